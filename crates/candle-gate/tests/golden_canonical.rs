//! Bits across machines and devices, the whole forward in the canonical order
//! (docs/CANONICAL.md): greedy decoding of two prompts on every registry model in `canonical`
//! mode must reproduce the committed hashes of every step's logits and every layer's output.
//! The canonical order is pure IEEE arithmetic with nothing chosen at run time, so any x86-64
//! host reproduces them, and so must a GPU that follows docs/CANONICAL.md.
//!
//! The widest kernel tier the host has runs the whole test; each narrower one (AVX2's packed
//! kernels, the scalar definition `kernels::canonical::matmul`) is checked against the same
//! hashes in the same test, two steps a model.
//!
//! `CANDLE_GATE_BLESS_GOLDEN=1` rewrites the file, only after a deliberate change of the
//! order (CONTRIBUTING.md, "Bits").

use std::path::PathBuf;
use std::sync::Arc;

use candle_gate::decoder::{argmax_margin, SeqRows};
use candle_gate::kernels::{isa, set_isa, Isa};
use candle_gate::*;
use serde::{Deserialize, Serialize};

const STEPS: usize = 8;
const PROMPTS: [&str; 2] =
    ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"];

#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Step {
    token: u32,
    logits: String,
    /// The residual stream's hash after each layer, space-separated.
    layers: String,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Run {
    model: String,
    model_sha256: String,
    prompt: String,
    steps: Vec<Step>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Golden {
    compile_target: String,
    produced_on: String,
    runs: Vec<Run>,
}

fn hash(v: &[f32]) -> String {
    format!("{:016x}", candle_gate::ops::hash_bits(v))
}

/// Greedy decoding: the prompt in one forward, then one token per forward.
fn decode(m: &Model, p: &Policy, prompt: &[u32]) -> Vec<Step> {
    decode_steps(m, p, prompt, STEPS)
}

fn decode_steps(m: &Model, p: &Policy, prompt: &[u32], steps: usize) -> Vec<Step> {
    let mut cache = m.decoder.new_cache();
    let mut feed = prompt.to_vec();
    (0..steps)
        .map(|_| {
            let mut trace = vec![];
            let out = m
                .decoder
                .forward_traced(p, &mut [SeqRows { cache: &mut cache, tokens: &feed, logit_rows: 1 }], Some(&mut trace))
                .unwrap();
            let logits = out[0].as_ref().unwrap();
            let layers: Vec<String> = trace.iter().map(|x| hash(x)).collect();
            let step = Step { token: argmax_margin(logits).0, logits: hash(logits), layers: layers.join(" ") };
            feed = vec![step.token];
            step
        })
        .collect()
}

fn runs_of(name: &str, m: &Model, policy: &Policy) -> Vec<Run> {
    PROMPTS
        .iter()
        .map(|prompt| Run {
            model: name.into(),
            model_sha256: m.sha256().unwrap(),
            prompt: (*prompt).into(),
            steps: decode(m, policy, &m.tokenizer.encode(prompt).unwrap()),
        })
        .collect()
}

fn first_difference(want: &Run, got: &Run) -> Option<String> {
    for (i, (w, g)) in want.steps.iter().zip(&got.steps).enumerate() {
        if w == g {
            continue;
        }
        let layer = w.layers.split(' ').zip(g.layers.split(' ')).position(|(a, b)| a != b);
        let at = match layer {
            Some(l) => format!("first differing layer output: layer {l}"),
            None => "every layer output equal: the final norm or the output matrix differs".into(),
        };
        return Some(format!(
            "{} prompt {:?} step {i}: logits hash {} != golden {} (token {} vs {}); {at}",
            got.model, got.prompt, g.logits, w.logits, g.token, w.token
        ));
    }
    None
}

fn load(name: &str, policy: &Arc<Policy>) -> Model {
    let path = registry::resolve(name).expect("run `candle-gate fetch --model all` first");
    Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap()
}

#[test]
fn canonical_forward_reproduces_the_golden_hashes_on_every_registry_model() {
    let policy = Arc::new(Policy::new(Mode::Canonical));
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/canonical.json");
    let mut runs = vec![];
    for known in registry::KNOWN {
        let m = load(known.name, &policy);
        runs.extend(runs_of(known.name, &m, &policy));
    }
    if std::env::var("CANDLE_GATE_BLESS_GOLDEN").as_deref() == Ok("1") {
        let g = Golden { compile_target: host::compile_target(), produced_on: host::cpu_model(), runs };
        std::fs::write(&file, serde_json::to_string_pretty(&g).unwrap() + "\n").unwrap();
        eprintln!("wrote {}", file.display());
        return;
    }
    let golden: Golden = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(golden.runs.len(), runs.len(), "the golden file has another set of runs");
    let diffs: Vec<String> = golden
        .runs
        .iter()
        .zip(&runs)
        .filter_map(|(w, g)| {
            if w.model_sha256 != g.model_sha256 {
                return Some(format!("{}: the golden hashes are for another model file", g.model));
            }
            first_difference(w, g)
        })
        .collect();
    assert!(
        diffs.is_empty(),
        "this host ({}, kernels {}) does not reproduce the canonical golden bits (produced on {}, {}):\n{}",
        host::cpu_model(),
        isa().name(),
        golden.produced_on,
        golden.compile_target,
        diffs.join("\n")
    );

    // The other tiers give the same bits: each model loaded with the kernels capped at a
    // narrower tier (AVX2's packed kernels; below that nothing is packed and the scalar
    // definition runs), two steps of the first prompt (the scalar kernel is slow).
    let best = isa();
    for tier in Isa::available().into_iter().filter(|&t| t < best) {
        for known in registry::KNOWN {
            set_isa(tier);
            let m = load(known.name, &policy);
            let ids = m.tokenizer.encode(PROMPTS[0]).unwrap();
            let got = decode_steps(&m, &policy, &ids, 2);
            set_isa(best);
            let want = golden.runs.iter().find(|r| r.model == known.name && r.prompt == PROMPTS[0]).unwrap();
            assert_eq!(
                got[..],
                want.steps[..2],
                "{}: kernel tier {tier:?} does not reproduce the golden bits",
                known.name
            );
        }
        eprintln!("kernel tier {tier:?} reproduces every model's first two steps");
    }
}
