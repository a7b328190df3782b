//! The canonical reduction order: one order per dtype that a CUDA warp computes natively and
//! any CPU reproduces bit for bit, so a GPU's result can be checked on a laptop.
//!
//! For one output (one weight row against one activation row):
//! - the activation row is quantized in units of 32 values: `d = amax / 127`,
//!   `q = rint(x * (1 / d))` (ties to even, clamped to ±127), `d = 0` for an all-zero unit;
//! - the weight row is read in the same units of 32 (a K-quant superblock is 8 units), each
//!   giving exact integer dot products and one or two f32 coefficients ([`Unit`]);
//! - unit `u` belongs to lane `u % 32`; each lane accumulates its units in increasing `u` with
//!   fused multiply-adds, `acc = fma(coef * d, int as f32, acc)`, the product `coef * d` rounded
//!   on its own first ([`Unit::accumulate`]);
//! - the 32 lane sums are combined by an xor butterfly over offsets 16, 8, 4, 2, 1
//!   ([`butterfly`]), which is what `__shfl_xor_sync` computes in a warp.
//!
//! F32 and F16 weights are not quantized: element `e` belongs to lane `e % 32`,
//! `acc = fma(w, x, acc)`, then the same butterfly (the reference lane's order on a GPU).
//!
//! Every step is an IEEE operation with one rounding (or none: integer sums, f16 → f32), so the
//! order fixes the bits on any device that follows it. `cuda/canonical.cu` is the GPU side;
//! [`matmul`] is the CPU kernel and [`emulate_warp`] runs the GPU kernel's per-thread loop lane
//! by lane: the tests hold all three equal.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use super::{parallel_for, OutPtr};
use crate::error::{Error, Result};

/// Lanes of a warp: the accumulators each output is spread over.
pub const LANES: usize = 32;
/// Values per unit: the activation quantization block and a lane's step through the weights.
pub const UNIT: usize = 32;
/// The xor offsets of the final butterfly, in order.
pub const BUTTERFLY: [usize; 5] = [16, 8, 4, 2, 1];

/// The weight dtypes with a canonical order (those of the models in the registry, plus Q4_0
/// and the dense types).
pub const SUPPORTED: [GgmlDType; 8] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// Activation rows quantized in units of [`UNIT`]: `q` row-major `[m, k]`, `d` `[m, k / 32]`.
pub struct QuantizedRows {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub k: usize,
}

impl QuantizedRows {
    /// The 32 quantized values and the scale of unit `u` of row `r`.
    #[inline]
    pub fn unit(&self, r: usize, u: usize) -> (&[i8], f32) {
        let units = self.k / UNIT;
        let q = &self.q[r * self.k + u * UNIT..][..UNIT];
        (q, self.d[r * units + u])
    }
}

/// Quantizes `m` rows of `k` (`k % 32 == 0`) the canonical way (see the module docs).
pub fn quantize_rows(x: &[f32], m: usize, k: usize) -> QuantizedRows {
    debug_assert_eq!(k % UNIT, 0);
    debug_assert_eq!(x.len(), m * k);
    let mut q = vec![0i8; m * k];
    let mut d = vec![0f32; m * k / UNIT];
    for ((xs, qs), du) in x.chunks_exact(UNIT).zip(q.chunks_exact_mut(UNIT)).zip(d.iter_mut()) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        *du = scale;
    }
    QuantizedRows { q, d, k }
}

/// One unit of 32 weights, decoded: `w` the integer weights, `scale_lo`/`scale_hi` integer
/// multipliers of the dot products over values 0..16 and 16..32, `coef` the block's f32 scale,
/// and `min` the (coefficient, integer multiplier) of the activations' sum for dtypes with an
/// offset (Q4_1's `m`, Q4_K's `-dmin · min`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unit {
    pub w: [i8; UNIT],
    pub scale_lo: i32,
    pub scale_hi: i32,
    pub coef: f32,
    pub min: Option<(f32, i32)>,
}

impl Unit {
    /// Adds this unit's contribution against activations `q` with scale `d` to `acc`: the one
    /// place the float operations of the order are written on the CPU.
    #[inline(always)]
    pub fn accumulate(&self, q: &[i8], d: f32, acc: f32) -> f32 {
        let (mut lo, mut hi, mut sum) = (0i32, 0i32, 0i32);
        for i in 0..UNIT / 2 {
            lo += self.w[i] as i32 * q[i] as i32;
            sum += q[i] as i32;
        }
        for i in UNIT / 2..UNIT {
            hi += self.w[i] as i32 * q[i] as i32;
            sum += q[i] as i32;
        }
        let c = self.scale_lo * lo + self.scale_hi * hi;
        let acc = (self.coef * d).mul_add(c as f32, acc);
        match self.min {
            Some((coef, mult)) => (coef * d).mul_add((mult * sum) as f32, acc),
            None => acc,
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Bytes per unit-block of a dtype and units per block.
fn block_layout(dtype: GgmlDType) -> (usize, usize) {
    match dtype {
        GgmlDType::Q4_0 => (18, 1),
        GgmlDType::Q4_1 => (20, 1),
        GgmlDType::Q5_0 => (22, 1),
        GgmlDType::Q8_0 => (34, 1),
        GgmlDType::Q4K => (144, 8),
        GgmlDType::Q6K => (210, 8),
        _ => unreachable!("{dtype:?} has no units"),
    }
}

/// Bytes per weight row of `k` values.
pub fn row_bytes(dtype: GgmlDType, k: usize) -> usize {
    match dtype {
        GgmlDType::F32 => 4 * k,
        GgmlDType::F16 => 2 * k,
        _ => {
            let (bytes, units) = block_layout(dtype);
            k / (UNIT * units) * bytes
        }
    }
}

/// Q4_K's 6-bit scale and min of sub-block `j` (llama.cpp's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)) as i32, ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32)
    }
}

/// Decodes unit `u` of one weight row (`row`: that row's bytes).
pub fn unit(dtype: GgmlDType, row: &[u8], u: usize) -> Unit {
    let (bytes, per_block) = block_layout(dtype);
    let b = &row[(u / per_block) * bytes..][..bytes];
    let mut w = [0i8; UNIT];
    let plain = |w: [i8; UNIT], coef: f32, min: Option<(f32, i32)>| Unit { w, scale_lo: 1, scale_hi: 1, coef, min };
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => {
            let (qs, offset) = if dtype == GgmlDType::Q4_0 { (&b[2..18], 8) } else { (&b[4..20], 0) };
            for j in 0..16 {
                w[j] = (qs[j] & 0xF) as i8 - offset;
                w[j + 16] = (qs[j] >> 4) as i8 - offset;
            }
            let min = (dtype == GgmlDType::Q4_1).then(|| (f16_at(b, 2), 1));
            plain(w, f16_at(b, 0), min)
        }
        GgmlDType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                w[j] = ((qs[j] & 0xF) | (((qh >> j) & 1) << 4) as u8) as i8 - 16;
                w[j + 16] = ((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8) as i8 - 16;
            }
            plain(w, f16_at(b, 0), None)
        }
        GgmlDType::Q8_0 => {
            for (o, v) in w.iter_mut().zip(&b[2..34]) {
                *o = *v as i8;
            }
            plain(w, f16_at(b, 0), None)
        }
        GgmlDType::Q4K => {
            let j = u % 8;
            let (sc, mn) = scale_min_k4(j, &b[4..16]);
            let qs = &b[16 + 32 * (j / 2)..][..32];
            let shift = 4 * (j % 2);
            for (o, v) in w.iter_mut().zip(qs) {
                *o = ((v >> shift) & 0xF) as i8;
            }
            Unit { w, scale_lo: sc, scale_hi: sc, coef: f16_at(b, 0), min: Some((-f16_at(b, 2), mn)) }
        }
        GgmlDType::Q6K => {
            let j = u % 8;
            let (h, t) = (j / 4, j % 4);
            let ql = &b[64 * h + 32 * (t % 2)..][..32];
            let qh = &b[128 + 32 * h..][..32];
            let shift = 4 * (t / 2);
            for l in 0..UNIT {
                w[l] = (((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * t)) & 3) << 4)) as i8 - 32;
            }
            let sc = &b[192..208];
            Unit {
                w,
                scale_lo: sc[8 * h + 2 * t] as i8 as i32,
                scale_hi: sc[8 * h + 2 * t + 1] as i8 as i32,
                coef: f16_at(b, 208),
                min: None,
            }
        }
        _ => unreachable!("{dtype:?} has no units"),
    }
}

/// The xor butterfly over the 32 lane sums, as a warp's `__shfl_xor_sync` reduction runs it;
/// every lane ends with the same sum (addition commutes), lane 0's is returned.
#[inline]
pub fn butterfly(mut v: [f32; LANES]) -> f32 {
    for off in BUTTERFLY {
        let prev = v;
        for (l, o) in v.iter_mut().enumerate() {
            *o = prev[l] + prev[l ^ off];
        }
    }
    v[0]
}

/// The weight as raw bytes plus its shape, checked against `x`.
fn prepare<'w>(w: &'w QTensor, x: &[f32], m: usize) -> Result<(std::borrow::Cow<'w, [u8]>, usize, usize)> {
    let dtype = w.dtype();
    if !SUPPORTED.contains(&dtype) {
        return Err(Error::Unsupported(format!(
            "GGML dtype {dtype:?} has no canonical-order kernel (it has: {})",
            SUPPORTED.map(super::dtype_name).join(", ")
        )));
    }
    let dims = w.shape().dims();
    let (n, k) = (dims[0], dims[1]);
    if x.len() != m * k {
        return Err(Error::BadInput(format!("input has {} values, expected {m} rows of {k}", x.len())));
    }
    if dtype != GgmlDType::F32 && dtype != GgmlDType::F16 && k % UNIT != 0 {
        return Err(Error::BadInput(format!("k = {k} is not a multiple of {UNIT}")));
    }
    Ok((w.data()?, n, k))
}

fn dense_value(dtype: GgmlDType, row: &[u8], e: usize) -> f32 {
    match dtype {
        GgmlDType::F32 => f32::from_le_bytes([row[4 * e], row[4 * e + 1], row[4 * e + 2], row[4 * e + 3]]),
        _ => f16_at(row, 2 * e),
    }
}

/// Outputs per parallel task of [`matmul`].
const COLUMNS_PER_TASK: usize = 16;

/// The canonical order on the CPU: `m` rows of `x` against `w` (`[n, k]`), `m` rows of `n` out.
/// It walks each weight row once, unit by unit, adding unit `u` into lane `u % 32` of every
/// row's accumulators, then folds the lanes: the order of [`emulate_warp`] with the loops
/// turned inside out.
pub fn matmul(w: &QTensor, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let (bytes, n, k) = prepare(w, x, m)?;
    let dtype = w.dtype();
    let rb = row_bytes(dtype, k);
    let mut out = vec![0f32; m * n];
    let out_ptr = OutPtr(out.as_mut_ptr());
    let dense = matches!(dtype, GgmlDType::F32 | GgmlDType::F16);
    let qa = (!dense).then(|| quantize_rows(x, m, k));
    let tasks = n.div_ceil(COLUMNS_PER_TASK);
    parallel_for(tasks, |t| {
        let op = out_ptr;
        let mut acc = vec![[0f32; LANES]; m];
        for col in t * COLUMNS_PER_TASK..((t + 1) * COLUMNS_PER_TASK).min(n) {
            let row = &bytes[col * rb..][..rb];
            acc.iter_mut().for_each(|a| *a = [0.0; LANES]);
            match &qa {
                None => {
                    for e in 0..k {
                        let wv = dense_value(dtype, row, e);
                        for (r, a) in acc.iter_mut().enumerate() {
                            a[e % LANES] = wv.mul_add(x[r * k + e], a[e % LANES]);
                        }
                    }
                }
                Some(qa) => {
                    for u in 0..k / UNIT {
                        let un = unit(dtype, row, u);
                        for (r, a) in acc.iter_mut().enumerate() {
                            let (q, d) = qa.unit(r, u);
                            a[u % LANES] = un.accumulate(q, d, a[u % LANES]);
                        }
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                // SAFETY: each task writes only its own columns of `out`, which outlives the loop.
                unsafe { *op.0.add(r * n + col) = butterfly(*a) };
            }
        }
    });
    Ok(out)
}

/// The GPU kernel's per-thread loop run lane by lane: lane `l` walks units `l, l + 32, …` of
/// its output (elements, for dense weights) with one accumulator, then the warp's butterfly.
/// Slow (it decodes every unit once per row); the tests use it as the oracle both [`matmul`]
/// and the CUDA kernel must equal.
pub fn emulate_warp(w: &QTensor, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let (bytes, n, k) = prepare(w, x, m)?;
    let dtype = w.dtype();
    let rb = row_bytes(dtype, k);
    let dense = matches!(dtype, GgmlDType::F32 | GgmlDType::F16);
    let qa = (!dense).then(|| quantize_rows(x, m, k));
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for col in 0..n {
            let row = &bytes[col * rb..][..rb];
            let lane_sum = |lane: usize| -> f32 {
                let mut acc = 0f32;
                match &qa {
                    None => {
                        for e in (lane..k).step_by(LANES) {
                            acc = dense_value(dtype, row, e).mul_add(x[r * k + e], acc);
                        }
                    }
                    Some(qa) => {
                        for u in (lane..k / UNIT).step_by(LANES) {
                            let (q, d) = qa.unit(r, u);
                            acc = unit(dtype, row, u).accumulate(q, d, acc);
                        }
                    }
                }
                acc
            };
            out[r * n + col] = butterfly(std::array::from_fn(lane_sum));
        }
    }
    Ok(out)
}

/// One real weight per (dtype, shape) of a GGUF's matrices, each cut to its first `max_rows`
/// output rows: what the differential tests and the GPU check run the kernels on.
pub fn sample_weights(path: &std::path::Path, max_rows: usize) -> Result<Vec<(String, QTensor)>> {
    use candle_core::quantized::QStorage;
    let mut file = crate::gguf::GgufFile::open(path)?;
    let mut names: Vec<(String, GgmlDType, Vec<usize>)> = file
        .content
        .tensor_infos
        .iter()
        .filter(|(_, info)| info.shape.rank() == 2 && SUPPORTED.contains(&info.ggml_dtype))
        .map(|(name, info)| (name.clone(), info.ggml_dtype, info.shape.dims().to_vec()))
        .collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for (name, dtype, dims) in names {
        if !seen.insert((super::dtype_name(dtype), dims.clone())) {
            continue;
        }
        let t = file.tensor(&name)?;
        let (n, k) = (dims[0], dims[1]);
        let t = if n > max_rows {
            let bytes = t.data()?;
            let head = bytes[..max_rows * row_bytes(dtype, k)].to_vec();
            let storage = QStorage::from_data(std::borrow::Cow::Owned(head), &candle_core::Device::Cpu, dtype)?;
            QTensor::new(storage, (max_rows, k))?
        } else {
            t
        };
        out.push((name, t));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn weights(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
        let mut s = seed;
        let vals: Vec<f32> = (0..n * k)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.2
            })
            .collect();
        let t = Tensor::from_vec(vals, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    }

    #[test]
    fn units_decode_to_candles_dequantization() {
        // Each unit's integers times its coefficients must give Candle's dequantized weights
        // (to f32 rounding), or the order would be exact about the wrong numbers.
        for dtype in SUPPORTED.into_iter().filter(|d| !matches!(d, GgmlDType::F32 | GgmlDType::F16)) {
            let (n, k) = (3, 512);
            let w = weights(dtype, n, k, 7);
            let dense = w.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bytes = w.data().unwrap();
            let rb = row_bytes(dtype, k);
            for col in 0..n {
                for u in 0..k / UNIT {
                    let un = unit(dtype, &bytes[col * rb..][..rb], u);
                    for i in 0..UNIT {
                        let s = if i < 16 { un.scale_lo } else { un.scale_hi };
                        let mut v = un.coef * (s * un.w[i] as i32) as f32;
                        if let Some((c, mult)) = un.min {
                            v += c * mult as f32;
                        }
                        let want = dense[col * k + u * UNIT + i];
                        assert!(
                            (v - want).abs() <= 1e-6 + want.abs() * 1e-5,
                            "{dtype:?} col {col} unit {u} value {i}: {v} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantization_rounds_ties_to_even_and_keeps_zero_units() {
        let mut x = vec![0f32; 64];
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = 1.5;
        x[3] = -2.5;
        let qa = quantize_rows(&x, 1, 64);
        assert_eq!(&qa.q[..4], &[127, 0, 2, -2]);
        assert_eq!(qa.d, vec![1.0, 0.0]);
        assert!(qa.q[32..].iter().all(|&v| v == 0));
    }
}
