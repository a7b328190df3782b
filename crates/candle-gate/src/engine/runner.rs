//! The model runner: owns every cache a sequence has (its KV cache, the reference lane's f32
//! cache its deep rechecks build, its draft model's), finds and registers their prefixes in the
//! prefix cache, turns a step's plan into rows for one fast-lane forward, and runs the
//! reference lane when the gate asks. The model sees rows and caches, never sequences; the
//! runner reads sequences and writes none (the scheduler and the decide stage do).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::decoder::SeqRows;
use crate::dispatch::{Lane, Policy, QMatMul};
use crate::error::{Error, Result};
use crate::kv_cache::{BlockLayout, KvCache, KvDtype, KvPool};
use crate::model::Model;
use crate::prefix_cache::{chain_hash, colliding_hash, KV_BLOCK};
use crate::reference::ReferenceWeights;

use super::drafter::Drafter;
use super::gate::Recheck;
use super::scheduler::{KvBlocks, Work};
use super::sequence::{SeqId, Sequence};
use super::EngineConfig;

/// A step's logits: `(index in running, logits)` for every sequence that decides a token.
pub(crate) type StepLogits = Vec<(usize, Vec<f32>)>;

/// What a step's forward gave.
pub(crate) struct StepRun {
    /// Rows it ran.
    pub rows: usize,
    pub logits: StepLogits,
    /// Sequences (index in running) whose own part of the step failed: a resumed sequence's
    /// repaired position, recomputed in the reference lane after its chunk.
    pub failed: Vec<(usize, Error)>,
}

pub(crate) struct Runner {
    pool: Arc<KvPool>,
    slots: HashMap<SeqId, Slot>,
    /// The reference lane's own f32 caches, made by a sequence's first deep recheck. They
    /// outlive a preemption (the resumed sequence takes back what they rebuilt) and go when
    /// the sequence is released.
    references: HashMap<SeqId, KvCache>,
    /// Seeds every chain hash: the model file, the kernel policy and the K/V dtype.
    salt: u64,
    prefix_caching: bool,
    /// The draft model's lane, when the engine speculates with one.
    drafter: Option<Drafter>,
}

/// One running sequence's cache, and the prefix-cache identity of its leading whole blocks.
#[derive(Clone)]
struct Slot {
    cache: KvCache,
    /// `(chain hash, content serial)` of blocks `0..chain.len()`: those this cache found in the
    /// prefix cache or registered there.
    chain: Vec<(u64, u64)>,
}

impl Runner {
    /// A runner whose caches (of `layout`) share one pool of `cfg.kv_budget_tokens` (in whole
    /// blocks); `salt` names what besides the tokens decides a block's bits.
    pub fn new(layout: BlockLayout, draft: Option<Arc<Model>>, cfg: &EngineConfig, salt: u64) -> Self {
        let hash = if cfg.collide_prefix_hashes { colliding_hash } else { chain_hash };
        Runner {
            pool: KvPool::bounded_with(layout, cfg.kv_budget_blocks(), hash),
            slots: HashMap::new(),
            references: HashMap::new(),
            salt,
            prefix_caching: cfg.enable_prefix_caching,
            drafter: draft.map(|d| Drafter::new(d, cfg.kv_dtype, cfg.max_tokens_per_step)),
        }
    }
    pub fn draft_model(&self) -> Option<&Arc<Model>> {
        self.drafter.as_ref().map(|d| d.model())
    }
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// `from`'s cache shared with `to` (another choice of the same prompt): full blocks stay
    /// shared, the first write to a shared block copies it.
    pub fn fork(&mut self, from: SeqId, to: SeqId) {
        let slot = self.slots[&from].clone();
        self.slots.insert(to, slot);
        if let Some(exact) = self.references.get(&from).cloned() {
            self.references.insert(to, exact);
        }
        if let Some(d) = &mut self.drafter {
            d.fork(from, to);
        }
    }
    /// Drops every cache of `id`, which has left the engine.
    pub fn release(&mut self, id: SeqId) {
        self.close(id);
        self.references.remove(&id);
    }

    /// Turns each [`Work::Draft`] of the plan into a [`Work::Verify`] of the draft model's
    /// proposals. While the step speculates (`speculating`), the draft caches of sequences
    /// prefilling a chunk take the same chunk, so that the draft model's prompt is prefilled
    /// with the target's and not in the first decode step. If the draft model fails, those
    /// sequences decode without drafts this step (their tokens never depend on drafts), their
    /// draft caches are dropped, and the error is returned for the engine to count; nothing else
    /// changes. With `fail` the draft model's forward fails halfway (fault injection for tests).
    pub fn propose(
        &mut self,
        lane: &dyn Lane,
        running: &[Sequence],
        plan: &mut [(usize, Work)],
        speculating: bool,
        fail: bool,
    ) -> Option<Error> {
        let drafter = self.drafter.as_mut()?;
        let wanted: Vec<(SeqId, Vec<u32>, usize)> = plan
            .iter()
            .filter_map(|(i, w)| {
                let s = &running[*i];
                match w {
                    Work::Draft(n) => Some((s.id, s.history(s.computed + 1), *n)),
                    Work::Prefill(c) if speculating && s.req.forced_tokens.is_none() => {
                        Some((s.id, s.history(c.end), 0))
                    }
                    _ => None,
                }
            })
            .collect();
        if wanted.is_empty() {
            return None;
        }
        let faulty = FailAfter { lane, calls_left: AtomicUsize::new(drafter.model().decoder.layers.len() * 7 / 2) };
        let lane: &dyn Lane = if fail { &faulty } else { lane };
        let (proposed, error) = match drafter.propose(lane, &wanted) {
            Ok(p) => (p, None),
            Err(e) => {
                wanted.iter().for_each(|(id, _, _)| drafter.close(*id));
                (Vec::new(), Some(e))
            }
        };
        let mut proposed = wanted.iter().zip(proposed).filter(|((_, _, n), _)| *n > 0).map(|(_, d)| d);
        for (_, w) in plan.iter_mut().filter(|(_, w)| matches!(w, Work::Draft(_))) {
            *w = match proposed.next() {
                Some(drafts) => Work::Verify(drafts),
                None => Work::Decode,
            };
        }
        error
    }
    /// Keeps `id`'s first `len` positions: a verification run's rows after its last decided one
    /// go (their blocks back to the pool).
    pub fn truncate(&mut self, id: SeqId, len: usize) {
        self.cache_mut(id).truncate(len);
    }
    fn cache_mut(&mut self, id: SeqId) -> &mut KvCache {
        &mut self.slots.get_mut(&id).expect("a running sequence has a cache").cache
    }

    /// What the gate asked for `s`, whose latest position the fast lane just wrote: the
    /// reference lane's logits for that position.
    pub fn recheck(&mut self, model: &Model, s: &Sequence, what: Recheck, how: ReferenceWeights) -> Result<Vec<f32>> {
        match what {
            Recheck::Position { keep_fast_kv } => self.recheck_position(model, s, how, keep_fast_kv),
            Recheck::Rebuild => self.rebuild_in_reference_lane(model, s, how),
        }
    }

    /// Its K/V replace the fast lane's; with `keep_fast_kv` (the shadow gate) the fast lane's
    /// K/V are put back.
    fn recheck_position(
        &mut self,
        model: &Model,
        s: &Sequence,
        how: ReferenceWeights,
        keep_fast_kv: bool,
    ) -> Result<Vec<f32>> {
        let cache = self.cache_mut(s.id);
        let pos = cache.len() - 1;
        let fed = s.fed_at(pos);
        if !keep_fast_kv {
            return model.decoder.reference_step(cache, fed, how);
        }
        let saved = cache.save_position(pos);
        let ref_logits = model.decoder.reference_step(cache, fed, how);
        cache.restore_position(saved)?;
        ref_logits
    }

    /// Recomputes the sequence in the reference lane from `reference_exact` on (the prompt, then
    /// every token fed so far), in its own f32 cache, and returns the logits of the last position;
    /// the sequence's cache takes the rebuilt positions' K/V (in its dtype). Positions before
    /// `reference_exact` already are what this would compute, so the result is bitwise the same as
    /// rebuilding from position 0: greedy decoding in the reference lane alone. The caller
    /// records that positions up to the cache's length are now exact (`reference_exact`).
    fn rebuild_in_reference_lane(&mut self, model: &Model, s: &Sequence, how: ReferenceWeights) -> Result<Vec<f32>> {
        let cache = &mut self.slots.get_mut(&s.id).expect("a running sequence has a cache").cache;
        let len = cache.len();
        debug_assert_eq!(len, s.req.prompt_tokens.len() + s.steps.len());
        let exact = self.references.entry(s.id).or_insert_with(|| model.decoder.new_cache_with(KvDtype::F32));
        // The latest position is always recomputed: it is the one whose logits are wanted.
        let from = s.reference_exact.min(len - 1).min(exact.len());
        let fed: Vec<u32> = (from..len).map(|i| s.fed_at(i)).collect();
        exact.truncate(from);
        let last = model.decoder.reference_extend(exact, &fed, how)?;
        for pos in from..len {
            for layer in 0..model.decoder.cfg.n_layer {
                cache.write(layer, pos, &exact.read(layer, pos, false), &exact.read(layer, pos, true))?;
            }
        }
        Ok(last)
    }

    /// Registers `s`'s whole blocks that hold the fast lane's own K/V (see
    /// [`Sequence::clean_prefix`]) in the prefix cache.
    pub fn publish(&mut self, s: &Sequence) {
        if !self.prefix_caching {
            return;
        }
        let Some(slot) = self.slots.get_mut(&s.id) else { return };
        let clean = s.clean_prefix().min(s.computed).min(slot.cache.len());
        if slot.chain.len() >= clean / KV_BLOCK {
            return; // most steps: no block filled since the last one
        }
        let ids = slot.cache.block_ids();
        while slot.chain.len() < clean / KV_BLOCK {
            let b = slot.chain.len();
            let tokens: Vec<u32> = (b * KV_BLOCK..(b + 1) * KV_BLOCK).map(|i| s.fed_at(i)).collect();
            let (parent_hash, parent_serial) = slot.chain.last().copied().unwrap_or((self.salt, 0));
            let hash = self.pool.hash_block(parent_hash, &tokens);
            let serial = self.pool.register(ids[b], hash, parent_serial, &tokens);
            slot.chain.push((hash, serial));
        }
    }

    /// Forgets every cached prefix; the running caches will register their blocks again.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
        for slot in self.slots.values_mut() {
            slot.chain.clear();
        }
    }

    /// Runs the plan's rows in one forward: each decode sequence's latest choice, each prefill
    /// chunk's positions (the prompt's, or a resumed sequence's history). On success returns
    /// the number of rows and, in plan order, the logits of every sequence that wanted them; on
    /// an error nothing changed (the forward rolls its caches back).
    /// A resumed sequence's chunk that ends at a position the gate had repaired is followed by
    /// that position's reference-lane step, as the gate ran it (a failure there is that
    /// sequence's alone: [`StepRun::failed`]).
    /// With `fail_midway` the forward fails halfway through its layers (fault injection for
    /// tests: the caches have been written by then and must be rolled back).
    pub fn run(
        &mut self,
        model: &Model,
        policy: &Policy,
        reference: ReferenceWeights,
        running: &[Sequence],
        plan: &[(usize, Work)],
        fail_midway: bool,
    ) -> Result<StepRun> {
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|(i, w)| {
                let s = &running[*i];
                match w {
                    Work::Decode => vec![s.fed_last()],
                    Work::Prefill(c) => c.clone().map(|p| s.fed_at(p)).collect(),
                    Work::Verify(d) => std::iter::once(s.fed_last()).chain(d.iter().copied()).collect(),
                    Work::Draft(_) => unreachable!("the runner proposes drafts before the forward"),
                }
            })
            .collect();
        // The caches leave the map for the call (the forward needs them all mutably at once).
        let mut slots: Vec<Slot> = plan.iter().map(|(i, _)| self.slots.remove(&running[*i].id).unwrap()).collect();
        let result = {
            let mut batch = Vec::with_capacity(plan.len());
            for (((i, work), tokens), slot) in plan.iter().zip(&tokens).zip(slots.iter_mut()) {
                let s = &running[*i];
                let logit_rows = match work {
                    Work::Decode | Work::Verify(_) | Work::Draft(_) => tokens.len(),
                    Work::Prefill(c) => (c.end == s.req.prompt_tokens.len() && s.steps.is_empty()) as usize,
                };
                batch.push(SeqRows { cache: &mut slot.cache, tokens, logit_rows });
            }
            let rows: usize = batch.iter().map(|b| b.tokens.len()).sum();
            let faulty = FailAfter { lane: policy, calls_left: AtomicUsize::new(model.decoder.layers.len() * 7 / 2) };
            let lane: &dyn Lane = if fail_midway { &faulty } else { policy };
            model.decoder.forward_in(lane, &mut batch, None).map(|l| (rows, l))
        };
        for ((i, _), slot) in plan.iter().zip(slots) {
            self.slots.insert(running[*i].id, slot);
        }
        let (rows, logits) = result?;
        let mut run = StepRun { rows, logits: Vec::new(), failed: Vec::new() };
        for ((i, work), lg) in plan.iter().zip(logits) {
            let s = &running[*i];
            if let Work::Prefill(c) = work {
                if s.repaired_at(c.end - 1) {
                    let cache = self.cache_mut(s.id);
                    if let Err(e) = model.decoder.reference_step(cache, s.fed_at(c.end - 1), reference) {
                        run.failed.push((*i, e));
                    }
                }
            }
            if let Some(lg) = lg {
                run.logits.push((*i, lg));
            }
        }
        Ok(run)
    }
}

/// The scheduler's view of the pool: block accounting, and opening and closing caches.
impl KvBlocks for Runner {
    /// Opens `s`'s cache with the longest cached prefix of its history that it may take, and
    /// returns how many positions that is. A new request takes whole blocks of its prompt
    /// short of its last position (whose logits it needs); a preempted one whole blocks of
    /// its history before the first position the gate rewrote.
    fn open(&mut self, s: &Sequence) -> usize {
        let limit = match (self.prefix_caching, s.is_resuming()) {
            (false, _) => 0,
            (true, false) => s.req.prompt_tokens.len() - 1,
            (true, true) => s.clean_prefix().min(s.target()),
        };
        let tokens: Vec<u32> = (0..limit / KV_BLOCK * KV_BLOCK).map(|i| s.fed_at(i)).collect();
        let mut hashes = Vec::with_capacity(tokens.len() / KV_BLOCK);
        for block in tokens.chunks_exact(KV_BLOCK) {
            hashes.push(self.pool.hash_block(hashes.last().copied().unwrap_or(self.salt), block));
        }
        let hits = self.pool.lookup(&hashes, &tokens);
        let chain = hits.iter().zip(hashes).map(|(h, hash)| (hash, h.2)).collect();
        self.slots.insert(s.id, Slot { cache: KvCache::from_hits(self.pool.clone(), &hits), chain });
        hits.len() * KV_BLOCK
    }

    /// Puts back what a preempted sequence's deep rechecks had rebuilt (positions
    /// `..reference_exact`, from its own f32 reference cache), as the engine's cache held them.
    /// Returns the positions its cache now holds.
    fn restore(&mut self, s: &Sequence) -> Result<usize> {
        let cache = &mut self.slots.get_mut(&s.id).expect("an open cache").cache;
        if let (Some(exact), true) = (self.references.get(&s.id), s.reference_exact > cache.len()) {
            let from = cache.len();
            cache.extend(s.reference_exact - from)?;
            for pos in from..s.reference_exact {
                for layer in 0..cache.layout().n_layer {
                    cache.write(layer, pos, &exact.read(layer, pos, false), &exact.read(layer, pos, true))?;
                }
            }
        }
        Ok(cache.len())
    }

    fn available_blocks(&self) -> usize {
        self.pool.available_blocks().unwrap_or(usize::MAX)
    }
    fn blocks_to_extend(&self, id: SeqId, rows: usize) -> usize {
        self.slots[&id].cache.blocks_to_extend(rows)
    }
    /// Drops `id`'s KV cache (its blocks back to the pool, the cached ones stay cached) and its
    /// draft cache; a reference cache stays for when it resumes.
    fn close(&mut self, id: SeqId) {
        self.slots.remove(&id);
        if let Some(d) = &mut self.drafter {
            d.close(id);
        }
    }
}

/// A lane whose matmuls fail after a number of calls.
struct FailAfter<'a> {
    lane: &'a dyn Lane,
    calls_left: AtomicUsize,
}

impl Lane for FailAfter<'_> {
    fn matmul_into(&self, w: &QMatMul, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()> {
        if self.calls_left.fetch_sub(1, Ordering::Relaxed) == 0 {
            return Err(Error::Engine("injected fault halfway through the forward".into()));
        }
        self.lane.matmul_into(w, x, m, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Request;
    use crate::kv_cache::KvDtype;
    use crate::sampling::SamplingParams;

    const LAYOUT: BlockLayout = BlockLayout { n_layer: 2, n_kv_head: 1, head_dim: 4, dtype: KvDtype::F32 };

    fn runner(blocks: usize, prefix_caching: bool) -> Runner {
        let cfg = EngineConfig {
            kv_budget_tokens: blocks * KV_BLOCK,
            enable_prefix_caching: prefix_caching,
            ..EngineConfig::default()
        };
        Runner::new(LAYOUT, None, &cfg, 7)
    }
    fn seq(id: u64, prompt: Vec<u32>) -> Sequence {
        Sequence::new(SeqId(id), id, Request::new(prompt, SamplingParams::greedy(8)), 0)
    }
    /// Writes positions `from..to` of `id`'s cache as the forward would, each value its position.
    fn fill(r: &mut Runner, id: SeqId, to: usize) {
        let cache = r.cache_mut(id);
        let from = cache.len();
        cache.extend(to - from).unwrap();
        for pos in from..to {
            for layer in 0..LAYOUT.n_layer {
                let v = [pos as f32; 4];
                cache.write(layer, pos, &v, &v).unwrap();
            }
        }
    }

    #[test]
    fn a_published_prefix_is_found_in_whole_blocks_short_of_the_last_prompt_position() {
        let mut r = runner(8, true);
        let prompt: Vec<u32> = (0..70).collect();
        let mut a = seq(1, prompt.clone());
        assert_eq!(r.open(&a), 0);
        fill(&mut r, a.id, 70);
        a.computed = 70;
        r.publish(&a);
        assert_eq!(r.pool().used_blocks(), 3);
        // the same prompt: two whole blocks; its last position is computed again for its logits
        let b = seq(2, prompt.clone());
        assert_eq!(r.open(&b), 64);
        assert_eq!(r.blocks_to_extend(b.id, 7), 1, "positions 64..71 need a block of their own");
        // a prompt of exactly 64 takes one block only: the 64th position's logits are wanted
        assert_eq!(r.open(&seq(3, prompt[..64].to_vec())), 32);
        r.release(SeqId(3));
        // the salt is part of every chain hash: another runner's blocks are not these
        let mut other = Runner::new(LAYOUT, None, &EngineConfig::default(), 8);
        assert_eq!(other.open(&seq(4, prompt.clone())), 0);
        // a's partial block goes back when it leaves; b still holds the two whole ones
        r.release(a.id);
        assert_eq!((r.pool().used_blocks(), r.pool().cached_blocks(), r.available_blocks()), (2, 0, 6));
        // ... which stay cached when b leaves too, and can be taken again
        r.release(b.id);
        assert_eq!((r.pool().used_blocks(), r.pool().cached_blocks(), r.available_blocks()), (0, 2, 8));
        // without prefix caching nothing is found
        let mut off = runner(8, false);
        assert_eq!(off.open(&b), 0);
    }

    #[test]
    fn a_reference_cache_outlives_a_preemption_and_restores_what_it_rebuilt() {
        let mut r = runner(8, false);
        let mut s = seq(1, (0..40).collect());
        r.open(&s);
        fill(&mut r, s.id, 40);
        let mut exact = KvCache::new(LAYOUT);
        exact.extend(36).unwrap();
        for pos in 0..36 {
            for layer in 0..LAYOUT.n_layer {
                cache_write(&mut exact, layer, pos, -(pos as f32));
            }
        }
        r.references.insert(s.id, exact);
        s.reference_exact = 36;
        r.close(s.id); // preempted
        assert!(r.references.contains_key(&s.id));
        assert_eq!(r.open(&s), 0);
        assert_eq!(r.restore(&s).unwrap(), 36);
        let cache = r.cache_mut(s.id);
        assert_eq!(cache.read(1, 35, true), vec![-35.0; 4]);
        // a fork shares both caches; leaving the engine drops them
        r.fork(s.id, SeqId(2));
        assert!(r.references.contains_key(&SeqId(2)));
        r.release(s.id);
        assert!(!r.references.contains_key(&s.id) && r.references.contains_key(&SeqId(2)));
        r.truncate(SeqId(2), 10);
        assert_eq!(r.cache_mut(SeqId(2)).len(), 10);
    }

    fn cache_write(c: &mut KvCache, layer: usize, pos: usize, v: f32) {
        c.write(layer, pos, &[v; 4], &[v; 4]).unwrap();
    }
}
