//! The decide stage: a sequence's rows of logits become its tokens. Each row goes through the
//! gate, and the runner recomputes what the gate asks for. A verification run (the fed token,
//! then each draft) is decided row by row; row `j`'s decision is the one plain decoding makes
//! there as long as every earlier draft equalled the decision before it, so the run goes on
//! while a draft equals the decision, the gate did not recheck the row (a recheck rewrites the
//! row's K/V, which the rows after it read) and the sequence has not finished. The cache keeps
//! the rows up to the last decided one.

use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampling::Decision;

use super::gate::{self, Gate, Recheck};
use super::output::{self, Outputs};
use super::runner::Runner;
use super::sequence::{Sequence, StepRecord};
use super::speculative::{next_draft_window, SpecStats};
use super::{FinishReason, GateStats};

/// What deciding a step's sequences reads and writes besides each sequence.
pub(crate) struct Decide<'a> {
    pub model: &'a Model,
    pub gate: &'a Gate,
    pub runner: &'a mut Runner,
    pub outputs: &'a mut Outputs,
    pub gate_stats: &'a mut GateStats,
    pub spec_stats: &'a mut SpecStats,
    /// The gate fails on purpose for this request this step (fault injection for tests).
    pub failing: Option<super::RequestId>,
}

impl Decide<'_> {
    /// Decides `s`'s tokens from its rows' `logits` (one row, or a verification run of
    /// `drafts`); `fast` is the first row's fast-lane decision, made beforehand for every
    /// sequence at once.
    pub fn rows(&mut self, s: &mut Sequence, logits: &[f32], fast: Decision, drafts: &[u32]) {
        let vocab = self.model.decoder.cfg.vocab;
        let first = s.computed - 1 - drafts.len();
        let mut fast = Some(fast);
        let mut kept = 0;
        for j in 0..=drafts.len() {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let fast = fast.take().unwrap_or_else(|| gate::decision(s, row));
            let last = j == drafts.len() || self.gate.rechecks(&fast);
            if last {
                self.truncate(s, first + j + 1); // the recheck rewrites the cache's last row
            }
            let go_on = match self.one(s, row, fast) {
                Ok(record) => {
                    let draft_kept = !last && record.token == drafts[j] && !record.rechecked;
                    record.tally(self.gate_stats);
                    s.steps.push(record);
                    output::after_token(self.model, s);
                    draft_kept && s.finish.is_none()
                }
                Err(e) => {
                    fail(s, e);
                    false
                }
            };
            if !go_on {
                self.truncate(s, first + j + 1);
                break;
            }
            kept += 1;
            self.outputs.emit(s);
        }
        if !drafts.is_empty() {
            s.draft_window = next_draft_window(drafts.len(), kept);
        }
        s.speculation.add_run(drafts.len(), kept);
        self.spec_stats.add_run(drafts.len(), kept);
    }

    /// One row through the gate, the runner recomputing what the gate asks for. An error leaves
    /// the row's K/V undefined: the caller fails the sequence, and only it.
    fn one(&mut self, s: &mut Sequence, row: &[f32], fast: Decision) -> Result<StepRecord> {
        if self.failing == Some(s.request) {
            return Err(Error::Engine("injected fault in the gate".into()));
        }
        let mut verdict = self.gate.open(row, fast);
        while let Some(what) = verdict.waiting_for() {
            let logits = self.runner.recheck(self.model, s, what, self.gate.reference)?;
            if what == Recheck::Rebuild {
                s.reference_exact = s.computed;
            }
            self.gate.answer(&mut verdict, gate::decision(s, &logits), logits);
        }
        Ok(self.gate.close(verdict, &s.req.params, row))
    }

    fn truncate(&mut self, s: &mut Sequence, len: usize) {
        self.runner.truncate(s.id, len);
        s.computed = len;
    }
}

/// `s` failed alone: it finishes with `e` and the step goes on for the others.
pub(crate) fn fail(s: &mut Sequence, e: Error) {
    s.error = Some(e);
    s.finish = Some(FinishReason::Error);
}
