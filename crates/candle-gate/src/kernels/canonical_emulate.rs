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

/// The tensor-core kernel's block: `MMA_ROWS` rows by `MMA_COLS` columns, `MMA_WARPS` warps,
/// each holding `MMA_SLOTS` lane slots of every output (canonical.cu's names).
pub const MMA_WARPS: usize = 8;
pub const MMA_ROWS: usize = 32;
pub const MMA_COLS: usize = 16;
const MMA_SLOTS: usize = 4;
const MMA_ROW_WORDS: usize = LANES * 8 + 4;

fn load4(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `__vsub4`: bytewise subtraction, each byte wrapping on its own.
fn vsub4(a: i32, b: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    i32::from_le_bytes(std::array::from_fn(|i| a[i].wrapping_sub(b[i])))
}

/// `decode_pair` in canonical.cu, line for line: words `i` and `4 + i` of unit `u` of `row`.
fn decode_pair(dtype: GgmlDType, row: &[u8], u: usize, i: usize) -> (i32, i32) {
    let (bytes, per_block) = match dtype {
        GgmlDType::Q4_0 => (18, 1),
        GgmlDType::Q4_1 => (20, 1),
        GgmlDType::Q5_0 => (22, 1),
        GgmlDType::Q8_0 => (34, 1),
        GgmlDType::Q4K => (144, 8),
        _ => (210, 8),
    };
    let b = &row[(u / per_block) * bytes..][..bytes];
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => {
            let v = if dtype == GgmlDType::Q4_0 { load4(b, 2 + 4 * i) } else { load4(b, 4 + 4 * i) };
            let (w0, w1) = (v & 0x0F0F0F0F, (v >> 4) & 0x0F0F0F0F);
            if dtype == GgmlDType::Q4_0 {
                (vsub4(w0, 0x08080808), vsub4(w1, 0x08080808))
            } else {
                (w0, w1)
            }
        }
        GgmlDType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let v = load4(b, 6 + 4 * i);
            let (mut hlo, mut hhi) = (0i32, 0i32);
            for j in 0..4 {
                hlo |= (((qh >> (4 * i + j)) & 1) << (8 * j + 4)) as i32;
                hhi |= (((qh >> (16 + 4 * i + j)) & 1) << (8 * j + 4)) as i32;
            }
            (vsub4((v & 0x0F0F0F0F) | hlo, 0x10101010), vsub4(((v >> 4) & 0x0F0F0F0F) | hhi, 0x10101010))
        }
        GgmlDType::Q8_0 => (load4(b, 2 + 4 * i), load4(b, 2 + 16 + 4 * i)),
        GgmlDType::Q4K => {
            let j = u % 8;
            let qs = 16 + 32 * (j / 2);
            let shift = 4 * (j % 2);
            ((load4(b, qs + 4 * i) >> shift) & 0x0F0F0F0F, (load4(b, qs + 16 + 4 * i) >> shift) & 0x0F0F0F0F)
        }
        _ => {
            let j = u % 8;
            let (h, t) = (j / 4, j % 4);
            let (ql, qh) = (64 * h + 32 * (t % 2), 128 + 32 * h);
            let shift = 4 * (t / 2);
            let word = |o: usize| {
                let lo = (load4(b, ql + o) >> shift) & 0x0F0F0F0F;
                let hi = ((load4(b, qh + o) >> (2 * t)) & 0x03030303) << 4;
                vsub4(lo | hi, 0x20202020)
            };
            (word(4 * i), word(16 + 4 * i))
        }
    }
}

/// One warp's `mma.m16n8k{32,16}.row.col.s32.s8.s8.s32` with zero accumulators, from the
/// registers of its 32 lanes (`a[lane]`, `b[lane]`) to theirs (`d[lane]`), through the matrices
/// the PTX ISA's fragment layouts define (see canonical.cu): `k` is 32 (a: 4 words, b: 2) or 16
/// (a: 2 words, b: 1).
fn mma(k: usize, a: &[[i32; 4]; LANES], b: &[[i32; 2]; LANES]) -> [[i32; 4]; LANES] {
    let byte = |w: i32, e: usize| w.to_le_bytes()[e] as i8 as i32;
    let mut am = [[0i32; 32]; 16];
    let mut bm = [[0i32; 8]; 32];
    for lane in 0..LANES {
        let (g, t) = (lane / 4, lane % 4);
        for e in 0..4 {
            am[g][4 * t + e] = byte(a[lane][0], e);
            am[g + 8][4 * t + e] = byte(a[lane][1], e);
            bm[4 * t + e][g] = byte(b[lane][0], e);
            if k == 32 {
                am[g][16 + 4 * t + e] = byte(a[lane][2], e);
                am[g + 8][16 + 4 * t + e] = byte(a[lane][3], e);
                bm[16 + 4 * t + e][g] = byte(b[lane][1], e);
            }
        }
    }
    let dm = |r: usize, c: usize| (0..k).map(|i| am[r][i] * bm[i][c]).sum::<i32>();
    std::array::from_fn(|lane| {
        let (g, t) = (lane / 4, lane % 4);
        [dm(g, 2 * t), dm(g, 2 * t + 1), dm(g + 8, 2 * t), dm(g + 8, 2 * t + 1)]
    })
}

/// `x` (`m` rows of `k`) times `w`ᵀ as `canonical_mma` computes it: the stage, each warp's
/// fragments and tensor-core products, each thread's epilogue per slot, the butterfly split
/// between registers and shared memory.
pub fn emulate_mma(w: &QTensor, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let dtype = w.dtype();
    if !TILE_DTYPES.contains(&dtype) {
        return Err(Error::Unsupported(format!("the tensor-core kernel has no {dtype:?}")));
    }
    let (n, k) = w.shape().dims2()?;
    if k % UNIT != 0 || x.len() != m * k {
        return Err(Error::BadInput(format!("{} values for {m} rows of k = {k}", x.len())));
    }
    let bytes = w.data()?;
    let rb = row_bytes(dtype, k);
    let qa = quantize_rows(x, m, k);
    let units = k / UNIT;
    let (mt_n, nt_n) = (MMA_ROWS / 16, MMA_COLS / 8);
    let row_of = |c: usize| &bytes[c.min(n - 1) * rb..][..rb];
    let mut out = vec![0f32; m * n];
    for by in 0..n.div_ceil(MMA_COLS) {
        for bx in 0..m.div_ceil(MMA_ROWS) {
            let (row0, col0) = (bx * MMA_ROWS, by * MMA_COLS);
            // acc[warp][lane][s][mt][nt][e]
            let mut acc = vec![[[[[[0f32; 4]; 2]; 2]; MMA_SLOTS]; LANES]; MMA_WARPS];
            let mut base = 0;
            while base < units {
                let mut sq = vec![0i32; MMA_ROWS * MMA_ROW_WORDS];
                let mut sd = vec![0f32; MMA_ROWS * (LANES + 1)];
                let mut ss = vec![0i32; MMA_ROWS * (LANES + 1)];
                for i in 0..MMA_ROWS * LANES {
                    let (r, j, uj) = (i / LANES, i % LANES, base + i % LANES);
                    if row0 + r < m && uj < units {
                        let (qv, du) = qa.unit(row0 + r, uj);
                        for wd in 0..8 {
                            let q4 = &qv[4 * wd..4 * wd + 4];
                            sq[r * MMA_ROW_WORDS + j * 8 + wd] =
                                i32::from_le_bytes([q4[0] as u8, q4[1] as u8, q4[2] as u8, q4[3] as u8]);
                        }
                        sd[r * (LANES + 1) + j] = du;
                        ss[r * (LANES + 1) + j] = qv.iter().map(|&v| v as i32).sum();
                    }
                }
                for (warp, acc_w) in acc.iter_mut().enumerate() {
                    for s in 0..MMA_SLOTS {
                        let j = warp + 8 * s;
                        let u = base + j;
                        if u >= units {
                            continue;
                        }
                        // Each lane's registers, as the kernel loads them.
                        let mut a = [[[0i32; 4]; LANES]; 2];
                        let mut dr = [[[0f32; 2]; 2]; LANES];
                        let mut sr = [[[0i32; 2]; 2]; LANES];
                        for lane in 0..LANES {
                            let (g, t) = (lane / 4, lane % 4);
                            for mt in 0..mt_n {
                                let (r0, r1) = (16 * mt + g, 16 * mt + g + 8);
                                a[mt][lane] = [
                                    sq[r0 * MMA_ROW_WORDS + j * 8 + t],
                                    sq[r1 * MMA_ROW_WORDS + j * 8 + t],
                                    sq[r0 * MMA_ROW_WORDS + j * 8 + 4 + t],
                                    sq[r1 * MMA_ROW_WORDS + j * 8 + 4 + t],
                                ];
                                dr[lane][mt] = [sd[r0 * (LANES + 1) + j], sd[r1 * (LANES + 1) + j]];
                                sr[lane][mt] = [ss[r0 * (LANES + 1) + j], ss[r1 * (LANES + 1) + j]];
                            }
                        }
                        for nt in 0..nt_n {
                            let mut b = [[0i32; 2]; LANES];
                            let mut cf = [[unit(dtype, row_of(0), 0); 2]; LANES];
                            for (lane, (bl, cl)) in b.iter_mut().zip(cf.iter_mut()).enumerate() {
                                let (g, t) = (lane / 4, lane % 4);
                                let (b0, b1) = decode_pair(dtype, row_of(col0 + 8 * nt + g), u, t);
                                *bl = [b0, b1];
                                for (e, c) in cl.iter_mut().enumerate() {
                                    *c = unit(dtype, row_of(col0 + 8 * nt + 2 * t + e), u);
                                }
                            }
                            for mt in 0..mt_n {
                                let c: Vec<[i32; 4]> = if dtype == GgmlDType::Q6K {
                                    let lo_a: [[i32; 4]; LANES] =
                                        std::array::from_fn(|l| [a[mt][l][0], a[mt][l][1], 0, 0]);
                                    let hi_a: [[i32; 4]; LANES] =
                                        std::array::from_fn(|l| [a[mt][l][2], a[mt][l][3], 0, 0]);
                                    let lo = mma(16, &lo_a, &std::array::from_fn(|l| [b[l][0], 0]));
                                    let hi = mma(16, &hi_a, &std::array::from_fn(|l| [b[l][1], 0]));
                                    (0..LANES)
                                        .map(|l| {
                                            std::array::from_fn(|e| {
                                                cf[l][e % 2].scale_lo * lo[l][e] + cf[l][e % 2].scale_hi * hi[l][e]
                                            })
                                        })
                                        .collect()
                                } else {
                                    let dot = mma(32, &a[mt], &b);
                                    (0..LANES)
                                        .map(|l| {
                                            std::array::from_fn(|e| {
                                                if dtype == GgmlDType::Q4K {
                                                    cf[l][e % 2].scale_lo * dot[l][e]
                                                } else {
                                                    dot[l][e]
                                                }
                                            })
                                        })
                                        .collect()
                                };
                                for lane in 0..LANES {
                                    for e in 0..4 {
                                        let ce = &cf[lane][e % 2];
                                        let du = dr[lane][mt][e / 2];
                                        let v = &mut acc_w[lane][s][mt][nt][e];
                                        let cv = if dtype == GgmlDType::Q6K {
                                            c[lane][e] as f32
                                        } else {
                                            small_int_to_float(c[lane][e])
                                        };
                                        *v = (ce.coef * du).mul_add(cv, *v);
                                        if let (GgmlDType::Q4_1 | GgmlDType::Q4K, Some((mc, mult))) = (dtype, ce.min) {
                                            *v = (mc * du).mul_add(small_int_to_float(mult * sr[lane][mt][e / 2]), *v);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                base += LANES;
            }
            // The butterfly: offsets 16 and 8 in registers, 4, 2, 1 over the warps' sums.
            let mut part = vec![[0f32; MMA_WARPS]; MMA_ROWS * MMA_COLS];
            for (warp, acc_w) in acc.iter().enumerate() {
                for (lane, al) in acc_w.iter().enumerate() {
                    let (g, t) = (lane / 4, lane % 4);
                    for mt in 0..mt_n {
                        for nt in 0..nt_n {
                            for e in 0..4 {
                                let v = |s: usize| al[s][mt][nt][e];
                                let (r, c) = (16 * mt + g + 8 * (e / 2), 8 * nt + 2 * t + e % 2);
                                part[r * MMA_COLS + c][warp] = (v(0) + v(2)) + (v(1) + v(3));
                            }
                        }
                    }
                }
            }
            for (o, p) in part.iter().enumerate() {
                let (r, c) = (o / MMA_COLS, o % MMA_COLS);
                if row0 + r < m && col0 + c < n {
                    out[(row0 + r) * n + col0 + c] = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
                }
            }
        }
    }
    Ok(out)
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
