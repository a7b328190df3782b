//! Q4_K and Q6_K × Q8_K for the CPU `gemv` and `invariant` kernels.
//!
//! These define their own per-element arithmetic (Candle's x86 path for them is an eight-lane
//! float reduction per element, and its multi-row path repacks the weights into another order):
//! per 256-weight super-block, the integer part is exact —
//!
//! * `isum = Σ_j sc_j · Σ_{e∈j} u_e·y_e − OFFSET · Σ_j sc_j · bsum_j` (Q6_K: u = q + 32, OFFSET 32),
//! * `imin = Σ_j m_j · Σ_{e∈j} y_e` (Q4_K's sub-block mins),
//!
//! and the float part is one fixed expression, super-block after super-block:
//! `acc = acc + ((d_y·d_x)·isum − (d_y·dmin_x)·imin)` (Q6_K: `acc = acc + (d_y·d_x)·isum`).
//! Integer sums cannot depend on how they are grouped, and the float expression is the same
//! scalar operations whether eight columns (the AVX2 batched kernel), sixteen columns (the
//! AVX-512 batched kernel), one element's partial sums (the one-row kernels) or one element
//! (the portable path) sit in the vector lanes — so every row count gives the same bits, on
//! every x86-64 with AVX2 and on the portable path alike (tested).
//!
//! The batched kernels read the GGUF blocks as they are and transpose four bytes of eight
//! (`avx2::transpose8x4`) or sixteen (`avx512::transpose16x4`) columns into each vector on the
//! fly, once per pass over up to 32 rows, so that one broadcast of a row's four activation
//! bytes serves every column: Candle gets that shape by keeping a repacked copy of the
//! weights, which would break the memory budget and needs no other order of sums.

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ6K, BlockQ8K};
use half::f16;

use super::cpu_q32::mirror;
use super::OutPtr;

/// Mirrors Candle's `#[repr(C)]` `BlockQ4K`.
#[repr(C)]
pub(crate) struct Q4K {
    d: f16,
    dmin: f16,
    scales: [u8; 12],
    qs: [u8; 128],
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ6K`.
#[repr(C)]
pub(crate) struct Q6K {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [i8; 16],
    d: f16,
}
/// Mirrors Candle's `#[repr(C)]` `BlockQ8K`.
#[repr(C)]
pub(crate) struct Q8K {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 256],
    pub(crate) bsums: [i16; 16],
}
const _: () = assert!(std::mem::size_of::<Q4K>() == std::mem::size_of::<BlockQ4K>());
const _: () = assert!(std::mem::size_of::<Q6K>() == std::mem::size_of::<BlockQ6K>());
const _: () = assert!(std::mem::size_of::<Q8K>() == std::mem::size_of::<BlockQ8K>());
const _: () = assert!(std::mem::align_of::<Q8K>() == std::mem::align_of::<BlockQ8K>());

/// A super-block unpacked: 256 unsigned weights in element order, a scale per 16 weights,
/// and the coefficients its `bsums` term takes (Q4_K: each sub-block's min, twice; Q6_K: the
/// scales).
pub(crate) struct Unpacked {
    u: [[u8; 32]; 8],
    sc: [i16; 16],
    bcoef: [i16; 16],
}

pub(crate) trait KBlock: Sync + 'static {
    /// Q6_K stores u = q + 32.
    const OFFSET: i32;
    const HAS_MIN: bool;
    fn unpack(&self) -> Unpacked;
    /// The exact integer partial sums (Σ sc·u·y, Σ bcoef·bsums) of this block against `y`, in
    /// eight i32 lanes each, unpacking as it goes: the one-row kernel uses each block once.
    /// SAFETY: AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn partials_with(
        &self,
        y: &Q8K,
        controls: &avx2::ScaleControls,
    ) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i);
    /// [`KBlock::partials_with`] two 32-weight chunks per 512-bit vector: other lanes, the same
    /// two exact integer totals.
    /// SAFETY: AVX-512 F/BW/VL and VNNI must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn partials_avx512(&self, y: &Q8K) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m256i);
    fn d(&self) -> f32;
    fn dmin(&self) -> f32;
    /// Up to [`TILE_ROWS`] rows against sixteen columns, columns in the lanes: `out[r]`
    /// lane c is row r · column `col(c)`, each lane exactly [`element`]'s.
    /// SAFETY: AVX-512 F/BW/VL and VNNI must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn sixteen_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) where
        Self: Sized;
    /// Rows from which the AVX2 tier runs [`KBlock::eight_columns`] (fewer take the one-row
    /// kernel per element): on the EPYC, Q4_K's eight-column kernel beats two one-row passes
    /// (Qwen2.5 1.5B's 8960 × 1536 at two rows: 0.63 against 0.81 ms), Q6_K's only from three
    /// (1536 × 8960: 1.10 against 0.92 ms at two rows, 1.30 against 2.34 at three).
    #[cfg(target_arch = "x86_64")]
    const EIGHT_MIN_ROWS: usize;
    /// Rows up to which the AVX-512 tier reads each column once for all rows, in order
    /// ([`elements_avx512`]), rather than transposing sixteen columns ([`KBlock::sixteen_columns`]),
    /// for columns of fewer than [`KBlock::FEW_ROWS_MAX_BLOCKS`] super-blocks: a verification run
    /// or a few decoding sequences do not pay for the transposes, and the columns' bytes stream
    /// in order. Measured on the Zen 4 EPYC with Qwen2.5 1.5B's matrices, from memory
    /// (`cargo bench --bench kernels -- --rows 1,2,3,4,5,8`, the cold column): Q6_K's 151936 ×
    /// 1536 output at 2/5/8 rows 6.2/11.4/19.3 ms against 18.1/21.6/23.9; its k = 8960
    /// `ffn_down` 0.41/0.52/0.84/1.14 at 1/2/5/8 rows against 1.02/1.04/1.27/1.31 (so Q6_K takes
    /// it at one row too, past [`SIXTEEN_ONE_ROW_MIN_BLOCKS`], which was measured on Q4_K).
    /// Q4_K's 8960 × 1536 at 2/5 rows 0.39/0.67 against 0.66/0.85, but 1.16 against 0.95 at 8;
    /// its k = 8960 `ffn_down` loses from 3 rows (0.51 against 0.39), and at one row it keeps
    /// the Xeon's rule (here the one-row kernel would win, 0.26–0.31 against 0.37–0.41).
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX: usize;
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX_BLOCKS: usize;
    /// [`KBlock::sixteen_columns`] eight columns wide, in AVX2, for up to [`TILE_ROWS`] rows.
    /// SAFETY: AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn eight_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) where
        Self: Sized;
}

impl KBlock for Q4K {
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    #[cfg(target_arch = "x86_64")]
    const EIGHT_MIN_ROWS: usize = 2;
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX: usize = 5;
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX_BLOCKS: usize = SIXTEEN_ONE_ROW_MIN_BLOCKS;
    #[cfg(target_arch = "x86_64")]
    unsafe fn sixteen_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) {
        avx512::q4k_sixteen_columns(col, kb, ys, rows, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn eight_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) {
        eight::q4k_eight_columns(col, kb, ys, rows, out)
    }
    fn unpack(&self) -> Unpacked {
        let sm = |j: usize| self.scale_min(j);
        let mut sc = [0i16; 16];
        let mut bcoef = [0i16; 16];
        for j in 0..8 {
            let (s, m) = sm(j);
            sc[2 * j] = s as i16;
            sc[2 * j + 1] = s as i16;
            bcoef[2 * j] = m as i16;
            bcoef[2 * j + 1] = m as i16;
        }
        let u = std::array::from_fn(|c| {
            let src = &self.qs[32 * (c / 2)..32 * (c / 2) + 32];
            std::array::from_fn(|l| if c % 2 == 0 { src[l] & 0xF } else { src[l] >> 4 })
        });
        Unpacked { u, sc, bcoef }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn partials_with(
        &self,
        y: &Q8K,
        controls: &avx2::ScaleControls,
    ) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let (dup, bcoef) = self.scales_mins();
        let mut acc = _mm256_setzero_si256();
        for i in 0..4 {
            let (lo, hi) = self.nibbles(i);
            for (c, u) in [(2 * i, lo), (2 * i + 1, hi)] {
                let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * c) as *const __m256i);
                let sc = _mm256_shuffle_epi8(dup, avx2::broadcast_i16(controls, c, c));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, yq), sc));
            }
        }
        (acc, _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i), bcoef))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn partials_avx512(&self, y: &Q8K) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let (dup, bcoef) = self.scales_mins();
        let scales = _mm512_castsi256_si512(dup);
        let mut acc = _mm512_setzero_si512();
        for i in 0..4 {
            // Chunks 2i and 2i + 1: the low and the high nibbles of the same 32 bytes.
            let q = super::avx512::both(_mm256_loadu_si256(self.qs.as_ptr().add(32 * i) as *const __m256i));
            let u = _mm512_and_si512(_mm512_mask_srli_epi16::<4>(q, 0xFFFF_0000, q), _mm512_set1_epi8(0x0F));
            let yq = _mm512_loadu_si512(y.qs.as_ptr().add(64 * i) as *const _);
            let sc = avx512::runs_of_i16(scales, 2 * i, 16);
            acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u, yq), sc);
        }
        (acc, _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i), bcoef))
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn dmin(&self) -> f32 {
        self.dmin.to_f32()
    }
}

#[cfg(target_arch = "x86_64")]
impl Q4K {
    /// Sub-block `j`'s 6-bit scale and min, unpacked from the 12 packed bytes.
    #[inline(always)]
    fn scale_min(&self, j: usize) -> (u8, u8) {
        let q = &self.scales;
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
        }
    }

    /// Weights `64i..64i+32` and `64i+32..64i+64`: the low and high nibbles of `qs[32i..]`.
    #[inline(always)]
    unsafe fn nibbles(&self, i: usize) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let mask = _mm256_set1_epi8(0x0F);
        let q = _mm256_loadu_si256(self.qs.as_ptr().add(32 * i) as *const __m256i);
        (_mm256_and_si256(q, mask), _mm256_and_si256(_mm256_srli_epi16(q, 4), mask))
    }

    /// The eight 6-bit scales as i16 in both 128-bit halves, and each 16 weights' min (the
    /// `bsums` coefficients) as i16 (llama.cpp's `utmp` shuffle).
    #[inline(always)]
    unsafe fn scales_mins(&self) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let sm = self.scale_min_bytes();
        let scales16 = _mm256_cvtepu8_epi16(sm);
        let dup = _mm256_permute2x128_si256(scales16, scales16, 0x00);
        (dup, _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm)))
    }

    /// The eight 6-bit scales (bytes 0-7) and mins (bytes 8-15), unpacked.
    #[inline(always)]
    unsafe fn scale_min_bytes(&self) -> std::arch::x86_64::__m128i {
        use std::arch::x86_64::*;
        // The twelve bytes q and four of `qs` after them (inside the block), in one register;
        // bytes 0-7 of `sm` are the scales, 8-15 the mins: scales and mins 0-3 are the low six
        // bits of q[0..4], q[4..8]; scales 4-7 take q[8..12]'s low nibbles, mins 4-7 their high
        // nibbles, and both take the top two bits of q[0..4] (scales) or q[4..8] (mins) as bits
        // 4-5. Sixteen bytes at once, where scalar code spends some twenty operations.
        let q = _mm_loadu_si128((self as *const Self as *const u8).add(4) as *const __m128i);
        let low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        let top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        let keep = |v: __m128i, m: i64, m_hi: i64| _mm_and_si128(v, _mm_set_epi64x(m_hi, m));
        let low = _mm_or_si128(
            keep(low, 0x0F0F_0F0F_3F3F_3F3F, 0x0000_0000_3F3F_3F3F),
            keep(_mm_srli_epi16(low, 4), 0, 0x0F0F_0F0F_0000_0000),
        );
        _mm_or_si128(low, keep(_mm_srli_epi16(top, 2), 0x3030_3030_0000_0000, 0x3030_3030_0000_0000))
    }
}

impl KBlock for Q6K {
    const OFFSET: i32 = 32;
    const HAS_MIN: bool = false;
    #[cfg(target_arch = "x86_64")]
    const EIGHT_MIN_ROWS: usize = 3;
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX: usize = FEW_ROWS_MAX;
    #[cfg(target_arch = "x86_64")]
    const FEW_ROWS_MAX_BLOCKS: usize = usize::MAX;
    #[cfg(target_arch = "x86_64")]
    unsafe fn sixteen_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) {
        avx512::q6k_sixteen_columns(col, kb, ys, rows, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn eight_columns<'a>(
        col: impl Fn(usize) -> &'a [Self],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) {
        eight::q6k_eight_columns(col, kb, ys, rows, out)
    }
    fn unpack(&self) -> Unpacked {
        let u = std::array::from_fn(|c| {
            let (n, t) = (c / 4, c % 4);
            let ql = &self.ql[64 * n + 32 * (t % 2)..64 * n + 32 * (t % 2) + 32];
            let qh = &self.qh[32 * n..32 * n + 32];
            std::array::from_fn(|l| {
                let lo = if t < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
                lo | (((qh[l] >> (2 * t)) & 3) << 4)
            })
        });
        let sc = self.scales.map(|s| s as i16);
        Unpacked { u, sc, bcoef: sc }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn partials_with(
        &self,
        y: &Q8K,
        controls: &avx2::ScaleControls,
    ) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let (lo, hi, bcoef) = self.scale_halves();
        let mut acc = _mm256_setzero_si256();
        for n in 0..2 {
            for (t, u) in self.sixes(n).into_iter().enumerate() {
                let c = 4 * n + t;
                let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * c) as *const __m256i);
                acc = _mm256_add_epi32(
                    acc,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, yq), Self::scale(lo, hi, c, controls)),
                );
            }
        }
        (acc, _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i), bcoef))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn partials_avx512(&self, y: &Q8K) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let (m4, m2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x03));
        let bcoef = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const __m128i));
        let scales = _mm512_castsi256_si512(bcoef);
        let mut acc = _mm512_setzero_si512();
        for n in 0..2 {
            // Chunks 4n, 4n + 1 take the low nibbles of ql[64n..64n + 64] and bits 0-1, 2-3 of
            // qh[32n..]; chunks 4n + 2, 4n + 3 the high nibbles and bits 4-5, 6-7.
            let ql = _mm512_loadu_si512(self.ql.as_ptr().add(64 * n) as *const _);
            let qh = super::avx512::both(_mm256_loadu_si256(self.qh.as_ptr().add(32 * n) as *const __m256i));
            let qh = _mm512_mask_srli_epi16::<2>(qh, 0xFFFF_0000, qh);
            for (t, (lo, hi)) in
                [(ql, qh), (_mm512_srli_epi16::<4>(ql), _mm512_srli_epi16::<4>(qh))].into_iter().enumerate()
            {
                let u = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_slli_epi16::<4>(_mm512_and_si512(hi, m2)));
                let c = 4 * n + 2 * t;
                let yq = _mm512_loadu_si512(y.qs.as_ptr().add(32 * c) as *const _);
                acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u, yq), avx512::runs_of_i16(scales, 2 * c, 8));
            }
        }
        (acc, _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i), bcoef))
    }
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn dmin(&self) -> f32 {
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
impl Q6K {
    /// Weights `128n..128n+128` as u = q + 32, 32 to a register.
    #[inline(always)]
    unsafe fn sixes(&self, n: usize) -> [std::arch::x86_64::__m256i; 4] {
        use std::arch::x86_64::*;
        let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
        let hi = |qh: __m256i, t: i32| {
            // ((qh >> 2t) & 3) << 4, bytewise (16-bit shifts, then the byte mask).
            let v = match t {
                0 => qh,
                1 => _mm256_srli_epi16(qh, 2),
                2 => _mm256_srli_epi16(qh, 4),
                _ => _mm256_srli_epi16(qh, 6),
            };
            _mm256_slli_epi16(_mm256_and_si256(v, m2), 4)
        };
        let ql0 = _mm256_loadu_si256(self.ql.as_ptr().add(64 * n) as *const __m256i);
        let ql1 = _mm256_loadu_si256(self.ql.as_ptr().add(64 * n + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * n) as *const __m256i);
        [
            _mm256_or_si256(_mm256_and_si256(ql0, m4), hi(qh, 0)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), hi(qh, 1)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), hi(qh, 2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), hi(qh, 3)),
        ]
    }

    /// The sixteen scales as i16: the low eight in both halves, the high eight in both halves,
    /// and all sixteen in order (the `bsums` coefficients).
    #[inline(always)]
    unsafe fn scale_halves(
        &self,
    ) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let bcoef = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const __m128i));
        (_mm256_permute2x128_si256(bcoef, bcoef, 0x00), _mm256_permute2x128_si256(bcoef, bcoef, 0x11), bcoef)
    }

    /// Weights `32c..32c+32`'s two scales, one per 16-weight half.
    #[inline(always)]
    unsafe fn scale(
        lo: std::arch::x86_64::__m256i,
        hi: std::arch::x86_64::__m256i,
        c: usize,
        controls: &avx2::ScaleControls,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let (a, b) = (2 * c, 2 * c + 1);
        if c < 4 {
            _mm256_shuffle_epi8(lo, avx2::broadcast_i16(controls, a, b))
        } else {
            _mm256_shuffle_epi8(hi, avx2::broadcast_i16(controls, a - 8, b - 8))
        }
    }
}

/// The exact integer parts of one super-block against one activation block: (isum, imin).
fn int_parts<W: KBlock>(x: &Unpacked, y: &Q8K) -> (i32, i32) {
    let mut isum = 0i32;
    for (c, u) in x.u.iter().enumerate() {
        for half in 0..2 {
            let r = 16 * half..16 * half + 16;
            let dot: i32 = u[r.clone()].iter().zip(&y.qs[32 * c..][r]).map(|(&u, &q)| u as i32 * q as i32).sum();
            isum += x.sc[2 * c + half] as i32 * dot;
        }
    }
    let bdot: i32 = x.bcoef.iter().zip(&y.bsums).map(|(&c, &b)| c as i32 * b as i32).sum();
    if W::HAS_MIN {
        (isum, bdot)
    } else {
        (isum - W::OFFSET * bdot, 0)
    }
}

/// The float step every path computes, lane by lane.
#[inline(always)]
fn step<W: KBlock>(acc: f32, isum: i32, imin: i32, xd: f32, xdmin: f32, yd: f32) -> f32 {
    if W::HAS_MIN {
        acc + ((yd * xd) * isum as f32 - (yd * xdmin) * imin as f32)
    } else {
        acc + (yd * xd) * isum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::KBlock;
    use std::arch::x86_64::*;

    /// `_mm256_shuffle_epi8` controls: entry `a * 8 + b` fills the low half with i16 lane `a`
    /// and the high half with i16 lane `b` of a 128-bit source repeated in both halves.
    pub struct ScaleControls([[u8; 32]; 64]);

    /// The controls, hidden from the optimizer once per one-row call ([`std::hint::black_box`]):
    /// seeing constants, it rewrote each of Q4_K's one-instruction `vpshufb`s into a shift and a
    /// lane-crossing broadcast, and the one-row Q4_K kernel ran 1.06-1.09x as fast without that
    /// on a Zen 2 (docs/BENCHMARKS.md, "Q4_K's scale shuffles kept as shuffles"). Hidden once per
    /// block instead, the loads were not hoisted and the gain was smaller; Q6_K moved within 1%.
    #[inline(always)]
    pub fn scale_controls() -> &'static ScaleControls {
        std::hint::black_box(&BROADCAST_I16)
    }

    static BROADCAST_I16: ScaleControls = ScaleControls({
        let mut t = [[0u8; 32]; 64];
        let mut i = 0;
        while i < 64 {
            let (a, b) = ((2 * (i / 8)) as u8, (2 * (i % 8)) as u8);
            let mut j = 0;
            while j < 16 {
                t[i][j] = a + (j % 2) as u8;
                t[i][16 + j] = b + (j % 2) as u8;
                j += 1;
            }
            i += 1;
        }
        t
    });

    #[inline(always)]
    pub unsafe fn broadcast_i16(controls: &ScaleControls, a: usize, b: usize) -> __m256i {
        _mm256_loadu_si256(controls.0[a * 8 + b].as_ptr() as *const __m256i)
    }

    /// The sum of eight i32 lanes.
    #[inline(always)]
    pub unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// `(hsum(p), hsum(q))` in one tree of adds (integer sums: any order gives the same).
    #[inline(always)]
    pub unsafe fn hsum2(p: __m256i, q: __m256i) -> (i32, i32) {
        let t = _mm256_hadd_epi32(p, q);
        let u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        let v = _mm_hadd_epi32(u, u);
        (_mm_cvtsi128_si32(v), _mm_extract_epi32(v, 1))
    }

    /// [`super::step`] on eight lanes: the same IEEE operations in the same order.
    #[inline(always)]
    pub unsafe fn step8<W: KBlock>(
        acc: __m256,
        isum: __m256i,
        ib: __m256i,
        xd: __m256,
        xdmin: __m256,
        yd: __m256,
    ) -> __m256 {
        if W::HAS_MIN {
            let a = _mm256_mul_ps(_mm256_mul_ps(yd, xd), _mm256_cvtepi32_ps(isum));
            let b = _mm256_mul_ps(_mm256_mul_ps(yd, xdmin), _mm256_cvtepi32_ps(ib));
            _mm256_add_ps(acc, _mm256_sub_ps(a, b))
        } else {
            let isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(ib, _mm256_set1_epi32(W::OFFSET)));
            _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(yd, xd), _mm256_cvtepi32_ps(isum)))
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod eight {
    use super::super::avx2::{f16_halves, transpose8x4};
    use super::{avx2::step8, Q4K, Q6K, Q8K, TILE_ROWS, Y_QS};
    use std::arch::x86_64::*;

    /// Columns ahead the kernels prefetch: the next tile's eight, which the same thread reads next.
    const AHEAD: usize = 8;

    /// An i32 lane's low i16 in both its halves: a coefficient that `madd` against an i16 pair
    /// multiplies into both.
    #[inline(always)]
    unsafe fn pair(v: __m256i) -> __m256i {
        _mm256_or_si256(_mm256_slli_epi32::<16>(v), _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)))
    }

    /// The four bytes at `y` in every i32 lane.
    #[inline(always)]
    unsafe fn broadcast(y: *const i32) -> __m256i {
        _mm256_set1_epi32(y.read_unaligned())
    }

    /// The eight columns' blocks `b` as raw addresses (bounds checked by the caller), with the
    /// next tile's asked for.
    #[inline(always)]
    unsafe fn block_addresses<W>(cols: &[&[W]; 8], b: usize, kb: usize) -> [*const u8; 8] {
        let at: [*const u8; 8] = std::array::from_fn(|c| cols[c].as_ptr().add(b) as *const u8);
        for &a in &at {
            super::super::prefetch_at(&*(a as *const W), AHEAD * kb * std::mem::size_of::<W>());
        }
        at
    }

    /// Up to [`TILE_ROWS`] rows (`ys`, row r's blocks at `r * kb`) against eight Q4_K columns
    /// (`col(c)` is column c's blocks), columns in the lanes: the weights are transposed four
    /// bytes per lane as they are read, so each 4-weight group of every column takes one
    /// `maddubs` against a row's four activation bytes broadcast, and one transposed load serves
    /// every row. A sub-block's eight `maddubs` sum in i16 (|Σ| ≤ 8 · 2 · 15 · 128 = 30,720),
    /// then one `madd` against the scale; each lane runs [`super::step`] on exact integer sums:
    /// the one-row bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4k_eight_columns<'a>(
        col: impl Fn(usize) -> &'a [Q4K],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) {
        let cols: [&[Q4K]; 8] = std::array::from_fn(&col);
        assert!(cols.iter().all(|c| c.len() >= kb));
        let segments = |b: usize, s: usize| {
            // Raw addresses, checked once above.
            let at = if s == 0 {
                block_addresses(&cols, b, kb)
            } else {
                std::array::from_fn(|c| cols[c].as_ptr().add(b) as *const u8)
            };
            transpose8x4(|c| at[c].add(16 * s))
        };
        q4k_tile_rows(segments, kb, ys, rows, out)
    }

    /// Bytes `16s..16s + 16` of the eight columns `8h..8h + 8` of a packed Q4_K group's tile at
    /// `tile` ([`super::pack_q4k`]): vector t lane c is column `8h + c`'s dword t, one load each.
    #[inline(always)]
    unsafe fn packed_segment(tile: *const u8, s: usize, h: usize) -> [__m256i; 4] {
        std::array::from_fn(|t| _mm256_loadu_si256(tile.add(256 * s + 64 * t + 32 * h) as *const __m256i))
    }

    /// A packed Q4_K group of sixteen columns ([`super::pack_q4k`]) for up to [`TILE_ROWS`]
    /// rows on the AVX2 tier: up to four rows through [`q4k_packed_few`] (both eight-column
    /// halves of a tile in one pass, every sum in registers), more through
    /// [`q4k_tile_rows`] once per half, each segment a load where the GGUF layout takes a
    /// transpose. The same lanes, the same arithmetic: the one-row bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4k_sixteen_packed(
        group: &[Q4K],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
        first_pass: bool,
    ) {
        assert!(group.len() >= 16 * kb && ys.len() >= rows * kb && out.len() >= rows);
        let base = group.as_ptr() as *const u8;
        match rows {
            1 => q4k_packed_few::<1>(base, kb, ys, out),
            2 => q4k_packed_few::<2>(base, kb, ys, out),
            3 => q4k_packed_few::<3>(base, kb, ys, out),
            4 => q4k_packed_few::<4>(base, kb, ys, out),
            _ => {
                let mut got = [[0f32; 8]; TILE_ROWS];
                for h in 0..2 {
                    let segments = |b: usize, s: usize| {
                        let tile = base.add(b * PACKED_TILE);
                        // Five rows or more: the multi-row distance.
                        if first_pass && h == 0 {
                            ask_ahead::<TILE_ROWS>(tile, s);
                        }
                        packed_segment(tile, s, h)
                    };
                    q4k_tile_rows(segments, kb, ys, rows, &mut got);
                    for (o, g) in out.iter_mut().zip(&got[..rows]) {
                        o[8 * h..8 * h + 8].copy_from_slice(g);
                    }
                }
            }
        }
    }

    /// Asks for the segment that lies ahead of segment `s` of `tile`, into L2, for a pass of `R`
    /// rows: [`crate::kernels::ONE_ROW_AHEAD`] bytes ahead at one row (four segments: the rest
    /// of the tile and the next one's start), [`crate::kernels::TILE_PREFETCH_AHEAD`] at more.
    /// Without it a packed group read from memory at 20 GB/s on a Zen 2 where the GGUF layout's
    /// one-row kernel, which asks 4 KiB ahead, read at 27.
    #[inline(always)]
    unsafe fn ask_ahead<const R: usize>(tile: *const u8, s: usize) {
        let segment = tile.wrapping_add(256 * s);
        if R == 1 {
            crate::kernels::prefetch_one_row_ahead(segment, 256)
        } else {
            crate::kernels::prefetch_tile_ahead(segment, 256)
        }
    }

    /// Bytes of one packed Q4_K tile: a super-block of sixteen columns.
    const PACKED_TILE: usize = 16 * std::mem::size_of::<Q4K>();

    /// [`q4k_tile_rows`]'s arithmetic for `R` (one to four) rows over a packed group, both
    /// eight-column halves of each tile in one pass, so the tile's bytes are read once and in
    /// order, and every sum stays in a register (the general kernel keeps its rows' sums on
    /// the stack).
    #[inline(always)]
    unsafe fn q4k_packed_few<const R: usize>(base: *const u8, kb: usize, ys: &[Q8K], out: &mut [[f32; 16]]) {
        let m4 = _mm256_set1_epi8(0x0F);
        let spread = spread();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..kb {
            let tile = base.add(b * PACKED_TILE);
            let mut isum = [[_mm256_setzero_si256(); 2]; R];
            // The tile ahead is asked for a segment at a time, spread over this one's work:
            // asked for at once, its 36 lines stalled the reads. At one row, with the scales
            // read first (below), two segments at the top of each `i`, where LLVM gathers them
            // unless fenced, read memory 0.89-0.94x as fast on a Zen 2 as one per half; at two
            // rows the fence cost more compute than it saved.
            ask_ahead::<R>(tile, 0);
            let sc: [[__m256i; 8]; 2] = std::array::from_fn(|h| {
                let [_, s0, _, s2] = packed_segment(tile, 0, h);
                scale_pairs(s0, s2, &spread)
            });
            for i in 0..4 {
                for h in 0..2 {
                    ask_ahead::<R>(tile, 1 + 2 * i + h);
                    if R == 1 {
                        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                    }
                    let (lo, hi) = (packed_segment(tile, 1 + 2 * i, h), packed_segment(tile, 2 + 2 * i, h));
                    let q = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                    for half in 0..2 {
                        let j = 2 * i + half;
                        let mut a = [_mm256_setzero_si256(); R];
                        for (t, &q) in q.iter().enumerate() {
                            let u = if half == 0 {
                                _mm256_and_si256(q, m4)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4)
                            };
                            for (r, a) in a.iter_mut().enumerate() {
                                let y = ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + 32 * j) as *const i32;
                                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(u, broadcast(y.add(t))));
                            }
                        }
                        for (s, a) in isum.iter_mut().zip(a) {
                            s[h] = _mm256_add_epi32(s[h], _mm256_madd_epi16(a, sc[h][j]));
                        }
                    }
                }
            }
            let sums: [[__m256i; 4]; R] = std::array::from_fn(|r| sub_block_sums(&ys[r * kb + b]));
            for h in 0..2 {
                let [dd, _, s1, s2] = packed_segment(tile, 0, h);
                let (xd, xdmin) = f16_halves(dd);
                let mins = six_bits(s1, s2, 4);
                for (r, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
                    let ib = min_term(&mins, &sums[r], &spread);
                    acc[h] = step8::<Q4K>(acc[h], isum[h], ib, xd, xdmin, _mm256_set1_ps(ys[r * kb + b].d));
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), acc[1]);
        }
    }

    /// `_mm256_shuffle_epi8` controls that spread the bytes of each i32 lane into its two i16s:
    /// `0..4`, byte k into both (a scale, paired for `madd`); `4` and `5`, bytes 0 and 1 or 2
    /// and 3, one into each (two mins for one `madd`).
    pub struct Spread([[u8; 32]; 6]);

    static SPREAD: Spread = Spread({
        let mut t = [[0x80u8; 32]; 6];
        let mut k = 0;
        while k < 6 {
            let mut p = 0;
            while p < 32 {
                let (lane, i16_half) = (4 * ((p % 16) / 4) as u8, (p % 4) / 2);
                if p % 2 == 0 {
                    t[k][p] = lane + if k < 4 { k as u8 } else { (2 * (k - 4) + i16_half) as u8 };
                }
                p += 1;
            }
            k += 1;
        }
        t
    });

    /// The controls, hidden from the optimizer once per call: seeing constants, it rewrites a
    /// one-instruction `vpshufb` into shifts and masks (as for `avx2::scale_controls`).
    #[inline(always)]
    unsafe fn spread() -> [__m256i; 6] {
        let t = std::hint::black_box(&SPREAD);
        std::array::from_fn(|k| _mm256_loadu_si256(t.0[k].as_ptr() as *const __m256i))
    }

    /// `Q4K::scale_min`'s six-bit scales (`low` = q[0..4], `nibble` 0) or mins (`low` = q[4..8],
    /// `nibble` 4) of eight columns, lane by lane, as bytes: sub-block j is byte j % 4 of vector
    /// j / 4. Sub-blocks 0-3 are the low six bits of `low`; 4-7 a nibble of q[8..12] (`s2`) with
    /// the top two bits of `low` above it. Every byte is masked, so 16-bit shifts serve.
    #[inline(always)]
    unsafe fn six_bits(low: __m256i, s2: __m256i, nibble: u32) -> [__m256i; 2] {
        let nib = if nibble == 0 { s2 } else { _mm256_srli_epi16::<4>(s2) };
        let top = _mm256_and_si256(_mm256_srli_epi16::<2>(low), _mm256_set1_epi8(0x30));
        [
            _mm256_and_si256(low, _mm256_set1_epi8(0x3F)),
            _mm256_or_si256(_mm256_and_si256(nib, _mm256_set1_epi8(0x0F)), top),
        ]
    }

    /// The eight sub-blocks' scales of eight columns ([`six_bits`]), each in both i16 halves of
    /// its lane, for `madd`: one shuffle each.
    #[inline(always)]
    unsafe fn scale_pairs(s0: __m256i, s2: __m256i, spread: &[__m256i; 6]) -> [__m256i; 8] {
        let bytes = six_bits(s0, s2, 0);
        std::array::from_fn(|j| _mm256_shuffle_epi8(bytes[j / 4], spread[j % 4]))
    }

    /// Row `y`'s (bsums of sub-block 2k, of 2k + 1) as an i16 pair in every lane, k = 0..4: each
    /// sub-block's two sums of sixteen added first (|Σ| ≤ 32 · 128, exact in i16).
    #[inline(always)]
    unsafe fn sub_block_sums(y: &Q8K) -> [__m256i; 4] {
        let bs = y.bsums.as_ptr() as *const __m128i;
        let s = _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs.add(1)));
        [
            _mm256_broadcastd_epi32(s),
            _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0x55>(s)),
            _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0xAA>(s)),
            _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0xFF>(s)),
        ]
    }

    /// A row's mins term, lane by lane: Σ_j mins_j · (the sub-block sums j of [`sub_block_sums`]),
    /// exact in i32, two sub-blocks a `madd`; `mins` from [`six_bits`].
    #[inline(always)]
    unsafe fn min_term(mins: &[__m256i; 2], sums: &[__m256i; 4], spread: &[__m256i; 6]) -> __m256i {
        let term = |k: usize| _mm256_madd_epi16(_mm256_shuffle_epi8(mins[k / 2], spread[4 + k % 2]), sums[k]);
        _mm256_add_epi32(_mm256_add_epi32(term(0), term(1)), _mm256_add_epi32(term(2), term(3)))
    }

    /// Up to [`TILE_ROWS`] rows (`ys`, row r's blocks at `r * kb`) against eight Q4_K columns
    /// whose super-block b's bytes `16s..16s + 16` are `segments(b, s)` (vector t lane c:
    /// column c's dword t).
    #[inline(always)]
    unsafe fn q4k_tile_rows(
        mut segments: impl FnMut(usize, usize) -> [__m256i; 4],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) {
        debug_assert!(rows <= TILE_ROWS && out.len() >= rows);
        let m4 = _mm256_set1_epi8(0x0F);
        let spread = spread();
        let mut acc = [_mm256_setzero_ps(); TILE_ROWS];
        let mut isum = [_mm256_setzero_si256(); TILE_ROWS];
        assert!(ys.len() >= rows * kb);
        for b in 0..kb {
            // d and dmin, then the twelve scale bytes q[0..12] as three dwords per lane.
            let [dd, s0, s1, s2] = segments(b, 0);
            let (xd, xdmin) = f16_halves(dd);
            let sc = scale_pairs(s0, s2, &spread);
            let mins = six_bits(s1, s2, 4);
            isum[..rows].fill(_mm256_setzero_si256());
            for i in 0..4 {
                let (lo, hi) = (segments(b, 1 + 2 * i), segments(b, 2 + 2 * i));
                let q = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                // Sub-block 2i in the low nibbles, 2i + 1 in the high.
                for half in 0..2 {
                    let u: [__m256i; 8] = std::array::from_fn(|t| {
                        if half == 0 {
                            _mm256_and_si256(q[t], m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q[t]), m4)
                        }
                    });
                    let (j, first) = (2 * i + half, 64 * i + 32 * half);
                    for (r, isum) in isum[..rows].iter_mut().enumerate() {
                        let y = ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + first) as *const i32;
                        let mut a = _mm256_setzero_si256();
                        for (t, &u) in u.iter().enumerate() {
                            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(u, broadcast(y.add(t))));
                        }
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(a, sc[j]));
                    }
                }
            }
            for (r, (acc, &isum)) in acc[..rows].iter_mut().zip(&isum).enumerate() {
                let y = &ys[r * kb + b];
                let ib = min_term(&mins, &sub_block_sums(y), &spread);
                *acc = step8::<Q4K>(*acc, isum, ib, xd, xdmin, _mm256_set1_ps(y.d));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc[..rows]) {
            _mm256_storeu_ps(o.as_mut_ptr(), *a);
        }
    }

    /// [`q4k_eight_columns`] for Q6_K: per 16-weight half, four transposed dwords of `ql` (two
    /// places) and `qh` give the four chunks' 6-bit weights, each 4-weight group summed by
    /// `maddubs` against a row's broadcast bytes. Two groups' sums still fit in i16
    /// (2 · 2 · 63 · 128 = 32,256), so a half takes two `madd`s against its scale; the `bsums`
    /// term and the float step are [`super::step`]'s, lane by lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q6k_eight_columns<'a>(
        col: impl Fn(usize) -> &'a [Q6K],
        kb: usize,
        ys: &[Q8K],
        rows: usize,
        out: &mut [[f32; 8]],
    ) {
        debug_assert!(rows <= TILE_ROWS && out.len() >= rows);
        let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let mut acc = [_mm256_setzero_ps(); TILE_ROWS];
        let mut isum = [_mm256_setzero_si256(); TILE_ROWS];
        let cols: [&[Q6K]; 8] = std::array::from_fn(&col);
        assert!(cols.iter().all(|c| c.len() >= kb) && ys.len() >= rows * kb);
        for b in 0..kb {
            let at = block_addresses(&cols, b, kb);
            // The block ends two bytes after its scales, so `d` comes in lane by lane.
            let d: [u16; 8] = std::array::from_fn(|c| (*(at[c] as *const Q6K)).d.to_bits());
            let xd = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const __m128i));
            let packed = transpose8x4(|c| at[c].add(std::mem::offset_of!(Q6K, scales)));
            // Scale s (i8) sign-extended in each lane.
            let sc: [__m256i; 16] = std::array::from_fn(|s| {
                let v = packed[s / 4];
                _mm256_srai_epi32::<24>(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * (s % 4) as i32)))
            });
            isum[..rows].fill(_mm256_setzero_si256());
            for n in 0..2 {
                for half in 0..2 {
                    let (ql, qh) = (std::mem::offset_of!(Q6K, ql), std::mem::offset_of!(Q6K, qh));
                    let a = transpose8x4(|c| at[c].add(ql + 64 * n + 16 * half));
                    let bq = transpose8x4(|c| at[c].add(ql + 64 * n + 32 + 16 * half));
                    let h = transpose8x4(|c| at[c].add(qh + 32 * n + 16 * half));
                    for t in 0..4 {
                        // `Q6K::unpack` for chunk 4n + t: a nibble of `ql`, two bits of `qh`.
                        let u: [__m256i; 4] = std::array::from_fn(|g| {
                            let (lo, hi) = match t {
                                0 => (_mm256_and_si256(a[g], m4), _mm256_slli_epi16::<4>(h[g])),
                                1 => (_mm256_and_si256(bq[g], m4), _mm256_slli_epi16::<2>(h[g])),
                                2 => (_mm256_and_si256(_mm256_srli_epi16::<4>(a[g]), m4), h[g]),
                                _ => {
                                    (_mm256_and_si256(_mm256_srli_epi16::<4>(bq[g]), m4), _mm256_srli_epi16::<2>(h[g]))
                                }
                            };
                            _mm256_or_si256(lo, _mm256_and_si256(hi, m30))
                        });
                        let s = 8 * n + 2 * t + half;
                        let scale = pair(sc[s]);
                        for (r, isum) in isum[..rows].iter_mut().enumerate() {
                            let y = ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + 16 * s) as *const i32;
                            let p = |g: usize| _mm256_maddubs_epi16(u[g], broadcast(y.add(g)));
                            let (p01, p23) = (_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
                            *isum = _mm256_add_epi32(
                                *isum,
                                _mm256_add_epi32(_mm256_madd_epi16(p01, scale), _mm256_madd_epi16(p23, scale)),
                            );
                        }
                    }
                }
            }
            // The (scale 2p, scale 2p + 1) pairs as i16, against the (bsums[2p], bsums[2p + 1]) pairs.
            let pairs: [__m256i; 8] = std::array::from_fn(|p| {
                _mm256_or_si256(
                    _mm256_and_si256(sc[2 * p], _mm256_set1_epi32(0xFFFF)),
                    _mm256_slli_epi32::<16>(sc[2 * p + 1]),
                )
            });
            for (r, (acc, &isum)) in acc[..rows].iter_mut().zip(&isum).enumerate() {
                let y = &ys[r * kb + b];
                let bs = y.bsums.as_ptr() as *const i32;
                let mut ib = _mm256_setzero_si256();
                for (p, &pair) in pairs.iter().enumerate() {
                    ib = _mm256_add_epi32(ib, _mm256_madd_epi16(pair, broadcast(bs.add(p))));
                }
                *acc = step8::<Q6K>(*acc, isum, ib, xd, _mm256_setzero_ps(), _mm256_set1_ps(y.d));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc[..rows]) {
            _mm256_storeu_ps(o.as_mut_ptr(), *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::avx512::transpose16x4;
    use super::{KBlock, TILE_ROWS, Y_QS};
    use crate::kernels::cpu_canonical::q6k_slot;
    use std::arch::x86_64::*;

    /// i16 lane l of the result: lane `first + l / run` of `v` (`run` a power of two): each
    /// scale repeated over the products it multiplies.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn runs_of_i16(v: __m512i, first: usize, run: u32) -> __m512i {
        let lane = _mm512_set_epi16(
            31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
            3, 2, 1, 0,
        );
        let idx = _mm512_add_epi16(
            _mm512_srl_epi16(lane, _mm_cvtsi32_si128(run.trailing_zeros() as i32)),
            _mm512_set1_epi16(first as i16),
        );
        _mm512_permutexvar_epi16(idx, v)
    }

    /// Columns ahead the kernels prefetch: the next tile's sixteen, which the same thread reads next.
    const AHEAD: usize = 16;

    /// i32 lanes of `v` shifted right by `bits`, masked to `mask`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn field(v: __m512i, bits: u32, mask: i32) -> __m512i {
        _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(bits as i32)), _mm512_set1_epi32(mask))
    }

    /// `$run::<R>(u, y, sc, isum)` over `rows` rows, four at a time (`R` = 4, then what is left),
    /// `y(r)` giving row r's activation bytes: the rows' `dpbusd` chains interleave inside one
    /// call. A macro, not a generic function: the same loop through a trait ran 5–10% slower.
    macro_rules! every_row {
        ($run:ident, $u:expr, $sc:expr, $rows:expr, $y:expr, $isum:expr) => {{
            let mut r = 0;
            while r < $rows {
                let (u, sc, isum) = ($u, $sc, &mut $isum[r..]);
                r += match $rows - r {
                    1 => $run::<1>(u, [$y(r)], sc, isum),
                    2 => $run::<2>(u, std::array::from_fn(|e| $y(r + e)), sc, isum),
                    3 => $run::<3>(u, std::array::from_fn(|e| $y(r + e)), sc, isum),
                    _ => $run::<4>(u, std::array::from_fn(|e| $y(r + e)), sc, isum),
                };
            }
        }};
    }

    /// `acc + dpbusd(u, *y broadcast)`, the four bytes at `y` read by the instruction itself
    /// (`{1to16}`): left to itself, LLVM hoists the broadcasts into registers, through general
    /// registers when they run out, which costs a shuffle uop per `dpbusd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpbusd_broadcast(acc: __m512i, u: __m512i, y: *const i32) -> __m512i {
        let mut acc = acc;
        std::arch::asm!(
            "vpdpbusd {acc}, {u}, dword ptr [{y}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            u = in(zmm_reg) u,
            y = in(reg) y,
            options(pure, readonly, nostack, preserves_flags),
        );
        acc
    }

    /// `isum[r] += sc · Σ u · y_r` over one 32-weight sub-block of sixteen columns (`u[t]` lane c:
    /// column c's weights 4t..4t+4) for `R` rows (`y[r]`: their 32 activation bytes), the rows'
    /// `dpbusd` chains interleaved so that they overlap. Each 16-weight half's sum fits in i16
    /// (|Σ| ≤ 16 · 15 · 128), so `dpwssd` against the scale (an i32 lane is the i16 pair
    /// (sc, 0)) multiplies it exactly, in one uop where `mullo` takes two.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn sub_block_rows<const R: usize>(
        u: &[__m512i; 8],
        y: [*const i32; R],
        sc: __m512i,
        isum: &mut [__m512i],
    ) -> usize {
        let mut a = [[_mm512_setzero_si512(); 2]; R];
        for (t, &u) in u.iter().enumerate() {
            for (a, y) in a.iter_mut().zip(y) {
                a[t / 4] = dpbusd_broadcast(a[t / 4], u, y.add(t));
            }
        }
        for (s, a) in isum.iter_mut().zip(a) {
            *s = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(*s, a[0], sc), a[1], sc);
        }
        R
    }

    /// Up to [`TILE_ROWS`] rows (`ys`, row r's blocks at `r * kb`) against sixteen Q4_K columns
    /// (`col(c)` is column c's blocks), columns in the lanes: the weights are transposed four
    /// bytes per lane as they are read, so each 4-weight group of every column takes one
    /// `dpbusd` against a row's four activation bytes broadcast, and one transposed load serves
    /// every row. Each lane runs [`super::step`] on exact integer sums: the one-row bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn q4k_sixteen_columns<'a>(
        col: impl Fn(usize) -> &'a [super::Q4K],
        kb: usize,
        ys: &[super::Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) {
        let cols: [&[super::Q4K]; 16] = std::array::from_fn(&col);
        assert!(cols.iter().all(|c| c.len() >= kb));
        let segments = |b: usize, s: usize| {
            // Raw addresses, checked once above: the transposes read 144 of them per block.
            let at: [*const u8; 16] = std::array::from_fn(|c| cols[c].as_ptr().add(b) as *const u8);
            if s == 0 {
                for &a in &at {
                    let x = &*(a as *const super::Q4K);
                    super::super::prefetch_at(x, AHEAD * kb * std::mem::size_of_val(x));
                }
            }
            transpose16x4(|c| at[c].add(16 * s))
        };
        q4k_tile_rows(segments, kb, ys, rows, out)
    }

    /// [`q4k_sixteen_columns`] over a packed group ([`super::pack_q4k`]): the same arithmetic on
    /// the same lanes, each segment one aligned load of four vectors instead of a transpose.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn q4k_sixteen_packed(
        group: &[super::Q4K],
        kb: usize,
        ys: &[super::Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
        first_pass: bool,
    ) {
        assert!(group.len() >= 16 * kb);
        let base = group.as_ptr() as *const u8;
        const TILE: usize = 16 * std::mem::size_of::<super::Q4K>();
        // A group is one run of bytes, read in order, which the hardware prefetcher follows,
        // but not far enough ahead: at many rows a tile's compute outlasts its read, and at few
        // (on a Xeon) the prefetcher alone ran well short of memory's rate.
        let (tiles_ahead, segments_ahead) =
            (crate::kernels::prefetches_tiles(rows, first_pass), crate::kernels::prefetches_segments(rows, first_pass));
        let segments = |b: usize, s: usize| {
            if tiles_ahead && s == 0 {
                crate::kernels::prefetch_tile_ahead(base.add(b * TILE), TILE);
            }
            let p = base.add(b * TILE + 256 * s);
            if segments_ahead {
                crate::kernels::prefetch_tile_ahead(p, 256);
            }
            std::array::from_fn(|t| _mm512_loadu_si512(p.add(64 * t) as *const _))
        };
        match rows {
            1 => q4k_tile_few::<1>(segments, kb, ys, out),
            2 => q4k_tile_few::<2>(segments, kb, ys, out),
            _ => q4k_tile_rows(segments, kb, ys, rows, out),
        }
    }

    /// [`q4k_tile_rows`] for a fixed `R` of one or two rows (a decode step's), every sum in
    /// registers: the general kernel keeps up to [`TILE_ROWS`] rows' sums in arrays on the stack,
    /// so at one row each sub-block's sum went through a store and a reload, and each call
    /// zeroed 4 KB of them. Even and odd sub-blocks sum in two chains, added once a super-block:
    /// integer sums, so the same `isum` and, through the same float step, the same bits.
    #[inline(always)]
    unsafe fn q4k_tile_few<const R: usize>(
        mut segments: impl FnMut(usize, usize) -> [__m512i; 4],
        kb: usize,
        ys: &[super::Q8K],
        out: &mut [[f32; 16]],
    ) {
        debug_assert!(out.len() >= R);
        assert!(ys.len() >= R * kb);
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..kb {
            let [dd, s0, s1, s2] = segments(b, 0);
            let high = |lo: __m512i, top: __m512i, k: u32, shift: u32| {
                _mm512_or_si512(field(lo, 8 * k + shift, 0x0F), _mm512_slli_epi32::<4>(field(top, 8 * k + 6, 3)))
            };
            let mut isum = [[_mm512_setzero_si512(); 2]; R];
            for i in 0..4 {
                let (lo, hi) = (segments(b, 1 + 2 * i), segments(b, 2 + 2 * i));
                let q = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                for half in 0..2 {
                    let j = 2 * i + half;
                    let sc = if j < 4 { field(s0, 8 * j as u32, 63) } else { high(s2, s0, j as u32 - 4, 0) };
                    let mut a = [[_mm512_setzero_si512(); 2]; R];
                    for (t, &q) in q.iter().enumerate() {
                        let u = if half == 0 {
                            _mm512_and_si512(q, m4)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4)
                        };
                        for (r, a) in a.iter_mut().enumerate() {
                            let y =
                                ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + 64 * i + 32 * half) as *const i32;
                            a[t / 4] = dpbusd_broadcast(a[t / 4], u, y.add(t));
                        }
                    }
                    for (s, a) in isum.iter_mut().zip(a) {
                        s[half] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[half], a[0], sc), a[1], sc);
                    }
                }
            }
            let xd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let xdmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            for (r, (acc, isum)) in acc.iter_mut().zip(isum).enumerate() {
                let y = &ys[r * kb + b];
                let bs = y.bsums.as_ptr() as *const i32;
                let mut imin = [_mm512_setzero_si512(); 2];
                for j in 0..8 {
                    let m = if j < 4 { field(s1, 8 * j as u32, 63) } else { high(s2, s1, j as u32 - 4, 4) };
                    let m = _mm512_or_si512(_mm512_slli_epi32::<16>(m), m);
                    imin[j % 2] = _mm512_dpwssd_epi32(imin[j % 2], m, _mm512_set1_epi32(bs.add(j).read_unaligned()));
                }
                let yd = _mm512_set1_ps(y.d);
                let isum = _mm512_add_epi32(isum[0], isum[1]);
                let imin = _mm512_add_epi32(imin[0], imin[1]);
                let a = _mm512_mul_ps(_mm512_mul_ps(yd, xd), _mm512_cvtepi32_ps(isum));
                let m = _mm512_mul_ps(_mm512_mul_ps(yd, xdmin), _mm512_cvtepi32_ps(imin));
                *acc = _mm512_add_ps(*acc, _mm512_sub_ps(a, m));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), *a);
        }
    }

    /// The sixteen-column Q4_K kernel over any source of its segments: `segments(b, s)` is
    /// bytes `16s..16s + 16` of the sixteen columns' super-block b, `out[t]` lane c holding
    /// column c's dword t.
    #[inline(always)]
    unsafe fn q4k_tile_rows(
        mut segments: impl FnMut(usize, usize) -> [__m512i; 4],
        kb: usize,
        ys: &[super::Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) {
        debug_assert!(rows <= TILE_ROWS && out.len() >= rows);
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
        let mut isum = [_mm512_setzero_si512(); TILE_ROWS];
        assert!(ys.len() >= rows * kb);
        for b in 0..kb {
            // d and dmin, then the twelve scale bytes q[0..12] as three dwords per lane.
            let [dd, s0, s1, s2] = segments(b, 0);
            let xd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let xdmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            // `Q4K::scale_min` lane by lane: sub-blocks 0-3 are the low six bits of q[j] and
            // q[j + 4]; 4-7 take q[j + 4]'s nibbles and the top two bits of q[j - 4] or q[j].
            let high = |lo: __m512i, top: __m512i, k: u32, shift: u32| {
                _mm512_or_si512(field(lo, 8 * k + shift, 0x0F), _mm512_slli_epi32::<4>(field(top, 8 * k + 6, 3)))
            };
            let sc: [__m512i; 8] =
                std::array::from_fn(
                    |j| if j < 4 { field(s0, 8 * j as u32, 63) } else { high(s2, s0, j as u32 - 4, 0) },
                );
            let mins: [__m512i; 8] = std::array::from_fn(|j| {
                let m = if j < 4 { field(s1, 8 * j as u32, 63) } else { high(s2, s1, j as u32 - 4, 4) };
                // In both i16 halves, against a (bsums[2j], bsums[2j + 1]) pair.
                _mm512_or_si512(_mm512_slli_epi32::<16>(m), m)
            });
            isum[..rows].fill(_mm512_setzero_si512());
            for i in 0..4 {
                // qs[32i..32i + 32]: segments 1 + 2i and 2 + 2i.
                let (lo, hi) = (segments(b, 1 + 2 * i), segments(b, 2 + 2 * i));
                let q = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                // Sub-block 2i in the low nibbles, 2i + 1 in the high.
                for half in 0..2 {
                    let u: [__m512i; 8] = std::array::from_fn(|t| {
                        if half == 0 {
                            _mm512_and_si512(q[t], m4)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(q[t]), m4)
                        }
                    });
                    let (j, first) = (2 * i + half, 64 * i + 32 * half);
                    let y = |r: usize| ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + first) as *const i32;
                    every_row!(sub_block_rows, &u, sc[j], rows, y, isum);
                }
            }
            for (r, (acc, &isum)) in acc[..rows].iter_mut().zip(&isum).enumerate() {
                let y = &ys[r * kb + b];
                let bs = y.bsums.as_ptr() as *const i32;
                let mut imin = _mm512_setzero_si512();
                for (j, &m) in mins.iter().enumerate() {
                    imin = _mm512_dpwssd_epi32(imin, m, _mm512_set1_epi32(bs.add(j).read_unaligned()));
                }
                let yd = _mm512_set1_ps(y.d);
                let a = _mm512_mul_ps(_mm512_mul_ps(yd, xd), _mm512_cvtepi32_ps(isum));
                let m = _mm512_mul_ps(_mm512_mul_ps(yd, xdmin), _mm512_cvtepi32_ps(imin));
                *acc = _mm512_add_ps(*acc, _mm512_sub_ps(a, m));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc[..rows]) {
            _mm512_storeu_ps(o.as_mut_ptr(), *a);
        }
    }

    /// `isum[r] += sc · Σ u · y_r` over one 16-weight half of sixteen Q6_K columns (`u[g]` lane c:
    /// column c's weights 4g..4g+4) for `R` rows, the rows' chains interleaved. A half's sum
    /// (up to 16 · 63 · 128) needs i32, so the scale takes a `mullo`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn half_rows<const R: usize>(
        u: &[__m512i; 4],
        y: [*const i32; R],
        sc: __m512i,
        isum: &mut [__m512i],
    ) -> usize {
        let mut a = [_mm512_setzero_si512(); R];
        for (g, &u) in u.iter().enumerate() {
            for (a, y) in a.iter_mut().zip(y) {
                *a = dpbusd_broadcast(*a, u, y.add(g));
            }
        }
        for (s, a) in isum.iter_mut().zip(a) {
            *s = _mm512_add_epi32(*s, _mm512_mullo_epi32(a, sc));
        }
        R
    }

    /// [`q4k_sixteen_columns`] for Q6_K: per 16-weight half, four transposed dwords of `ql` (two
    /// places) and `qh` give the four chunks' 6-bit weights, each summed by `dpbusd` against a
    /// row's broadcast bytes and times that half's scale; the `bsums` term and the float step
    /// are [`super::step`]'s, lane by lane.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn q6k_sixteen_columns<'a>(
        col: impl Fn(usize) -> &'a [super::Q6K],
        kb: usize,
        ys: &[super::Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
    ) {
        let cols: [&[super::Q6K]; 16] = std::array::from_fn(&col);
        assert!(cols.iter().all(|c| c.len() >= kb));
        let at = |b: usize| -> [*const u8; 16] { std::array::from_fn(|c| cols[c].as_ptr().add(b) as *const u8) };
        let scales = |b: usize| {
            let at = at(b);
            for &a in &at {
                let x = &*(a as *const super::Q6K);
                super::super::prefetch_at(x, AHEAD * kb * std::mem::size_of_val(x));
            }
            transpose16x4(|c| at[c].add(std::mem::offset_of!(super::Q6K, scales)))
        };
        let d = |b: usize| {
            // The block ends two bytes after its scales, so `d` comes in lane by lane.
            let at = at(b);
            let d: [u16; 16] = std::array::from_fn(|c| (*(at[c] as *const super::Q6K)).d.to_bits());
            _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr() as *const __m256i))
        };
        let segment = |b: usize, byte: usize| {
            let at = at(b);
            transpose16x4(|c| at[c].add(byte))
        };
        Q6kTiles { scales, segment, d }.run(kb, ys, rows, out)
    }

    /// [`q6k_sixteen_columns`] over a packed group (the dword tiles of
    /// [`crate::kernels::cpu_canonical`], which this mode shares): each segment's four vectors
    /// and the scales are aligned loads, and the sixteen `d` one 256-bit load.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
    pub unsafe fn q6k_sixteen_packed(
        group: &[super::Q6K],
        kb: usize,
        ys: &[super::Q8K],
        rows: usize,
        out: &mut [[f32; 16]],
        first_pass: bool,
    ) {
        assert!(group.len() >= 16 * kb);
        const TILE: usize = 16 * std::mem::size_of::<super::Q6K>();
        let base = group.as_ptr() as *const u8;
        // Below four rows each segment is asked for ahead as it is read (as Q4_K's); the whole
        // tile past the register kernel's rows only: at four rows Qwen 1.5B's Q6_K matrices read
        // slower with it, at eight faster (docs/BENCHMARKS.md, "Q6_K's tile prefetch").
        let segments_ahead = crate::kernels::prefetches_segments(rows, first_pass);
        let prefetch = rows > Q6K_REGISTER_ROWS && crate::kernels::prefetches_tiles(rows, first_pass);
        let vectors = |b: usize, first: usize| -> [__m512i; 4] {
            let p = base.add(b * TILE + 64 * first);
            if segments_ahead {
                crate::kernels::prefetch_tile_ahead(p, 256);
            }
            std::array::from_fn(|t| _mm512_loadu_si512(p.add(64 * t) as *const _))
        };
        // Each tile is read from its start to its end ([`q6k_slot`]): the scales, the
        // sixteen halves' segments as the kernel takes them, then `d`.
        let scales = |b: usize| {
            if prefetch {
                crate::kernels::prefetch_tile_ahead(base.add(b * TILE), TILE);
            }
            vectors(b, q6k_slot(std::mem::offset_of!(super::Q6K, scales) / 4))
        };
        let segment = |b: usize, byte: usize| vectors(b, q6k_slot(byte / 4));
        let d = |b: usize| {
            _mm512_cvtph_ps(_mm256_loadu_si256(base.add(b * TILE + 64 * super::Q6K_WORDS) as *const __m256i))
        };
        Q6kTiles { scales, segment, d }.run(kb, ys, rows, out)
    }

    /// Where a Q6_K kernel finds sixteen columns' super-block `b`: `scales(b)` its scale bytes
    /// as four vectors, `segment(b, byte)` bytes `byte..byte + 16` (vector t, lane c: column
    /// c's dword t), `d(b)` the sixteen `d`; called in that order, `d` once the sums are made.
    struct Q6kTiles<S, G, D> {
        scales: S,
        segment: G,
        d: D,
    }

    impl<S, G, D> Q6kTiles<S, G, D>
    where
        S: Fn(usize) -> [__m512i; 4],
        G: Fn(usize, usize) -> [__m512i; 4],
        D: Fn(usize) -> __m512,
    {
        /// Picks the kernel for `rows`: up to [`Q6K_REGISTER_ROWS`] rows keep every sum in
        /// registers (Q4_K's kernel only up to two: at three and four rows its register form ran
        /// slower on some shapes).
        #[inline(always)]
        unsafe fn run(self, kb: usize, ys: &[super::Q8K], rows: usize, out: &mut [[f32; 16]]) {
            match rows {
                1 => self.few::<1>(kb, ys, out),
                2 => self.few::<2>(kb, ys, out),
                3 => self.few::<3>(kb, ys, out),
                4 => self.few::<4>(kb, ys, out),
                _ => self.rows(kb, ys, rows, out),
            }
        }

        /// Up to [`TILE_ROWS`] rows over sixteen Q6_K columns ([`Q6kTiles`]).
        #[inline(always)]
        unsafe fn rows(self, kb: usize, ys: &[super::Q8K], rows: usize, out: &mut [[f32; 16]]) {
            let Q6kTiles { scales, segment, d } = self;
            debug_assert!(rows <= TILE_ROWS && out.len() >= rows);
            let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
            let mut isum = [_mm512_setzero_si512(); TILE_ROWS];
            assert!(ys.len() >= rows * kb);
            for b in 0..kb {
                let scales = scales(b);
                isum[..rows].fill(_mm512_setzero_si512());
                for n in 0..2 {
                    for half in 0..2 {
                        let a = segment(b, Q6K_QL + 64 * n + 16 * half);
                        let bq = segment(b, Q6K_QL + 64 * n + 32 + 16 * half);
                        let h = segment(b, Q6K_QH + 32 * n + 16 * half);
                        for t in 0..4 {
                            let u = q6k_chunk(&a, &bq, &h, t);
                            let s = 8 * n + 2 * t + half;
                            let y =
                                |r: usize| ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + 16 * s) as *const i32;
                            every_row!(half_rows, &u, q6k_scale(&scales, s), rows, y, isum);
                        }
                    }
                }
                let xd = d(b);
                for (r, (acc, &isum)) in acc[..rows].iter_mut().zip(&isum).enumerate() {
                    let y = &ys[r * kb + b];
                    *acc = q6k_step(*acc, isum, q6k_bsum_term(&scales, y), xd, y);
                }
            }
            for (o, a) in out.iter_mut().zip(&acc[..rows]) {
                _mm512_storeu_ps(o.as_mut_ptr(), *a);
            }
        }

        /// [`Q6kTiles::rows`] for a fixed `R` of one to four rows, every sum in registers, the
        /// sixteen halves' sums in two chains (as [`q4k_tile_few`]: the same integers, so the same
        /// bits).
        #[inline(always)]
        unsafe fn few<const R: usize>(self, kb: usize, ys: &[super::Q8K], out: &mut [[f32; 16]]) {
            let Q6kTiles { scales, segment, d } = self;
            debug_assert!(out.len() >= R);
            assert!(ys.len() >= R * kb);
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..kb {
                let scales = scales(b);
                let mut isum = [[_mm512_setzero_si512(); 2]; R];
                for n in 0..2 {
                    for half in 0..2 {
                        let a = segment(b, Q6K_QL + 64 * n + 16 * half);
                        let bq = segment(b, Q6K_QL + 64 * n + 32 + 16 * half);
                        let h = segment(b, Q6K_QH + 32 * n + 16 * half);
                        for t in 0..4 {
                            let u = q6k_chunk(&a, &bq, &h, t);
                            let s = 8 * n + 2 * t + half;
                            let sc = q6k_scale(&scales, s);
                            for (r, isum) in isum.iter_mut().enumerate() {
                                let y = ys.as_ptr().add(r * kb + b).cast::<u8>().add(Y_QS + 16 * s) as *const i32;
                                let mut a = _mm512_setzero_si512();
                                for (g, &u) in u.iter().enumerate() {
                                    a = dpbusd_broadcast(a, u, y.add(g));
                                }
                                isum[t % 2] = _mm512_add_epi32(isum[t % 2], _mm512_mullo_epi32(a, sc));
                            }
                        }
                    }
                }
                let xd = d(b);
                for (r, (acc, isum)) in acc.iter_mut().zip(isum).enumerate() {
                    let y = &ys[r * kb + b];
                    *acc = q6k_step(*acc, _mm512_add_epi32(isum[0], isum[1]), q6k_bsum_term(&scales, y), xd, y);
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                _mm512_storeu_ps(o.as_mut_ptr(), *a);
            }
        }
    }

    /// Scale s (i8) sign-extended in each lane, from the four vectors of a tile's scale bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_scale(scales: &[__m512i; 4], s: usize) -> __m512i {
        _mm512_srai_epi32::<24>(_mm512_sll_epi32(scales[s / 4], _mm_cvtsi32_si128(24 - 8 * (s % 4) as i32)))
    }

    /// The `bsums` term's integer: Σ_s sc_s · bsums_s, scales paired (s = 2p, 2p + 1) as i16
    /// against the (bsums[2p], bsums[2p + 1]) pairs, in two chains.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_bsum_term(scales: &[__m512i; 4], y: &super::Q8K) -> __m512i {
        let bs = y.bsums.as_ptr() as *const i32;
        let mut ib = [_mm512_setzero_si512(); 2];
        for p in 0..8 {
            let pair = _mm512_or_si512(
                _mm512_and_si512(q6k_scale(scales, 2 * p), _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32::<16>(q6k_scale(scales, 2 * p + 1)),
            );
            ib[p % 2] = _mm512_dpwssd_epi32(ib[p % 2], pair, _mm512_set1_epi32(bs.add(p).read_unaligned()));
        }
        _mm512_add_epi32(ib[0], ib[1])
    }

    /// Chunk `4n + t` of a Q6_K half as `Q6K::unpack` gives it: a nibble of `ql` (`a` or `bq`),
    /// two bits of `qh`, per four weights `g` of sixteen columns.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_chunk(a: &[__m512i; 4], bq: &[__m512i; 4], h: &[__m512i; 4], t: usize) -> [__m512i; 4] {
        let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        let mut u = [_mm512_setzero_si512(); 4];
        for (g, u) in u.iter_mut().enumerate() {
            let (lo, hi) = match t {
                0 => (_mm512_and_si512(a[g], m4), _mm512_slli_epi16::<4>(h[g])),
                1 => (_mm512_and_si512(bq[g], m4), _mm512_slli_epi16::<2>(h[g])),
                2 => (_mm512_and_si512(_mm512_srli_epi16::<4>(a[g]), m4), h[g]),
                _ => (_mm512_and_si512(_mm512_srli_epi16::<4>(bq[g]), m4), _mm512_srli_epi16::<2>(h[g])),
            };
            // lo | (hi & 0x30)
            *u = _mm512_ternarylogic_epi32::<0xF8>(lo, hi, m30);
        }
        u
    }

    /// The float step of [`super::step`] for Q6_K, lane by lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_step(acc: __m512, isum: __m512i, ib: __m512i, xd: __m512, y: &super::Q8K) -> __m512 {
        let isum = _mm512_sub_epi32(isum, _mm512_mullo_epi32(ib, _mm512_set1_epi32(super::Q6K::OFFSET)));
        _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(y.d), xd), _mm512_cvtepi32_ps(isum)))
    }

    /// Up to how many rows the Q6_K kernel keeps every sum in registers ([`Q6kTiles::few`]).
    const Q6K_REGISTER_ROWS: usize = 4;
    // [`Q6kTiles::run`] names the register kernels one by one, `few::<1>` to `few::<4>`.
    const _: () = assert!(Q6K_REGISTER_ROWS == 4);
    const Q6K_QL: usize = std::mem::offset_of!(super::Q6K, ql);
    const Q6K_QH: usize = std::mem::offset_of!(super::Q6K, qh);
}

/// One output element, [`element`]'s arithmetic with the integer parts in AVX2: the one-row
/// kernel, reading the column's bytes in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn element_avx2<W: KBlock>(wc: &[W], y: &[Q8K]) -> f32 {
    use std::arch::x86_64::{_mm256_mullo_epi32, _mm256_set1_epi32, _mm256_sub_epi32};
    let controls = avx2::scale_controls();
    let mut acc = 0f32;
    for (x, yb) in wc.iter().zip(y) {
        super::prefetch_ahead(x);
        let (p, q) = x.partials_with(yb, controls);
        // Integer sums, so any order of the adds gives the same totals: one tree for both of
        // Q4_K's, and Q6_K's offset taken in the lanes before its one reduction.
        let (isum, imin) = if W::HAS_MIN {
            avx2::hsum2(p, q)
        } else {
            (avx2::hsum(_mm256_sub_epi32(p, _mm256_mullo_epi32(q, _mm256_set1_epi32(W::OFFSET)))), 0)
        };
        acc = step::<W>(acc, isum, imin, x.d(), x.dmin(), yb.d);
    }
    acc
}

/// [`element_avx2`]'s arithmetic for `R` rows of one column, the integer parts two chunks per
/// 512-bit vector: the same exact integers, then the same float step, so per row [`element`]'s
/// bits. Each super-block is read and unpacked once for all the rows (the unpacking is the same
/// pure arithmetic on the same bytes, which the compiler computes once); then each row takes
/// its own integer sums and its own float step. One row is the AVX-512 one-row kernel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn elements_avx512<W: KBlock, const R: usize>(wc: &[W], y: &[Q8K], kb: usize) -> [f32; R] {
    use std::arch::x86_64::_mm512_reduce_add_epi32;
    assert!(y.len() >= R * kb && wc.len() >= kb);
    let mut acc = [0f32; R];
    for (b, x) in wc[..kb].iter().enumerate() {
        super::prefetch_ahead(x);
        let (xd, xdmin) = (x.d(), x.dmin());
        for (r, acc) in acc.iter_mut().enumerate() {
            let yb = y.get_unchecked(r * kb + b);
            let (p, q) = x.partials_avx512(yb);
            let (p, q) = (_mm512_reduce_add_epi32(p), avx2::hsum(q));
            let (isum, imin) = if W::HAS_MIN { (p, q) } else { (p - W::OFFSET * q, 0) };
            *acc = step::<W>(*acc, isum, imin, xd, xdmin, yb.d);
        }
    }
    acc
}

/// Rows `0..m` (at most [`FEW_ROWS_MAX`]) of column `wc` through [`elements_avx512`].
#[cfg(target_arch = "x86_64")]
unsafe fn few_rows_avx512<W: KBlock>(wc: &[W], y: &[Q8K], kb: usize, m: usize, put: impl Fn(usize, f32)) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match m {
                $($r => elements_avx512::<W, $r>(wc, y, kb).into_iter().enumerate().for_each(|(r, v)| put(r, v)),)*
                _ => unreachable!("at most FEW_ROWS_MAX rows"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8)
}

/// The portable definition of one output element.
fn element<W: KBlock>(wc: &[W], y: &[Q8K]) -> f32 {
    let mut acc = 0f32;
    for (x, yb) in wc.iter().zip(y) {
        let (isum, imin) = int_parts::<W>(&x.unpack(), yb);
        acc = step::<W>(acc, isum, imin, x.d(), x.dmin(), yb.d);
    }
    acc
}

/// Columns handed to a worker at once: one tile of the sixteen-column kernel and two of the
/// eight-column one, which take a task's columns whole.
const COLS_PER_TASK: usize = 16;
const _: () = assert!(COLS_PER_TASK == 16);
/// Rows one pass of a columns-in-lanes kernel takes over its tile: their sums wait on the stack.
const TILE_ROWS: usize = 32;

/// A tile's output rows, zeroed: `[[0; L]; TILE_ROWS]` is a 2 KB memset per sixteen columns
/// (3% of Qwen2.5 1.5B's single-stream decode), where a decode step's `m` needs one row of it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn with_tile<const L: usize>(m: usize, f: impl FnOnce(&mut [[f32; L]])) {
    const FEW: usize = 4;
    if m <= FEW {
        f(&mut [[0f32; L]; FEW])
    } else {
        f(&mut [[0f32; L]; TILE_ROWS])
    }
}
/// Where a [`Q8K`]'s quants start: the columns-in-lanes kernels broadcast from raw addresses.
const Y_QS: usize = std::mem::offset_of!(Q8K, qs);
/// Rows from which the sixteen-column AVX-512 kernel runs: its transposes pay off from two rows
/// (Qwen2.5 1.5B's 1536 × 1536 Q4_K on one thread of the Xeon: 111 µs against 164 µs for the
/// one-row kernel twice; the 151936-column Q6_K output breaks even).
const SIXTEEN_MIN_ROWS: usize = 2;
/// The most rows [`elements_avx512`] takes (one monomorphized loop per count).
const FEW_ROWS_MAX: usize = 8;
/// Super-blocks per column from which the sixteen-column kernel also takes one row: Qwen2.5
/// 1.5B's `ffn_down` (k = 8960, 35 super-blocks), every layer in turn on the Xeon, 372 µs a
/// layer against 540 for the one-row kernel; at k = 1536 and 4864 (6 and 19) the one-row kernel
/// stays ahead (41 against 44 µs, 80 against 99). The eight-column AVX2 kernels never take one
/// row: on the EPYC they tie the one-row kernel there (Q4_K) or lose (Q6_K, 1.6x slower).
const SIXTEEN_ONE_ROW_MIN_BLOCKS: usize = 32;

fn matmul<W: KBlock>(w: &[W], xq: &[Q8K], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 256;
    let ptr = OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let (simd, wide) = (super::isa() >= super::Isa::Avx2, super::isa() == super::Isa::Avx512);
    #[cfg(target_arch = "x86_64")]
    let few = wide && m <= W::FEW_ROWS_MAX && kb < W::FEW_ROWS_MAX_BLOCKS;
    #[cfg(target_arch = "x86_64")]
    let sixteen = !few && wide && (m >= SIXTEEN_MIN_ROWS || kb >= SIXTEEN_ONE_ROW_MIN_BLOCKS);
    #[cfg(target_arch = "x86_64")]
    const {
        assert!(W::FEW_ROWS_MAX <= FEW_ROWS_MAX)
    };
    #[cfg(target_arch = "x86_64")]
    let eight = simd && !wide && m >= W::EIGHT_MIN_ROWS;
    let run = |task: usize| {
        let p = ptr;
        let cols = task * COLS_PER_TASK..n.min((task + 1) * COLS_PER_TASK);
        // SAFETY (all writes below): each (row, column) of this task's columns is written by
        // this task alone, inside `out`; the instructions used were detected at run time.
        let put = |r: usize, c: usize, v: f32| unsafe { *p.0.add(r * n + c) = v };
        #[cfg(target_arch = "x86_64")]
        if sixteen {
            by_tiles::<W, 16>(
                w,
                kb,
                cols,
                m,
                |col, r0, rows, got| unsafe { W::sixteen_columns(col, kb, &xq[r0 * kb..], rows, got) },
                put,
            );
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if few {
            for c in cols.clone() {
                unsafe { few_rows_avx512(&w[c * kb..(c + 1) * kb], xq, kb, m, |r, v| put(r, c, v)) };
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if eight {
            by_tiles::<W, 8>(
                w,
                kb,
                cols,
                m,
                |col, r0, rows, got| unsafe { W::eight_columns(col, kb, &xq[r0 * kb..], rows, got) },
                put,
            );
            return;
        }
        // Fewer rows in AVX2 (AVX-512 took `few` or `sixteen`): one element at a time, each
        // column's bytes read in order (eight columns in flight, interleaved, read memory at
        // half the rate).
        #[cfg(target_arch = "x86_64")]
        if simd {
            for c in cols.clone() {
                for r in 0..m {
                    let (wc, y) = (&w[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb]);
                    put(r, c, unsafe { element_avx2(wc, y) });
                }
            }
            return;
        }
        for c in cols {
            for r in 0..m {
                put(r, c, element(&w[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb]));
            }
        }
    };
    super::parallel_for(n.div_ceil(COLS_PER_TASK), run);
}

/// Columns `cols` of all `m` rows through a columns-in-lanes kernel `L` columns wide:
/// `kernel(col, r0, rows, got)` fills `got[..rows]` for rows `r0..r0 + rows` (at most
/// [`TILE_ROWS`]) of the tile whose column c is `col(c)`. A short last tile repeats its last
/// column in the spare lanes, never written.
#[cfg(target_arch = "x86_64")]
fn by_tiles<'a, W: KBlock, const L: usize>(
    w: &'a [W],
    kb: usize,
    cols: std::ops::Range<usize>,
    m: usize,
    kernel: impl Fn(&dyn Fn(usize) -> &'a [W], usize, usize, &mut [[f32; L]]),
    put: impl Fn(usize, usize, f32),
) {
    for c0 in cols.clone().step_by(L) {
        let last = (c0 + L).min(cols.end) - 1;
        let col = |c: usize| {
            let c = (c0 + c).min(last);
            &w[c * kb..(c + 1) * kb]
        };
        with_tile::<L>(m, |got| {
            for r0 in (0..m).step_by(TILE_ROWS) {
                let rows = TILE_ROWS.min(m - r0);
                kernel(&col, r0, rows, got);
                for (i, g) in got[..rows].iter().enumerate() {
                    for (c, &v) in (c0..=last).zip(g) {
                        put(r0 + i, c, v);
                    }
                }
            }
        });
    }
}

pub fn matmul_q4k(w: &[BlockQ4K], xq: &[BlockQ8K], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: mirror types of the same size, alignment and layout (asserted above).
    let (w, xq) = unsafe { (mirror::<_, Q4K>(w), mirror::<_, Q8K>(xq)) };
    matmul(w, xq, m, k, n, out)
}

pub fn matmul_q6k(w: &[BlockQ6K], xq: &[BlockQ8K], m: usize, k: usize, n: usize, out: &mut [f32]) {
    // SAFETY: as above.
    let (w, xq) = unsafe { (mirror::<_, Q6K>(w), mirror::<_, Q8K>(xq)) };
    matmul(w, xq, m, k, n, out)
}

/// Columns per packed group of a Q4_K weight.
pub const PACK_COLS: usize = 16;
/// Dwords of a Q6_K block before its `d` (`ql`, `qh`, `scales`): a packed tile's `d` vector
/// follows that many vectors.
pub(crate) const Q6K_WORDS: usize = 52;
const _: () = assert!(4 * Q6K_WORDS == std::mem::offset_of!(Q6K, d));
/// 16-byte segments of a Q4_K block: `d`, `dmin` and the scales, then `qs` in eight.
const SEGMENTS: usize = std::mem::size_of::<Q4K>() / 16;
const _: () = assert!(SEGMENTS * 16 == std::mem::size_of::<Q4K>());

/// Q4_K weights (`n` columns of `kb` super-blocks; `src` in GGUF order, or packed) permuted into
/// the other layout. Packed, each group of [`PACK_COLS`] columns keeps its byte range, and its
/// super-block b is one tile: segment s of the sixteen columns stored as the four vectors the
/// sixteen-column kernel would transpose it into (vector t, lane l: column l's dword t of the
/// segment), so that the kernel loads what it would otherwise transpose.
fn permute_q4k(src: &[BlockQ4K], n: usize, kb: usize, pack: bool) -> Vec<BlockQ4K> {
    use candle_core::quantized::k_quants::GgmlType;
    const BLOCK: usize = std::mem::size_of::<Q4K>();
    assert!(n.is_multiple_of(PACK_COLS) && src.len() == n * kb, "Q4_K packing: {n} columns of {kb} blocks");
    let mut out = vec![BlockQ4K::zeros(); src.len()];
    // SAFETY: plain-old-data blocks viewed as their bytes.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src)),
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(src)),
        )
    };
    let group = PACK_COLS * kb * BLOCK;
    for (s, d) in s.chunks_exact(group).zip(d.chunks_exact_mut(group)) {
        for (l, b, seg, t) in group_dwords(kb) {
            let plain = (l * kb + b) * BLOCK + seg * 16 + t * 4;
            let packed = b * PACK_COLS * BLOCK + seg * 256 + t * 64 + l * 4;
            let (from, to) = if pack { (plain, packed) } else { (packed, plain) };
            d[to..to + 4].copy_from_slice(&s[from..from + 4]);
        }
    }
    out
}

/// Every (column, super-block, segment, dword) of a group, in the order its GGUF bytes lie.
fn group_dwords(kb: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..PACK_COLS).flat_map(move |l| {
        (0..kb).flat_map(move |b| (0..SEGMENTS).flat_map(move |seg| (0..4).map(move |t| (l, b, seg, t))))
    })
}

/// Q4_K blocks in GGUF order, packed ([`permute_q4k`]).
pub fn pack_q4k(plain: &[BlockQ4K], n: usize, kb: usize) -> Vec<BlockQ4K> {
    permute_q4k(plain, n, kb, true)
}

/// [`pack_q4k`] undone.
pub fn unpack_q4k(packed: &[BlockQ4K], n: usize, kb: usize) -> Vec<BlockQ4K> {
    permute_q4k(packed, n, kb, false)
}

/// [`matmul_q4k`] over weights [`pack_q4k`] packed, the same bits: the AVX-512 tier's
/// sixteen-column kernel and the AVX2 tier's two eight-column halves read the groups directly,
/// at every row count; the portable tier unpacks a copy and runs its own.
pub fn matmul_q4k_packed(w: &[BlockQ4K], xq: &[BlockQ8K], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 256;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernel reads a packed Q4_K group of `kb` tiles; the tier is checked inside.
    if unsafe {
        packed_groups::<_, Q4K>(w, xq, m, kb, n, out, avx512::q4k_sixteen_packed, Some(eight::q4k_sixteen_packed))
    } {
        return;
    }
    matmul_q4k(&unpack_q4k(w, n, kb), xq, m, k, n, out)
}

/// [`matmul_q6k`] over weights packed in [`super::cpu_canonical`]'s Q6_K dword tiles, the same
/// bits: the AVX-512 sixteen-column kernel at every row count; the other tiers unpack a copy.
pub fn matmul_q6k_packed(w: &[BlockQ6K], xq: &[BlockQ8K], m: usize, k: usize, n: usize, out: &mut [f32]) {
    let kb = k / 256;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernel reads a packed Q6_K group of `kb` tiles; the tier is checked inside.
    if unsafe { packed_groups::<_, Q6K>(w, xq, m, kb, n, out, avx512::q6k_sixteen_packed, None) } {
        return;
    }
    matmul_q6k(&super::cpu_canonical::unpack_q6k(w, n, kb), xq, m, k, n, out)
}

/// A sixteen-column kernel over one packed group: (group, kb, rows' activations, rows, out).
#[cfg(target_arch = "x86_64")]
/// (group, kb, the pass's rows' activations, rows, out, whether the pass is the group's first).
type GroupKernel<W> = unsafe fn(&[W], usize, &[Q8K], usize, &mut [[f32; 16]], bool);

/// A kernel over every group of [`PACK_COLS`] packed columns, [`TILE_ROWS`] rows a pass:
/// `avx512` on the AVX-512 tier, `avx2` (where there is one) on the AVX2 tier; false (nothing
/// written) on any other.
///
/// # Safety
/// Each kernel must read at most a group's `PACK_COLS * kb` blocks and `rows * kb` of `ys`, and
/// need no more than its tier (AVX-512 F/BW/VL/VNNI; AVX2, FMA, F16C).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn packed_groups<B, W>(
    w: &[B],
    xq: &[BlockQ8K],
    m: usize,
    kb: usize,
    n: usize,
    out: &mut [f32],
    avx512: GroupKernel<W>,
    avx2: Option<GroupKernel<W>>,
) -> bool
where
    W: Sync,
{
    assert!(n.is_multiple_of(PACK_COLS) && w.len() == n * kb && out.len() == m * n);
    assert!(
        std::mem::size_of::<B>() == std::mem::size_of::<W>() && std::mem::align_of::<B>() >= std::mem::align_of::<W>()
    );
    let kernel = match (super::isa(), avx2) {
        (super::Isa::Avx512, _) => avx512,
        (super::Isa::Avx2, Some(avx2)) => avx2,
        _ => return false,
    };
    // SAFETY: mirror types of the same size, alignment and layout (asserted above).
    let (w, xq) = (mirror::<_, W>(w), mirror::<_, Q8K>(xq));
    let ptr = OutPtr(out.as_mut_ptr());
    super::parallel_for(n / PACK_COLS, |g| {
        let p = ptr;
        let group = &w[g * PACK_COLS * kb..(g + 1) * PACK_COLS * kb];
        with_tile::<16>(m, |got| {
            for r0 in (0..m).step_by(TILE_ROWS) {
                let rows = TILE_ROWS.min(m - r0);
                // SAFETY: the kernel's tier was detected at run time; each (row, column) of this
                // group's columns is written by this task alone, inside `out`.
                unsafe {
                    kernel(group, kb, &xq[r0 * kb..], rows, got, r0 == 0);
                    for (i, row) in got[..rows].iter().enumerate() {
                        let o = p.0.add((r0 + i) * n + g * PACK_COLS);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), o, PACK_COLS);
                    }
                }
            }
        });
    });
    true
}

/// The portable definition for `m` rows (what the AVX2 paths must equal bit for bit).
#[cfg(test)]
fn portable<W: KBlock>(w: &[W], xq: &[Q8K], m: usize, kb: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            out[r * n + c] = element(&w[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::GgmlType;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..len)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if i % 61 == 0 {
                    u * 9.0
                } else {
                    u
                }
            })
            .collect()
    }

    fn check<B: GgmlType<VecDotType = BlockQ8K>, W: KBlock>(
        run: fn(&[B], &[BlockQ8K], usize, usize, usize, &mut [f32]),
    ) {
        // Two super-blocks per column, and as many as take the sixteen-column kernel at one row.
        for kb in [2, SIXTEEN_ONE_ROW_MIN_BLOCKS] {
            check_shape::<B, W>(run, 37, 256 * kb);
        }
    }

    fn check_shape<B: GgmlType<VecDotType = BlockQ8K>, W: KBlock>(
        run: fn(&[B], &[BlockQ8K], usize, usize, usize, &mut [f32]),
        n: usize,
        k: usize,
    ) {
        let mut wq = vec![B::zeros(); n * k / 256];
        B::from_float(&data(n * k, 3), &mut wq);
        let x = data(19 * k, 5);
        let mut xq = vec![BlockQ8K::zeros(); 19 * k / 256];
        BlockQ8K::from_float(&x, &mut xq);
        // SAFETY: mirror types.
        let (w, y) = unsafe { (mirror::<_, W>(&wq), mirror::<_, Q8K>(&xq)) };
        let want = portable(w, y, 19, k / 256, n);
        for m in 1..=19 {
            let mut got = vec![0f32; m * n];
            run(&wq, &xq[..m * k / 256], m, k, n, &mut got);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "m={m} k={k}");
        }
        // The definition computes the dot product of the dequantized operands.
        let mut wf = vec![0f32; n * k];
        B::to_float(&wq, &mut wf);
        let mut xf = vec![0f32; 19 * k];
        BlockQ8K::to_float(&xq, &mut xf);
        for (i, &v) in want.iter().enumerate() {
            let (r, c) = (i / n, i % n);
            let exact: f64 = (0..k).map(|e| wf[c * k + e] as f64 * xf[r * k + e] as f64).sum();
            let mag: f64 = (0..k).map(|e| (wf[c * k + e] as f64 * xf[r * k + e] as f64).abs()).sum();
            assert!((v as f64 - exact).abs() <= 1e-5 * mag + 1e-6, "r={r} c={c}: {v} vs {exact}");
        }
    }

    #[test]
    fn q4k_every_path_and_row_count_equals_the_portable_definition() {
        check::<BlockQ4K, Q4K>(matmul_q4k);
    }

    #[test]
    fn q6k_every_path_and_row_count_equals_the_portable_definition() {
        check::<BlockQ6K, Q6K>(matmul_q6k);
    }
}
