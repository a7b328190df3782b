//! Python binding: a thin layer over `candle_gate`. Every entry point catches Rust panics and
//! turns them (and every `candle_gate::Error`) into `candle_gate.CandleGateError`, so nothing
//! crosses into Python as a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use candle_gate::engine::options::calibration_lane;
use candle_gate::engine::{Choice, EngineOptions, Event, Output, SpeculativeConfig, SpeculativeMethod};
use candle_gate::profile::Profile;
use candle_gate::reference::ReferenceWeights;
use candle_gate::{
    Engine as RsEngine, EngineConfig, GateConfig, GateMode, Mode, Model as RsModel, Policy, Request, WeightLayout,
};
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

mod testing;

create_exception!(_native, CandleGateError, PyException, "Any error raised by candle-gate.");
create_exception!(
    _native,
    InvalidParameter,
    PyValueError,
    "A request or option out of range; `param` names it (Rust's spelling, e.g. 'max_new_tokens')."
);
create_exception!(_native, EngineShutDown, CandleGateError, "The engine has been shut down.");

/// An `InvalidParameter` carrying `param` as data, so callers never parse the message.
fn invalid(param: &str, msg: String) -> PyErr {
    let e = InvalidParameter::new_err(msg);
    Python::attach(|py| e.value(py).setattr("param", param)).expect("setting an attribute on a new exception");
    e
}

/// Candle errors carry a backtrace when RUST_BACKTRACE is set; Python users get the message.
fn clean(msg: String) -> String {
    match msg.find("\n   0: ") {
        Some(i) => msg[..i].trim_end().to_string(),
        None => msg,
    }
}

fn to_py(e: candle_gate::Error) -> PyErr {
    match e {
        candle_gate::Error::InvalidParam { param, msg } => invalid(param, msg),
        candle_gate::Error::ShutDown => EngineShutDown::new_err(e.to_string()),
        candle_gate::Error::BadInput(m) => PyValueError::new_err(clean(m)),
        other => CandleGateError::new_err(clean(other.to_string())),
    }
}

fn chat_json(messages: &str, tools: Option<&str>) -> PyResult<(serde_json::Value, Option<serde_json::Value>)> {
    let parse = |what: &str, s: &str| {
        serde_json::from_str(s).map_err(|e| PyValueError::new_err(format!("{what} is not valid JSON: {e}")))
    };
    let m = parse("messages", messages)?;
    candle_gate::chat::check_messages(&m).map_err(PyTypeError::new_err)?;
    Ok((m, tools.map(|t| parse("tools", t)).transpose()?))
}

/// Raises TypeError unless `messages_json` has the shape every chat must have.
#[pyfunction]
fn check_chat(messages_json: &str) -> PyResult<()> {
    chat_json(messages_json, None).map(|_| ())
}

/// A count argument. Taken as i64 so that a negative one gets an error naming it (PyO3's
/// conversion to usize says only "can't convert negative int to unsigned"); the engine checks
/// the rest (`EngineConfig`'s bounds).
fn count(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(name, format!("{name} must not be negative, got {v}")))
}

/// A float parameter as the engine keeps it (f32). A finite value beyond f32's range would turn
/// into infinity and be refused as "got inf", naming a value the caller never sent: it is
/// refused here as the number given.
fn f32_param(name: &str, v: f64) -> PyResult<f32> {
    let f = v as f32;
    if v.is_finite() && !f.is_finite() {
        return Err(invalid(
            name,
            format!("{name} is {v:e}, beyond the engine's 32-bit floats (at most {:e} in magnitude)", f32::MAX),
        ));
    }
    Ok(f)
}

/// Runs `f`, turning a panic into a `CandleGateError` instead of unwinding into Python.
fn guarded<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CandleGateError::new_err(format!("internal error in {what}: {msg}")))
        }
    }
}

#[pyclass(frozen, module = "candle_gate._native")]
struct Model {
    inner: Arc<RsModel>,
}

#[pymethods]
impl Model {
    /// The model at `path`, its weights in `layout` (default: the one the default mode's
    /// kernels read fastest). The kernels an engine runs over it are the engine's to choose.
    #[staticmethod]
    #[pyo3(signature = (path, layout = None))]
    fn load(py: Python<'_>, path: PathBuf, layout: Option<&str>) -> PyResult<Self> {
        guarded("Model.load", || {
            let layout = match layout {
                Some(l) => WeightLayout::from_str(l).map_err(to_py)?,
                None => WeightLayout::for_mode(Mode::DEFAULT),
            };
            let m = py.detach(|| RsModel::load(&path, layout)).map_err(to_py)?;
            Ok(Model { inner: Arc::new(m) })
        })
    }

    #[getter]
    fn path(&self) -> String {
        self.inner.path.display().to_string()
    }
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.layout.name()
    }
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner.decoder.cfg;
        let d = PyDict::new(py);
        d.set_item("arch", c.arch.name())?;
        d.set_item("n_layer", c.n_layer)?;
        d.set_item("hidden", c.hidden)?;
        d.set_item("ffn", c.ffn)?;
        d.set_item("n_head", c.n_head)?;
        d.set_item("n_kv_head", c.n_kv_head)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("sliding_window", c.sliding_window)?;
        d.set_item("local_layers", c.local_layers.iter().filter(|&&l| l).count())?;
        d.set_item("vocab", c.vocab)?;
        d.set_item("context_length", c.context_length)?;
        d.set_item("rope_base", c.rope_base)?;
        d.set_item("weight_bytes", self.inner.decoder.weight_bytes)?;
        d.set_item("bytes_per_decode_token", self.inner.decoder.bytes_per_decode_token())?;
        // K/V bytes one cached position adds to each decode step's reads (K and V, every layer).
        d.set_item("kv_bytes_per_token_f16", c.kv_bytes_per_token(candle_gate::decoder::KvDtype::F16))?;
        d.set_item("kv_bytes_per_token_f32", c.kv_bytes_per_token(candle_gate::decoder::KvDtype::F32))?;
        Ok(d)
    }

    fn sha256(&self, py: Python<'_>) -> PyResult<String> {
        guarded("Model.sha256", || py.detach(|| self.inner.sha256()).map_err(to_py))
    }

    fn tokenize(&self, text: &str) -> PyResult<Vec<u32>> {
        guarded("Model.tokenize", || self.inner.tokenizer.encode(text).map_err(to_py))
    }

    fn detokenize(&self, ids: Vec<u32>) -> PyResult<String> {
        guarded("Model.detokenize", || Ok(self.inner.tokenizer.decode(&ids)))
    }

    fn token_bytes<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.inner.tokenizer.bytes(&ids, true))
    }

    #[getter]
    fn stop_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.inner.tokenizer.stop_ids.iter().copied().collect();
        v.sort();
        v
    }

    /// The chat rendered by the model's template, as text. `messages_json` is a JSON list of
    /// OpenAI-style message objects, `tools_json` an optional JSON list of tool definitions.
    #[pyo3(signature = (messages_json, tools_json = None))]
    fn apply_chat_template(&self, messages_json: &str, tools_json: Option<&str>) -> PyResult<String> {
        guarded("Model.apply_chat_template", || {
            let (m, t) = chat_json(messages_json, tools_json)?;
            self.inner.tokenizer.render_chat(&m, t.as_ref()).map_err(to_py)
        })
    }

    /// Token ids of a chat: control tokens only where the template put them.
    #[pyo3(signature = (messages_json, tools_json = None))]
    fn encode_chat(&self, messages_json: &str, tools_json: Option<&str>) -> PyResult<Vec<u32>> {
        guarded("Model.encode_chat", || {
            let (m, t) = chat_json(messages_json, tools_json)?;
            self.inner.tokenizer.encode_chat(&m, t.as_ref()).map_err(to_py)
        })
    }

    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.tokenizer.template_source().map(str::to_string)
    }

    /// Logits after the last of `tokens` (a fresh sequence): `lane` "fast" runs `mode` (default:
    /// the one the weights' layout was made for) in one prefill call; "reference" runs every
    /// position through the FP32 reference lane (`weights` "dense" or "blockwise").
    #[pyo3(signature = (tokens, lane = "fast", weights = "dense", mode = None))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        lane: &str,
        weights: &str,
        mode: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let y = guarded("Model.logits", || {
            let how = reference_weights(weights)?;
            let mode = mode.map(Mode::from_str).transpose().map_err(to_py)?.unwrap_or(self.inner.layout.mode());
            let policy = Policy::new(mode);
            let l = &self.inner.decoder;
            match lane {
                "fast" => py.detach(|| l.last_logits(&policy, &tokens)).map_err(to_py),
                "reference" => {
                    if tokens.is_empty() {
                        return Err(PyValueError::new_err("empty token list"));
                    }
                    py.detach(|| l.reference_logits(&tokens, how)).map_err(to_py)
                }
                _ => Err(PyValueError::new_err(format!("unknown lane {lane:?}; expected fast or reference"))),
            }
        })?;
        Ok(y.into_pyarray(py))
    }
}

fn reference_weights(name: &str) -> PyResult<ReferenceWeights> {
    match name {
        "dense" => Ok(ReferenceWeights::Dense),
        "blockwise" => Ok(ReferenceWeights::Blockwise),
        _ => Err(PyValueError::new_err(format!("unknown weights {name:?}; expected dense or blockwise"))),
    }
}

#[pyclass(frozen, module = "candle_gate._native")]
struct Engine {
    inner: Mutex<RsEngine>,
    /// Which profile and calibration the gate's tau came from (None: given, or not gated).
    gate_source: Option<String>,
}

/// `(ids, logprobs)` of a choice's top alternatives as `[steps, k]` arrays.
fn top_arrays<'py>(py: Python<'py>, top: &[Vec<(u32, f32)>]) -> (Bound<'py, PyArray2<u32>>, Bound<'py, PyArray2<f32>>) {
    let k = top.first().map_or(0, |t| t.len());
    let ids: Vec<Vec<u32>> = top.iter().map(|t| t.iter().map(|x| x.0).collect()).collect();
    let lps: Vec<Vec<f32>> = top.iter().map(|t| t.iter().map(|x| x.1).collect()).collect();
    let ids = numpy::ndarray::Array2::from_shape_vec((top.len(), k), ids.concat()).expect("k alternatives per step");
    let lps = numpy::ndarray::Array2::from_shape_vec((top.len(), k), lps.concat()).expect("k alternatives per step");
    (ids.into_pyarray(py), lps.into_pyarray(py))
}

fn gate_dict<'py>(py: Python<'py>, g: &candle_gate::engine::GateStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (key, value) in g.by_name() {
        d.set_item(key, value)?;
    }
    Ok(d)
}

/// `speculative=dict(method="ngram"|"draft", num_speculative_tokens=K, prompt_lookup_max=N,
/// prompt_lookup_min=N, disable_by_batch_size=N, draft_model=Model)`: what is not given is
/// `SpeculativeConfig::new`'s, and the bounds are `SpeculativeConfig::validate`'s (the draft
/// model's vocabulary is the engine's to check).
type Speculation = (Option<SpeculativeConfig>, Option<Arc<RsModel>>);

fn speculative_config(d: Option<&Bound<'_, PyDict>>) -> PyResult<Speculation> {
    let Some(d) = d else { return Ok((None, None)) };
    let Some(method) = d.get_item("method")? else {
        return Err(invalid("speculative", "speculative needs a method, e.g. dict(method=\"ngram\")".into()));
    };
    let method = method.extract::<String>().map_err(|_| invalid("speculative", "method must be a string".into()))?;
    let mut c = SpeculativeConfig::new(SpeculativeMethod::from_str(&method).map_err(to_py)?);
    let mut draft = None;
    for (k, v) in d.iter() {
        let key: String = k.extract()?;
        let field = match key.as_str() {
            "method" => continue,
            "draft_model" => {
                let m = v.cast::<Model>().map_err(|_| {
                    invalid("draft_model", "draft_model must be a loaded model (candle_gate.Model)".into())
                })?;
                draft = Some(m.get().inner.clone());
                continue;
            }
            "num_speculative_tokens" => &mut c.num_speculative_tokens,
            "prompt_lookup_max" => &mut c.prompt_lookup_max,
            "prompt_lookup_min" => &mut c.prompt_lookup_min,
            "disable_by_batch_size" => &mut c.disable_by_batch_size,
            other => {
                let expected = "method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, \
                                disable_by_batch_size, draft_model";
                return Err(invalid(
                    "speculative",
                    format!("unknown speculative option {other:?}; expected {expected}"),
                ));
            }
        };
        let n = v.extract::<i64>().map_err(|_| invalid("speculative", format!("{key} must be an integer")))?;
        *field = count(&key, n)?;
    }
    c.validate().map_err(to_py)?;
    Ok((Some(c), draft))
}

fn choice_dict<'py>(py: Python<'py>, c: Choice) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", c.index)?;
    d.set_item("text", c.text)?;
    d.set_item("token_ids", c.token_ids.into_pyarray(py))?;
    d.set_item("margins", c.margins.into_pyarray(py))?;
    d.set_item("reference_margins", c.reference_margins.into_pyarray(py))?;
    d.set_item("rechecked", c.rechecked.into_iter().map(|b| b as u8).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("corrected", c.corrected.into_iter().map(|b| b as u8).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("logit_hashes", c.logit_hashes.into_pyarray(py))?;
    d.set_item("logprobs", c.logprobs.into_pyarray(py))?;
    let (ids, lps) = top_arrays(py, &c.top_logprobs);
    d.set_item("top_logprob_ids", ids)?;
    d.set_item("top_logprobs", lps)?;
    d.set_item("finish_reason", c.finish_reason.name())?;
    d.set_item("fingerprint", c.fingerprint)?;
    d.set_item("error", c.error)?;
    d.set_item("gate", gate_dict(py, &c.gate)?)?;
    d.set_item("draft_tokens", c.draft_tokens)?;
    d.set_item("accepted_tokens", c.accepted_tokens)?;
    Ok(d)
}

fn output_dict<'py>(py: Python<'py>, o: Output) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", o.id)?;
    d.set_item("prompt_tokens", o.prompt_tokens.len())?;
    d.set_item("cached_tokens", o.cached_tokens)?;
    d.set_item("seed", o.seed)?;
    let choices = PyList::empty(py);
    for c in o.choices {
        choices.append(choice_dict(py, c)?)?;
    }
    d.set_item("choices", choices)?;
    Ok(d)
}

/// How a request decodes (`candle_gate::SamplingParams`): built and validated here, once.
#[pyclass(frozen, module = "candle_gate._native", name = "SamplingParams")]
#[derive(Clone)]
pub(crate) struct SamplingParams {
    pub(crate) inner: candle_gate::SamplingParams,
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (*, max_new_tokens = None, stop = None, temperature = 0.0, top_k = 0, top_p = 1.0, min_p = 0.0,
        repetition_penalty = 1.0, presence_penalty = 0.0, frequency_penalty = 0.0, seed = None, n = 1,
        logprobs = false, top_logprobs = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_new_tokens: Option<i64>,
        stop: Option<&Bound<'_, PyAny>>,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        min_p: f64,
        repetition_penalty: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        seed: Option<i128>,
        n: i64,
        logprobs: bool,
        top_logprobs: i64,
    ) -> PyResult<Self> {
        let stop = match stop {
            None => Vec::new(),
            Some(s) if s.is_instance_of::<PyString>() => vec![s.extract::<String>()?],
            Some(s) => s
                .extract::<Vec<String>>()
                .map_err(|_| PyTypeError::new_err("stop must be a string or a list of strings"))?,
        };
        let seed = seed
            .map(|s| u64::try_from(s).map_err(|_| invalid("seed", format!("seed must be in [0, 2**64), got {s}"))))
            .transpose()?;
        // The default is the Rust type's (`DEFAULT_MAX_NEW_TOKENS`): one owner.
        let max_new_tokens = max_new_tokens.unwrap_or(candle_gate::SamplingParams::default().max_new_tokens as i64);
        let inner = candle_gate::SamplingParams {
            max_new_tokens: count("max_new_tokens", max_new_tokens)?,
            stop,
            temperature: f32_param("temperature", temperature)?,
            top_k: count("top_k", top_k)?,
            top_p: f32_param("top_p", top_p)?,
            min_p: f32_param("min_p", min_p)?,
            repetition_penalty: f32_param("repetition_penalty", repetition_penalty)?,
            presence_penalty: f32_param("presence_penalty", presence_penalty)?,
            frequency_penalty: f32_param("frequency_penalty", frequency_penalty)?,
            seed,
            n: count("n", n)?,
            logprobs,
            top_logprobs: count("top_logprobs", top_logprobs)?,
        };
        inner.validate().map_err(to_py)?;
        Ok(SamplingParams { inner })
    }

    #[getter]
    fn max_new_tokens(&self) -> usize {
        self.inner.max_new_tokens
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.inner.stop.clone()
    }
    #[getter]
    fn temperature(&self) -> f32 {
        self.inner.temperature
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.inner.top_p
    }
    #[getter]
    fn min_p(&self) -> f32 {
        self.inner.min_p
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.inner.repetition_penalty
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.inner.presence_penalty
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.inner.frequency_penalty
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed
    }
    #[getter]
    fn n(&self) -> usize {
        self.inner.n
    }
    #[getter]
    fn logprobs(&self) -> bool {
        self.inner.logprobs
    }
    #[getter]
    fn top_logprobs(&self) -> usize {
        self.inner.top_logprobs
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "SamplingParams(max_new_tokens={}, stop={:?}, temperature={}, top_k={}, top_p={}, min_p={}, repetition_penalty={}, presence_penalty={}, frequency_penalty={}, seed={}, n={}, logprobs={}, top_logprobs={})",
            p.max_new_tokens, p.stop, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty, p.seed.map_or("None".into(), |s| s.to_string()), p.n,
            if p.logprobs { "True" } else { "False" }, p.top_logprobs
        )
    }
}

impl Engine {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, RsEngine>> {
        self.inner.lock().map_err(|_| CandleGateError::new_err("the engine is unusable after an internal error"))
    }

    /// `f` on the engine with the GIL released: the lock may wait for a step in another thread,
    /// and holding the GIL meanwhile would stall every Python thread.
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut RsEngine) -> T + Send) -> PyResult<T> {
        py.detach(|| self.lock().map(|mut e| f(&mut e)))
    }
}

#[pymethods]
impl Engine {
    /// Keyword-only: `mode` (default the model's), `profile` (thresholds and the calibrated
    /// gate, read once), `gate`, `tau`, `deep_tau`, `gate_profiles` (where a gated engine
    /// without `tau` or `profile` looks for its calibration, first match wins), the
    /// scheduler's budgets, `threads`, `record_logit_hashes`, `row_split_max` (overrides the
    /// profile's thresholds), `enable_prefix_caching`.
    #[new]
    #[pyo3(signature = (model, *, mode = None, profile = None, gate = "off", tau = None, deep_tau = None,
        max_num_seqs = None, max_tokens_per_step = None, prefill_chunk = None, kv_budget_tokens = None,
        kv_dtype = None, threads = None, record_logit_hashes = false, row_split_max = None, gate_profiles = None,
        enable_prefix_caching = None, collide_prefix_hashes = false, speculative = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &Model,
        mode: Option<&str>,
        profile: Option<&str>,
        gate: &str,
        tau: Option<f32>,
        deep_tau: Option<f32>,
        max_num_seqs: Option<i64>,
        max_tokens_per_step: Option<i64>,
        prefill_chunk: Option<i64>,
        kv_budget_tokens: Option<i64>,
        kv_dtype: Option<&str>,
        threads: Option<i64>,
        record_logit_hashes: bool,
        row_split_max: Option<i64>,
        gate_profiles: Option<Vec<String>>,
        enable_prefix_caching: Option<bool>,
        collide_prefix_hashes: bool,
        speculative: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        guarded("Engine()", || {
            // What is not given is `EngineConfig::default()`'s (`ENGINE_DEFAULTS`): one owner;
            // the rules that turn the options into an engine are `EngineOptions::build`'s.
            let d = EngineConfig::default();
            let (spec, draft_model) = speculative_config(speculative)?;
            let given = |name: &str, v: Option<i64>, default: usize| v.map_or(Ok(default), |v| count(name, v));
            let config = EngineConfig {
                max_num_seqs: given("max_num_seqs", max_num_seqs, d.max_num_seqs)?,
                max_tokens_per_step: given("max_tokens_per_step", max_tokens_per_step, d.max_tokens_per_step)?,
                prefill_chunk: given("prefill_chunk", prefill_chunk, d.prefill_chunk)?,
                kv_budget_tokens: given("kv_budget_tokens", kv_budget_tokens, d.kv_budget_tokens)?,
                kv_dtype: kv_dtype.map_or(Ok(d.kv_dtype), candle_gate::decoder::KvDtype::from_str).map_err(to_py)?,
                threads: threads.map(|t| count("threads", t)).transpose()?,
                record_logit_hashes,
                enable_prefix_caching: enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
                collide_prefix_hashes,
                speculative: spec,
                ..d
            };
            let options = EngineOptions {
                mode: mode.map(Mode::from_str).transpose().map_err(to_py)?,
                profile: profile.map(PathBuf::from),
                gate: Some(GateMode::from_str(gate).map_err(to_py)?),
                tau,
                deep_tau,
                gate_profiles: gate_profiles.unwrap_or_default().into_iter().map(PathBuf::from).collect(),
                row_split_max: row_split_max.map(|r| count("row_split_max", r)).transpose()?,
                draft_model,
                config,
            };
            let (e, gate_source) = options.build(model.inner.clone()).map_err(to_py)?;
            Ok(Engine { inner: Mutex::new(e), gate_source })
        })
    }

    #[pyo3(signature = (prompt_tokens, params, forced_tokens = None))]
    fn submit(
        &self,
        py: Python<'_>,
        prompt_tokens: Vec<u32>,
        params: &SamplingParams,
        forced_tokens: Option<Vec<u32>>,
    ) -> PyResult<u64> {
        guarded("Engine.submit", || {
            let req = Request { prompt_tokens, params: params.inner.clone(), forced_tokens };
            py.detach(|| self.lock().map(|mut e| e.submit(req)))?.map_err(to_py)
        })
    }

    /// One forward step with the GIL released; returns the number of rows it ran.
    fn step(&self, py: Python<'_>) -> PyResult<usize> {
        guarded("Engine.step", || py.detach(|| self.lock().map(|mut e| e.step()))?.map_err(to_py))
    }

    fn cancel(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        guarded("Engine.cancel", || py.detach(|| self.lock().map(|mut e| e.cancel(id)))?.map_err(to_py))
    }

    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        guarded("Engine.shutdown", || py.detach(|| self.lock().map(|mut e| e.shutdown())))
    }

    #[getter]
    fn has_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |e| e.has_work())
    }
    #[getter]
    fn num_running(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.num_running())
    }
    #[getter]
    fn kv_budget_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.config().kv_budget_tokens)
    }
    /// Blocks of the KV pool held by running sequences' caches now.
    #[getter]
    fn kv_used_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.kv_used_blocks())
    }
    /// Unreferenced blocks that keep a cached prefix (reused when the free ones run out).
    #[getter]
    fn kv_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.kv_cached_blocks())
    }
    /// The pool's size in blocks.
    #[getter]
    fn kv_total_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.kv_total_blocks())
    }
    #[getter]
    fn prefix_caching(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |e| e.config().enable_prefix_caching)
    }
    /// Counters: `prefix_queries` and `prefix_hits` (prompt tokens looked up and found),
    /// `preemptions`.
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with(py, |e| e.cache_stats())?;
        let d = PyDict::new(py);
        d.set_item("prefix_queries", c.prefix_queries)?;
        d.set_item("prefix_hits", c.prefix_hits)?;
        d.set_item("preemptions", c.preemptions)?;
        Ok(d)
    }
    /// Drafts proposed and kept since the engine started (speculative decoding).
    fn spec_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with(py, |e| e.spec_stats())?;
        let d = PyDict::new(py);
        d.set_item("draft_tokens", c.draft_tokens)?;
        d.set_item("accepted_tokens", c.accepted_tokens)?;
        d.set_item("draft_failures", self.with(py, |e| e.draft_failures())?)?;
        Ok(d)
    }
    /// The engine's speculation as given (None: off), e.g. `ngram;k=12;lookup=2..64;max_batch=8`.
    #[getter]
    fn speculative(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, |e| e.describe_speculation())
    }
    /// Forgets every cached prefix (blocks running sequences hold stay with them).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        guarded("Engine.reset_prefix_cache", || self.with(py, |e| e.reset_prefix_cache()))
    }
    #[getter]
    fn kv_block_size(&self) -> usize {
        candle_gate::kv_cache::KV_BLOCK
    }
    /// How K/V values are stored: "f16" or "f32".
    #[getter]
    fn kv_dtype(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| e.config().kv_dtype.name().to_string())
    }
    /// The kernel policy and K/V storage as they enter the result fingerprint.
    #[getter]
    fn kernels(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| e.describe_kernels())
    }
    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.num_waiting())
    }
    #[getter]
    fn policy(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| e.policy().describe())
    }
    /// `fp_` + 16 hex: the stack (model file, version, kernels, gate, host) results are
    /// fingerprinted with; what the server reports as `system_fingerprint`.
    #[getter]
    fn system_fingerprint(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| e.system_fingerprint())
    }
    #[getter]
    fn gate(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| e.config().gate.describe())
    }
    /// `"PATH (model/mode)"`: the profile and calibration the gate's tau came from; None when
    /// tau was given or the engine is not gated.
    #[getter]
    fn gate_source(&self) -> Option<String> {
        self.gate_source.clone()
    }
    #[getter]
    fn tau(&self, py: Python<'_>) -> PyResult<f32> {
        self.with(py, |e| e.config().gate.tau)
    }
    #[getter]
    fn deep_tau(&self, py: Python<'_>) -> PyResult<f32> {
        self.with(py, |e| e.config().gate.deep_tau)
    }

    fn gate_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        gate_dict(py, &self.with(py, |e| e.gate_stats())?)
    }

    /// Events since the last call: dicts with `type` "token" (id, index, token, text, and
    /// `logprob`, `top_logprob_ids`, `top_logprobs` when asked for) or "finished" (id, index,
    /// reason).
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let evs = self.with(py, |e| e.drain_events())?;
        let out = PyList::empty(py);
        for ev in evs {
            let d = PyDict::new(py);
            match ev {
                Event::Token { id, index, token, text, logprob, top_logprobs } => {
                    d.set_item("type", "token")?;
                    d.set_item("id", id)?;
                    d.set_item("index", index)?;
                    d.set_item("token", token)?;
                    d.set_item("text", text)?;
                    if let Some(lp) = logprob {
                        d.set_item("logprob", lp)?;
                        let (ids, lps): (Vec<u32>, Vec<f32>) = top_logprobs.into_iter().unzip();
                        d.set_item("top_logprob_ids", ids.into_pyarray(py))?;
                        d.set_item("top_logprobs", lps.into_pyarray(py))?;
                    }
                }
                Event::Finished { id, index, reason, speculation } => {
                    d.set_item("type", "finished")?;
                    d.set_item("id", id)?;
                    d.set_item("index", index)?;
                    d.set_item("reason", reason.name())?;
                    d.set_item("draft_tokens", speculation.draft_tokens)?;
                    d.set_item("accepted_tokens", speculation.accepted_tokens)?;
                }
            }
            out.append(d)?;
        }
        Ok(out)
    }

    fn is_finished(&self, py: Python<'_>, id: u64) -> PyResult<bool> {
        self.with(py, |e| e.is_finished(id))
    }

    fn take_output<'py>(&self, py: Python<'py>, id: u64) -> PyResult<Option<Bound<'py, PyDict>>> {
        let o = self.with(py, |e| e.take_output(id))?;
        o.map(|o| output_dict(py, o)).transpose()
    }

    /// Steps until all of `ids` are finished (each step with the GIL released) and returns their
    /// outputs in order. Between steps it runs Python's signal handlers: when one raises (Ctrl-C's
    /// `KeyboardInterrupt`), `ids` are cancelled and their outputs dropped, and the exception is
    /// raised within one step; the engine stays usable and other requests are untouched.
    fn run<'py>(&self, py: Python<'py>, ids: Vec<u64>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let outs = guarded("Engine.run", || {
            loop {
                // Done when every id has finished, or (as `run_to_completion`) when nothing is left to run.
                let done = py.detach(|| {
                    self.lock().map(|mut e| -> candle_gate::Result<bool> {
                        if ids.iter().all(|&id| e.is_finished(id)) {
                            return Ok(true);
                        }
                        Ok(e.step()? == 0 && !e.has_work())
                    })
                })?;
                if done.map_err(to_py)? {
                    break;
                }
                if let Err(interrupt) = py.check_signals() {
                    self.with(py, |e| {
                        for &id in &ids {
                            let _ = e.cancel(id); // an id already taken is not ours to report here
                            e.take_output(id);
                        }
                    })?;
                    return Err(interrupt);
                }
            }
            // What `run_to_completion` returns: every output, in order.
            py.detach(|| self.lock().map(|mut e| e.run_to_completion(&ids)))?.map_err(to_py)
        })?;
        outs.into_iter().map(|o| output_dict(py, o)).collect()
    }
}

/// Measures the kernel crossover (all CPU dtypes and shapes, or `quick`: the default model's)
/// and writes the profile JSON to `out`; returns the printed table. Progress goes to stderr.
#[pyfunction]
#[pyo3(signature = (quick = true, out = String::from("candle-gate-profile.json")))]
fn calibrate_kernels(py: Python<'_>, quick: bool, out: String) -> PyResult<String> {
    guarded("calibrate_kernels", || {
        py.detach(|| -> candle_gate::Result<String> {
            use candle_gate::profile::{format_table, measure, MeasureSpec};
            let spec = if quick { MeasureSpec::quick() } else { MeasureSpec::full() };
            let total = spec.dtypes.len() * spec.shapes.len() * spec.rows.len() * 4;
            let mut n = 0usize;
            let p = measure(&spec, |what| {
                n += 1;
                if n.is_multiple_of(20) || n == total {
                    eprint!("\rcalibrate: {n}/{total} (~) {what:<60}");
                }
            })?;
            eprintln!();
            // Keep a gate section already in the file.
            let mut p = p;
            if let Ok(old) = Profile::load(std::path::Path::new(&out)) {
                p.gate = old.gate;
                p.gates = old.gates;
            }
            p.save(std::path::Path::new(&out))?;
            Ok(format_table(&p))
        })
        .map_err(to_py)
    })
}

fn load_profiles(paths: &[String]) -> PyResult<Vec<Profile>> {
    paths.iter().map(|p| Profile::load(&PathBuf::from(p)).map_err(to_py)).collect()
}

/// `(tau, deep_tau, source)` an engine over `model` in `mode` would use (deep_tau None: tau ×
/// the default fraction; source: `"PATH (model/mode)"` of the calibration used), by the
/// engine's own rule (`GateConfig::resolve_values`). Without a model only the gate's name and
/// numbers are checked (tau comes back 0 where a calibration would give it).
#[pyfunction]
#[pyo3(signature = (gate, tau = None, deep_tau = None, profiles = Vec::new(), model = None, mode = None))]
fn resolve_gate(
    py: Python<'_>,
    gate: &str,
    tau: Option<f32>,
    deep_tau: Option<f32>,
    profiles: Vec<String>,
    model: Option<&Model>,
    mode: Option<&str>,
) -> PyResult<(f32, Option<f32>, Option<String>)> {
    guarded("resolve_gate", || {
        let gmode = GateMode::from_str(gate).map_err(to_py)?;
        let Some(model) = model else {
            let (t, d, _) = GateConfig::resolve_values(GateMode::Off, tau, deep_tau, &[], None).map_err(to_py)?;
            return Ok((t, d, None));
        };
        let loaded = load_profiles(&profiles)?;
        let list: Vec<(&Profile, &str)> = loaded.iter().zip(&profiles).map(|(p, s)| (p, s.as_str())).collect();
        let mode = mode.map(Mode::from_str).transpose().map_err(to_py)?.unwrap_or(model.inner.layout.mode());
        let lane = py.detach(|| calibration_lane(gmode, tau, list.len(), &model.inner, mode)).map_err(to_py)?;
        GateConfig::resolve_values(gmode, tau, deep_tau, &list, lane.as_ref().map(|(m, h)| (*m, h.as_str())))
            .map_err(to_py)
    })
}

/// Where known models are cached (`registry::cache_dir`: `CANDLE_GATE_CACHE`, else
/// `$XDG_CACHE_HOME/candle-gate`, else `~/.cache/candle-gate`).
#[pyfunction]
fn cache_dir() -> String {
    candle_gate::registry::cache_dir().to_string_lossy().into_owned()
}

/// Where `candle-gate calibrate` writes, and a gated engine looks first: the user's cache.
#[pyfunction]
fn user_profile_path() -> String {
    candle_gate::profile::user_profile_path().display().to_string()
}

/// Writes a gate calibration (a JSON object) under "gate" in the profile at `path`; returns
/// the whole profile as JSON text. The profile format is Rust's (`Profile::merge_gate`).
#[pyfunction]
fn merge_gate(py: Python<'_>, path: PathBuf, gate_json: &str) -> PyResult<String> {
    guarded("merge_gate", || {
        let gate: serde_json::Value =
            serde_json::from_str(gate_json).map_err(|e| PyValueError::new_err(format!("not JSON: {e}")))?;
        let prof = py.detach(|| Profile::merge_gate(&path, gate)).map_err(to_py)?;
        Ok(prof.to_string())
    })
}

/// What this host and build contribute to the bits in `mode` (hashed into fingerprints): the
/// compile target, plus the run-time dispatch of Candle's kernels for modes that use them.
#[pyfunction]
#[pyo3(signature = (mode = None))]
fn host_signature(mode: Option<&str>) -> PyResult<String> {
    Ok(candle_gate::host::signature(mode_or_default(mode)?))
}

/// `mode` by name, or the default mode.
fn mode_or_default(mode: Option<&str>) -> PyResult<Mode> {
    Ok(mode.map(Mode::from_str).transpose().map_err(to_py)?.unwrap_or(Mode::DEFAULT))
}

/// The CPU kernels' instruction-set tier in use (`portable`, `avx2`, `avx512`): every tier gives
/// the same bits, so it is not part of the host signature.
#[pyfunction]
fn kernel_tier() -> &'static str {
    candle_gate::kernels::isa().name()
}

/// The `system_fingerprint` an engine would report over a model file whose SHA-256 is
/// `model_sha256`, in `mode` without a profile, K/V stored as `kv_dtype`, its gate described as
/// `gate` (`GateConfig::describe`: "gate=off" when off), on this host and build: what `verify`
/// matches a record's fingerprint against to find the model and the settings it was served with.
/// The kernels' description is `Engine::describe_kernels`' (tests/test_verify.py checks the two
/// agree on a real engine).
#[pyfunction]
#[pyo3(signature = (model_sha256, mode = None, kv_dtype = None, gate = "gate=off"))]
fn system_fingerprint(model_sha256: &str, mode: Option<&str>, kv_dtype: Option<&str>, gate: &str) -> PyResult<String> {
    let mode = mode_or_default(mode)?;
    let kv = kv_dtype
        .map_or(Ok(EngineConfig::default().kv_dtype), candle_gate::decoder::KvDtype::from_str)
        .map_err(to_py)?;
    let kernels = format!("{};kv={}", Policy::new(mode).describe(), kv.name());
    Ok(candle_gate::model::system_fingerprint(model_sha256, &kernels, gate, &candle_gate::host::signature(mode)))
}

/// The weight layout `mode`'s kernels read fastest (what `Model.load(layout=)` takes).
#[pyfunction]
fn layout_for(mode: &str) -> PyResult<&'static str> {
    Ok(WeightLayout::for_mode(Mode::from_str(mode).map_err(to_py)?).name())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // NumPy's C API is imported on the first array made. Made here, at import, rather than in a
    // call whose Ctrl-C would make the import fail (rust-numpy panics then: "Failed to access
    // NumPy array API capsule: PyErr KeyboardInterrupt").
    let _ = numpy::PyArray1::<f32>::zeros(m.py(), 0, false);
    m.add("CandleGateError", m.py().get_type::<CandleGateError>())?;
    m.add("InvalidParameter", m.py().get_type::<InvalidParameter>())?;
    m.add("EngineShutDown", m.py().get_type::<EngineShutDown>())?;
    m.add("__version__", candle_gate::VERSION)?;
    m.add("CUDA_AVAILABLE", candle_gate::kernels::cuda::AVAILABLE)?;
    m.add("METAL_AVAILABLE", candle_gate::kernels::metal::AVAILABLE)?;
    // Rust owns the names; Python's MODES / GATES are these.
    m.add("MODES", candle_gate::Mode::ALL.map(|x| x.name()).to_vec())?;
    m.add("GATES", candle_gate::GateMode::ALL.map(|x| x.name()).to_vec())?;
    m.add("SPECULATIVE_METHODS", SpeculativeMethod::ALL.map(|x| x.name()).to_vec())?;
    m.add_function(wrap_pyfunction!(host_signature, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_tier, m)?)?;
    m.add_function(wrap_pyfunction!(system_fingerprint, m)?)?;
    let known = PyList::empty(m.py());
    let part = |w: &candle_gate::registry::WheelPart| -> PyResult<Bound<'_, PyDict>> {
        let p = PyDict::new(m.py());
        p.set_item("pip_spec", w.pip_spec)?;
        p.set_item("wheel_sha256", w.wheel_sha256)?;
        p.set_item("member", w.member)?;
        Ok(p)
    };
    for k in candle_gate::registry::KNOWN {
        let d = PyDict::new(m.py());
        d.set_item("name", k.name)?;
        let parts = PyList::empty(m.py());
        for w in k.parts {
            parts.append(part(w)?)?;
        }
        d.set_item("parts", parts)?;
        match &k.terms {
            Some(t) => {
                let td = PyDict::new(m.py());
                td.set_item("wheel", part(&t.wheel)?)?;
                td.set_item("files", t.files.to_vec())?;
                td.set_item("notice", t.notice)?;
                d.set_item("terms", td)?;
            }
            None => d.set_item("terms", m.py().None())?,
        }
        d.set_item("bytes", k.bytes)?;
        d.set_item("file_name", k.file_name)?;
        d.set_item("sha256", k.sha256)?;
        known.append(d)?;
    }
    m.add("KNOWN_MODELS", known)?;
    m.add("DEFAULT_MODEL", candle_gate::registry::DEFAULT_MODEL)?;
    m.add_function(wrap_pyfunction!(resolve_gate, m)?)?;
    m.add_function(wrap_pyfunction!(user_profile_path, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(check_chat, m)?)?;
    m.add_function(wrap_pyfunction!(merge_gate, m)?)?;
    m.add_class::<Model>()?;
    m.add_function(wrap_pyfunction!(calibrate_kernels, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<SamplingParams>()?;
    m.add("MAX_TOP_LOGPROBS", candle_gate::sampling::MAX_TOP_LOGPROBS)?;
    m.add("DEFAULT_MAX_NEW_TOKENS", candle_gate::SamplingParams::default().max_new_tokens)?;
    let d = EngineConfig::default();
    let defaults = PyDict::new(m.py());
    defaults.set_item("max_num_seqs", d.max_num_seqs)?;
    defaults.set_item("max_tokens_per_step", d.max_tokens_per_step)?;
    defaults.set_item("prefill_chunk", d.prefill_chunk)?;
    defaults.set_item("kv_budget_tokens", d.kv_budget_tokens)?;
    defaults.set_item("kv_dtype", d.kv_dtype.name())?;
    defaults.set_item("enable_prefix_caching", d.enable_prefix_caching)?;
    m.add("ENGINE_DEFAULTS", defaults)?;
    m.add("MAX_N", candle_gate::sampling::MAX_N)?;
    m.add("MAX_STOP", candle_gate::sampling::MAX_STOP)?;
    m.add("MAX_NEW_TOKENS_LIMIT", candle_gate::sampling::MAX_NEW_TOKENS_LIMIT)?;
    // {name: {"ge"|"gt": lo, "le"|"lt": hi}}: pydantic's words, so a schema field is
    // `Field(**SAMPLING_BOUNDS[name])`.
    let bounds = PyDict::new(m.py());
    for r in candle_gate::sampling::PARAM_RANGES {
        let b = PyDict::new(m.py());
        for (end, words) in [(r.min, ["ge", "gt"]), (r.max, ["le", "lt"])] {
            let Some(end) = end else { continue };
            let word = if end.inclusive { words[0] } else { words[1] };
            match r.integer {
                true => b.set_item(word, end.value as i64)?,
                false => b.set_item(word, end.value)?,
            }
        }
        bounds.set_item(r.name, b)?;
    }
    m.add("SAMPLING_BOUNDS", bounds)?;
    m.add("FINISH_REASONS", candle_gate::engine::FinishReason::ALL.map(|r| r.name()).to_vec())?;
    m.add("GATE_COUNTERS", candle_gate::engine::GateStats::KEYS.to_vec())?;
    m.add("DEFAULT_MODE", candle_gate::Mode::DEFAULT.name())?;
    m.add("LAYOUTS", WeightLayout::ALL.map(|l| l.name()).to_vec())?;
    m.add("KV_DTYPES", candle_gate::decoder::KvDtype::ALL.map(|d| d.name()).to_vec())?;
    m.add_function(wrap_pyfunction!(layout_for, m)?)?;
    testing::register(m)?; // _native._testing: test scaffolding
    Ok(())
}
