//! The margin gate: decides each step's token from the fast lane's logits, rechecks low-margin
//! steps in the reference lane (repairing the K/V of that position), rebuilds the cache in the
//! reference lane when the recheck is itself a near-tie, and returns one record per step.

use crate::decoder::{KvCache, KvDtype};
use crate::error::Result;
use crate::model::Model;
use crate::ops::hash_bits;
use crate::reference::ReferenceWeights;
use crate::sampling::{self, Decision};

use super::config::{GateConfig, GateMode};
use super::sequence::{Sequence, StepRecord};

pub(crate) struct Gate {
    pub cfg: GateConfig,
    pub reference: ReferenceWeights,
    pub record_logit_hashes: bool,
}

impl Gate {
    /// The step's record for `s`, whose latest position (just written by the fast lane) is the
    /// last of `cache`. An error leaves that position's K/V undefined: the caller fails the
    /// sequence, and only it.
    /// `fast` is [`fast_decision`] of `logits` (computed for every sequence in parallel).
    pub fn decide(
        &self,
        model: &Model,
        s: &mut Sequence,
        cache: &mut KvCache,
        logits: &[f32],
        fast: Decision,
    ) -> Result<StepRecord> {
        let key = s.draw_key();
        let output = s.fed_output();
        let params = &s.req.params;
        let choose = |lg: &[f32]| -> Decision { sampling::decide(params, key, &s.req.prompt_tokens, &output, lg) };
        let rechecked = match self.cfg.mode {
            GateMode::Off | GateMode::Shadow => false,
            GateMode::Always => true,
            GateMode::Gated => fast.margin < self.cfg.tau,
        };
        let mut record = StepRecord {
            token: fast.token,
            margin: fast.margin,
            reference_margin: f32::NAN,
            rechecked,
            corrected: false,
            deep: false,
            logit_hash: self.record_logit_hashes.then(|| hash_bits(logits)),
            logprob: None,
            top_logprobs: Vec::new(),
        };
        let pos = cache.len() - 1;
        let fed = s.fed_at(pos);
        let mut deciding: Option<Vec<f32>> = None;
        if rechecked {
            let mut ref_logits = model.decoder.reference_step(cache, fed, self.reference)?;
            let mut reference = choose(&ref_logits);
            if reference.margin < self.cfg.deep_tau {
                ref_logits = rebuild_in_reference_lane(model, s, cache, self.reference)?;
                reference = sampling::decide(&s.req.params, key, &s.req.prompt_tokens, &output, &ref_logits);
                record.deep = true;
            }
            record.token = reference.token;
            record.reference_margin = reference.margin;
            record.corrected = reference.token != fast.token;
            deciding = Some(ref_logits);
        } else if self.cfg.mode == GateMode::Shadow {
            // The fast lane's K/V must stay as they are: save the one position the recheck
            // overwrites and put it back.
            let saved = cache.save_position(pos);
            let ref_logits = model.decoder.reference_step(cache, fed, self.reference);
            cache.restore_position(saved)?;
            let reference = choose(&ref_logits?);
            record.reference_margin = reference.margin;
            record.corrected = reference.token != fast.token;
        }
        let params = &s.req.params;
        if params.wants_logprobs() {
            let (lp, top) =
                sampling::logprobs(deciding.as_deref().unwrap_or(logits), record.token, params.top_logprobs);
            record.logprob = Some(lp);
            record.top_logprobs = top;
        }
        Ok(record)
    }
}

/// The decision `s`'s next step would take from `logits`, before any recheck.
pub(crate) fn fast_decision(s: &Sequence, logits: &[f32]) -> Decision {
    sampling::decide(&s.req.params, s.draw_key(), &s.req.prompt_tokens, &s.fed_output(), logits)
}

/// Recomputes the sequence in the reference lane from `reference_exact` on (the prompt, then
/// every token fed so far), in its own f32 cache, and returns the logits of the last position;
/// the sequence's cache takes the rebuilt positions' K/V (in its dtype). Positions before
/// `reference_exact` already are what this would compute, so the result is bitwise the same as
/// rebuilding from position 0: greedy decoding in the reference lane alone.
fn rebuild_in_reference_lane(
    model: &Model,
    s: &mut Sequence,
    cache: &mut KvCache,
    how: ReferenceWeights,
) -> Result<Vec<f32>> {
    let len = cache.len();
    debug_assert_eq!(len, s.req.prompt_tokens.len() + s.steps.len());
    // The latest position is always recomputed: it is the one whose logits are wanted.
    let from = s.reference_exact.min(len - 1).min(s.reference_cache.as_ref().map_or(0, |c| c.len()));
    let fed: Vec<u32> = (from..len).map(|i| s.fed_at(i)).collect();
    let exact = s.reference_cache.get_or_insert_with(|| model.decoder.new_cache_with(KvDtype::F32));
    exact.truncate(from);
    let last = model.decoder.reference_extend(exact, &fed, how)?;
    for pos in from..len {
        for layer in 0..model.decoder.cfg.n_layer {
            cache.write(layer, pos, &exact.read(layer, pos, false), &exact.read(layer, pos, true))?;
        }
    }
    s.reference_exact = len;
    Ok(last)
}
