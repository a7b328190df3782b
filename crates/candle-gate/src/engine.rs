//! Continuous batching. The scheduler owns sequences and their state; the model only sees
//! rows. Requests join and leave at step boundaries; each step packs every running
//! sequence's decode row plus whole prefill chunks under a token budget.
//!
//! Prefill chunk boundaries are multiples of `prefill_chunk` counted from the start of the
//! prompt, so they depend only on the prompt, never on load: a chunk that does not fit the
//! step's budget waits for the next step whole.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::sync::Arc;

use serde::Serialize;

use crate::dispatch::Policy;
use crate::error::{Error, Result};
use crate::llama::{argmax_margin, KvCache, SeqRows};
use crate::model::{fingerprint, Model};
use crate::reference::ReferenceWeights;
use crate::tokenizer::StreamDecoder;

pub type RequestId = u64;

/// Upper bound on `max_new_tokens` accepted at submit: a bigger value is a bug, not a plan.
pub const MAX_NEW_TOKENS_LIMIT: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GateMode {
    Off,
    Gated,
    Always,
    /// Runs the reference step on every step only to record its margin
    /// (`Output::reference_margins`), then restores the fast lane's K/V and keeps its token:
    /// outputs are those of `Off`. What `calibrate --gate` measures with.
    Shadow,
}

impl GateMode {
    pub const ALL: [GateMode; 4] = [GateMode::Off, GateMode::Gated, GateMode::Always, GateMode::Shadow];
    pub fn name(self) -> &'static str {
        match self {
            GateMode::Off => "off",
            GateMode::Gated => "gated",
            GateMode::Always => "always",
            GateMode::Shadow => "shadow",
        }
    }
}

impl FromStr for GateMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        GateMode::ALL.into_iter().find(|g| g.name() == s).ok_or_else(|| {
            Error::BadInput(format!("unknown gate mode {s:?}; expected off, gated, always or shadow"))
        })
    }
}

/// The margin gate. A step whose fast-lane margin is below `tau` is recomputed in the reference
/// lane over the sequence's cache. That removes the step's own batch noise but not the noise
/// already in the cache (K/V written by earlier fast-lane steps); when the reference margin is
/// itself below `deep_tau`, that noise could still decide the token, so the whole sequence's
/// cache is rebuilt in the reference lane first ("deep recheck"): the token then depends on
/// nothing but the token history.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateConfig {
    pub mode: GateMode,
    pub tau: f32,
    pub deep_tau: f32,
}

/// `deep_tau` when not given: half of tau. On the default model's gemm_f16 lane the recheck's
/// margin moved by 0.44x as much as the fast lane's across batch compositions
/// (`calibrate --gate`: recheck_shift 0.021 vs batch_shift 0.047); calibrate it for your lane.
pub const DEEP_TAU_FRACTION: f32 = 0.5;

impl GateConfig {
    pub fn new(mode: GateMode, tau: f32) -> Result<Self> {
        Self::with_deep(mode, tau, tau * DEEP_TAU_FRACTION)
    }
    pub fn with_deep(mode: GateMode, tau: f32, deep_tau: f32) -> Result<Self> {
        for (name, v) in [("tau", tau), ("deep_tau", deep_tau)] {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::BadInput(format!("{name} must be a finite number >= 0, got {v}")));
            }
        }
        Ok(GateConfig { mode, tau, deep_tau })
    }
    pub fn off() -> Self {
        GateConfig { mode: GateMode::Off, tau: 0.0, deep_tau: 0.0 }
    }
    pub fn describe(&self) -> String {
        match self.mode {
            GateMode::Off | GateMode::Shadow => "gate=off".into(),
            GateMode::Always => format!("gate=always;deep_tau={}", self.deep_tau),
            GateMode::Gated => format!("gate=gated;tau={};deep_tau={}", self.tau, self.deep_tau),
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_tokens_per_step: usize,
    pub prefill_chunk: usize,
    /// KV memory budget in tokens (over all sequences).
    pub kv_budget_tokens: usize,
    pub gate: GateConfig,
    /// FP32 copies of the weights for the reference lane are kept only under this many bytes.
    pub reference_dense_max_bytes: usize,
    /// Worker threads for this engine's steps (None: the global pool).
    pub threads: Option<usize>,
    /// Keep a hash of every step's logits bits (the probe counts mismatches with them).
    pub record_logit_hashes: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 16,
            max_tokens_per_step: 256,
            prefill_chunk: 64,
            kv_budget_tokens: 65536,
            gate: GateConfig::off(),
            reference_dense_max_bytes: 2 << 30,
            threads: None,
            record_logit_hashes: false,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    /// Teacher forcing: feed these tokens instead of the chosen ones (the choice is still
    /// recorded), to count step flips against another run's tokens.
    pub forced_tokens: Option<Vec<u32>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Eos,
    StopString,
    Length,
    Cancelled,
    ContextFull,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::StopString => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ContextFull => "context_full",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Event {
    Token { id: RequestId, token: u32, text: String },
    Finished { id: RequestId, reason: FinishReason },
}

#[derive(Clone, Debug, Default)]
pub struct GateStats {
    pub steps: u64,
    pub rechecks: u64,
    pub corrections: u64,
    pub deep_rechecks: u64,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Output {
    pub id: RequestId,
    pub prompt_tokens: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub margins: Vec<f32>,
    /// The reference lane's margin on rechecked steps (after a deep recheck, the rebuilt
    /// lane's); NaN on steps the gate let through.
    pub reference_margins: Vec<f32>,
    pub rechecked: Vec<bool>,
    /// Steps whose token the reference lane changed (with `GateMode::Shadow`: would have).
    pub corrected: Vec<bool>,
    pub logit_hashes: Vec<u64>,
    pub finish_reason: FinishReason,
    pub fingerprint: String,
    pub gate: GateStats,
}

struct Sequence {
    id: RequestId,
    req: Request,
    cache: KvCache,
    prefilled: usize,
    output: Vec<u32>,
    margins: Vec<f32>,
    reference_margins: Vec<f32>,
    rechecked: Vec<bool>,
    corrected: Vec<bool>,
    logit_hashes: Vec<u64>,
    /// Positions `..reference_exact` of the cache hold the reference lane's K/V computed over
    /// the reference lane's own prefix (left by the last deep recheck), so the next deep
    /// recheck only rebuilds from there.
    reference_exact: usize,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    finish: Option<FinishReason>,
    gate: GateStats,
    reserved_tokens: usize,
    new_token: bool,
}

impl Sequence {
    fn in_prefill(&self) -> bool {
        self.prefilled < self.req.prompt_tokens.len()
    }
    /// The prompt's next chunk: from `prefilled` to the next multiple of `chunk`.
    fn next_chunk(&self, chunk: usize) -> std::ops::Range<usize> {
        let end = ((self.prefilled / chunk) + 1) * chunk;
        self.prefilled..end.min(self.req.prompt_tokens.len())
    }
}

fn hash_bits(logits: &[f32]) -> u64 {
    // FNV-1a over the exact bits: equal iff (with overwhelming probability) bitwise equal.
    let mut h = 0xcbf29ce484222325u64;
    for v in logits {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

pub struct Engine {
    model: Arc<Model>,
    policy: Arc<Policy>,
    cfg: EngineConfig,
    reference: ReferenceWeights,
    pool: Option<rayon::ThreadPool>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    finished: HashMap<RequestId, Output>,
    events: Vec<Event>,
    next_id: RequestId,
    reserved_tokens: usize,
    stats: GateStats,
    shut_down: bool,
    model_sha: String,
    /// What this host and build contribute to the bits in the policy's mode (`host::signature`).
    host: String,
}

impl Engine {
    pub fn new(model: Arc<Model>, policy: Arc<Policy>, cfg: EngineConfig) -> Result<Self> {
        if cfg.max_num_seqs == 0 {
            return Err(Error::BadInput("max_num_seqs must be at least 1".into()));
        }
        if cfg.prefill_chunk == 0 || cfg.max_tokens_per_step < cfg.prefill_chunk {
            return Err(Error::BadInput(format!(
                "need 1 <= prefill_chunk ({}) <= max_tokens_per_step ({})",
                cfg.prefill_chunk, cfg.max_tokens_per_step
            )));
        }
        let pool = match cfg.threads {
            Some(0) => return Err(Error::BadInput("threads must be at least 1".into())),
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| Error::Engine(e.to_string()))?,
            ),
            None => None,
        };
        let reference = ReferenceWeights::for_budget(&model.llama, cfg.reference_dense_max_bytes);
        let model_sha = model.sha256()?;
        let policy_mode = policy.mode;
        Ok(Engine {
            model,
            policy,
            cfg,
            reference,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: HashMap::new(),
            events: Vec::new(),
            next_id: 1,
            reserved_tokens: 0,
            stats: GateStats::default(),
            shut_down: false,
            model_sha,
            host: crate::host::signature(policy_mode),
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
    pub fn gate_stats(&self) -> GateStats {
        self.stats.clone()
    }

    /// Validates and queues a request. Everything that can make a request fail is checked
    /// here, so a bad request never reaches a step that other requests share.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        if self.shut_down {
            return Err(Error::Engine("the engine has been shut down".into()));
        }
        let ctx = self.model.llama.cfg.context_length;
        let vocab = self.model.llama.cfg.vocab as u32;
        if req.prompt_tokens.is_empty() {
            return Err(Error::BadInput("empty prompt".into()));
        }
        if let Some(t) = req.prompt_tokens.iter().find(|&&t| t >= vocab) {
            return Err(Error::BadInput(format!("prompt token id {t} is outside the vocabulary of {vocab}")));
        }
        if req.max_new_tokens == 0 || req.max_new_tokens > MAX_NEW_TOKENS_LIMIT {
            return Err(Error::BadInput(format!(
                "max_new_tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {}",
                req.max_new_tokens
            )));
        }
        if req.prompt_tokens.len() >= ctx {
            return Err(Error::BadInput(format!(
                "the prompt has {} tokens but the context holds {ctx} (including at least one new token)",
                req.prompt_tokens.len()
            )));
        }
        if req.stop.iter().any(|s| s.is_empty()) {
            return Err(Error::BadInput("stop strings must not be empty".into()));
        }
        if let Some(f) = &req.forced_tokens {
            if let Some(t) = f.iter().find(|&&t| t >= vocab) {
                return Err(Error::BadInput(format!("forced token id {t} is outside the vocabulary")));
            }
        }
        let reserve = (req.prompt_tokens.len() + req.max_new_tokens).min(ctx);
        if reserve > self.cfg.kv_budget_tokens {
            return Err(Error::BadInput(format!(
                "the request needs {reserve} tokens of KV cache (prompt + max_new_tokens) but the whole budget is {}",
                self.cfg.kv_budget_tokens
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id,
            cache: self.model.llama.new_cache(),
            prefilled: 0,
            output: Vec::new(),
            margins: Vec::new(),
            reference_margins: Vec::new(),
            rechecked: Vec::new(),
            corrected: Vec::new(),
            logit_hashes: Vec::new(),
            reference_exact: 0,
            decoder: StreamDecoder::default(),
            text: String::new(),
            emitted: 0,
            finish: None,
            gate: GateStats::default(),
            reserved_tokens: reserve,
            new_token: false,
            req,
        });
        Ok(id)
    }

    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let mut s = self.waiting.remove(i).unwrap();
            s.finish = Some(FinishReason::Cancelled);
            self.retire(s);
            return Ok(());
        }
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.finish = Some(FinishReason::Cancelled);
            self.retire_finished();
            return Ok(());
        }
        if self.finished.contains_key(&id) {
            return Ok(());
        }
        Err(Error::BadInput(format!("unknown request id {id}")))
    }

    pub fn shutdown(&mut self) {
        self.shut_down = true;
    }
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
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

    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_num_seqs {
            let Some(front) = self.waiting.front() else { break };
            if self.reserved_tokens + front.reserved_tokens > self.cfg.kv_budget_tokens {
                break;
            }
            let s = self.waiting.pop_front().unwrap();
            self.reserved_tokens += s.reserved_tokens;
            self.running.push(s);
        }
    }

    /// One forward over every active row. Returns the number of rows it ran.
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
        self.admit();
        // Plan: decode rows first (one each), then whole prefill chunks in arrival order.
        let mut budget = self.cfg.max_tokens_per_step;
        let mut plan: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if !s.in_prefill() && budget > 0 {
                plan.push((i, 0..0));
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.in_prefill() {
                let c = s.next_chunk(self.cfg.prefill_chunk);
                if c.len() <= budget {
                    budget -= c.len();
                    plan.push((i, c));
                }
            }
        }
        if plan.is_empty() {
            return Ok(0);
        }
        plan.sort_by_key(|p| p.0);
        let decode_tokens: Vec<u32> = plan
            .iter()
            .map(|(i, chunk)| if chunk.is_empty() { self.running[*i].fed_last() } else { 0 })
            .collect();
        let model = self.model.clone();
        let rows;
        let logits = {
            let mut chosen: Vec<Option<&mut Sequence>> = self.running.iter_mut().map(Some).collect();
            let mut batch = Vec::with_capacity(plan.len());
            let mut r = 0;
            for ((i, chunk), dtok) in plan.iter().zip(&decode_tokens) {
                let s = chosen[*i].take().unwrap();
                let (tokens, want): (&[u32], bool) = if chunk.is_empty() {
                    (std::slice::from_ref(dtok), true)
                } else {
                    (&s.req.prompt_tokens[chunk.clone()], chunk.end == s.req.prompt_tokens.len())
                };
                r += tokens.len();
                batch.push(SeqRows { cache: &mut s.cache, tokens, want_logits: want });
            }
            rows = r;
            model.llama.forward(&self.policy, &mut batch)?
        };
        for ((i, chunk), lg) in plan.iter().zip(logits) {
            let s = &mut self.running[*i];
            if !chunk.is_empty() {
                s.prefilled = chunk.end;
            }
            let Some(lg) = lg else { continue };
            self.stats.steps += 1;
            s.gate.steps += 1;
            let (fast_tok, margin) = argmax_margin(&lg);
            let mut tok = fast_tok;
            let check = match self.cfg.gate.mode {
                GateMode::Off | GateMode::Shadow => false,
                GateMode::Always => true,
                GateMode::Gated => margin < self.cfg.gate.tau,
            };
            if self.cfg.record_logit_hashes {
                s.logit_hashes.push(hash_bits(&lg));
            }
            let fed = s.fed_at(s.cache.len() - 1);
            // (reference token, its margin) where the reference lane ran this step.
            let reference = if check {
                let mut ref_logits = model.llama.reference_step(&mut s.cache, fed, self.reference)?;
                if argmax_margin(&ref_logits).1 < self.cfg.gate.deep_tau {
                    ref_logits = s.rebuild_in_reference_lane(&model, self.reference)?;
                    self.stats.deep_rechecks += 1;
                    s.gate.deep_rechecks += 1;
                }
                let (ref_tok, ref_margin) = argmax_margin(&ref_logits);
                self.stats.rechecks += 1;
                s.gate.rechecks += 1;
                if ref_tok != fast_tok {
                    self.stats.corrections += 1;
                    s.gate.corrections += 1;
                }
                tok = ref_tok;
                Some((ref_tok, ref_margin))
            } else if self.cfg.gate.mode == GateMode::Shadow {
                // On a copy of the cache: the fast lane's K/V must stay as they are.
                Some(argmax_margin(&model.llama.reference_step(&mut s.cache.clone(), fed, self.reference)?))
            } else {
                None
            };
            s.rechecked.push(check);
            s.reference_margins.push(reference.map_or(f32::NAN, |(_, m)| m));
            s.corrected.push(reference.is_some_and(|(t, _)| t != fast_tok));
            s.margins.push(margin);
            s.output.push(tok);
            s.new_token = true;
            let fed_tok = s.fed_last();
            let delta = s.decoder.push(&model.tokenizer, fed_tok);
            s.text.push_str(&delta);
            Self::check_stop(&model, s, delta.len());
        }
        for s in self.running.iter_mut() {
            Self::emit_text(&mut self.events, s);
        }
        self.retire_finished();
        Ok(rows)
    }

    /// `new_bytes`: how much text this step appended. No stop string occurred in the text
    /// before it, so a new occurrence must end in those bytes: only the tail is searched, which
    /// keeps long outputs linear.
    fn check_stop(model: &Model, s: &mut Sequence, new_bytes: usize) {
        let fed = s.fed_last();
        let ctx = model.llama.cfg.context_length;
        let longest = s.req.stop.iter().map(|st| st.len()).max().unwrap_or(0);
        let mut from = s.text.len().saturating_sub(new_bytes + longest.saturating_sub(1));
        while !s.text.is_char_boundary(from) {
            from -= 1;
        }
        let tail = &s.text[from..];
        if model.tokenizer.stop_ids.contains(&fed) {
            s.finish = Some(FinishReason::Eos);
        } else if let Some(pos) = s.req.stop.iter().filter_map(|st| tail.find(st.as_str())).min().map(|p| from + p) {
            s.text.truncate(pos);
            s.finish = Some(FinishReason::StopString);
        } else if s.output.len() >= s.req.max_new_tokens {
            s.finish = Some(FinishReason::Length);
        } else if s.cache.len() + 1 >= ctx {
            s.finish = Some(FinishReason::ContextFull);
        }
    }

    /// Streams the text that can no longer turn into a stop string.
    fn emit_text(events: &mut Vec<Event>, s: &mut Sequence) {
        if !std::mem::take(&mut s.new_token) {
            return;
        }
        let Some(&tok) = s.output.last() else { return };
        if s.finish.is_none() {
            let tail = s.text.get(s.emitted..).unwrap_or("");
            let mut hold = 0;
            for st in &s.req.stop {
                for l in (1..st.len().min(tail.len() + 1)).rev() {
                    if tail.is_char_boundary(tail.len() - l) && st.starts_with(&tail[tail.len() - l..]) {
                        hold = hold.max(l);
                        break;
                    }
                }
            }
            let safe = s.text.len() - hold;
            let text = s.text[s.emitted..safe].to_string();
            s.emitted = safe;
            events.push(Event::Token { id: s.id, token: tok, text });
        } else {
            if s.finish != Some(FinishReason::StopString) {
                let rest = s.decoder.finish();
                s.text.push_str(&rest);
            }
            let text = s.text.get(s.emitted.min(s.text.len())..).unwrap_or("").to_string();
            s.emitted = s.text.len();
            events.push(Event::Token { id: s.id, token: tok, text });
        }
    }

    fn retire_finished(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_some() {
                let s = self.running.remove(i);
                self.reserved_tokens -= s.reserved_tokens;
                self.retire(s);
            } else {
                i += 1;
            }
        }
    }

    fn retire(&mut self, s: Sequence) {
        let reason = s.finish.unwrap_or(FinishReason::Cancelled);
        let fp = fingerprint(&self.model_sha, &self.policy.describe(), &self.cfg.gate.describe(), &self.host, &s.output);
        self.events.push(Event::Finished { id: s.id, reason });
        let text = s.text;
        self.finished.insert(
            s.id,
            Output {
                id: s.id,
                prompt_tokens: s.req.prompt_tokens,
                token_ids: s.output,
                text,
                margins: s.margins,
                reference_margins: s.reference_margins,
                rechecked: s.rechecked,
                corrected: s.corrected,
                logit_hashes: s.logit_hashes,
                finish_reason: reason,
                fingerprint: fp,
                gate: s.gate,
            },
        );
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

impl Sequence {
    /// Recomputes the cache in the reference lane from `reference_exact` on (the prompt, then
    /// every token fed so far) and returns the logits of the last position. Positions before
    /// `reference_exact` already are what this would compute, so the result is bitwise the
    /// same as rebuilding from position 0.
    fn rebuild_in_reference_lane(&mut self, model: &Model, how: ReferenceWeights) -> Result<Vec<f32>> {
        let len = self.cache.len();
        debug_assert_eq!(len, self.req.prompt_tokens.len() + self.output.len());
        // The latest position is always recomputed: it is the one whose logits are wanted.
        let from = self.reference_exact.min(len - 1);
        let kvd = model.llama.cfg.kv_dim();
        self.cache.truncate(from, kvd);
        let fed: Vec<u32> = (from..len).map(|i| self.fed_at(i)).collect();
        let last = model.llama.reference_extend(&mut self.cache, &fed, how)?;
        self.reference_exact = len;
        Ok(last)
    }

    /// The token fed at cache position `i`: the prompt's, then each choice (the forced token
    /// instead when teacher forcing).
    fn fed_at(&self, i: usize) -> u32 {
        let prompt = &self.req.prompt_tokens;
        if i < prompt.len() {
            return prompt[i];
        }
        let j = i - prompt.len();
        match &self.req.forced_tokens {
            Some(f) if j < f.len() => f[j],
            _ => self.output[j],
        }
    }

    /// The token that goes into the model after the latest choice.
    fn fed_last(&self) -> u32 {
        self.fed_at(self.req.prompt_tokens.len() + self.output.len() - 1)
    }
}
