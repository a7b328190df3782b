//! Differential kernel tests in the manner of llama.cpp's `test-backend-ops`: every kernel
//! pair that is supposed to agree is compared over dtypes, shapes (the default model's, plus
//! odd ones) and row counts — bitwise where the claim is bitwise.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_gate::dispatch::{dtype_name, Backend};
use candle_gate::kernels::cpu::SUPPORTED;
use candle_gate::profile::Profile;
use candle_gate::*;

fn is_k_quant(d: GgmlDType) -> bool {
    matches!(d, GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K | GgmlDType::Q8K)
}

/// (n, k) shapes for a dtype: the default model's shapes where k fits the block size, and odd
/// output counts that exercise the 1..3 leftover columns after the column quads.
fn shapes(d: GgmlDType) -> Vec<(usize, usize)> {
    if is_k_quant(d) {
        // The Qwen2.5 shapes: 0.5B ffn_down [896, 4864]; 1.5B k_proj [256, 1536], ffn_down's k (8960).
        vec![(576, 768), (192, 512), (37, 256), (130, 1536), (3, 256), (896, 4864), (256, 1536), (64, 8960)]
    } else {
        // SmolLM2's shapes and Qwen2.5 0.5B's ([896, 896], k/v [128, 896], ffn [4864, 896]).
        vec![
            (576, 576),
            (192, 576),
            (1536, 576),
            (576, 1536),
            (37, 64),
            (131, 96),
            (1, 32),
            (6, 576),
            (896, 896),
            (128, 896),
            (4864, 896),
        ]
    }
}

fn weight(d: GgmlDType, n: usize, k: usize, seed: u64) -> QMatMul {
    let w = pseudo_random(n * k, seed);
    let w = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, d).unwrap();
    QMatMul::new(Arc::new(q), Arc::new(Policy::default())).unwrap()
}

/// Deterministic inputs without an RNG dependency; a few large values so quantization scales
/// vary between blocks.
fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 0 {
                u * 8.0
            } else {
                u
            }
        })
        .collect()
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `check(dtype, n, k, weight, x, rows)` for every dtype, shape and row count, with weights and
/// activations drawn from the given seeds.
fn every_case(seeds: (u64, u64), check: impl Fn(GgmlDType, usize, usize, &QMatMul, &[f32], usize)) {
    for d in SUPPORTED {
        for (n, k) in shapes(d) {
            let w = weight(d, n, k, seeds.0 + n as u64);
            let x = pseudo_random(64 * k, seeds.1 + k as u64);
            for m in rows_for(n) {
                check(d, n, k, &w, &x[..m * k], m);
            }
        }
    }
}

fn rows_for(n: usize) -> Vec<usize> {
    if n >= 1024 {
        vec![1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64]
    } else {
        (1..=64).collect()
    }
}

/// Every instruction-set tier the kernels can pick at run time, forced one after another on
/// this host, gives the portable tier's bits: over every dtype, shape and row count, so both
/// the one-row (columns in lanes) and the multi-row (rows in lanes) paths of each tier run.
#[test]
fn every_isa_tier_gives_the_portable_bits() {
    use candle_gate::kernels::{set_isa, Isa};
    let tiers = Isa::available();
    // Printed, not skipped silently: a host without AVX-512 VNNI compares the tiers it has.
    eprintln!("kernel tiers on this host: {:?} (of Portable, Avx2, Avx512)", tiers);
    every_case((11, 5), |d, n, k, w, x, m| {
        let run = |isa| {
            assert_eq!(set_isa(isa), isa);
            w.run_cpu(Kernel::Invariant, x, m).unwrap()
        };
        let portable = run(Isa::Portable);
        for &isa in &tiers[1..] {
            assert!(bits_equal(&run(isa), &portable), "{d:?} [{n},{k}] m={m}: {isa:?} != Portable");
        }
    });
    set_isa(Isa::best());
}

/// Weights packed for the sixteen-column kernels (`QMatMul::with_packing`: Q4_K, Q6_K, Q4_1, Q5_0)
/// give the GGUF layout's bits at every row count, on every kernel tier this host has (tiers
/// without AVX-512 unpack a copy), and `weight()` gives back the GGUF bytes. Shapes whose
/// columns are not whole groups of sixteen stay unpacked.
#[test]
fn packed_weights_give_the_gguf_layouts_bits() {
    use candle_gate::kernels::{set_isa, Isa};
    let policy = Arc::new(Policy::default());
    let packs = |d| matches!(d, GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q4_1 | GgmlDType::Q5_0);
    for d in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q4_1, GgmlDType::Q5_0] {
        for (n, k) in shapes(d) {
            let w = pseudo_random(n * k, 3 + n as u64);
            let q = Arc::new(QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), d).unwrap());
            let plain = QMatMul::with_packing(q.clone(), WeightLayout::Invariant, policy.clone(), false).unwrap();
            let packed = QMatMul::with_packing(q.clone(), WeightLayout::Invariant, policy.clone(), true).unwrap();
            assert_eq!(packed.is_packed(), packs(d) && n % 16 == 0, "{d:?} [{n},{k}]");
            for rows in [0..n, 0..1, n / 2..n, n / 3..n / 3 + 1, n - 1..n] {
                let (got, want) =
                    (packed.dequantize_rows(rows.clone()).unwrap(), plain.dequantize_rows(rows.clone()).unwrap());
                assert!(bits_equal(&got, &want), "{d:?} [{n},{k}] rows {rows:?}: dequantized");
            }
            assert_eq!(packed.weight().data().unwrap(), q.data().unwrap(), "{d:?} [{n},{k}]: unpacked bytes");
            let x = pseudo_random(64 * k, 9 + k as u64);
            for isa in Isa::available() {
                assert_eq!(set_isa(isa), isa);
                for m in rows_for(n) {
                    let want = plain.run_cpu(Kernel::Invariant, &x[..m * k], m).unwrap();
                    let got = packed.run_cpu(Kernel::Invariant, &x[..m * k], m).unwrap();
                    assert!(bits_equal(&got, &want), "{d:?} [{n},{k}] m={m} {isa:?}: packed != GGUF layout");
                    let mut into = Vec::new();
                    packed.forward_rows_into(&policy, &x[..m * k], m, &mut into).unwrap();
                    assert!(bits_equal(&into, &want), "{d:?} [{n},{k}] m={m} {isa:?}: forward_rows_into");
                }
            }
            set_isa(Isa::best());
        }
    }
}

#[test]
fn invariant_equals_gemv_bitwise_all_dtypes_shapes_rows() {
    every_case((7, 99), |d, n, k, w, x, m| {
        let a = w.run_cpu(Kernel::Invariant, x, m).unwrap();
        let b = w.run_cpu(Kernel::GemvRowSplit, x, m).unwrap();
        assert!(bits_equal(&a, &b), "{d:?} [{n},{k}] m={m}: invariant != gemv");
    });
}

#[test]
fn row_split_equals_concatenated_single_rows() {
    for d in SUPPORTED {
        let (n, k) = shapes(d)[1];
        let w = weight(d, n, k, 3);
        let policy = Arc::new(Policy { default_row_split_max: 64, ..Policy::new(Mode::RowSplit) });
        let w = w.with_policy(policy);
        let x = pseudo_random(64 * k, 5);
        for m in [1, 2, 3, 4, 5, 8, 17, 64] {
            let xs = Tensor::from_slice(&x[..m * k], (m, k), &Device::Cpu).unwrap();
            let y: Vec<f32> = w.forward(&xs).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let mut cat = Vec::new();
            for r in 0..m {
                cat.extend(w.run_cpu(Kernel::GemvRowSplit, &x[r * k..(r + 1) * k], 1).unwrap());
            }
            assert!(bits_equal(&y, &cat), "{d:?} m={m}: row_split != concatenated single rows");
        }
    }
}

/// Our single-row kernel is Candle's own single-row path wherever Candle does not repack the
/// weights (on x86, Candle repacks Q4K always, and Q8_0 on VNNI machines) and candle-gate does
/// not define its own order (Q4K and Q6K: `kernels::cpu_kquant`).
#[test]
fn gemv_equals_candle_single_row() {
    for d in SUPPORTED {
        if matches!(d, GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0 | GgmlDType::F32 | GgmlDType::F16) {
            continue;
        }
        for (n, k) in shapes(d) {
            let w = weight(d, n, k, 11);
            let x = pseudo_random(k, 12);
            let a = w.run_cpu(Kernel::Candle, &x, 1).unwrap();
            let b = w.run_cpu(Kernel::GemvRowSplit, &x, 1).unwrap();
            assert!(bits_equal(&a, &b), "{d:?} [{n},{k}]: gemv != Candle's own single-row QMatMul");
        }
    }
}

#[test]
fn gemm_agrees_within_tolerance_but_not_bitwise() {
    let mut differs = 0;
    for d in SUPPORTED {
        for (n, k) in shapes(d).into_iter().take(3) {
            let w = weight(d, n, k, 21);
            let x = pseudo_random(16 * k, 22);
            for m in [1, 2, 4, 5, 8, 16] {
                let x = &x[..m * k];
                let g = w.run_cpu(Kernel::Gemm, x, m).unwrap();
                let v = w.run_cpu(Kernel::GemvRowSplit, x, m).unwrap();
                let scale = v.iter().fold(1e-6f32, |a, &b| a.max(b.abs()));
                let err = g.iter().zip(&v).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                // gemv quantizes activations to 8 bits per block (as llama.cpp does); gemm
                // does not: they differ by the activation quantization error, a few percent.
                assert!(err <= 0.05 * scale, "{d:?} [{n},{k}] m={m}: gemm vs gemv error {err} > 5% of {scale}");
                if !bits_equal(&g, &v) {
                    differs += 1;
                }
            }
        }
    }
    assert!(differs > 0, "gemm was bitwise equal to gemv everywhere: the problem would not exist");
}

/// The invariant kernel gives row 0 the same bits at every row count. (How the dense GEMM's bits
/// move with the row count depends on the host: the `gemm` crate picks its micro-kernel and k
/// blocking at run time. It is printed, not asserted; the tests that need a lane whose bits
/// follow the row count use `split_k_f16`, where that is a property of our code.)
#[test]
fn invariant_row_bits_do_not_depend_on_row_count() {
    let (n, k) = (1536, 576);
    let w = weight(GgmlDType::Q4_1, n, k, 31);
    let x = pseudo_random(64 * k, 32);
    let gemm_alone = w.run_cpu(Kernel::Gemm, &x[..k], 1).unwrap();
    let inv1 = w.run_cpu(Kernel::Invariant, &x[..k], 1).unwrap();
    let mut gemm_changed = vec![];
    for m in [2, 3, 4, 5, 8, 16, 32, 64] {
        if !bits_equal(&w.run_cpu(Kernel::Gemm, &x[..m * k], m).unwrap()[..n], &gemm_alone) {
            gemm_changed.push(m);
        }
        let inv = w.run_cpu(Kernel::Invariant, &x[..m * k], m).unwrap();
        assert!(bits_equal(&inv[..n], &inv1), "invariant row 0 changed at m={m}");
    }
    eprintln!("on this host, gemm row 0 changed bits at row counts {gemm_changed:?}");
}

/// The exact f64 product of f16-rounded operands (the weight dequantized by Candle, both rounded
/// by `half`), with the sum of |products| for the accumulation bound.
fn f16_products(x: &[f32], wd: &[f32], k: usize, r: usize, j: usize) -> (f64, f64) {
    let r16 = |v: f32| half::f16::from_f32(v).to_f32() as f64;
    (0..k).map(|i| r16(x[r * k + i]) * r16(wd[j * k + i])).fold((0f64, 0f64), |(s, a), p| (s + p, a + p.abs()))
}

/// `got` is an f16 value within one f16 ulp (plus F32 accumulation error where the sum cancels)
/// of the exact product.
fn assert_f16_result(got: f32, exact: f64, mag: f64, what: &str) {
    use half::f16;
    assert_eq!(got, f16::from_f32(got).to_f32(), "{what}: {got} is not an f16 value");
    let h = f16::from_f32(exact as f32);
    let ulp = (f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()).abs();
    let tol = ulp as f64 + 1e-5 * mag;
    assert!(((got as f64) - exact).abs() <= tol, "{what}: {got} vs exact {exact} (tol {tol})");
}

/// gemm_f16 is "f16 operands, F32 accumulation, f16 results". (Whether its bits move with the
/// row count is the host's business, as for `gemm`.)
#[test]
fn gemm_f16_is_f16_operands_f32_accumulation_f16_results() {
    let (n, k) = (1536, 576);
    let w = weight(GgmlDType::Q4_1, n, k, 41);
    let wd: Vec<f32> = w.dense_f32().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let x = pseudo_random(16 * k, 42);
    for m in [1, 2, 3, 4, 8, 16] {
        let y = w.run_cpu(Kernel::GemmF16, &x[..m * k], m).unwrap();
        for r in 0..m {
            for j in 0..n {
                let (exact, mag) = f16_products(&x, &wd, k, r, j);
                assert_f16_result(y[r * n + j], exact, mag, &format!("gemm_f16 m={m} [{r},{j}]"));
            }
        }
    }
}

/// split_k_f16: a row among 2, 5, 8 and 17 rows gets different bits than alone (each row count
/// splits k differently), every value within the f16 rounding bound of the exact product of its
/// f16 operands, over dtypes and shapes (odd n for the column tails, k not a multiple of 8).
/// A chunking difference moves an output only when it crosses an f16 rounding boundary (about
/// one output in two thousand here), so the differences are counted over every row of the call.
#[test]
fn split_k_f16_bits_follow_the_row_count_and_agree_with_f64() {
    for (d, n, k) in [
        (GgmlDType::Q4_1, 4096, 576),
        (GgmlDType::Q8_0, 577, 1536),
        (GgmlDType::Q6K, 131, 768),
        (GgmlDType::F32, 37, 100),
    ] {
        let w = weight(d, n, k, 61);
        let wd: Vec<f32> = w.dense_f32().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let x = pseudo_random(17 * k, 62);
        let alone: Vec<f32> =
            (0..17).flat_map(|r| w.run_cpu(Kernel::SplitKF16, &x[r * k..(r + 1) * k], 1).unwrap()).collect();
        let mut moved = vec![];
        for m in [2, 5, 8, 17] {
            let y = w.run_cpu(Kernel::SplitKF16, &x[..m * k], m).unwrap();
            for r in 0..m {
                for j in 0..n {
                    let (exact, mag) = f16_products(&x, &wd, k, r, j);
                    assert_f16_result(y[r * n + j], exact, mag, &format!("split_k_f16 {d:?} m={m} [{r},{j}]"));
                }
            }
            moved.push(y.iter().zip(&alone).filter(|(a, b)| a.to_bits() != b.to_bits()).count());
            // The same call again gives the same bits.
            assert!(bits_equal(&y, &w.run_cpu(Kernel::SplitKF16, &x[..m * k], m).unwrap()));
        }
        eprintln!("split_k_f16 {d:?} [{n},{k}]: outputs that differ from alone at m = 2, 5, 8, 17: {moved:?}");
        if n * 2 >= 4096 {
            assert!(
                moved.iter().all(|&c| c > 0),
                "{d:?} [{n},{k}]: some row count gave every row its alone bits: {moved:?}"
            );
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let w = weight(GgmlDType::Q4_1, 64, 64, 1);
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let x = Tensor::zeros((3, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(err(w.forward(&x)).contains("inner dimension mismatch"));
    let x = Tensor::zeros(64, candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(err(w.forward(&x)).contains("rank"));
    let x = Tensor::zeros((64, 4), candle_core::DType::F32, &Device::Cpu).unwrap().t().unwrap();
    assert!(err(w.forward(&x)).contains("not contiguous"));
    let x = Tensor::zeros((0, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(err(w.forward(&x)).contains("zero rows"));
    assert!(w.run_cpu(Kernel::Invariant, &[0.0; 10], 1).unwrap_err().to_string().contains("expected 1 rows"));
    assert!(w.run_cpu(Kernel::Invariant, &[], 0).unwrap_err().to_string().contains("zero rows"));
    let bf =
        QTensor::quantize(&Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::BF16)
            .unwrap();
    let g = QMatMul::from_qtensor(bf).unwrap();
    assert!(g.run_cpu(Kernel::Invariant, &[0.0; 32], 1).unwrap_err().to_string().contains("no CPU kernel"));
    let r1 =
        QTensor::quantize(&Tensor::zeros(32, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    assert!(QMatMul::from_qtensor(r1).unwrap_err().to_string().contains("rank 2"));
}

#[test]
fn profiles_load_and_refuse_bad_files() {
    let dir = std::env::temp_dir().join(format!("cg-prof-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = Profile::load(&dir.join("nope.json")).unwrap_err().to_string();
    assert!(missing.contains("cannot read"), "{missing}");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    assert!(Profile::load(&bad).unwrap_err().to_string().contains("not a candle-gate profile"));
    let good = dir.join("good.json");
    std::fs::write(
        &good,
        r#"{"backend": "cuda", "created": "x", "dtypes": {"q4_1": {"row_split_max": 6, "crossover_rows": 7, "table": []}}}"#,
    )
    .unwrap();
    let p = Profile::load(&good).unwrap();
    assert!(p
        .policy(Backend::Cpu, Mode::RowSplit, "good.json")
        .unwrap_err()
        .to_string()
        .contains("measured on backend"));
    let pol = p.policy(Backend::Cuda, Mode::RowSplit, "good.json").unwrap();
    assert_eq!(pol.row_split_max(Backend::Cuda, GgmlDType::Q4_1), 6);
    assert_eq!(pol.row_split_max(Backend::Cuda, GgmlDType::Q8_0), 4);
    assert_eq!(dtype_name(GgmlDType::Q4_1), "q4_1");
    std::fs::remove_dir_all(&dir).ok();
}

/// One gate calibration per mode and model: merging replaces that entry only, moves an older
/// single `gate` into `gates`, and the lookup takes the entry for the engine's lane.
#[test]
fn gate_calibrations_are_kept_and_found_per_mode_and_model() {
    use candle_gate::engine::{GateConfig, GateMode};
    let dir = std::env::temp_dir().join(format!("cg-gates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("p.json");
    std::fs::write(
        &path,
        r#"{"backend": "cpu", "created": "x", "note": "kept", "gate": {"tau": 0.5, "mode": "gemm"}}"#,
    )
    .unwrap();
    let entry = |tau: f32, mode: &str, sha: &str| serde_json::json!({"tau": tau, "mode": mode, "model": "m.gguf", "model_sha256": sha});
    Profile::merge_gate(&path, entry(0.1, "native", "aa")).unwrap();
    Profile::merge_gate(&path, entry(0.2, "native", "bb")).unwrap();
    let v = Profile::merge_gate(&path, entry(0.3, "native", "aa")).unwrap();
    assert_eq!(v["note"], "kept");
    assert!(v.get("gate").is_none());
    let p = Profile::load(&path).unwrap();
    let taus: Vec<f32> = p.gate_calibrations().map(|g| g.tau).collect();
    assert_eq!(taus, [0.5, 0.2, 0.3]);
    assert_eq!(p.gate_for(Mode::Native, "AA").unwrap().tau, 0.3);
    assert_eq!(p.gate_for(Mode::Native, "bb").unwrap().tau, 0.2);
    assert_eq!(p.gate_for(Mode::Gemm, "cc").unwrap().tau, 0.5); // no model in the old entry: any model
    assert!(p.gate_for(Mode::Native, "cc").is_none());
    assert!(p.gate_for(Mode::Invariant, "aa").is_none());

    let empty = Profile::empty(Backend::Cpu);
    let profiles = [(&empty, "empty.json"), (&p, "p.json")];
    let (cfg, source) =
        GateConfig::resolve(GateMode::Gated, None, None, &profiles, Some((Mode::Native, "bb"))).unwrap();
    assert_eq!((cfg.tau, source.as_deref()), (0.2, Some("p.json (m.gguf/native)")));
    let err = GateConfig::resolve(GateMode::Gated, None, None, &profiles, Some((Mode::Native, "cc")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("in mode native")
            && err.contains("empty.json has none")
            && err.contains("p.json has any model/gemm, m.gguf/native"),
        "{err}"
    );
    // a given tau needs no calibration; neither does a gate that never rechecks by margin
    assert!(GateConfig::resolve(GateMode::Gated, Some(0.7), None, &[], None).unwrap().1.is_none());
    assert!(GateConfig::resolve(GateMode::Off, None, None, &[], None).is_ok());
    std::fs::write(&path, "[1]").unwrap();
    assert!(Profile::merge_gate(&path, entry(0.1, "native", "aa"))
        .unwrap_err()
        .to_string()
        .contains("not overwriting"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Candle's own Q4_1, Q5_0 and Q8_0 CPU paths compute each element the same way at every row
/// count (Q8_0: where k is not a multiple of 256, so Candle never repacks it), and the invariant
/// kernels reproduce them bit for bit: SmolLM2's and Qwen 0.5B's layers give Candle's exact
/// numbers, only faster.
#[test]
fn q4_1_q5_0_q8_0_invariant_equal_candle_qmatmul_at_every_row_count() {
    for (d, n, k) in [
        (GgmlDType::Q4_1, 576, 576),
        (GgmlDType::Q4_1, 192, 576),
        (GgmlDType::Q4_1, 1536, 576),
        (GgmlDType::Q4_1, 576, 1536),
        (GgmlDType::Q4_1, 37, 64),
        (GgmlDType::Q5_0, 896, 896),
        (GgmlDType::Q5_0, 128, 896),
        (GgmlDType::Q5_0, 4864, 896),
        (GgmlDType::Q5_0, 131, 4864),
        (GgmlDType::Q5_0, 37, 64),
        (GgmlDType::Q8_0, 896, 896),
        (GgmlDType::Q8_0, 128, 896),
        (GgmlDType::Q8_0, 4099, 896),
        (GgmlDType::Q8_0, 37, 96),
        // Columns of 20, 15, 9 and 1 blocks: groups of eight, then the one-row kernel's last
        // group of 4, 7 or 1 blocks (or that group alone).
        (GgmlDType::Q8_0, 256, 640),
        (GgmlDType::Q8_0, 131, 480),
        (GgmlDType::Q8_0, 67, 288),
        (GgmlDType::Q8_0, 67, 32),
    ] {
        let w = weight(d, n, k, 41);
        let x = pseudo_random(64 * k, 42);
        for m in rows_for(n) {
            let a = w.run_cpu(Kernel::Invariant, &x[..m * k], m).unwrap();
            let b = w.run_cpu(Kernel::Candle, &x[..m * k], m).unwrap();
            assert!(bits_equal(&a, &b), "{d:?} [{n},{k}] m={m}");
        }
    }
}

/// The reference lane's matmul: a row's result is the same bits whatever other rows share the
/// call, and the same with a dense FP32 copy of the weight or block-by-block dequantization.
#[test]
fn reference_matmul_rows_are_independent_and_dense_equals_blockwise() {
    use candle_gate::reference::{matmul_rows, ReferenceWeights};
    for d in SUPPORTED {
        for (n, k) in shapes(d).into_iter().take(4) {
            let w = weight(d, n, k, 51);
            let x = pseudo_random(7 * k, 52);
            let single: Vec<Vec<f32>> =
                (0..7).map(|r| matmul_rows(&w, ReferenceWeights::Dense, &x[r * k..(r + 1) * k], 1).unwrap()).collect();
            for m in [2, 3, 7] {
                for how in [ReferenceWeights::Dense, ReferenceWeights::Blockwise] {
                    let y = matmul_rows(&w, how, &x[..m * k], m).unwrap();
                    for r in 0..m {
                        assert!(
                            bits_equal(&y[r * n..(r + 1) * n], &single[r]),
                            "{d:?} [{n},{k}] m={m} row {r} {how:?}"
                        );
                    }
                }
            }
        }
    }
}
