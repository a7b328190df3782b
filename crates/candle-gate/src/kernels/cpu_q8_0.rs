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
    use super::super::avx2::f16x8;
    use super::super::prefetch_ahead;
    use super::Q80;
    use std::arch::x86_64::*;

    /// Candle's `hsum_float_8`.
    #[inline(always)]
    pub(super) unsafe fn hsum(x: __m256) -> f32 {
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

    /// Block `b` of one weight column against rows `ys[0..R]`, each row's scale product given by
    /// `d(r)`: Candle's `acc = fma(d_x·d_y, cvt(Σ pairs), acc)`, the weight block loaded and its
    /// absolute value taken once for all the rows.
    #[inline(always)]
    unsafe fn block<const R: usize>(
        acc: &mut [__m256; R],
        x: *const Q80,
        ys: [*const Q80; R],
        b: usize,
        d: impl Fn(usize) -> f32,
    ) {
        let x = &*x.add(b);
        prefetch_ahead(x);
        let bx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
        let ax = _mm256_sign_epi8(bx, bx);
        for (r, a) in acc.iter_mut().enumerate() {
            let by = _mm256_loadu_si256((*ys[r].add(b)).qs.as_ptr() as *const __m256i);
            *a = _mm256_fmadd_ps(_mm256_set1_ps(d(r)), pair_sums(ax, bx, by), *a);
        }
    }

    /// Rows `ys[0..R]` (each `kb` blocks) against one weight column: lane for lane exactly
    /// Candle's `acc = fma(d_x·d_y, cvt(Σ pairs), acc)`, block after block, then its horizontal
    /// sum. The scale products `d_x·d_y` (the same f32 multiply) are made eight blocks at a
    /// time, the weight's scales read on the integer side ([`f16x8`]), and read back as
    /// broadcasts from memory: a conversion, a multiply and a broadcast per block and row were
    /// three vector instructions of eight, and the memory stream of a one-row GEMV waits on
    /// this loop's vector work. One row reads one column at a time, the matrix in its own order:
    /// on Zen 3 the 151936 × 896 output read 31–32 GB/s so, 24–26 with two columns side by side
    /// and a scale per block, while a plain two-thread sum of the same bytes read 33–45.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn column<const R: usize>(w: &[Q80], ys: [&[Q80]; R], yd: [&[f32]; R]) -> [f32; R] {
        let kb = w.len();
        assert!(ys.iter().zip(&yd).all(|(y, d)| y.len() >= kb && d.len() >= kb));
        let (x, ys, yd) = (w.as_ptr(), ys.map(|y| y.as_ptr()), yd.map(|d| d.as_ptr()));
        let mut acc = [_mm256_setzero_ps(); R];
        let mut b = 0;
        while b + 8 <= kb {
            let xd = f16x8(|i| x.add(b + i) as *const u8);
            let mut d = [[0f32; 8]; R];
            for (r, dr) in d.iter_mut().enumerate() {
                _mm256_storeu_ps(dr.as_mut_ptr(), _mm256_mul_ps(xd, _mm256_loadu_ps(yd[r].add(b))));
            }
            // Kept in memory, so that each scale is one broadcast load, not a lane permute.
            let d = std::hint::black_box(&d);
            for i in 0..8 {
                block(&mut acc, x, ys, b + i, |r| d[r][i]);
            }
            b += 8;
        }
        for b in b..kb {
            let xd = (*x.add(b)).d.to_f32();
            block(&mut acc, x, ys, b, |r| xd * *yd[r].add(b));
        }
        acc.map(|a| hsum(a))
    }

    /// [`column`] at one row, the same element, with the scale products of the column's last
    /// `kb % 8` blocks made as a group too, the lanes past the column neither read nor used.
    /// One at a time (a scalar conversion, multiply and broadcast per block, as [`column`]
    /// makes them), the 262144 × 640 output (twenty blocks a column, four of them left over)
    /// took 1.12x as long on the Zen 2. From two rows on, the pass waits on vector work, and
    /// the per-block form's fewer instructions win (the grouped form was 0.95x at two rows).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn column1(w: &[Q80], y: &[Q80], yd: &[f32]) -> f32 {
        let kb = w.len();
        assert!(y.len() >= kb && yd.len() >= kb);
        let (x, ys, yd) = (w.as_ptr(), [y.as_ptr()], yd.as_ptr());
        let mut acc = [_mm256_setzero_ps()];
        let mut b = 0;
        while b + 8 <= kb {
            let mut d = [0f32; 8];
            let xd = f16x8(|i| x.add(b + i) as *const u8);
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(xd, _mm256_loadu_ps(yd.add(b))));
            // Kept in memory, so that each scale is one broadcast load, not a lane permute.
            let d = std::hint::black_box(&d);
            for i in 0..8 {
                block(&mut acc, x, ys, b + i, |_| d[i]);
            }
            b += 8;
        }
        let left = kb - b;
        if left > 0 {
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let mut d = [0f32; 8];
            let xd = f16x8(|i| x.add(b + i.min(left - 1)) as *const u8);
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(xd, _mm256_maskload_ps(yd.add(b), mask)));
            let d = std::hint::black_box(&d);
            for i in 0..7 {
                if i == left {
                    break;
                }
                block(&mut acc, x, ys, b + i, |_| d[i]);
            }
        }
        hsum(acc[0])
    }
}

/// The AVX-512 tier: two output elements per 512-bit vector, each in its own eight lanes with
/// exactly [`avx2`]'s per-lane float operations, and each finished by the same horizontal sum, so
/// the bits are the AVX2 tier's (and Candle's).
///
/// The integer part takes another road to the same integers. Candle's eight partial sums per block
/// (four products each) come from `maddubs(|x|, sign(y, x))`, whose i16 pairs cannot saturate
/// here (its quantizer keeps |y| ≤ 127, so a pair is at most 2·128·127). VNNI's `dpbusd` wants
/// unsigned weights, so x is offset to x + 128 (one xor) and the sum starts from −128 · Σ y over
/// each four values, computed once per activation block: Σ (x + 128)·y − 128·Σ y = Σ x·y,
/// exactly, in one instruction per two output elements.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::avx512::{cat, halves_ps};
    use super::super::prefetch_ahead;
    use super::Q80;
    use std::arch::x86_64::*;

    /// `lo`'s 32 bytes in the low half, `hi`'s in the high.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn halves(lo: &[i8; 32], hi: &[i8; 32]) -> __m512i {
        let load = |q: &[i8; 32]| _mm256_loadu_si256(q.as_ptr() as *const __m256i);
        cat(load(lo), load(hi))
    }

    /// Each half's [`super::avx2::hsum`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum_halves(v: __m512) -> [f32; 2] {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        [super::avx2::hsum(_mm512_castps512_ps256(v)), super::avx2::hsum(hi)]
    }

    /// One activation block of two rows (or of one row, twice), ready for the offset form.
    pub struct Rows2 {
        qs: __m512i,
        /// −128 · Σ of each four `qs`: where each lane's sum starts.
        start: __m512i,
        /// Each row's scale over its eight lanes.
        d: __m512,
    }

    impl Rows2 {
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        pub unsafe fn of(lo: &Q80, d_lo: f32, hi: &Q80, d_hi: f32) -> Rows2 {
            let qs = halves(&lo.qs, &hi.qs);
            let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), qs);
            Rows2 { qs, start: _mm512_sub_epi32(_mm512_setzero_si512(), sums), d: halves_ps(d_lo, d_hi) }
        }
    }

    /// One activation block of one row, for [`column1`]: the offset form in 256 bits.
    pub struct Row1 {
        qs: __m256i,
        /// −128 · Σ of each four `qs`: where each lane's sum starts.
        start: __m256i,
    }

    impl Row1 {
        #[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
        pub unsafe fn of(y: &Q80) -> Row1 {
            let qs = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
            let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), qs);
            Row1 { qs, start: _mm256_sub_epi32(_mm256_setzero_si256(), sums) }
        }
    }

    /// One row against one weight column, exactly [`super::avx2::column`]'s element (the same
    /// eight lanes, scale products and horizontal sum) with the integer sums from VNNI's offset
    /// form in 256 bits: a block is a load, an xor, a `dpbusd`, a conversion and an FMA, against
    /// the AVX2 tier's seven, and the matrix is read in its own order, one column after the
    /// next. The path before, two columns side by side in one 512-bit vector, read it in two
    /// interleaved streams with a blend and two broadcasts per block, and took 7.0–7.3 ms on the
    /// 151936 × 896 output on the 2-core Zen 4 (which splits each 512-bit operation in two),
    /// against 3.9–4.2 for the AVX2 tier and 4.0–4.2 for this one.
    #[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn column1(w: &[Q80], y: &[Row1], yd: &[f32]) -> f32 {
        let kb = w.len();
        assert!(y.len() >= kb && yd.len() >= kb);
        let x = w.as_ptr();
        let offset = _mm256_set1_epi8(-128);
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b + 8 <= kb {
            let xd = super::super::avx2::f16x8(|i| x.add(b + i) as *const u8);
            let mut d = [0f32; 8];
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(xd, _mm256_loadu_ps(yd.as_ptr().add(b))));
            // Kept in memory, so that each scale is one broadcast load, not a lane permute.
            let d = std::hint::black_box(&d);
            for i in 0..8 {
                let xb = &*x.add(b + i);
                prefetch_ahead(xb);
                let xu = _mm256_xor_si256(_mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i), offset);
                let yb = y.get_unchecked(b + i);
                let sums = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(yb.start, xu, yb.qs));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d[i]), sums, acc);
            }
            b += 8;
        }
        for b in b..kb {
            let xb = &*x.add(b);
            let xu = _mm256_xor_si256(_mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i), offset);
            let yb = y.get_unchecked(b);
            let sums = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(yb.start, xu, yb.qs));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(xb.d.to_f32() * *yd.get_unchecked(b)), sums, acc);
        }
        super::avx2::hsum(acc)
    }

    /// Candle's per-block step on two elements at once: `acc + (d_x·d_y) · Σ x·y`, one FMA per
    /// lane, with the exact integer lanes from the offset form.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    unsafe fn step(acc: __m512, x_plus_128: __m512i, y: &Rows2, d: __m512) -> __m512 {
        _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(y.start, x_plus_128, y.qs)), acc)
    }

    /// One weight column against `P` row pairs (`rows[p]`: the pair's blocks), every element
    /// exactly [`super::avx2::column`]'s: `2P` results, pair by pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub unsafe fn column<const P: usize>(w: &[Q80], rows: [&[Rows2]; P]) -> [[f32; 2]; P] {
        let mut acc = [_mm512_setzero_ps(); P];
        let offset = _mm512_set1_epi8(-128);
        for (b, x) in w.iter().enumerate() {
            prefetch_ahead(x);
            let xu = _mm512_xor_si512(halves(&x.qs, &x.qs), offset);
            let xd = _mm512_set1_ps(x.d.to_f32());
            for p in 0..P {
                let y = rows[p].get_unchecked(b);
                acc[p] = step(acc[p], xu, y, _mm512_mul_ps(xd, y.d));
            }
        }
        acc.map(|a| hsum_halves(a))
    }
}

/// `got` copied to the front of `buf`, which is returned cut to it.
fn fill<'a>(buf: &'a mut [f32], got: &[f32]) -> &'a [f32] {
    buf[..got.len()].copy_from_slice(got);
    &buf[..got.len()]
}

/// Columns handed to a worker at once.
const COLS_PER_TASK: usize = 16;
/// Row pairs sharing one pass over a weight column with AVX-512, two rows per vector.
const ROW_GROUP: usize = 4;
/// The most rows sharing one pass over a weight column with AVX2 (any count up to it takes one
/// pass). Eight accumulators fit beside the block's registers once the scale products are
/// broadcast from memory: 1.10–1.29x over four at 8 rows on Zen 3, the weight block read once
/// instead of twice.
const AVX2_ROWS: usize = 8;
const _: () = assert!(AVX2_ROWS == 8, "the AVX2 dispatch names every row count up to eight");
/// The most outputs one pass over a column gives (either tier).
const GROUP_OUT: usize = if AVX2_ROWS > 2 * ROW_GROUP { AVX2_ROWS } else { 2 * ROW_GROUP };

/// `y = x · Wᵀ` for `m` rows; bitwise equal to Candle's Q8_0 matmul row by row on x86 (AVX2).
/// Returns false (and writes nothing) where this path does not apply; the caller then uses
/// Candle's own dot product.
pub fn matmul(w: &[BlockQ8_0], xq: &[BlockQ8_0], m: usize, k: usize, n: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = super::isa();
        if isa < super::Isa::Avx2 {
            return false;
        }
        let wide = isa == super::Isa::Avx512;
        let kb = k / 32;
        // SAFETY: Q80 mirrors BlockQ8_0 (see `cpu_q32::mirror`).
        let (w, xq) = unsafe { (mirror::<_, Q80>(w), mirror::<_, Q80>(xq)) };
        let yd: Vec<f32> = xq.iter().map(|y| y.d.to_f32()).collect();
        let row = |r: usize| (&xq[r * kb..(r + 1) * kb], &yd[r * kb..(r + 1) * kb]);
        // AVX-512's activations, built once: row pairs (2p, 2p + 1), or at one row the row alone
        // in 256 bits (`ones`). An odd last row pairs with itself: a row's lane in a pair gives
        // the bits it gives alone, and the pair kernel at 2P rows reads the column once where the
        // odd row would read it again through a loop of its own (7 rows took 1.7x as long as 8).
        let pairs: Vec<Vec<avx512::Rows2>> = if !wide || m == 1 {
            Vec::new()
        } else {
            let pair = |lo: usize, hi: usize| -> Vec<avx512::Rows2> {
                let ((yl, dl), (yh, dh)) = (row(lo), row(hi));
                // SAFETY: AVX-512 F/BW and VNNI are part of the tier (`wide`).
                (0..kb).map(|b| unsafe { avx512::Rows2::of(&yl[b], dl[b], &yh[b], dh[b]) }).collect()
            };
            (0..m.div_ceil(2)).map(|p| pair(2 * p, (2 * p + 1).min(m - 1))).collect()
        };
        let ones: Vec<avx512::Row1> = if wide && m == 1 {
            // SAFETY: AVX-512 VL and VNNI are part of the tier (`wide`).
            xq[..kb].iter().map(|y| unsafe { avx512::Row1::of(y) }).collect()
        } else {
            Vec::new()
        };
        let ptr = OutPtr(out.as_mut_ptr());
        let col_tasks = n.div_ceil(COLS_PER_TASK);
        let run = |task: usize| {
            let p = ptr;
            let mut cols = task * COLS_PER_TASK..n.min((task + 1) * COLS_PER_TASK);
            let col = |c: usize| &w[c * kb..(c + 1) * kb];
            // One row with AVX-512: column after column ([`avx512::column1`]); with AVX2 the
            // same below ([`avx2::column1`]); two rows and more go through the row-group loop.
            if m == 1 && wide {
                for c in cols.clone() {
                    // SAFETY: AVX-512 F/VL and VNNI are part of the tier (`wide`).
                    let v = unsafe { avx512::column1(col(c), &ones, &yd[..kb]) };
                    // SAFETY: (0, c) belongs to this task alone.
                    unsafe { *p.0.add(c) = v };
                }
                cols.start = cols.end;
            }
            // One row with AVX2: column after column straight into the output, without the
            // row-group loop's buffer and dispatch per column.
            if m == 1 {
                let (y, d) = row(0);
                for c in cols.clone() {
                    // SAFETY: AVX2, FMA and F16C are part of the tier (`isa`).
                    let v = unsafe { avx2::column1(col(c), y, d) };
                    // SAFETY: (0, c) belongs to this task alone.
                    unsafe { *p.0.add(c) = v };
                }
                cols.start = cols.end;
            }
            for c in cols {
                let wc = col(c);
                let mut r0 = 0;
                while r0 < m {
                    // SAFETY: the tier's features detected (`isa`); with AVX-512, `pairs` holds every row.
                    let mut buf = [0f32; GROUP_OUT];
                    let got: &[f32] = unsafe {
                        let left = pairs.len().saturating_sub(r0 / 2);
                        if wide && left >= ROW_GROUP {
                            let rows: [&[avx512::Rows2]; ROW_GROUP] = std::array::from_fn(|i| &pairs[r0 / 2 + i][..]);
                            fill(&mut buf, avx512::column::<ROW_GROUP>(wc, rows).as_flattened())
                        } else if wide && left == 3 {
                            let rows: [&[avx512::Rows2]; 3] = std::array::from_fn(|i| &pairs[r0 / 2 + i][..]);
                            fill(&mut buf, avx512::column::<3>(wc, rows).as_flattened())
                        } else if wide && left == 2 {
                            let rows: [&[avx512::Rows2]; 2] = std::array::from_fn(|i| &pairs[r0 / 2 + i][..]);
                            fill(&mut buf, avx512::column::<2>(wc, rows).as_flattened())
                        } else if wide && left == 1 {
                            fill(&mut buf, avx512::column::<1>(wc, [&pairs[r0 / 2][..]]).as_flattened())
                        } else {
                            // Every row count up to eight in one pass over the column: a row at a
                            // time, the 262144 × 640 output took 1.55x (two rows) and 1.74x
                            // (three) as long, and five as four and one 1.19x.
                            macro_rules! rows {
                                ($r:literal) => {{
                                    let rs: [usize; $r] = std::array::from_fn(|i| r0 + i);
                                    fill(&mut buf, &avx2::column::<$r>(wc, rs.map(|r| row(r).0), rs.map(|r| row(r).1)))
                                }};
                            }
                            match (m - r0).min(AVX2_ROWS) {
                                8 => rows!(8),
                                7 => rows!(7),
                                6 => rows!(6),
                                5 => rows!(5),
                                4 => rows!(4),
                                3 => rows!(3),
                                2 => rows!(2),
                                _ => {
                                    let (y, d) = row(r0);
                                    fill(&mut buf, &[avx2::column1(wc, y, d)])
                                }
                            }
                        }
                    };
                    // (Less an odd last row's twin.)
                    let got = &got[..got.len().min(m - r0)];
                    for (i, &v) in got.iter().enumerate() {
                        // SAFETY: each (row, c) belongs to this task alone.
                        unsafe { *p.0.add((r0 + i) * n + c) = v };
                    }
                    r0 += got.len();
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
