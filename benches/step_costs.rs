//! `cargo bench --bench step_costs [-- --model NAME,...] [-- --tokens 64] [-- --rounds 3] [-- --json F]`: where a
//! single-stream decode step's time goes, per model (default: every registry model). Each round
//! decodes the same tokens twice, alternately: the whole step in `invariant` mode, and the same
//! step with every matmul skipped (its output left zero), in which the norms, RoPE, attention over
//! the same cache, the activations, the residuals and the logits' argmax all still run. The
//! difference is the matmuls' time; their weights' bytes over it, the rate they read at, set
//! beside the read bandwidth measured in the same run. Best of the rounds, each kind apart.
//! `--json F` also writes the rows to F, stamped by `benches/provenance.py` (commit, host, date).
//!
//! What it tells: how much of a step is not the weights' read, which no kernel speedup reaches
//! (issue 50's "every model at 85% of the bandwidth"), and how fast the matmuls themselves read.
use std::time::Instant;

use candle_gate::decoder::{argmax_margin, SeqRows};
use candle_gate::dispatch::Lane;
use candle_gate::kv_cache::KvCache;
use candle_gate::*;

const PROMPT: &str = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from wine making.";

#[path = "bandwidth.rs"]
mod bandwidth;
use bandwidth::bandwidth_gbs;

/// The step without its matmuls: every output the right size, all zeros.
struct NoMatmuls;

impl Lane for NoMatmuls {
    fn matmul_into(&self, w: &QMatMul, _x: &[f32], m: usize, out: &mut Vec<f32>) -> candle_gate::Result<()> {
        out.clear();
        out.resize(m * w.dims().0, 0.0);
        Ok(())
    }
}

/// Seconds per decoded token over `tokens` steps after the prompt, in `lane`.
fn per_token(m: &Model, lane: &dyn Lane, prompt: &[u32], tokens: usize) -> f64 {
    let mut cache = m.decoder.new_cache();
    let step = |cache: &mut KvCache, t: &[u32]| {
        let l = m.decoder.forward_in(lane, &mut [SeqRows { cache, tokens: t, logit_rows: 1 }], None).unwrap();
        argmax_margin(l[0].as_ref().unwrap()).0
    };
    let mut tok = step(&mut cache, prompt);
    let t = Instant::now();
    for _ in 0..tokens {
        tok = step(&mut cache, &[tok]);
    }
    t.elapsed().as_secs_f64() / tokens as f64
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let models: Vec<String> = arg(&args, "--model")
        .map(|m| m.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| registry::KNOWN.iter().map(|k| k.name.to_string()).collect());
    let tokens: usize = arg(&args, "--tokens").map_or(64, |t| t.parse().expect("--tokens N"));
    let rounds: usize = arg(&args, "--rounds").map_or(3, |r| r.parse().expect("--rounds N"));
    let json = arg(&args, "--json");
    let policy = Policy::new(Mode::Invariant);
    let mut rows = Vec::new();
    println!(
        "single-stream decode, {tokens} tokens after a {}-character prompt, best of {rounds} alternating rounds; \
         invariant kernels' tier: {}",
        PROMPT.len(),
        kernels::isa().name()
    );
    println!(
        "{:<36} {:>9} {:>11} {:>12} {:>9} {:>10} {:>11} {:>10}",
        "model", "MB/token", "step ms", "no-matmul ms", "its share", "matmul ms", "matmul GB/s", "of the bw"
    );
    for name in &models {
        let path = registry::resolve(name).expect("fetch the model first (`candle-gate fetch --model ...`)");
        let m = Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap();
        let prompt = m.tokenizer.encode(PROMPT).unwrap();
        per_token(&m, &policy, &prompt, 4); // (first touches)
        let (mut whole, mut rest) = (f64::MAX, f64::MAX);
        for _ in 0..rounds {
            whole = whole.min(per_token(&m, &policy, &prompt, tokens));
            rest = rest.min(per_token(&m, &NoMatmuls, &prompt, tokens));
        }
        let bw = bandwidth_gbs();
        let bytes = m.decoder.bytes_per_decode_token() as f64;
        let matmul = whole - rest;
        let rate = bytes / matmul / 1e9;
        println!(
            "{:<36} {:>9.1} {:>11.3} {:>12.3} {:>8.0}% {:>10.3} {:>11.1} {:>9.0}%   (read bandwidth {bw:.1} GB/s)",
            name,
            bytes / 1e6,
            whole * 1e3,
            rest * 1e3,
            100.0 * rest / whole,
            matmul * 1e3,
            rate,
            100.0 * rate / bw
        );
        rows.push(serde_json::json!({
            "model": name, "bytes_per_token": bytes, "step_ms": whole * 1e3, "without_matmuls_ms": rest * 1e3,
            "matmul_ms": matmul * 1e3, "matmul_read_gbs": rate, "read_bandwidth_gbs": bw,
        }));
    }
    if let Some(path) = json {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benches/provenance.py");
        let out = std::process::Command::new("python3").arg(script).output().expect("python3 for the provenance stamp");
        let mut doc: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&out.stdout).expect("benches/provenance.py prints its stamp");
        doc.insert("tier".into(), kernels::isa().name().into());
        doc.insert("tokens".into(), tokens.into());
        doc.insert("rounds".into(), rounds.into());
        doc.insert("rows".into(), rows.into());
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
        println!("wrote {path}");
    }
}
