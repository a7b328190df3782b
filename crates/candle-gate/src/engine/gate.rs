//! The margin gate: decides each step's token from the fast lane's logits, asks for a recheck
//! of low-margin steps in the reference lane (which repairs the K/V of that position), asks for
//! a rebuild in the reference lane when the recheck is itself a near-tie, and returns one
//! record per step. The gate computes nothing: it says what the runner, which owns the caches,
//! must recompute ([`Recheck`]), and decides from what comes back.

use crate::ops::hash_bits;
use crate::reference::ReferenceWeights;
use crate::sampling::{self, Decision, SamplingParams};

use super::config::{GateConfig, GateMode};
use super::sequence::{Sequence, StepRecord};

pub(crate) struct Gate {
    pub cfg: GateConfig,
    pub reference: ReferenceWeights,
    pub record_logit_hashes: bool,
}

/// What the gate needs recomputed in the reference lane before it can decide a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recheck {
    /// The latest position, its K/V replacing the fast lane's; with `keep_fast_kv` (the shadow
    /// gate, which only watches) the fast lane's K/V are put back.
    Position { keep_fast_kv: bool },
    /// The whole history, in the reference lane's own f32 cache (a near-tie in the recheck).
    Rebuild,
}

/// A step on its way through the gate: its record so far and what the gate waits for.
pub(crate) struct Verdict {
    record: StepRecord,
    fast_token: u32,
    waiting_for: Option<Recheck>,
    /// The reference lane's logits, when they decided the token (its logprobs come from them).
    deciding: Option<Vec<f32>>,
}

impl Verdict {
    /// What the runner must recompute next (None: the step is decided).
    pub fn waiting_for(&self) -> Option<Recheck> {
        self.waiting_for
    }
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

    /// Starts deciding a step from the fast lane's `logits`, whose decision is `fast`.
    pub fn open(&self, logits: &[f32], fast: Decision) -> Verdict {
        let rechecked = self.rechecks(&fast);
        let waiting_for = match (rechecked, self.cfg.mode) {
            (true, _) => Some(Recheck::Position { keep_fast_kv: false }),
            (false, GateMode::Shadow) => Some(Recheck::Position { keep_fast_kv: true }),
            (false, _) => None,
        };
        let record = StepRecord {
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
        Verdict { record, fast_token: fast.token, waiting_for, deciding: None }
    }

    /// Takes the reference lane's answer to what `v` waited for: `logits`, whose decision is
    /// `reference`. A shadow recheck only records what the reference lane would have done; a
    /// real one decides the token, unless its own margin is under `deep_tau`, when the gate
    /// asks for a rebuild and decides from that.
    pub fn answer(&self, v: &mut Verdict, reference: Decision, logits: Vec<f32>) {
        let asked = v.waiting_for.take().expect("the gate asked for a recheck");
        v.record.reference_margin = reference.margin;
        v.record.corrected = reference.token != v.fast_token;
        if asked == (Recheck::Position { keep_fast_kv: true }) {
            return;
        }
        if asked == Recheck::Rebuild {
            v.record.deep = true;
        } else if reference.margin < self.cfg.deep_tau {
            v.waiting_for = Some(Recheck::Rebuild);
        }
        v.record.token = reference.token;
        v.deciding = Some(logits);
    }

    /// The step's record; `logits` are the fast lane's (the logprobs' source unless the
    /// reference lane decided).
    pub fn close(&self, v: Verdict, params: &SamplingParams, logits: &[f32]) -> StepRecord {
        debug_assert!(v.waiting_for.is_none(), "a step closed before its recheck");
        let mut record = v.record;
        if params.wants_logprobs() {
            let source = v.deciding.as_deref().unwrap_or(logits);
            let (lp, top) = sampling::logprobs(source, record.token, params.top_logprobs);
            record.logprob = Some(lp);
            record.top_logprobs = top;
        }
        record
    }
}

/// The decision `s`'s next step would take from `logits` (the fast lane's, or a recheck's).
pub(crate) fn decision(s: &Sequence, logits: &[f32]) -> Decision {
    sampling::decide(&s.req.params, s.draw_key(), &s.req.prompt_tokens, &s.fed_output(), logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(mode: GateMode) -> Gate {
        let mut cfg = GateConfig::new(mode, 1.0).unwrap();
        cfg.deep_tau = 0.25;
        Gate { cfg, reference: ReferenceWeights::Dense, record_logit_hashes: true }
    }
    fn d(token: u32, margin: f32) -> Decision {
        Decision { token, margin }
    }
    const LOGITS: [f32; 3] = [0.0, 2.0, 1.5];

    #[test]
    fn a_wide_margin_passes_and_a_narrow_one_is_rechecked_and_corrected() {
        let g = gate(GateMode::Gated);
        let v = g.open(&LOGITS, d(1, 2.0));
        assert_eq!(v.waiting_for(), None);
        let r = g.close(v, &SamplingParams::default(), &LOGITS);
        assert_eq!((r.token, r.rechecked, r.corrected, r.logit_hash), (1, false, false, Some(hash_bits(&LOGITS))));
        assert!(r.reference_margin.is_nan());

        let mut v = g.open(&LOGITS, d(1, 0.5));
        assert_eq!(v.waiting_for(), Some(Recheck::Position { keep_fast_kv: false }));
        g.answer(&mut v, d(2, 0.5), vec![0.0, 1.0, 1.5]);
        assert_eq!(v.waiting_for(), None, "the recheck's margin is over deep_tau");
        let r = g.close(v, &SamplingParams::default(), &LOGITS);
        assert_eq!(
            (r.token, r.margin, r.reference_margin, r.rechecked, r.corrected, r.deep),
            (2, 0.5, 0.5, true, true, false)
        );
    }

    #[test]
    fn a_near_tie_in_the_recheck_asks_for_a_rebuild_which_decides() {
        let g = gate(GateMode::Gated);
        let mut v = g.open(&LOGITS, d(1, 0.5));
        g.answer(&mut v, d(2, 0.1), vec![0.0, 1.0, 1.1]);
        assert_eq!(v.waiting_for(), Some(Recheck::Rebuild));
        g.answer(&mut v, d(1, 0.2), vec![0.0, 1.2, 1.0]);
        assert_eq!(v.waiting_for(), None);
        let params = SamplingParams { logprobs: true, ..Default::default() };
        let r = g.close(v, &params, &LOGITS);
        assert_eq!((r.token, r.reference_margin, r.corrected, r.deep), (1, 0.2, false, true));
        // the rebuilt lane's logits decided, so they give the logprob
        let (lp, _) = sampling::logprobs(&[0.0, 1.2, 1.0], 1, 0);
        assert_eq!(r.logprob, Some(lp));
    }

    #[test]
    fn the_shadow_gate_rechecks_without_deciding_and_keeps_the_fast_kv() {
        let g = gate(GateMode::Shadow);
        let mut v = g.open(&LOGITS, d(1, 0.01));
        assert_eq!(v.waiting_for(), Some(Recheck::Position { keep_fast_kv: true }));
        g.answer(&mut v, d(2, 0.01), vec![0.0, 1.0, 1.5]);
        assert_eq!(v.waiting_for(), None, "never a rebuild");
        let params = SamplingParams { logprobs: true, ..Default::default() };
        let r = g.close(v, &params, &LOGITS);
        assert_eq!((r.token, r.rechecked, r.corrected, r.deep), (1, false, true, false));
        assert_eq!(r.logprob, Some(sampling::logprobs(&LOGITS, 1, 0).0), "the fast lane's logits decided");
    }

    #[test]
    fn off_never_rechecks_and_always_always_does() {
        assert_eq!(gate(GateMode::Off).open(&LOGITS, d(1, 0.0)).waiting_for(), None);
        let always = gate(GateMode::Always).open(&LOGITS, d(1, f32::INFINITY));
        assert_eq!(always.waiting_for(), Some(Recheck::Position { keep_fast_kv: false }));
    }
}
