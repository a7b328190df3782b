//! Crossover profiles: measured per backend and dtype, written by `cargo bench` or
//! `candle-gate calibrate --kernels`, read by the engine.
//!
//! ```json
//! {"backend": "cpu", "created": "...", "candle_gate_version": "0.1.0",
//!  "dtypes": {"q4_1": {"row_split_max": 4, "crossover_rows": 5,
//!                      "table": [{"shape": [1536, 576], "rows": 1, "kernel": "gemv_row_split", "ns_per_call": 1234.0}]}},
//!  "gates": [{"tau": 0.09, "deep_tau": 0.05, "mode": "split_k_f16",
//!             "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_sha256": "...", "rule": "..."}]}
//! ```
//!
//! A gate calibration holds for one model file in one fast-lane mode: `gates` keeps one per
//! `(mode, model_sha256)`. The older single `"gate"` object is still read, as one more entry.

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deep_tau: Option<f32>,
    #[serde(default)]
    pub rule: String,
    /// The fast-lane mode calibrated; absent (older profiles): any mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// The model file's name, for people reading the profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The model calibrated; absent (older profiles): any model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_sha256: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl GateProfile {
    /// Whether this calibration is for `mode` on the model whose file hashes to `model_sha256`.
    pub fn applies_to(&self, mode: Mode, model_sha256: &str) -> bool {
        self.mode.as_deref().is_none_or(|m| m == mode.name())
            && self.model_sha256.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(model_sha256))
    }

    /// `model/mode`, as error messages and `Engine.gate_source` name a calibration.
    pub fn label(&self) -> String {
        let model = match (&self.model, &self.model_sha256) {
            (Some(m), _) => m.clone(),
            (None, Some(h)) => format!("sha256 {}", &h[..h.len().min(12)]),
            (None, None) => "any model".into(),
        };
        format!("{model}/{}", self.mode.as_deref().unwrap_or("any mode"))
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    pub backend: String,
    pub created: String,
    #[serde(default)]
    pub candle_gate_version: String,
    #[serde(default)]
    pub dtypes: BTreeMap<String, DtypeProfile>,
    /// A single calibration, as profiles before `gates` held it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<GateProfile>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<GateProfile>,
}

/// The user's own profile, which `candle-gate calibrate` writes by default and a gated engine
/// reads before the one shipped with the package: `profile-cpu.json` in the cache directory.
pub fn user_profile_path() -> std::path::PathBuf {
    crate::registry::cache_dir().join("profile-cpu.json")
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

    /// A profile with nothing measured yet, for this build.
    pub fn empty(backend: Backend) -> Self {
        Profile {
            backend: backend.name().into(),
            created: now_iso8601(),
            candle_gate_version: crate::VERSION.into(),
            dtypes: BTreeMap::new(),
            gate: None,
            gates: Vec::new(),
        }
    }

    /// Every gate calibration in the profile: `gates`, then the older single `gate`.
    pub fn gate_calibrations(&self) -> impl Iterator<Item = &GateProfile> {
        self.gates.iter().chain(self.gate.iter())
    }

    /// The calibration for `mode` on the model hashing to `model_sha256`, if the profile has one.
    pub fn gate_for(&self, mode: Mode, model_sha256: &str) -> Option<&GateProfile> {
        self.gate_calibrations().find(|g| g.applies_to(mode, model_sha256))
    }

    /// Writes a gate calibration into `"gates"` of the profile at `path` (created, empty, for
    /// the CPU, when missing), replacing the entry for the same mode and model; an older single
    /// `"gate"` moves into `"gates"`, and every other key is kept as it is. A file that is not a
    /// JSON object is refused, not overwritten. Returns the whole profile.
    pub fn merge_gate(path: &Path, gate: serde_json::Value) -> Result<serde_json::Value> {
        let g: GateProfile = serde_json::from_value(gate.clone())
            .map_err(|e| Error::BadInput(format!("not a gate calibration: {e}")))?;
        if !g.tau.is_finite() || g.tau < 0.0 {
            return Err(Error::BadInput(format!("a gate calibration's tau must be finite and >= 0, got {}", g.tau)));
        }
        let mut prof = if path.exists() {
            let refuse =
                |why: String| Error::BadInput(format!("{} exists but {why}; not overwriting it", path.display()));
            let text = std::fs::read_to_string(path).map_err(|e| refuse(format!("cannot be read ({e})")))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| refuse(format!("is not a readable JSON profile ({e})")))?;
            if !v.is_object() {
                return Err(refuse("is not a JSON object".into()));
            }
            v
        } else {
            serde_json::to_value(Profile::empty(Backend::Cpu)).map_err(|e| Error::Profile(e.to_string()))?
        };
        let obj = prof.as_object_mut().expect("checked above");
        let mut gates = match obj.remove("gates") {
            Some(serde_json::Value::Array(a)) => a,
            None => Vec::new(),
            Some(_) => {
                return Err(Error::BadInput(format!("{}: \"gates\" is not a list; not overwriting it", path.display())))
            }
        };
        gates.extend(obj.remove("gate").filter(|v| !v.is_null()));
        let same = |v: &serde_json::Value| {
            v.get("mode") == gate.get("mode") && v.get("model_sha256") == gate.get("model_sha256")
        };
        gates.retain(|v| !same(v));
        gates.push(gate);
        obj.insert("gates".into(), serde_json::Value::Array(gates));
        let text = serde_json::to_string_pretty(&prof).map_err(|e| Error::Profile(e.to_string()))? + "\n";
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)?;
        Ok(prof)
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

/// Row counts the crossover is measured at.
pub const CROSSOVER_ROWS: [usize; 14] = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128];

/// The default model's `[n, k]` linear shapes, then a 7B-class pair.
pub const MODEL_SHAPES: [[usize; 2]; 5] = [[576, 576], [192, 576], [1536, 576], [576, 1536], [49152, 576]];
pub const LARGE_SHAPES: [[usize; 2]; 2] = [[4096, 4096], [14336, 4096]];

pub struct MeasureSpec {
    pub dtypes: Vec<candle_core::quantized::GgmlDType>,
    pub shapes: Vec<[usize; 2]>,
    pub rows: Vec<usize>,
    /// Wall-clock spent per timed cell, at least one call.
    pub min_time: std::time::Duration,
}

impl MeasureSpec {
    /// `--quick`: the default model's dtypes (Q4_1 layers, Q8_0 output) and shapes.
    pub fn quick() -> Self {
        use candle_core::quantized::GgmlDType as D;
        MeasureSpec {
            dtypes: vec![D::Q4_1, D::Q8_0],
            shapes: MODEL_SHAPES.to_vec(),
            rows: CROSSOVER_ROWS.to_vec(),
            min_time: std::time::Duration::from_millis(4),
        }
    }
    pub fn full() -> Self {
        let mut shapes = MODEL_SHAPES.to_vec();
        shapes.extend(LARGE_SHAPES);
        MeasureSpec {
            dtypes: crate::kernels::cpu::SUPPORTED.to_vec(),
            shapes,
            rows: CROSSOVER_ROWS.to_vec(),
            min_time: std::time::Duration::from_millis(10),
        }
    }
}

fn time_ns(min_time: std::time::Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm caches and the dense-weight cache
    let mut best = f64::INFINITY;
    let start = std::time::Instant::now();
    let mut calls = 0;
    while calls < 3 || start.elapsed() < min_time {
        let t = std::time::Instant::now();
        f();
        best = best.min(t.elapsed().as_nanos() as f64);
        calls += 1;
    }
    best
}

/// Measures every kernel at every row count for each dtype and shape (k rounded up to the
/// dtype's block size), and derives each dtype's crossover. `progress` is called per cell.
pub fn measure(spec: &MeasureSpec, mut progress: impl FnMut(&str)) -> Result<Profile> {
    use crate::dispatch::{dtype_name, Kernel, QMatMul};
    use candle_core::{quantized::QTensor, Device, Tensor};
    let mut dtypes = BTreeMap::new();
    for &d in &spec.dtypes {
        let mut table = Vec::new();
        for &[n, k0] in &spec.shapes {
            let bs = d.block_size();
            let k = k0.div_ceil(bs) * bs;
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
            let q = QTensor::quantize(&w, d)?;
            let g = QMatMul::new(std::sync::Arc::new(q), std::sync::Arc::new(Policy::default()))?;
            let max_rows = spec.rows.iter().copied().max().unwrap_or(1);
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (max_rows, k), &Device::Cpu)?.flatten_all()?.to_vec1()?;
            for &m in &spec.rows {
                // Row-split of a big matrix at many rows costs seconds per call and its line is
                // linear in m: measure it where it can still win.
                for kernel in [Kernel::GemvRowSplit, Kernel::Invariant, Kernel::Gemm, Kernel::Candle] {
                    if kernel == Kernel::GemvRowSplit && m > 32 && n * k > 4096 * 4096 {
                        continue;
                    }
                    progress(&format!("{} [{n},{k}] rows={m} {}", dtype_name(d), kernel.name()));
                    let xs = &x[..m * k];
                    let mut err = None;
                    let ns = time_ns(spec.min_time, || {
                        if let Err(e) = g.run_cpu(kernel, xs, m) {
                            err = Some(e);
                        }
                    });
                    if let Some(e) = err {
                        return Err(e);
                    }
                    table.push(TableRow { shape: [n, k], rows: m, kernel: kernel.name().into(), ns_per_call: ns });
                }
            }
        }
        let (crossover_rows, row_split_max) = crossover(&table);
        dtypes.insert(dtype_name(d), DtypeProfile { row_split_max, crossover_rows, table });
    }
    Ok(Profile { dtypes, ..Profile::empty(Backend::Cpu) })
}

fn now_iso8601() -> String {
    let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (s / 86400, s % 86400);
    // civil-from-days (Howard Hinnant), to avoid a date dependency
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// A fixed-width text table: per dtype and shape, ns per call of each kernel at each row count.
pub fn format_table(p: &Profile) -> String {
    let mut out = String::new();
    for (d, dp) in &p.dtypes {
        out.push_str(&format!(
            "\n{d}: crossover (gemm beats row-split gemv) at {} rows -> row_split_max = {}\n",
            dp.crossover_rows.map(|r| r.to_string()).unwrap_or_else(|| "none measured".into()),
            dp.row_split_max
        ));
        let mut shapes: Vec<[usize; 2]> = dp.table.iter().map(|r| r.shape).collect();
        shapes.dedup();
        for s in shapes {
            out.push_str(&format!(
                "  [{}, {}]  us/call      gemv_rs   invariant        gemm      candle   inv/candle  inv/gemv_rs\n",
                s[0], s[1]
            ));
            let mut rows: Vec<usize> = dp.table.iter().filter(|r| r.shape == s).map(|r| r.rows).collect();
            rows.dedup();
            for m in rows {
                let get = |k: &str| {
                    dp.table.iter().find(|r| r.shape == s && r.rows == m && r.kernel == k).map(|r| r.ns_per_call / 1e3)
                };
                let f = |v: Option<f64>| v.map(|x| format!("{x:11.1}")).unwrap_or_else(|| format!("{:>11}", "-"));
                let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) => format!("{:11.2}x", b / a),
                    _ => format!("{:>12}", "-"),
                };
                let (g, i, ge, c) = (get("gemv_row_split"), get("invariant"), get("gemm"), get("candle"));
                out.push_str(&format!(
                    "    rows={m:<4}       {}{}{}{}{}{}\n",
                    f(g),
                    f(i),
                    f(ge),
                    f(c),
                    ratio(i, c),
                    ratio(i, g)
                ));
            }
        }
    }
    out
}
