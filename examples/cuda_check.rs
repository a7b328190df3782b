//! The CUDA check, in two steps (`benches/cuda_check.sh` runs both; see docs/CUDA.md):
//!
//! - `cuda_check extract --out DIR` (any build, no GPU): writes `DIR/weights.gguf`, one real
//!   weight per (dtype, shape) of every registry model, cut to 1024 output rows, so that the
//!   GPU machine, which cannot download, gets real weights in a few tens of MiB.
//! - `cuda_check run --weights DIR/weights.gguf [--out DIR]` (built with `--features cuda`, on a
//!   CUDA GPU): the differential tests (invariant at m rows == each row alone, bitwise, for
//!   m = 1..=64, 128, 256, 512; GPU == the CPU canonical kernel, bitwise, for every kernel of
//!   canonical.cu (the one-warp-per-column kernel's tiles and the tiled kernel's); whether
//!   Candle's own dispatch changes a row's bits with the row count; the reference matmul), then
//!   on the models' full shapes the crossover table, the timings of native, row-split and
//!   invariant, and every kernel's time at 1, 4, 8, 16, 64, 128, 256 and 512 rows (each also
//!   checked equal to invariant's output and invariant to each row alone). Prints the tables,
//!   writes `cuda_check.json` and `profile-cuda.json` to `--out`, and exits non-zero when a
//!   bitwise claim fails.
use std::path::PathBuf;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1).map(String::as_str) {
        Some("extract") => extract(PathBuf::from(arg(&args, "--out").unwrap_or_else(|| "target/cuda-check".into()))),
        Some("run") => {
            let weights =
                PathBuf::from(arg(&args, "--weights").unwrap_or_else(|| "target/cuda-check/weights.gguf".into()));
            let out = PathBuf::from(arg(&args, "--out").unwrap_or_else(|| ".".into()));
            gpu::run(&weights, &out)
        }
        _ => Err("usage: cuda_check extract --out DIR | cuda_check run --weights FILE [--out DIR]".into()),
    };
    if let Err(e) = result {
        eprintln!("cuda_check: {e}");
        std::process::exit(1);
    }
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Rows kept per sampled weight: enough for every kernel's tiling, small enough to carry.
const SAMPLE_ROWS: usize = 1024;

fn extract(dir: PathBuf) -> Result<()> {
    use candle_gate::kernels::canonical::sample_weights;
    std::fs::create_dir_all(&dir)?;
    let mut named = Vec::new();
    for known in candle_gate::registry::KNOWN {
        let path = candle_gate::registry::resolve(known.name)?;
        for (name, t) in sample_weights(&path, SAMPLE_ROWS)? {
            named.push((format!("{}/{name}", known.name), t));
        }
    }
    let refs: Vec<(&str, &candle_core::quantized::QTensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.join("weights.gguf");
    let mut f = std::fs::File::create(&path)?;
    candle_core::quantized::gguf_file::write(&mut f, &[], &refs)?;
    for (n, t) in &named {
        println!("{n}: {:?} {:?}", t.dtype(), t.shape().dims());
    }
    println!("{} weights, {} bytes: {}", named.len(), std::fs::metadata(&path)?.len(), path.display());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    pub fn run(_: &std::path::Path, _: &std::path::Path) -> super::Result<()> {
        Err("built without the `cuda` feature: cargo build --release --features cuda --example cuda_check".into())
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
    use candle_core::{Device, Module, Tensor};
    use candle_gate::dispatch::dtype_name;
    use candle_gate::kernels::canonical;
    use candle_gate::kernels::cuda::{canonical_dtype, canonical_with, Kernel};
    use candle_gate::profile::{crossover, DtypeProfile, Profile, TableRow};
    use candle_gate::{Mode, Policy, QMatMul};
    use serde_json::json;

    use super::Result;

    /// The differential tests' row counts: every m up to 64, then the prefill sizes.
    const MAX_ROWS: usize = 512;
    const ROW_COUNTS: [usize; 3] = [128, 256, 512];
    /// Rows of the reference matmul's checks (the dense order: the CPU side is slow).
    const REFERENCE_ROWS: usize = 64;

    fn differential_rows() -> Vec<usize> {
        (1..=64).chain(ROW_COUNTS).collect()
    }

    fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
    }

    fn mm(w: &Arc<QTensor>, mode: Mode) -> Result<QMatMul> {
        Ok(QMatMul::new(w.clone(), Arc::new(Policy::new(mode)))?)
    }

    fn with_kernel(w: &Arc<QTensor>, xs: &Tensor, kernel: Kernel) -> Result<Tensor> {
        Ok(canonical_with(w, xs, Some(kernel))?.ok_or("no canonical kernel for this dtype")?)
    }

    /// Rows of `y` (`[m, n]`) that differ in any bit from the same row computed alone.
    fn rows_differing(y: &[u32], alone: &[Vec<u32>], n: usize) -> usize {
        alone.iter().enumerate().filter(|(r, a)| y[r * n..(r + 1) * n] != a[..]).count()
    }

    struct Differential {
        label: String,
        invariant_ok: bool,
        equals_cpu: bool,
        /// Kernels whose output at some tested row count differs from the CPU's.
        kernels_differing: Vec<String>,
        native_rows_differing: Vec<(usize, usize)>,
        reference_invariant: bool,
        reference_equals_cpu: bool,
    }

    fn differential(dev: &Device, label: &str, w_cpu: &QTensor, w_gpu: Arc<QTensor>) -> Result<Differential> {
        let (n, k) = w_cpu.shape().dims2()?;
        let x = pseudo_random(MAX_ROWS * k, k as u64);
        let xs = Tensor::from_vec(x.clone(), (MAX_ROWS, k), dev)?;
        let inv = mm(&w_gpu, Mode::Invariant)?;
        let native = mm(&w_gpu, Mode::Native)?;
        let alone = |q: &QMatMul| -> Result<Vec<Vec<u32>>> {
            (0..MAX_ROWS).map(|r| bits(&q.forward(&xs.narrow(0, r, 1)?)?)).collect()
        };
        let (inv_alone, native_alone) = (alone(&inv)?, alone(&native)?);
        let mut invariant_ok = true;
        let mut native_rows_differing = Vec::new();
        for m in differential_rows() {
            let x_m = xs.narrow(0, 0, m)?;
            invariant_ok &= rows_differing(&bits(&inv.forward(&x_m)?)?, &inv_alone[..m], n) == 0;
            let d = rows_differing(&bits(&native.forward(&x_m)?)?, &native_alone[..m], n);
            if d > 0 {
                native_rows_differing.push((m, d));
            }
        }
        let cpu = canonical::matmul(w_cpu, &x, MAX_ROWS)?;
        let cpu_bits: Vec<u32> = cpu.iter().map(|v| v.to_bits()).collect();
        let equals_cpu = bits(&inv.forward(&xs)?)? == cpu_bits;
        // Every kernel and tile, at row counts that fill, split and overrun their tiles.
        let mut kernels_differing = Vec::new();
        let kernels = if canonical_dtype(w_cpu.dtype()).is_some() { Kernel::all() } else { Vec::new() };
        for kernel in kernels {
            for m in [1, 3, 13, 64, 100, MAX_ROWS] {
                let y = bits(&with_kernel(&w_gpu, &xs.narrow(0, 0, m)?, kernel)?)?;
                if y[..] != cpu_bits[..m * n] {
                    kernels_differing.push(format!("{}@{m}", kernel.label()));
                }
            }
        }
        // The reference matmul over the weight dequantized by Candle on each device.
        let xr = xs.narrow(0, 0, REFERENCE_ROWS)?;
        let ref_gpu = bits(&inv.forward_reference(&xr)?)?;
        let ref_alone: Vec<Vec<u32>> =
            (0..REFERENCE_ROWS).map(|r| bits(&inv.forward_reference(&xs.narrow(0, r, 1)?)?)).collect::<Result<_>>()?;
        let reference_invariant = rows_differing(&ref_gpu, &ref_alone, n) == 0;
        let cpu_ref =
            mm(&Arc::new(QTensor::quantize(&w_cpu.dequantize(&Device::Cpu)?, GgmlDType::F32)?), Mode::Canonical)?;
        let ref_cpu = canonical::matmul(cpu_ref.weight(), &x[..REFERENCE_ROWS * k], REFERENCE_ROWS)?;
        let reference_equals_cpu = ref_gpu == ref_cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        Ok(Differential {
            label: label.to_string(),
            invariant_ok,
            equals_cpu,
            kernels_differing,
            native_rows_differing,
            reference_invariant,
            reference_equals_cpu,
        })
    }

    /// Mean seconds per call after warm-up, the GPU synchronized around the timed calls: 3 to 20
    /// calls, as many as fit in about 40 ms (one call is timed first to tell).
    fn time(dev: &Device, f: impl Fn() -> Result<Tensor>) -> Result<f64> {
        f()?;
        dev.synchronize()?;
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        let once = t0.elapsed().as_secs_f64();
        let iters = ((0.04 / once) as usize).clamp(3, 20);
        f()?;
        dev.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        dev.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    }

    /// A weight of the given full shape with random bytes (timing only: no value is checked),
    /// the f16 scales kept finite.
    fn random_weight(dev: &Device, dtype: GgmlDType, n: usize, k: usize) -> Result<Arc<QTensor>> {
        let bytes = canonical::row_bytes(dtype, k) * n;
        let mut s = 0x9E3779B97F4A7C15u64 ^ (n * k) as u64;
        let data: Vec<u8> = (0..bytes)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // Bytes below 0x3c keep any f16 they form below 1.0 in magnitude.
                ((s >> 32) % 0x3c) as u8
            })
            .collect();
        let st = QStorage::from_data(std::borrow::Cow::Owned(data), dev, dtype)?;
        Ok(Arc::new(QTensor::new(st, (n, k))?))
    }

    /// (model, what, dtype, n, k): the models' largest matmuls per layer and their outputs.
    const SHAPES: [(&str, &str, GgmlDType, usize, usize); 9] = [
        ("smollm2-135m", "ffn_up", GgmlDType::Q4_1, 1536, 576),
        ("smollm2-135m", "ffn_down", GgmlDType::Q4_1, 576, 1536),
        ("smollm2-135m", "output", GgmlDType::Q8_0, 49152, 576),
        ("qwen2.5-0.5b", "ffn_up", GgmlDType::Q5_0, 4864, 896),
        ("qwen2.5-0.5b", "ffn_down", GgmlDType::Q4K, 896, 4864),
        ("qwen2.5-0.5b", "output", GgmlDType::Q8_0, 151936, 896),
        ("qwen2.5-1.5b", "ffn_up", GgmlDType::Q4K, 8960, 1536),
        ("qwen2.5-1.5b", "ffn_down", GgmlDType::Q6K, 1536, 8960),
        ("qwen2.5-1.5b", "output", GgmlDType::Q6K, 151936, 1536),
    ];
    /// Row counts of the timing tables; row-split (m launches) is timed up to `SPLIT_ROWS`.
    const TIMED_ROWS: [usize; 8] = [1, 4, 8, 16, 64, 128, 256, 512];
    const SPLIT_ROWS: usize = 16;

    pub fn run(weights: &std::path::Path, out: &std::path::Path) -> Result<()> {
        let started = Instant::now();
        let dev = Device::new_cuda(0)?;
        std::fs::create_dir_all(out)?;
        let mut file = std::fs::File::open(weights)?;
        let content = gguf_file::Content::read(&mut file)?;
        let mut names: Vec<String> = content.tensor_infos.keys().cloned().collect();
        names.sort();

        println!("## Differential tests (bitwise), {} real weights, rows 1..=64, 128, 256, 512\n", names.len());
        println!("| weight | dtype | [n, k] | invariant: m rows == each alone | GPU == CPU canonical | kernels != CPU | native: (m, rows differing) | reference invariant | reference == CPU |");
        println!("|---|---|---|---|---|---|---|---|---|");
        let mut failed = Vec::new();
        let mut experimental_failed: Vec<String> = Vec::new();
        let mut diffs = Vec::new();
        for name in &names {
            let w_cpu = content.tensor(&mut file, name, &Device::Cpu)?;
            let w_gpu = Arc::new(content.tensor(&mut file, name, &dev)?);
            let d = differential(&dev, name, &w_cpu, w_gpu)?;
            let native: Vec<String> = d.native_rows_differing.iter().map(|(m, r)| format!("{m}:{r}")).collect();
            let native = if native.is_empty() { "none".to_string() } else { native.join(" ") };
            let kernels =
                if d.kernels_differing.is_empty() { "none".to_string() } else { d.kernels_differing.join(" ") };
            println!(
                "| {} | {} | {:?} | {} | {} | {} | {} | {} | {} |",
                d.label,
                dtype_name(w_cpu.dtype()),
                w_cpu.shape().dims(),
                d.invariant_ok,
                d.equals_cpu,
                kernels,
                native,
                d.reference_invariant,
                d.reference_equals_cpu
            );
            // The tensor-core kernel is not dispatched yet: its failures are reported apart.
            let (mma, others): (Vec<&String>, Vec<&String>) =
                d.kernels_differing.iter().partition(|k| k.starts_with("mma@"));
            if !mma.is_empty() {
                experimental_failed.push(format!(
                    "{}: {}",
                    d.label,
                    mma.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ")
                ));
            }
            if !d.invariant_ok || !d.equals_cpu || !others.is_empty() || !d.reference_invariant {
                failed.push(d.label.clone());
            }
            diffs.push(json!({
                "weight": d.label, "dtype": dtype_name(w_cpu.dtype()), "shape": w_cpu.shape().dims(),
                "invariant_rows_equal_alone": d.invariant_ok, "gpu_equals_cpu_canonical": d.equals_cpu,
                "kernels_differing_from_cpu": d.kernels_differing,
                "native_rows_differing": d.native_rows_differing, "reference_invariant": d.reference_invariant,
                "reference_equals_cpu": d.reference_equals_cpu,
            }));
        }
        println!("\n(differential tests: {:.0} s)", started.elapsed().as_secs_f64());

        let kernels = Kernel::all();
        println!("\n## Time per call (µs) on the models' full shapes; ratio = native / invariant\n");
        println!("invariant = the kernel `canonical` picks for the row count; best = the fastest of every kernel\n");
        println!("| model | matmul | dtype | [n, k] | rows | native | row_split | invariant (kernel) | native/invariant | best kernel | native/best |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        let mut timings = Vec::new();
        let mut per_kernel = Vec::new();
        let mut profile = Profile::empty(candle_gate::dispatch::Backend::Cuda);
        let mut tables: std::collections::BTreeMap<String, Vec<TableRow>> = Default::default();
        for (model, what, dtype, n, k) in SHAPES {
            let w = random_weight(&dev, dtype, n, k)?;
            let (native, split, inv) = (mm(&w, Mode::Native)?, mm(&w, Mode::RowSplit)?, mm(&w, Mode::Invariant)?);
            let mut rows: Vec<usize> = (1..=SPLIT_ROWS).chain(TIMED_ROWS).collect();
            rows.sort();
            rows.dedup();
            // Invariance on the full shape too (these shapes pick the wider tiles).
            let max = *TIMED_ROWS.iter().max().unwrap();
            let x_all = Tensor::from_vec(pseudo_random(max * k, 3), (max, k), &dev)?;
            let alone: Vec<Vec<u32>> =
                (0..max).map(|r| bits(&inv.forward(&x_all.narrow(0, r, 1)?)?)).collect::<Result<_>>()?;
            let mut shape_kernels = Vec::new();
            for m in rows {
                let xs = x_all.narrow(0, 0, m)?.contiguous()?;
                let y_inv = bits(&inv.forward(&xs)?)?;
                if rows_differing(&y_inv, &alone[..m], n) > 0 {
                    failed.push(format!("{model} {what} [{n}, {k}] at {m} rows"));
                }
                let t_native = time(&dev, || Ok(native.forward(&xs)?))?;
                let t_split = if m <= SPLIT_ROWS { Some(time(&dev, || Ok(split.forward(&xs)?))?) } else { None };
                let t_inv = time(&dev, || Ok(inv.forward(&xs)?))?;
                let table = tables.entry(dtype_name(dtype)).or_default();
                if let Some(t_split) = t_split {
                    for (kernel, t) in [("gemm", t_native), ("gemv_row_split", t_split), ("invariant", t_inv)] {
                        table.push(TableRow { shape: [n, k], rows: m, kernel: kernel.into(), ns_per_call: t * 1e9 });
                    }
                }
                if !TIMED_ROWS.contains(&m) {
                    continue;
                }
                // Every kernel: the same bits as invariant's, and its time.
                let mut kernel_us = serde_json::Map::new();
                let mut best = (f64::INFINITY, String::new());
                for kernel in &kernels {
                    // The one-warp-per-column kernel re-reads the weights per row tile: past 64
                    // rows it is far too slow to matter (and to time on the output matrices).
                    if matches!(kernel, Kernel::Warp(_) | Kernel::WarpUnrolled) && m > 64 {
                        continue;
                    }
                    let f = || with_kernel(&w, &xs, *kernel);
                    if bits(&f()?)? != y_inv {
                        let what = format!("{model} {what} [{n}, {k}] {} at {m} rows", kernel.label());
                        if *kernel == Kernel::Mma {
                            experimental_failed.push(what);
                        } else {
                            failed.push(what);
                        }
                    }
                    let t = time(&dev, f)?;
                    kernel_us.insert(kernel.label(), json!(t * 1e6));
                    if t < best.0 {
                        best = (t, kernel.label());
                    }
                }
                let chosen = Kernel::for_rows(m).label();
                println!(
                    "| {model} | {what} | {} | [{n}, {k}] | {m} | {:.1} | {} | {:.1} ({chosen}) | {:.2}x | {} {:.1} | {:.2}x |",
                    dtype_name(dtype),
                    t_native * 1e6,
                    t_split.map_or("-".to_string(), |t| format!("{:.1}", t * 1e6)),
                    t_inv * 1e6,
                    t_native / t_inv,
                    best.1,
                    best.0 * 1e6,
                    t_native / best.0
                );
                timings.push(json!({
                    "model": model, "matmul": what, "dtype": dtype_name(dtype), "shape": [n, k], "rows": m,
                    "native_us": t_native * 1e6, "row_split_us": t_split.map(|t| t * 1e6), "invariant_us": t_inv * 1e6,
                    "invariant_kernel": chosen, "kernels_us": kernel_us.clone(),
                }));
                shape_kernels.push((m, t_native * 1e6, kernel_us));
            }
            per_kernel.push((model, what, dtype, n, k, shape_kernels));
        }
        println!("\n## Every kernel, µs per call (the same bits each)\n");
        let labels: Vec<String> = kernels.iter().map(Kernel::label).collect();
        println!("| shape | rows | {} |", labels.join(" | "));
        println!("|---|---|{}", "---|".repeat(labels.len()));
        for (model, what, dtype, n, k, shape_kernels) in &per_kernel {
            for (m, _, us) in shape_kernels {
                let cells: Vec<String> = labels
                    .iter()
                    .map(|l| us.get(l).and_then(|v| v.as_f64()).map_or("-".into(), |v| format!("{v:.1}")))
                    .collect();
                println!("| {model} {what} {} [{n}, {k}] | {m} | {} |", dtype_name(*dtype), cells.join(" | "));
            }
        }
        // For the dispatch by row count: each kernel against native over the shapes.
        println!(
            "\n## Each kernel against native by row count: native / kernel, geometric mean over the shapes (worst)\n"
        );
        println!("| rows | {} | best (by worst shape) |", labels.join(" | "));
        println!("|---|{}---|", "---|".repeat(labels.len()));
        let mut summary = Vec::new();
        for m in TIMED_ROWS {
            let mut cells = Vec::new();
            let mut best = (0.0f64, String::new());
            for l in &labels {
                let ratios: Vec<f64> = per_kernel
                    .iter()
                    .flat_map(|(.., sk)| sk.iter())
                    .filter(|(mm, ..)| *mm == m)
                    .filter_map(|(_, native_us, us)| us.get(l).and_then(|v| v.as_f64()).map(|v| native_us / v))
                    .collect();
                if ratios.is_empty() {
                    cells.push("-".to_string());
                    continue;
                }
                let gm = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
                let worst = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
                if worst > best.0 {
                    best = (worst, l.clone());
                }
                cells.push(format!("{gm:.2} ({worst:.2})"));
                summary.push(json!({"rows": m, "kernel": l, "geomean_native_over_kernel": gm, "worst": worst}));
            }
            println!("| {m} | {} | {} ({:.2}) |", cells.join(" | "), best.1, best.0);
        }
        // Row-split's crossover against Candle's own batched dispatch ("gemm" in the table: on
        // CUDA that is whatever Candle picks for the row count).
        println!("\n## Crossover (row-split vs Candle's dispatch)\n");
        for (dtype, table) in tables {
            let (cross, below) = crossover(&table);
            println!("{dtype}: row_split_max {below}, Candle's dispatch first faster at {cross:?} rows");
            profile.dtypes.insert(dtype, DtypeProfile { row_split_max: below, crossover_rows: cross, table });
        }
        profile.save(&out.join("profile-cuda.json"))?;
        let seconds = started.elapsed().as_secs_f64();
        let report = json!({
            "differential": diffs, "timings": timings, "kernels_vs_native": summary, "failed": failed,
            "tensor_core_kernel_failed": experimental_failed, "seconds": seconds,
        });
        std::fs::write(out.join("cuda_check.json"), serde_json::to_string_pretty(&report)? + "\n")?;
        println!("\n(cuda_check: {seconds:.0} s)");
        if experimental_failed.is_empty() {
            println!("\nthe tensor-core kernel (mma, not dispatched) equals the CPU everywhere it ran");
        } else {
            println!("\nthe tensor-core kernel (mma, not dispatched) DIFFERS: {}", experimental_failed.join("; "));
        }
        if failed.is_empty() {
            println!("\nall bitwise claims hold");
            Ok(())
        } else {
            Err(format!("bitwise claims failed for: {}", failed.join(", ")).into())
        }
    }
}
