//! Admission, the step plan and preemption. The scheduler owns the sequences; it decides
//! which sequence runs which work each step under the budgets and touches no logits, caches
//! or text: it sees the KV pool through [`KvBlocks`], a block-accounting view the runner gives.
//!
//! Prefill chunk boundaries are multiples of `prefill_chunk` counted from the start of the
//! prompt, so they depend only on the prompt (and where its cached prefix ended), never on
//! load: a chunk that does not fit the step's budget waits for the next step whole.

use std::collections::VecDeque;
use std::ops::Range;

use super::sequence::{SeqId, Sequence};
use super::speculative::{SpeculativeConfig, SpeculativeMethod};
use super::{CacheStats, EngineConfig, RequestId};
use crate::error::Result;
use crate::prefix_cache::KV_BLOCK;

/// What the scheduler knows of the KV pool: how many blocks a sequence's cache would take, and
/// opening and closing caches (the runner owns them).
pub(crate) trait KvBlocks {
    /// Opens `s`'s cache with the longest cached prefix of its history it may take; returns
    /// how many positions that is.
    fn open(&mut self, s: &Sequence) -> usize;
    /// Puts back what a resumed sequence's deep rechecks had rebuilt; returns the positions
    /// its cache now holds.
    fn restore(&mut self, s: &Sequence) -> Result<usize>;
    /// Drops `id`'s cache (preempted, or not admitted after all).
    fn close(&mut self, id: SeqId);
    /// Blocks the pool has for caches to take (free, or cached and unreferenced).
    fn available_blocks(&self) -> usize;
    /// Blocks `id`'s cache would take to grow by `rows` positions.
    fn blocks_to_extend(&self, id: SeqId, rows: usize) -> usize;
}

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Work {
    /// Feed its latest choice and decide the next token.
    Decode,
    /// Feed these prompt positions; the last chunk also decides the first token.
    Prefill(Range<usize>),
    /// Feed its latest choice and then these drafts, deciding a token after each row: the
    /// drafts are kept while each equals the token decided before it.
    Verify(Vec<u32>),
    /// A [`Work::Verify`] of this many drafts that the draft model has yet to propose (the
    /// runner does, once the plan fits the pool).
    Draft(usize),
}

impl Work {
    /// Rows it puts into the step.
    pub fn rows(&self) -> usize {
        match self {
            Work::Decode => 1,
            Work::Prefill(c) => c.len(),
            Work::Verify(d) => 1 + d.len(),
            Work::Draft(n) => 1 + n,
        }
    }
}

pub(crate) struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    max_num_seqs: usize,
    max_tokens_per_step: usize,
    prefill_chunk: usize,
    prefix_caching: bool,
    admissions: u64,
    /// Prefix hits of first admissions, and preemptions.
    pub stats: CacheStats,
    /// Drafts for decoding sequences (None: the engine does not speculate, or its gate
    /// rechecks every step, which would end every verification run at its first row).
    speculative: Option<SpeculativeConfig>,
    context_length: usize,
}

impl Scheduler {
    pub fn new(cfg: &EngineConfig, context_length: usize) -> Self {
        let speculative = cfg.speculative.filter(|_| cfg.gate.can_speculate());
        Scheduler {
            speculative,
            context_length,
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_num_seqs: cfg.max_num_seqs,
            max_tokens_per_step: cfg.max_tokens_per_step,
            prefill_chunk: cfg.prefill_chunk,
            prefix_caching: cfg.enable_prefix_caching,
            admissions: 0,
            stats: CacheStats::default(),
        }
    }

    /// The step's work (see [`Scheduler::plan`]), after admitting waiting sequences while the
    /// pool allows and preempting the most recently admitted ones until the plan's blocks are
    /// in the pool.
    pub fn schedule(&mut self, kv: &mut impl KvBlocks) -> Result<Vec<(usize, Work)>> {
        self.admit(kv)?;
        loop {
            // Drafts only when they fit beside every sequence's next row.
            for with_drafts in [true, false] {
                let plan = self.plan(with_drafts);
                let need: usize = plan.iter().map(|(i, w)| kv.blocks_to_extend(self.running[*i].id, w.rows())).sum();
                if need <= kv.available_blocks() || (!with_drafts && self.running.len() <= 1) {
                    return Ok(plan);
                }
            }
            let id = self.preempt_latest().expect("a running sequence");
            kv.close(id);
            self.stats.preemptions += 1;
        }
    }

    /// Admits waiting sequences in order while the sequence limit and the pool allow: a
    /// sequence comes in when the blocks its history still needs (after its prefix-cache hit)
    /// plus one step fit beside what the running sequences need to reach their next token, and
    /// no running sequence is still prefilling whole blocks of its prompt (then it comes in once
    /// they are cached, and takes them as a hit).
    fn admit(&mut self, kv: &mut impl KvBlocks) -> Result<()> {
        let mut committed: usize =
            self.running.iter().map(|s| kv.blocks_to_extend(s.id, s.target() + 1 - s.computed)).sum();
        while let Some(s) = self.next_to_admit() {
            // Its prefix is being computed by a running request: wait for those blocks instead
            // of computing them a second time beside it.
            if self.prefix_caching && self.prefix_in_flight(s) {
                break;
            }
            let hit = kv.open(s);
            let need = (s.target() + 1).div_ceil(KV_BLOCK) - hit / KV_BLOCK;
            if need + committed > kv.available_blocks() {
                kv.close(s.id);
                break;
            }
            committed += need;
            let (first_admission, prompt) = (s.cached_tokens.is_none(), s.req.prompt_tokens.len());
            let computed = kv.restore(s)?;
            if first_admission {
                self.stats.prefix_queries += prompt as u64;
                self.stats.prefix_hits += hit as u64;
            }
            self.waiting.front_mut().unwrap().cached_tokens.get_or_insert(hit);
            self.admit_front(computed);
        }
        Ok(())
    }

    /// After a step ran `plan`: each planned sequence's cache holds its rows.
    pub fn advance(&mut self, plan: &[(usize, Work)]) {
        for (i, work) in plan {
            let s = &mut self.running[*i];
            match work {
                Work::Prefill(c) => s.computed = c.end,
                _ => s.computed += work.rows(),
            }
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The next waiting sequence, if the sequence limit lets it in (a request's `n` choices
    /// count from its first admission: they fork from it after its prefill).
    fn next_to_admit(&self) -> Option<&Sequence> {
        let s = self.waiting.front()?;
        let slots = if s.index == 0 && s.steps.is_empty() { s.req.params.n } else { 1 };
        (self.running.len() + slots <= self.max_num_seqs).then_some(s)
    }

    /// Whether a running sequence is still prefilling a whole block of `s`'s prompt that `s`
    /// could take from the prefix cache once it is computed (a shared system prompt, the same
    /// document): then `s` is better admitted after it.
    fn prefix_in_flight(&self, s: &Sequence) -> bool {
        let mine = &s.req.prompt_tokens[..s.req.prompt_tokens.len() - 1];
        self.running.iter().any(|r| {
            let theirs = &r.req.prompt_tokens;
            let shared = mine.iter().zip(theirs).take_while(|(a, b)| a == b).count() / KV_BLOCK * KV_BLOCK;
            shared > s.computed && r.computed < shared && r.in_prefill()
        })
    }

    /// Moves the front waiting sequence to running, holding `computed` positions.
    fn admit_front(&mut self, computed: usize) {
        let mut s = self.waiting.pop_front().expect("a waiting sequence");
        self.admissions += 1;
        s.admitted_at = self.admissions;
        s.computed = computed;
        self.running.push(s);
    }

    /// The step's work: one decode row for every decoding sequence, then (`with_drafts`) their
    /// drafts, then whole prefill chunks in arrival order while the token budget lasts; ordered
    /// by position in `running`. Drafts come before prefill so that a request's drafts, and so
    /// its acceptance counts, do not depend on what else is prefilling.
    fn plan(&self, with_drafts: bool) -> Vec<(usize, Work)> {
        let mut budget = self.max_tokens_per_step;
        let mut plan = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if !s.in_prefill() && budget > 0 {
                plan.push((i, Work::Decode));
                budget -= 1;
            }
        }
        if with_drafts {
            budget -= self.add_drafts(&mut plan, budget);
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

    /// Whether a step of `plan` speculates: it would, if it had drafts, with this many decoding
    /// sequences.
    pub fn speculates(&self, plan: &[(usize, Work)]) -> bool {
        let decoding = plan.iter().filter(|(_, w)| !matches!(w, Work::Prefill(_))).count();
        self.speculative.is_some_and(|spec| decoding <= spec.disable_by_batch_size)
    }

    /// Turns decode work into verification runs while `budget` rows last; returns the rows
    /// added. Drafts never reach past the request's `max_new_tokens` or the context;
    /// teacher-forced sequences get none.
    fn add_drafts(&self, plan: &mut [(usize, Work)], budget: usize) -> usize {
        let Some(spec) = &self.speculative else { return 0 };
        if !self.speculates(plan) {
            return 0;
        }
        let mut left = budget;
        for (i, w) in plan.iter_mut().filter(|(_, w)| *w == Work::Decode) {
            let s = &self.running[*i];
            if left == 0 || s.req.forced_tokens.is_some() {
                continue;
            }
            let to_emit = s.req.params.max_new_tokens.saturating_sub(s.steps.len() + 1);
            let room = self.context_length.saturating_sub(s.target() + 2);
            let window = if s.draft_window == 0 { spec.num_speculative_tokens } else { s.draft_window };
            let limit = left.min(to_emit).min(room).min(spec.num_speculative_tokens);
            let work = match spec.method {
                SpeculativeMethod::Ngram => {
                    // A match at least as long as the window is a copy in progress: it drafts
                    // past the window (a cut-short run shrank it), up to its own length.
                    let (mut drafts, matched) = spec.lookup(&s.history(s.computed + 1), limit);
                    drafts.truncate(window.max(matched));
                    Work::Verify(drafts)
                }
                SpeculativeMethod::Draft => Work::Draft(limit.min(window)),
            };
            if work.rows() > 1 {
                left -= work.rows() - 1;
                *w = work;
            }
        }
        budget - left
    }

    /// Puts the most recently admitted running sequence back at the front of the queue, its
    /// cache gone (the caller drops it): it resumes by recomputing its history. Returns its id.
    fn preempt_latest(&mut self) -> Option<SeqId> {
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

    /// Takes request `id`'s sequences that are not running (never admitted, or preempted) out
    /// of the queue.
    pub fn take_waiting(&mut self, id: RequestId) -> Vec<Sequence> {
        let (taken, kept): (VecDeque<Sequence>, _) =
            std::mem::take(&mut self.waiting).into_iter().partition(|s| s.request == id);
        self.waiting = kept;
        taken.into()
    }

    /// A request of `n` choices prefills once, as choice 0 (`running[i]`); after that prefill
    /// its other choices join the running set, each a fork of it sharing its K/V. Returns
    /// their indices in `running`; `next_seq` gives their ids.
    pub fn fork_choices(&mut self, i: usize, next_seq: &mut u64) -> Vec<usize> {
        let s = &self.running[i];
        if s.index != 0 || !s.steps.is_empty() || s.req.params.n <= 1 {
            return Vec::new();
        }
        let forks: Vec<Sequence> = (1..s.req.params.n as u32)
            .map(|index| {
                *next_seq += 1;
                s.fork(SeqId(*next_seq - 1), index)
            })
            .collect();
        let first = self.running.len();
        self.running.extend(forks);
        (first..self.running.len()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sequence::StepRecord;
    use crate::engine::{GateConfig, GateMode, Request};
    use crate::sampling::SamplingParams;

    fn seq(id: RequestId, prompt: usize) -> Sequence {
        Sequence::new(SeqId(id), id, Request::new(vec![1; prompt], SamplingParams::greedy(8)), 0)
    }

    fn record(rechecked: bool) -> StepRecord {
        StepRecord::plain(2, rechecked)
    }

    #[test]
    fn the_plan_puts_decode_rows_first_and_whole_chunks_while_the_budget_lasts() {
        let cfg = EngineConfig { max_tokens_per_step: 69, prefill_chunk: 64, max_num_seqs: 3, ..Default::default() };
        let mut sch = Scheduler::new(&cfg, 4096);
        for (id, prompt) in [(1, 100), (2, 10), (3, 5), (4, 5)] {
            sch.waiting.push_back(seq(id, prompt));
        }
        let mut admitted = vec![];
        while let Some(s) = sch.next_to_admit() {
            admitted.push(s.id);
            sch.admit_front(0);
        }
        assert_eq!(admitted, [1, 2, 3].map(SeqId), "max_num_seqs");
        sch.running[1].computed = 10;
        sch.running[1].steps.push(record(false));
        // 1 decode row, then 64 of the first prompt; the third's 5 no longer fit (69 - 65).
        assert_eq!(sch.plan(true), vec![(0, Work::Prefill(0..64)), (1, Work::Decode)]);
        // A cached prefix of 96 positions: the next chunk runs to the next multiple of 64.
        sch.running[0].computed = 96;
        assert_eq!(sch.plan(true)[0], (0, Work::Prefill(96..100)));
    }

    /// A pool of `free` blocks, each sequence's cache holding `positions`.
    struct Pool {
        free: usize,
        positions: std::collections::HashMap<SeqId, usize>,
    }
    impl KvBlocks for Pool {
        fn open(&mut self, s: &Sequence) -> usize {
            self.positions.insert(s.id, 0);
            0
        }
        fn restore(&mut self, _: &Sequence) -> Result<usize> {
            Ok(0)
        }
        fn close(&mut self, id: SeqId) {
            self.positions.remove(&id);
        }
        fn available_blocks(&self) -> usize {
            self.free - self.positions.values().map(|p| p.div_ceil(KV_BLOCK)).sum::<usize>()
        }
        fn blocks_to_extend(&self, id: SeqId, rows: usize) -> usize {
            let p = self.positions[&id];
            (p + rows).div_ceil(KV_BLOCK) - p.div_ceil(KV_BLOCK)
        }
    }

    #[test]
    fn admission_stops_at_the_pool_and_preemption_makes_room_for_the_earliest() {
        let mut sch = Scheduler::new(&EngineConfig::default(), 4096);
        let mut kv = Pool { free: 5, positions: Default::default() };
        // three different prompts (one shared with a running prefill would wait for its blocks)
        sch.waiting.extend((1..=3).map(|id| {
            let mut s = seq(id, 40);
            s.req.prompt_tokens[0] = id as u32;
            s
        }));
        // each needs 2 blocks for its prompt and first token: the third does not fit beside them
        let plan = sch.schedule(&mut kv).unwrap();
        assert_eq!(plan, [(0, Work::Prefill(0..40)), (1, Work::Prefill(0..40))]);
        assert_eq!((sch.running.len(), sch.waiting.len(), kv.positions.len()), (2, 1, 2));
        assert_eq!(sch.stats.prefix_queries, 80);
        sch.advance(&plan);
        assert_eq!(sch.running[0].computed, 40);
        // both decode to position 64: their next rows need a new block each, and one is left
        for s in sch.running.iter_mut() {
            s.steps.extend((0..25).map(|_| record(false)));
            s.computed = 64;
            kv.positions.insert(s.id, 64);
        }
        let plan = sch.schedule(&mut kv).unwrap();
        assert_eq!(plan, [(0, Work::Decode)]);
        assert_eq!(sch.stats.preemptions, 1);
        assert_eq!((sch.waiting[0].id, sch.waiting[0].computed), (SeqId(2), 0));
        assert!(!kv.positions.contains_key(&SeqId(2)), "its cache was closed");
    }

    #[test]
    fn preemption_takes_the_latest_admitted_and_it_resumes_through_its_repaired_positions() {
        let mut sch = Scheduler::new(&EngineConfig::default(), 4096);
        sch.waiting.extend([seq(1, 40), seq(2, 40)]);
        sch.admit_front(0);
        sch.admit_front(0);
        for s in sch.running.iter_mut() {
            s.computed = 43;
            s.steps.extend([record(false), record(true), record(false), record(true)]);
        }
        assert_eq!(sch.preempt_latest(), Some(SeqId(2)));
        let s = &sch.waiting[0];
        assert_eq!((s.id, s.computed, s.target(), s.clean_prefix()), (SeqId(2), 0, 43, 40));
        // Steps 1 and 3 were rechecked: positions 40 and 42 were rewritten by the gate.
        assert_eq!(s.next_chunk(64), 0..41);
        let mut s = sch.waiting.pop_front().unwrap();
        s.computed = 41;
        assert_eq!(s.next_chunk(64), 41..43);
        s.computed = 43;
        assert!(!s.in_prefill());
    }

    #[test]
    fn a_request_waits_while_a_running_one_prefills_the_blocks_it_shares() {
        let mut sch = Scheduler::new(&EngineConfig::default(), 4096);
        let mut a = seq(1, 100);
        a.req.prompt_tokens[70] = 9; // a and b share 70 positions: two whole blocks
        sch.waiting.push_back(a);
        sch.admit_front(0);
        let b = seq(2, 90);
        assert!(sch.prefix_in_flight(&b));
        sch.running[0].computed = 64;
        assert!(!sch.prefix_in_flight(&b), "both shared blocks are computed");
        sch.running[0].computed = 0;
        assert!(sch.prefix_in_flight(&seq(3, 40)), "one whole shared block before its last token");
        assert!(!sch.prefix_in_flight(&seq(4, 20)), "less than a block in common");
    }

    #[test]
    fn choices_fork_after_the_prefill_and_leave_the_queue_together() {
        let mut sch = Scheduler::new(&EngineConfig::default(), 4096);
        let mut s = seq(1, 10);
        s.req.params.n = 3;
        sch.running.push(s);
        let mut next_seq = 7;
        assert_eq!(sch.fork_choices(0, &mut next_seq), [1, 2]);
        let ids: Vec<(SeqId, RequestId, u32)> = sch.running.iter().map(|s| (s.id, s.request, s.index)).collect();
        assert_eq!(ids, [(SeqId(1), 1, 0), (SeqId(7), 1, 1), (SeqId(8), 1, 2)]);
        assert_eq!(next_seq, 9);
        // once choice 0 has a token it is no longer a fork point
        sch.running[0].steps.push(record(false));
        assert!(sch.fork_choices(0, &mut next_seq).is_empty());
        // preempted choices of one request are cancelled together, by request id
        while sch.preempt_latest().is_some() {}
        sch.waiting.push_back(seq(2, 10));
        let taken: Vec<SeqId> = sch.take_waiting(1).iter().map(|s| s.id).collect();
        assert_eq!(taken.len(), 3);
        assert_eq!(sch.waiting.iter().map(|s| s.request).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn drafts_fill_what_the_budget_leaves_and_stop_at_the_request_end() {
        let cfg = EngineConfig { speculative: Some(SpeculativeConfig::ngram(8)), ..EngineConfig::default() };
        let mut sch = Scheduler::new(&cfg, 4096);
        // prompt 1 2 3 1 2 3 1 2, output so far: 3 (fed next); the lookup proposes 1 2 3 1 2 ...
        let mut s =
            Sequence::new(SeqId(1), 1, Request::new(vec![1, 2, 3, 1, 2, 3, 1, 2], SamplingParams::greedy(6)), 0);
        s.computed = 8;
        s.steps.push(StepRecord { token: 3, ..record(false) });
        sch.running.push(s);
        assert_eq!(sch.plan(false), [(0, Work::Decode)]);
        // the latest earlier "3 1 2 3" is followed by the history's last three tokens
        assert_eq!(sch.plan(true), [(0, Work::Verify(vec![1, 2, 3]))]);
        // max_new_tokens 3 with one token out: the run may emit 2 more, so 1 draft
        sch.running[0].req.params.max_new_tokens = 3;
        assert_eq!(sch.plan(true), [(0, Work::Verify(vec![1]))], "the request's end");
        sch.running[0].req.params.max_new_tokens = 6;
        sch.max_tokens_per_step = 3;
        assert_eq!(sch.plan(true), [(0, Work::Verify(vec![1, 2]))], "the step's token budget");
        sch.running[0].req.forced_tokens = Some(vec![3, 1, 2]);
        assert_eq!(sch.plan(true), [(0, Work::Decode)], "teacher forcing");
        // the gate rechecking every step would end every run at its first row
        let always = EngineConfig { gate: GateConfig::new(GateMode::Always, 0.0).unwrap(), ..cfg };
        assert!(Scheduler::new(&always, 4096).speculative.is_none());
    }
}
