//! The reference lane: one decode step of one sequence in FP32 with exactly dequantized
//! weights and a fixed reduction order that depends on nothing but that row and its own cache.
//! The gate trusts its argmax over the fast lane's and writes its K/V in place of the fast
//! lane's.

use candle_core::{Storage, Tensor};
use rayon::prelude::*;

use crate::dispatch::{Lane, QMatMul};
use crate::error::{Error, Result};
use crate::ops::{dot, dot4};

/// Output rows dequantized at a time when no dense copy is kept: 64 rows of k=4096 is 1 MiB.
const ROWS_PER_BLOCK: usize = 64;

/// Whether the reference lane keeps dense FP32 copies of the weights (fast) or dequantizes
/// block by block on every step (no extra memory: what a 7B model on a small machine needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceWeights {
    Dense,
    Blockwise,
}

impl ReferenceWeights {
    /// Dense when the FP32 copy fits the budget, else blockwise.
    /// `dense_bytes`: what the FP32 copy of every linear layer takes
    /// ([`crate::decoder::Decoder::dense_f32_bytes`]).
    pub fn for_budget(dense_bytes: usize, max_dense_bytes: usize) -> Self {
        if dense_bytes <= max_dense_bytes {
            ReferenceWeights::Dense
        } else {
            ReferenceWeights::Blockwise
        }
    }
}

fn tensor_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (st, layout) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(c) => {
            let s = c.as_slice::<f32>()?;
            let o = layout.start_offset();
            Ok(f(&s[o..o + layout.shape().elem_count()]))
        }
        _ => Err(Error::Unsupported("the reference lane runs on the CPU".into())),
    }
}

/// `y = W x` for `m` rows (`xs` row-major, `m × k`; returns `m × n`) with dequantized weights.
/// Every output is one 8-lane [`dot`] of a weight row and an input row, so a row's result does
/// not depend on `m`: rebuilding many positions in one call reads the weights once and gives
/// the same bits as one position at a time.
pub fn matmul_rows(w: &QMatMul, how: ReferenceWeights, xs: &[f32], m: usize) -> Result<Vec<f32>> {
    let (n, k) = w.dims();
    if xs.len() != m * k {
        return Err(Error::BadInput(format!("reference matmul: input {} != {m} x k {k}", xs.len())));
    }
    // Output-major blocks, so each block of weight rows is read (or dequantized) once for all m.
    let mut yt = vec![0f32; n * m];
    // ys[i * m + r] = dot(weight row i, input row r), four pairs at a time through `dot4`.
    let block = |ys: &mut [f32], wd: &[f32]| {
        let pair = |p: usize| (&wd[(p / m) * k..(p / m + 1) * k], &xs[(p % m) * k..(p % m + 1) * k]);
        let full = ys.len() - ys.len() % 4;
        for p in (0..full).step_by(4) {
            let (w0, x0) = pair(p);
            let (w1, x1) = pair(p + 1);
            let (w2, x2) = pair(p + 2);
            let (w3, x3) = pair(p + 3);
            ys[p..p + 4].copy_from_slice(&dot4([w0, w1, w2, w3], [x0, x1, x2, x3]));
        }
        for p in full..ys.len() {
            let (w, x) = pair(p);
            ys[p] = dot(w, x);
        }
    };
    match how {
        ReferenceWeights::Dense => {
            let dense = w.dense_f32()?;
            tensor_slice(dense, |wd| {
                yt.par_chunks_mut(ROWS_PER_BLOCK * m).enumerate().for_each(|(b, ys)| {
                    let r0 = b * ROWS_PER_BLOCK;
                    block(ys, &wd[r0 * k..(r0 + ys.len() / m) * k]);
                })
            })?;
        }
        ReferenceWeights::Blockwise => {
            yt.par_chunks_mut(ROWS_PER_BLOCK * m).enumerate().try_for_each(|(b, ys)| -> Result<()> {
                let r0 = b * ROWS_PER_BLOCK;
                let wd = w.dequantize_rows(r0..r0 + ys.len() / m)?;
                block(ys, &wd);
                Ok(())
            })?;
        }
    }
    if m == 1 {
        return Ok(yt);
    }
    let mut y = vec![0f32; m * n];
    for j in 0..n {
        for r in 0..m {
            y[r * n + j] = yt[j * m + r];
        }
    }
    Ok(y)
}

/// The reference lane: every linear layer through [`matmul_rows`].
impl Lane for ReferenceWeights {
    fn matmul_into(&self, w: &QMatMul, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()> {
        *out = matmul_rows(w, *self, x, m)?;
        Ok(())
    }
}
