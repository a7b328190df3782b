//! One request's state while it is in the engine. Values that can be derived (its output
//! tokens, how many positions its cache holds, the token fed next) are methods, not fields.

use crate::error::Error;

use super::speculative::SpecStats;
use super::text::TextState;
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

impl StepRecord {
    /// A step that took `token` with margin 1, the gate letting it through or (`rechecked`)
    /// confirming it: what the rooms' unit tests feed sequences.
    #[cfg(test)]
    pub fn plain(token: u32, rechecked: bool) -> Self {
        StepRecord {
            token,
            margin: 1.0,
            reference_margin: f32::NAN,
            rechecked,
            corrected: false,
            deep: false,
            logit_hash: None,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }

    /// Counts this step into the engine's gate counters.
    pub fn tally(&self, stats: &mut GateStats) {
        stats.steps += 1;
        stats.rechecks += self.rechecked as u64;
        stats.corrections += (self.rechecked && self.corrected) as u64;
        stats.deep_rechecks += self.deep as u64;
    }
}

/// A sequence's id: one per choice of a request, never reused. Not a [`RequestId`]: a request of
/// `n` choices runs as `n` sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SeqId(pub u64);

pub(crate) struct Sequence {
    pub id: SeqId,
    /// The request it is a choice of, and which.
    pub request: RequestId,
    pub index: u32,
    /// The key of its draws (the request's seed, or the one drawn at submit).
    pub seed: u64,
    pub req: Request,
    /// Positions its KV cache holds: the prompt, then every choice but the latest (which is
    /// fed on the next step). Zero again when it is preempted.
    pub computed: usize,
    pub steps: Vec<StepRecord>,
    /// Positions `..reference_exact` of its history hold the reference lane's K/V computed over
    /// the reference lane's own prefix (left by the last deep recheck, in the runner's f32
    /// reference cache, of which its KV cache took a copy), so the next deep recheck only
    /// rebuilds from there.
    pub reference_exact: usize,
    pub text: TextState,
    pub finish: Option<FinishReason>,
    /// Why the sequence failed, when `finish` is `Error`.
    pub error: Option<Error>,
    /// When it was (last) admitted, in the engine's admission order: the latest admitted is
    /// preempted first.
    pub admitted_at: u64,
    /// Prompt tokens its first admission found in the prefix cache.
    pub cached_tokens: Option<usize>,
    /// Drafts proposed for it and kept.
    pub speculation: SpecStats,
    /// Drafts its next verification run may take (0: not speculated yet): grows while runs are
    /// kept whole, falls to what the last run kept. A function of its own history alone.
    pub draft_window: usize,
}

impl Sequence {
    pub fn new(id: SeqId, request: RequestId, req: Request, seed: u64) -> Self {
        Sequence {
            id,
            request,
            index: 0,
            seed,
            req,
            computed: 0,
            steps: Vec::new(),
            reference_exact: 0,
            text: TextState::default(),
            finish: None,
            error: None,
            admitted_at: 0,
            cached_tokens: None,
            speculation: SpecStats::default(),
            draft_window: 0,
        }
    }

    /// Choice `index` of the same request, as this one is after its prefill and before its
    /// first token.
    pub fn fork(&self, id: SeqId, index: u32) -> Sequence {
        debug_assert!(!self.in_prefill() && self.steps.is_empty());
        Sequence {
            id,
            request: self.request,
            index,
            seed: self.seed,
            req: self.req.clone(),
            computed: self.computed,
            steps: Vec::new(),
            reference_exact: self.reference_exact,
            text: TextState::default(),
            finish: None,
            error: None,
            admitted_at: self.admitted_at,
            cached_tokens: self.cached_tokens,
            speculation: SpecStats::default(),
            draft_window: 0,
        }
    }

    /// The draw key of its next decision.
    pub fn draw_key(&self) -> crate::sampling::DrawKey {
        crate::sampling::DrawKey { seed: self.seed, index: self.index, position: self.steps.len() as u32 }
    }

    /// The tokens fed at positions `0..end`: the prompt, then the outputs (or forced tokens)
    /// fed after it. With `end` one past the latest choice, the whole history drafters read.
    pub fn history(&self, end: usize) -> Vec<u32> {
        (0..end).map(|p| self.fed_at(p)).collect()
    }

    /// The tokens its output has put into the context so far (the forced ones when forcing).
    pub fn fed_output(&self) -> Vec<u32> {
        let p = self.req.prompt_tokens.len();
        (p..p + self.steps.len()).map(|i| self.fed_at(i)).collect()
    }

    /// Positions its cache must hold before it decodes: the prompt, and after a preemption
    /// every choice but the latest.
    pub fn target(&self) -> usize {
        self.req.prompt_tokens.len() + self.steps.len().saturating_sub(1)
    }

    /// Whether positions are missing from its cache: a prompt not yet through the model, or a
    /// history being recomputed after a preemption.
    pub fn in_prefill(&self) -> bool {
        self.computed < self.target()
    }

    /// A preempted sequence (its cache dropped) resumes by recomputing its history.
    pub fn is_resuming(&self) -> bool {
        !self.steps.is_empty()
    }

    /// Its next chunk of positions to compute: from `computed` to the next multiple of `chunk`,
    /// ending early at a position the gate repaired (the runner recomputes that one in the
    /// reference lane after the chunk, as the gate did).
    pub fn next_chunk(&self, chunk: usize) -> std::ops::Range<usize> {
        let end = (((self.computed / chunk) + 1) * chunk).min(self.target());
        let end = (self.computed..end).find(|&p| self.repaired_at(p)).map_or(end, |p| p + 1);
        self.computed..end
    }

    /// Whether the gate rewrote position `p`'s K/V in the reference lane on its own (a
    /// recheck after the fast lane wrote it), and no deep recheck rebuilt it since.
    pub fn repaired_at(&self, p: usize) -> bool {
        let prompt = self.req.prompt_tokens.len();
        p >= self.reference_exact && p + 1 >= prompt && self.steps.get(p + 1 - prompt).is_some_and(|r| r.rechecked)
    }

    /// Where its history stops being the fast lane's own computation: the first position the
    /// gate rewrote (`usize::MAX` if none). Only positions before it may be shared as a cached
    /// prefix (callers bound it by what the cache holds).
    pub fn clean_prefix(&self) -> usize {
        if self.reference_exact > 0 {
            return 0;
        }
        let prompt = self.req.prompt_tokens.len();
        self.steps.iter().position(|r| r.rechecked).map_or(usize::MAX, |j| prompt - 1 + j)
    }

    pub fn output(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.token).collect()
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
        self.steps.iter().for_each(|r| r.tally(&mut g));
        g
    }
}
