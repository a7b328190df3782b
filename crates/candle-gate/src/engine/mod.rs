//! Continuous batching, in rooms: the [`scheduler`] owns the sequences and plans each step,
//! the [`runner`] owns their KV caches and turns the plan into rows for one forward, the
//! [`gate`] decides each token (rechecking in the reference lane), and the [`output`] stage
//! turns tokens into text, stop decisions and stream events. [`Engine::step`] reads as
//! schedule → run → gate → output. Requests join and leave at step boundaries; each step packs
//! every running sequence's decode row plus whole prefill chunks under a token budget.

mod config;
mod drafter;
mod gate;
pub mod options;
mod output;
mod request;
mod runner;
mod scheduler;
mod sequence;
pub mod speculative;
mod text;

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::dispatch::Policy;
use crate::error::{Error, Result};
use crate::kv_cache::KV_BLOCK;
use crate::model::{fingerprint, Model};
use crate::reference::ReferenceWeights;
use crate::sampling::Decision;

use gate::Gate;
use runner::Runner;
use scheduler::Scheduler;
use scheduler::Work;
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
    pool: Option<rayon::ThreadPool>,
    finished: HashMap<RequestId, Output>,
    /// Requests with a choice still running: their choices finished so far.
    pending: HashMap<RequestId, Pending>,
    events: Vec<Event>,
    next_id: RequestId,
    next_seq: u64,
    steps_run: u64,
    stats: GateStats,
    cache_stats: CacheStats,
    spec_stats: SpecStats,
    /// Steps whose draft model failed (those sequences decoded without drafts).
    draft_failures: u64,
    shut_down: bool,
    model_sha: String,
    /// What this host and build contribute to the bits in the policy's mode (`host::signature`).
    host: String,
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
        if cfg.max_num_seqs == 0 {
            return Err(Error::invalid("max_num_seqs", "max_num_seqs must be at least 1"));
        }
        if cfg.prefill_chunk == 0 || cfg.max_tokens_per_step < cfg.prefill_chunk {
            return Err(Error::invalid(
                "prefill_chunk",
                format!(
                    "need 1 <= prefill_chunk ({}) <= max_tokens_per_step ({})",
                    cfg.prefill_chunk, cfg.max_tokens_per_step
                ),
            ));
        }
        if let Some(spec) = &cfg.speculative {
            spec.validate()?;
        }
        check_draft_model(&model, draft.as_deref(), cfg.speculative.as_ref())?;
        let pool = match cfg.threads {
            Some(0) => return Err(Error::invalid("threads", "threads must be at least 1")),
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
        let model_sha = model.sha256()?;
        // What besides the tokens decides a K/V block's bits: no block is shared across them.
        let salt = crate::prefix_cache::salt(&[&model_sha, &policy.describe(), cfg.kv_dtype.name()]);
        Ok(Engine {
            model_sha,
            host: crate::host::signature(policy.mode),
            scheduler: Scheduler::new(&cfg, model.decoder.cfg.context_length),
            runner: Runner::new(&model, draft, &cfg, salt),
            gate,
            model,
            policy,
            cfg,
            pool,
            finished: HashMap::new(),
            pending: HashMap::new(),
            events: Vec::new(),
            next_id: 1,
            next_seq: 0,
            steps_run: 0,
            stats: GateStats::default(),
            cache_stats: CacheStats::default(),
            spec_stats: SpecStats::default(),
            draft_failures: 0,
            shut_down: false,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
    /// The kernel policy and the K/V storage: what, besides the gate and the host, decides a
    /// result's bits (the fingerprint's "policy" part).
    pub fn describe_kernels(&self) -> String {
        format!("{};kv={}", self.policy.describe(), self.cfg.kv_dtype.name())
    }
    /// The stack every result of this engine is fingerprinted with, as the server reports it
    /// ([`crate::model::system_fingerprint`]).
    pub fn system_fingerprint(&self) -> String {
        crate::model::system_fingerprint(
            &self.model_sha,
            &self.describe_kernels(),
            &self.cfg.gate.describe(),
            &self.host,
        )
    }
    pub fn gate_stats(&self) -> GateStats {
        self.stats.clone()
    }

    /// Validates and queues a request. Everything that can make a request fail is checked
    /// here, so a bad request never reaches a step that other requests share.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        if self.shut_down {
            return Err(Error::ShutDown);
        }
        self.validate(&req)?;
        let id = self.next_id;
        self.next_id += 1;
        let seed = req.params.seed.unwrap_or_else(|| fresh_seed(id));
        let n = req.params.n;
        let pending = Pending { prompt_tokens: req.prompt_tokens.clone(), seed, choices: vec![None; n] };
        self.pending.insert(id, pending);
        self.scheduler.waiting.push_back(Sequence::new(SeqId(self.next_seq), id, req, seed));
        self.next_seq += 1;
        Ok(id)
    }

    /// Checks a request against the model and the budgets.
    fn validate(&self, req: &Request) -> Result<()> {
        let ctx = self.model.decoder.cfg.context_length;
        let vocab = self.model.decoder.cfg.vocab as u32;
        if req.prompt_tokens.is_empty() {
            return Err(Error::invalid("prompt", "empty prompt"));
        }
        if let Some(t) = req.prompt_tokens.iter().find(|&&t| t >= vocab) {
            return Err(Error::invalid("prompt", format!("prompt token id {t} is outside the vocabulary of {vocab}")));
        }
        let p = &req.params;
        p.validate()?;
        if p.n > self.cfg.max_num_seqs {
            return Err(Error::invalid(
                "n",
                format!("n = {} choices cannot run at once with max_num_seqs = {}", p.n, self.cfg.max_num_seqs),
            ));
        }
        if req.prompt_tokens.len() >= ctx {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens but the context holds {ctx} (including at least one new token)",
                    req.prompt_tokens.len()
                ),
            ));
        }
        if let Some(f) = &req.forced_tokens {
            if let Some(t) = f.iter().find(|&&t| t >= vocab) {
                return Err(Error::invalid("forced_tokens", format!("forced token id {t} is outside the vocabulary")));
            }
        }
        // Alone in the engine it must be able to finish: then preemption can always make room.
        let reserve = (req.prompt_tokens.len() + p.max_new_tokens).min(ctx);
        let blocks = reserve.div_ceil(KV_BLOCK) * p.n;
        if blocks > self.cfg.kv_budget_blocks() {
            return Err(Error::invalid("max_new_tokens", format!(
                "the request needs {} tokens of KV cache ((prompt + max_new_tokens) x n, in blocks of {KV_BLOCK}) but the whole budget is {}",
                blocks * KV_BLOCK,
                self.cfg.kv_budget_blocks() * KV_BLOCK
            )));
        }
        Ok(())
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
        if self.finished.contains_key(&id) {
            return Ok(());
        }
        Err(Error::invalid("request_id", format!("unknown request id {id}")))
    }

    pub fn shutdown(&mut self) {
        self.shut_down = true;
    }
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }
    pub fn num_waiting(&self) -> usize {
        self.scheduler.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.scheduler.running.len()
    }
    /// Blocks of the KV pool held by running sequences' caches now.
    pub fn kv_used_blocks(&self) -> usize {
        self.runner.pool().used_blocks()
    }
    /// Blocks no running sequence holds that keep a cached prefix (reused, least recently
    /// used first, when the free ones run out).
    pub fn kv_cached_blocks(&self) -> usize {
        self.runner.pool().cached_blocks()
    }
    /// The pool's size in blocks (`kv_budget_tokens` rounded up to whole blocks).
    pub fn kv_total_blocks(&self) -> usize {
        self.cfg.kv_budget_blocks()
    }
    /// Prefix-cache and preemption counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache_stats.clone()
    }
    /// The engine's speculation, if any.
    pub fn speculative(&self) -> Option<&SpeculativeConfig> {
        self.cfg.speculative.as_ref()
    }
    /// The engine's speculation in one line (None: off), e.g. `ngram;k=12;lookup=2..64;max_batch=8`
    /// or `draft;k=3;max_batch=1;draft_model=FILE`.
    pub fn describe_speculation(&self) -> Option<String> {
        let spec = self.cfg.speculative.as_ref()?.describe();
        Some(match self.runner.draft_model() {
            Some(d) => format!("{spec};draft_model={}", d.path.file_name().unwrap_or_default().to_string_lossy()),
            None => spec,
        })
    }
    /// Drafts proposed and kept since the engine started.
    pub fn spec_stats(&self) -> SpecStats {
        self.spec_stats
    }
    /// Steps in which the draft model failed; their sequences decoded without drafts (the
    /// same tokens) and went on.
    pub fn draft_failures(&self) -> u64 {
        self.draft_failures
    }
    /// Forgets every cached prefix (blocks held by running sequences stay with them).
    pub fn reset_prefix_cache(&mut self) {
        self.runner.reset_prefix_cache();
    }

    pub fn drain_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub fn take_output(&mut self, id: RequestId) -> Option<Output> {
        self.finished.remove(&id)
    }
    pub fn is_finished(&self, id: RequestId) -> bool {
        self.finished.contains_key(&id)
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
        self.admit()?;
        let mut plan = self.plan_within_pool();
        if plan.is_empty() {
            return Ok(0);
        }
        self.steps_run += 1;
        let fail_draft = self.cfg.inject_fault == Some(InjectedFault::Draft { step: self.steps_run });
        let speculating = self.scheduler.speculates(&plan);
        if self
            .runner
            .propose(self.policy.as_ref(), &self.scheduler.running, &mut plan, speculating, fail_draft)
            .is_some()
        {
            self.draft_failures += 1;
        }
        let fail_midway = self.cfg.inject_fault == Some(InjectedFault::Forward { step: self.steps_run });
        let model = self.model.clone();
        let reference = self.gate.reference;
        let running = &mut self.scheduler.running;
        let (rows, logits) = self.runner.run(&model, &self.policy, reference, running, &plan, fail_midway)?;
        // A request of n choices prefills once; its other choices start here, each sharing
        // the prompt's K/V blocks, deciding from the same logits.
        let mut deciding: Vec<(usize, usize)> = Vec::with_capacity(logits.len());
        for (k, (i, _)) in logits.iter().enumerate() {
            deciding.push((*i, k));
            for j in self.scheduler.fork_choices(*i, &mut self.next_seq) {
                self.runner.fork(self.scheduler.running[*i].id, self.scheduler.running[j].id);
                deciding.push((j, k));
            }
        }
        // The sampling of each sequence's first row runs for every sequence at once; the
        // gate's rechecks and the rest of each verification run follow.
        let running = &self.scheduler.running;
        let vocab = model.decoder.cfg.vocab;
        let fast: Vec<_> =
            deciding.par_iter().map(|&(i, k)| gate::fast_decision(&running[i], &logits[k].1[..vocab])).collect();
        for (&(i, k), fast) in deciding.iter().zip(fast) {
            let drafts = match plan.binary_search_by_key(&i, |p| p.0).map(|p| &plan[p].1) {
                Ok(Work::Verify(d)) => d.as_slice(),
                _ => &[],
            };
            self.decide_rows(&model, i, &logits[k].1, fast, drafts);
        }
        for s in self.scheduler.running.iter_mut() {
            output::emit(&mut self.events, s);
            if s.error.is_none() {
                self.runner.publish(s);
            }
        }
        self.retire_finished();
        Ok(rows)
    }

    /// Decides `running[i]`'s tokens from its rows' logits: one row, or a verification run (the
    /// fed token, then each draft). Row `j`'s decision is the one plain decoding makes there as
    /// long as every earlier draft equalled the decision before it; so the run goes on while a
    /// draft equals the decision, the gate did not recheck the row (a recheck rewrites the row's
    /// K/V, which the rows after it read) and the sequence has not finished. The cache keeps the
    /// rows up to the last decided one.
    fn decide_rows(&mut self, model: &Model, i: usize, logits: &[f32], fast: Decision, drafts: &[u32]) {
        let (vocab, steps_run) = (model.decoder.cfg.vocab, self.steps_run);
        let first = self.scheduler.running[i].computed - 1 - drafts.len();
        let steps_before = self.scheduler.running[i].steps.len();
        let mut fast = Some(fast);
        for j in 0..=drafts.len() {
            let s = &mut self.scheduler.running[i];
            let row = &logits[j * vocab..(j + 1) * vocab];
            let fast = fast.take().unwrap_or_else(|| gate::fast_decision(s, row));
            let last = j == drafts.len() || self.gate.rechecks(&fast);
            if last {
                self.runner.truncate(s, first + j + 1); // the recheck rewrites the cache's last row
            }
            let fault = self.cfg.inject_fault == Some(InjectedFault::Gate { step: steps_run, id: s.request });
            let decided = match fault {
                true => Err(Error::Engine(format!("injected fault in the gate of step {steps_run}"))),
                false => self.gate.decide(model, s, &mut self.runner, row, fast),
            };
            let kept = match decided {
                Ok(record) => {
                    let kept = !last && record.token == drafts[j] && !record.rechecked;
                    record.tally(&mut self.stats);
                    s.steps.push(record);
                    output::after_token(model, s);
                    kept && s.finish.is_none()
                }
                Err(e) => {
                    s.error = Some(e);
                    s.finish = Some(FinishReason::Error);
                    false
                }
            };
            if !kept {
                self.runner.truncate(s, first + j + 1);
                break;
            }
            s.speculation.accepted_tokens += 1;
            self.spec_stats.accepted_tokens += 1;
            output::emit(&mut self.events, s);
        }
        let s = &mut self.scheduler.running[i];
        if !drafts.is_empty() {
            // A run kept whole asks for twice as many next time; one cut short, for one more
            // than it kept: verification rows cost compute, and a sequence that is copying its
            // prompt keeps long runs while one that is not keeps none.
            let kept = (s.steps.len() - steps_before).saturating_sub(1);
            s.draft_window = if kept == drafts.len() { 2 * drafts.len() } else { kept + 1 };
        }
        s.speculation.draft_tokens += drafts.len() as u64;
        self.spec_stats.draft_tokens += drafts.len() as u64;
    }

    /// Admits waiting sequences in order while the sequence limit and the pool allow: a
    /// sequence comes in when the blocks its history still needs (after its prefix-cache hit)
    /// plus one step fit beside what the running sequences need to reach their next token, and
    /// no running sequence is still prefilling whole blocks of its prompt (then it comes in once
    /// they are cached, and takes them as a hit).
    fn admit(&mut self) -> Result<()> {
        let mut committed: usize = self
            .scheduler
            .running
            .iter()
            .map(|s| self.runner.blocks_to_extend(s.id, s.target() + 1 - s.computed))
            .sum();
        while let Some(s) = self.scheduler.next_to_admit() {
            // Its prefix is being computed by a running request: wait for those blocks instead
            // of computing them a second time beside it.
            if self.cfg.enable_prefix_caching && self.scheduler.prefix_in_flight(s) {
                break;
            }
            let hit = self.runner.open(s);
            let need = (s.target() + 1).div_ceil(KV_BLOCK) - hit / KV_BLOCK;
            if need + committed > self.runner.available_blocks() {
                self.runner.close(s.id);
                break;
            }
            committed += need;
            if s.cached_tokens.is_none() {
                self.cache_stats.prefix_queries += s.req.prompt_tokens.len() as u64;
                self.cache_stats.prefix_hits += hit as u64;
            }
            let computed = self.runner.restore_rebuilt(s)?;
            let front = self.scheduler.waiting.front_mut().unwrap();
            front.cached_tokens.get_or_insert(hit);
            self.scheduler.admit_front(computed);
        }
        Ok(())
    }

    /// The step's plan, after preempting the most recently admitted sequences until the
    /// blocks it needs are in the pool.
    fn plan_within_pool(&mut self) -> Vec<(usize, scheduler::Work)> {
        loop {
            // Drafts only when they fit beside every sequence's next row.
            for with_drafts in [true, false] {
                let plan = self.scheduler.plan(with_drafts);
                let running = &self.scheduler.running;
                let need: usize =
                    plan.iter().map(|(i, w)| self.runner.blocks_to_extend(running[*i].id, w.rows())).sum();
                if need <= self.runner.available_blocks() || (!with_drafts && running.len() <= 1) {
                    return plan;
                }
            }
            let id = self.scheduler.preempt_latest().expect("a running sequence");
            self.runner.close(id);
            self.cache_stats.preemptions += 1;
        }
    }

    fn retire_finished(&mut self) {
        for s in self.scheduler.take_finished() {
            self.retire(s);
        }
    }

    fn retire(&mut self, s: Sequence) {
        self.runner.close(s.id);
        let reason = s.finish.unwrap_or(FinishReason::Cancelled);
        let token_ids = s.output();
        let fp =
            fingerprint(&self.model_sha, &self.describe_kernels(), &self.cfg.gate.describe(), &self.host, &token_ids);
        let steps = &s.steps;
        let choice = Choice {
            index: s.index,
            token_ids,
            margins: steps.iter().map(|r| r.margin).collect(),
            reference_margins: steps.iter().map(|r| r.reference_margin).collect(),
            rechecked: steps.iter().map(|r| r.rechecked).collect(),
            corrected: steps.iter().map(|r| r.corrected).collect(),
            logit_hashes: steps.iter().filter_map(|r| r.logit_hash).collect(),
            logprobs: steps.iter().filter_map(|r| r.logprob).collect(),
            top_logprobs: match s.req.params.top_logprobs {
                0 => Vec::new(),
                _ => steps.iter().map(|r| r.top_logprobs.clone()).collect(),
            },
            finish_reason: reason,
            fingerprint: fp,
            gate: s.gate_stats(),
            draft_tokens: s.speculation.draft_tokens,
            accepted_tokens: s.speculation.accepted_tokens,
            error: s.error.map(|e| e.to_string()),
            text: s.text.text,
        };
        let Some(p) = self.pending.get_mut(&s.request) else { return };
        // A request that ends before its prefill forked it ends every choice the same way.
        let unforked = s.index == 0 && steps.is_empty();
        for (index, slot) in p.choices.iter_mut().enumerate() {
            if index == s.index as usize || (unforked && slot.is_none()) {
                *slot = Some(Choice { index: index as u32, ..choice.clone() });
                let speculation = s.speculation;
                self.events.push(Event::Finished { id: s.request, index: index as u32, reason, speculation });
            }
        }
        if p.choices.iter().all(Option::is_some) {
            let p = self.pending.remove(&s.request).unwrap();
            let output = Output {
                id: s.request,
                prompt_tokens: p.prompt_tokens,
                cached_tokens: s.cached_tokens.unwrap_or(0),
                seed: p.seed,
                choices: p.choices.into_iter().map(Option::unwrap).collect(),
            };
            self.finished.insert(s.request, output);
        }
    }

    /// Runs until every submitted request is done; outputs in submission order.
    pub fn run_to_completion(&mut self, ids: &[RequestId]) -> Result<Vec<Output>> {
        while ids.iter().any(|id| !self.finished.contains_key(id)) {
            if self.step()? == 0 && !self.has_work() {
                break;
            }
        }
        ids.iter()
            .map(|id| self.take_output(*id).ok_or_else(|| Error::Engine(format!("request {id} did not finish"))))
            .collect()
    }
}

/// A draft model goes with speculative method `draft` alone, and must share the target's
/// vocabulary: every token's bytes and kind, the special and stop ids, and the logits' width
/// (a draft is a token id the target verifies).
fn check_draft_model(model: &Model, draft: Option<&Model>, spec: Option<&SpeculativeConfig>) -> Result<()> {
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

/// A request whose choices are not all finished.
struct Pending {
    prompt_tokens: Vec<u32>,
    seed: u64,
    choices: Vec<Option<Choice>>,
}

/// A seed for a request that gave none: fresh per request and per process.
fn fresh_seed(id: RequestId) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(id);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}
