//! One request's state while it is in the engine. Values that can be derived (its output
//! tokens, how many positions its cache holds, the token fed next) are methods, not fields.

use crate::error::Error;
use crate::kv_cache::KvCache;

use super::output::TextState;
use super::{FinishReason, GateStats, Request, RequestId};

/// What one decode step decided for a sequence: the gate's record.
#[derive(Clone, Debug)]
pub(crate) struct StepRecord {
    pub token: u32,
    /// The fast lane's decision margin (greedy: top1 − top2).
    pub margin: f32,
    /// The reference lane's margin where it ran (the rebuilt lane's after a deep recheck);
    /// NaN where the gate let the step through.
    pub reference_margin: f32,
    pub rechecked: bool,
    /// The reference lane changed the token (with `GateMode::Shadow`: would have).
    pub corrected: bool,
    pub deep: bool,
    pub logit_hash: Option<u64>,
    /// The chosen token's log-probability under the deciding lane's logits, when asked for.
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

pub(crate) struct Sequence {
    /// The engine's id for this sequence: the request's own for choice 0, a fresh one for the
    /// other choices.
    pub id: RequestId,
    /// The request it is a choice of, and which.
    pub request: RequestId,
    pub index: u32,
    /// The key of its draws (the request's seed, or the one drawn at submit).
    pub seed: u64,
    pub req: Request,
    /// Prompt tokens already through the model.
    pub prefilled: usize,
    pub steps: Vec<StepRecord>,
    /// Positions `..reference_exact` of `reference_cache` hold the reference lane's K/V computed
    /// over the reference lane's own prefix (left by the last deep recheck), so the next deep
    /// recheck only rebuilds from there.
    pub reference_exact: usize,
    /// The reference lane's own cache, in f32 (the exact lane keeps exact K/V whatever the
    /// engine stores): made by the first deep recheck. The sequence's cache takes a copy of
    /// its positions, in the engine's dtype.
    pub reference_cache: Option<KvCache>,
    pub text: TextState,
    pub finish: Option<FinishReason>,
    /// Why the sequence failed, when `finish` is `Error`.
    pub error: Option<Error>,
    /// KV tokens reserved for it at admission (prompt + max_new_tokens, capped by the context).
    pub reserved_blocks: usize,
}

impl Sequence {
    pub fn new(id: RequestId, req: Request, seed: u64, reserved_blocks: usize) -> Self {
        Sequence {
            id,
            request: id,
            index: 0,
            seed,
            req,
            prefilled: 0,
            steps: Vec::new(),
            reference_exact: 0,
            reference_cache: None,
            text: TextState::default(),
            finish: None,
            error: None,
            reserved_blocks,
        }
    }

    /// Choice `index` of the same request, as this one is after its prefill and before its
    /// first token: it takes `reserved_blocks` of this one's reservation.
    pub fn fork(&mut self, id: RequestId, index: u32, reserved_blocks: usize) -> Sequence {
        debug_assert!(!self.in_prefill() && self.steps.is_empty());
        self.reserved_blocks -= reserved_blocks;
        Sequence {
            id,
            request: self.request,
            index,
            seed: self.seed,
            req: self.req.clone(),
            prefilled: self.prefilled,
            steps: Vec::new(),
            reference_exact: self.reference_exact,
            reference_cache: self.reference_cache.clone(),
            text: TextState::default(),
            finish: None,
            error: None,
            reserved_blocks,
        }
    }

    /// The draw key of its next decision.
    pub fn draw_key(&self) -> crate::sampling::DrawKey {
        crate::sampling::DrawKey { seed: self.seed, index: self.index, position: self.steps.len() as u32 }
    }

    /// The tokens its output has put into the context so far (the forced ones when forcing).
    pub fn fed_output(&self) -> Vec<u32> {
        let p = self.req.prompt_tokens.len();
        (p..p + self.steps.len()).map(|i| self.fed_at(i)).collect()
    }

    pub fn in_prefill(&self) -> bool {
        self.prefilled < self.req.prompt_tokens.len()
    }

    /// The prompt's next chunk: from `prefilled` to the next multiple of `chunk`.
    pub fn next_chunk(&self, chunk: usize) -> std::ops::Range<usize> {
        let end = ((self.prefilled / chunk) + 1) * chunk;
        self.prefilled..end.min(self.req.prompt_tokens.len())
    }

    pub fn output(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.token).collect()
    }

    /// Positions its KV cache holds: the prompt so far, then every choice but the latest
    /// (which is fed on the next step).
    pub fn cached(&self) -> usize {
        self.prefilled + self.steps.len().saturating_sub(1)
    }

    /// The token fed at cache position `i`: the prompt's, then each choice (the forced token
    /// instead when teacher forcing).
    pub fn fed_at(&self, i: usize) -> u32 {
        let prompt = &self.req.prompt_tokens;
        if i < prompt.len() {
            return prompt[i];
        }
        let j = i - prompt.len();
        match &self.req.forced_tokens {
            Some(f) if j < f.len() => f[j],
            _ => self.steps[j].token,
        }
    }

    /// The token that goes into the model after the latest choice.
    pub fn fed_last(&self) -> u32 {
        self.fed_at(self.req.prompt_tokens.len() + self.steps.len() - 1)
    }

    pub fn gate_stats(&self) -> GateStats {
        let mut g = GateStats::default();
        self.steps.iter().for_each(|r| g.add(r));
        g
    }
}
