//! Seeded sampling whose every draw is a function of the request alone.
//!
//! A request's token at output position `pos` of choice `index` is decided from its logits and
//! uniforms drawn by Philox4x32-10 keyed by the request's `seed`, at counter
//! `(token pair, pos, index, stream)`. No generator carries state between draws, so a token's
//! draw depends on nothing but (seed, index, pos): not on how many draws came before, on the
//! other requests in the batch, or on the engine's step.
//!
//! The decision is the exponential race (Gumbel-max): among the candidates that survive the
//! filters, the winner is the token with the smallest `E_j / w_j`, `E_j = -ln u_j` an Exp(1)
//! draw and `w_j = exp((l_j - l_max) / T)`, which picks token j with probability
//! `w_j / Σ w` exactly. Written as perturbed scores `s_j = l_j - T ln E_j`, it is an argmax, and
//! that gives the gate its margin (see [`Decision::margin`]).
//!
//! Order of operations (vLLM's): penalties on the raw logits, then temperature, then top-k,
//! top-p (over the top-k survivors, renormalized) and min-p (against the most likely token),
//! then the race. `temperature == 0` is greedy: the argmax of the penalized logits, bit for bit
//! the engine's greedy path when there are no penalties.

use crate::detmath::{exp_f64_in_place, ln_f64};
use crate::error::{Error, Result};
use crate::ops::argmax_margin;

/// Most alternatives a step's logprobs can list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most choices one request can ask for.
pub const MAX_N: usize = 64;
/// Most stop strings one request can give.
pub const MAX_STOP: usize = 16;
/// The largest `max_new_tokens` a request may ask for.
pub const MAX_NEW_TOKENS_LIMIT: usize = 1 << 20;

/// One end of a parameter's range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct End {
    pub value: f64,
    /// Whether `value` itself is allowed.
    pub inclusive: bool,
}

/// A numeric parameter's allowed range: the one statement of it, which [`SamplingParams::validate`]
/// checks and the Python schemas are built from (`_native.SAMPLING_BOUNDS`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamRange {
    pub name: &'static str,
    pub min: Option<End>,
    pub max: Option<End>,
    /// A count (its ends are whole numbers), not a real.
    pub integer: bool,
}

const fn closed(name: &'static str, min: f64, max: f64) -> ParamRange {
    let (min, max) = (Some(End { value: min, inclusive: true }), Some(End { value: max, inclusive: true }));
    ParamRange { name, min, max, integer: false }
}

const fn count(name: &'static str, min: usize, max: usize) -> ParamRange {
    ParamRange { integer: true, ..closed(name, min as f64, max as f64) }
}

pub const PARAM_RANGES: [ParamRange; 9] = [
    ParamRange { name: "temperature", min: Some(End { value: 0.0, inclusive: true }), max: None, integer: false },
    ParamRange {
        name: "top_p",
        min: Some(End { value: 0.0, inclusive: false }),
        max: Some(End { value: 1.0, inclusive: true }),
        integer: false,
    },
    closed("min_p", 0.0, 1.0),
    ParamRange {
        name: "repetition_penalty",
        min: Some(End { value: 0.0, inclusive: false }),
        max: Some(End { value: 10.0, inclusive: true }),
        integer: false,
    },
    closed("presence_penalty", -2.0, 2.0),
    closed("frequency_penalty", -2.0, 2.0),
    count("max_new_tokens", 1, MAX_NEW_TOKENS_LIMIT),
    count("n", 1, MAX_N),
    count("top_logprobs", 0, MAX_TOP_LOGPROBS),
];

impl ParamRange {
    pub fn of(name: &str) -> &'static ParamRange {
        PARAM_RANGES.iter().find(|r| r.name == name).expect("a parameter with a range")
    }
    /// Whether `v` is in the range (NaN never is).
    pub fn contains(&self, v: f64) -> bool {
        let above = self.min.is_none_or(|m| if m.inclusive { v >= m.value } else { v > m.value });
        let below = self.max.is_none_or(|m| if m.inclusive { v <= m.value } else { v < m.value });
        v.is_finite() && above && below
    }
}

/// `[0, 1]`, `(0, 10]`, `>= 0`: how messages write a range.
impl std::fmt::Display for ParamRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.min, self.max) {
            (Some(lo), Some(hi)) => {
                let (open, close) = (if lo.inclusive { '[' } else { '(' }, if hi.inclusive { ']' } else { ')' });
                write!(f, "in {open}{}, {}{close}", lo.value, hi.value)
            }
            (Some(lo), None) => write!(f, "a finite number {} {}", if lo.inclusive { ">=" } else { ">" }, lo.value),
            (None, Some(hi)) => write!(f, "a finite number {} {}", if hi.inclusive { "<=" } else { "<" }, hi.value),
            (None, None) => write!(f, "a finite number"),
        }
    }
}

/// How one request decodes: everything about its output but the prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// The text ends before the first occurrence of any of these.
    pub stop: Vec<String>,
    /// 0: greedy. Otherwise logits are divided by it before the filters and the draw.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one (0: all).
    pub min_p: f32,
    /// CTRL's penalty on every token of the prompt and the output: a positive logit is divided
    /// by it, a negative one multiplied (1: none).
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token the output already has.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time the output has it.
    pub frequency_penalty: f32,
    /// The key of every draw. `None`: the engine draws one at submit and reports it.
    pub seed: Option<u64>,
    /// Choices sampled from one prompt (its prefill runs once).
    pub n: usize,
    /// Report each step's chosen-token log-probability.
    pub logprobs: bool,
    /// ... and this many most likely alternatives (implies `logprobs`), at most 20.
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_new_tokens: 64,
            stop: Vec::new(),
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            n: 1,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_new_tokens: usize) -> Self {
        SamplingParams { max_new_tokens, ..Default::default() }
    }

    /// Every rule on the parameters, with a message naming the parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |param: &'static str, m: String| Err(Error::invalid(param, m));
        let floats = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ];
        let counts = [("max_new_tokens", self.max_new_tokens), ("n", self.n), ("top_logprobs", self.top_logprobs)];
        let checks = floats.map(|(n, v)| (n, v as f64, v.to_string())).into_iter();
        for (name, v, shown) in checks.chain(counts.map(|(n, v)| (n, v as f64, v.to_string()))) {
            let range = ParamRange::of(name);
            if !range.contains(v) {
                return bad(range.name, format!("{name} must be {range}, got {shown}"));
            }
        }
        if self.stop.len() > MAX_STOP {
            return bad("stop", format!("at most {MAX_STOP} stop strings, got {}", self.stop.len()));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop", "stop strings must not be empty".into());
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// Top-p's survivors: tokens in probability order with the mass before each, how many are
/// kept, and each token's rank in that order (`u32::MAX`: none).
type TopPOrder = (Vec<(u32, f64)>, usize, Vec<u32>);

/// Where a draw sits: everything the randomness of one decision depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawKey {
    pub seed: u64,
    pub index: u32,
    pub position: u32,
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key[0] = key[0].wrapping_add(PHILOX_W0);
            key[1] = key[1].wrapping_add(PHILOX_W1);
        }
        let p0 = PHILOX_M0 as u64 * ctr[0] as u64;
        let p1 = PHILOX_M1 as u64 * ctr[2] as u64;
        ctr = [(p1 >> 32) as u32 ^ ctr[1] ^ key[0], p1 as u32, (p0 >> 32) as u32 ^ ctr[3] ^ key[1], p0 as u32];
    }
    ctr
}

/// Counter word 3 separates independent streams of the same key.
const STREAM_TOKENS: u32 = 0;

impl DrawKey {
    /// The uniforms in (0, 1) of tokens `2p` and `2p + 1`, 53 bits each.
    fn uniform_pair(&self, pair: u32) -> [f64; 2] {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let r = philox4x32_10([pair, self.position, self.index, STREAM_TOKENS], key);
        let u = |hi: u32, lo: u32| ((((hi as u64) << 32 | lo as u64) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
        [u(r[0], r[1]), u(r[2], r[3])]
    }
    /// Token `j`'s uniform in (0, 1).
    pub fn uniform(&self, j: u32) -> f64 {
        self.uniform_pair(j / 2)[(j % 2) as usize]
    }
}

/// One step's decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub token: u32,
    /// In logit units, the smallest change of the logits found that could change the token:
    /// greedy, top1 − top2; sampled, the winner's perturbed score minus the runner-up's, or,
    /// when smaller, the distance of a filter's cut-off from admitting a token that would win
    /// or from dropping the winner. `f32::INFINITY` when nothing could change it.
    pub margin: f32,
}

/// The decision for one step from `logits`, given the tokens already in the context (`prompt`
/// and the `output` so far, for the penalties).
pub fn decide(p: &SamplingParams, key: DrawKey, prompt: &[u32], output: &[u32], logits: &[f32]) -> Decision {
    let penalized;
    let logits = if p.has_penalties() {
        penalized = penalize(p, prompt, output, logits);
        &penalized[..]
    } else {
        logits
    };
    if p.is_greedy() {
        let (token, margin) = argmax_margin(logits);
        return Decision { token, margin };
    }
    sample(p, key, logits)
}

/// The logits after the repetition, presence and frequency penalties.
pub fn penalize(p: &SamplingParams, prompt: &[u32], output: &[u32], logits: &[f32]) -> Vec<f32> {
    let mut l = logits.to_vec();
    let v = l.len();
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in output {
        *counts.entry(t).or_default() += 1;
    }
    if p.repetition_penalty != 1.0 {
        let mut seen = std::collections::HashSet::new();
        for &t in prompt.iter().chain(output) {
            if (t as usize) < v && seen.insert(t) {
                let x = &mut l[t as usize];
                *x = if *x > 0.0 { *x / p.repetition_penalty } else { *x * p.repetition_penalty };
            }
        }
    }
    for (&t, &c) in &counts {
        if (t as usize) < v {
            l[t as usize] -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
    l
}

/// Why a token is not a candidate: the first filter that removed it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cut {
    In,
    TopK,
    TopP,
    MinP,
}

/// The candidate set after the filters, with what the margin needs to know about each cut.
struct Filtered {
    /// Per token: in, or which filter removed it.
    cut: Vec<Cut>,
    /// `w_j = exp((l_j - l_max) / T)`.
    w: Vec<f64>,
    /// top-k: the smallest kept logit and the largest removed one.
    top_k_edge: Option<(f32, f32)>,
    /// top-p: tokens in probability order (of the top-k survivors) with the mass fraction
    /// before each, the number kept, and each token's rank in that order (u32::MAX: none).
    top_p_order: Option<TopPOrder>,
    l_max: f64,
    /// min-p: the threshold on `(l - l_max) / T`.
    min_p_edge: Option<f64>,
}

/// Tokens in decreasing logit order, ties by lower id: the order every cut uses.
fn by_logit(logits: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    move |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

fn filter(p: &SamplingParams, logits: &[f32]) -> Filtered {
    let v = logits.len();
    let t = p.temperature as f64;
    let l_max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut w: Vec<f64> = logits.iter().map(|&l| (l as f64 - l_max) / t).collect();
    exp_f64_in_place(&mut w);
    let mut cut = vec![Cut::In; v];
    let mut f = Filtered { cut: Vec::new(), w, top_k_edge: None, top_p_order: None, min_p_edge: None, l_max };

    let mut kept: Option<Vec<u32>> = None;
    if p.top_k > 0 && p.top_k < v {
        let mut ids: Vec<u32> = (0..v as u32).collect();
        ids.select_nth_unstable_by(p.top_k, by_logit(logits));
        let (top, rest) = ids.split_at(p.top_k);
        rest.iter().for_each(|&j| cut[j as usize] = Cut::TopK);
        let kth = top.iter().map(|&j| logits[j as usize]).fold(f32::INFINITY, f32::min);
        let next = rest.iter().map(|&j| logits[j as usize]).fold(f32::NEG_INFINITY, f32::max);
        f.top_k_edge = Some((kth, next));
        kept = Some(top.to_vec());
    }
    if p.top_p < 1.0 {
        let ids = kept.take().unwrap_or_else(|| (0..v as u32).collect());
        let total: f64 = ids.iter().map(|&j| f.w[j as usize]).sum();
        let goal = p.top_p as f64 * total;
        // The kept prefix lies among the tokens at or above any weight whose tokens already hold
        // `goal` (a token ranks above every token of a smaller weight): find such a weight by
        // steps of 10^-6 and sort only those tokens.
        let mut floor = 1e-3;
        let mut near: Vec<u32>;
        loop {
            near = ids.iter().copied().filter(|&j| f.w[j as usize] >= floor).collect();
            if floor == 0.0 || near.iter().map(|&j| f.w[j as usize]).sum::<f64>() >= goal {
                break;
            }
            floor = if floor < 1e-290 { 0.0 } else { floor * 1e-6 };
        }
        for &j in &ids {
            if f.w[j as usize] < floor {
                cut[j as usize] = Cut::TopP;
            }
        }
        near.sort_unstable_by(by_logit(logits));
        let mut before = 0.0;
        let mut order = Vec::with_capacity(near.len());
        let mut keep = near.len();
        for (i, &j) in near.iter().enumerate() {
            order.push((j, before / total));
            if before >= goal && keep == near.len() {
                keep = i;
            }
            before += f.w[j as usize];
        }
        let mut rank = vec![u32::MAX; v];
        for (r, &(j, _)) in order.iter().enumerate() {
            rank[j as usize] = r as u32;
            if r >= keep {
                cut[j as usize] = Cut::TopP;
            }
        }
        f.top_p_order = Some((order, keep, rank));
    }
    if p.min_p > 0.0 {
        // p_j >= min_p p_max  <=>  w_j >= min_p (w of the most likely token is 1).
        let min_p = p.min_p as f64;
        for (j, c) in cut.iter_mut().enumerate() {
            if *c == Cut::In && f.w[j] < min_p {
                *c = Cut::MinP;
            }
        }
        f.min_p_edge = Some(ln_f64(min_p));
    }
    f.cut = cut;
    f
}

fn logit_of(c: f64) -> f64 {
    let c = c.clamp(1e-300, 1.0 - 1e-16);
    ln_f64(c) - ln_f64(1.0 - c)
}

fn sample(p: &SamplingParams, key: DrawKey, logits: &[f32]) -> Decision {
    let t = p.temperature as f64;
    let f = filter(p, logits);
    // The race: the smallest E_j / w_j wins (ties: lower id).
    let ratio = |j: u32| -> f64 {
        let w = f.w[j as usize];
        if w > 0.0 {
            -ln_f64(key.uniform(j)) / w
        } else {
            f64::INFINITY
        }
    };
    let (mut best, mut r1, mut r2) = (u32::MAX, f64::INFINITY, f64::INFINITY);
    let candidate = |j: usize| j < logits.len() && f.cut[j] == Cut::In && f.w[j] > 0.0;
    for pair in 0..logits.len().div_ceil(2) as u32 {
        if !candidate(2 * pair as usize) && !candidate(2 * pair as usize + 1) {
            continue; // no draw needed (a filter left few candidates)
        }
        let u = key.uniform_pair(pair);
        for (k, &u) in u.iter().enumerate() {
            let j = 2 * pair + k as u32;
            if !candidate(j as usize) {
                continue;
            }
            let r = -ln_f64(u) / f.w[j as usize];
            if r < r1 {
                (r2, r1, best) = (r1, r, j);
            } else if r < r2 {
                r2 = r;
            }
        }
    }
    if best == u32::MAX {
        // Every weight underflowed (a vanishing temperature): the most likely token.
        let (token, margin) = argmax_margin(logits);
        return Decision { token, margin };
    }
    let lw = logits[best as usize];
    let mut margin = if r2.is_finite() { t * (ln_f64(r2) - ln_f64(r1)) } else { f64::INFINITY };

    // The winner's own distance from being cut.
    if let Some((_, next)) = f.top_k_edge {
        margin = margin.min((lw - next) as f64);
    }
    let z = |j: u32| (logits[j as usize] as f64 - f.l_max) / t;
    let z_w = z(best);
    if let (Some(edge), true) = (f.min_p_edge, z_w < 0.0) {
        margin = margin.min(t * (z_w - edge));
    }
    let top_p = logit_of(p.top_p as f64);
    if let Some((order, keep, rank)) = &f.top_p_order {
        let r = rank[best as usize] as usize;
        if r > 0 {
            margin = margin.min(t * (top_p - logit_of(order[r].1)));
        }
        if r + 1 == *keep {
            if let Some(&(next, _)) = order.get(*keep) {
                margin = margin.min((lw - logits[next as usize]) as f64);
            }
        }
    }
    // Tokens a cut removed that would win if a change of the logits smaller than the margin
    // admitted them.
    for j in 0..logits.len() as u32 {
        let lj = logits[j as usize];
        let admit = match f.cut[j as usize] {
            Cut::In => continue,
            Cut::TopK => (f.top_k_edge.unwrap().0 - lj) as f64,
            Cut::MinP => t * (f.min_p_edge.unwrap() - z(j)),
            Cut::TopP => {
                let (order, keep, rank) = f.top_p_order.as_ref().unwrap();
                let overtake = (logits[order[*keep - 1].0 as usize] - lj) as f64;
                match order.get(rank[j as usize] as usize) {
                    Some(&(_, before)) => overtake.min(t * (logit_of(before) - top_p)),
                    None => overtake,
                }
            }
        };
        if admit < margin && ratio(j) < r1 {
            margin = admit.max(0.0);
        }
    }
    Decision { token: best, margin: margin as f32 }
}

/// A step's log-probabilities under `logits` (log-softmax, in f64): the chosen token's, and the
/// `top` most likely tokens' in decreasing order (ties by lower id).
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut e: Vec<f64> = logits.iter().map(|&l| l as f64 - m).collect();
    exp_f64_in_place(&mut e);
    let lse = m + ln_f64(e.iter().sum::<f64>());
    let lp = |j: u32| (logits[j as usize] as f64 - lse) as f32;
    let mut alts = Vec::new();
    if top > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let top = top.min(ids.len());
        if top < ids.len() {
            ids.select_nth_unstable_by(top, by_logit(logits));
            ids.truncate(top);
        }
        ids.sort_unstable_by(by_logit(logits));
        alts = ids.into_iter().map(|j| (j, lp(j))).collect();
    }
    (lp(chosen), alts)
}

/// The candidate set the filters leave (for tests of the cuts): token ids in increasing order.
pub fn candidates(p: &SamplingParams, logits: &[f32]) -> Vec<u32> {
    let f = filter(p, logits);
    (0..logits.len() as u32).filter(|&j| f.cut[j as usize] == Cut::In && f.w[j as usize] > 0.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams { temperature: t, ..Default::default() }
    }

    #[test]
    fn each_rule_names_its_parameter_as_data() {
        let d = SamplingParams::default;
        let cases: Vec<(&str, SamplingParams)> = vec![
            ("temperature", SamplingParams { temperature: -1.0, ..d() }),
            ("top_p", SamplingParams { top_p: 0.0, ..d() }),
            ("min_p", SamplingParams { min_p: 2.0, ..d() }),
            ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..d() }),
            ("presence_penalty", SamplingParams { presence_penalty: 3.0, ..d() }),
            ("frequency_penalty", SamplingParams { frequency_penalty: -3.0, ..d() }),
            ("max_new_tokens", SamplingParams { max_new_tokens: 0, ..d() }),
            ("n", SamplingParams { n: 0, ..d() }),
            ("top_logprobs", SamplingParams { top_logprobs: MAX_TOP_LOGPROBS + 1, ..d() }),
            ("stop", SamplingParams { stop: vec![String::new()], ..d() }),
        ];
        for (param, p) in cases {
            assert_eq!(p.validate().unwrap_err().param(), Some(param), "{param}");
        }
        assert!(d().validate().is_ok());
    }

    #[test]
    fn each_range_keeps_its_ends_and_refuses_nan() {
        let top_p = ParamRange::of("top_p");
        assert!(!top_p.contains(0.0) && top_p.contains(1.0) && !top_p.contains(f64::NAN));
        assert!(ParamRange::of("temperature").contains(0.0) && !ParamRange::of("temperature").contains(f64::INFINITY));
        assert_eq!(ParamRange::of("repetition_penalty").to_string(), "in (0, 10]");
        assert_eq!(ParamRange::of("temperature").to_string(), "a finite number >= 0");
        let e = SamplingParams { n: MAX_N + 1, ..Default::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), format!("n must be in [1, {MAX_N}], got {}", MAX_N + 1));
    }

    #[test]
    fn philox_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniforms_are_inside_the_open_interval() {
        let k = DrawKey { seed: 7, index: 0, position: 0 };
        for j in 0..10_000 {
            let u = k.uniform(j);
            assert!(u > 0.0 && u < 1.0);
        }
    }

    #[test]
    fn greedy_is_argmax_margin_bit_for_bit() {
        let l = [0.5f32, 2.25, -1.0, 2.0];
        let d = decide(&params(0.0), DrawKey { seed: 1, index: 0, position: 0 }, &[], &[], &l);
        assert_eq!((d.token, d.margin.to_bits()), (1, argmax_margin(&l).1.to_bits()));
    }

    #[test]
    fn top_k_keeps_exactly_k_with_ties_to_the_lower_id() {
        let l = [1.0f32, 3.0, 2.0, 3.0, 2.0, 0.0];
        let p = SamplingParams { top_k: 3, ..params(1.0) };
        assert_eq!(candidates(&p, &l), vec![1, 2, 3]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // probabilities 0.5, 0.25, 0.125, 0.125 (T = 1)
        let ln = |x: f64| x.ln() as f32;
        let l = [ln(0.5), ln(0.25), ln(0.125), ln(0.125)];
        let c = |top_p| candidates(&SamplingParams { top_p, ..params(1.0) }, &l);
        assert_eq!(c(0.4999), vec![0]);
        assert_eq!(c(0.5001), vec![0, 1]);
        assert_eq!(c(0.7499), vec![0, 1]);
        assert_eq!(c(0.7501), vec![0, 1, 2]);
        assert_eq!(c(1.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn min_p_keeps_tokens_at_least_min_p_of_the_max() {
        let ln = |x: f64| x.ln() as f32;
        let l = [ln(0.4), ln(0.2), ln(0.1), ln(0.3)];
        let c = |min_p| candidates(&SamplingParams { min_p, ..params(1.0) }, &l);
        // 0.2 / 0.4 = 0.5 and 0.3 / 0.4 = 0.75, up to the rounding of the logits to f32.
        assert_eq!(c(0.4999), vec![0, 1, 3]);
        assert_eq!(c(0.5001), vec![0, 3]);
        assert_eq!(c(0.7499), vec![0, 3]);
        assert_eq!(c(0.7501), vec![0]);
        assert_eq!(c(0.2499), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_draw_depends_only_on_its_key() {
        let l: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = params(0.9);
        let k = DrawKey { seed: 42, index: 1, position: 9 };
        let a = decide(&p, k, &[], &[], &l);
        for _ in 0..3 {
            assert_eq!(decide(&p, k, &[], &[], &l), a);
        }
        let others: std::collections::HashSet<u32> =
            (0..40).map(|s| decide(&p, DrawKey { seed: s, ..k }, &[], &[], &l).token).collect();
        assert!(others.len() > 3, "different seeds should give different tokens");
    }

    #[test]
    fn the_margin_is_the_perturbed_score_gap_without_filters() {
        let l: Vec<f32> = (0..9).map(|i| i as f32 * 0.1).collect();
        let p = params(0.7);
        let k = DrawKey { seed: 3, index: 0, position: 2 };
        let d = decide(&p, k, &[], &[], &l);
        let mut s: Vec<(f64, u32)> =
            (0..9u32).map(|j| (l[j as usize] as f64 - 0.7 * (-(k.uniform(j).ln())).ln(), j)).collect();
        s.sort_by(|a, b| b.0.total_cmp(&a.0));
        assert_eq!(d.token, s[0].1);
        assert!((d.margin as f64 - (s[0].0 - s[1].0)).abs() < 1e-5, "{} vs {}", d.margin, s[0].0 - s[1].0);
    }

    #[test]
    fn penalties_follow_openai_and_ctrl() {
        let l = [2.0f32, -1.0, 0.5, 1.0];
        let p =
            SamplingParams { repetition_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, ..params(0.0) };
        let out = penalize(&p, &[0, 1], &[2, 2, 0], &l);
        assert_eq!(out, vec![2.0 / 2.0 - 0.25 - 0.5, -2.0, 0.5 / 2.0 - 0.5 - 0.5, 1.0]);
    }

    #[test]
    fn bad_parameters_are_refused_by_name() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (params(-0.1), "temperature"),
            (params(f32::NAN), "temperature"),
            (SamplingParams { top_p: 0.0, ..params(1.0) }, "top_p"),
            (SamplingParams { top_p: 1.5, ..params(1.0) }, "top_p"),
            (SamplingParams { min_p: -0.1, ..params(1.0) }, "min_p"),
            (SamplingParams { n: 0, ..params(1.0) }, "n must"),
            (SamplingParams { n: 10_000, ..params(1.0) }, "n must"),
            (SamplingParams { top_logprobs: 21, ..params(1.0) }, "top_logprobs"),
            (SamplingParams { presence_penalty: 3.0, ..params(1.0) }, "presence_penalty"),
        ];
        for (p, name) in cases {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let (lp, top) = logprobs(&l, 0, 2);
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
