//! 32-weight blocks against 32-value Q8 activation blocks — Q4_1 × Q8_1 and Q5_0 × Q8_0 — for
//! the CPU `gemv` and `invariant` kernels.
//!
//! Candle 0.11 computes both dot products with its generic scalar code. Here the per-block
//! integer sum is computed with AVX2 — integer arithmetic is exact, so lanes and reduction trees
//! cannot change it — and the float part is done exactly as Candle does it, block by block in
//! order (Q4_1: `sumf += sumi as f32 * d_x * d_y + m_x * s_y`; Q5_0:
//! `sumf += sumi as f32 * d_x * d_y`). Every output element is therefore bitwise equal to Candle's own result, at every
//! row count, while a weight block is unpacked once per tile of rows instead of once per row
//! and column.

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ5_0, BlockQ8_0, BlockQ8_1};
use half::f16;

use super::OutPtr;

/// Mirrors Candle's `#[repr(C)]` `BlockQ4_1` (its fields are crate-private).
#[repr(C)]
#[derive(Clone)]
pub(crate) struct Q41 {
    d: f16,
    m: f16,
    qs: [u8; 16],
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ5_0`.
#[repr(C)]
#[derive(Clone)]
pub(crate) struct Q50 {
    d: f16,
    qh: [u8; 4],
    qs: [u8; 16],
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ8_1`.
#[repr(C)]
pub(crate) struct Q81 {
    pub(crate) d: f16,
    pub(crate) s: f16,
    pub(crate) qs: [i8; 32],
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ8_0`.
#[repr(C)]
pub(crate) struct Q80 {
    pub(crate) d: f16,
    pub(crate) qs: [i8; 32],
}
const _: () = assert!(std::mem::size_of::<Q41>() == std::mem::size_of::<BlockQ4_1>());
const _: () = assert!(std::mem::size_of::<Q50>() == std::mem::size_of::<BlockQ5_0>());
const _: () = assert!(std::mem::size_of::<Q81>() == std::mem::size_of::<BlockQ8_1>());
const _: () = assert!(std::mem::size_of::<Q80>() == std::mem::size_of::<BlockQ8_0>());

/// Reinterprets Candle's blocks as their mirrors.
///
/// SAFETY (callers): `B` and `T` are a Candle block type and its mirror above: the same size
/// (asserted), the same alignment (both hold f16 and bytes only), the same `repr(C)` layout.
pub(crate) unsafe fn mirror<B, T>(s: &[B]) -> &[T] {
    std::slice::from_raw_parts(s.as_ptr() as *const T, s.len())
}

/// An activation block: 32 quantized values, their scale, and (Q8_1) their scaled sum.
pub(crate) trait Act: Sync + 'static {
    fn qs(&self) -> &[i8; 32];
    fn d(&self) -> f32;
    fn s(&self) -> f32;
}

impl Act for Q81 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn s(&self) -> f32 {
        self.s.to_f32()
    }
}

impl Act for Q80 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn s(&self) -> f32 {
        0.0
    }
}

/// A 32-weight block whose weights are unsigned bytes `u` minus `OFFSET`.
pub(crate) trait Weights: Sync + 'static {
    type Y: Act;
    const OFFSET: i32;
    /// Whether the block has a min (`m_x * s_y` is added per block).
    const HAS_MIN: bool;
    fn u(&self) -> [u8; 32];
    fn d(&self) -> f32;
    fn m(&self) -> f32;
    /// The packed low four bits: weight j's in byte j's low nibble (j < 16), else byte j - 16's
    /// high nibble.
    fn qs(&self) -> &[u8; 16];
    /// Weight j's fifth bit (worth 16) as bit j; 0 for four-bit blocks.
    fn qh(&self) -> u32;
    #[cfg(target_arch = "x86_64")]
    /// SAFETY: AVX2 must be available.
    unsafe fn u_avx2(&self) -> std::arch::x86_64::__m256i;
    /// [`avx2::dot8_transposed`] of this block's weights.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot8_transposed_avx2(&self, yt: &[std::arch::x86_64::__m256i; 8]) -> std::arch::x86_64::__m256i {
        avx2::dot8_transposed(self.u_avx2(), yt)
    }
}

impl Weights for Q41 {
    type Y = Q81;
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    fn u(&self) -> [u8; 32] {
        std::array::from_fn(|j| if j < 16 { self.qs[j] & 0x0F } else { self.qs[j - 16] >> 4 })
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn m(&self) -> f32 {
        self.m.to_f32()
    }
    fn qs(&self) -> &[u8; 16] {
        &self.qs
    }
    fn qh(&self) -> u32 {
        0
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn u_avx2(&self) -> std::arch::x86_64::__m256i {
        avx2::nibbles(&self.qs)
    }
    /// Each 4 bytes of `qs` broadcast straight from memory hold two groups (their low nibbles:
    /// weights 4g..4g+4; high: 16+4g..): no unpacked vector to shuffle groups out of, which
    /// costs a lane-crossing permute per group.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot8_transposed_avx2(&self, yt: &[std::arch::x86_64::__m256i; 8]) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let q = self.qs.as_ptr() as *const i32;
        let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for g in 0..4 {
            avx2::nibble_group_dots(q.add(g), yt[g], yt[g + 4], &mut lo, &mut hi);
        }
        let ones = _mm256_set1_epi16(1);
        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
    }
}

impl Weights for Q50 {
    type Y = Q80;
    const OFFSET: i32 = 16;
    const HAS_MIN: bool = false;
    fn u(&self) -> [u8; 32] {
        let qh = u32::from_le_bytes(self.qh);
        std::array::from_fn(|j| {
            let nib = if j < 16 { self.qs[j] & 0x0F } else { self.qs[j - 16] >> 4 };
            nib | ((((qh >> j) & 1) as u8) << 4)
        })
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn m(&self) -> f32 {
        0.0
    }
    fn qs(&self) -> &[u8; 16] {
        &self.qs
    }
    fn qh(&self) -> u32 {
        u32::from_le_bytes(self.qh)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn u_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        _mm256_or_si256(avx2::nibbles(&self.qs), _mm256_and_si256(avx2::bits(self.qh), _mm256_set1_epi8(0x10)))
    }
}

/// Candle's float step for one block: `acc + sumi * d_x * d_y (+ m_x * s_y)`, in that order.
#[inline(always)]
fn step<W: Weights>(acc: f32, sumi: i32, x: &W, y: &W::Y) -> f32 {
    if W::HAS_MIN {
        acc + (sumi as f32 * x.d() * y.d() + x.m() * y.s())
    } else {
        acc + sumi as f32 * x.d() * y.d()
    }
}

/// The exact integer dot product of a block: Σ (u - OFFSET) · y = Σ u·y - OFFSET · Σ y.
fn sumi_scalar<W: Weights>(u: &[u8; 32], y: &W::Y, ysum: i32) -> i32 {
    let dot: i32 = u.iter().zip(y.qs()).map(|(&u, &q)| u as i32 * q as i32).sum();
    dot - W::OFFSET * ysum
}

fn qs_sum(y: &impl Act) -> i32 {
    y.qs().iter().map(|&q| q as i32).sum()
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::Act;
    use std::arch::x86_64::*;

    /// 16 bytes of nibbles as 32 unsigned bytes: low nibbles first, then high nibbles.
    #[inline(always)]
    pub unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        // One load into both halves and one shift of the high half only: three instructions
        // where two 128-bit halves, shifted and masked apart and then joined, take five.
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.as_ptr() as *const __m128i));
        _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F))
    }

    /// Bit j of the 32-bit little-endian `qh` as byte j: 0xFF where set, 0 where not.
    /// One constant (each byte's own bit, and'ed and compared with itself), not two: the
    /// eight-column GEMV holds eight blocks and its constants in sixteen registers, and one
    /// more constant made LLVM spill the accumulator every block (1.28x slower on Zen 3).
    #[inline(always)]
    pub unsafe fn bits(qh: [u8; 4]) -> __m256i {
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(i32::from_le_bytes(qh)), shuf);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit)
    }

    /// Σ u·y over a block as eight i32 partial sums (u ≤ 31, so pairs fit in i16).
    #[inline(always)]
    unsafe fn partial(u: __m256i, y: &impl Act) -> __m256i {
        let yq = _mm256_loadu_si256(y.qs().as_ptr() as *const __m256i);
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, yq), _mm256_set1_epi16(1))
    }

    #[inline(always)]
    pub unsafe fn dot(u: __m256i, y: &impl Act) -> i32 {
        let p = partial(u, y);
        let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Σ u·y of one weight block against eight rows at once, from the rows' activations
    /// transposed (`yt[g]` lane r: row r's bytes 4g..4g+4): each group of 4 weights is
    /// broadcast to every lane, so lane r sums row r and no horizontal reduction is needed.
    /// Lane r is [`dot`] of row r, exactly. The i16 pairs of `maddubs` (|u·y + u·y| ≤ 2·31·128) are
    /// summed over 4 groups before widening: at most 31,744, inside i16.
    #[inline(always)]
    pub unsafe fn dot8_transposed(u: __m256i, yt: &[__m256i; 8]) -> __m256i {
        let mut ub = [0i32; 8];
        _mm256_storeu_si256(ub.as_mut_ptr() as *mut __m256i, u);
        // Kept in memory, so that each group is one broadcast load: left to itself the compiler
        // turns them into lane-crossing permutes of `u`, three times the cost on Zen 1.
        let ub = std::hint::black_box(&ub);
        let ones = _mm256_set1_epi16(1);
        let half = |g0: usize| {
            let mut s = _mm256_maddubs_epi16(_mm256_set1_epi32(ub[g0]), yt[g0]);
            for g in g0 + 1..g0 + 4 {
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_set1_epi32(ub[g]), yt[g]));
            }
            _mm256_madd_epi16(s, ones)
        };
        _mm256_add_epi32(half(0), half(4))
    }

    /// Σ u·y of eight weight blocks (eight columns) against one row's block, as eight i32 lanes
    /// (lane i = column i).
    #[inline(always)]
    pub unsafe fn dot8_cols(us: [__m256i; 8], y: &impl Act) -> __m256i {
        let yq = _mm256_loadu_si256(y.qs().as_ptr() as *const __m256i);
        lanes8(us.map(|u| _mm256_maddubs_epi16(u, yq)))
    }

    /// The 4 packed bytes at `q` broadcast to every lane, their low nibbles' products with
    /// `y_lo` added to the i16 pairs of `lo` and their high nibbles' with `y_hi` to `hi`: a
    /// rows-in-lanes step for two 4-weight groups from one load.
    #[inline(always)]
    pub unsafe fn nibble_group_dots(q: *const i32, y_lo: __m256i, y_hi: __m256i, lo: &mut __m256i, hi: &mut __m256i) {
        let mask = _mm256_set1_epi8(0x0F);
        let b = _mm256_set1_epi32(std::ptr::read_unaligned(q));
        *lo = _mm256_add_epi16(*lo, _mm256_maddubs_epi16(_mm256_and_si256(b, mask), y_lo));
        *hi = _mm256_add_epi16(*hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), mask), y_hi));
    }

    /// The two f16s that open each of eight blocks (`d`, then Q4_1's `m`), as f32 lanes: one
    /// vector of the eight 4-byte heads, split by one shuffle, instead of sixteen scalar loads
    /// and conversions.
    #[inline(always)]
    pub unsafe fn head_halves(heads: [i32; 8]) -> (__m256, __m256) {
        super::super::avx2::f16_halves(_mm256_loadu_si256(heads.as_ptr() as *const __m256i))
    }

    /// Eight blocks' `maddubs` pair sums (sixteen i16 each, |pair| ≤ 2·31·128) to one vector of
    /// their eight i32 totals: in-lane unpacks and adds (one instruction each), where `hadd`
    /// costs several. The unpacks move 32-bit units, each two i16 of one column, so the adds
    /// stay in i16 until a unit holds eight products (≤ 31,744); then one `madd` per four
    /// columns widens, where widening each block first took eight (4% on the GEMV).
    #[inline(always)]
    pub(crate) unsafe fn lanes8(p: [__m256i; 8]) -> __m256i {
        let pair = |a, b| _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        let quad = |a, b| _mm256_add_epi16(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
        let ones = _mm256_set1_epi16(1);
        // 128-bit lane L of q0: columns 0..4's sums over their lane-L partials (q1: 4..8).
        let q0 = _mm256_madd_epi16(quad(pair(p[0], p[1]), pair(p[2], p[3])), ones);
        let q1 = _mm256_madd_epi16(quad(pair(p[4], p[5]), pair(p[6], p[7])), ones);
        _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31))
    }

    /// `R` rows against a packed group's sixteen columns on the AVX2 tier, both eight-column
    /// halves of a tile in one pass (half h: the tile's vector bytes `32h..32h + 32`, column
    /// 8h + c in lane c): lane c runs exactly [`super::row_8cols`]'s operations for its column,
    /// so both give the same bits. Each row's bytes 4t..4t + 4 are broadcast to every lane and
    /// one `maddubs` takes four weights of eight columns, so no lane is ever summed across (the
    /// GGUF layout's kernel reduces eight vectors per block). Q4_1's eight `maddubs` of a block
    /// sum in i16 (|Σ| ≤ 8 · 2 · 15 · 128 = 30,720), then one `madd` widens; Q5_0's weights
    /// reach 31, so its low and high nibbles' four each (≤ 31,744) widen apart, and its fifth
    /// bits come from the tile's lane masks, 32 bits a half, one byte each ([`bits`]).
    /// `out` row r starts at `out + r * n`. `from_memory`: the first pass over the group,
    /// which asks for its tiles ahead at every row count (from memory a 1536 × 576 Q4_1 weight
    /// read 1.25x as fast at one row, 1.12x at three, with it on a Zen 2), one row
    /// [`super::super::ONE_ROW_AHEAD`] ahead, more rows [`super::super::TILE_PREFETCH_AHEAD`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn sixteen_packed<W: super::Packed, const R: usize>(
        group: &[W],
        kb: usize,
        ys: &[W::Y],
        ysum: &[i32],
        out: *mut f32,
        n: usize,
        from_memory: bool,
    ) {
        assert!(group.len() >= super::PACK_COLS * kb && ys.len() >= R * kb);
        assert!(W::OFFSET == 0 || ysum.len() >= R * kb);
        let tile_bytes = super::PACK_COLS * std::mem::size_of::<W>();
        let base = group.as_ptr() as *const u8;
        let (m4, ones, fifth) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1), _mm256_set1_epi8(0x10));
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..kb {
            let tile = base.add(b * tile_bytes);
            if from_memory {
                if R == 1 {
                    super::super::prefetch_one_row_ahead(tile, tile_bytes);
                } else {
                    super::super::prefetch_tile_ahead(tile, tile_bytes);
                }
            }
            for h in 0..2 {
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
                for t in 0..4 {
                    let v = _mm256_loadu_si256(tile.add(W::TILE_QS + super::VECTOR_BYTES * t + 32 * h) as *const _);
                    lo[t] = _mm256_and_si256(v, m4);
                    hi[t] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                }
                if W::OFFSET != 0 {
                    // Q5_0: mask i's bits 32h.. are this half's bytes' fifth bits.
                    let mask = |i: usize| {
                        let at = tile.add(super::TILE_SECOND + 8 * i + 4 * h) as *const [u8; 4];
                        _mm256_and_si256(bits(std::ptr::read_unaligned(at)), fifth)
                    };
                    for t in 0..4 {
                        lo[t] = _mm256_or_si256(lo[t], mask(2 * t));
                        hi[t] = _mm256_or_si256(hi[t], mask(2 * t + 1));
                    }
                }
                let xd = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h) as *const __m128i));
                let xm = if W::HAS_MIN {
                    _mm256_cvtph_ps(_mm_loadu_si128(tile.add(super::TILE_SECOND + 16 * h) as *const __m128i))
                } else {
                    xd
                };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let y = ys.get_unchecked(r * kb + b);
                    let yq = y.qs().as_ptr() as *const i32;
                    let word = |j: usize| _mm256_set1_epi32(std::ptr::read_unaligned(yq.add(j)));
                    let sumi = if W::OFFSET == 0 {
                        let mut p = _mm256_setzero_si256();
                        for t in 0..4 {
                            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[t], word(t)));
                            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[t], word(4 + t)));
                        }
                        _mm256_madd_epi16(p, ones)
                    } else {
                        let (mut pl, mut ph) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for t in 0..4 {
                            pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(lo[t], word(t)));
                            ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(hi[t], word(4 + t)));
                        }
                        let sumi = _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
                        _mm256_sub_epi32(sumi, _mm256_set1_epi32(W::OFFSET * *ysum.get_unchecked(r * kb + b)))
                    };
                    let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sumi), xd), _mm256_set1_ps(y.d()));
                    let t = if W::HAS_MIN { _mm256_add_ps(t, _mm256_mul_ps(xm, _mm256_set1_ps(y.s()))) } else { t };
                    acc[h] = _mm256_add_ps(acc[h], t);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(r * n), acc[0]);
            _mm256_storeu_ps(out.add(r * n + 8), acc[1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::super::avx512::{both, both_ps, halves_ps, spread};
    use super::{Act, Weights};
    use std::arch::x86_64::*;

    /// Two blocks' 32 unsigned weights each, `a`'s in the low 256 bits and `b`'s in the high:
    /// the nibbles split with one shift of the high-nibble lanes, the fifth bits added under a
    /// mask made straight from `qh` (no byte shuffle, as AVX2 needs).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn u_pair<W: Weights>(a: &W, b: &W) -> __m512i {
        let qa = _mm_loadu_si128(a.qs().as_ptr() as *const __m128i);
        let qb = _mm_loadu_si128(b.qs().as_ptr() as *const __m128i);
        let q = _mm512_castsi256_si512(_mm256_set_m128i(qb, qa));
        // 128-bit lanes [a, a, b, b]; the second of each pair shifted to its high nibbles.
        let q = _mm512_shuffle_i32x4::<0b01_01_00_00>(q, q);
        let q = _mm512_mask_srli_epi16::<4>(q, 0xFF00_FF00, q);
        let u = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
        let qh = a.qh() as u64 | ((b.qh() as u64) << 32);
        if qh == 0 {
            return u;
        }
        _mm512_mask_add_epi8(u, qh, u, _mm512_set1_epi8(0x10))
    }

    /// Eight vectors of sixteen i32 partial sums to one vector of sixteen totals, where `p[i]`
    /// holds column i's partials in its low 256 bits and column i + 4's in its high (i < 4), and
    /// `p[4 + i]` columns 8 + i and 12 + i: lane j of the result is column j's total.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn lanes16(p: [__m512i; 8]) -> __m512i {
        let pair = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
        let quad = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
        // 128-bit lane L of q0: the lane-L partials of p[0..4]; L = 0, 1 belong to columns 0..4,
        // L = 2, 3 to columns 4..8 (q1: 8..12, 12..16).
        let q0 = quad(pair(p[0], p[1]), pair(p[2], p[3]));
        let q1 = quad(pair(p[4], p[5]), pair(p[6], p[7]));
        let even = _mm512_shuffle_i32x4::<0b10_00_10_00>(q0, q1);
        let odd = _mm512_shuffle_i32x4::<0b11_01_11_01>(q0, q1);
        _mm512_add_epi32(even, odd)
    }

    /// One row against sixteen columns `c0..c0+16` at once: lane i accumulates column i with
    /// exactly the operations [`super::row_8cols`] gives its lanes, block after block, so both
    /// give the same bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn row_16cols<W: Weights>(w: &[W], kb: usize, c0: usize, y: &[W::Y], ysum: &[i32]) -> [f32; 16] {
        assert!((c0 + 16) * kb <= w.len() && y.len() >= kb && ysum.len() >= kb);
        let first = w.as_ptr().add(c0 * kb);
        let next = first.wrapping_add(16 * kb) as *const i8;
        let per_block = 16 * std::mem::size_of::<W>();
        let mut acc = _mm512_setzero_ps();
        for b in 0..kb {
            // As in `row_8cols`: each step asks for its share of the next sixteen columns.
            for off in (b * per_block..(b + 1) * per_block).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off));
            }
            // SAFETY: column c0 + i, block b < kb: inside `w` (asserted above).
            let xs: [&W; 16] = std::array::from_fn(|i| &*first.add(i * kb + b));
            let (yb, sb) = (y.get_unchecked(b), *ysum.get_unchecked(b));
            let yy = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.qs().as_ptr() as *const __m256i));
            // Loops, not `array::from_fn` or `map`: LLVM may leave those out of line, a call per
            // element (it did for `map` here once other kernels grew: 1.8x slower at one row).
            let mut p = [_mm512_setzero_si512(); 8];
            for (i, p) in p.iter_mut().enumerate() {
                let a = (i / 4) * 8 + i % 4;
                *p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_pair(xs[a], xs[a + 4]), yy);
            }
            let sumi = _mm512_sub_epi32(lanes16(p), _mm512_set1_epi32(W::OFFSET * sb));
            let mut heads = [0i32; 16];
            for (h, x) in heads.iter_mut().zip(xs) {
                *h = std::ptr::read_unaligned(x as *const W as *const i32);
            }
            let heads = _mm512_loadu_si512(heads.as_ptr() as *const _);
            let xd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads));
            let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), xd), _mm512_set1_ps(yb.d()));
            let t = if W::HAS_MIN {
                let xm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(heads)));
                _mm512_add_ps(t, _mm512_mul_ps(xm, _mm512_set1_ps(yb.s())))
            } else {
                t
            };
            acc = _mm512_add_ps(acc, t);
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), acc);
        out
    }

    /// `R` rows against a packed group's sixteen columns (column c in lane c), block after
    /// block: lane c runs exactly [`row_16cols`]'s operations for its column, so both give the
    /// same bits (the integer sums are exact in any order). The weights come straight from
    /// plain vector loads of the tile, unpacked once for all `R` rows; each row's
    /// bytes 4t..4t + 4 are broadcast to every lane, one `dpbusd` per four weights of sixteen
    /// columns, so no lane ever needs summing across. `out` row r starts at `out + r * n`.
    /// `from_memory`: the group is not yet in the caches (the first pass over it), so its tiles
    /// are asked for ahead: [`super::super::TILE_PREFETCH_AHEAD`] from
    /// [`super::super::PREFETCH_ROWS`] rows, [`super::super::SHORT_GROUP_AHEAD`] below.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn sixteen_packed<W: super::Packed, const R: usize>(
        group: &[W],
        kb: usize,
        ys: &[W::Y],
        ysum: &[i32],
        out: *mut f32,
        n: usize,
        from_memory: bool,
    ) {
        assert!(group.len() >= super::PACK_COLS * kb && ys.len() >= R * kb);
        assert!(W::OFFSET == 0 || ysum.len() >= R * kb);
        let prefetch = super::super::prefetches_tiles(R, from_memory);
        let few_ahead = super::super::prefetches_segments(R, from_memory);
        let tile_bytes = super::PACK_COLS * std::mem::size_of::<W>();
        let base = group.as_ptr() as *const u8;
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..kb {
            // A group is one run of bytes read in order, which the hardware prefetcher follows,
            // but not far enough ahead once a tile's rows take longer than its read.
            let tile = base.add(b * tile_bytes);
            if prefetch {
                super::super::prefetch_tile_ahead(tile, tile_bytes);
            } else if few_ahead {
                super::super::prefetch_into_l2(tile.wrapping_add(super::super::SHORT_GROUP_AHEAD), tile_bytes);
            }
            // Loops, not `array::from_fn` or `map`, which LLVM may leave out of line (see
            // `row_16cols`).
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); 4], [_mm512_setzero_si512(); 4]);
            for t in 0..4 {
                let v = _mm512_loadu_si512(tile.add(W::TILE_QS + super::VECTOR_BYTES * t) as *const _);
                lo[t] = _mm512_and_si512(v, m4);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
            if W::OFFSET != 0 {
                // Q5_0: the fifth bits, as the tile's lane masks ([`super::Packed`]).
                let fifth = _mm512_set1_epi8(0x10);
                let mask = |i: usize| std::ptr::read_unaligned(tile.add(super::TILE_SECOND + 8 * i) as *const u64);
                for t in 0..4 {
                    lo[t] = _mm512_mask_add_epi8(lo[t], mask(2 * t), lo[t], fifth);
                    hi[t] = _mm512_mask_add_epi8(hi[t], mask(2 * t + 1), hi[t], fifth);
                }
            }
            let xd = _mm512_cvtph_ps(_mm256_loadu_si256(tile as *const __m256i));
            let xm = if W::HAS_MIN {
                _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(super::TILE_SECOND) as *const __m256i))
            } else {
                xd
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let y = ys.get_unchecked(r * kb + b);
                let yq = y.qs().as_ptr() as *const i32;
                let word = |j: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(j)));
                // Two chains, so that consecutive multiply-adds do not wait on each other.
                let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for t in 0..4 {
                    even = _mm512_dpbusd_epi32(even, lo[t], word(t));
                    odd = _mm512_dpbusd_epi32(odd, hi[t], word(4 + t));
                }
                let mut sumi = _mm512_add_epi32(even, odd);
                if W::OFFSET != 0 {
                    sumi = _mm512_sub_epi32(sumi, _mm512_set1_epi32(W::OFFSET * *ysum.get_unchecked(r * kb + b)));
                }
                let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), xd), _mm512_set1_ps(y.d()));
                let t = if W::HAS_MIN { _mm512_add_ps(t, _mm512_mul_ps(xm, _mm512_set1_ps(y.s()))) } else { t };
                *acc = _mm512_add_ps(*acc, t);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * n), *acc);
        }
    }

    /// [`super::Group8`] with each vector in both 256-bit halves: eight rows for two columns.
    pub struct Group16 {
        yt: [__m512i; 8],
        d: __m512,
        s: __m512,
        offset_sum: __m512i,
    }

    impl Group16 {
        #[target_feature(enable = "avx512f")]
        pub unsafe fn of(g: &super::Group8) -> Group16 {
            Group16 { yt: g.yt.map(|v| both(v)), d: both_ps(g.d), s: both_ps(g.s), offset_sum: both(g.offset_sum) }
        }
    }

    /// Eight rows of two columns at once, rows in the lanes (`a`'s in lanes 0-7, `b`'s in
    /// 8-15): each lane runs exactly [`super::column_8rows`]'s operations for its row and
    /// column, so both give the same bits. Group g of each column's unpacked weights reaches its
    /// eight lanes by one permute, and VNNI sums four products per lane straight into i32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn two_columns_8rows<W: Weights>(wa: &[W], wb: &[W], groups: &[Group16]) -> [f32; 16] {
        let mut acc = _mm512_setzero_ps();
        for ((xa, xb), g) in wa.iter().zip(wb).zip(groups) {
            super::super::prefetch_ahead(xa);
            super::super::prefetch_ahead(xb);
            let u = u_pair(xa, xb);
            // Two chains, so that consecutive multiply-adds do not wait on each other.
            let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for t in (0..8).step_by(2) {
                even = _mm512_dpbusd_epi32(even, spread(u, t as i32), g.yt[t]);
                odd = _mm512_dpbusd_epi32(odd, spread(u, t as i32 + 1), g.yt[t + 1]);
            }
            let sumi = _mm512_sub_epi32(_mm512_add_epi32(even, odd), g.offset_sum);
            let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), halves_ps(xa.d(), xb.d())), g.d);
            let t = if W::HAS_MIN { _mm512_add_ps(t, _mm512_mul_ps(halves_ps(xa.m(), xb.m()), g.s)) } else { t };
            acc = _mm512_add_ps(acc, t);
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}

/// Eight rows' activation blocks for one block index, with their floats as lanes.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Group8 {
    /// The eight rows' 32 bytes transposed: `yt[g]` lane r = row r's bytes 4g..4g+4.
    yt: [std::arch::x86_64::__m256i; 8],
    d: std::arch::x86_64::__m256,
    s: std::arch::x86_64::__m256,
    /// OFFSET · Σ y per row, subtracted from the lanes' Σ u·y.
    offset_sum: std::arch::x86_64::__m256i,
}

/// Eight rows of one column at once: lane i accumulates row i with exactly [`step`]'s scalar
/// expression (separate IEEE multiplies and adds, no fused multiply-add), block after block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn column_8rows<W: Weights>(w: &[W], groups: &[Group8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (x, g) in w.iter().zip(groups) {
        super::prefetch_ahead(x);
        let sumi = _mm256_sub_epi32(x.dot8_transposed_avx2(&g.yt), g.offset_sum);
        let s = _mm256_cvtepi32_ps(sumi);
        let t = _mm256_mul_ps(_mm256_mul_ps(s, _mm256_set1_ps(x.d())), g.d);
        let t = if W::HAS_MIN { _mm256_add_ps(t, _mm256_mul_ps(_mm256_set1_ps(x.m()), g.s)) } else { t };
        acc = _mm256_add_ps(acc, t);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// One row against eight columns `c0..c0+8` at once: lane i accumulates column i with exactly
/// [`step`]'s scalar expression, block after block (as [`column_8rows`], with columns in the
/// lanes instead of rows: what a GEMV needs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_8cols<W: Weights>(w: &[W], kb: usize, c0: usize, y: &[W::Y], ysum: &[i32]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    // Eight columns read side by side are eight streams a few cache lines long each, too short
    // for the hardware prefetcher to follow: decode ran 20% faster on SmolLM2 once each block
    // step also asks for its share of the next eight columns (one contiguous run of memory).
    // A cache-resident benchmark does not show this; only reading from DRAM does.
    assert!((c0 + 8) * kb <= w.len() && y.len() >= kb && ysum.len() >= kb);
    let first = w.as_ptr().add(c0 * kb);
    let next = first.wrapping_add(8 * kb) as *const i8;
    let per_block = 8 * std::mem::size_of::<W>();
    for b in 0..kb {
        // A fixed count of lines from the block's start (unrolled; a line past its end is the
        // next block's): a `step_by` over the block's own range cost integer work every block.
        for line in 0..per_block.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(b * per_block + 64 * line));
        }
        // SAFETY: column c0 + i, block b < kb: inside `w` (asserted above).
        let xs: [&W; 8] = std::array::from_fn(|i| &*first.add(i * kb + b));
        let (yb, sb) = (y.get_unchecked(b), *ysum.get_unchecked(b));
        let sumi = avx2::dot8_cols(xs.map(|x| x.u_avx2()), yb);
        let sumi = _mm256_sub_epi32(sumi, _mm256_set1_epi32(W::OFFSET * sb));
        let (xd, xm) = avx2::head_halves(xs.map(|x| std::ptr::read_unaligned(x as *const W as *const i32)));
        let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sumi), xd), _mm256_set1_ps(yb.d()));
        let t = if W::HAS_MIN { _mm256_add_ps(t, _mm256_mul_ps(xm, _mm256_set1_ps(yb.s()))) } else { t };
        acc = _mm256_add_ps(acc, t);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// Rows at which rows in the lanes beat columns in the lanes (both give the same bits).
const GROUP_MIN_ROWS: usize = 3;

/// The activations of rows `r0..r0+rows` (at most 8; the other lanes zero: they add nothing
/// and are not written back), block by block, in [`column_8rows`]'s layout. Built once per
/// matmul and shared by every column task.
#[cfg(target_arch = "x86_64")]
fn groups_of<W: Weights>(xq: &[W::Y], ysum: &[i32], kb: usize, r0: usize, rows: usize) -> Vec<Group8> {
    use std::arch::x86_64::*;
    (0..kb)
        .map(|b| {
            let mut yt = [[0i32; 8]; 8];
            let (mut d, mut s, mut o) = ([0f32; 8], [0f32; 8], [0i32; 8]);
            for i in 0..rows {
                let y = &xq[(r0 + i) * kb + b];
                for (g, col) in yt.iter_mut().enumerate() {
                    let q = &y.qs()[4 * g..4 * g + 4];
                    col[i] = i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
                }
                d[i] = y.d();
                s[i] = y.s();
                o[i] = W::OFFSET * ysum[(r0 + i) * kb + b];
            }
            // SAFETY: plain loads from arrays of eight lanes (AVX2 is checked by the caller).
            unsafe {
                Group8 {
                    yt: yt.map(|c| _mm256_loadu_si256(c.as_ptr() as *const __m256i)),
                    d: _mm256_loadu_ps(d.as_ptr()),
                    s: _mm256_loadu_ps(s.as_ptr()),
                    offset_sum: _mm256_loadu_si256(o.as_ptr() as *const __m256i),
                }
            }
        })
        .collect()
}

/// Up to eight rows' activations in the rows-in-lanes layouts: AVX2's, and (when that tier
/// runs) AVX-512's, built once per matmul.
#[cfg(target_arch = "x86_64")]
struct RowGroup {
    narrow: Vec<Group8>,
    wide: Vec<avx512::Group16>,
}

#[cfg(target_arch = "x86_64")]
impl RowGroup {
    fn new(narrow: Vec<Group8>, isa: super::Isa) -> RowGroup {
        // SAFETY: AVX-512 F is part of the tier checked here.
        let wide = if isa == super::Isa::Avx512 {
            narrow.iter().map(|g| unsafe { avx512::Group16::of(g) }).collect()
        } else {
            Vec::new()
        };
        RowGroup { narrow, wide }
    }
}

/// Rows `r0..r0+rows` (at most 8, their [`RowGroup`]) against columns `cols`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn group8<W: Weights>(
    w: &[W],
    groups: &RowGroup,
    kb: usize,
    r0: usize,
    rows: usize,
    cols: std::ops::Range<usize>,
    n: usize,
    out: *mut f32,
) {
    let col = |c: usize| &w[c * kb..(c + 1) * kb];
    let put = |c: usize, acc: &[f32]| {
        for (i, v) in acc.iter().take(rows).enumerate() {
            // SAFETY: each (row, c) belongs to exactly one caller-side task.
            unsafe { *out.add((r0 + i) * n + c) = *v };
        }
    };
    let mut c = cols.start;
    while c < cols.end {
        // SAFETY (both kernels): the tier's features were detected by the caller, and `wide` is
        // only built when AVX-512 runs.
        if !groups.wide.is_empty() && c + 2 <= cols.end {
            let acc = unsafe { avx512::two_columns_8rows(col(c), col(c + 1), &groups.wide) };
            put(c, &acc[..8]);
            put(c + 1, &acc[8..]);
            c += 2;
        } else {
            put(c, &unsafe { column_8rows(col(c), &groups.narrow) });
            c += 1;
        }
    }
}

const MAX_TILE: usize = 16;

/// `out[r * n + c]` for rows `0..m` (at most 16) of `xq` and columns `cols` of `w`; `groups`:
/// the tile's rows as [`groups_of`] in 8s when the rows-in-lanes path runs, else empty.
#[allow(clippy::too_many_arguments)]
fn tile<W: Weights>(
    w: &[W],
    xq: &[W::Y],
    ysum: &[i32],
    kb: usize,
    m: usize,
    cols: std::ops::Range<usize>,
    n: usize,
    out: *mut f32,
    #[cfg(target_arch = "x86_64")] groups: &[RowGroup],
) {
    debug_assert!(m <= MAX_TILE);
    #[cfg(target_arch = "x86_64")]
    let isa = super::isa();
    #[cfg(target_arch = "x86_64")]
    let simd = isa >= super::Isa::Avx2;
    #[cfg(target_arch = "x86_64")]
    if !groups.is_empty() {
        for (g, rows_g) in groups.iter().enumerate() {
            group8(w, rows_g, kb, 8 * g, 8.min(m - 8 * g), cols.clone(), n, out);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let cols = if simd {
        let mut c = cols.start;
        while isa == super::Isa::Avx512 && c + 16 <= cols.end {
            for r in 0..m {
                let rows_of = r * kb..(r + 1) * kb;
                // SAFETY: AVX-512 (F, BW, VL, VNNI) detected at run time.
                let acc = unsafe { avx512::row_16cols(w, kb, c, &xq[rows_of.clone()], &ysum[rows_of]) };
                for (i, v) in acc.iter().enumerate() {
                    // SAFETY: each (r, c + i) belongs to exactly one caller-side task.
                    unsafe { *out.add(r * n + c + i) = *v };
                }
            }
            c += 16;
        }
        while c + 8 <= cols.end {
            for r in 0..m {
                let rows_of = r * kb..(r + 1) * kb;
                // SAFETY: AVX2 detected at run time.
                let acc = unsafe { row_8cols(w, kb, c, &xq[rows_of.clone()], &ysum[rows_of]) };
                for (i, v) in acc.iter().enumerate() {
                    // SAFETY: each (r, c + i) belongs to exactly one caller-side task.
                    unsafe { *out.add(r * n + c + i) = *v };
                }
            }
            c += 8;
        }
        c..cols.end
    } else {
        cols
    };
    for c in cols {
        let wc = &w[c * kb..(c + 1) * kb];
        let mut acc = [0f32; MAX_TILE];
        for (b, x) in wc.iter().enumerate() {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX2 detected at run time.
                unsafe {
                    let u = x.u_avx2();
                    for r in 0..m {
                        let (y, s) = (&xq[r * kb + b], ysum[r * kb + b]);
                        acc[r] = step(acc[r], avx2::dot(u, y) - W::OFFSET * s, x, y);
                    }
                }
                continue;
            }
            let u = x.u();
            for r in 0..m {
                let (y, s) = (&xq[r * kb + b], ysum[r * kb + b]);
                acc[r] = step(acc[r], sumi_scalar::<W>(&u, y, s), x, y);
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

fn matmul<W: Weights>(w: &[W], xq: &[W::Y], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 32;
    let ysum: Vec<i32> = if W::OFFSET != 0 { xq.iter().map(qs_sum).collect() } else { vec![0; xq.len()] };
    let ptr = OutPtr(out.as_mut_ptr());
    let col_tasks = n.div_ceil(COLS_PER_TASK);
    let row_tiles = m.div_ceil(MAX_TILE);
    // Rows in the lanes from GROUP_MIN_ROWS rows of a tile on (both paths give the same bits).
    #[cfg(target_arch = "x86_64")]
    let isa = super::isa();
    #[cfg(target_arch = "x86_64")]
    let groups: Vec<Vec<RowGroup>> = (0..row_tiles)
        .map(|rt| {
            let (r0, rows) = (rt * MAX_TILE, MAX_TILE.min(m - rt * MAX_TILE));
            if rows < GROUP_MIN_ROWS || isa < super::Isa::Avx2 {
                return Vec::new();
            }
            (0..rows.div_ceil(8))
                .map(|g| RowGroup::new(groups_of::<W>(xq, &ysum, kb, r0 + 8 * g, 8.min(rows - 8 * g)), isa))
                .collect()
        })
        .collect();
    let run = |task: usize| {
        let p = ptr;
        let (rt, ct) = (task / col_tasks, task % col_tasks);
        let r0 = rt * MAX_TILE;
        let rows = MAX_TILE.min(m - r0);
        let cols = ct * COLS_PER_TASK..n.min((ct + 1) * COLS_PER_TASK);
        let rows_of = r0 * kb..(r0 + rows) * kb;
        // SAFETY: the offset stays inside `out` (rows r0.. of m).
        #[rustfmt::skip]
        tile(w, &xq[rows_of.clone()], &ysum[rows_of], kb, rows, cols, n, unsafe { p.0.add(r0 * n) },
             #[cfg(target_arch = "x86_64")] &groups[rt]);
    };
    super::parallel_for(row_tiles * col_tasks, run);
}

/// Columns per packed group of a Q4_1 or Q5_0 weight.
pub const PACK_COLS: usize = 16;

/// A 32-weight block type with a packed layout: sixteen columns' block b stored as one tile
/// that the sixteen-column kernel loads with no transposes, shuffles or per-column loads. A
/// tile is the sixteen blocks' bytes rearranged (Q5_0's fifth bits regrouped bit by bit):
/// first the heads, sixteen f16s per field (`d`, then Q4_1's `m`; Q5_0's fifth bits as eight
/// 64-bit lane masks), then the nibbles as four 64-byte vectors, vector t lane c holding
/// column c's `qs[4t..4t + 4]` (weights 4t.. in the low nibbles, 16 + 4t.. in the high).
pub(crate) trait Packed: Weights + Clone {
    /// Where a block's `qs` starts.
    const BLOCK_QS: usize;
    /// Where the tile's nibble vectors start.
    const TILE_QS: usize;
    /// Column c's block bytes before `qs` into the tile's heads.
    fn pack_head(c: usize, block: &[u8], tile: &mut [u8]);
    /// [`Packed::pack_head`] undone.
    fn unpack_head(c: usize, tile: &[u8], block: &mut [u8]);
}

/// Bytes of one of a tile's nibble vectors: a dword per column.
const VECTOR_BYTES: usize = PACK_COLS * 4;
/// Where a tile's second field starts, after the sixteen f16 `d`: Q4_1's `m`, Q5_0's lane masks.
const TILE_SECOND: usize = PACK_COLS * 2;

impl Packed for Q41 {
    const BLOCK_QS: usize = 4;
    const TILE_QS: usize = 64;
    fn pack_head(c: usize, block: &[u8], tile: &mut [u8]) {
        tile[2 * c..2 * c + 2].copy_from_slice(&block[0..2]);
        tile[TILE_SECOND + 2 * c..TILE_SECOND + 2 * c + 2].copy_from_slice(&block[2..4]);
    }
    fn unpack_head(c: usize, tile: &[u8], block: &mut [u8]) {
        block[0..2].copy_from_slice(&tile[2 * c..2 * c + 2]);
        block[2..4].copy_from_slice(&tile[TILE_SECOND + 2 * c..TILE_SECOND + 2 * c + 2]);
    }
}

/// Q5_0's fifth bits in a tile: mask `2t` (`2t + 1`) has bits 4c..4c + 4 set from column c's
/// `qh` bits 4t.. (16 + 4t..), the weights whose bytes vector t lane c holds in its low (high)
/// nibbles: one `kmov` per vector, where unpacking `qh` per column took a shuffle and a compare.
impl Packed for Q50 {
    const BLOCK_QS: usize = 6;
    const TILE_QS: usize = 96;
    fn pack_head(c: usize, block: &[u8], tile: &mut [u8]) {
        tile[2 * c..2 * c + 2].copy_from_slice(&block[0..2]);
        let qh = u32::from_le_bytes(block[2..6].try_into().unwrap());
        for m in 0..8 {
            let nibble = (qh >> (16 * (m % 2) + 4 * (m / 2))) & 0xF;
            let at = TILE_SECOND + 8 * m + c / 2;
            tile[at] = (tile[at] & !(0xF << (4 * (c % 2)))) | ((nibble as u8) << (4 * (c % 2)));
        }
    }
    fn unpack_head(c: usize, tile: &[u8], block: &mut [u8]) {
        block[0..2].copy_from_slice(&tile[2 * c..2 * c + 2]);
        let mut qh = 0u32;
        for m in 0..8 {
            let nibble = (tile[TILE_SECOND + 8 * m + c / 2] >> (4 * (c % 2))) & 0xF;
            qh |= (nibble as u32) << (16 * (m % 2) + 4 * (m / 2));
        }
        block[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

const _: () = assert!(<Q41 as Packed>::TILE_QS + 256 == PACK_COLS * std::mem::size_of::<Q41>());
const _: () = assert!(<Q50 as Packed>::TILE_QS + 256 == PACK_COLS * std::mem::size_of::<Q50>());
const _: () = assert!(VECTOR_BYTES == 64);

/// Weights (`n` columns of `kb` blocks; `src` in GGUF order, or packed) permuted into the
/// other layout. Each group of [`PACK_COLS`] columns keeps its byte range; inside it, block b
/// of the sixteen columns is tile b ([`Packed`]).
fn permute<B: Clone, W: Packed>(src: &[B], n: usize, kb: usize, pack: bool) -> Vec<B> {
    let block = std::mem::size_of::<W>();
    let tile = PACK_COLS * block;
    assert!(
        std::mem::size_of::<B>() == block && n.is_multiple_of(PACK_COLS) && src.len() == n * kb,
        "packing: {n} columns of {kb} blocks"
    );
    let mut out = src.to_vec();
    // SAFETY: plain-old-data blocks viewed as their bytes.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src)),
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(src)),
        )
    };
    let group = PACK_COLS * kb * block;
    for (s, d) in s.chunks_exact(group).zip(d.chunks_exact_mut(group)) {
        for c in 0..PACK_COLS {
            for b in 0..kb {
                let plain = (c * kb + b) * block;
                let t = b * tile;
                for word in 0..4 {
                    let (p, q) = (plain + W::BLOCK_QS + 4 * word, t + W::TILE_QS + VECTOR_BYTES * word + 4 * c);
                    let (from, to) = if pack { (p, q) } else { (q, p) };
                    d[to..to + 4].copy_from_slice(&s[from..from + 4]);
                }
                if pack {
                    W::pack_head(c, &s[plain..plain + block], &mut d[t..t + tile]);
                } else {
                    W::unpack_head(c, &s[t..t + tile], &mut d[plain..plain + block]);
                }
            }
        }
    }
    out
}

/// Q4_1 blocks in GGUF order, packed ([`Packed`]).
pub fn pack_q4_1(plain: &[BlockQ4_1], n: usize, kb: usize) -> Vec<BlockQ4_1> {
    permute::<_, Q41>(plain, n, kb, true)
}

/// [`pack_q4_1`] undone.
pub fn unpack_q4_1(packed: &[BlockQ4_1], n: usize, kb: usize) -> Vec<BlockQ4_1> {
    permute::<_, Q41>(packed, n, kb, false)
}

/// Q5_0 blocks in GGUF order, packed ([`Packed`]).
pub fn pack_q5_0(plain: &[BlockQ5_0], n: usize, kb: usize) -> Vec<BlockQ5_0> {
    permute::<_, Q50>(plain, n, kb, true)
}

/// [`pack_q5_0`] undone.
pub fn unpack_q5_0(packed: &[BlockQ5_0], n: usize, kb: usize) -> Vec<BlockQ5_0> {
    permute::<_, Q50>(packed, n, kb, false)
}

/// Rows the packed kernels run against one pass over a group's tiles. On AVX2 eight rows' sums
/// for both halves of a tile take all sixteen registers, so some live in L1, yet eight rows a
/// pass (half the passes of four) ran Qwen 0.5B's Q5_0 matrices 1.1-1.3x as fast (a Zen 2).
const PACKED_ROWS: usize = 8;

/// [`matmul`] over packed weights, the same bits: with AVX-512 or AVX2 the tier's
/// sixteen-column kernel reads the groups directly at every row count; below AVX2 (forced) a
/// copy is unpacked and the scalar kernels run.
fn matmul_packed<W: Packed>(w: &[W], xq: &[W::Y], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 32;
    assert!(n.is_multiple_of(PACK_COLS) && w.len() == n * kb && xq.len() >= m * kb && out.len() == m * n);
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        let wide = super::isa() == super::Isa::Avx512;
        let ysum: Vec<i32> = if W::OFFSET != 0 { xq[..m * kb].iter().map(qs_sum).collect() } else { Vec::new() };
        let ptr = OutPtr(out.as_mut_ptr());
        return super::parallel_for(n / PACK_COLS, |g| {
            let p = ptr;
            let group = &w[g * PACK_COLS * kb..(g + 1) * PACK_COLS * kb];
            for r0 in (0..m).step_by(PACKED_ROWS) {
                let (ys, sums) = (&xq[r0 * kb..], ysum.get(r0 * kb..).unwrap_or(&[]));
                // Only the first pass reads the group from memory; the others find it cached.
                let (o, first) = (p.0.wrapping_add(r0 * n + g * PACK_COLS), r0 == 0);
                // SAFETY: the tier was detected at run time; rows r0.. and this group's sixteen
                // columns of `out` are written by this task alone.
                macro_rules! rows {
                    ($r:expr) => {
                        unsafe {
                            if wide {
                                avx512::sixteen_packed::<W, { $r }>(group, kb, ys, sums, o, n, first)
                            } else {
                                avx2::sixteen_packed::<W, { $r }>(group, kb, ys, sums, o, n, first)
                            }
                        }
                    };
                }
                match m - r0 {
                    1 => rows!(1),
                    2 => rows!(2),
                    3 => rows!(3),
                    4 => rows!(4),
                    5 => rows!(5),
                    6 => rows!(6),
                    7 => rows!(7),
                    _ => rows!(PACKED_ROWS),
                }
            }
        });
    }
    matmul(&permute::<W, W>(w, n, kb, false), xq, m, k, n, out)
}

/// [`matmul_q4_1`] over weights [`pack_q4_1`] packed: the same bits.
pub fn matmul_q4_1_packed(w: &[BlockQ4_1], xq: &[BlockQ8_1], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: mirror types (see `mirror`).
    let (w, xq) = unsafe { (mirror::<_, Q41>(w), mirror::<_, Q81>(xq)) };
    matmul_packed(w, xq, m, k, n, out)
}

/// [`matmul_q5_0`] over weights [`pack_q5_0`] packed: the same bits.
pub fn matmul_q5_0_packed(w: &[BlockQ5_0], xq: &[BlockQ8_0], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: mirror types (see `mirror`).
    let (w, xq) = unsafe { (mirror::<_, Q50>(w), mirror::<_, Q80>(xq)) };
    matmul_packed(w, xq, m, k, n, out)
}

/// `y = x · Wᵀ` for `m` rows; bitwise equal to Candle's Q4_1 matmul row by row.
pub fn matmul_q4_1(w: &[BlockQ4_1], xq: &[BlockQ8_1], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: mirror types (see `mirror`).
    let (w, xq) = unsafe { (mirror::<_, Q41>(w), mirror::<_, Q81>(xq)) };
    matmul(w, xq, m, k, n, out)
}

/// `y = x · Wᵀ` for `m` rows; bitwise equal to Candle's Q5_0 matmul row by row.
pub fn matmul_q5_0(w: &[BlockQ5_0], xq: &[BlockQ8_0], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: mirror types (see `mirror`).
    let (w, xq) = unsafe { (mirror::<_, Q50>(w), mirror::<_, Q80>(xq)) };
    matmul(w, xq, m, k, n, out)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Pseudo-random bytes (every bit pattern of `qs` and Q5_0's `qh`), `d`/`m` kept finite.
    fn random_blocks<B: Clone>(zero: B, count: usize, seed: u64) -> Vec<B> {
        let mut out = vec![zero; count];
        // SAFETY: plain-old-data blocks viewed as their bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(&out[..])) };
        let mut s = seed | 1;
        for x in bytes.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = s as u8;
        }
        // Each block's leading f16s (d; Q4_1's m) as small normal numbers.
        let size = std::mem::size_of::<B>();
        let heads = if size == std::mem::size_of::<Q41>() { 2 } else { 1 };
        for (i, b) in bytes.chunks_exact_mut(size).enumerate() {
            for h in 0..heads {
                let v = f16::from_f32(((i * 7 + h * 3) % 13) as f32 / 64.0 - 0.09);
                b[2 * h..2 * h + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    fn activations<Y: Clone>(zero: Y, count: usize, seed: u64, with_sum: bool) -> Vec<Y> {
        let mut out = random_blocks(zero, count, seed);
        // SAFETY: as above.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(&out[..])) };
        for (i, b) in bytes.chunks_exact_mut(std::mem::size_of::<Y>()).enumerate() {
            b[0..2].copy_from_slice(&f16::from_f32(0.01 + (i % 5) as f32 * 0.003).to_le_bytes());
            if with_sum {
                b[2..4].copy_from_slice(&f16::from_f32((i % 11) as f32 * 0.25 - 1.0).to_le_bytes());
            }
        }
        out
    }

    /// Packing then unpacking gives back every byte, and the packed kernels give the GGUF
    /// layout's bits at every row count, on the host's widest tier (`tests/kernels.rs` forces
    /// the others, which unpack a copy).
    fn packed_case<B: Clone + PartialEq + std::fmt::Debug, Y: Clone>(
        wzero: B,
        yzero: Y,
        with_sum: bool,
        pack: fn(&[B], usize, usize) -> Vec<B>,
        unpack: fn(&[B], usize, usize) -> Vec<B>,
        plain: fn(&[B], &[Y], usize, usize, usize, &mut [f32]),
        packed: fn(&[B], &[Y], usize, usize, usize, &mut [f32]),
    ) {
        for (n, kb) in [(16, 1), (48, 3), (32, 28), (64, 18)] {
            let w = random_blocks(wzero.clone(), n * kb, 11 + n as u64);
            let p = pack(&w, n, kb);
            assert!(unpack(&p, n, kb) == w, "[{n}, {}]: unpack(pack(w)) != w", 32 * kb);
            let y = activations(yzero.clone(), 19 * kb, 5 + kb as u64, with_sum);
            for m in 1..=19 {
                let (mut want, mut got) = (vec![0f32; m * n], vec![1f32; m * n]);
                plain(&w, &y[..m * kb], m, 32 * kb, n, &mut want);
                packed(&p, &y[..m * kb], m, 32 * kb, n, &mut got);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "[{n}, {}] m={m}: packed != GGUF layout", 32 * kb);
            }
        }
    }

    #[test]
    fn packed_q4_1_gives_the_gguf_layouts_bits() {
        use candle_core::quantized::k_quants::GgmlType;
        packed_case(
            BlockQ4_1::zeros(),
            BlockQ8_1::zeros(),
            true,
            pack_q4_1,
            unpack_q4_1,
            matmul_q4_1,
            matmul_q4_1_packed,
        );
    }

    #[test]
    fn packed_q5_0_gives_the_gguf_layouts_bits() {
        use candle_core::quantized::k_quants::GgmlType;
        packed_case(
            BlockQ5_0::zeros(),
            BlockQ8_0::zeros(),
            false,
            pack_q5_0,
            unpack_q5_0,
            matmul_q5_0,
            matmul_q5_0_packed,
        );
    }

    #[test]
    fn q5_0_unpack_avx2_equals_scalar() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let mut s = 0x9E3779B97F4A7C15u64;
        for _ in 0..200 {
            let mut b = [0u8; 22];
            for x in b.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *x = s as u8;
            }
            b[0] = 0;
            b[1] = 0x3c; // d = 1.0
            let blk = Q50 {
                d: f16::from_bits(u16::from_le_bytes([b[0], b[1]])),
                qh: [b[2], b[3], b[4], b[5]],
                qs: b[6..22].try_into().unwrap(),
            };
            let mut got = [0u8; 32];
            // SAFETY: AVX2 checked above.
            unsafe { std::arch::x86_64::_mm256_storeu_si256(got.as_mut_ptr() as *mut _, blk.u_avx2()) };
            assert_eq!(got, blk.u());
        }
    }
}
