//! `split_k_f16`: the CPU stand-in for a half-precision GPU GEMM whose kernel follows the row
//! count, with bits that are the same on every machine.
//!
//! A GPU GEMM library picks its tiling from the problem shape: with few rows there are few
//! output tiles, so it splits the reduction (split-K) to fill the machine, and with many rows it
//! does not. Each split is summed separately and the partial sums are added at the end, so the
//! rounding of a row's outputs depends on how many rows shared the call. This kernel does the
//! same on purpose:
//!
//! * operands are f16 (the activations rounded to f16, the weights dequantized and rounded to
//!   f16), products are accumulated in f32 with fused multiply-adds, results are rounded to f16
//!   (tensor-core semantics);
//! * k is cut into [`k_splits`]`(m)` contiguous chunks; each chunk is summed in eight f32 lanes,
//!   the lanes are reduced in a fixed tree, and the chunk sums are added in order.
//!
//! Everything is fixed at compile time: an AVX2/FMA/F16C path when the build targets them (as
//! `x86-64-v3` does) and a portable path with the same arithmetic operation for operation
//! (tested bitwise equal), no run-time ISA dispatch. So a row's bits are a function of its
//! values and the row count only, on any machine: they differ between row counts by
//! construction, and the margin gate is shown on this lane.

use half::f16;

use super::OutPtr;

/// Rows that share one pass over a column tile.
const TILE_ROWS: usize = 4;
/// Weight columns held in registers at once (4 × 3 accumulators + 3 weight registers fit the
/// sixteen AVX registers).
const TILE_COLS: usize = 3;
/// Columns one worker takes at a time: their f16 weights (a few tens of KiB) stay in L2 while
/// every row tile passes over them.
const COLS_PER_TASK: usize = 48;

/// How many contiguous chunks k is split into for a call with `m` rows: many for one row (few
/// output tiles to spread over the machine), none from 17 rows on, as GPU GEMM heuristics choose.
pub fn k_splits(m: usize) -> usize {
    match m {
        0 | 1 => 8,
        2..=4 => 4,
        5..=8 => 3,
        9..=16 => 2,
        _ => 1,
    }
}

/// Length of each k chunk (a multiple of the eight lanes; the last chunk may be shorter).
pub fn chunk_len(k: usize, splits: usize) -> usize {
    k.div_ceil(8).div_ceil(splits.max(1)).max(1) * 8
}

#[inline(always)]
fn reduce8(c: &[f32; 8]) -> f32 {
    ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7]))
}

/// `y = x · Wᵀ` for `m` rows: `w` is `[n, k]` f16, `x` is `m × k` f32 (rounded to f16 here);
/// returns `m × n`, each value an f16 kept as f32.
pub fn matmul(w: &[f16], x: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k, "split_k_f16: weight is not [n, k]");
    assert_eq!(x.len(), m * k, "split_k_f16: input is not m x k");
    let xh: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let cl = chunk_len(k, k_splits(m));
    let mut out = vec![0f32; m * n];
    let op = OutPtr(out.as_mut_ptr());
    let tasks = n.div_ceil(COLS_PER_TASK);
    super::parallel_for(tasks, |t| {
        #[allow(clippy::redundant_locals)] // captures the whole Send wrapper, not its raw field
        let op = op;
        let c_end = n.min((t + 1) * COLS_PER_TASK);
        for r0 in (0..m).step_by(TILE_ROWS) {
            let rows = TILE_ROWS.min(m - r0);
            for c0 in (t * COLS_PER_TASK..c_end).step_by(TILE_COLS) {
                let cols = TILE_COLS.min(c_end - c0);
                // SAFETY: rows r0..r0+rows × columns c0..c0+cols belong to this task alone.
                unsafe { run_tile(&xh, w, k, n, cl, r0, rows, c0, cols, op) };
            }
        }
    });
    for v in out.iter_mut() {
        *v = f16::from_f32(*v).to_f32();
    }
    out
}

/// Dispatches one tile to the monomorphized kernel for its shape.
#[allow(clippy::too_many_arguments)]
unsafe fn run_tile(
    x: &[f32],
    w: &[f16],
    k: usize,
    n: usize,
    cl: usize,
    r0: usize,
    rows: usize,
    c0: usize,
    cols: usize,
    op: OutPtr,
) {
    macro_rules! go {
        ($r:literal, $c:literal) => {{
            let xs: [&[f32]; $r] = std::array::from_fn(|i| &x[(r0 + i) * k..(r0 + i + 1) * k]);
            let ws: [&[f16]; $c] = std::array::from_fn(|j| &w[(c0 + j) * k..(c0 + j + 1) * k]);
            let y = tile::<$r, $c>(xs, ws, cl);
            for i in 0..$r {
                for j in 0..$c {
                    *op.0.add((r0 + i) * n + c0 + j) = y[i][j];
                }
            }
        }};
    }
    match (rows, cols) {
        (1, 1) => go!(1, 1),
        (1, 2) => go!(1, 2),
        (1, _) => go!(1, 3),
        (2, 1) => go!(2, 1),
        (2, 2) => go!(2, 2),
        (2, _) => go!(2, 3),
        (3, 1) => go!(3, 1),
        (3, 2) => go!(3, 2),
        (3, _) => go!(3, 3),
        (_, 1) => go!(4, 1),
        (_, 2) => go!(4, 2),
        (_, _) => go!(4, 3),
    }
}

/// Unrounded f32 results of `R` rows against `C` weight columns, chunk length `cl`.
#[inline(always)]
fn tile<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f16]; C], cl: usize) -> [[f32; C]; R] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    {
        // SAFETY: the target features are enabled at compile time; every load reads 8 values
        // inside a chunk's body.
        unsafe { tile_avx2::<R, C>(x, w, cl) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    {
        tile_portable::<R, C>(x, w, cl)
    }
}

/// The definition of the lane's arithmetic, in plain Rust: per chunk, lane `l` accumulates
/// `fma(x[j], w[j], acc)` over `j ≡ l (mod 8)`, the lanes reduce in [`reduce8`]'s tree, a
/// leftover `k % 8` tail is summed by scalar FMAs and added last; chunk sums add in order.
#[allow(dead_code)]
fn tile_portable<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f16]; C], cl: usize) -> [[f32; C]; R] {
    let k = x[0].len();
    let mut total = [[0f32; C]; R];
    for (chunk, start) in (0..k).step_by(cl).enumerate() {
        let end = k.min(start + cl);
        let body = start + (end - start) / 8 * 8;
        for r in 0..R {
            for c in 0..C {
                let mut acc = [0f32; 8];
                for j in (start..body).step_by(8) {
                    for l in 0..8 {
                        acc[l] = x[r][j + l].mul_add(w[c][j + l].to_f32(), acc[l]);
                    }
                }
                let mut tail = 0f32;
                for j in body..end {
                    tail = x[r][j].mul_add(w[c][j].to_f32(), tail);
                }
                let part = reduce8(&acc) + tail;
                total[r][c] = if chunk == 0 { part } else { total[r][c] + part };
            }
        }
    }
    total
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
#[inline(always)]
unsafe fn tile_avx2<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f16]; C], cl: usize) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let k = x[0].len();
    let mut total = [[0f32; C]; R];
    let mut start = 0;
    let mut chunk = 0;
    while start < k {
        let end = k.min(start + cl);
        let body = start + (end - start) / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut j = start;
        while j < body {
            let wv: [__m256; C] =
                std::array::from_fn(|c| _mm256_cvtph_ps(_mm_loadu_si128(w[c].as_ptr().add(j) as *const __m128i)));
            for r in 0..R {
                let xv = _mm256_loadu_ps(x[r].as_ptr().add(j));
                for c in 0..C {
                    acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
            j += 8;
        }
        for r in 0..R {
            for c in 0..C {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][c]);
                let mut tail = 0f32;
                for j in body..end {
                    tail = x[r][j].mul_add(w[c][j].to_f32(), tail);
                }
                let part = reduce8(&lanes) + tail;
                total[r][c] = if chunk == 0 { part } else { total[r][c] + part };
            }
        }
        start = end;
        chunk += 1;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// The compiled path (AVX2 on x86-64-v3) is the portable definition, bit for bit, for
    /// every tile shape, chunk length and ragged k.
    #[test]
    fn compiled_tile_equals_portable_definition() {
        for k in [8, 24, 32, 40, 64, 100, 576, 1536] {
            let x = values(4 * k, k as u64);
            let w: Vec<f16> = values(3 * k, 7 + k as u64).into_iter().map(f16::from_f32).collect();
            for splits in [1, 2, 3, 4, 8] {
                let cl = chunk_len(k, splits);
                macro_rules! check {
                    ($r:literal, $c:literal) => {{
                        let xs: [&[f32]; $r] = std::array::from_fn(|i| &x[i * k..(i + 1) * k]);
                        let ws: [&[f16]; $c] = std::array::from_fn(|j| &w[j * k..(j + 1) * k]);
                        let a = tile::<$r, $c>(xs, ws, cl);
                        let b = tile_portable::<$r, $c>(xs, ws, cl);
                        for i in 0..$r {
                            for j in 0..$c {
                                assert_eq!(
                                    a[i][j].to_bits(),
                                    b[i][j].to_bits(),
                                    "k={k} splits={splits} tile {}x{} [{i},{j}]",
                                    $r,
                                    $c
                                );
                            }
                        }
                    }};
                }
                check!(1, 1);
                check!(1, 3);
                check!(2, 2);
                check!(3, 1);
                check!(4, 3);
                check!(4, 2);
            }
        }
    }

    #[test]
    fn chunks_cover_k() {
        for k in [1, 7, 8, 9, 576, 1536, 4096] {
            for m in [1, 2, 5, 9, 17] {
                let cl = chunk_len(k, k_splits(m));
                assert!(cl % 8 == 0 && cl >= 8);
                assert!(k.div_ceil(cl) <= k_splits(m));
            }
        }
    }
}
