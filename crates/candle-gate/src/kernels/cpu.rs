//! CPU kernels for quantized `y = x · Wᵀ` (W is `[n, k]`, x is `[m, k]`).
//!
//! * `gemv`: one row. The row is quantized to the weight type's dot-product type and every
//!   output element is one call of Candle's block dot product, grouped in column quads exactly
//!   as Candle's own CPU matmul groups them (`vec_dot_4`, then `vec_dot_2` / `vec_dot` for the
//!   0..=3 leftover columns).
//! * `invariant`: many rows, same per-element arithmetic as `gemv`, but a weight quad is loaded
//!   once and used for a tile of rows while it is hot in L1. Work is split across threads by
//!   output element, never across the reduction, so the bits do not depend on the row count or
//!   on the thread count.
//! * `gemm`: dequantized weights (cached) through Candle's dense matmul. Fast for long prefills,
//!   but its reduction order is the dense GEMM's, so its bits differ from `gemv`.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
    BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor, QuantizedType};
use half::f16;

use super::OutPtr;
use crate::error::{Error, Result};

/// Rows that share one pass over a weight quad. 16 quantized Q8 rows of k=4096 are ~70 KiB,
/// so a tile of activations plus one weight quad stays within L2.
const ROW_TILE: usize = 16;
/// Column quads handed to a worker at once: big enough to amortize scheduling, small enough
/// that two cores get balanced work on a 192-column matrix.
const QUADS_PER_TASK: usize = 8;

/// The GGML dtypes the CPU kernels handle. Q8_1 is only ever a dot-product type in GGUF files.
pub const SUPPORTED: [GgmlDType; 13] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
    GgmlDType::Q8K,
];

fn blocks_of<T>(bytes: &[u8]) -> Result<&[T]> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Error::Unsupported(format!(
            "weight storage of {} bytes is not a whole, aligned array of {size}-byte blocks",
            bytes.len()
        )));
    }
    // SAFETY: size and alignment checked above; the block types are plain `repr(C)` data
    // (floats and bytes) for which every bit pattern is valid, and the bytes are Candle's own
    // CPU storage of exactly that block type.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) })
}

fn quantize_rows<T: GgmlType>(x: &[f32], m: usize, k: usize) -> Vec<T::VecDotType>
where
    T::VecDotType: 'static,
{
    use super::quantize;
    let kb = k / T::BLCK_SIZE;
    let mut q = vec![T::VecDotType::zeros(); m * kb];
    let row = |src: &[f32], dst: &mut [T::VecDotType]| {
        if T::DIRECT_COPY {
            T::VecDotType::direct_copy(src, dst)
        } else if let Some(d) = cast_mut::<_, BlockQ8_0>(dst) {
            quantize::q8_0(src, d)
        } else if let Some(d) = cast_mut::<_, BlockQ8_1>(dst) {
            quantize::q8_1(src, d)
        } else if let Some(d) = cast_mut::<_, BlockQ8K>(dst) {
            quantize::q8k(src, d)
        } else {
            T::VecDotType::from_float(src, dst)
        }
    };
    // Rows are independent: a prefill's many rows are quantized in parallel, bits unchanged
    // (below some 64K values, waking a second worker costs more than it saves).
    if m >= 2 && m * k >= 1 << 16 && kb > 0 {
        use rayon::prelude::*;
        q.par_chunks_mut(kb).zip(x.par_chunks(k)).for_each(|(dst, src)| row(src, dst));
    } else {
        for r in 0..m {
            row(&x[r * k..(r + 1) * k], &mut q[r * kb..(r + 1) * kb]);
        }
    }
    q
}

/// [`cast`] for a mutable slice.
fn cast_mut<A: 'static, B: 'static>(s: &mut [A]) -> Option<&mut [B]> {
    if std::any::TypeId::of::<A>() == std::any::TypeId::of::<B>() {
        // SAFETY: A and B are the same type.
        Some(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut B, s.len()) })
    } else {
        None
    }
}

/// `Some(slice)` when `A` is `B` (a type-level dispatch that keeps the kernels generic).
fn cast<A: 'static, B: 'static>(s: &[A]) -> Option<&[B]> {
    if std::any::TypeId::of::<A>() == std::any::TypeId::of::<B>() {
        // SAFETY: A and B are the same type.
        Some(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const B, s.len()) })
    } else {
        None
    }
}

/// The shared core of `gemv` and `invariant`: rows `0..m` of `x` against all `n` columns.
/// Each output element is computed by exactly one `vec_dot_4`/`vec_dot_2`/`vec_dot` call over
/// the full k, independent of `m`, of the tile it falls in and of the thread that runs it.
fn quad_matmul<T: GgmlType + 'static>(w: &[T], x: &[f32], m: usize, k: usize, n: usize, out: &mut [f32])
where
    T::VecDotType: 'static,
{
    let kb = k / T::BLCK_SIZE;
    let xq = quantize_rows::<T>(x, m, k);
    let xq = &xq[..];
    if let (Some(w), Some(xq)) = (cast::<T, BlockQ4_1>(w), cast::<T::VecDotType, BlockQ8_1>(xq)) {
        return super::cpu_q32::matmul_q4_1(w, xq, m, k, n, out);
    }
    if let (Some(w), Some(xq)) = (cast::<T, BlockQ5_0>(w), cast::<T::VecDotType, BlockQ8_0>(xq)) {
        return super::cpu_q32::matmul_q5_0(w, xq, m, k, n, out);
    }
    if let (Some(w), Some(xq)) = (cast::<T, BlockQ4K>(w), cast::<T::VecDotType, BlockQ8K>(xq)) {
        return super::cpu_kquant::matmul_q4k(w, xq, m, k, n, out);
    }
    if let (Some(w), Some(xq)) = (cast::<T, BlockQ6K>(w), cast::<T::VecDotType, BlockQ8K>(xq)) {
        return super::cpu_kquant::matmul_q6k(w, xq, m, k, n, out);
    }
    if let (Some(w), Some(xq)) = (cast::<T, BlockQ8_0>(w), cast::<T::VecDotType, BlockQ8_0>(xq)) {
        if super::cpu_q8_0::matmul(w, xq, m, k, n, out) {
            return;
        }
    }
    let row = |r: usize| &xq[r * kb..(r + 1) * kb];
    let col = |c: usize| &w[c * kb..(c + 1) * kb];
    let n_quad = n & !3;
    let quads = n_quad / 4;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let tasks = quads.div_ceil(QUADS_PER_TASK);
    let row_tiles = m.div_ceil(ROW_TILE);
    let run = |task: usize| {
        let op = out_ptr;
        let tile = task / tasks.max(1);
        let qt = task % tasks.max(1);
        let r0 = tile * ROW_TILE;
        let r1 = m.min(r0 + ROW_TILE);
        for q in qt * QUADS_PER_TASK..quads.min((qt + 1) * QUADS_PER_TASK) {
            let c = q * 4;
            let (w0, w1, w2, w3) = (col(c), col(c + 1), col(c + 2), col(c + 3));
            for r in r0..r1 {
                let (d0, d1, d2, d3) = T::vec_dot_4(k, w0, w1, w2, w3, row(r));
                // SAFETY: (r, c..c+4) belongs to this task alone.
                unsafe {
                    let p = op.0.add(r * n + c);
                    *p = d0;
                    *p.add(1) = d1;
                    *p.add(2) = d2;
                    *p.add(3) = d3;
                }
            }
        }
    };
    let total = row_tiles * tasks;
    super::parallel_for(total, run);
    let tail = n - n_quad;
    if tail > 0 {
        for r in 0..m {
            let o = &mut out[r * n + n_quad..(r + 1) * n];
            if tail >= 2 {
                let (d0, d1) = T::vec_dot_2(k, col(n_quad), col(n_quad + 1), row(r));
                o[0] = d0;
                o[1] = d1;
            }
            if tail & 1 == 1 {
                o[tail - 1] = T::vec_dot(k, col(n - 1), row(r));
            }
        }
    }
}

macro_rules! with_block_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            GgmlDType::F32 => {
                type $T = f32;
                $body
            }
            GgmlDType::F16 => {
                type $T = f16;
                $body
            }
            GgmlDType::Q4_0 => {
                type $T = BlockQ4_0;
                $body
            }
            GgmlDType::Q4_1 => {
                type $T = BlockQ4_1;
                $body
            }
            GgmlDType::Q5_0 => {
                type $T = BlockQ5_0;
                $body
            }
            GgmlDType::Q5_1 => {
                type $T = BlockQ5_1;
                $body
            }
            GgmlDType::Q8_0 => {
                type $T = BlockQ8_0;
                $body
            }
            GgmlDType::Q2K => {
                type $T = BlockQ2K;
                $body
            }
            GgmlDType::Q3K => {
                type $T = BlockQ3K;
                $body
            }
            GgmlDType::Q4K => {
                type $T = BlockQ4K;
                $body
            }
            GgmlDType::Q5K => {
                type $T = BlockQ5K;
                $body
            }
            GgmlDType::Q6K => {
                type $T = BlockQ6K;
                $body
            }
            GgmlDType::Q8K => {
                type $T = BlockQ8K;
                $body
            }
            other => return Err(Error::Unsupported(format!("GGML dtype {other:?} has no CPU kernel in candle-gate"))),
        }
    };
}

/// Checks shared by every kernel: the weight is `[n, k]` on the CPU with a supported dtype and
/// `x` holds `m` whole rows of `k`.
pub(crate) fn check(w: &QTensor, x: &[f32], m: usize) -> Result<(usize, usize)> {
    let (n, k) = w.shape().dims2()?;
    if !SUPPORTED.contains(&w.dtype()) {
        return Err(Error::Unsupported(format!("GGML dtype {:?} has no CPU kernel in candle-gate", w.dtype())));
    }
    if m == 0 {
        return Err(Error::BadInput("matmul input has zero rows".into()));
    }
    if x.len() != m * k {
        return Err(Error::BadInput(format!("matmul input holds {} values, expected {m} rows x k={k}", x.len())));
    }
    if k % w.dtype().block_size() != 0 {
        return Err(Error::BadInput(format!(
            "inner dimension {k} is not a multiple of the {:?} block size {}",
            w.dtype(),
            w.dtype().block_size()
        )));
    }
    Ok((n, k))
}

/// Row-split GEMV: each row alone through the single-row kernel.
pub fn gemv_rows(w: &QTensor, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; m * w.shape().dims2()?.0];
    gemv_rows_into(w, x, m, &mut out)?;
    Ok(out)
}

/// [`gemv_rows`] into `out` (`m` rows of `n`).
pub fn gemv_rows_into(w: &QTensor, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    let (n, k) = check_out(w, x, m, out)?;
    let data = w.data()?;
    with_block_type!(w.dtype(), T => {
        let wb = blocks_of::<T>(&data)?;
        for r in 0..m {
            quad_matmul::<T>(wb, &x[r * k..(r + 1) * k], 1, k, n, &mut out[r * n..(r + 1) * n]);
        }
    });
    Ok(())
}

/// The batch-invariant multi-row kernel: bitwise equal to `gemv_rows` for every m.
pub fn invariant(w: &QTensor, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; m * w.shape().dims2()?.0];
    invariant_into(w, x, m, &mut out)?;
    Ok(out)
}

/// [`invariant`] into `out` (`m` rows of `n`).
pub fn invariant_into(w: &QTensor, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    let (n, k) = check_out(w, x, m, out)?;
    let data = w.data()?;
    with_block_type!(w.dtype(), T => {
        let wb = blocks_of::<T>(&data)?;
        quad_matmul::<T>(wb, x, m, k, n, out);
    });
    Ok(())
}

/// [`check`], and that `out` holds exactly `m` rows of `n`.
fn check_out(w: &QTensor, x: &[f32], m: usize, out: &[f32]) -> Result<(usize, usize)> {
    let (n, k) = check(w, x, m)?;
    if out.len() != m * n {
        return Err(Error::BadInput(format!("matmul output holds {} values, expected {m} rows x n={n}", out.len())));
    }
    Ok((n, k))
}

/// Exact dequantization of one weight row range, block by block (used by the reference lane
/// so it never needs a full FP32 copy of the weights).
pub fn dequantize_rows(w: &QTensor, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let (n, k) = w.shape().dims2()?;
    if rows.end > n {
        return Err(Error::BadInput(format!("rows {rows:?} out of {n}")));
    }
    let data = w.data()?;
    let mut out = vec![0f32; rows.len() * k];
    with_block_type!(w.dtype(), T => {
        let wb = blocks_of::<T>(&data)?;
        let kb = k / T::BLCK_SIZE;
        T::to_float(&wb[rows.start * kb..rows.end * kb], &mut out);
    });
    Ok(out)
}

/// Whether [`pack`] takes `w`: a Q4_K, Q6_K, Q4_1 or Q5_0 weight on the CPU, in whole groups
/// of sixteen columns.
pub fn packable(w: &QTensor) -> bool {
    use super::{cpu_kquant, cpu_q32};
    let cols = match w.dtype() {
        GgmlDType::Q4K | GgmlDType::Q6K => cpu_kquant::PACK_COLS,
        GgmlDType::Q4_1 | GgmlDType::Q5_0 => cpu_q32::PACK_COLS,
        _ => return false,
    };
    match w.shape().dims2() {
        Ok((n, k)) => w.device().is_cpu() && n % cols == 0 && k % w.dtype().block_size() == 0 && k > 0,
        Err(_) => false,
    }
}

/// `w` with its bytes permuted for [`invariant_packed_into`] (same dtype, shape and size; only
/// the packed kernels may read it): the blocks of each sixteen columns stored as the
/// sixteen-column kernel reads them, so that it needs no transposes. `None` where
/// [`packable`] is false.
pub fn pack(w: &QTensor) -> Result<Option<QTensor>> {
    if !packable(w) {
        return Ok(None);
    }
    match w.dtype() {
        // The canonical mode's dword tiles: the sixteen-column kernel's segments as they are.
        GgmlDType::Q6K => super::cpu_canonical::pack(w),
        _ => permuted(w, true).map(Some),
    }
}

/// [`pack`] undone: the GGUF layout every other reader takes.
pub fn unpack(w: &QTensor) -> Result<QTensor> {
    match w.dtype() {
        GgmlDType::Q6K => super::cpu_canonical::unpack(w),
        _ => permuted(w, false),
    }
}

/// `blocks` (`n` columns of `kb` blocks of a packable dtype) packed or unpacked.
fn permute_blocks(dtype: GgmlDType, data: &[u8], n: usize, kb: usize, pack: bool) -> Result<Box<dyn QuantizedType>> {
    use super::{cpu_kquant as kq, cpu_q32 as q32};
    // Candle's own block vectors are its CPU storage: no copy through bytes.
    Ok(match (dtype, pack) {
        (GgmlDType::Q4K, true) => Box::new(kq::pack_q4k(blocks_of(data)?, n, kb)),
        (GgmlDType::Q4K, false) => Box::new(kq::unpack_q4k(blocks_of(data)?, n, kb)),
        (GgmlDType::Q4_1, true) => Box::new(q32::pack_q4_1(blocks_of(data)?, n, kb)),
        (GgmlDType::Q4_1, false) => Box::new(q32::unpack_q4_1(blocks_of(data)?, n, kb)),
        (GgmlDType::Q5_0, true) => Box::new(q32::pack_q5_0(blocks_of(data)?, n, kb)),
        (GgmlDType::Q5_0, false) => Box::new(q32::unpack_q5_0(blocks_of(data)?, n, kb)),
        (d, _) => return Err(Error::Unsupported(format!("no packed layout for {d:?}"))),
    })
}

fn permuted(w: &QTensor, pack: bool) -> Result<QTensor> {
    use candle_core::quantized::QStorage;
    let (n, k) = w.shape().dims2()?;
    let data = w.data()?;
    let blocks = permute_blocks(w.dtype(), &data, n, k / w.dtype().block_size(), pack)?;
    Ok(QTensor::new(QStorage::Cpu(blocks), (n, k))?)
}

/// [`dequantize_rows`] of a weight [`pack`] made: only the groups of sixteen rows that hold
/// `rows` are unpacked, into a temporary.
pub fn dequantize_rows_packed(w: &QTensor, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
    const G: usize = super::cpu_kquant::PACK_COLS;
    const _: () = assert!(G == super::cpu_q32::PACK_COLS);
    let (n, k) = w.shape().dims2()?;
    if rows.end > n || !packable(w) {
        return Err(Error::BadInput(format!("rows {rows:?} of a packed [{n}, {k}] {:?} weight", w.dtype())));
    }
    if w.dtype() == GgmlDType::Q6K {
        return super::cpu_canonical::dequantize_rows_packed(w, rows);
    }
    let data = w.data()?;
    let (d, bytes) = (w.dtype(), w.dtype().type_size());
    let (kb, g0, g1) = (k / d.block_size(), rows.start / G, rows.end.div_ceil(G));
    let plain = permute_blocks(d, &data[g0 * G * kb * bytes..g1 * G * kb * bytes], (g1 - g0) * G, kb, false)?;
    let first = rows.start - g0 * G;
    let mut out = vec![0f32; rows.len() * k];
    let ours = unpacked_as_bytes(&*plain);
    with_block_type!(d, T => {
        T::to_float(&blocks_of::<T>(ours)?[first * kb..(first + rows.len()) * kb], &mut out);
    });
    Ok(out)
}

/// A block vector's bytes.
fn unpacked_as_bytes(blocks: &dyn QuantizedType) -> &[u8] {
    // SAFETY: Candle's CPU block vectors are plain-old-data, `storage_size_in_bytes` long.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr(), blocks.storage_size_in_bytes()) }
}

/// [`invariant_into`] over a weight [`pack`] made: the same bits.
pub fn invariant_packed_into(w: &QTensor, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    let (n, k) = check_out(w, x, m, out)?;
    if !packable(w) {
        return Err(Error::BadInput(format!(
            "a packed weight is Q4_K, Q6_K, Q4_1 or Q5_0 with n a multiple of 16, got {:?} [{n}, {k}]",
            w.dtype()
        )));
    }
    let data = w.data()?;
    match w.dtype() {
        GgmlDType::Q4K => {
            let xq = quantize_rows::<BlockQ4K>(x, m, k);
            super::cpu_kquant::matmul_q4k_packed(blocks_of(&data)?, &xq, m, k, n, out);
        }
        GgmlDType::Q6K => {
            let xq = quantize_rows::<BlockQ6K>(x, m, k);
            super::cpu_kquant::matmul_q6k_packed(blocks_of(&data)?, &xq, m, k, n, out);
        }
        GgmlDType::Q4_1 => {
            let xq = quantize_rows::<BlockQ4_1>(x, m, k);
            super::cpu_q32::matmul_q4_1_packed(blocks_of(&data)?, &xq, m, k, n, out);
        }
        _ => {
            let xq = quantize_rows::<BlockQ5_0>(x, m, k);
            super::cpu_q32::matmul_q5_0_packed(blocks_of(&data)?, &xq, m, k, n, out);
        }
    }
    Ok(())
}
