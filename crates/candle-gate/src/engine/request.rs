//! What crosses the engine's boundary: its configuration, requests, events and outputs.

use serde::Serialize;

use super::speculative::SpecStats;

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
