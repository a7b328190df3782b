//! The model runner: owns every running sequence's KV cache and turns a step's plan into rows
//! for one fast-lane forward. The model sees rows and caches, never sequences.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dispatch::{QMatMul, Policy};
use crate::error::{Error, Result};
use crate::kv_cache::{BlockLayout, KvCache, KvPool};
use crate::llama::{Lane, SeqRows};
use crate::model::Model;

use super::scheduler::Work;
use super::sequence::Sequence;
use super::{EngineConfig, RequestId};

pub(crate) struct Runner {
    pool: Arc<KvPool>,
    caches: HashMap<RequestId, KvCache>,
}

impl Runner {
    /// A runner whose caches share one pool of `cfg.kv_budget_tokens` (in whole blocks).
    pub fn new(model: &Model, cfg: &EngineConfig) -> Self {
        let layout = BlockLayout::new(&model.llama.cfg, cfg.kv_dtype);
        Runner { pool: KvPool::bounded(layout, cfg.kv_budget_blocks()), caches: HashMap::new() }
    }
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }
    pub fn open(&mut self, id: RequestId) {
        self.caches.insert(id, KvCache::in_pool(self.pool.clone()));
    }
    /// `from`'s cache shared with `to` (another choice of the same prompt): full blocks stay
    /// shared, the first write to a shared block copies it.
    pub fn fork(&mut self, from: RequestId, to: RequestId) {
        let c = self.caches[&from].clone();
        self.caches.insert(to, c);
    }
    pub fn close(&mut self, id: RequestId) {
        self.caches.remove(&id);
    }
    pub fn cache_mut(&mut self, id: RequestId) -> &mut KvCache {
        self.caches.get_mut(&id).expect("a running sequence has a cache")
    }

    /// Runs the plan's rows in one forward: each decode sequence's latest choice, each prefill
    /// chunk's prompt tokens. On success advances the prefilled sequences and returns the
    /// number of rows and, in plan order, the logits of every sequence that wanted them; on an
    /// error nothing changed (the forward rolls its caches back).
    /// With `fail_midway` the forward fails halfway through its layers (fault injection for
    /// tests: the caches have been written by then and must be rolled back).
    pub fn run(
        &mut self,
        model: &Model,
        policy: &Policy,
        running: &mut [Sequence],
        plan: &[(usize, Work)],
        fail_midway: bool,
    ) -> Result<(usize, Vec<(usize, Vec<f32>)>)> {
        let decode_tokens: Vec<u32> =
            plan.iter().map(|(i, w)| if *w == Work::Decode { running[*i].fed_last() } else { 0 }).collect();
        // The caches leave the map for the call (the forward needs them all mutably at once).
        let mut caches: Vec<KvCache> = plan.iter().map(|(i, _)| self.caches.remove(&running[*i].id).unwrap()).collect();
        let result = {
            let mut batch = Vec::with_capacity(plan.len());
            for (((i, work), dtok), cache) in plan.iter().zip(&decode_tokens).zip(caches.iter_mut()) {
                let prompt = &running[*i].req.prompt_tokens;
                let (tokens, want_logits): (&[u32], bool) = match work {
                    Work::Decode => (std::slice::from_ref(dtok), true),
                    Work::Prefill(c) => (&prompt[c.clone()], c.end == prompt.len()),
                };
                batch.push(SeqRows { cache, tokens, want_logits });
            }
            let rows: usize = batch.iter().map(|b| b.tokens.len()).sum();
            let faulty = FailAfter { lane: policy, calls_left: AtomicUsize::new(model.llama.layers.len() * 7 / 2) };
            let lane: &dyn Lane = if fail_midway { &faulty } else { policy };
            model.llama.forward_in(lane, &mut batch, None).map(|l| (rows, l))
        };
        for ((i, _), cache) in plan.iter().zip(caches) {
            self.caches.insert(running[*i].id, cache);
        }
        let (rows, logits) = result?;
        let mut out = Vec::new();
        for ((i, work), lg) in plan.iter().zip(logits) {
            if let Work::Prefill(c) = work {
                running[*i].prefilled = c.end;
            }
            if let Some(lg) = lg {
                out.push((*i, lg));
            }
        }
        Ok((rows, out))
    }
}

/// A lane whose matmuls fail after a number of calls.
struct FailAfter<'a> {
    lane: &'a Policy,
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
