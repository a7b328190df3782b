//! What crosses the engine's boundary: its configuration, requests, events and outputs.

use serde::Serialize;

use super::gate::GateConfig;
use super::sequence::StepRecord;

pub type RequestId = u64;

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
    /// Fault injection for tests of the engine's failure handling; `None` in real use.
    #[doc(hidden)]
    pub inject_fault: Option<InjectedFault>,
}

/// A failure the engine raises on purpose, to test that a failing step harms nothing else.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InjectedFault {
    /// The forward of the engine's `step`-th step (counting from 1) fails halfway through.
    Forward { step: u64 },
    /// The gate fails for request `id` on the engine's `step`-th step.
    Gate { step: u64, id: RequestId },
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
            inject_fault: None,
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
    /// The engine failed for this request alone (`Output::error` says why); others go on.
    Error,
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

impl GateStats {
    pub(crate) fn add(&mut self, r: &StepRecord) {
        self.steps += 1;
        self.rechecks += r.rechecked as u64;
        self.corrections += (r.rechecked && r.corrected) as u64;
        self.deep_rechecks += r.deep as u64;
    }
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
    /// What failed, when `finish_reason` is `Error`.
    pub error: Option<String>,
}
