//! Q8_0 × Q8_0 for the CPU `gemv` and `invariant` kernels.
//!
//! Candle's x86 path (`avx::vec_dot_q8_0_q8_0`) keeps eight float lanes per output element:
//! each block's eight exact integer partial sums (four products each) are converted and
//! accumulated with one fused multiply-add by `d_x · d_y`, and the eight lanes are summed at the
//! end in a fixed tree. This kernel does exactly that per element, so its bits are Candle's
//! single-row bits, but it loads and takes the absolute value of a weight block once for up to
//! eight rows instead of once per row.

use candle_core::quantized::k_quants::BlockQ8_0;

use super::cpu_q32::{mirror, Q80};
use super::OutPtr;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::prefetch_ahead;
    use super::Q80;
    use std::arch::x86_64::*;

    /// Candle's `hsum_float_8`.
    #[inline(always)]
    unsafe fn hsum(x: __m256) -> f32 {
        let r = _mm256_extractf128_ps(x, 1);
        let r = _mm_add_ps(r, _mm256_castps256_ps128(x));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// A block's eight exact integer partial sums of x·y (four products each) as floats, from
    /// `ax = |x|`, `bx = x` and `by = y`: Candle's `mul_sum_i8_pairs_float`.
    #[inline(always)]
    unsafe fn pair_sums(ax: __m256i, bx: __m256i, by: __m256i) -> __m256 {
        let sy = _mm256_sign_epi8(by, bx);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy)))
    }

    /// Rows `ys[0..R]` (each `kb` blocks) against one weight column: lane-wise exactly Candle's
    /// `acc = fma(d_x·d_y, cvt(Σ pairs), acc)`, block after block, then its horizontal sum.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn column<const R: usize>(w: &[Q80], ys: [&[Q80]; R], yd: [&[f32]; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in w.iter().enumerate() {
            prefetch_ahead(x);
            let bx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            let ax = _mm256_sign_epi8(bx, bx);
            let xd = x.d.to_f32();
            for r in 0..R {
                let by = _mm256_loadu_si256(ys[r][b].qs.as_ptr() as *const __m256i);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xd * yd[r][b]), pair_sums(ax, bx, by), acc[r]);
            }
        }
        acc.map(|a| hsum(a))
    }

    /// One row against `C` adjacent columns `w[0..C]` (each `y.len()` blocks): each column
    /// exactly as [`column`] computes it. Side by side, the columns' chains of multiply-adds
    /// overlap.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn columns<const C: usize>(w: [&[Q80]; C], y: &[Q80], yd: &[f32]) -> [f32; C] {
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..y.len() {
            let by = _mm256_loadu_si256(y[b].qs.as_ptr() as *const __m256i);
            for (a, wc) in acc.iter_mut().zip(w) {
                let x = &wc[b];
                prefetch_ahead(x);
                let bx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                let q = pair_sums(_mm256_sign_epi8(bx, bx), bx, by);
                *a = _mm256_fmadd_ps(_mm256_set1_ps(x.d.to_f32() * yd[b]), q, *a);
            }
        }
        acc.map(|a| hsum(a))
    }
}

/// Columns side by side in the one-row path.
const ONE_ROW_COLS: usize = 2;
/// Columns handed to a worker at once.
const COLS_PER_TASK: usize = 16;
/// Rows sharing one pass over a weight column.
const ROW_GROUP: usize = 4;

/// `y = x · Wᵀ` for `m` rows; bitwise equal to Candle's Q8_0 matmul row by row on x86 (AVX2).
/// Returns false (and writes nothing) where this path does not apply; the caller then uses
/// Candle's own dot product.
pub fn matmul(w: &[BlockQ8_0], xq: &[BlockQ8_0], m: usize, k: usize, n: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return false;
        }
        let kb = k / 32;
        // SAFETY: Q80 mirrors BlockQ8_0 (see `cpu_q32::mirror`).
        let (w, xq) = unsafe { (mirror::<_, Q80>(w), mirror::<_, Q80>(xq)) };
        let yd: Vec<f32> = xq.iter().map(|y| y.d.to_f32()).collect();
        let row = |r: usize| (&xq[r * kb..(r + 1) * kb], &yd[r * kb..(r + 1) * kb]);
        let ptr = OutPtr(out.as_mut_ptr());
        let col_tasks = n.div_ceil(COLS_PER_TASK);
        let run = |task: usize| {
            let p = ptr;
            let cols = task * COLS_PER_TASK..n.min((task + 1) * COLS_PER_TASK);
            if m == 1 {
                let (y, d) = row(0);
                let mut c = cols.start;
                while c < cols.end {
                    let col = |i: usize| &w[(c + i) * kb..(c + i + 1) * kb];
                    // SAFETY: AVX2 and FMA detected above; columns c.. belong to this task.
                    unsafe {
                        if c + ONE_ROW_COLS <= cols.end {
                            let got = avx2::columns::<ONE_ROW_COLS>(std::array::from_fn(col), y, d);
                            for (i, v) in got.into_iter().enumerate() {
                                *p.0.add(c + i) = v;
                            }
                            c += ONE_ROW_COLS;
                        } else {
                            *p.0.add(c) = avx2::columns::<1>([col(0)], y, d)[0];
                            c += 1;
                        }
                    }
                }
                return;
            }
            for c in cols {
                let wc = &w[c * kb..(c + 1) * kb];
                let mut r0 = 0;
                while r0 < m {
                    // SAFETY: AVX2 and FMA detected above; each (row, c) belongs to this task.
                    unsafe {
                        if m - r0 >= ROW_GROUP {
                            let rs: [usize; ROW_GROUP] = std::array::from_fn(|i| r0 + i);
                            let got = avx2::column::<ROW_GROUP>(wc, rs.map(|r| row(r).0), rs.map(|r| row(r).1));
                            for (i, v) in got.into_iter().enumerate() {
                                *p.0.add((r0 + i) * n + c) = v;
                            }
                            r0 += ROW_GROUP;
                        } else {
                            let (y, d) = row(r0);
                            *p.0.add(r0 * n + c) = avx2::column::<1>(wc, [y], [d])[0];
                            r0 += 1;
                        }
                    }
                }
            }
        };
        super::parallel_for(col_tasks, run);
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, xq, m, k, n, out);
        false
    }
}
