//! The lane moves the AVX2 columns-in-lanes kernels share: eight columns, one per i32 lane,
//! transposed from their blocks as they are read (the AVX2 half of [`super::avx512`]'s
//! sixteen-column form).

use std::arch::x86_64::*;

/// Sixteen bytes at each of `p(0..8)`, transposed: `out[k]` lane c is dword k of `p(c)`'s.
/// Lane `4l + q` comes from 128-bit lane l of the q-th gathered vector, so that vector takes
/// columns q and q + 4, and a 4 × 4 transpose inside each 128-bit lane finishes.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn transpose8x4(p: impl Fn(usize) -> *const u8) -> [__m256i; 4] {
    let load = |c: usize| _mm_loadu_si128(p(c) as *const __m128i);
    let h: [__m256i; 4] =
        std::array::from_fn(|q| _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(load(q)), load(q + 4)));
    let (t0, t1) = (_mm256_unpacklo_epi32(h[0], h[1]), _mm256_unpackhi_epi32(h[0], h[1]));
    let (t2, t3) = (_mm256_unpacklo_epi32(h[2], h[3]), _mm256_unpackhi_epi32(h[2], h[3]));
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// The f16 at each of `p(0..8)` as f32 lanes (lane i from `p(i)`). Read as integers and
/// packed by shifts on the integer pipes, which the Q8_0 GEMV leaves idle, then one conversion,
/// instead of a scalar conversion per value in the vector loop that the memory stream waits on
/// (docs/DESIGN.md §2). Not a win everywhere: for the Q4_1 GEMV's eight column heads (`d` and
/// `m`), one gathered vector split by a shuffle stayed faster.
#[inline(always)]
pub unsafe fn f16x8(p: impl Fn(usize) -> *const u8) -> __m256 {
    let h = |i: usize| std::ptr::read_unaligned(p(i) as *const u16) as u64;
    let lo = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
    let hi = h(4) | h(5) << 16 | h(6) << 32 | h(7) << 48;
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// Each i32 lane's two f16 halves as f32: the low halves, then the high. (An f16 to f32
/// conversion is exact, whichever instruction does it.)
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16_halves(v: __m256i) -> (__m256, __m256) {
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0b11_01_10_00);
    (_mm256_cvtph_ps(_mm256_castsi256_si128(v)), _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)))
}
