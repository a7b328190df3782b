//! Admission, the step plan and preemption. The scheduler owns the sequences; it decides
//! which sequence runs which work each step under the budgets and touches no logits, caches
//! or text (the engine asks the runner what K/V blocks a plan needs).
//!
//! Prefill chunk boundaries are multiples of `prefill_chunk` counted from the start of the
//! prompt, so they depend only on the prompt (and where its cached prefix ended), never on
//! load: a chunk that does not fit the step's budget waits for the next step whole.

use std::collections::VecDeque;
use std::ops::Range;

use super::sequence::Sequence;
use super::{EngineConfig, RequestId};

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Work {
    /// Feed its latest choice and decide the next token.
    Decode,
    /// Feed these prompt positions; the last chunk also decides the first token.
    Prefill(Range<usize>),
}

impl Work {
    /// Rows it puts into the step.
    pub fn rows(&self) -> usize {
        match self {
            Work::Decode => 1,
            Work::Prefill(c) => c.len(),
        }
    }
}

pub(crate) struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    max_num_seqs: usize,
    max_tokens_per_step: usize,
    prefill_chunk: usize,
    admissions: u64,
}

impl Scheduler {
    pub fn new(cfg: &EngineConfig) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_num_seqs: cfg.max_num_seqs,
            max_tokens_per_step: cfg.max_tokens_per_step,
            prefill_chunk: cfg.prefill_chunk,
            admissions: 0,
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The next waiting sequence, if the sequence limit lets it in (a request's `n` choices
    /// count from its first admission: they fork from it after its prefill).
    pub fn next_to_admit(&self) -> Option<&Sequence> {
        let s = self.waiting.front()?;
        let slots = if s.index == 0 && s.steps.is_empty() { s.req.params.n } else { 1 };
        (self.running.len() + slots <= self.max_num_seqs).then_some(s)
    }

    /// Moves the front waiting sequence to running, holding `computed` positions.
    pub fn admit_front(&mut self, computed: usize) {
        let mut s = self.waiting.pop_front().expect("a waiting sequence");
        self.admissions += 1;
        s.admitted_at = self.admissions;
        s.computed = computed;
        self.running.push(s);
    }

    /// The step's work: one decode row for every decoding sequence, then whole prefill chunks
    /// in arrival order while the token budget lasts; ordered by position in `running`.
    pub fn plan(&self) -> Vec<(usize, Work)> {
        let mut budget = self.max_tokens_per_step;
        let mut plan = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if !s.in_prefill() && budget > 0 {
                plan.push((i, Work::Decode));
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.in_prefill() {
                let c = s.next_chunk(self.prefill_chunk);
                if c.len() <= budget {
                    budget -= c.len();
                    plan.push((i, Work::Prefill(c)));
                }
            }
        }
        plan.sort_by_key(|p| p.0);
        plan
    }

    /// Puts the most recently admitted running sequence back at the front of the queue, its
    /// cache gone (the caller drops it): it resumes by recomputing its history. Returns its id.
    pub fn preempt_latest(&mut self) -> Option<RequestId> {
        let i = (0..self.running.len()).max_by_key(|&i| (self.running[i].admitted_at, i))?;
        let mut s = self.running.remove(i);
        s.computed = 0;
        let id = s.id;
        self.waiting.push_front(s);
        Some(id)
    }

    /// Takes the finished sequences out of `running`.
    pub fn take_finished(&mut self) -> Vec<Sequence> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_some() {
                done.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        done
    }

    /// Takes a sequence that is not running (never admitted, or preempted) out of the queue.
    pub fn take_waiting(&mut self, id: RequestId) -> Option<Sequence> {
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }
}
