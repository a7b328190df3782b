//! Crossover profiles: measured per backend and dtype, written by `cargo bench` or
//! `candle-gate calibrate --kernels`, read by the engine.
//!
//! ```json
//! {"backend": "cpu", "created": "...", "candle_gate_version": "0.1.0",
//!  "dtypes": {"q4_1": {"row_split_max": 4, "crossover_rows": 5,
//!                      "table": [{"shape": [1536, 576], "rows": 1, "kernel": "gemv_row_split", "ns_per_call": 1234.0}]}},
//!  "gate": {"tau": 0.5, "rule": "..."}}
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::dispatch::{dtype_from_name, Backend, Mode, Policy};
use crate::error::{Error, Result};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TableRow {
    pub shape: [usize; 2],
    pub rows: usize,
    pub kernel: String,
    pub ns_per_call: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DtypeProfile {
    pub row_split_max: usize,
    pub crossover_rows: Option<usize>,
    #[serde(default)]
    pub table: Vec<TableRow>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GateProfile {
    pub tau: f32,
    #[serde(default)]
    pub rule: String,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    pub backend: String,
    pub created: String,
    #[serde(default)]
    pub candle_gate_version: String,
    #[serde(default)]
    pub dtypes: BTreeMap<String, DtypeProfile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<GateProfile>,
}

/// From a table of timings for one dtype: the first row count at which the batched kernel
/// (`gemm`) beats row-split `gemv` summed over the shapes measured, and the threshold below it.
pub fn crossover(table: &[TableRow]) -> (Option<usize>, usize) {
    let mut rows: Vec<usize> = table.iter().map(|r| r.rows).collect();
    rows.sort_unstable();
    rows.dedup();
    let total = |m: usize, kernel: &str| -> f64 {
        table.iter().filter(|r| r.rows == m && r.kernel == kernel).map(|r| r.ns_per_call).sum()
    };
    for &m in &rows {
        let (g, s) = (total(m, "gemm"), total(m, "gemv_row_split"));
        if g > 0.0 && s > 0.0 && g < s {
            let below = rows.iter().copied().filter(|&x| x < m).max().unwrap_or(1);
            return (Some(m), below.max(1));
        }
    }
    (None, rows.last().copied().unwrap_or(crate::dispatch::DEFAULT_ROW_SPLIT_MAX))
}

impl Profile {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Profile(format!("cannot read {}: {e}", path.display())))?;
        let p: Profile = serde_json::from_str(&text)
            .map_err(|e| Error::Profile(format!("{} is not a candle-gate profile: {e}", path.display())))?;
        for name in p.dtypes.keys() {
            dtype_from_name(name).map_err(|_| Error::Profile(format!("{}: unknown dtype {name:?}", path.display())))?;
        }
        Ok(p)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Profile(e.to_string()))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// The policy for `backend` in `mode`; a profile measured on another backend is refused.
    pub fn policy(&self, backend: Backend, mode: Mode, source: &str) -> Result<Policy> {
        if self.backend != backend.name() {
            return Err(Error::Profile(format!(
                "{source} was measured on backend {:?}, not {:?}",
                self.backend,
                backend.name()
            )));
        }
        let mut p = Policy::new(mode);
        for (name, d) in &self.dtypes {
            if d.row_split_max == 0 {
                return Err(Error::Profile(format!("{source}: row_split_max for {name} must be at least 1")));
            }
            p.row_split_max.insert((backend, name.clone()), d.row_split_max);
        }
        p.source = Some(source.to_string());
        Ok(p)
    }
}
