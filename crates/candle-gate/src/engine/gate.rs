//! The margin gate: decides each step's token from the fast lane's logits, rechecks low-margin
//! steps in the reference lane (repairing the K/V of that position), rebuilds the cache in the
//! reference lane when the recheck is itself a near-tie, and returns one record per step.

use crate::error::Result;
use crate::model::Model;
use crate::ops::hash_bits;
use crate::reference::ReferenceWeights;
use crate::sampling::{self, Decision};

use super::config::{GateConfig, GateMode};
use super::runner::Runner;
use super::sequence::{Sequence, StepRecord};

pub(crate) struct Gate {
    pub cfg: GateConfig,
    pub reference: ReferenceWeights,
    pub record_logit_hashes: bool,
}

impl Gate {
    /// Whether the step whose fast-lane decision is `fast` is recomputed in the reference lane.
    pub fn rechecks(&self, fast: &Decision) -> bool {
        match self.cfg.mode {
            GateMode::Off | GateMode::Shadow => false,
            GateMode::Always => true,
            GateMode::Gated => fast.margin < self.cfg.tau,
        }
    }

    /// The step's record for `s`, whose latest position was just written by the fast lane.
    /// The gate decides what to recompute; the runner, which owns the caches, recomputes it.
    /// An error leaves that position's K/V undefined: the caller fails the sequence, and only it.
    /// `fast` is [`fast_decision`] of `logits` (computed for every sequence in parallel).
    pub fn decide(
        &self,
        model: &Model,
        s: &mut Sequence,
        runner: &mut Runner,
        logits: &[f32],
        fast: Decision,
    ) -> Result<StepRecord> {
        let key = s.draw_key();
        let output = s.fed_output();
        let params = &s.req.params;
        let choose = |lg: &[f32]| -> Decision { sampling::decide(params, key, &s.req.prompt_tokens, &output, lg) };
        let rechecked = self.rechecks(&fast);
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
        let mut deciding: Option<Vec<f32>> = None;
        if rechecked {
            let mut ref_logits = runner.recheck(model, s, self.reference, false)?;
            let mut reference = choose(&ref_logits);
            if reference.margin < self.cfg.deep_tau {
                ref_logits = runner.rebuild_in_reference_lane(model, s, self.reference)?;
                reference = sampling::decide(&s.req.params, key, &s.req.prompt_tokens, &output, &ref_logits);
                record.deep = true;
            }
            record.token = reference.token;
            record.reference_margin = reference.margin;
            record.corrected = reference.token != fast.token;
            deciding = Some(ref_logits);
        } else if self.cfg.mode == GateMode::Shadow {
            let reference = choose(&runner.recheck(model, s, self.reference, true)?);
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
