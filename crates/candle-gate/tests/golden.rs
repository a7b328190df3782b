//! Bits across machines: greedy decoding of a few prompts on the default model, 16 steps each,
//! in `invariant` mode (f16 K/V), in the reference lane (f32 K/V) and in `split_k_f16` (batch
//! dependent, but not host dependent), must reproduce the committed hashes of every
//! step's logits and of every layer's output. The hashes were produced on the development
//! machine (see the file's `produced_on`); any x86-64 host running the same build target must
//! reproduce them, whatever its CPU generation, core count or glibc.
//!
//! On a mismatch the test names the first differing step and, inside it, the first layer whose
//! output differs. `CANDLE_GATE_BLESS_GOLDEN=1` rewrites the file (only after a deliberate
//! change of the arithmetic; say why in the commit).

use std::path::PathBuf;
use std::sync::Arc;

use candle_gate::decoder::{argmax_margin, SeqRows};
use candle_gate::reference::ReferenceWeights;
use candle_gate::*;
use serde::{Deserialize, Serialize};

const STEPS: usize = 16;
const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nExplain why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
];

#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Step {
    token: u32,
    logits: String,
    /// The residual stream's hash after each layer, space-separated (one line a step).
    layers: String,
}

#[derive(Serialize, Deserialize, Debug)]
struct Run {
    lane: String,
    prompt: String,
    steps: Vec<Step>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Golden {
    model_sha256: String,
    compile_target: String,
    produced_on: String,
    runs: Vec<Run>,
}

fn hash(v: &[f32]) -> String {
    format!("{:016x}", candle_gate::ops::hash_bits(v))
}

fn step_of(logits: &[f32], trace: &[Vec<f32>]) -> Step {
    let layers: Vec<String> = trace.iter().map(|x| hash(x)).collect();
    Step { token: argmax_margin(logits).0, logits: hash(logits), layers: layers.join(" ") }
}

/// Greedy decoding in the fast lane: the prompt in one forward, then one token per forward.
fn fast_lane(m: &Model, p: &Policy, prompt: &[u32]) -> Vec<Step> {
    let mut cache = m.decoder.new_cache();
    let mut feed = prompt.to_vec();
    (0..STEPS)
        .map(|_| {
            let mut trace = vec![];
            let out = m.decoder.forward_traced(
                p,
                &mut [SeqRows { cache: &mut cache, tokens: &feed, logit_rows: 1 }],
                Some(&mut trace),
            );
            let step = step_of(out.unwrap()[0].as_ref().unwrap(), &trace);
            feed = vec![step.token];
            step
        })
        .collect()
}

/// Greedy decoding in the reference lane, the same way (its own cache is f32: the exact lane).
fn reference_lane(m: &Model, prompt: &[u32]) -> Vec<Step> {
    let mut cache = m.decoder.new_cache_with(candle_gate::decoder::KvDtype::F32);
    let mut feed = prompt.to_vec();
    (0..STEPS)
        .map(|_| {
            let mut trace = vec![];
            let logits = m
                .decoder
                .reference_extend_traced(&mut cache, &feed, ReferenceWeights::Dense, Some(&mut trace))
                .unwrap();
            let step = step_of(&logits, &trace);
            feed = vec![step.token];
            step
        })
        .collect()
}

fn first_difference(want: &Run, got: &Run) -> Option<String> {
    for (i, (w, g)) in want.steps.iter().zip(&got.steps).enumerate() {
        if w == g {
            continue;
        }
        let (wl, gl): (Vec<&str>, Vec<&str>) = (w.layers.split(' ').collect(), g.layers.split(' ').collect());
        let layer = wl.iter().zip(&gl).position(|(a, b)| a != b);
        let at = match layer {
            Some(l) => format!("first differing layer output: layer {l} of {}", wl.len()),
            None => "every layer output equal: the final norm or the output matrix differs".into(),
        };
        return Some(format!(
            "{} lane, prompt {:?}, step {i}: logits hash {} != golden {} (token {} vs {}); {at}",
            got.lane, got.prompt, g.logits, w.logits, g.token, w.token
        ));
    }
    None
}

#[test]
fn invariant_reference_and_split_k_lanes_reproduce_the_golden_hashes() {
    let path = registry::resolve(registry::DEFAULT_MODEL).expect("run `candle-gate fetch` first");
    let policy = Arc::new(Policy::new(Mode::Invariant));
    let m = Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap();
    let split_k = Policy::new(Mode::SplitKF16);
    let mut runs = vec![];
    for prompt in PROMPTS {
        // The chat prompt is written out already: its control-token texts are meant.
        let ids = m.tokenizer.encode_rendered(prompt).unwrap();
        runs.push(Run { lane: "invariant".into(), prompt: prompt.into(), steps: fast_lane(&m, &policy, &ids) });
        runs.push(Run { lane: "reference".into(), prompt: prompt.into(), steps: reference_lane(&m, &ids) });
        runs.push(Run { lane: "split_k_f16".into(), prompt: prompt.into(), steps: fast_lane(&m, &split_k, &ids) });
    }
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/smollm2-135m-instruct-q4_1.json");
    if std::env::var("CANDLE_GATE_BLESS_GOLDEN").as_deref() == Ok("1") {
        let cpu = host::cpu_model();
        let g = Golden {
            model_sha256: m.sha256().unwrap(),
            compile_target: host::compile_target(),
            produced_on: cpu,
            runs,
        };
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, serde_json::to_string_pretty(&g).unwrap() + "\n").unwrap();
        eprintln!("wrote {}", file.display());
        return;
    }
    let golden: Golden = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(golden.model_sha256, m.sha256().unwrap(), "the golden hashes are for another model file");
    assert_eq!(
        golden.compile_target,
        host::compile_target(),
        "the golden hashes were produced by a build for another target; the bits are promised per compile target"
    );
    let diffs: Vec<String> = golden.runs.iter().zip(&runs).filter_map(|(w, g)| first_difference(w, g)).collect();
    assert!(
        diffs.is_empty(),
        "this host does not reproduce the golden bits (produced on {}):\n{}",
        golden.produced_on,
        diffs.join("\n")
    );
    assert_eq!(golden.runs.len(), runs.len());

    // Every narrower kernel tier this host has reproduces the invariant lane too.
    use candle_gate::kernels::{set_isa, Isa};
    let best = Isa::best();
    for isa in Isa::available().into_iter().filter(|&i| i != best) {
        set_isa(isa);
        for want in golden.runs.iter().filter(|r| r.lane == "invariant") {
            let ids = m.tokenizer.encode_rendered(&want.prompt).unwrap();
            let got = Run { lane: want.lane.clone(), prompt: want.prompt.clone(), steps: fast_lane(&m, &policy, &ids) };
            if let Some(d) = first_difference(want, &got) {
                panic!("kernel tier {isa:?} does not reproduce the golden bits: {d}");
            }
        }
        eprintln!("kernel tier {isa:?}: the invariant lane reproduces the golden hashes");
    }
    set_isa(best);
}

/// The mismatch report names the first differing step and the first differing layer in it.
#[test]
fn a_mismatch_names_the_step_and_the_layer() {
    let step = |logits: &str, layers: &[&str]| Step { token: 1, logits: logits.into(), layers: layers.join(" ") };
    let run = |steps| Run { lane: "invariant".into(), prompt: "p".into(), steps };
    let want = run(vec![step("a", &["1", "2", "3"]), step("b", &["4", "5", "6"])]);
    let got = run(vec![step("a", &["1", "2", "3"]), step("x", &["4", "9", "9"])]);
    let msg = first_difference(&want, &got).unwrap();
    assert!(msg.contains("step 1") && msg.contains("layer 1 of 3"), "{msg}");
    let head_only = run(vec![step("a", &["1", "2", "3"]), step("x", &["4", "5", "6"])]);
    assert!(first_difference(&want, &head_only).unwrap().contains("output matrix"));
    assert!(first_difference(&want, &want).is_none());
}
