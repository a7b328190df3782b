//! Speculation with a draft model, on the real models: the draft lane's caches follow each
//! sequence's history exactly, a failing draft model changes no token, and a draft model of
//! another vocabulary is refused at load.

use std::sync::Arc;

use candle_gate::engine::{Choice, InjectedFault, SpeculativeConfig, SpeculativeMethod};
use candle_gate::*;

const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

fn model(name: &str) -> (Arc<Model>, Arc<Policy>) {
    let path = registry::resolve(name).expect("run `candle-gate fetch --model all` first");
    let policy = Arc::new(Policy::new(Mode::Invariant));
    (Arc::new(Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap()), policy)
}

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "fn main() {\n    let xs = vec![1, 2, 3];\n",
];

/// Runs `PROMPTS` greedily, 24 tokens each, stepping by hand so that a failing step is seen.
fn run(m: &Arc<Model>, draft: Option<Arc<Model>>, p: &Arc<Policy>, cfg: EngineConfig) -> (Vec<Choice>, Engine) {
    let mut e = Engine::with_draft_model(m.clone(), draft, p.clone(), cfg).unwrap();
    let ids: Vec<_> = PROMPTS
        .iter()
        .map(|s| e.submit(Request::new(m.tokenizer.encode(s).unwrap(), SamplingParams::greedy(24))).unwrap())
        .collect();
    while ids.iter().any(|id| !e.is_finished(*id)) {
        e.step().unwrap();
    }
    (ids.iter().map(|id| e.take_output(*id).unwrap().choices.remove(0)).collect(), e)
}

fn draft_cfg(k: usize) -> EngineConfig {
    let speculative = SpeculativeConfig { disable_by_batch_size: 8, ..SpeculativeConfig::draft_model(k) };
    EngineConfig { record_logit_hashes: true, prefill_chunk: 16, speculative: Some(speculative), ..Default::default() }
}

fn same(a: &Choice, b: &Choice) -> bool {
    a.token_ids == b.token_ids && a.logit_hashes == b.logit_hashes && a.fingerprint == b.fingerprint
}

/// The target drafting for itself in `invariant` mode: a row's bits do not depend on what
/// shares its forward, so the draft lane (catching up in chunks, batched with other
/// sequences) computes exactly the target's logits, and every greedy draft is kept — unless
/// the draft lane's cache had drifted from the sequence's history by a single position.
#[test]
fn a_model_drafting_for_itself_has_every_draft_kept() {
    let (m, p) = model(QWEN);
    let (plain, _) = run(&m, None, &p, EngineConfig { record_logit_hashes: true, ..Default::default() });
    for k in [1, 3, 5] {
        let (spec, e) = run(&m, Some(m.clone()), &p, draft_cfg(k));
        for (a, b) in plain.iter().zip(&spec) {
            assert!(same(a, b), "k = {k}: {:?} against {:?}", b.text, a.text);
            // every draft is kept but those past a stop (none here: 24 tokens each)
            assert!(b.draft_tokens > 0 && b.accepted_tokens == b.draft_tokens, "k = {k}: {b:?}");
        }
        assert_eq!(e.draft_failures(), 0);
    }
}

/// A draft model whose forward fails (halfway through its layers) costs that step its drafts
/// and nothing else: the step decodes without them, every token and logits hash is the one
/// without speculation, the engine goes on, and the failure is counted.
#[test]
fn a_failing_draft_model_changes_no_token() {
    let (m, p) = model(QWEN);
    let (plain, _) = run(&m, None, &p, EngineConfig { record_logit_hashes: true, ..Default::default() });
    for step in [3, 6] {
        let cfg = EngineConfig { inject_fault: Some(InjectedFault::Draft { step }), ..draft_cfg(4) };
        let (spec, e) = run(&m, Some(m.clone()), &p, cfg);
        assert!(plain.iter().zip(&spec).all(|(a, b)| same(a, b)), "a draft failure at step {step} changed an output");
        assert_eq!(e.draft_failures(), 1, "step {step}");
        assert!(spec.iter().any(|c| c.accepted_tokens > 0));
    }
}

/// The draft model must share the target's vocabulary; the method and the model go together.
#[test]
fn draft_models_are_checked_at_load() {
    let (qwen, p) = model(QWEN);
    let (smol, _) = model(registry::DEFAULT_MODEL);
    let err = Engine::with_draft_model(qwen.clone(), Some(smol.clone()), p.clone(), draft_cfg(4)).err().unwrap();
    assert_eq!(err.param(), Some("draft_model"));
    assert!(err.to_string().contains("does not share the vocabulary"), "{err}");
    let err = Engine::with_draft_model(qwen.clone(), None, p.clone(), draft_cfg(4)).err().unwrap();
    assert_eq!(err.param(), Some("draft_model"));
    let ngram =
        EngineConfig { speculative: Some(SpeculativeConfig::new(SpeculativeMethod::Ngram)), ..Default::default() };
    let err = Engine::with_draft_model(qwen.clone(), Some(qwen.clone()), p.clone(), ngram).err().unwrap();
    assert_eq!(err.param(), Some("draft_model"));
    // the same vocabulary in another model: Qwen2.5-Coder 1.5B drafted for by 0.5B
    let (big, _) = model("qwen2.5-coder-1.5b-instruct-q4_k_m");
    assert!(Engine::with_draft_model(big, Some(qwen), p, draft_cfg(4)).is_ok());
}
