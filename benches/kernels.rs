//! `cargo bench --bench kernels [-- --model NAME|PATH] [-- --rows 1,8]`: every distinct
//! (dtype, shape) of a model's linear layers, timed side by side in one run: the invariant
//! kernel against Candle's own `QMatMul` at each row count, and the weight bytes each call
//! reads per second (a decode step is bandwidth-bound at one row).
use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{Device, Module, Tensor};
use candle_gate::dispatch::Kernel;
use candle_gate::gguf::GgufFile;
use candle_gate::{registry, QMatMul};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// Median seconds per call over enough calls to fill ~0.3 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-6);
    let reps = ((0.3 / once) as usize).clamp(3, 200);
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = arg(&args, "--model").unwrap_or_else(|| registry::DEFAULT_MODEL.into());
    let rows: Vec<usize> = arg(&args, "--rows").unwrap_or_else(|| "1,8".into()).split(',').map(|r| r.parse().unwrap()).collect();
    let path = registry::resolve(&model).expect("fetch the model first (`candle-gate fetch --model ...`)");
    let mut f = GgufFile::open(&path).expect("cannot open the model");
    // One representative tensor per (dtype, shape), and how many layers use it.
    let mut kinds: BTreeMap<(String, usize, usize), (String, usize)> = BTreeMap::new();
    let names: Vec<String> = f.content.tensor_infos.keys().cloned().collect();
    for name in names {
        let info = &f.content.tensor_infos[&name];
        let dims = info.shape.dims().to_vec();
        if dims.len() != 2 || name == "token_embd.weight" {
            continue;
        }
        let key = (format!("{:?}", info.ggml_dtype), dims[0], dims[1]);
        kinds.entry(key).or_insert_with(|| (name.clone(), 0)).1 += 1;
    }
    println!("model {model}: {}", path.display());
    println!("{:<6} {:>7} {:>6} {:>5} {:>4} {:>11} {:>11} {:>8} {:>9}", "dtype", "n", "k", "count", "rows", "invariant", "candle", "ratio", "GB/s inv");
    for ((dtype, n, k), (name, count)) in kinds {
        let t = f.tensor(&name).unwrap();
        let bytes = t.storage_size_in_bytes() as f64;
        let ours = QMatMul::from_qtensor(t).unwrap();
        let candle = candle_core::quantized::QMatMul::from_qtensor(f.tensor(&name).unwrap()).unwrap();
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
            let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap();
            let ti = time(|| {
                std::hint::black_box(ours.run_cpu(Kernel::Invariant, &x, m).unwrap());
            });
            let tc = time(|| {
                std::hint::black_box(candle.forward(&xt).unwrap());
            });
            println!(
                "{dtype:<6} {n:>7} {k:>6} {count:>5} {m:>4} {:>9.3}ms {:>9.3}ms {:>7.2}x {:>9.1}",
                ti * 1e3,
                tc * 1e3,
                tc / ti,
                bytes / ti / 1e9
            );
        }
    }
}
