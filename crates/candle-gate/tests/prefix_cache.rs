//! The prefix cache, preemption and speculation never change a bit (invariant mode, and the
//! canonical order at the end; real models): every
//! step's token, logits hash and logprob are the same when a prompt's prefix came from the
//! cache as when it was prefilled cold (hits ending at every offset of a block, any prefill
//! chunk, several sequences sharing cached blocks in one step, after eviction), when a
//! sequence was preempted and recomputed, and when every block hash collides.

use std::sync::Arc;

use candle_gate::engine::{CacheStats, GateConfig, GateMode};
use candle_gate::kv_cache::KV_BLOCK;
use candle_gate::*;

const SMOL: &str = "smollm2-135m-instruct-q4_1";

fn model(name: &str) -> (Arc<Model>, Arc<Policy>) {
    model_in(name, Mode::Invariant)
}

fn model_in(name: &str, mode: Mode) -> (Arc<Model>, Arc<Policy>) {
    let path = registry::resolve(name).expect("run `candle-gate fetch --model all` first");
    let policy = Arc::new(Policy::new(mode));
    (Arc::new(Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap()), policy)
}

/// At least `n` tokens of real text.
fn text_tokens(m: &Model, n: usize, salt: usize) -> Vec<u32> {
    let mut text = String::new();
    let mut i = salt;
    while m.tokenizer.encode(&text).unwrap().len() < n {
        text.push_str(&format!(
            "Note {i}: the ferry to the north island leaves at {} past the hour, carries {} cars, and \
             waits for the bus from the station when it is late. ",
            i * 7 % 60,
            i * 13 % 41 + 2
        ));
        i += 1;
    }
    m.tokenizer.encode(&text).unwrap()[..n].to_vec()
}

fn config(prefill_chunk: usize, caching: bool) -> EngineConfig {
    EngineConfig {
        prefill_chunk,
        max_tokens_per_step: 512,
        record_logit_hashes: true,
        enable_prefix_caching: caching,
        ..Default::default()
    }
}

fn params(max_new_tokens: usize, seeded: bool) -> SamplingParams {
    let mut p = SamplingParams { max_new_tokens, logprobs: true, top_logprobs: 2, ..Default::default() };
    if seeded {
        p.temperature = 0.8;
        p.seed = Some(11);
    }
    p
}

/// What must be identical: each step's token, logits hash, logprob bits, and the fingerprint.
type Bits = Vec<(Vec<u32>, Vec<u64>, Vec<u32>, String)>;

fn bits(o: &Output) -> Bits {
    o.choices
        .iter()
        .map(|c| {
            (
                c.token_ids.clone(),
                c.logit_hashes.clone(),
                c.logprobs.iter().map(|l| l.to_bits()).collect(),
                c.fingerprint.clone(),
            )
        })
        .collect()
}

/// Runs `prompts` together in `engine`; their outputs in order.
fn run_all(engine: &mut Engine, prompts: &[Vec<u32>], p: &SamplingParams) -> Vec<Output> {
    let ids: Vec<_> = prompts.iter().map(|t| engine.submit(Request::new(t.clone(), p.clone())).unwrap()).collect();
    engine.run_to_completion(&ids).unwrap()
}

/// Each prompt alone in a fresh engine without a prefix cache.
fn cold(m: &Arc<Model>, pol: &Arc<Policy>, prompts: &[Vec<u32>], p: &SamplingParams) -> Vec<Bits> {
    prompts
        .iter()
        .map(|t| {
            let mut e = Engine::new(m.clone(), pol.clone(), config(64, false)).unwrap();
            bits(&run_all(&mut e, std::slice::from_ref(t), p)[0])
        })
        .collect()
}

#[test]
fn warm_equals_cold_at_every_offset_and_chunk_and_when_shared_in_one_step() {
    let (m, pol) = model(SMOL);
    let base = text_tokens(&m, 4 * KV_BLOCK + 40, 0);
    // Prompts that share 2, 3 or 4 cached blocks and end 1, 7, 31 or 32 positions further.
    let prompts: Vec<Vec<u32>> = [(2, 1), (2, 7), (3, 31), (3, 32), (4, 1), (4, 17)]
        .iter()
        .map(|&(blocks, r)| base[..blocks * KV_BLOCK + r].to_vec())
        .collect();
    for seeded in [false, true] {
        let p = params(6, seeded);
        let want = cold(&m, &pol, &prompts, &p);
        for chunk in [1, 7, 64, 512] {
            let mut e = Engine::new(m.clone(), pol.clone(), config(chunk, true)).unwrap();
            // The longest prompt warms the cache; then all of them run together, sharing its
            // blocks in the same steps.
            run_all(&mut e, &[base.clone()], &p);
            let outs = run_all(&mut e, &prompts, &p);
            for ((o, want), prompt) in outs.iter().zip(&want).zip(&prompts) {
                let hit = (prompt.len() - 1) / KV_BLOCK * KV_BLOCK;
                assert_eq!(o.cached_tokens, hit, "chunk {chunk}: a prompt of {} tokens", prompt.len());
                assert_eq!(&bits(o), want, "chunk {chunk}, seeded {seeded}: a prompt of {} tokens", prompt.len());
            }
            let s = e.cache_stats();
            assert!(s.prefix_hits > 0 && s.prefix_hits < s.prefix_queries, "{s:?}");
            assert_eq!(e.kv_used_blocks(), 0, "every block back once all finished");
            assert!(e.kv_cached_blocks() > 0);
        }
    }
}

#[test]
fn multi_turn_history_is_a_hit_and_evicted_blocks_recompute_to_the_same_bits() {
    let (m, pol) = model(SMOL);
    let p = params(40, false);
    let turn1 = text_tokens(&m, 3 * KV_BLOCK + 20, 100);
    // The next turn's prompt is the history: the first turn, its answer, a new message.
    let mut e = Engine::new(m.clone(), pol.clone(), config(64, true)).unwrap();
    let o1 = run_all(&mut e, &[turn1.clone()], &p).remove(0);
    assert!(o1.choices[0].token_ids.len() > 20, "{:?}", o1.choices[0].finish_reason);
    let mut turn2 = turn1.clone();
    turn2.extend(&o1.choices[0].token_ids);
    turn2.extend(text_tokens(&m, 20, 200));
    let want = cold(&m, &pol, &[turn2.clone()], &p);
    let o2 = run_all(&mut e, &[turn2.clone()], &p).remove(0);
    // The answer's whole blocks were cached as they were decoded (the last token is never fed).
    let fed = turn1.len() + o1.choices[0].token_ids.len() - 1;
    assert_eq!(o2.cached_tokens, fed / KV_BLOCK * KV_BLOCK);
    assert!(o2.cached_tokens > turn1.len() / KV_BLOCK * KV_BLOCK, "the answer's blocks are hits too");
    assert_eq!(bits(&o2), want[0]);

    // A pool just big enough for one sequence: every new prompt evicts what the last cached.
    let need = (turn2.len() + 40).div_ceil(KV_BLOCK) * KV_BLOCK;
    let mut small =
        Engine::new(m.clone(), pol.clone(), EngineConfig { kv_budget_tokens: need, ..config(64, true) }).unwrap();
    let other = text_tokens(&m, turn2.len(), 300);
    for round in 0..2 {
        let o = run_all(&mut small, &[turn2.clone()], &p).remove(0);
        assert_eq!(bits(&o), want[0], "round {round}");
        run_all(&mut small, &[other.clone()], &p);
    }
    // Reset forgets, and the next run is cold and the same.
    let o = run_all(&mut small, &[turn2.clone()], &p).remove(0);
    assert!(o.cached_tokens == 0, "the other prompt evicted turn2's blocks");
    small.reset_prefix_cache();
    assert_eq!(small.kv_cached_blocks(), 0);
    let o = run_all(&mut small, &[turn2.clone()], &p).remove(0);
    assert_eq!((o.cached_tokens, bits(&o)), (0, want[0].clone()));
}

#[test]
fn a_hash_collision_cannot_serve_wrong_kv() {
    let (m, pol) = model(SMOL);
    let p = params(6, false);
    let a = text_tokens(&m, 3 * KV_BLOCK + 3, 400);
    // b has a's second and third blocks after another first block: every block hash collides
    // with every other, and only the token ids and the parent tell them apart.
    let mut b = text_tokens(&m, KV_BLOCK, 500);
    b.extend(&a[KV_BLOCK..]);
    let mut c = a[..KV_BLOCK].to_vec();
    c.extend(text_tokens(&m, 2 * KV_BLOCK + 3, 600));
    let want = cold(&m, &pol, &[a.clone(), b.clone(), c.clone()], &p);
    let cfg = EngineConfig { collide_prefix_hashes: true, ..config(64, true) };
    let mut e = Engine::new(m.clone(), pol.clone(), cfg).unwrap();
    let oa = run_all(&mut e, &[a.clone()], &p).remove(0);
    let ob = run_all(&mut e, &[b], &p).remove(0);
    let oc = run_all(&mut e, &[c], &p).remove(0);
    let oa2 = run_all(&mut e, &[a], &p).remove(0);
    assert_eq!(
        [oa.cached_tokens, ob.cached_tokens, oc.cached_tokens, oa2.cached_tokens],
        [0, 0, KV_BLOCK, 3 * KV_BLOCK]
    );
    for (o, w) in [&oa, &ob, &oc].iter().zip(&want) {
        assert_eq!(&bits(o), w);
    }
    assert_eq!(bits(&oa2), want[0]);
}

/// `n` requests of 40 to 40 + 9(n - 1) prompt tokens, submitted at once.
fn burst(m: &Model, n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| text_tokens(m, 40 + 9 * i, 700 + 31 * i)).collect()
}

/// A burst of `n` requests in a pool of `blocks` blocks (a third of what they need or less)
/// against the same burst in a pool that never runs out; at least `at_least` preemptions.
fn preempted_equals_uninterrupted(
    gate: GateConfig,
    mode: Mode,
    seeded: bool,
    n: usize,
    max_new: usize,
    blocks: usize,
    at_least: u64,
) {
    let (m, pol) = model_in(SMOL, mode);
    let p = params(max_new, seeded);
    let prompts = burst(&m, n);
    let cfg = |budget: usize| EngineConfig { kv_budget_tokens: budget, gate, ..config(64, true) };
    let mut roomy = Engine::new(m.clone(), pol.clone(), cfg(65536)).unwrap();
    let want: Vec<Bits> = run_all(&mut roomy, &prompts, &p).iter().map(bits).collect();
    assert_eq!(roomy.cache_stats().preemptions, 0);

    let budget = blocks * KV_BLOCK;
    let mut tight = Engine::new(m.clone(), pol.clone(), cfg(budget)).unwrap();
    let ids: Vec<_> = prompts.iter().map(|t| tight.submit(Request::new(t.clone(), p.clone())).unwrap()).collect();
    while tight.has_work() {
        tight.step().unwrap();
        assert!(tight.kv_used_blocks() + tight.kv_cached_blocks() <= budget / KV_BLOCK);
    }
    let got: Vec<Output> = ids.iter().map(|id| tight.take_output(*id).expect("every request finishes once")).collect();
    let CacheStats { preemptions, .. } = tight.cache_stats();
    assert!(preemptions >= at_least, "the pool must force {at_least} preemptions or more, got {preemptions}");
    eprintln!("{n} requests in {blocks} blocks, gate {}: {preemptions} preemptions", gate.describe());
    for (i, (o, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(&bits(o), w, "request {i} ({preemptions} preemptions, gate {})", gate.describe());
    }
    assert_eq!(tight.kv_used_blocks(), 0);
}

#[test]
fn preempted_equals_uninterrupted_greedy_and_seeded() {
    preempted_equals_uninterrupted(GateConfig::off(), Mode::Invariant, false, 16, 40, 16, 3);
    preempted_equals_uninterrupted(GateConfig::off(), Mode::Invariant, true, 16, 40, 16, 3);
}

#[test]
fn preempted_equals_uninterrupted_when_the_gate_rewrote_positions() {
    // Every step rechecked (each position's K/V rewritten by the reference lane) ...
    preempted_equals_uninterrupted(
        GateConfig::with_deep(GateMode::Always, 0.0, 0.0).unwrap(),
        Mode::Invariant,
        false,
        8,
        40,
        5,
        2,
    );
    // ... and every recheck deep (the whole history rebuilt in the reference lane).
    let deep = GateConfig::with_deep(GateMode::Always, 0.0, f32::MAX).unwrap();
    preempted_equals_uninterrupted(deep, Mode::Invariant, true, 8, 40, 5, 2);
}

/// The canonical order (the whole forward a GPU reproduces, docs/CANONICAL.md) keeps the same
/// promises: a prefix-cache hit at any offset and chunk, a preempted and recomputed sequence,
/// and prompt-lookup speculation give a cold, plain, uninterrupted run's bits, greedy and
/// seeded. On the Qwen model, whose Q4_K and Q6_K matrices are what the packed kernels read.
#[test]
fn canonical_mode_keeps_every_bit_under_caching_preemption_and_speculation() {
    const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";
    let (m, pol) = model_in(QWEN, Mode::Canonical);
    let base = text_tokens(&m, 3 * KV_BLOCK + 10, 40);
    let prompts: Vec<Vec<u32>> =
        [(1, 1), (2, 9), (3, 3)].iter().map(|&(b, r)| base[..b * KV_BLOCK + r].to_vec()).collect();
    for seeded in [false, true] {
        let p = params(5, seeded);
        let want = cold(&m, &pol, &prompts, &p);
        for chunk in [7, 512] {
            let mut e = Engine::new(m.clone(), pol.clone(), config(chunk, true)).unwrap();
            run_all(&mut e, &[base.clone()], &p);
            let outs = run_all(&mut e, &prompts, &p);
            for (o, want) in outs.iter().zip(&want) {
                assert!(o.cached_tokens > 0);
                assert_eq!(&bits(o), want, "canonical, chunk {chunk}, seeded {seeded}");
            }
        }
        // Prompt lookup: the same tokens, logits and logprobs as plain decoding.
        let spec =
            EngineConfig { speculative: Some(candle_gate::engine::SpeculativeConfig::ngram(4)), ..config(64, false) };
        let mut e = Engine::new(m.clone(), pol.clone(), spec).unwrap();
        for (t, want) in prompts.iter().zip(&want) {
            assert_eq!(&bits(&run_all(&mut e, std::slice::from_ref(t), &p)[0]), want, "canonical, speculating");
        }
        assert!(e.spec_stats().accepted_tokens > 0, "no draft was kept: {:?}", e.spec_stats());
    }
    preempted_equals_uninterrupted(GateConfig::off(), Mode::Canonical, false, 8, 24, 6, 2);
    preempted_equals_uninterrupted(GateConfig::off(), Mode::Canonical, true, 8, 24, 6, 2);
}
