//! The batched forward on the real default model: rows of several sequences — decode rows and
//! prefill chunks mixed — in one call give logits bitwise equal to each sequence run alone.

use std::sync::Arc;

use candle_gate::decoder::{KvCache, SeqRows};
use candle_gate::engine::{Choice, FinishReason, InjectedFault};
use candle_gate::*;

fn model(mode: Mode) -> (Model, Arc<Policy>) {
    model_named(registry::DEFAULT_MODEL, mode)
}

const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

fn model_named(name: &str, mode: Mode) -> (Model, Arc<Policy>) {
    let path = registry::resolve(name).expect("run `candle-gate fetch --model all` first");
    let policy = Arc::new(Policy::new(mode));
    (Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap(), policy)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A sequence's script: its prompt, then how many tokens each forward call feeds it.
struct Script {
    tokens: Vec<u32>,
    feeds: Vec<usize>,
}

/// Runs every script alone (each `feeds` entry one call), recording the logits after each call.
fn run_alone(m: &Model, p: &Policy, s: &Script) -> Vec<Vec<u32>> {
    let mut cache = m.decoder.new_cache();
    let mut at = 0;
    let mut out = vec![];
    for &n in &s.feeds {
        let r = m
            .decoder
            .forward(p, &mut [SeqRows { cache: &mut cache, tokens: &s.tokens[at..at + n], logit_rows: 1 }])
            .unwrap();
        out.push(bits(r[0].as_ref().unwrap()));
        at += n;
    }
    out
}

/// Runs all scripts together: call i feeds every script its i-th entry in one forward.
fn run_together(m: &Model, p: &Policy, scripts: &[Script]) -> Vec<Vec<Vec<u32>>> {
    let mut caches: Vec<KvCache> = scripts.iter().map(|_| m.decoder.new_cache()).collect();
    let mut at = vec![0; scripts.len()];
    let mut out = vec![vec![]; scripts.len()];
    let calls = scripts.iter().map(|s| s.feeds.len()).max().unwrap();
    for c in 0..calls {
        let mut batch = vec![];
        let mut who = vec![];
        for (i, (s, cache)) in scripts.iter().zip(caches.iter_mut()).enumerate() {
            if let Some(&n) = s.feeds.get(c) {
                batch.push(SeqRows { cache, tokens: &s.tokens[at[i]..at[i] + n], logit_rows: 1 });
                who.push(i);
                at[i] += n;
            }
        }
        let r = m.decoder.forward(p, &mut batch).unwrap();
        for (i, l) in who.into_iter().zip(r) {
            out[i].push(bits(&l.unwrap()));
        }
    }
    out
}

fn scripts(m: &Model) -> Vec<Script> {
    let t = |s: &str| m.tokenizer.encode(s).unwrap();
    let long = t("In the beginning of the twentieth century, the city grew quickly as factories opened along the river and workers arrived from the countryside looking for jobs, housing and schools for their children, and the old town walls were taken down to make room.");
    let v = vec![
        // prefill 5 then decode one token at a time
        Script { tokens: t("The capital of France is Paris and the capital of Spain is Madrid, while the capital of Italy is Rome."), feeds: vec![5, 1, 1, 1, 1, 1, 1] },
        // one long prefill chunk arriving while others decode
        Script { tokens: long.clone(), feeds: vec![1, 1, long.len() - 4, 1, 1] },
        // chunked prefill of odd sizes mixed with decodes
        Script { tokens: t("Water boils at one hundred degrees Celsius at sea level, but at high altitude it boils at a lower temperature."), feeds: vec![3, 7, 1, 1, 2, 1] },
        Script { tokens: t("1, 2, 3, 4, 5, 6, 7"), feeds: vec![1, 1, 1, 1, 1, 1, 1, 1] },
    ];
    for s in &v {
        assert!(s.feeds.iter().sum::<usize>() <= s.tokens.len());
    }
    v
}

#[test]
fn batched_forward_is_bitwise_equal_to_alone_invariant() {
    let (m, p) = model(Mode::Invariant);
    assert_mixes_equal_alone(&m, &p);
}

/// The same on Qwen2.5 0.5B: Q5_0, Q8_0, Q4_K and Q6_K weights, projection biases, NeoX RoPE, GQA.
#[test]
fn qwen_batched_forward_is_bitwise_equal_to_alone_invariant() {
    let (m, p) = model_named(QWEN, Mode::Invariant);
    assert_mixes_equal_alone(&m, &p);
}

/// Candle's own dispatch on the Qwen file is where the problem lives natively: its x86 CPU
/// matmul repacks Q4_K and Q6_K weights for inputs of more than one row (the 0.5B's
/// `ffn_down`), so a sequence's logits change with what shares its step.
#[test]
#[cfg(target_arch = "x86_64")]
fn qwen_native_dispatch_is_not_batch_invariant() {
    let (m, p) = model_named(QWEN, Mode::Native);
    let sc = scripts(&m);
    let alone: Vec<_> = sc.iter().map(|s| run_alone(&m, &p, s)).collect();
    assert_ne!(run_together(&m, &p, &sc), alone, "Candle's dispatch gave identical bits batched and alone");
}

fn assert_mixes_equal_alone(m: &Model, p: &Policy) {
    let sc = scripts(m);
    let alone: Vec<_> = sc.iter().map(|s| run_alone(m, p, s)).collect();
    // several batch mixes: all four, pairs, and reversed order
    let together = run_together(m, p, &sc);
    assert_eq!(together, alone, "all four together");
    for pair in [[0usize, 1], [2, 3], [1, 3]] {
        let sub: Vec<Script> =
            pair.iter().map(|&i| Script { tokens: sc[i].tokens.clone(), feeds: sc[i].feeds.clone() }).collect();
        let tg = run_together(m, p, &sub);
        for (j, &i) in pair.iter().enumerate() {
            assert_eq!(tg[j], alone[i], "pair {pair:?}, sequence {i}");
        }
    }
    let rev: Vec<Script> =
        sc.iter().rev().map(|s| Script { tokens: s.tokens.clone(), feeds: s.feeds.clone() }).collect();
    let tg = run_together(m, p, &rev);
    for (j, t) in tg.iter().enumerate() {
        assert_eq!(*t, alone[sc.len() - 1 - j], "reversed, sequence {}", sc.len() - 1 - j);
    }
}

#[test]
fn native_cpu_path_is_also_exact_for_q4_1() {
    // Candle's generic CPU quantized matmul computes each element the same way at every row
    // count; the test pins that down so a Candle upgrade that changes it shows. Candle switches
    // to run-time dispatched repacked kernels only for Q4K, Q6K (m > 1) and Q8_0 (on VNNI hosts)
    // with k a multiple of 256: no weight of the default model qualifies, so the generic path
    // runs on every host. That premise is checked here, not assumed.
    let (m, p) = model(Mode::Native);
    use candle_core::quantized::GgmlDType as D;
    for w in m.decoder.layers.iter().flat_map(|l| l.linears()).chain([&m.decoder.lm_head]) {
        let (d, k) = (w.dtype(), w.dims().1);
        assert!(
            !(matches!(d, D::Q4K | D::Q6K | D::Q8_0) && k % 256 == 0),
            "{w:?} could take Candle's host-dispatched repacked path"
        );
    }
    let sc = scripts(&m);
    let alone: Vec<_> = sc.iter().map(|s| run_alone(&m, &p, s)).collect();
    assert_eq!(run_together(&m, &p, &sc), alone);
}

/// The lane the gate is tested on changes a sequence's logits with what shares its step, by
/// construction (split-K follows the row count), on every host.
#[test]
fn split_k_f16_lane_is_not_batch_invariant() {
    let (m, p) = model(Mode::SplitKF16);
    let sc = scripts(&m);
    let alone: Vec<_> = sc.iter().map(|s| run_alone(&m, &p, s)).collect();
    assert_ne!(run_together(&m, &p, &sc), alone, "split_k_f16 gave identical bits batched and alone");
}

#[test]
fn two_runs_are_bitwise_equal() {
    for mode in [Mode::Invariant, Mode::Gemm, Mode::RowSplit, Mode::SplitKF16] {
        let (m, p) = model(mode);
        let sc = scripts(&m);
        assert_eq!(run_together(&m, &p, &sc), run_together(&m, &p, &sc), "{mode:?}");
    }
}

#[test]
fn engine_outputs_do_not_depend_on_batch_in_invariant_mode() {
    let (m, p) = model(Mode::Invariant);
    let m = Arc::new(m);
    let prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn"];
    let req = |s: &str| Request::new(m.tokenizer.encode(s).unwrap(), SamplingParams::greedy(12));
    let cfg = EngineConfig { record_logit_hashes: true, ..Default::default() };
    let mut alone = vec![];
    for s in prompts {
        let mut e = Engine::new(m.clone(), p.clone(), cfg.clone()).unwrap();
        let id = e.submit(req(s)).unwrap();
        alone.push(e.run_to_completion(&[id]).unwrap().remove(0).choices.remove(0));
    }
    let mut e = Engine::new(m.clone(), p.clone(), cfg.clone()).unwrap();
    let ids: Vec<_> = prompts.iter().map(|s| e.submit(req(s)).unwrap()).collect();
    let together: Vec<_> = e.run_to_completion(&ids).unwrap().into_iter().map(|mut o| o.choices.remove(0)).collect();
    for (a, b) in alone.iter().zip(&together) {
        assert_eq!(a.token_ids, b.token_ids);
        assert_eq!(a.logit_hashes, b.logit_hashes);
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(
            a.margins.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.margins.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_batch_in_invariant_mode() {
    let (m, p) = model(Mode::Invariant);
    let m = Arc::new(m);
    let prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"];
    let params = |i: u64| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(100 + i),
        n: 2,
        ..SamplingParams::greedy(16)
    };
    let req = |i: usize| Request::new(m.tokenizer.encode(prompts[i]).unwrap(), params(i as u64));
    let mut alone = vec![];
    for i in 0..prompts.len() {
        let mut e = Engine::new(m.clone(), p.clone(), EngineConfig::default()).unwrap();
        let id = e.submit(req(i)).unwrap();
        alone.push(e.run_to_completion(&[id]).unwrap().remove(0));
    }
    let mut e = Engine::new(m.clone(), p.clone(), EngineConfig::default()).unwrap();
    let ids: Vec<_> = (0..prompts.len()).rev().map(|i| e.submit(req(i)).unwrap()).collect();
    let mut together = e.run_to_completion(&ids).unwrap();
    together.reverse();
    for (a, b) in alone.iter().zip(&together) {
        assert_eq!(a.seed, b.seed);
        assert_eq!(a.choices.len(), 2);
        for (x, y) in a.choices.iter().zip(&b.choices) {
            assert_eq!((x.index, &x.token_ids), (y.index, &y.token_ids));
        }
        assert_ne!(a.choices[0].token_ids, a.choices[1].token_ids, "two choices drew the same 16 tokens");
    }
}

#[test]
fn bad_forward_input_is_an_error_not_a_panic() {
    let (m, p) = model(Mode::Invariant);
    let mut c = m.decoder.new_cache();
    let e = m.decoder.forward(&p, &mut [SeqRows { cache: &mut c, tokens: &[999_999], logit_rows: 1 }]).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    let e = m.decoder.forward(&p, &mut [SeqRows { cache: &mut c, tokens: &[], logit_rows: 1 }]).unwrap_err();
    assert!(e.to_string().contains("no tokens"), "{e}");
}

/// The reference lane gives a position the same bits whether it is computed alone or together
/// with others in one pass (the deep recheck rebuilds many positions at once), with dense or
/// blockwise weights, and a recheck (`reference_step` over a cache the reference lane wrote)
/// reproduces that position exactly.
#[test]
fn reference_lane_rows_are_independent_of_how_many_share_a_pass() {
    use candle_gate::reference::ReferenceWeights::{Blockwise, Dense};
    let (m, _) = model(Mode::Invariant);
    let toks = m.tokenizer.encode("Water boils at 100 degrees Celsius because").unwrap();
    assert!(toks.len() >= 6);
    let mut one = m.decoder.new_cache();
    let mut per_position = vec![];
    for &t in &toks {
        per_position.push(bits(&m.decoder.reference_append(&mut one, t, Dense).unwrap()));
    }
    for how in [Dense, Blockwise] {
        // first half one at a time, the rest in one pass
        let mut c = m.decoder.new_cache();
        let half = toks.len() / 2;
        for &t in &toks[..half] {
            m.decoder.reference_append(&mut c, t, how).unwrap();
        }
        let last = m.decoder.reference_extend(&mut c, &toks[half..], how).unwrap();
        assert_eq!(bits(&last), *per_position.last().unwrap(), "{how:?}");
        for l in 0..m.decoder.cfg.n_layer {
            assert_eq!(bits(&c.layer(l, false)), bits(&one.layer(l, false)), "{how:?} layer {l} K");
            assert_eq!(bits(&c.layer(l, true)), bits(&one.layer(l, true)), "{how:?} layer {l} V");
        }
        // a recheck of position 3 over the reference lane's own prefix
        let mut c4 = c.clone();
        c4.truncate(4);
        assert_eq!(bits(&m.decoder.reference_step(&mut c4, toks[3], how).unwrap()), per_position[3]);
    }
}

/// A step whose forward fails halfway through its layers (after K/V were written) leaves every
/// sequence and cache as it was: the engine goes on, and every request's output is bitwise the
/// one of a run without the failure. A failure in one request's gate finishes that request
/// with `Error` and changes nothing for the others.
#[test]
fn a_failing_step_harms_no_other_request() {
    let (m, p) = model(Mode::Invariant);
    let m = Arc::new(m);
    let prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"];
    let run = |fault: Option<InjectedFault>| -> (Vec<Choice>, usize) {
        let gate = GateConfig::new(GateMode::Always, 0.0).unwrap();
        let cfg = EngineConfig {
            record_logit_hashes: true,
            inject_fault: fault,
            gate,
            prefill_chunk: 4,
            ..Default::default()
        };
        let mut e = Engine::new(m.clone(), p.clone(), cfg).unwrap();
        let ids: Vec<_> = prompts
            .iter()
            .map(|s| e.submit(Request::new(m.tokenizer.encode(s).unwrap(), SamplingParams::greedy(8))).unwrap())
            .collect();
        let mut failed_steps = 0;
        while ids.iter().any(|id| !e.is_finished(*id)) {
            if let Err(err) = e.step() {
                assert!(err.to_string().contains("injected fault"), "{err}");
                failed_steps += 1;
            }
        }
        (ids.iter().map(|id| e.take_output(*id).unwrap().choices.remove(0)).collect(), failed_steps)
    };
    let (clean, _) = run(None);
    let same =
        |a: &Choice, b: &Choice| a.token_ids == b.token_ids && a.logit_hashes == b.logit_hashes && a.text == b.text;
    // Step 2 still prefills (chunks of 4), step 5 decodes every request.
    for step in [2, 5] {
        let (out, failed) = run(Some(InjectedFault::Forward { step }));
        assert_eq!(failed, 1);
        for (k, (a, b)) in clean.iter().zip(&out).enumerate() {
            assert!(same(a, b), "after a failed forward at step {step}, request {} changed", k + 1);
        }
    }
    let (out, failed) = run(Some(InjectedFault::Gate { step: 6, id: 2 }));
    assert_eq!(failed, 0);
    for (k, (a, b)) in clean.iter().zip(&out).enumerate() {
        if k + 1 == 2 {
            assert_eq!(b.finish_reason, FinishReason::Error);
            assert!(b.error.as_deref().unwrap().contains("injected fault"));
            assert!(b.token_ids.len() < a.token_ids.len() && a.token_ids.starts_with(&b.token_ids));
        } else {
            assert!(same(a, b), "a failure in request 2's gate changed request {}", k + 1);
        }
    }
}

/// Resident set size of this process, from /proc (Linux).
#[cfg(target_os = "linux")]
fn rss_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Set in the child process that measures memory alone.
#[cfg(target_os = "linux")]
const MEASURING_ALONE: &str = "CANDLE_GATE_MEASURING_ALONE";

/// tokenizers 0.23 caches BPE words in thread-locals that outlive the tokenizer; candle-gate
/// turns that cache off. Built 60 times, each encoding 4,000 distinct words, a tokenizer whose
/// cache stayed on would leave 60 x 4,000 entries (tens of MB) behind.
///
/// The resident set counts every thread of the process, and the other tests of this file load
/// models on parallel threads; so the measurement runs in a child process that runs this test
/// alone, and this test checks that the child measured.
#[test]
#[cfg(target_os = "linux")]
fn building_tokenizers_again_and_again_does_not_grow_memory() {
    const NAME: &str = "building_tokenizers_again_and_again_does_not_grow_memory";
    if std::env::var_os(MEASURING_ALONE).is_none() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(MEASURING_ALONE, "1")
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "the measuring child failed:\n{log}");
        assert!(log.contains("60 tokenizers built and dropped"), "the child did not measure:\n{log}");
        return;
    }
    let path = registry::resolve(registry::DEFAULT_MODEL).expect("run `candle-gate fetch` first");
    let f = candle_gate::gguf::GgufFile::open(&path).unwrap();
    // Letters only (SmolLM2 splits digits off), so each word is one cache entry.
    let word = |i: u32| -> String {
        let mut h = i.wrapping_mul(2654435761) | 1;
        (0..8)
            .map(|_| {
                let c = (b'a' + (h % 26) as u8) as char;
                h /= 26;
                c
            })
            .collect()
    };
    let text: String = (0..4000u32).map(|i| word(i) + " ").collect();
    let round = || {
        let t = candle_gate::tokenizer::GgufTokenizer::from_gguf(&f).unwrap();
        assert!(t.encode(&text).unwrap().len() > 4000);
    };
    for _ in 0..10 {
        round(); // the allocator's own high-water mark
    }
    let before = rss_bytes().expect("/proc/self/statm");
    for _ in 0..60 {
        round();
    }
    let grown = rss_bytes().unwrap().saturating_sub(before);
    eprintln!("60 tokenizers built and dropped: the process grew by {} KB", grown >> 10);
    assert!(grown < 8 << 20, "60 tokenizers built and dropped grew the process by {} MB", grown >> 20);
}
