//! The lane moves the AVX-512 kernels share: most of them hold two output elements (two columns,
//! or two rows) per 512-bit vector, one in each 256-bit half.

use std::arch::x86_64::*;

/// `lo` in the low 256 bits, `hi` in the high.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn cat(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// `v` in both halves.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn both(v: __m256i) -> __m512i {
    _mm512_broadcast_i64x4(v)
}

/// `v` in both halves.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn both_ps(v: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)))
}

/// `lo` in the low eight lanes, `hi` in the high eight.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn halves_ps(lo: f32, hi: f32) -> __m512 {
    _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(lo), _mm512_set1_ps(hi))
}

/// `v`'s i32 lane `t` in lanes 0-7 and its lane `8 + t` in lanes 8-15: each half's own element
/// `t` reaching that half's eight lanes.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn spread(v: __m512i, t: i32) -> __m512i {
    let u = 8 + t;
    _mm512_permutexvar_epi32(_mm512_setr_epi32(t, t, t, t, t, t, t, t, u, u, u, u, u, u, u, u), v)
}
