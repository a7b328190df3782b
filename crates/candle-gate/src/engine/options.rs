//! An engine from what a user asks for, by the crate's rules: the kernel mode (default: the
//! one the model's weight layout was made for), a profile's measured thresholds, the gate and where its calibrated tau comes from,
//! and the budgets. The Python binding, the CLI and the server all build engines through
//! [`EngineOptions::build`], so the rules have one owner.

use std::path::PathBuf;
use std::sync::Arc;

use crate::dispatch::{Backend, Mode, Policy};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::profile::Profile;

use super::config::{EngineConfig, GateConfig, GateMode};
use super::Engine;

/// What an engine is asked to be. `config`'s gate is replaced by the one resolved from `gate`,
/// `tau`, `deep_tau` and the profiles.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// The fast lane's kernel mode; None: the one the model's weight layout was made for.
    pub mode: Option<Mode>,
    /// A profile whose thresholds (and gate calibration) the engine takes, read once.
    pub profile: Option<PathBuf>,
    pub gate: Option<GateMode>,
    pub tau: Option<f32>,
    pub deep_tau: Option<f32>,
    /// Where a gated engine given neither `tau` nor `profile` looks for its calibration, first
    /// match wins.
    pub gate_profiles: Vec<PathBuf>,
    /// Overrides the profile's row-split thresholds with one for every shape.
    pub row_split_max: Option<usize>,
    /// The draft model of speculative method `draft`; it runs in the engine's lane.
    pub draft_model: Option<Arc<Model>>,
    pub config: EngineConfig,
}

impl EngineOptions {
    /// The engine, and where its gate's tau came from (`"PATH (model/mode)"`; None when tau
    /// was given or the engine is not gated).
    pub fn build(mut self, model: Arc<Model>) -> Result<(Engine, Option<String>)> {
        let mode = self.mode.unwrap_or(model.layout.mode());
        let loaded = self.profile.as_ref().map(|p| Profile::load(p)).transpose()?;
        let mut policy = match (&loaded, &self.profile) {
            (Some(p), Some(path)) => p.policy(Backend::Cpu, mode, &path.display().to_string())?,
            _ => Policy::new(mode),
        };
        if let Some(r) = self.row_split_max {
            if r == 0 {
                return Err(Error::invalid("row_split_max", "row_split_max must be at least 1"));
            }
            policy.default_row_split_max = r;
            policy.row_split_max.clear();
        }
        // An explicit profile is the only place its gate is looked for.
        let (profiles, paths) = match (loaded, &self.profile) {
            (Some(p), Some(path)) => (vec![p], vec![path.display().to_string()]),
            _ => {
                let paths: Vec<String> = self.gate_profiles.iter().map(|p| p.display().to_string()).collect();
                (self.gate_profiles.iter().map(|p| Profile::load(p)).collect::<Result<Vec<_>>>()?, paths)
            }
        };
        let list: Vec<(&Profile, &str)> = profiles.iter().zip(&paths).map(|(p, s)| (p, s.as_str())).collect();
        let gate = self.gate.unwrap_or(GateMode::Off);
        let lane = calibration_lane(gate, self.tau, list.len(), &model, mode)?;
        let lane = lane.as_ref().map(|(m, h)| (*m, h.as_str()));
        let (gate, source) = GateConfig::resolve(gate, self.tau, self.deep_tau, &list, lane)?;
        self.config.gate = gate;
        Ok((Engine::with_draft_model(model, self.draft_model, Arc::new(policy), self.config)?, source))
    }
}

/// The lane a gate calibration is looked up for: `mode` and the model file's sha256, computed
/// only when a gated engine without tau has profiles to look in.
pub fn calibration_lane(
    gate: GateMode,
    tau: Option<f32>,
    profiles: usize,
    model: &Model,
    mode: Mode,
) -> Result<Option<(Mode, String)>> {
    if !GateConfig::needs_calibration(gate, tau) || profiles == 0 {
        return Ok(None);
    }
    Ok(Some((mode, model.sha256()?)))
}
