//! `cargo bench --bench attention [-- --contexts 1024,4096,16384 --dtype f16 --tier avx512|avx2|vector|portable|all
//! --models SmolLM2,Qwen2.5-0.5B --repeat 5 --prefill 0]`: the attention
//! kernel alone on the three models' head shapes and Llama 3.1 8B's, as a decode step runs it (one row, every
//! layer in turn, so the K/V come from memory) and as a prefill chunk of 512 rows at the end of
//! the context; K/V bytes read per second against the machine's read bandwidth, and the
//! portable tier beside the vectorized one.
use std::time::Instant;

use candle_gate::attention::{attend_rows, Heads, Tier};
use candle_gate::kv_cache::{BlockLayout, KvCache, KvDtype, KvPool};

#[path = "bandwidth.rs"]
mod bandwidth;
use bandwidth::bandwidth_gbs;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str, default: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.into())
    };
    let contexts: Vec<usize> = opt("--contexts", "1024,4096,16384").split(',').map(|s| s.parse().unwrap()).collect();
    let dtype: KvDtype = opt("--dtype", "f16").parse().unwrap();
    let repeat: usize = opt("--repeat", "5").parse().unwrap();
    let tiers: Vec<Tier> = match opt("--tier", "all").as_str() {
        "avx512" => vec![Tier::Avx512],
        "avx2" => vec![Tier::Avx2],
        "portable" => vec![Tier::Portable],
        "vector" => vec![Tier::Avx512, Tier::Avx2],
        _ => vec![Tier::Avx512, Tier::Avx2, Tier::Portable],
    };
    let models = opt("--models", "");
    let prefill_on = opt("--prefill", "1") != "0";
    let bw = bandwidth_gbs();
    println!("read bandwidth {bw:.1} GB/s; {} threads; K/V {}", rayon::current_num_threads(), dtype.name());
    let shapes = [
        ("SmolLM2-135M", 30, Heads::new(9, 3, 64)),
        ("Qwen2.5-0.5B", 24, Heads::new(14, 2, 64)),
        ("Qwen2.5-1.5B", 28, Heads::new(12, 2, 128)),
        ("Llama-3.1-8B", 32, Heads::new(32, 8, 128)),
    ];
    println!(
        "{:<14} {:>7} {:<9} {:>12} {:>9} {:>10} {:>14}",
        "model", "context", "tier", "decode ms", "GB/s", "% of bw", "prefill 512 ms"
    );
    for (name, n_layer, h) in shapes {
        if !models.is_empty() && !models.split(',').any(|m| name.starts_with(m)) {
            continue;
        }
        for &ctx in &contexts {
            let lay = BlockLayout { n_layer, n_kv_head: h.n_kv_head, head_dim: h.head_dim, dtype };
            let mut c = KvCache::in_pool(KvPool::unbounded(lay));
            c.extend(ctx).unwrap();
            let kvd = h.n_kv_head * h.head_dim;
            let row: Vec<f32> = (0..kvd).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            for l in 0..n_layer {
                for p in 0..ctx {
                    c.write(l, p, &row, &row).unwrap();
                }
            }
            let qd = h.n_head * h.head_dim;
            let q: Vec<f32> = (0..512 * qd).map(|i| ((i * 13 % 97) as f32 - 48.0) / 30.0).collect();
            let mut out = vec![0f32; 512 * qd];
            let kv_bytes = (n_layer * 2 * kvd * ctx * dtype.size()) as f64;
            for &tier in &tiers {
                if tier > Tier::current() {
                    continue;
                }
                // On a rayon worker, as the engine's forward runs (`Decoder::forward_in`): from
                // outside the pool every parallel loop would also pay a sleep and a wake.
                let decode = |out: &mut [f32]| {
                    rayon::scope(|_| {
                        for l in 0..n_layer {
                            attend_rows(h, l, &q[..qd], &[0], &[ctx - 1], &[&c], &mut out[..qd], tier);
                        }
                    })
                };
                decode(&mut out);
                let mut best = f64::INFINITY;
                for _ in 0..repeat {
                    let t = Instant::now();
                    decode(&mut out);
                    best = best.min(t.elapsed().as_secs_f64());
                }
                let prefill = if prefill_on {
                    let pos: Vec<usize> = (ctx - 512..ctx).collect();
                    let seq = vec![0usize; 512];
                    let t = Instant::now();
                    attend_rows(h, 0, &q, &seq, &pos, &[&c], &mut out, tier);
                    t.elapsed().as_secs_f64()
                } else {
                    f64::NAN
                };
                let gbs = kv_bytes / best / 1e9;
                println!(
                    "{name:<14} {ctx:>7} {:<9} {:>12.3} {gbs:>9.1} {:>9.0}% {:>14.1}",
                    format!("{tier:?}"),
                    best * 1e3,
                    100.0 * gbs / bw,
                    prefill * 1e3 * n_layer as f64
                );
            }
        }
    }
}
