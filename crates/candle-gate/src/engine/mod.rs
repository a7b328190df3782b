//! Continuous batching, in rooms: the [`scheduler`] owns the sequences and plans each step
//! (admission and preemption included), the [`runner`] owns every cache and turns the plan into
//! rows for one forward, the [`decide`] stage turns each sequence's logits into tokens through
//! the [`gate`] (the runner recomputing what the gate asks for), and the [`output`] stage turns
//! tokens into text, stop decisions, stream events and outputs. [`Engine::step`] reads as
//! schedule → propose → run → decide → output. Requests join and leave at step boundaries; each
//! step packs every running sequence's decode row plus whole prefill chunks under a token budget.

mod config;
mod decide;
mod drafter;
mod gate;
mod inspect;
pub mod options;
mod output;
mod request;
mod runner;
mod scheduler;
mod sequence;
pub mod speculative;
mod text;

use std::sync::Arc;

use rayon::prelude::*;

use crate::dispatch::Policy;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::reference::ReferenceWeights;

use decide::Decide;
use gate::Gate;
use output::{Outputs, Stack};
use runner::{Runner, StepLogits};
use scheduler::{Scheduler, Work};
use sequence::{SeqId, Sequence};

pub use config::{EngineConfig, GateConfig, GateMode, InjectedFault, DEEP_TAU_FRACTION};
pub use options::EngineOptions;
pub use request::{CacheStats, Choice, Event, FinishReason, GateStats, Output, Request, RequestId};
pub use speculative::{SpecStats, SpeculativeConfig, SpeculativeMethod};

/// Upper bound on `max_new_tokens` accepted at submit: a bigger value is a bug, not a plan.
pub use crate::sampling::MAX_NEW_TOKENS_LIMIT;

pub struct Engine {
    model: Arc<Model>,
    policy: Arc<Policy>,
    cfg: EngineConfig,
    scheduler: Scheduler,
    runner: Runner,
    gate: Gate,
    outputs: Outputs,
    /// What a result's fingerprint covers besides its tokens.
    stack: Stack,
    pool: Option<rayon::ThreadPool>,
    next_id: RequestId,
    next_seq: u64,
    steps_run: u64,
    stats: GateStats,
    spec_stats: SpecStats,
    /// Steps whose draft model failed (those sequences decoded without drafts).
    draft_failures: u64,
    shut_down: bool,
}

impl Engine {
    pub fn new(model: Arc<Model>, policy: Arc<Policy>, cfg: EngineConfig) -> Result<Self> {
        Self::with_draft_model(model, None, policy, cfg)
    }

    /// An engine whose speculation (`cfg.speculative` with method `draft`) drafts with
    /// `draft`, a model with the target's vocabulary (checked token by token).
    pub fn with_draft_model(
        model: Arc<Model>,
        draft: Option<Arc<Model>>,
        policy: Arc<Policy>,
        cfg: EngineConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        drafter::check_draft_model(&model, draft.as_deref(), cfg.speculative.as_ref())?;
        let pool = match cfg.threads {
            Some(n) => {
                Some(rayon::ThreadPoolBuilder::new().num_threads(n).build().map_err(|e| Error::Engine(e.to_string()))?)
            }
            None => None,
        };
        let gate = Gate {
            cfg: cfg.gate,
            reference: ReferenceWeights::for_budget(model.decoder.dense_f32_bytes(), cfg.reference_dense_max_bytes),
            record_logit_hashes: cfg.record_logit_hashes,
        };
        let stack = Stack {
            model_sha: model.sha256()?,
            kernels: format!("{};kv={}", policy.describe(), cfg.kv_dtype.name()),
            gate: cfg.gate.describe(),
            host: crate::host::signature(policy.mode),
        };
        // What besides the tokens decides a K/V block's bits: no block is shared across them.
        let salt = crate::prefix_cache::salt(&[&stack.model_sha, &policy.describe(), cfg.kv_dtype.name()]);
        let layout = model.decoder.cfg.block_layout(cfg.kv_dtype);
        Ok(Engine {
            scheduler: Scheduler::new(&cfg, model.decoder.cfg.context_length),
            runner: Runner::new(layout, draft, &cfg, salt),
            gate,
            outputs: Outputs::default(),
            stack,
            model,
            policy,
            cfg,
            pool,
            next_id: 1,
            next_seq: 0,
            steps_run: 0,
            stats: GateStats::default(),
            spec_stats: SpecStats::default(),
            draft_failures: 0,
            shut_down: false,
        })
    }

    /// Validates and queues a request. Everything that can make a request fail is checked
    /// here, so a bad request never reaches a step that other requests share.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        if self.shut_down {
            return Err(Error::ShutDown);
        }
        let c = &self.model.decoder.cfg;
        req.validate(c.vocab, c.context_length, &self.cfg)?;
        let id = self.next_id;
        self.next_id += 1;
        let seed = req.params.seed.unwrap_or_else(|| request::fresh_seed(id));
        self.outputs.expect(id, req.prompt_tokens.clone(), seed, req.params.n);
        self.scheduler.waiting.push_back(Sequence::new(SeqId(self.next_seq), id, req, seed));
        self.next_seq += 1;
        Ok(id)
    }

    /// Cancels every choice of request `id`; its output keeps what they had generated.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        let waiting = self.scheduler.take_waiting(id);
        let mut found = !waiting.is_empty();
        for mut s in waiting {
            s.finish = Some(FinishReason::Cancelled);
            self.retire(s);
        }
        for s in self.scheduler.running.iter_mut().filter(|s| s.request == id) {
            s.finish.get_or_insert(FinishReason::Cancelled);
            found = true;
        }
        if found {
            self.retire_finished();
            return Ok(());
        }
        if self.outputs.is_finished(id) {
            return Ok(());
        }
        Err(Error::invalid("request_id", format!("unknown request id {id}")))
    }

    pub fn shutdown(&mut self) {
        self.shut_down = true;
    }

    /// Forgets every cached prefix (blocks held by running sequences stay with them).
    pub fn reset_prefix_cache(&mut self) {
        self.runner.reset_prefix_cache();
    }

    pub fn drain_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.outputs.events)
    }

    pub fn take_output(&mut self, id: RequestId) -> Option<Output> {
        self.outputs.take(id)
    }
    pub fn is_finished(&self, id: RequestId) -> bool {
        self.outputs.is_finished(id)
    }

    /// One forward over every active row. Returns the number of rows it ran. An error leaves
    /// every sequence and cache as they were before the step; a failure that concerns one
    /// sequence (its recheck) finishes that sequence with `FinishReason::Error` and no other.
    pub fn step(&mut self) -> Result<usize> {
        match self.pool.take() {
            Some(pool) => {
                let r = pool.install(|| self.step_inner());
                self.pool = Some(pool);
                r
            }
            None => self.step_inner(),
        }
    }

    fn step_inner(&mut self) -> Result<usize> {
        let mut plan = self.scheduler.schedule(&mut self.runner)?;
        if plan.is_empty() {
            return Ok(0);
        }
        self.steps_run += 1;
        self.propose(&mut plan);
        let (rows, logits) = self.run(&plan)?;
        self.decide(&plan, logits);
        self.output();
        Ok(rows)
    }

    /// Drafts for the plan's [`Work::Draft`]s, from the draft model.
    fn propose(&mut self, plan: &mut [(usize, Work)]) {
        let fail = self.cfg.inject_fault == Some(InjectedFault::Draft { step: self.steps_run });
        let speculating = self.scheduler.speculates(plan);
        let running = &self.scheduler.running;
        if self.runner.propose(self.policy.as_ref(), running, plan, speculating, fail).is_some() {
            self.draft_failures += 1;
        }
    }

    /// The plan's forward; a sequence whose own part of it failed finishes with the error.
    fn run(&mut self, plan: &[(usize, Work)]) -> Result<(usize, StepLogits)> {
        let fail_midway = self.cfg.inject_fault == Some(InjectedFault::Forward { step: self.steps_run });
        let reference = self.gate.reference;
        let running = &self.scheduler.running;
        let run = self.runner.run(&self.model, &self.policy, reference, running, plan, fail_midway)?;
        self.scheduler.advance(plan);
        for (i, e) in run.failed {
            decide::fail(&mut self.scheduler.running[i], e);
        }
        Ok((run.rows, run.logits))
    }

    /// Every sequence's tokens from its rows' logits. A request of n choices prefills once;
    /// its other choices start here, each sharing the prompt's K/V blocks, deciding from the
    /// same logits. The first row's sampling runs for every sequence at once; the gate's
    /// rechecks and the rest of each verification run follow.
    fn decide(&mut self, plan: &[(usize, Work)], logits: StepLogits) {
        let mut deciding: Vec<(usize, usize)> = Vec::with_capacity(logits.len());
        for (k, (i, _)) in logits.iter().enumerate() {
            deciding.push((*i, k));
            for j in self.scheduler.fork_choices(*i, &mut self.next_seq) {
                self.runner.fork(self.scheduler.running[*i].id, self.scheduler.running[j].id);
                deciding.push((j, k));
            }
        }
        let running = &self.scheduler.running;
        let vocab = self.model.decoder.cfg.vocab;
        let fast: Vec<_> =
            deciding.par_iter().map(|&(i, k)| gate::decision(&running[i], &logits[k].1[..vocab])).collect();
        let failing = match self.cfg.inject_fault {
            Some(InjectedFault::Gate { step, id }) if step == self.steps_run => Some(id),
            _ => None,
        };
        let mut stage = Decide {
            model: &self.model,
            gate: &self.gate,
            runner: &mut self.runner,
            outputs: &mut self.outputs,
            gate_stats: &mut self.stats,
            spec_stats: &mut self.spec_stats,
            failing,
        };
        for (&(i, k), fast) in deciding.iter().zip(fast) {
            let drafts = match plan.binary_search_by_key(&i, |p| p.0).map(|p| &plan[p].1) {
                Ok(Work::Verify(d)) => d.as_slice(),
                _ => &[],
            };
            stage.rows(&mut self.scheduler.running[i], &logits[k].1, fast, drafts);
        }
    }

    /// Streams every sequence's new text, registers the blocks they filled in the prefix
    /// cache, and retires the finished ones.
    fn output(&mut self) {
        for s in self.scheduler.running.iter_mut() {
            self.outputs.emit(s);
            if s.error.is_none() {
                self.runner.publish(s);
            }
        }
        self.retire_finished();
    }

    fn retire_finished(&mut self) {
        for s in self.scheduler.take_finished() {
            self.retire(s);
        }
    }

    fn retire(&mut self, s: Sequence) {
        self.runner.release(s.id);
        self.outputs.retire(s, &self.stack);
    }

    /// Runs until every submitted request is done; outputs in submission order.
    pub fn run_to_completion(&mut self, ids: &[RequestId]) -> Result<Vec<Output>> {
        while ids.iter().any(|id| !self.outputs.is_finished(*id)) {
            if self.step()? == 0 && !self.has_work() {
                break;
            }
        }
        ids.iter()
            .map(|id| self.take_output(*id).ok_or_else(|| Error::Engine(format!("request {id} did not finish"))))
            .collect()
    }
}
