//! The tiled CUDA kernel (`canonical_tile` in `cuda/canonical.cu`) run thread by thread on the
//! CPU: the blocks of the grid, the activation chunk each block stages in shared memory (laid
//! out as the kernel lays it out), and each thread's loop over its units, rows and columns. The
//! tests hold it equal, bit for bit, to [`canonical::matmul`](super::canonical::matmul) for every
//! tile, which is the claim that lets the host pick the tile by row count: an output's bits
//! depend on its row and column only, never on how the grid is cut.

use candle_core::quantized::{GgmlDType, QTensor};

use super::canonical::{butterfly, quantize_rows, row_bytes, unit, Unit, LANES, UNIT};
use crate::error::{Error, Result};

/// Warps per block of the tiled kernel: `TILE_WARPS` in canonical.cu.
pub const TILE_WARPS: usize = 4;

/// A block's share of the output: `rows` activation rows by `TILE_WARPS * cols` weight columns,
/// `cols` per warp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub rows: usize,
    pub cols: usize,
}

/// The tiles canonical.cu instantiates (`TILE_ALL` there), smallest first.
pub const TILES: [Tile; 6] = [
    Tile { rows: 1, cols: 4 },
    Tile { rows: 2, cols: 4 },
    Tile { rows: 4, cols: 4 },
    Tile { rows: 8, cols: 4 },
    Tile { rows: 16, cols: 4 },
    Tile { rows: 32, cols: 2 },
];

/// The quantized dtypes the tiled kernel decodes.
pub const TILE_DTYPES: [GgmlDType; 6] =
    [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K];

/// `tile_accumulate` in canonical.cu: `Unit::accumulate` against a staged unit, with the
/// integer parts regrouped as the kernel groups them (one dot product over all 32 values for
/// the dtypes whose two halves share a scale, `sc * dot`; the integer sum read from the stage)
/// and the same float operations in the same order.
fn tile_accumulate(dtype: GgmlDType, un: &Unit, q: &[i8; UNIT], du: f32, sum: i32, acc: f32) -> f32 {
    let dot = |range: std::ops::Range<usize>| range.map(|i| un.w[i] as i32 * q[i] as i32).sum::<i32>();
    let c = match dtype {
        GgmlDType::Q6K => un.scale_lo * dot(0..UNIT / 2) + un.scale_hi * dot(UNIT / 2..UNIT),
        GgmlDType::Q4K => un.scale_lo * dot(0..UNIT),
        _ => dot(0..UNIT),
    };
    let cf = if dtype == GgmlDType::Q6K { c as f32 } else { small_int_to_float(c) };
    let acc = (un.coef * du).mul_add(cf, acc);
    match (dtype, un.min) {
        (GgmlDType::Q4_1 | GgmlDType::Q4K, Some((coef, mult))) => {
            (coef * du).mul_add(small_int_to_float(mult * sum), acc)
        }
        _ => acc,
    }
}

/// `small_int_to_float` in canonical.cu: `v as f32` for |v| < 2^22 through the mantissa of
/// 1.5 · 2^23 (an integer add and a float subtraction). Panics outside that range, which the
/// kernel's uses never reach (the bounds are in canonical.cu).
pub fn small_int_to_float(v: i32) -> f32 {
    assert!((-(1 << 22)..1 << 22).contains(&v), "{v} is outside the exact range of the conversion");
    f32::from_bits((0x4B40_0000 + v) as u32) - 12_582_912.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_int_to_float_is_the_conversion_over_its_whole_range() {
        for v in -(1 << 22)..(1 << 22) {
            assert_eq!(small_int_to_float(v).to_bits(), (v as f32).to_bits(), "{v}");
        }
    }
}

/// One block's shared-memory stage of a chunk of 32 units: `sq[r][half][j]` the 16 values of
/// half `half` of unit `base + j` of row `row0 + r`, `sd[r][j]` its scale, `ss[r][j]` the sum of
/// its 32 values; zeros past the rows or the units.
struct Stage {
    sq: Vec<[[[i8; UNIT / 2]; LANES]; 2]>,
    sd: Vec<[f32; LANES]>,
    ss: Vec<[i32; LANES]>,
}

/// `x` (`m` rows of `k`) times `w`ᵀ as `canonical_tile` with `tile` computes it, thread by thread.
pub fn emulate_tile(w: &QTensor, x: &[f32], m: usize, tile: Tile) -> Result<Vec<f32>> {
    let dtype = w.dtype();
    if !TILE_DTYPES.contains(&dtype) {
        return Err(Error::Unsupported(format!("the tiled kernel has no {dtype:?}")));
    }
    let (n, k) = w.shape().dims2()?;
    if k % UNIT != 0 || x.len() != m * k {
        return Err(Error::BadInput(format!("{} values for {m} rows of k = {k}", x.len())));
    }
    let bytes = w.data()?;
    let rb = row_bytes(dtype, k);
    let qa = quantize_rows(x, m, k);
    let units = k / UNIT;
    let threads = TILE_WARPS * LANES;
    let (rt, ct) = (tile.rows, tile.cols);
    let mut out = vec![0f32; m * n];
    // grid = (ceil(m / RT), ceil(n / (TILE_WARPS * CT)))
    for by in 0..n.div_ceil(TILE_WARPS * ct) {
        for bx in 0..m.div_ceil(rt) {
            let row0 = bx * rt;
            // acc[thread][r][c]
            let mut acc = vec![vec![vec![0f32; ct]; rt]; threads];
            let mut base = 0;
            while base < units {
                // Each thread's weight units (decoded before the stage, as the kernel does).
                let decoded: Vec<Option<Vec<Unit>>> = (0..threads)
                    .map(|t| {
                        let (warp, lane) = (t / LANES, t % LANES);
                        let col0 = (by * TILE_WARPS + warp) * ct;
                        let u = base + lane;
                        (u < units).then(|| {
                            (0..ct).map(|c| unit(dtype, &bytes[(col0 + c).min(n - 1) * rb..][..rb], u)).collect()
                        })
                    })
                    .collect();
                // The stage, thread by thread as the kernel's loop assigns it.
                let mut st = Stage {
                    sq: vec![[[[0; UNIT / 2]; LANES]; 2]; rt],
                    sd: vec![[0.0; LANES]; rt],
                    ss: vec![[0; LANES]; rt],
                };
                let stage_iters = (rt * LANES).div_ceil(threads);
                for t in 0..threads {
                    for it in 0..stage_iters {
                        let i = t + it * threads;
                        if i >= rt * LANES {
                            continue;
                        }
                        let (r, j, uj) = (i / LANES, i % LANES, base + i % LANES);
                        if row0 + r < m && uj < units {
                            let (qv, du) = qa.unit(row0 + r, uj);
                            st.sq[r][0][j].copy_from_slice(&qv[..UNIT / 2]);
                            st.sq[r][1][j].copy_from_slice(&qv[UNIT / 2..]);
                            st.sd[r][j] = du;
                            st.ss[r][j] = qv.iter().map(|&v| v as i32).sum();
                        }
                    }
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let lane = t % LANES;
                    let Some(un) = &decoded[t] else { continue };
                    for (r, ar) in a.iter_mut().enumerate() {
                        let mut qv = [0i8; UNIT];
                        qv[..UNIT / 2].copy_from_slice(&st.sq[r][0][lane]);
                        qv[UNIT / 2..].copy_from_slice(&st.sq[r][1][lane]);
                        let (du, sum) = (st.sd[r][lane], st.ss[r][lane]);
                        for (c, v) in ar.iter_mut().enumerate() {
                            *v = tile_accumulate(dtype, &un[c], &qv, du, sum, *v);
                        }
                    }
                }
                base += LANES;
            }
            for warp in 0..TILE_WARPS {
                let col0 = (by * TILE_WARPS + warp) * ct;
                for r in 0..rt {
                    for c in 0..ct {
                        if row0 + r < m && col0 + c < n {
                            let lanes = std::array::from_fn(|l| acc[warp * LANES + l][r][c]);
                            out[(row0 + r) * n + col0 + c] = butterfly(lanes);
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The tile the CUDA host code launches for `m` rows, `None` for the one-warp-per-column kernel
/// (`canonical_<dtype>_r1`, one row). Any choice gives the same bits; this one is for speed:
/// a tile no taller than the rows (fewer rows than the tile only waste lanes), 16 rows by 16
/// columns per block from 9 rows on.
pub fn tile_for_rows(m: usize) -> Option<Tile> {
    Some(match m {
        0 | 1 => return None,
        2 => TILES[1],
        3 | 4 => TILES[2],
        5..=8 => TILES[3],
        _ => TILES[4],
    })
}
