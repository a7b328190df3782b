//! Activations to Candle's dot-product blocks (Q8_0, Q8_1, Q8_K), bit for bit as Candle's
//! `from_float` makes them, but without its per-value call of libm's `roundf`: that call was most
//! of a small multi-row matmul's time (60% of an 8-row 128 × 896 Q5_0 one), and it is paid again
//! by every matrix a row meets. Every block is the same bytes as Candle's (tested against it).

use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use half::f16;

use super::cpu_kquant::Q8K;
use super::cpu_q32::{Q80, Q81};

/// `f32::round` (halves away from zero), from `trunc`, which is one instruction on x86-64-v3:
/// `v - trunc(v)` is exact, so the comparison with 0.5 decides the same ties `roundf` does. NaN
/// stays NaN (the comparison is false) and converts to 0 as Candle's does.
#[inline(always)]
fn round_half_away(v: f32) -> f32 {
    let t = v.trunc();
    if (v - t).abs() >= 0.5 {
        t + 1f32.copysign(v)
    } else {
        t
    }
}

/// Reinterprets Candle's blocks as their mirrors, for writing.
///
/// SAFETY (callers): as `cpu_q32::mirror`: `B` and `T` are a Candle block type and its mirror.
unsafe fn mirror_mut<B, T>(s: &mut [B]) -> &mut [T] {
    std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut T, s.len())
}

/// The largest |x| (NaN ignored, as `f32::max` ignores it).
fn amax(x: &[f32]) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: AVX2 is a compile-time feature of this build.
    unsafe {
        return avx2::amax(x);
    }
    #[allow(unreachable_code)]
    x.iter().fold(0f32, |a, &v| a.max(v.abs()))
}

/// `q[i] = round(x[i] · scale)` converted as `f32 as i8` converts (saturating, NaN to 0),
/// clamped first to [−128, 127] (which saturation does anyway).
fn round_block(x: &[f32], scale: f32, q: &mut [i8]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if x.len().is_multiple_of(32) {
        // SAFETY: AVX2 is a compile-time feature of this build; lengths checked.
        unsafe { avx2::round_block(x, scale, q) };
        return;
    }
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_half_away(v * scale) as i8;
    }
}

/// One 32-value block as Q8_0 and Q8_1 make it: `d = amax / 127`, `q = round(x / d)`.
fn block32(x: &[f32], d_out: &mut f16, qs: &mut [i8; 32]) {
    let d = amax(x) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    *d_out = f16::from_f32(d);
    round_block(x, id, qs);
}

/// Candle's `BlockQ8_0::from_float` (x86).
pub fn q8_0(xs: &[f32], ys: &mut [BlockQ8_0]) {
    assert_eq!(xs.len(), 32 * ys.len());
    // SAFETY: Q80 mirrors BlockQ8_0.
    let ys = unsafe { mirror_mut::<_, Q80>(ys) };
    for (x, y) in xs.chunks_exact(32).zip(ys) {
        block32(x, &mut y.d, &mut y.qs);
    }
}

/// Candle's `BlockQ8_1::from_float`: Q8_0's values, and `s = f16(Σ q) · d` in f16.
pub fn q8_1(xs: &[f32], ys: &mut [BlockQ8_1]) {
    assert_eq!(xs.len(), 32 * ys.len());
    // SAFETY: Q81 mirrors BlockQ8_1.
    let ys = unsafe { mirror_mut::<_, Q81>(ys) };
    for (x, y) in xs.chunks_exact(32).zip(ys) {
        block32(x, &mut y.d, &mut y.qs);
        let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
        y.s = f16::from_f32(sum as f32) * y.d;
    }
}

/// Candle's `BlockQ8K::from_float`: scaled by −127 / (the value of largest magnitude, the first
/// such), rounded and clamped; the sums of each 16; `d` its reciprocal.
pub fn q8k(xs: &[f32], ys: &mut [BlockQ8K]) {
    assert_eq!(xs.len(), 256 * ys.len());
    // SAFETY: Q8K mirrors BlockQ8K.
    let ys = unsafe { mirror_mut::<_, Q8K>(ys) };
    for (x, y) in xs.chunks_exact(256).zip(ys) {
        let amax = amax(x);
        if amax == 0.0 {
            y.d = 0.0;
            y.qs.fill(0);
            y.bsums.fill(0);
            continue;
        }
        // The first value of that magnitude, as Candle's strict `<` scan keeps it.
        let max = *x.iter().find(|v| v.abs() == amax).expect("amax is some |x|");
        let iscale = -127f32 / max;
        round_block(x, iscale, &mut y.qs);
        for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = q.iter().map(|&q| q as i32).sum::<i32>() as i16;
        }
        y.d = 1.0 / iscale;
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn abs(v: __m256) -> __m256 {
        _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)))
    }

    /// `max(|v|, acc)` returns `acc` where `v` is NaN: `f32::max`'s rule.
    pub unsafe fn amax(x: &[f32]) -> f32 {
        let (chunks, rest) = x.as_chunks::<8>();
        let mut m = _mm256_setzero_ps();
        for c in chunks {
            m = _mm256_max_ps(abs(_mm256_loadu_ps(c.as_ptr())), m);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().chain(rest).fold(0f32, |a, &v| a.max(v.abs()))
    }

    /// Eight values times `scale`, rounded half away from zero (exactly [`super::round_half_away`]:
    /// `v - trunc(v)` is exact), as i32 lanes with NaN as 0.
    #[inline(always)]
    unsafe fn round8(v: __m256, scale: __m256) -> __m256i {
        let p = _mm256_mul_ps(v, scale);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
        let tie_or_more = _mm256_cmp_ps::<_CMP_GE_OQ>(abs(_mm256_sub_ps(p, t)), _mm256_set1_ps(0.5));
        let away = _mm256_or_ps(_mm256_and_ps(p, _mm256_set1_ps(-0.0)), _mm256_set1_ps(1.0));
        let r = _mm256_add_ps(t, _mm256_and_ps(tie_or_more, away));
        let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
        _mm256_and_si256(_mm256_cvttps_epi32(r), ordered)
    }

    /// [`super::round_block`], 32 values at a time, packed to bytes with saturation.
    pub unsafe fn round_block(x: &[f32], scale: f32, q: &mut [i8]) {
        assert_eq!(x.len(), q.len());
        let scale = _mm256_set1_ps(scale);
        for (x, q) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            let i: [__m256i; 4] = std::array::from_fn(|j| round8(_mm256_loadu_ps(x.as_ptr().add(8 * j)), scale));
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            // The packs interleave 128-bit lanes: dword j of each lane came from vector j.
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::GgmlType;

    /// Values that probe every branch: ties at ±k.5 (a block whose largest magnitude is 127
    /// has scale 1), NaN, infinities, signed zeros, subnormals, huge and tiny magnitudes, and
    /// pseudo-random blocks.
    fn inputs(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        (0..len)
            .map(|i| {
                let r = next();
                match (i / 32) % 8 {
                    0 => {
                        if i % 32 == 0 {
                            127.0
                        } else {
                            (r % 255) as f32 / 2.0 - 63.5
                        }
                    }
                    1 => [f32::NAN, f32::INFINITY, -0.0, 0.0, 1e-40, -1e-42, 3.0e38, -2.5][(r % 8) as usize],
                    2 => 0.0,
                    3 => f32::from_bits((r as u32) & 0x807F_FFFF | 0x3F00_0000),
                    4 => {
                        if i % 32 == 5 {
                            -1000.0
                        } else {
                            (r % 2001) as f32 - 1000.0
                        }
                    }
                    _ => f32::from_bits(r as u32 >> 1) * if r & (1 << 40) != 0 { -1.0 } else { 1.0 },
                }
            })
            .collect()
    }

    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: plain-data blocks viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }

    #[test]
    fn every_quantizer_makes_candles_bytes() {
        for seed in 1..40u64 {
            let x = inputs(256 * 8, seed);
            let (mut a, mut b) = (vec![BlockQ8_0::zeros(); 64], vec![BlockQ8_0::zeros(); 64]);
            q8_0(&x, &mut a);
            BlockQ8_0::from_float(&x, &mut b);
            assert_eq!(bytes(&a), bytes(&b), "Q8_0, seed {seed}");
            let (mut a, mut b) = (vec![BlockQ8_1::zeros(); 64], vec![BlockQ8_1::zeros(); 64]);
            q8_1(&x, &mut a);
            BlockQ8_1::from_float(&x, &mut b);
            assert_eq!(bytes(&a), bytes(&b), "Q8_1, seed {seed}");
            let (mut a, mut b) = (vec![BlockQ8K::zeros(); 8], vec![BlockQ8K::zeros(); 8]);
            q8k(&x, &mut a);
            BlockQ8K::from_float(&x, &mut b);
            assert_eq!(bytes(&a), bytes(&b), "Q8_K, seed {seed}");
        }
    }

    #[test]
    fn rounding_is_roundf_on_ties_and_edges() {
        for v in
            [0.5f32, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 8388607.5, 8388608.0, 1e30, -0.0, f32::NAN]
        {
            let (a, b) = (round_half_away(v), v.round());
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{v}: {a} != {b}");
        }
    }
}
