//! Q4_1 × Q8_1 for the CPU `gemv` and `invariant` kernels.
//!
//! Candle 0.11 computes this dot product with its generic scalar code. Here the per-block
//! integer sum is computed with AVX2 — integer arithmetic is exact, so the lanes cannot change
//! it — and the float part is done exactly as Candle does it, block by block in order:
//! `sumf += sumi as f32 * d_x * d_y + m_x * s_y`. Every output element is therefore bitwise
//! equal to Candle's own Q4_1 result, at every row count, while a weight block is unpacked once
//! per tile of rows instead of once per row and column.

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_1};
use half::f16;

use super::OutPtr;

/// Mirrors Candle's `#[repr(C)]` `BlockQ4_1` (its fields are crate-private).
#[repr(C)]
struct Q41 {
    d: f16,
    m: f16,
    qs: [u8; 16],
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ8_1`.
#[repr(C)]
struct Q81 {
    d: f16,
    s: f16,
    qs: [i8; 32],
}
const _: () = assert!(std::mem::size_of::<Q41>() == std::mem::size_of::<BlockQ4_1>());
const _: () = assert!(std::mem::size_of::<Q81>() == std::mem::size_of::<BlockQ8_1>());

fn as_q41(w: &[BlockQ4_1]) -> &[Q41] {
    // SAFETY: same size and alignment (asserted above), both repr(C) {f16, f16, bytes}.
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const Q41, w.len()) }
}
fn as_q81(x: &[BlockQ8_1]) -> &[Q81] {
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const Q81, x.len()) }
}

#[inline(always)]
fn block_sumi_scalar(x: &Q41, y: &Q81) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += (x.qs[j] as i32 & 0x0F) * y.qs[j] as i32 + (x.qs[j] as i32 >> 4) * y.qs[j + 16] as i32;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q41, Q81};
    use std::arch::x86_64::*;

    /// The 32 weight nibbles of a block as unsigned bytes, in element order.
    #[inline(always)]
    pub unsafe fn unpack(x: &Q41) -> __m256i {
        let q = _mm_loadu_si128(x.qs.as_ptr() as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    #[inline(always)]
    pub unsafe fn sumi(xq: __m256i, y: &Q81) -> i32 {
        let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        // u8 (<= 15) x i8 pairs summed to i16: |15*128*2| fits; then pairs of i16 to i32.
        let p16 = _mm256_maddubs_epi16(xq, yq);
        let p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// The integer sums of one weight block against eight rows' blocks, as eight i32 lanes
    /// (lane i = row i). Integer adds are exact, so the reduction tree cannot change them.
    #[inline(always)]
    pub unsafe fn sumi8(xq: __m256i, ys: [&Q81; 8]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let p = |y: &Q81| {
            let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
            _mm256_madd_epi16(_mm256_maddubs_epi16(xq, yq), ones)
        };
        let h01 = _mm256_hadd_epi32(p(ys[0]), p(ys[1]));
        let h23 = _mm256_hadd_epi32(p(ys[2]), p(ys[3]));
        let h45 = _mm256_hadd_epi32(p(ys[4]), p(ys[5]));
        let h67 = _mm256_hadd_epi32(p(ys[6]), p(ys[7]));
        let q0 = _mm256_hadd_epi32(h01, h23);
        let q1 = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256(q0, q1, 0x20);
        let hi = _mm256_permute2x128_si256(q0, q1, 0x31);
        _mm256_add_epi32(lo, hi)
    }

    /// Eight rows of one column at once: lane i accumulates row i with exactly the scalar
    /// expression `acc += sumi as f32 * xd * d + xm * s` (separate IEEE multiplies and adds, no
    /// fused multiply-add), block after block.
    #[target_feature(enable = "avx2")]
    pub unsafe fn column_8rows(w: &[Q41], ys: &[[&Q81; 8]], yd: &[__m256], ysum: &[__m256]) -> [f32; 8] {
        let mut acc = _mm256_setzero_ps();
        for (b, x) in w.iter().enumerate() {
            let xq = unpack(x);
            let xd = _mm256_set1_ps(x.d.to_f32());
            let xm = _mm256_set1_ps(x.m.to_f32());
            let s = _mm256_cvtepi32_ps(sumi8(xq, ys[b]));
            let t = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(s, xd), yd[b]), _mm256_mul_ps(xm, ysum[b]));
            acc = _mm256_add_ps(acc, t);
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}

/// Rows at which the eight-lane path beats one horizontal sum per row (both give the same bits).
const GROUP_MIN_ROWS: usize = 3;

/// An all-zero activation block for the unused lanes of a group.
static ZERO_Q81: Q81 = Q81 { d: f16::ZERO, s: f16::ZERO, qs: [0; 32] };

/// Rows `r0..r0+8` (fewer at the end, padded with zero blocks) against columns `cols`.
#[cfg(target_arch = "x86_64")]
fn group8(w: &[Q41], xq: &[Q81], kb: usize, r0: usize, rows: usize, cols: std::ops::Range<usize>, n: usize, out: *mut f32) {
    use std::arch::x86_64::*;
    let mut ys: Vec<[&Q81; 8]> = Vec::with_capacity(kb);
    let mut yd = Vec::with_capacity(kb);
    let mut ysum = Vec::with_capacity(kb);
    for b in 0..kb {
        let mut blk = [&ZERO_Q81; 8];
        let mut d = [0f32; 8];
        let mut s = [0f32; 8];
        for i in 0..rows {
            let y = &xq[(r0 + i) * kb + b];
            blk[i] = y;
            d[i] = y.d.to_f32();
            s[i] = y.s.to_f32();
        }
        ys.push(blk);
        // SAFETY: plain loads from arrays of eight floats (AVX2 is checked by the caller).
        unsafe {
            yd.push(_mm256_loadu_ps(d.as_ptr()));
            ysum.push(_mm256_loadu_ps(s.as_ptr()));
        }
    }
    for c in cols {
        // SAFETY: AVX2 detected by the caller.
        let acc = unsafe { avx2::column_8rows(&w[c * kb..(c + 1) * kb], &ys, &yd, &ysum) };
        for (i, v) in acc.iter().take(rows).enumerate() {
            // SAFETY: each (row, c) belongs to exactly one caller-side task.
            unsafe { *out.add((r0 + i) * n + c) = *v };
        }
    }
}

const MAX_TILE: usize = 16;

/// `out[r * n + c]` for rows `0..m` (at most 16) of `xq` (row-major Q8_1 blocks) and columns
/// `cols` of `w`.
fn tile(w: &[Q41], xq: &[Q81], kb: usize, m: usize, cols: std::ops::Range<usize>, n: usize, out: *mut f32) {
    debug_assert!(m <= MAX_TILE);
    #[cfg(target_arch = "x86_64")]
    let simd = is_x86_feature_detected!("avx2");
    #[cfg(target_arch = "x86_64")]
    if simd && m >= GROUP_MIN_ROWS {
        let mut r0 = 0;
        while r0 < m {
            let rows = 8.min(m - r0);
            group8(w, xq, kb, r0, rows, cols.clone(), n, out);
            r0 += rows;
        }
        return;
    }
    let yd: Vec<[f32; 2]> = xq[..m * kb].iter().map(|y| [y.d.to_f32(), y.s.to_f32()]).collect();
    for c in cols {
        let wc = &w[c * kb..(c + 1) * kb];
        let mut acc = [0f32; MAX_TILE];
        for (b, x) in wc.iter().enumerate() {
            let (xd, xm) = (x.d.to_f32(), x.m.to_f32());
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX2 detected at run time.
                unsafe {
                    let xq8 = avx2::unpack(x);
                    for r in 0..m {
                        let sumi = avx2::sumi(xq8, &xq[r * kb + b]);
                        let [d, s] = yd[r * kb + b];
                        acc[r] += sumi as f32 * xd * d + xm * s;
                    }
                }
                continue;
            }
            for r in 0..m {
                let sumi = block_sumi_scalar(x, &xq[r * kb + b]);
                let [d, s] = yd[r * kb + b];
                acc[r] += sumi as f32 * xd * d + xm * s;
            }
        }
        for r in 0..m {
            // SAFETY: each (r, c) belongs to exactly one caller-side task.
            unsafe { *out.add(r * n + c) = acc[r] };
        }
    }
}

/// Columns handed to a worker at once.
const COLS_PER_TASK: usize = 32;

/// `y = x · Wᵀ` for `m` rows; bitwise equal to Candle's Q4_1 matmul row by row.
pub fn matmul(w: &[BlockQ4_1], xq: &[BlockQ8_1], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 32;
    let (w, xq) = (as_q41(w), as_q81(xq));
    let ptr = OutPtr(out.as_mut_ptr());
    let col_tasks = n.div_ceil(COLS_PER_TASK);
    let row_tiles = m.div_ceil(MAX_TILE);
    let run = |task: usize| {
        let p = ptr;
        let (rt, ct) = (task / col_tasks, task % col_tasks);
        let r0 = rt * MAX_TILE;
        let rows = MAX_TILE.min(m - r0);
        let cols = ct * COLS_PER_TASK..n.min((ct + 1) * COLS_PER_TASK);
        // SAFETY: the offset stays inside `out` (rows r0.. of m).
        tile(w, &xq[r0 * kb..(r0 + rows) * kb], kb, rows, cols, n, unsafe { p.0.add(r0 * n) });
    };
    let total = row_tiles * col_tasks;
    super::parallel_for(total, run);
}
