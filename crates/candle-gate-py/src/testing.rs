//! `candle_gate._native._testing`: scaffolding for the Python property tests, kept out of the
//! binding's API. Nothing outside `tests/` should import it.

use std::sync::Arc;

use candle_gate::dispatch::Kernel;
use candle_gate::Policy;
use numpy::IntoPyArray;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use candle_gate::sampling::{self, DrawKey};

use crate::{guarded, to_py, CandleGateError, SamplingParams};

/// Deterministic inputs for property tests without seeding Candle's RNG (the CPU device has
/// no seed): xorshift64*.
fn xorshift(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545F4914F6CDD1D) >> 40) as f32 / (1u64 << 24) as f32;
            (u - 0.5) * 4.0
        })
        .collect()
}

/// Quantizes a random `[n, k]` weight to `dtype` and runs every CPU kernel on `m` random rows;
/// returns `{kernel: flat outputs}` (for property tests from Python).
#[pyfunction]
fn kernel_outputs<'py>(
    py: Python<'py>,
    dtype: &str,
    n: usize,
    k: usize,
    m: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    use candle_core::{quantized::QTensor, Device, Tensor};
    let outs = guarded("kernel_outputs", || {
        let d = candle_gate::dispatch::dtype_from_name(dtype).map_err(to_py)?;
        if n == 0 || k == 0 {
            return Err(PyValueError::new_err("n and k must be positive"));
        }
        if !k.is_multiple_of(d.block_size()) {
            return Err(PyValueError::new_err(format!(
                "k={k} is not a multiple of the {dtype} block size {}",
                d.block_size()
            )));
        }
        let dev = Device::Cpu;
        let r = || -> candle_core::Result<(QTensor, Vec<f32>)> {
            let w = Tensor::from_vec(xorshift(n * k, seed), (n, k), &dev)?;
            let x = xorshift(m.max(1) * k, seed ^ 0xABCDEF);
            Ok((QTensor::quantize(&w, d)?, x))
        };
        let (q, x) = r().map_err(|e| CandleGateError::new_err(e.to_string()))?;
        let g = candle_gate::QMatMul::new(Arc::new(q), Arc::new(Policy::default())).map_err(to_py)?;
        let x = &x[..m * k];
        let mut outs = vec![];
        for kern in [Kernel::GemvRowSplit, Kernel::Invariant, Kernel::Gemm, Kernel::SplitKF16, Kernel::Candle] {
            outs.push((kern.name(), g.run_cpu(kern, x, m).map_err(to_py)?));
        }
        Ok(outs)
    })?;
    let d = PyDict::new(py);
    for (name, v) in outs {
        d.set_item(name, v.into_pyarray(py))?;
    }
    Ok(d)
}

/// The sampler's decision for one step: `(token, margin)`.
#[pyfunction]
#[pyo3(signature = (logits, params, seed, index = 0, position = 0, prompt = Vec::new(), output = Vec::new()))]
fn decide(
    logits: Vec<f32>,
    params: &SamplingParams,
    seed: u64,
    index: u32,
    position: u32,
    prompt: Vec<u32>,
    output: Vec<u32>,
) -> PyResult<(u32, f32)> {
    guarded("decide", || {
        let key = DrawKey { seed, index, position };
        let d = sampling::decide(&params.inner, key, &prompt, &output, &logits);
        Ok((d.token, d.margin))
    })
}

/// The tokens drawn for `logits` with seeds `seed0 .. seed0 + draws` (position 0, choice 0).
#[pyfunction]
fn sample_tokens<'py>(
    py: Python<'py>,
    logits: Vec<f32>,
    params: &SamplingParams,
    seed0: u64,
    draws: usize,
) -> PyResult<Bound<'py, numpy::PyArray1<u32>>> {
    use rayon::prelude::*;
    let toks = guarded("sample_tokens", || {
        Ok(py.detach(|| {
            (0..draws as u64)
                .into_par_iter()
                .map(|d| {
                    let key = DrawKey { seed: seed0.wrapping_add(d), index: 0, position: 0 };
                    sampling::decide(&params.inner, key, &[], &[], &logits).token
                })
                .collect::<Vec<u32>>()
        }))
    })?;
    Ok(toks.into_pyarray(py))
}

/// The candidate set the filters leave, token ids in increasing order.
#[pyfunction]
fn candidates(logits: Vec<f32>, params: &SamplingParams) -> PyResult<Vec<u32>> {
    guarded("candidates", || Ok(sampling::candidates(&params.inner, &logits)))
}

/// Adds the `_testing` submodule to `parent` (also importable as `candle_gate._native._testing`).
pub(crate) fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = parent.py();
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(kernel_outputs, &m)?)?;
    m.add_function(wrap_pyfunction!(decide, &m)?)?;
    m.add_function(wrap_pyfunction!(sample_tokens, &m)?)?;
    m.add_function(wrap_pyfunction!(candidates, &m)?)?;
    parent.add_submodule(&m)?;
    py.import("sys")?.getattr("modules")?.set_item("candle_gate._native._testing", &m)?;
    Ok(())
}
