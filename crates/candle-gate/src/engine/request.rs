//! What crosses the engine's boundary: its configuration, requests, events and outputs.

use serde::Serialize;

use super::speculative::SpecStats;
use super::EngineConfig;

use crate::error::{Error, Result};
use crate::prefix_cache::KV_BLOCK;
use crate::sampling::SamplingParams;

pub type RequestId = u64;

#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    /// How it decodes: length, stops, temperature and filters, seed, choices, logprobs.
    pub params: SamplingParams,
    /// Teacher forcing: feed these tokens instead of the chosen ones (the choice is still
    /// recorded), to count step flips against another run's tokens.
    pub forced_tokens: Option<Vec<u32>>,
}

impl Request {
    pub fn new(prompt_tokens: Vec<u32>, params: SamplingParams) -> Self {
        Request { prompt_tokens, params, forced_tokens: None }
    }

    /// Every rule a request must meet to run on a model of `vocab` tokens and `context_length`
    /// positions under `cfg`'s budgets. Checked at submit, so that a bad request never reaches
    /// a step that other requests share.
    pub fn validate(&self, vocab: usize, context_length: usize, cfg: &EngineConfig) -> Result<()> {
        let vocab = vocab as u32;
        if self.prompt_tokens.is_empty() {
            return Err(Error::invalid("prompt", "empty prompt"));
        }
        if let Some(t) = self.prompt_tokens.iter().find(|&&t| t >= vocab) {
            return Err(Error::invalid("prompt", format!("prompt token id {t} is outside the vocabulary of {vocab}")));
        }
        let p = &self.params;
        p.validate()?;
        if p.n > cfg.max_num_seqs {
            return Err(Error::invalid(
                "n",
                format!("n = {} choices cannot run at once with max_num_seqs = {}", p.n, cfg.max_num_seqs),
            ));
        }
        if self.prompt_tokens.len() >= context_length {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens but the context holds {context_length} (including at least one new token)",
                    self.prompt_tokens.len()
                ),
            ));
        }
        if let Some(f) = &self.forced_tokens {
            if let Some(t) = f.iter().find(|&&t| t >= vocab) {
                return Err(Error::invalid("forced_tokens", format!("forced token id {t} is outside the vocabulary")));
            }
        }
        // Alone in the engine it must be able to finish: then preemption can always make room.
        let reserve = (self.prompt_tokens.len() + p.max_new_tokens).min(context_length);
        let blocks = reserve.div_ceil(KV_BLOCK) * p.n;
        if blocks > cfg.kv_budget_blocks() {
            return Err(Error::invalid("max_new_tokens", format!(
                "the request needs {} tokens of KV cache ((prompt + max_new_tokens) x n, in blocks of {KV_BLOCK}) but the whole budget is {}",
                blocks * KV_BLOCK,
                cfg.kv_budget_blocks() * KV_BLOCK
            )));
        }
        Ok(())
    }
}

/// A seed for a request that gave none: fresh per request and per process.
pub(crate) fn fresh_seed(id: RequestId) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(id);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    StopString,
    Length,
    Cancelled,
    ContextFull,
    /// The engine failed for this request alone (`Output::error` says why); others go on.
    Error,
}

/// Serialized as its one name ([`FinishReason::name`]).
impl Serialize for FinishReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl FinishReason {
    pub const ALL: [FinishReason; 6] = [
        FinishReason::Eos,
        FinishReason::StopString,
        FinishReason::Length,
        FinishReason::Cancelled,
        FinishReason::ContextFull,
        FinishReason::Error,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::StopString => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ContextFull => "context_full",
            FinishReason::Error => "error",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Event {
    /// Choice `index` of request `id` took a token. `text` is the text that can no longer turn
    /// into a stop string; `logprob`/`top_logprobs` when the request asked for them.
    Token { id: RequestId, index: u32, token: u32, text: String, logprob: Option<f32>, top_logprobs: Vec<(u32, f32)> },
    /// Choice `index` of request `id` ended; `speculation`: its drafts proposed and kept.
    Finished { id: RequestId, index: u32, reason: FinishReason, speculation: SpecStats },
}

#[derive(Clone, Debug, Default)]
pub struct GateStats {
    pub steps: u64,
    pub rechecks: u64,
    pub corrections: u64,
    pub deep_rechecks: u64,
}

impl GateStats {
    /// The counters' names, as every report spells them.
    pub const KEYS: [&'static str; 4] = ["steps", "rechecks", "corrections", "deep_rechecks"];
    /// The counters by name, in [`GateStats::KEYS`]' order.
    pub fn by_name(&self) -> [(&'static str, u64); 4] {
        let values = [self.steps, self.rechecks, self.corrections, self.deep_rechecks];
        std::array::from_fn(|i| (Self::KEYS[i], values[i]))
    }
}

/// The KV cache's counters since the engine started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens looked up in the prefix cache (each request's first admission).
    pub prefix_queries: u64,
    /// Of those, tokens whose K/V came from the cache.
    pub prefix_hits: u64,
    /// Sequences put back in the queue to free KV blocks.
    pub preemptions: u64,
}

/// A finished request: its prompt, the seed its draws were keyed by, and its `n` choices.
#[derive(Clone, Debug)]
pub struct Output {
    pub id: RequestId,
    pub prompt_tokens: Vec<u32>,
    /// Prompt tokens whose K/V came from the prefix cache (OpenAI's `cached_tokens`).
    pub cached_tokens: usize,
    /// The request's seed, or the one drawn at submit: passing it back replays the output.
    pub seed: u64,
    pub choices: Vec<Choice>,
}

/// One choice of a finished request.
#[derive(Clone, Debug)]
pub struct Choice {
    pub index: u32,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// Per step, the decision's margin in logit units (`sampling::Decision::margin`).
    pub margins: Vec<f32>,
    /// The reference lane's margin on rechecked steps (after a deep recheck, the rebuilt
    /// lane's); NaN on steps the gate let through.
    pub reference_margins: Vec<f32>,
    pub rechecked: Vec<bool>,
    /// Steps whose token the reference lane changed (with `GateMode::Shadow`: would have).
    pub corrected: Vec<bool>,
    pub logit_hashes: Vec<u64>,
    /// Per step, the chosen token's log-probability (empty unless asked for).
    pub logprobs: Vec<f32>,
    /// Per step, the most likely tokens and their log-probabilities (empty unless asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: FinishReason,
    pub fingerprint: String,
    pub gate: GateStats,
    /// Drafts proposed for this choice and kept (speculative decoding; zero without it).
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// What failed, when `finish_reason` is `Error`.
    pub error: Option<String>,
}
