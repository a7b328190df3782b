//! The canonical order (`kernels::canonical`), CPU side: the CPU kernel equals the CUDA
//! kernel's per-thread loop run lane by lane, bit for bit, over dtypes, shapes (synthetic and
//! every model's real weights) and row counts; a row's bits never depend on the rows beside it;
//! and the order computes the right product (within quantization error of the dense one).
//! The GPU side of the same claims runs in `benches/cuda_check.sh` on a CUDA machine.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_gate::kernels::canonical::{self, emulate_warp, matmul, SUPPORTED};
use candle_gate::*;

const ROWS: [usize; 7] = [1, 2, 3, 5, 8, 9, 17];

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

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn synthetic(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
    let t = Tensor::from_vec(pseudo_random(n * k, seed), (n, k), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

/// The CPU kernel against the lane-by-lane emulation, every row count, and each row of the
/// batch against the same row alone.
fn check(label: &str, w: &QTensor, seed: u64) {
    let k = w.shape().dims()[1];
    let n = w.shape().dims()[0];
    let max_rows = *ROWS.iter().max().unwrap();
    let x = pseudo_random(max_rows * k, seed);
    let alone: Vec<Vec<f32>> = (0..max_rows).map(|r| matmul(w, &x[r * k..(r + 1) * k], 1).unwrap()).collect();
    for m in ROWS {
        let y = matmul(w, &x[..m * k], m).unwrap();
        assert_eq!(
            bits(&y),
            bits(&emulate_warp(w, &x[..m * k], m).unwrap()),
            "{label}: kernel != emulation at {m} rows"
        );
        for r in 0..m {
            assert_eq!(
                bits(&y[r * n..(r + 1) * n]),
                bits(&alone[r]),
                "{label}: row {r} of {m} differs from the row alone"
            );
        }
    }
}

#[test]
fn cpu_kernel_equals_the_warp_emulation_on_synthetic_weights() {
    for dtype in SUPPORTED {
        let k_quant = matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K);
        // k from one unit to past 32 units (lanes wrap), odd output counts.
        let shapes: &[(usize, usize)] = if k_quant {
            &[(3, 256), (37, 512), (5, 1280), (2, 8960)]
        } else {
            &[(1, 32), (37, 64), (5, 1056), (3, 2048), (7, 96)]
        };
        for &(n, k) in shapes {
            let w = synthetic(dtype, n, k, (n * k) as u64);
            check(&format!("{dtype:?} [{n}, {k}]"), &w, k as u64);
        }
    }
}

#[test]
fn cpu_kernel_equals_the_warp_emulation_on_every_models_weights() {
    let mut seen = 0;
    for known in registry::KNOWN {
        let path = registry::resolve(known.name).expect("run `candle-gate fetch --model all` first");
        for (name, w) in canonical::sample_weights(&path, 48).unwrap() {
            check(&format!("{} {name} {:?} {:?}", known.name, w.dtype(), w.shape().dims()), &w, 11);
            seen += 1;
        }
    }
    // SmolLM2: Q4_1, Q8_0; Qwen 0.5B: Q8_0, Q5_0, Q4_K, Q6_K; Qwen 1.5B: Q4_K, Q6_K (several shapes each).
    assert!(seen >= 12, "only {seen} weights sampled");
}

#[test]
fn canonical_order_computes_the_product() {
    for dtype in SUPPORTED {
        let (n, k) = (64, 1536);
        let w = synthetic(dtype, n, k, 5);
        let x = pseudo_random(3 * k, 9);
        let y = matmul(&w, &x, 3).unwrap();
        let dense = w.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for r in 0..3 {
            let xr = &x[r * k..(r + 1) * k];
            let norm: f32 = xr.iter().map(|v| v * v).sum::<f32>().sqrt();
            for c in 0..n {
                let want: f64 = (0..k).map(|i| dense[c * k + i] as f64 * xr[i] as f64).sum();
                let wnorm: f32 = dense[c * k..(c + 1) * k].iter().map(|v| v * v).sum::<f32>().sqrt();
                // Activations are quantized to 8 bits (dense types are not): the error is a few
                // parts in a thousand of |w|·|x| at most.
                let tol = if matches!(dtype, GgmlDType::F32 | GgmlDType::F16) { 1e-5 } else { 8e-3 };
                let got = y[r * n + c] as f64;
                assert!(
                    (got - want).abs() <= tol * (wnorm * norm) as f64,
                    "{dtype:?} row {r} col {c}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn canonical_mode_runs_the_canonical_kernel_and_the_reference_order() {
    let policy = Arc::new(Policy::new(Mode::Canonical));
    let w = synthetic(GgmlDType::Q4K, 40, 512, 3);
    let x = pseudo_random(5 * 512, 4);
    let want = matmul(&w, &x, 5).unwrap();
    let qm = QMatMul::new(Arc::new(w), policy.clone()).unwrap();
    assert_eq!(bits(&qm.forward_rows(&policy, &x, 5).unwrap()), bits(&want));
    let xs = Tensor::from_vec(x.clone(), (5, 512), &Device::Cpu).unwrap();
    let y = qm.forward(&xs).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&y), bits(&want));
    // The reference matmul: the dense order over the dequantized weight, any row count.
    let r5 = qm.forward_reference(&xs).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let r1 =
        qm.forward_reference(&xs.narrow(0, 3, 1).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&r5[3 * 40..4 * 40]), bits(&r1));
    let dense = QTensor::quantize(qm.dense_f32().unwrap(), GgmlDType::F32).unwrap();
    assert_eq!(bits(&r5), bits(&emulate_warp(&dense, &x, 5).unwrap()));
}

#[test]
fn canonical_mode_refuses_dtypes_it_has_no_order_for() {
    let policy = Arc::new(Policy::new(Mode::Canonical));
    let qm = QMatMul::new(Arc::new(synthetic(GgmlDType::Q5K, 4, 256, 1)), policy.clone()).unwrap();
    let err = qm.forward_rows(&policy, &pseudo_random(256, 2), 1).unwrap_err().to_string();
    assert!(err.contains("canonical") && err.contains("Q5K"), "{err}");
}

// The tiled CUDA kernel (`canonical_tile`), run thread by thread (`canonical_emulate`): every
// tile, every row count, equal to the CPU kernel bit for bit. This is what lets the host pick
// the tile by row count.

use candle_gate::kernels::canonical_emulate::{emulate_mma, emulate_tile, tile_for_rows, TILES, TILE_DTYPES};

/// `emulate_tile` with every tile and `emulate_mma` (the tensor-core kernel) at each of `rows`,
/// and with the host's tile at every row count in `1..=max`, against the first rows of the CPU
/// kernel's `reference` (itself row-invariant).
fn check_tiles(label: &str, w: &QTensor, x: &[f32], reference: &[f32], rows: &[usize], max: usize) {
    let (n, k) = (w.shape().dims()[0], w.shape().dims()[1]);
    for &m in rows {
        for tile in TILES {
            let y = emulate_tile(w, &x[..m * k], m, tile).unwrap();
            assert_eq!(bits(&y), bits(&reference[..m * n]), "{label}: tile {tile:?} at {m} rows");
        }
        let y = emulate_mma(w, &x[..m * k], m).unwrap();
        assert_eq!(bits(&y), bits(&reference[..m * n]), "{label}: tensor-core kernel at {m} rows");
    }
    for m in 1..=max {
        if let Some(tile) = tile_for_rows(m) {
            let y = emulate_tile(w, &x[..m * k], m, tile).unwrap();
            assert_eq!(bits(&y), bits(&reference[..m * n]), "{label}: host tile {tile:?} at {m} rows");
        }
    }
}

#[test]
fn tiled_kernel_emulation_equals_the_cpu_kernel_on_synthetic_weights() {
    const MAX: usize = 70;
    for dtype in TILE_DTYPES {
        let k_quant = matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K);
        // k below, at and past a chunk of 32 units (1024 values), not a multiple of it; n past
        // a block's 16 columns and not a multiple of 4.
        let shapes: &[(usize, usize)] = if k_quant {
            &[(37, 256), (21, 1536), (9, 4864), (6, 8960)]
        } else {
            &[(37, 32), (37, 576), (21, 896), (9, 1536), (6, 4864)]
        };
        for &(n, k) in shapes {
            let w = synthetic(dtype, n, k, (n * k) as u64 + 1);
            let x = pseudo_random(MAX * k, k as u64 + 3);
            let reference = matmul(&w, &x, MAX).unwrap();
            // The CPU kernel at fewer rows is the same rows (row invariance, checked above too).
            assert_eq!(bits(&matmul(&w, &x[..7 * k], 7).unwrap()), bits(&reference[..7 * n]));
            check_tiles(&format!("{dtype:?} [{n}, {k}]"), &w, &x, &reference, &[1, 3, 17, 33, MAX], MAX);
        }
    }
}

#[test]
fn tiled_kernel_emulation_equals_the_cpu_kernel_at_hundreds_of_rows() {
    for dtype in TILE_DTYPES {
        let k = if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) { 1536 } else { 896 };
        let n = 18;
        let w = synthetic(dtype, n, k, 77);
        let x = pseudo_random(512 * k, 78);
        let reference = matmul(&w, &x, 512).unwrap();
        for m in [128, 200, 256, 512] {
            for tile in TILES.into_iter().filter(|t| t.rows >= 8).chain(tile_for_rows(m)) {
                let y = emulate_tile(&w, &x[..m * k], m, tile).unwrap();
                assert_eq!(bits(&y), bits(&reference[..m * n]), "{dtype:?} tile {tile:?} at {m} rows");
            }
            let y = emulate_mma(&w, &x[..m * k], m).unwrap();
            assert_eq!(bits(&y), bits(&reference[..m * n]), "{dtype:?} tensor-core kernel at {m} rows");
        }
    }
}

#[test]
fn tiled_kernel_emulation_equals_the_cpu_kernel_on_every_models_weights() {
    const MAX: usize = 40;
    let mut seen = 0;
    for known in registry::KNOWN {
        let path = registry::resolve(known.name).expect("run `candle-gate fetch --model all` first");
        for (name, w) in canonical::sample_weights(&path, 40).unwrap() {
            if !TILE_DTYPES.contains(&w.dtype()) {
                continue;
            }
            let k = w.shape().dims()[1];
            let x = pseudo_random(MAX * k, 13);
            let reference = matmul(&w, &x, MAX).unwrap();
            let label = format!("{} {name} {:?} {:?}", known.name, w.dtype(), w.shape().dims());
            check_tiles(&label, &w, &x, &reference, &[1, 5, MAX], 18);
            seen += 1;
        }
    }
    assert!(seen >= 12, "only {seen} weights sampled");
}
