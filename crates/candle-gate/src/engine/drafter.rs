//! The draft model's lane: a smaller model of the target's vocabulary, with its own K/V cache
//! per sequence in its own pool, proposing greedy drafts for the sequences a step verifies.
//!
//! A draft cache holds the K/V of the tokens it was fed. Before proposing, each cache keeps its
//! longest prefix that agrees with the sequence's history and is fed the rest (catching up on
//! the target's corrections, on tokens decoded while speculation was off, or on a whole prompt
//! the first time), so rejected drafts are rolled back by the next proposal, and a preempted or
//! forked sequence needs nothing special. What the drafts are never changes a bit of the output
//! (acceptance is exact match): only how many tokens a step emits.

use std::collections::HashMap;
use std::sync::Arc;

use crate::decoder::SeqRows;
use crate::dispatch::Lane;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvDtype, KvPool};
use crate::model::Model;

use super::sequence::SeqId;
use super::speculative::{SpeculativeConfig, SpeculativeMethod};

pub(crate) struct Drafter {
    model: Arc<Model>,
    /// Unbounded: a draft cache is never longer than its sequence's history plus its drafts, and
    /// the target's pool bounds those.
    pool: Arc<KvPool>,
    slots: HashMap<SeqId, DraftSlot>,
    /// The most rows of one sequence's catch-up in one forward.
    chunk: usize,
}

#[derive(Clone)]
struct DraftSlot {
    cache: KvCache,
    /// The token at each cached position.
    fed: Vec<u32>,
}

/// One sequence's proposal in progress.
struct Job {
    id: SeqId,
    /// Tokens still to feed: the history's tail the cache lacks, then the latest draft.
    pending: Vec<u32>,
    drafts: Vec<u32>,
    wanted: usize,
}

impl Drafter {
    pub fn new(model: Arc<Model>, kv_dtype: KvDtype, chunk: usize) -> Self {
        let pool = KvPool::unbounded(model.decoder.cfg.block_layout(kv_dtype));
        Drafter { model, pool, slots: HashMap::new(), chunk: chunk.max(1) }
    }
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
    pub fn fork(&mut self, from: SeqId, to: SeqId) {
        if let Some(slot) = self.slots.get(&from).cloned() {
            self.slots.insert(to, slot);
        }
    }
    pub fn close(&mut self, id: SeqId) {
        self.slots.remove(&id);
    }

    /// For each `(sequence, history, n)`, the draft model's `n` greedy tokens to follow
    /// `history` (the sequence's prompt and every token fed or decided since); with `n = 0` the
    /// cache only catches up with `history` (a prompt's chunk, fed beside the target's). The
    /// sequences' catch-up rows and draft rows run batched, one forward per draft. On an error
    /// every draft cache is as consistent as before (a forward rolls its caches back).
    pub fn propose(&mut self, lane: &dyn Lane, wanted: &[(SeqId, Vec<u32>, usize)]) -> Result<Vec<Vec<u32>>> {
        let mut jobs = Vec::with_capacity(wanted.len());
        for (id, history, n) in wanted {
            let slot = self
                .slots
                .entry(*id)
                .or_insert_with(|| DraftSlot { cache: KvCache::in_pool(self.pool.clone()), fed: Vec::new() });
            let mut keep = slot.fed.iter().zip(history).take_while(|(a, b)| a == b).count();
            // The last position is fed again when it is all the cache lacks: its logits are wanted.
            if *n > 0 {
                keep = keep.min(history.len() - 1);
            }
            slot.cache.truncate(keep);
            slot.fed.truncate(keep);
            jobs.push(Job { id: *id, pending: history[keep..].to_vec(), drafts: Vec::new(), wanted: *n });
        }
        let vocab = self.model.decoder.cfg.vocab;
        let is_active = |j: &Job| if j.wanted == 0 { !j.pending.is_empty() } else { j.drafts.len() < j.wanted };
        while jobs.iter().any(is_active) {
            let active: Vec<usize> = (0..jobs.len()).filter(|&j| is_active(&jobs[j])).collect();
            let fed: Vec<Vec<u32>> =
                active.iter().map(|&j| jobs[j].pending[..jobs[j].pending.len().min(self.chunk)].to_vec()).collect();
            // The caches leave the map for the call (the forward needs them all mutably at once).
            let mut slots: Vec<DraftSlot> = active.iter().map(|&j| self.slots.remove(&jobs[j].id).unwrap()).collect();
            let result = {
                let mut batch: Vec<SeqRows> = slots
                    .iter_mut()
                    .zip(&active)
                    .zip(&fed)
                    .map(|((slot, &j), tokens)| SeqRows {
                        cache: &mut slot.cache,
                        tokens,
                        logit_rows: (jobs[j].wanted > 0 && tokens.len() == jobs[j].pending.len()) as usize,
                    })
                    .collect();
                self.model.decoder.forward_in(lane, &mut batch, None)
            };
            for ((mut slot, &j), tokens) in slots.into_iter().zip(&active).zip(&fed) {
                if result.is_ok() {
                    slot.fed.extend_from_slice(tokens);
                    jobs[j].pending.drain(..tokens.len());
                }
                self.slots.insert(jobs[j].id, slot);
            }
            for (&j, logits) in active.iter().zip(result?) {
                let Some(logits) = logits else { continue };
                let token =
                    argmax(&logits[..vocab]).ok_or_else(|| Error::Engine("the draft model's logits are NaN".into()))?;
                let job = &mut jobs[j];
                job.drafts.push(token);
                if job.drafts.len() < job.wanted {
                    job.pending.push(token);
                }
            }
        }
        Ok(jobs.into_iter().map(|j| j.drafts).collect())
    }
}

/// The first index of the largest value (None when every value is NaN).
fn argmax(xs: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in xs.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) && !x.is_nan() {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// A draft model goes with speculative method `draft` alone, and must share the target's
/// vocabulary: every token's bytes and kind, the special and stop ids, and the logits' width
/// (a draft is a token id the target verifies).
pub(crate) fn check_draft_model(model: &Model, draft: Option<&Model>, spec: Option<&SpeculativeConfig>) -> Result<()> {
    let method = spec.map(|s| s.method);
    let Some(draft) = draft else {
        if method == Some(SpeculativeMethod::Draft) {
            return Err(Error::invalid("draft_model", "speculative method \"draft\" needs a draft model"));
        }
        return Ok(());
    };
    if method != Some(SpeculativeMethod::Draft) {
        return Err(Error::invalid("draft_model", "a draft model is used only by speculative method \"draft\""));
    }
    let difference = match (draft.decoder.cfg.vocab, model.decoder.cfg.vocab) {
        (d, t) if d != t => Some(format!("its logits have {d} entries, the target's {t}")),
        _ => draft.tokenizer.vocabulary_difference(&model.tokenizer),
    };
    match difference {
        Some(d) => Err(Error::invalid(
            "draft_model",
            format!(
                "draft model {} does not share the vocabulary of {}: {d}",
                draft.path.display(),
                model.path.display()
            ),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn argmax_takes_the_first_largest_and_skips_nan() {
        assert_eq!(super::argmax(&[1.0, 3.0, 3.0, -1.0]), Some(1));
        assert_eq!(super::argmax(&[f32::NAN, -2.0, f32::NAN]), Some(1));
        assert_eq!(super::argmax(&[f32::NAN]), None);
    }
}
