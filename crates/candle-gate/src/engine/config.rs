//! How an engine is configured: its budgets, its K/V storage and its gate.

use std::str::FromStr;

use serde::Serialize;

use crate::dispatch::Mode;
use crate::error::{Error, Result};
use crate::kv_cache::{KvDtype, KV_BLOCK};
use crate::profile::Profile;

use super::speculative::SpeculativeConfig;
use super::RequestId;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_tokens_per_step: usize,
    pub prefill_chunk: usize,
    /// KV memory budget in tokens (over all sequences): the engine's block pool holds this
    /// many positions, rounded up to whole blocks, and is allocated once.
    pub kv_budget_tokens: usize,
    /// How K/V values are stored (f16 by default; the reference lane's own caches are f32).
    pub kv_dtype: KvDtype,
    pub gate: GateConfig,
    /// FP32 copies of the weights for the reference lane are kept only under this many bytes.
    pub reference_dense_max_bytes: usize,
    /// Worker threads for this engine's steps (None: the global pool).
    pub threads: Option<usize>,
    /// Keep a hash of every step's logits bits (the probe counts mismatches with them).
    pub record_logit_hashes: bool,
    /// Reuse the K/V of whole blocks of a token history another request already computed
    /// (the prefix cache). Never changes a bit in `invariant` mode (see `docs/DESIGN.md`).
    pub enable_prefix_caching: bool,
    /// Every prefix block under one chain hash, for tests that a collision cannot serve wrong
    /// K/V; `false` in real use.
    #[doc(hidden)]
    pub collide_prefix_hashes: bool,
    /// Speculative decoding (`None`: off). It changes how many tokens a step emits, never which.
    pub speculative: Option<SpeculativeConfig>,
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
    /// The draft model's forward fails halfway through on the engine's `step`-th step.
    Draft { step: u64 },
}

impl EngineConfig {
    /// The rules between the budgets, and the speculation's own.
    pub fn validate(&self) -> Result<()> {
        if self.max_num_seqs == 0 {
            return Err(Error::invalid("max_num_seqs", "max_num_seqs must be at least 1"));
        }
        if self.prefill_chunk == 0 || self.max_tokens_per_step < self.prefill_chunk {
            return Err(Error::invalid(
                "prefill_chunk",
                format!(
                    "need 1 <= prefill_chunk ({}) <= max_tokens_per_step ({})",
                    self.prefill_chunk, self.max_tokens_per_step
                ),
            ));
        }
        if self.threads == Some(0) {
            return Err(Error::invalid("threads", "threads must be at least 1"));
        }
        match &self.speculative {
            Some(spec) => spec.validate(),
            None => Ok(()),
        }
    }

    /// The pool's size in blocks.
    pub fn kv_budget_blocks(&self) -> usize {
        self.kv_budget_tokens.div_ceil(KV_BLOCK)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 16,
            max_tokens_per_step: 256,
            prefill_chunk: 64,
            kv_budget_tokens: 65536,
            kv_dtype: KvDtype::F16,
            gate: GateConfig::off(),
            reference_dense_max_bytes: 2 << 30,
            threads: None,
            record_logit_hashes: false,
            enable_prefix_caching: true,
            collide_prefix_hashes: false,
            speculative: None,
            inject_fault: None,
        }
    }
}

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

    /// Whether a verification run can keep drafts: not when every step is rechecked (`always`,
    /// `shadow`), since a recheck ends the run at its row.
    pub fn can_speculate(&self) -> bool {
        matches!(self.mode, GateMode::Off | GateMode::Gated)
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
