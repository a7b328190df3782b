//! The lane moves the AVX-512 kernels share: most of them hold two output elements (two columns,
//! or two rows) per 512-bit vector, one in each 256-bit half; the K-quant kernels hold sixteen
//! columns, transposed from their blocks as they are read.

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

/// Sixteen bytes at each of `p(0..16)`, transposed: `out[k]` lane c is dword k of `p(c)`'s.
/// Lane `4l + q` comes from 128-bit lane l of the q-th gathered vector, so that vector takes
/// columns q, q + 4, q + 8, q + 12 and a 4 × 4 transpose inside each 128-bit lane finishes.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose16x4(p: impl Fn(usize) -> *const u8) -> [__m512i; 4] {
    let load = |c: usize| _mm_loadu_si128(p(c) as *const __m128i);
    let h: [__m512i; 4] = std::array::from_fn(|q| {
        let v = _mm512_castsi128_si512(load(q));
        let v = _mm512_inserti32x4::<1>(v, load(q + 4));
        let v = _mm512_inserti32x4::<2>(v, load(q + 8));
        _mm512_inserti32x4::<3>(v, load(q + 12))
    });
    let (t0, t1) = (_mm512_unpacklo_epi32(h[0], h[1]), _mm512_unpackhi_epi32(h[0], h[1]));
    let (t2, t3) = (_mm512_unpacklo_epi32(h[2], h[3]), _mm512_unpackhi_epi32(h[2], h[3]));
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}
