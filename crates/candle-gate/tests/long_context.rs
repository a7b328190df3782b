//! Long contexts on the real models, through the paged cache and the split attention kernel:
//! a sequence's logits at every checkpoint (across the 256-position split boundaries) and at
//! every decode step after its prompt are bitwise the same whatever its prefill chunks, its
//! neighbours in the step (decode rows and prefill chunks), the number of threads, and where
//! its blocks are in the pool.

use std::sync::Arc;

use candle_gate::decoder::{argmax_margin, SeqRows};
use candle_gate::kv_cache::{KvCache, KvDtype, KvPool};
use candle_gate::ops::hash_bits;
use candle_gate::*;

const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

fn model(name: &str) -> (Model, Arc<Policy>) {
    let path = registry::resolve(name).expect("run `candle-gate fetch --model all` first");
    let policy = Arc::new(Policy::new(Mode::Invariant));
    (Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap(), policy)
}

/// At least `n` tokens of real text (a paragraph whose numbers change each time).
fn text_tokens(m: &Model, n: usize, salt: usize) -> Vec<u32> {
    let mut text = String::new();
    let mut i = salt;
    loop {
        text.push_str(&format!(
            "Section {i}. The river rose {} centimetres overnight, and the {} families on the east bank moved their \
             belongings to the school on the hill, where volunteers served soup until {} o'clock. ",
            i * 7 % 93,
            i * 13 % 41 + 2,
            i % 12 + 1
        ));
        let t = m.tokenizer.encode(&text).unwrap();
        if t.len() >= n {
            return t[..n].to_vec();
        }
        i += 1;
    }
}

/// How one run feeds the sequence under test.
struct Plan {
    /// Tokens per forward call, never crossing a checkpoint.
    piece: usize,
    /// Other sequences in every call: each prefills 5 tokens in its first call, then decodes.
    neighbours: usize,
    threads: usize,
    /// Take the sequence's blocks from a pool whose free list was shuffled.
    scatter: bool,
    dtype: KvDtype,
}

/// The logits hash at each checkpoint, then at each of `decode` greedy steps after the prompt.
fn run(m: &Model, p: &Policy, prompt: &[u32], checkpoints: &[usize], decode: usize, plan: &Plan) -> Vec<(usize, u64)> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(plan.threads).build().unwrap();
    pool.install(|| {
        let lay = m.decoder.cfg.block_layout(plan.dtype);
        let kv = KvPool::unbounded(lay);
        let mut cache = if plan.scatter {
            // Blocks taken and given back in another order leave the free list shuffled.
            let kv = KvPool::bounded(lay, (prompt.len() + decode).div_ceil(candle_gate::kv_cache::KV_BLOCK) + 64);
            kv.shuffle_free_list(0x5EED);
            KvCache::in_pool(kv)
        } else {
            KvCache::in_pool(kv.clone())
        };
        let others: Vec<Vec<u32>> = (0..plan.neighbours).map(|i| text_tokens(m, 700, 1000 + i)).collect();
        let mut other_caches: Vec<KvCache> = others.iter().map(|_| KvCache::in_pool(kv.clone())).collect();
        let mut fed_others = vec![0usize; plan.neighbours];
        let mut out = vec![];
        let mut at = 0;
        let mut step = |cache: &mut KvCache, tokens: &[u32], other_caches: &mut Vec<KvCache>| -> Vec<f32> {
            let mut batch = vec![];
            for ((o, c), f) in others.iter().zip(other_caches.iter_mut()).zip(fed_others.iter_mut()) {
                let n = if *f == 0 { 5 } else { 1 };
                let n = n.min(o.len() - *f);
                if n > 0 {
                    batch.push(SeqRows { cache: c, tokens: &o[*f..*f + n], logit_rows: 1 });
                    *f += n;
                }
            }
            // The sequence under test sits in the middle of the step.
            let mid = batch.len() / 2;
            batch.insert(mid, SeqRows { cache, tokens, logit_rows: 1 });
            let mut r = m.decoder.forward(p, &mut batch).unwrap();
            r.remove(mid).unwrap()
        };
        let mut logits = vec![];
        for &cp in checkpoints {
            while at < cp {
                let n = plan.piece.min(cp - at);
                logits = step(&mut cache, &prompt[at..at + n], &mut other_caches);
                at += n;
            }
            out.push((cp, hash_bits(&logits)));
        }
        assert_eq!(at, prompt.len(), "the last checkpoint is the prompt's end");
        for i in 0..decode {
            let next = [argmax_margin(&logits).0];
            logits = step(&mut cache, &next, &mut other_caches);
            out.push((prompt.len() + 1 + i, hash_bits(&logits)));
        }
        out
    })
}

fn assert_plans_agree(name: &str, len: usize, checkpoints: &[usize], decode: usize, plans: &[Plan]) {
    let (m, p) = model(name);
    let prompt = text_tokens(&m, len, 0);
    let want = run(&m, &p, &prompt, checkpoints, decode, &plans[0]);
    for plan in &plans[1..] {
        let got = run(&m, &p, &prompt, checkpoints, decode, plan);
        let what = format!(
            "{name}: pieces of {}, {} neighbours, {} threads, scattered {}, {:?}",
            plan.piece, plan.neighbours, plan.threads, plan.scatter, plan.dtype
        );
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w, g, "{what}: position {} differs", w.0);
        }
    }
}

fn plans(dtype: KvDtype) -> Vec<Plan> {
    vec![
        Plan { piece: 512, neighbours: 0, threads: 2, scatter: false, dtype },
        Plan { piece: 1, neighbours: 1, threads: 1, scatter: true, dtype },
        Plan { piece: 7, neighbours: 4, threads: 2, scatter: false, dtype },
        Plan { piece: 64, neighbours: 16, threads: 1, scatter: true, dtype },
    ]
}

#[test]
fn smollm2_rows_across_split_boundaries_are_bitwise_stable() {
    let cps = [1, 255, 256, 257, 300];
    assert_plans_agree(registry::DEFAULT_MODEL, 300, &cps, 6, &plans(KvDtype::F16));
    assert_plans_agree(registry::DEFAULT_MODEL, 300, &cps, 6, &plans(KvDtype::F32)[..3]);
}

#[test]
fn qwen_rows_across_split_boundaries_are_bitwise_stable() {
    assert_plans_agree(QWEN, 300, &[1, 255, 256, 257, 300], 6, &plans(KvDtype::F16));
}

/// Past 4,096 positions (sixteen splits and one more), chunked prefill next to a neighbour on
/// one thread with scattered blocks gives the same bits as whole chunks on two.
#[test]
fn smollm2_at_4097_positions_is_bitwise_stable() {
    let plans = [
        Plan { piece: 512, neighbours: 0, threads: 2, scatter: false, dtype: KvDtype::F16 },
        Plan { piece: 64, neighbours: 1, threads: 1, scatter: true, dtype: KvDtype::F16 },
    ];
    assert_plans_agree(registry::DEFAULT_MODEL, 4097, &[4096, 4097], 3, &plans);
}

/// f16 K/V round each stored value once (round to nearest even): the same bits every time,
/// and different bits from f32 storage (so the fingerprint must tell them apart).
#[test]
fn kv_dtype_changes_bits_and_each_is_reproducible() {
    let (m, p) = model(registry::DEFAULT_MODEL);
    let prompt = text_tokens(&m, 40, 3);
    let at = |dtype| {
        let mut c = m.decoder.new_cache_with(dtype);
        let r = m.decoder.forward(&p, &mut [SeqRows { cache: &mut c, tokens: &prompt, logit_rows: 1 }]).unwrap();
        hash_bits(r[0].as_ref().unwrap())
    };
    assert_eq!(at(KvDtype::F16), at(KvDtype::F16));
    assert_ne!(at(KvDtype::F16), at(KvDtype::F32));
}
