//! Transcendental functions computed by our own code, so that their bits are a property of
//! this crate and the compile target, not of the host: glibc picks `expf`, `sinf`, `powf`, ...
//! variants at load time from the CPU's features (ifunc) and changes them between releases.
//!
//! Each works in f64 with plain multiplies and adds in a fixed order (Rust never contracts
//! them into FMAs), far more precisely than the f32 result needs, then rounds once.

use crate::kernels::Isa;

const LN2_HI: f64 = 6.931_471_803_691_238e-1; // ln 2 with trailing zero bits: k * LN2_HI is exact for the k here
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10; // ln 2 - LN2_HI
const INV_LN2: f64 = std::f64::consts::LOG2_E;

/// The factorials 12! down to 0! that `exp_f64`'s Taylor series divides by (after 13!).
const EXP_TAYLOR: [f64; 13] =
    [479_001_600.0, 39_916_800.0, 3_628_800.0, 362_880.0, 40_320.0, 5_040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0];

/// 2^k as an f64, for -1022 <= k <= 1023.
fn pow2(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// e^x in f64 (relative error ~1e-15), x within [-745, 709]; saturates outside.
pub fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.0 {
        return f64::INFINITY;
    }
    if x < -745.0 {
        return 0.0;
    }
    let k = (x * INV_LN2).round();
    let r = (x - k * LN2_HI) - k * LN2_LO; // |r| <= ln2/2
                                           // Taylor series to r^13: remainder < 0.35^14/14! ~ 5e-18.
    let mut p = 1.0 / 6_227_020_800.0;
    for d in EXP_TAYLOR {
        p = p * r + 1.0 / d;
    }
    let k = k as i64;
    // Split the scale so subnormal results (k < -1022) stay exact until the final rounding.
    if k < -1000 {
        p * pow2(k + 200) * pow2(-200)
    } else if k > 1000 {
        p * pow2(k - 100) * pow2(100)
    } else {
        p * pow2(k)
    }
}

/// e^x rounded to f32: softmax and SiLU use this, never the platform's `expf`.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    exp_f64(x as f64) as f32
}

/// `exp_f32` of every element, in place, bit for bit: SiLU and GELU over a layer's hidden width
/// call it thousands of times a token, and one scalar `exp_f64` is a chain of fourteen dependent
/// multiply-adds. The vector paths take a batch of floats at a time,
/// so that several such chains are in flight at once.
pub fn exp_f32_in_place(xs: &mut [f32]) {
    exp_f32_in_place_on(crate::kernels::isa(), xs)
}

/// [`exp_f32_in_place`] on the given kernel tier (capped at the host's): every tier gives the
/// same bits, which the tests check by forcing each. The tier is chosen at run time, as the
/// matmul kernels' is, so a build without `target-cpu=x86-64-v3` keeps the vector paths.
pub fn exp_f32_in_place_on(isa: Isa, xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let xs = {
        let (isa, mut xs) = (isa.min(Isa::best()), xs);
        if isa == Isa::Avx512 {
            // SAFETY: the host runs AVX-512 F (`Isa::best`); each batch is whole.
            xs = in_batches(xs, avx512::EXP_BATCH, |c| unsafe { avx512::exp_f32_batch(c) });
        }
        if isa >= Isa::Avx2 {
            // SAFETY: the host runs AVX2; each batch is whole.
            xs = in_batches(xs, EXP_BATCH, |c| unsafe { avx2::exp_f32_batch(c) });
            // SAFETY: as above, eight floats a call.
            xs = in_batches(xs, 8, |c| unsafe { avx2::exp_f32x8(c) });
        }
        xs
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for x in xs {
        *x = exp_f32(*x);
    }
}

/// `exp_f64` of every element, in place, bit for bit (sampling's weights over a vocabulary),
/// through the same vector batches as [`exp_f32_in_place`].
pub fn exp_f64_in_place(xs: &mut [f64]) {
    exp_f64_in_place_on(crate::kernels::isa(), xs)
}

/// [`exp_f64_in_place`] on the given kernel tier (capped at the host's).
pub fn exp_f64_in_place_on(isa: Isa, xs: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    let xs = {
        let (isa, mut xs) = (isa.min(Isa::best()), xs);
        if isa == Isa::Avx512 {
            // SAFETY: the host runs AVX-512 F; each batch is whole.
            xs = in_batches(xs, avx512::EXP_BATCH, |c| unsafe { avx512::exp_f64_batch(c) });
        }
        if isa >= Isa::Avx2 {
            // SAFETY: the host runs AVX2; each batch is whole.
            xs = in_batches(xs, EXP_BATCH, |c| unsafe { avx2::exp_f64_batch(c) });
        }
        xs
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for x in xs {
        *x = exp_f64(*x);
    }
}

/// `batch` over each whole run of `size` values; the rest (fewer than `size`) comes back.
#[cfg(target_arch = "x86_64")]
fn in_batches<T>(xs: &mut [T], size: usize, batch: impl FnMut(&mut [T])) -> &mut [T] {
    let mut batches = xs.chunks_exact_mut(size);
    batches.by_ref().for_each(batch);
    batches.into_remainder()
}

/// Floats per pass of the vector `exp`: eight vectors of four f64. One chain's multiply-add
/// steps each wait for the last (about six cycles), while a core issues four vector adds or
/// multiplies a cycle; with one vector in flight, `exp` ran at a third of that rate.
pub const EXP_BATCH: usize = 32;

/// `exp_f64`'s arithmetic four lanes at a time: the same multiplies and adds in the same order
/// (no FMA), the same round-half-away-from-zero `k`, the same `p * 2^k`; lanes that would leave
/// its common path (NaN, |x| > 690, where `k` passes ±1000) send their batch back to the
/// scalar (an f32 batch eight floats at a time, through `exp_f32x8`).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    const VECTORS: usize = super::EXP_BATCH / 4;

    /// [`exp_f32x8`] of `EXP_BATCH` floats, its steps interleaved across the batch.
    #[target_feature(enable = "avx2")]
    pub unsafe fn exp_f32_batch(c: &mut [f32]) {
        debug_assert_eq!(c.len(), super::EXP_BATCH);
        let mut x = [_mm256_setzero_pd(); VECTORS];
        for v in 0..VECTORS {
            x[v] = _mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr().add(4 * v)));
        }
        let Some(e) = exp_f64x4s(x) else {
            return c.chunks_exact_mut(8).for_each(|c| exp_f32x8(c));
        };
        for v in 0..VECTORS {
            // `cvtpd_ps` rounds to nearest even, as `as f32` does.
            _mm_storeu_ps(c.as_mut_ptr().add(4 * v), _mm256_cvtpd_ps(e[v]));
        }
    }

    /// `exp_f64` of `EXP_BATCH` values.
    #[target_feature(enable = "avx2")]
    pub unsafe fn exp_f64_batch(c: &mut [f64]) {
        debug_assert_eq!(c.len(), super::EXP_BATCH);
        let mut x = [_mm256_setzero_pd(); VECTORS];
        for v in 0..VECTORS {
            x[v] = _mm256_loadu_pd(c.as_ptr().add(4 * v));
        }
        let Some(e) = exp_f64x4s(x) else {
            return c.iter_mut().for_each(|v| *v = super::exp_f64(*v));
        };
        for v in 0..VECTORS {
            _mm256_storeu_pd(c.as_mut_ptr().add(4 * v), e[v]);
        }
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn exp_f32x8(c: &mut [f32]) {
        debug_assert_eq!(c.len(), 8);
        let x = _mm256_loadu_ps(c.as_ptr());
        match exp_f64x4s([_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))]) {
            Some([lo, hi]) => {
                _mm256_storeu_ps(c.as_mut_ptr(), _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo)))
            }
            None => c.iter_mut().for_each(|v| *v = super::exp_f32(*v)),
        }
    }

    /// `exp_f64` of each lane of `N` vectors, or None when a lane leaves the common path.
    /// (Loops, not closures: a closure does not inherit the target features, and its
    /// intrinsics would not inline.)
    #[inline(always)]
    pub(super) unsafe fn exp_f64x4s<const N: usize>(x: [__m256d; N]) -> Option<[__m256d; N]> {
        let sign = _mm256_set1_pd(-0.0);
        let limit = _mm256_set1_pd(690.0);
        let mut in_range = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
        for v in 0..N {
            in_range = _mm256_and_pd(in_range, _mm256_cmp_pd::<_CMP_LE_OQ>(_mm256_andnot_pd(sign, x[v]), limit));
        }
        if _mm256_movemask_pd(in_range) != 0b1111 {
            return None;
        }
        let mut k = [_mm256_setzero_pd(); N];
        let mut r = [_mm256_setzero_pd(); N];
        for v in 0..N {
            let t = _mm256_mul_pd(x[v], _mm256_set1_pd(super::INV_LN2));
            // f64::round: trunc, then one step away from zero when the (exact) fraction is ≥ 1/2.
            let whole = _mm256_round_pd::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let frac = _mm256_andnot_pd(sign, _mm256_sub_pd(t, whole));
            let half_or_more = _mm256_cmp_pd::<_CMP_GE_OQ>(frac, _mm256_set1_pd(0.5));
            let step = _mm256_and_pd(half_or_more, _mm256_or_pd(_mm256_set1_pd(1.0), _mm256_and_pd(t, sign)));
            k[v] = _mm256_add_pd(whole, step);
            r[v] = _mm256_sub_pd(
                _mm256_sub_pd(x[v], _mm256_mul_pd(k[v], _mm256_set1_pd(super::LN2_HI))),
                _mm256_mul_pd(k[v], _mm256_set1_pd(super::LN2_LO)),
            );
        }
        let mut p = [_mm256_set1_pd(1.0 / 6_227_020_800.0); N];
        for d in super::EXP_TAYLOR {
            for v in 0..N {
                p[v] = _mm256_add_pd(_mm256_mul_pd(p[v], r[v]), _mm256_set1_pd(1.0 / d));
            }
        }
        // 2^k for |k| <= 1000: k + 1023 (exact) in the low mantissa bits of 2^52 + (k + 1023),
        // shifted up into the exponent field.
        for v in 0..N {
            let biased = _mm256_add_pd(k[v], _mm256_set1_pd(4_503_599_627_370_496.0 + 1023.0));
            p[v] = _mm256_mul_pd(p[v], _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_castpd_si256(biased))));
        }
        Some(p)
    }
}

/// The AVX-512 tier of `exp_f64`'s vector arithmetic: eight lanes a vector where AVX2 has four,
/// and 32 registers, so a batch of eight vectors keeps all its chains in registers. Every lane
/// runs the AVX2 tier's operations in its order, so the bits are the same.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Floats per batch: eight vectors of eight f64.
    pub const EXP_BATCH: usize = 64;
    const VECTORS: usize = EXP_BATCH / 8;

    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn exp_f32_batch(c: &mut [f32]) {
        debug_assert_eq!(c.len(), EXP_BATCH);
        let mut x = [_mm512_setzero_pd(); VECTORS];
        for v in 0..VECTORS {
            x[v] = _mm512_cvtps_pd(_mm256_loadu_ps(c.as_ptr().add(8 * v)));
        }
        let Some(e) = exp_f64x8s(x) else {
            return c.chunks_exact_mut(8).for_each(|c| super::avx2::exp_f32x8(c));
        };
        for v in 0..VECTORS {
            // `cvtpd_ps` rounds to nearest even, as `as f32` does.
            _mm256_storeu_ps(c.as_mut_ptr().add(8 * v), _mm512_cvtpd_ps(e[v]));
        }
    }

    /// `exp_f64` of `EXP_BATCH` values.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn exp_f64_batch(c: &mut [f64]) {
        debug_assert_eq!(c.len(), EXP_BATCH);
        let mut x = [_mm512_setzero_pd(); VECTORS];
        for v in 0..VECTORS {
            x[v] = _mm512_loadu_pd(c.as_ptr().add(8 * v));
        }
        let Some(e) = exp_f64x8s(x) else {
            return c.iter_mut().for_each(|v| *v = super::exp_f64(*v));
        };
        for v in 0..VECTORS {
            _mm512_storeu_pd(c.as_mut_ptr().add(8 * v), e[v]);
        }
    }

    /// `exp_f64` of each lane of `N` vectors, or None when a lane leaves the common path
    /// (loops, not closures, as in the AVX2 tier).
    #[inline(always)]
    pub(super) unsafe fn exp_f64x8s<const N: usize>(x: [__m512d; N]) -> Option<[__m512d; N]> {
        let sign = _mm512_set1_epi64(i64::MIN);
        let limit = _mm512_set1_pd(690.0);
        for v in 0..N {
            let abs = _mm512_castsi512_pd(_mm512_andnot_si512(sign, _mm512_castpd_si512(x[v])));
            if _mm512_cmp_pd_mask::<_CMP_LE_OQ>(abs, limit) != 0xff {
                return None;
            }
        }
        let mut k = [_mm512_setzero_pd(); N];
        let mut r = [_mm512_setzero_pd(); N];
        for v in 0..N {
            let t = _mm512_mul_pd(x[v], _mm512_set1_pd(super::INV_LN2));
            // f64::round: trunc, then one step away from zero when the (exact) fraction is ≥ 1/2.
            let whole = _mm512_roundscale_pd::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let frac = _mm512_castsi512_pd(_mm512_andnot_si512(sign, _mm512_castpd_si512(_mm512_sub_pd(t, whole))));
            let half_or_more = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(frac, _mm512_set1_pd(0.5));
            let away = _mm512_or_si512(
                _mm512_castpd_si512(_mm512_set1_pd(1.0)),
                _mm512_and_si512(_mm512_castpd_si512(t), sign),
            );
            k[v] = _mm512_add_pd(whole, _mm512_maskz_mov_pd(half_or_more, _mm512_castsi512_pd(away)));
            r[v] = _mm512_sub_pd(
                _mm512_sub_pd(x[v], _mm512_mul_pd(k[v], _mm512_set1_pd(super::LN2_HI))),
                _mm512_mul_pd(k[v], _mm512_set1_pd(super::LN2_LO)),
            );
        }
        let mut p = [_mm512_set1_pd(1.0 / 6_227_020_800.0); N];
        for d in super::EXP_TAYLOR {
            for v in 0..N {
                p[v] = _mm512_add_pd(_mm512_mul_pd(p[v], r[v]), _mm512_set1_pd(1.0 / d));
            }
        }
        // 2^k for |k| <= 1000, as the AVX2 tier builds it.
        for v in 0..N {
            let biased = _mm512_add_pd(k[v], _mm512_set1_pd(4_503_599_627_370_496.0 + 1023.0));
            p[v] = _mm512_mul_pd(p[v], _mm512_castsi512_pd(_mm512_slli_epi64::<52>(_mm512_castpd_si512(biased))));
        }
        Some(p)
    }
}

/// Natural log in f64 for finite x > 0 (relative error ~1e-16).
pub fn ln_f64(x: f64) -> f64 {
    assert!(x > 0.0 && x.is_finite(), "ln_f64 needs a finite positive argument, got {x}");
    let (mut m, mut e) = (x, 0i64);
    if m < f64::MIN_POSITIVE {
        m *= pow2(54);
        e -= 54;
    }
    let bits = m.to_bits();
    e += ((bits >> 52) & 0x7ff) as i64 - 1023;
    m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52)); // [1, 2)
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    // ln m = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.172: the series to s^27 leaves < 1e-20.
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut p = 1.0 / 27.0;
    let mut d = 25.0;
    while d >= 1.0 {
        p = p * s2 + 1.0 / d;
        d -= 2.0;
    }
    let ef = e as f64;
    (ef * LN2_HI + 2.0 * s * p) + ef * LN2_LO
}

/// base^e for base > 0, rounded to f32 (RoPE frequencies).
pub fn powf(base: f32, e: f32) -> f32 {
    exp_f64(e as f64 * ln_f64(base as f64)) as f32
}

/// (sin t, cos t) for |t| < 2^20 (RoPE angles are position × frequency).
pub fn sin_cos_f64(t: f64) -> (f64, f64) {
    assert!(t.is_finite() && t.abs() < 1_048_576.0, "sin_cos_f64 argument {t} out of range");
    // Cody-Waite reduction by pi/2 in three parts; n * PIO2_1 and n * PIO2_2 are exact here.
    const PIO2_1: f64 = 1.570_796_326_734_125_6; // first 33 bits of pi/2
    const PIO2_2: f64 = 6.077_100_506_303_966e-11; // next 33 bits
    const PIO2_3: f64 = 2.022_266_248_795_950_6e-21; // the rest
    let n = (t * std::f64::consts::FRAC_2_PI).round();
    let r = ((t - n * PIO2_1) - n * PIO2_2) - n * PIO2_3; // |r| <= pi/4 (+ a hair)
    let r2 = r * r;
    // Taylor series to r^17 (sin) and r^18 (cos): remainders < 1e-19. FACT[i] = i!.
    const FACT: [f64; 19] = [
        1.0,
        1.0,
        2.0,
        6.0,
        24.0,
        120.0,
        720.0,
        5_040.0,
        40_320.0,
        362_880.0,
        3_628_800.0,
        39_916_800.0,
        479_001_600.0,
        6_227_020_800.0,
        87_178_291_200.0,
        1_307_674_368_000.0,
        20_922_789_888_000.0,
        355_687_428_096_000.0,
        6_402_373_705_728_000.0,
    ];
    let sign = |j: usize| if j.is_multiple_of(2) { 1.0 } else { -1.0 };
    let mut s = 1.0 / FACT[17];
    for j in (0..8).rev() {
        s = s * r2 + sign(j) / FACT[2 * j + 1];
    }
    let mut c = -1.0 / FACT[18];
    for j in (0..9).rev() {
        c = c * r2 + sign(j) / FACT[2 * j];
    }
    let (sin_r, cos_r) = (r * s, c);
    match (n as i64).rem_euclid(4) {
        0 => (sin_r, cos_r),
        1 => (cos_r, -sin_r),
        2 => (-sin_r, -cos_r),
        _ => (-cos_r, sin_r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_matches_libm_within_one_ulp() {
        let mut worst = 0;
        let mut x = -104.0f32;
        while x < 89.0 {
            let (a, b) = (exp_f32(x), (x as f64).exp() as f32);
            worst = worst.max(ulps(a, b));
            x += 0.0137;
        }
        assert!(worst <= 1, "exp_f32 off by {worst} ulps");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-100.0) > 0.0); // subnormal, not flushed
    }

    #[test]
    fn exp_in_place_is_exp_f32_bit_for_bit() {
        // Every edge of the vector path: its range limit (±690) and the scalar's (709, -745),
        // halfway points of k = round(x / ln 2), subnormal and zero results, NaN, infinities,
        // signed zeros, mixed into vectors whose other lanes are ordinary.
        let ln2 = std::f64::consts::LN_2;
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            690.0,
            -690.0,
            690.01,
            -690.01,
            88.7,
            88.8,
            -87.3,
            -103.9,
            -104.0,
            -150.0,
            709.0,
            710.0,
            -745.0,
            -746.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-30,
            -1e-30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for k in -160..160 {
            let mid = ((k as f64 + 0.5) * ln2) as f32;
            xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
        }
        let mut s = 0x9E3779B97F4A7C15u64;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            xs.push(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 240.0);
        }
        // On every tier, at every offset, so each special value meets each lane of a batch, of
        // a vector of eight and the scalar tail.
        for isa in Isa::available() {
            for off in 0..64 {
                let mut got = xs[off..].to_vec();
                exp_f32_in_place_on(isa, &mut got);
                for (&x, g) in xs[off..].iter().zip(&got) {
                    assert_eq!(g.to_bits(), exp_f32(x).to_bits(), "exp({x:e}) on {}", isa.name());
                }
            }
        }
    }

    #[test]
    fn exp_f64_in_place_is_exp_f64_bit_for_bit() {
        let mut xs: Vec<f64> = vec![0.0, -0.0, 690.0, -690.0, 690.5, -700.0, 709.0, 710.0, -745.0, -746.0, -1e-300];
        xs.extend([f64::MAX, f64::MIN, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, f64::MIN_POSITIVE]);
        for k in -990i64..990 {
            // x / ln 2 lands on k + 1/2 exactly for some f64 x near there (round goes away from 0).
            let x0 = (k as f64 + 0.5) * std::f64::consts::LN_2;
            xs.extend((-3i64..=3).map(|d| f64::from_bits((x0.to_bits() as i64 + d) as u64)));
        }
        let mut s = 0x2545F4914F6CDD1Du64;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            xs.push(((s >> 11) as f64 / (1u64 << 53) as f64 - 0.9) * 60.0);
        }
        for isa in Isa::available() {
            for off in 0..64 {
                let mut got = xs[off..].to_vec();
                exp_f64_in_place_on(isa, &mut got);
                for (&x, g) in xs[off..].iter().zip(&got) {
                    assert_eq!(g.to_bits(), exp_f64(x).to_bits(), "exp({x:e}) on {}", isa.name());
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_f64x4_is_exp_f64_at_exact_halfway_points() {
        use std::arch::x86_64::*;
        // f32 inputs never land x / ln 2 on a half exactly; f64 ones do, and there f64::round
        // goes away from zero where a round-to-even would not.
        let mut halfway = Vec::new();
        for k in -990i64..990 {
            let x0 = (k as f64 + 0.5) * std::f64::consts::LN_2;
            for d in -64i64..=64 {
                let x = f64::from_bits((x0.to_bits() as i64 + d) as u64);
                if x * INV_LN2 == k as f64 + 0.5 {
                    halfway.push(x);
                }
            }
        }
        assert!(halfway.len() > 100, "found only {} halfway points", halfway.len());
        assert!(Isa::best() >= Isa::Avx2, "every x86-64-v3 host runs AVX2; this one does not");
        // Through a batch's eight vectors as well as through one, and through the AVX-512
        // tier's where the host has it.
        if Isa::best() == Isa::Avx512 {
            for xs in halfway.chunks_exact(64) {
                let mut got = [0f64; 64];
                // SAFETY: the host runs AVX-512 F.
                unsafe {
                    let x: [__m512d; 8] = std::array::from_fn(|v| _mm512_loadu_pd(xs[8 * v..].as_ptr()));
                    let e = avx512::exp_f64x8s(x).expect("inside the vector range");
                    e.iter().enumerate().for_each(|(v, &e)| _mm512_storeu_pd(got[8 * v..].as_mut_ptr(), e));
                }
                for (g, &x) in got.iter().zip(xs) {
                    assert_eq!(g.to_bits(), exp_f64(x).to_bits(), "exp({x:e}) on avx512");
                }
            }
        }
        for xs in halfway.chunks_exact(EXP_BATCH) {
            let mut got = [0f64; EXP_BATCH];
            // SAFETY: AVX2 is enabled at compile time.
            unsafe {
                let x: [__m256d; EXP_BATCH / 4] = std::array::from_fn(|v| _mm256_loadu_pd(xs[4 * v..].as_ptr()));
                let e = avx2::exp_f64x4s(x).expect("inside the vector range");
                e.iter().enumerate().for_each(|(v, &e)| _mm256_storeu_pd(got[4 * v..].as_mut_ptr(), e));
            }
            for (g, &x) in got.iter().zip(xs) {
                assert_eq!(g.to_bits(), exp_f64(x).to_bits(), "exp({x:e}) in a batch on avx2");
            }
        }
        for xs in halfway.chunks_exact(4) {
            let mut got = [0f64; 4];
            // SAFETY: AVX2 is enabled at compile time.
            unsafe {
                let [v] = avx2::exp_f64x4s([_mm256_loadu_pd(xs.as_ptr())]).expect("inside the vector range");
                _mm256_storeu_pd(got.as_mut_ptr(), v);
            }
            for (g, &x) in got.iter().zip(xs) {
                assert_eq!(g.to_bits(), exp_f64(x).to_bits(), "exp({x:e})");
            }
        }
    }

    #[test]
    fn ln_and_pow_match_libm() {
        for &x in &[1e-300, 1e-10, 0.5, 1.0, 1.5, 2.0, 10.0, 1e4, 1e6, 1e300] {
            let (a, b) = (ln_f64(x), x.ln());
            assert!((a - b).abs() <= 4e-16 * b.abs().max(1.0), "ln {x}: {a} vs {b}");
        }
        for base in [10000.0f32, 500000.0, 1e6] {
            for i in 0..64 {
                let e = i as f32 / 64.0;
                assert!(ulps(powf(base, e), (base as f64).powf(e as f64) as f32) <= 1, "{base}^{e}");
            }
        }
    }

    #[test]
    fn sin_cos_match_libm() {
        let mut t = -9000.0f64;
        while t < 9000.0 {
            let (s, c) = sin_cos_f64(t);
            assert!((s - t.sin()).abs() < 1e-14 && (c - t.cos()).abs() < 1e-14, "t={t}");
            t += 0.731;
        }
        assert_eq!(sin_cos_f64(0.0), (0.0, 1.0));
    }
}
