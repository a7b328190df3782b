//! The margin gate: decides each step's token from the fast lane's logits, rechecks low-margin
//! steps in the reference lane (repairing the K/V of that position), rebuilds the cache in the
//! reference lane when the recheck is itself a near-tie, and returns one record per step.

use std::str::FromStr;

use serde::Serialize;

use crate::dispatch::Mode;
use crate::error::{Error, Result};
use crate::llama::{KvCache, KvDtype};
use crate::model::Model;
use crate::ops::hash_bits;
use crate::profile::Profile;
use crate::reference::ReferenceWeights;
use crate::sampling::{self, Decision};

use super::sequence::{Sequence, StepRecord};

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
            Error::invalid("gate", format!("unknown gate mode {s:?}; expected off, gated, always or shadow"))
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

/// `deep_tau` when not given: half of tau. On the default model's split_k_f16 lane the
/// recheck's margin moved about half as much as the fast lane's across batch compositions
/// (`calibrate --gate`: recheck_shift 0.025 vs batch_shift 0.047); calibrate it for your lane.
pub const DEEP_TAU_FRACTION: f32 = 0.5;

fn check_threshold(name: &'static str, v: f32) -> Result<()> {
    if !v.is_finite() || v < 0.0 {
        return Err(Error::invalid(name, format!("{name} must be a finite number >= 0, got {v}")));
    }
    Ok(())
}

impl GateConfig {
    pub fn new(mode: GateMode, tau: f32) -> Result<Self> {
        Self::with_deep(mode, tau, tau * DEEP_TAU_FRACTION)
    }
    pub fn with_deep(mode: GateMode, tau: f32, deep_tau: f32) -> Result<Self> {
        check_threshold("tau", tau)?;
        check_threshold("deep_tau", deep_tau)?;
        Ok(GateConfig { mode, tau, deep_tau })
    }
    /// Whether `mode` with this `tau` takes its tau from a calibration (a gated engine given
    /// none): then [`GateConfig::resolve_values`] needs the lane and the model's sha256.
    pub fn needs_calibration(mode: GateMode, tau: Option<f32>) -> bool {
        mode == GateMode::Gated && tau.is_none()
    }

    /// The gate's `(tau, deep_tau)` from what an engine was given, and where they came from:
    /// explicit values first; a gated engine without `tau` takes the calibrated `tau` (and its
    /// `deep_tau` unless one is given) of the first of `profiles` holding a calibration for
    /// `lane` (the fast-lane mode and the model file's sha256). `deep_tau` is `None` where
    /// neither gave one (then [`DEEP_TAU_FRACTION`] of tau). Gated with neither a tau nor such
    /// a calibration is an error that says what the profiles hold.
    pub fn resolve_values(
        mode: GateMode,
        tau: Option<f32>,
        deep_tau: Option<f32>,
        profiles: &[(&Profile, &str)],
        lane: Option<(Mode, &str)>,
    ) -> Result<(f32, Option<f32>, Option<String>)> {
        for (name, v) in [("tau", tau), ("deep_tau", deep_tau)] {
            v.map_or(Ok(()), |v| check_threshold(name, v))?;
        }
        if !Self::needs_calibration(mode, tau) {
            return Ok((tau.unwrap_or(0.0), deep_tau, None));
        }
        let how = "run `candle-gate calibrate --gate --model M --mode MODE` or pass tau=";
        if profiles.is_empty() {
            return Err(Error::invalid(
                "tau",
                format!("gate='gated' needs tau= or a profile with a gate calibration; {how}"),
            ));
        }
        let Some((lane_mode, sha)) = lane else {
            return Err(Error::BadInput("gate='gated' without tau= needs the model to find its calibration".into()));
        };
        for (p, path) in profiles {
            if let Some(g) = p.gate_for(lane_mode, sha) {
                return Ok((g.tau, deep_tau.or(g.deep_tau), Some(format!("{path} ({})", g.label()))));
            }
        }
        let held: Vec<String> = profiles
            .iter()
            .map(|(p, path)| {
                let labels: Vec<String> = p.gate_calibrations().map(|g| g.label()).collect();
                let labels = if labels.is_empty() { "none".to_string() } else { labels.join(", ") };
                format!("{path} has {labels}")
            })
            .collect();
        Err(Error::Profile(format!(
            "no gate calibration for this model (sha256 {}) in mode {}: {}; {how}",
            &sha[..sha.len().min(12)],
            lane_mode.name(),
            held.join("; ")
        )))
    }

    /// [`GateConfig::resolve_values`], validated into a config, with where tau came from.
    pub fn resolve(
        mode: GateMode,
        tau: Option<f32>,
        deep_tau: Option<f32>,
        profiles: &[(&Profile, &str)],
        lane: Option<(Mode, &str)>,
    ) -> Result<(Self, Option<String>)> {
        let (tau, deep, source) = Self::resolve_values(mode, tau, deep_tau, profiles, lane)?;
        let cfg = match deep {
            Some(deep) => Self::with_deep(mode, tau, deep)?,
            None => Self::new(mode, tau)?,
        };
        Ok((cfg, source))
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

pub(crate) struct Gate {
    pub cfg: GateConfig,
    pub reference: ReferenceWeights,
    pub record_logit_hashes: bool,
}

impl Gate {
    /// The step's record for `s`, whose latest position (just written by the fast lane) is the
    /// last of `cache`. An error leaves that position's K/V undefined: the caller fails the
    /// sequence, and only it.
    /// `fast` is [`fast_decision`] of `logits` (computed for every sequence in parallel).
    pub fn decide(
        &self,
        model: &Model,
        s: &mut Sequence,
        cache: &mut KvCache,
        logits: &[f32],
        fast: Decision,
    ) -> Result<StepRecord> {
        let key = s.draw_key();
        let output = s.fed_output();
        let params = &s.req.params;
        let choose = |lg: &[f32]| -> Decision { sampling::decide(params, key, &s.req.prompt_tokens, &output, lg) };
        let rechecked = match self.cfg.mode {
            GateMode::Off | GateMode::Shadow => false,
            GateMode::Always => true,
            GateMode::Gated => fast.margin < self.cfg.tau,
        };
        let mut record = StepRecord {
            token: fast.token,
            margin: fast.margin,
            reference_margin: f32::NAN,
            rechecked,
            corrected: false,
            deep: false,
            logit_hash: self.record_logit_hashes.then(|| hash_bits(logits)),
            logprob: None,
            top_logprobs: Vec::new(),
        };
        let pos = cache.len() - 1;
        let fed = s.fed_at(pos);
        let mut deciding: Option<Vec<f32>> = None;
        if rechecked {
            let mut ref_logits = model.llama.reference_step(cache, fed, self.reference)?;
            let mut reference = choose(&ref_logits);
            if reference.margin < self.cfg.deep_tau {
                ref_logits = rebuild_in_reference_lane(model, s, cache, self.reference)?;
                reference = sampling::decide(&s.req.params, key, &s.req.prompt_tokens, &output, &ref_logits);
                record.deep = true;
            }
            record.token = reference.token;
            record.reference_margin = reference.margin;
            record.corrected = reference.token != fast.token;
            deciding = Some(ref_logits);
        } else if self.cfg.mode == GateMode::Shadow {
            // The fast lane's K/V must stay as they are: save the one position the recheck
            // overwrites and put it back.
            let saved = cache.save_position(pos);
            let ref_logits = model.llama.reference_step(cache, fed, self.reference);
            cache.restore_position(saved)?;
            let reference = choose(&ref_logits?);
            record.reference_margin = reference.margin;
            record.corrected = reference.token != fast.token;
        }
        let params = &s.req.params;
        if params.wants_logprobs() {
            let (lp, top) =
                sampling::logprobs(deciding.as_deref().unwrap_or(logits), record.token, params.top_logprobs);
            record.logprob = Some(lp);
            record.top_logprobs = top;
        }
        Ok(record)
    }
}

/// The decision `s`'s next step would take from `logits`, before any recheck.
pub(crate) fn fast_decision(s: &Sequence, logits: &[f32]) -> Decision {
    sampling::decide(&s.req.params, s.draw_key(), &s.req.prompt_tokens, &s.fed_output(), logits)
}

/// Recomputes the sequence in the reference lane from `reference_exact` on (the prompt, then
/// every token fed so far), in its own f32 cache, and returns the logits of the last position;
/// the sequence's cache takes the rebuilt positions' K/V (in its dtype). Positions before
/// `reference_exact` already are what this would compute, so the result is bitwise the same as
/// rebuilding from position 0: greedy decoding in the reference lane alone.
fn rebuild_in_reference_lane(
    model: &Model,
    s: &mut Sequence,
    cache: &mut KvCache,
    how: ReferenceWeights,
) -> Result<Vec<f32>> {
    let len = cache.len();
    debug_assert_eq!(len, s.req.prompt_tokens.len() + s.steps.len());
    // The latest position is always recomputed: it is the one whose logits are wanted.
    let from = s.reference_exact.min(len - 1).min(s.reference_cache.as_ref().map_or(0, |c| c.len()));
    let fed: Vec<u32> = (from..len).map(|i| s.fed_at(i)).collect();
    let exact = s.reference_cache.get_or_insert_with(|| model.llama.new_cache_with(KvDtype::F32));
    exact.truncate(from);
    let last = model.llama.reference_extend(exact, &fed, how)?;
    for pos in from..len {
        for layer in 0..model.llama.cfg.n_layer {
            cache.write(layer, pos, &exact.read(layer, pos, false), &exact.read(layer, pos, true))?;
        }
    }
    s.reference_exact = len;
    Ok(last)
}
