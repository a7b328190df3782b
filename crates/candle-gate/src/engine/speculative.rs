//! Speculative decoding. A drafter proposes a sequence's next tokens; the target runs them as
//! one verification run of rows (the fed token, then each draft), and a draft is kept only while
//! it equals the token the target itself decides at that position. A row's bits depend only on
//! its own token history (the invariant kernels, `docs/DESIGN.md` §3), so every decision made on
//! a verification row is the one plain decoding makes at that position: the output does not
//! depend on whether, or how far, anything was speculated. Only the speed does.
//!
//! Two drafters: prompt lookup (n-gram), the continuation of the most recent earlier
//! occurrence of the history's longest matching suffix, which needs no second model; and a
//! draft model, a smaller model of the same vocabulary proposing its own greedy tokens from its
//! own K/V cache (the runner's [`crate::engine`] draft lane). Both are functions of the
//! sequence's own tokens, so acceptance is a function of the request.

use std::str::FromStr;

use crate::error::{Error, Result};

/// How drafts are proposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// Prompt lookup over the sequence's own prompt and output.
    Ngram,
    /// A smaller model with the same vocabulary, greedy.
    Draft,
}

impl SpeculativeMethod {
    pub const ALL: [SpeculativeMethod; 2] = [SpeculativeMethod::Ngram, SpeculativeMethod::Draft];
    pub fn name(self) -> &'static str {
        match self {
            SpeculativeMethod::Ngram => "ngram",
            SpeculativeMethod::Draft => "draft",
        }
    }
}

impl FromStr for SpeculativeMethod {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
            Error::invalid(
                "speculative_method",
                format!("unknown speculative method {s:?}; expected {}", names.join(", ")),
            )
        })
    }
}

/// An engine's speculation. None of it changes a bit of any output; it changes how many tokens
/// a step can emit per sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Drafts proposed per sequence and step (at most; fewer near the end of a request, when
    /// the step's token budget is short, or when nothing matches).
    pub num_speculative_tokens: usize,
    /// The longest suffix n-gram looked up.
    pub prompt_lookup_max: usize,
    /// The shortest suffix n-gram looked up.
    pub prompt_lookup_min: usize,
    /// No drafts in a step with more than this many decoding sequences: there the step is
    /// already compute-bound and verification rows cost more than they save.
    pub disable_by_batch_size: usize,
}

/// Longer matches predict better, but a match must exist. The longest match wins, so a high cap
/// finds the place an edit is copying from rather than the latest place a common 4-gram
/// occurred: on Qwen2.5 1.5B's code edits (k = 8), 64 kept 85% of the drafts and 4.9 tokens a
/// pass, 4 (vLLM's usual value) 80% and 4.3 (benches/speculative.py). One pass over the
/// history finds it whatever the cap.
pub const DEFAULT_PROMPT_LOOKUP_MAX: usize = 64;
pub const DEFAULT_PROMPT_LOOKUP_MIN: usize = 2;
/// Verifying drafts still paid at 8 decoding sequences on the 2-core development machine (1.34–1.37x
/// on Qwen 1.5B code edits, benches/speculative.py); above that it is not measured, so off.
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 8;
/// Drafts per step when not given: on Qwen2.5 1.5B's code edits, 12 gave 1.96–2.17x plain
/// single-stream decode against 1.90–1.91x for 5, in alternating rounds on the 2-core host, and
/// the same 1.4x at 8 streams (benches/speculative.py). The draft window keeps a sequence that
/// is not copying to short runs.
pub const DEFAULT_NUM_SPECULATIVE_TOKENS: usize = 12;
/// A draft model's drafts per step when not given: 3 did better than 4 on Qwen2.5 1.5B's code
/// completions (0.95x against 0.88x plain on the 2-core host) and as well on code edits.
pub const DEFAULT_DRAFT_MODEL_TOKENS: usize = 3;
/// A draft model costs a forward per draft: with two decoding sequences its forwards already
/// cost more than verification saved on the 2-core development machine (0.79–0.91x, Qwen2.5
/// 1.5B drafted for by 0.5B, benches/speculative.py), so by default one sequence alone drafts.
pub const DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE: usize = 1;
/// The most drafts a step may verify per sequence.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpeculativeConfig {
    /// `method` with every other setting at its default.
    pub fn new(method: SpeculativeMethod) -> Self {
        match method {
            SpeculativeMethod::Ngram => Self::ngram(DEFAULT_NUM_SPECULATIVE_TOKENS),
            SpeculativeMethod::Draft => Self::draft_model(DEFAULT_DRAFT_MODEL_TOKENS),
        }
    }

    /// A draft model proposing up to `num_speculative_tokens` per step.
    pub fn draft_model(num_speculative_tokens: usize) -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::Draft,
            disable_by_batch_size: DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE,
            ..Self::ngram(num_speculative_tokens)
        }
    }

    pub fn ngram(num_speculative_tokens: usize) -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::Ngram,
            num_speculative_tokens,
            prompt_lookup_max: DEFAULT_PROMPT_LOOKUP_MAX,
            prompt_lookup_min: DEFAULT_PROMPT_LOOKUP_MIN,
            disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
        }
    }

    /// The settings in one line, e.g. `ngram;k=12;lookup=2..64;max_batch=8` or
    /// `draft;k=3;max_batch=1`.
    pub fn describe(&self) -> String {
        let (k, lo, hi, b) =
            (self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max, self.disable_by_batch_size);
        match self.method {
            SpeculativeMethod::Ngram => format!("ngram;k={k};lookup={lo}..{hi};max_batch={b}"),
            SpeculativeMethod::Draft => format!("draft;k={k};max_batch={b}"),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let k = self.num_speculative_tokens;
        if k == 0 || k > MAX_SPECULATIVE_TOKENS {
            let m = format!("num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}");
            return Err(Error::invalid("num_speculative_tokens", m));
        }
        let (lo, hi) = (self.prompt_lookup_min, self.prompt_lookup_max);
        if lo == 0 || hi < lo {
            let m = format!("need 1 <= prompt_lookup_min ({lo}) <= prompt_lookup_max ({hi})");
            return Err(Error::invalid("prompt_lookup_min", m));
        }
        Ok(())
    }

    /// Up to `limit` prompt-lookup drafts to follow `history` (the prompt, then every token
    /// output so far), and the length of the suffix match they continue (0 without drafts).
    pub fn lookup(&self, history: &[u32], limit: usize) -> (Vec<u32>, usize) {
        let k = self.num_speculative_tokens.min(limit);
        ngram_draft(history, k, self.prompt_lookup_max, self.prompt_lookup_min)
    }
}

/// Prompt lookup: the earlier place in `history` that shares the longest suffix with it (at most
/// `max_n` tokens, at least `min_n`; the latest such place among equals), and its next (up to)
/// `k` tokens are the proposal, returned with the match's length. Empty (and 0) when nothing
/// matches. The same as looking up the last `n` tokens for `n` from `max_n` down to `min_n`,
/// latest occurrence first, in one pass: each earlier copy of the last token is extended
/// backwards. A long match is a copy in progress (an edit echoing its input), where a short
/// one is often a common phrase; the engine lets a long one draft past its adaptive window.
pub fn ngram_draft(history: &[u32], k: usize, max_n: usize, min_n: usize) -> (Vec<u32>, usize) {
    let len = history.len();
    if k == 0 || len < 2 || max_n == 0 {
        return (Vec::new(), 0);
    }
    let last = history[len - 1];
    let (mut best_end, mut best) = (0, 0);
    // `end` is where an earlier occurrence ends; it must end before the suffix does.
    for end in (0..len - 1).rev() {
        if history[end] != last {
            continue;
        }
        let cap = max_n.min(end + 1);
        let n = 1 + (1..cap).take_while(|&i| history[end - i] == history[len - 1 - i]).count();
        if n > best {
            (best_end, best) = (end, n);
            if n == max_n {
                break;
            }
        }
    }
    if best < min_n.max(1) {
        return (Vec::new(), 0);
    }
    let from = best_end + 1;
    (history[from..(from + k).min(len)].to_vec(), best)
}

/// Speculation's counters: drafts proposed and drafts kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
}

impl SpecStats {
    /// Counts a verification run of `drafted` drafts that kept `kept`.
    pub fn add_run(&mut self, drafted: usize, kept: usize) {
        self.draft_tokens += drafted as u64;
        self.accepted_tokens += kept as u64;
    }
}

/// The drafts a sequence's next verification run may take after a run of `drafted` drafts that
/// kept `kept`: a run kept whole asks for twice as many; one cut short, for one more than it
/// kept. Verification rows cost compute, and a sequence that is copying its prompt keeps long
/// runs while one that is not keeps none. A function of the sequence's own history alone.
pub(crate) fn next_draft_window(drafted: usize, kept: usize) -> usize {
    if kept == drafted {
        2 * drafted
    } else {
        kept + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draft_window_doubles_on_a_whole_run_and_falls_to_one_more_than_kept() {
        assert_eq!(next_draft_window(4, 4), 8);
        assert_eq!(next_draft_window(4, 1), 2);
        assert_eq!(next_draft_window(12, 0), 1);
        let mut stats = SpecStats::default();
        stats.add_run(4, 1);
        stats.add_run(3, 3);
        assert_eq!(stats, SpecStats { draft_tokens: 7, accepted_tokens: 4 });
    }

    #[test]
    fn lookup_takes_the_longest_suffix_and_its_latest_occurrence() {
        // "1 2 3 4 | 9 2 3 5 | 1 2 3": the 3-gram "1 2 3" occurs at 0; the 2-gram "2 3" also
        // at 5, but the longer match wins
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3];
        assert_eq!(ngram_draft(&h, 2, 4, 2), (vec![4, 9], 3));
        // with only 2-grams looked up, the latest "2 3" (at 5) wins
        assert_eq!(ngram_draft(&h, 2, 2, 2), (vec![5, 1], 2));
        // the proposal stops at the end of the history
        assert_eq!(ngram_draft(&[7, 8, 7, 8], 5, 2, 2), (vec![7, 8], 2));
        assert_eq!(ngram_draft(&[7, 8, 7], 5, 2, 1), (vec![8, 7], 1));
        // a run of one token: the longest earlier run, capped, its latest place
        assert_eq!(ngram_draft(&[3, 3, 3, 3, 4], 2, 8, 1), (vec![], 0));
        assert_eq!(ngram_draft(&[3, 3, 3, 3], 2, 8, 1), (vec![3], 3));
        assert_eq!(ngram_draft(&[3, 3, 3, 3], 2, 2, 1), (vec![3], 2));
        assert!(ngram_draft(&[1, 2, 3], 4, 3, 2).0.is_empty(), "no earlier occurrence");
        assert!(ngram_draft(&[5, 5], 0, 2, 1).0.is_empty());
        assert!(ngram_draft(&[], 3, 2, 1).0.is_empty());
    }

    /// The definition the one-pass lookup must equal: for `n` from `max_n` down to `min_n`, the
    /// latest earlier occurrence of the last `n` tokens.
    fn ngram_draft_by_definition(history: &[u32], k: usize, max_n: usize, min_n: usize) -> (Vec<u32>, usize) {
        let len = history.len();
        if k == 0 {
            return (Vec::new(), 0);
        }
        for n in (min_n.max(1)..=max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            for start in (0..len - n).rev() {
                if &history[start..start + n] == suffix {
                    let from = start + n;
                    return (history[from..(from + k).min(len)].to_vec(), n);
                }
            }
        }
        (Vec::new(), 0)
    }

    #[test]
    fn one_pass_lookup_equals_the_definition() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for case in 0..4000 {
            let len = (case % 60) as usize;
            // few distinct tokens, so that long matches are common
            let alphabet = 1 + (case / 60 % 5) as u64;
            let h: Vec<u32> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % alphabet) as u32
                })
                .collect();
            for (k, max_n, min_n) in [(1, 1, 1), (3, 4, 2), (8, 64, 2), (5, 3, 3), (16, 64, 1), (2, 2, 5)] {
                assert_eq!(
                    ngram_draft(&h, k, max_n, min_n),
                    ngram_draft_by_definition(&h, k, max_n, min_n),
                    "{h:?} k={k} n={min_n}..{max_n}"
                );
            }
        }
    }

    #[test]
    fn config_bounds_name_their_parameter() {
        let mut c = SpeculativeConfig::ngram(0);
        assert_eq!(c.validate().unwrap_err().param(), Some("num_speculative_tokens"));
        c.num_speculative_tokens = 3;
        c.prompt_lookup_min = DEFAULT_PROMPT_LOOKUP_MAX + 1;
        assert_eq!(c.validate().unwrap_err().param(), Some("prompt_lookup_min"));
        assert!(SpeculativeConfig::ngram(5).validate().is_ok());
        assert_eq!("medusa".parse::<SpeculativeMethod>().unwrap_err().param(), Some("speculative_method"));
        assert_eq!("draft".parse::<SpeculativeMethod>().unwrap(), SpeculativeMethod::Draft);
        assert_eq!(SpeculativeConfig::ngram(8).lookup(&[1, 2, 1, 2, 1, 2], 3), (vec![1, 2], 4));
        assert_eq!(SpeculativeConfig::new(SpeculativeMethod::Draft).describe(), "draft;k=3;max_batch=1");
    }
}
