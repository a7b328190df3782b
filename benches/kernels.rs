//! `cargo bench --bench kernels [-- --model NAME|PATH] [-- --rows 1,8] [-- --only Q5_0,Q8_0]`: every distinct
//! (dtype, shape) of a model's linear layers, timed side by side in one run: the invariant
//! kernel against Candle's own `QMatMul` (whatever it dispatches for that row count, repacked
//! tiles included) and against Candle's single-row dot product run for every element (the
//! fixed-order baseline), at each row count, and the weight bytes each call reads per second
//! (a decode step is bandwidth-bound at one row). Rounds alternate and each side keeps its best.
//!
//! Those timings repeat one matrix, so a shape that fits the caches measures compute alone.
//! The `cold` columns run the invariant kernel over every layer's matrix of the shape in turn,
//! as a decode step does, and give the time per call and the rate it reads the weights at:
//! where the shape's matrices together exceed the caches, that is the rate from memory.
//! On a host with a wider kernel tier than AVX2 (`kernels::Isa`), `vs avx2` times the
//! invariant kernel capped at AVX2 in the same rounds (the tiers give the same bits).
//! The last columns time the `canonical` mode's kernel (packed as `canonical` mode packs, in
//! the same rounds), its time over the invariant kernel's, and its cold rate.
use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_gate::dispatch::Kernel;
use candle_gate::gguf::GgufFile;
use candle_gate::huge_pages::WeightArena;
use candle_gate::kernels::{isa, set_isa, Isa};
use candle_gate::{registry, Mode, Policy, QMatMul, WeightLayout};
use rayon::prelude::*;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// Median seconds per call over enough calls to fill ~0.1 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-6);
    let reps = ((0.1 / once) as usize).clamp(3, 100);
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[reps / 2]
}

/// The weights `names` as a model's loader lays them out for `policy`'s mode: side by side in
/// huge pages (`huge_pages::WeightArena`), what the cold columns stream.
fn in_arena(f: &mut GgufFile, names: &[String], policy: &std::sync::Arc<Policy>) -> Vec<QMatMul> {
    let (arena, layout) = (WeightArena::new(), WeightLayout::for_mode(policy.mode));
    names
        .iter()
        .map(|nm| {
            QMatMul::laid_out_in(std::sync::Arc::new(f.tensor(nm).unwrap()), layout, policy.clone(), Some(&arena))
                .unwrap()
        })
        .collect()
}

/// Candle's single-row dot product (`GgmlType::vec_dot`, what its GEMV runs when it does not
/// repack) for every (row, column), columns split over rayon as our kernels are: the baseline
/// for kernels that must keep a fixed per-element order.
fn vec_dot_rows<T: GgmlType + Sync>(w: &QTensor, x: &[f32], m: usize, k: usize, n: usize) -> Vec<f32>
where
    T::VecDotType: Sync,
{
    let data = w.data().unwrap();
    // SAFETY: Candle's own CPU storage of a `T` tensor is a whole, aligned array of `T`.
    let wb = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const T, data.len() / std::mem::size_of::<T>()) };
    let kb = k / T::BLCK_SIZE;
    let mut xq = vec![T::VecDotType::zeros(); m * kb];
    for r in 0..m {
        T::VecDotType::from_float(&x[r * k..(r + 1) * k], &mut xq[r * kb..(r + 1) * kb]);
    }
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(n).enumerate().for_each(|(r, o)| {
        o.par_iter_mut()
            .enumerate()
            .for_each(|(c, v)| *v = T::vec_dot(k, &wb[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb]));
    });
    out
}

fn vec_dot_baseline(w: &QTensor, x: &[f32], m: usize, k: usize, n: usize) -> Option<Vec<f32>> {
    Some(match w.dtype() {
        GgmlDType::Q4K => vec_dot_rows::<BlockQ4K>(w, x, m, k, n),
        GgmlDType::Q6K => vec_dot_rows::<BlockQ6K>(w, x, m, k, n),
        GgmlDType::Q5_0 => vec_dot_rows::<BlockQ5_0>(w, x, m, k, n),
        GgmlDType::Q8_0 => vec_dot_rows::<BlockQ8_0>(w, x, m, k, n),
        GgmlDType::Q4_1 => vec_dot_rows::<BlockQ4_1>(w, x, m, k, n),
        _ => return None,
    })
}

fn main() {
    // On a pool worker, as `Decoder::forward` runs: called from outside, each parallel kernel
    // would park this thread and add a wake-up to every call.
    rayon::scope(|_| run());
}

fn run() {
    let args: Vec<String> = std::env::args().collect();
    let model = arg(&args, "--model").unwrap_or_else(|| registry::DEFAULT_MODEL.into());
    let rows: Vec<usize> =
        arg(&args, "--rows").unwrap_or_else(|| "1,8".into()).split(',').map(|r| r.parse().unwrap()).collect();
    // Only these dtypes (as printed, e.g. `Q5_0,Q4K`): a kernel's own shapes, quickly.
    let only: Option<Vec<String>> = arg(&args, "--only").map(|o| o.split(',').map(|d| d.trim().to_string()).collect());
    let path = registry::resolve(&model).expect("fetch the model first (`candle-gate fetch --model ...`)");
    let mut f = GgufFile::open(&path).expect("cannot open the model");
    // One representative tensor per (dtype, shape), and how many layers use it.
    let mut kinds: BTreeMap<(String, usize, usize), Vec<String>> = BTreeMap::new();
    let names: Vec<String> = f.content.tensor_infos.keys().cloned().collect();
    // The embedding is a matmul only where it is also the output matrix (tied, as in SmolLM2,
    // Qwen 0.5B and Gemma), and there the largest of a decode step.
    let tied = !names.iter().any(|n| n == "output.weight");
    for name in names {
        let info = &f.content.tensor_infos[&name];
        let dims = info.shape.dims().to_vec();
        if dims.len() != 2 || (name == "token_embd.weight" && !tied) {
            continue;
        }
        let key = (format!("{:?}", info.ggml_dtype), dims[0], dims[1]);
        if only.as_ref().is_some_and(|o| !o.contains(&key.0)) {
            continue;
        }
        kinds.entry(key).or_default().push(name.clone());
    }
    if kinds.is_empty() {
        eprintln!("no linear layer of {model} has a dtype in --only {:?}", only.unwrap_or_default());
        std::process::exit(2);
    }
    let tier = isa();
    println!("model {model}: {}", path.display());
    println!("invariant kernels' tier: {} (CANDLE_GATE_ISA caps it)", tier.name());
    println!(
        "{:<6} {:>7} {:>6} {:>5} {:>4} {:>11} {:>11} {:>8} {:>11} {:>8} {:>9} {:>11} {:>9} {:>8} {:>11} {:>8} {:>9}",
        "dtype",
        "n",
        "k",
        "count",
        "rows",
        "invariant",
        "QMatMul",
        "ratio",
        "vec_dot",
        "ratio",
        "GB/s inv",
        "inv cold",
        "GB/s cold",
        "vs avx2",
        "canonical",
        "vs inv",
        "GB/s can"
    );
    let canonical_policy = std::sync::Arc::new(Policy::new(Mode::Canonical));
    for ((dtype, n, k), names) in kinds {
        let (name, count) = (names[0].clone(), names.len());
        let layers = in_arena(&mut f, &names, &std::sync::Arc::new(Policy::default()));
        let t = f.tensor(&name).unwrap();
        let bytes = t.storage_size_in_bytes() as f64;
        let ours = QMatMul::from_qtensor(t).unwrap();
        let candle = candle_core::quantized::QMatMul::from_qtensor(f.tensor(&name).unwrap()).unwrap();
        let canon = QMatMul::new(std::sync::Arc::new(f.tensor(&name).unwrap()), canonical_policy.clone()).unwrap();
        let canon_layers = in_arena(&mut f, &names, &canonical_policy);
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
            let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap();
            // Alternating rounds, each side's best: a busy machine slows both, not one.
            let (mut ti, mut tc, mut tv, mut ta) = (f64::INFINITY, f64::INFINITY, f64::INFINITY, f64::INFINITY);
            let mut tk = f64::INFINITY;
            let raw = f.tensor(&name).unwrap();
            for _ in 0..3 {
                tv = tv.min(time(|| {
                    std::hint::black_box(vec_dot_baseline(&raw, &x, m, k, n));
                }));
                ti = ti.min(time(|| {
                    std::hint::black_box(ours.run_cpu(Kernel::Invariant, &x, m).unwrap());
                }));
                tc = tc.min(time(|| {
                    std::hint::black_box(candle.forward(&xt).unwrap());
                }));
                tk = tk.min(time(|| {
                    std::hint::black_box(canon.run_cpu(Kernel::Canonical, &x, m).unwrap());
                }));
                if tier > Isa::Avx2 {
                    set_isa(Isa::Avx2);
                    ta = ta.min(time(|| {
                        std::hint::black_box(ours.run_cpu(Kernel::Invariant, &x, m).unwrap());
                    }));
                    set_isa(tier);
                }
            }
            let cold = time(|| {
                for l in &layers {
                    std::hint::black_box(l.run_cpu(Kernel::Invariant, &x, m).unwrap());
                }
            }) / count as f64;
            let canon_cold = time(|| {
                for l in &canon_layers {
                    std::hint::black_box(l.run_cpu(Kernel::Canonical, &x, m).unwrap());
                }
            }) / count as f64;
            let vs_avx2 = if ta.is_finite() { format!("{:.2}x", ta / ti) } else { "-".into() };
            println!(
                "{dtype:<6} {n:>7} {k:>6} {count:>5} {m:>4} {:>9.3}ms {:>9.3}ms {:>7.2}x {:>9.3}ms {:>7.2}x {:>9.1} {:>9.3}ms {:>9.1} {vs_avx2:>8} {:>9.3}ms {:>7.2}x {:>9.1}",
                ti * 1e3,
                tc * 1e3,
                tc / ti,
                tv * 1e3,
                tv / ti,
                bytes / ti / 1e9,
                cold * 1e3,
                bytes / cold / 1e9,
                tk * 1e3,
                tk / ti,
                bytes / canon_cold / 1e9
            );
        }
    }
}
