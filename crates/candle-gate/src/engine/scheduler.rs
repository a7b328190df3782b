//! Admission and the step plan. The scheduler owns the sequences; it decides which sequence
//! runs which work each step under the budgets and touches no logits, caches or text.
//!
//! Prefill chunk boundaries are multiples of `prefill_chunk` counted from the start of the
//! prompt, so they depend only on the prompt, never on load: a chunk that does not fit the
//! step's budget waits for the next step whole.

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

pub(crate) struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    reserved_blocks: usize,
    max_num_seqs: usize,
    max_tokens_per_step: usize,
    prefill_chunk: usize,
    kv_budget_blocks: usize,
}

impl Scheduler {
    pub fn new(cfg: &EngineConfig) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved_blocks: 0,
            max_num_seqs: cfg.max_num_seqs,
            max_tokens_per_step: cfg.max_tokens_per_step,
            prefill_chunk: cfg.prefill_chunk,
            kv_budget_blocks: cfg.kv_budget_blocks(),
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// KV blocks reserved by the running sequences (each admitted with its whole reservation).
    pub fn reserved_blocks(&self) -> usize {
        self.reserved_blocks
    }

    /// Moves waiting sequences to running, in arrival order, while the sequence limit and the
    /// KV budget (reserved for each request's prompt + max_new_tokens, times its choices) allow.
    fn admit(&mut self) -> Vec<RequestId> {
        let mut admitted = Vec::new();
        // A request's `n` choices count from its admission (they fork from it after prefill).
        while let Some(front) = self.waiting.front() {
            if self.running.len() + front.req.params.n > self.max_num_seqs
                || self.reserved_blocks + front.reserved_blocks > self.kv_budget_blocks
            {
                break;
            }
            let s = self.waiting.pop_front().unwrap();
            self.reserved_blocks += s.reserved_blocks;
            admitted.push(s.id);
            self.running.push(s);
        }
        admitted
    }

    /// Admits what fits, then plans the step: one decode row for every decoding sequence,
    /// then whole prefill chunks in arrival order while the token budget lasts. Returns the
    /// sequences admitted now and the plan, ordered by position in `running`.
    pub fn schedule(&mut self) -> (Vec<RequestId>, Vec<(usize, Work)>) {
        let admitted = self.admit();
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
        (admitted, plan)
    }

    /// Takes the finished sequences out of `running`, releasing their KV reservations.
    pub fn take_finished(&mut self) -> Vec<Sequence> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_some() {
                let s = self.running.remove(i);
                self.reserved_blocks -= s.reserved_blocks;
                done.push(s);
            } else {
                i += 1;
            }
        }
        done
    }

    /// Takes a sequence that has not been admitted yet out of the queue.
    pub fn take_waiting(&mut self, id: RequestId) -> Option<Sequence> {
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }
}
