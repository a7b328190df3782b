//! The AVX2 tier of the attention kernels: eight lanes, each one (query, position) or
//! (query, d) chain of fused multiply-adds in the definition's order, so its bits are the
//! scalar definition's; `exp` and the softmax's eight-lane reductions as the spec writes them.

use std::arch::x86_64::*;

use super::{prefetch_row, Next, EXP_MIN, EXP_P, KV_BLOCK, LN2_HI, LN2_LO, LOG2E};

#[cfg(target_feature = "f16c")]
pub unsafe fn widen_f16(src: &[u16], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
        let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
        _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
    }
}

/// [`super::exp_neg`] in eight lanes, operation for operation.
#[inline(always)]
pub unsafe fn exp_neg8(x: __m256) -> __m256 {
    let ok = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_MIN));
    let k =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LO), r);
    let z = _mm256_mul_ps(r, r);
    let mut y = _mm256_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
    // Lanes outside the range may hold any k: the mask zeroes them after the fact.
    let ki = _mm256_and_si256(_mm256_cvtps_epi32(k), _mm256_castps_si256(ok));
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(ki, _mm256_set1_epi32(127))));
    _mm256_and_ps(_mm256_mul_ps(y, scale), ok)
}

#[inline(always)]
unsafe fn lanes(v: __m256) -> [f32; 8] {
    let mut a = [0f32; 8];
    _mm256_storeu_ps(a.as_mut_ptr(), v);
    a
}

/// Stored values, eight at a time as f32 (widening f16 is exact).
pub trait Src: Copy {
    unsafe fn load8(p: *const Self) -> __m256;
}
impl Src for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}
#[cfg(target_feature = "f16c")]
impl Src for u16 {
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// The block's scores for `NQ` queries: `P` registers of eight positions per pass from
/// `t0`, `NQ × P` accumulators (at most twelve, so none is spilled), one fused chain per
/// lane. Each step over `d` asks for the same row of `next`, the region read after this one
/// (null: none), as the AVX-512 tier does: a block is its own 4 KiB page or more, where the
/// hardware's prefetch stops.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_pass<T: Src, const NQ: usize, const P: usize, const L2: bool>(
    qs: &[&[f32]],
    kt: *const T,
    hd: usize,
    t0: usize,
    scale: __m256,
    out: &mut [f32],
    at: &impl Fn(usize) -> usize,
    next: *const u8,
) {
    let mut acc = [[_mm256_setzero_ps(); P]; NQ];
    let k = kt.add(t0);
    let row_bytes = KV_BLOCK * std::mem::size_of::<T>();
    for d in 0..hd {
        prefetch_row::<L2>(next, d * row_bytes, row_bytes);
        let row = k.add(d * KV_BLOCK);
        // The smaller side is held in registers while the other streams past it: NQ × P
        // accumulators + min(NQ, P) + 1 fit AVX2's sixteen.
        if NQ <= P {
            let mut qb = [_mm256_setzero_ps(); NQ];
            for (j, b) in qb.iter_mut().enumerate() {
                *b = _mm256_set1_ps(*qs[j].get_unchecked(d));
            }
            for p in 0..P {
                let kv = T::load8(row.add(8 * p));
                for j in 0..NQ {
                    acc[j][p] = _mm256_fmadd_ps(qb[j], kv, acc[j][p]);
                }
            }
        } else {
            let mut kv = [_mm256_setzero_ps(); P];
            for (p, v) in kv.iter_mut().enumerate() {
                *v = T::load8(row.add(8 * p));
            }
            for j in 0..NQ {
                let qb = _mm256_set1_ps(*qs[j].get_unchecked(d));
                for p in 0..P {
                    acc[j][p] = _mm256_fmadd_ps(qb, kv[p], acc[j][p]);
                }
            }
        }
    }
    for j in 0..NQ {
        let o = at(j) + t0;
        for p in 0..P {
            _mm256_storeu_ps(out[o + 8 * p..o + 8 * p + 8].as_mut_ptr(), _mm256_mul_ps(acc[j][p], scale));
        }
    }
}

/// Every pass over the block's 32 positions for one group of up to eight queries; `next` is
/// asked for during the first pass only.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_passes<T: Src, const NQ: usize, const P: usize, const L2: bool>(
    qs: &[&[f32]],
    kt: *const T,
    hd: usize,
    scale: __m256,
    out: &mut [f32],
    at: &impl Fn(usize) -> usize,
    mut next: *const u8,
) {
    for t0 in (0..KV_BLOCK).step_by(8 * P) {
        scores_pass::<T, NQ, P, L2>(qs, kt, hd, t0, scale, out, at, next);
        next = std::ptr::null();
    }
}

/// Scores of the block's 32 positions (`kt`: `[hd][32]`) for each of `qs`, a group of
/// queries at a time ([`super::query_groups`]): each key vector is read once per group. `next`:
/// the region read after this one, asked for as the first group goes.
pub unsafe fn scores_block<T: Src>(
    qs: &[&[f32]],
    kt: *const T,
    hd: usize,
    scale: f32,
    out: &mut [f32],
    at: impl Fn(usize) -> usize,
    next: Next,
) {
    debug_assert!(qs.iter().all(|q| q.len() >= hd));
    let sc = _mm256_set1_ps(scale);
    for (j, n, next) in super::query_groups(qs.len(), super::Tier::Avx2, next) {
        let (g, at_j) = (&qs[j..j + n], |i: usize| at(j + i));
        at_level!(next, scores_group::<T>(g, kt, hd, sc, out, &at_j));
    }
}

/// One group's passes, as many positions a pass as its accumulators allow in sixteen registers.
#[inline(always)]
unsafe fn scores_group<T: Src, const L2: bool>(
    g: &[&[f32]],
    kt: *const T,
    hd: usize,
    sc: __m256,
    out: &mut [f32],
    at: &impl Fn(usize) -> usize,
    next: *const u8,
) {
    match g.len() {
        1 => scores_passes::<T, 1, 4, L2>(g, kt, hd, sc, out, at, next),
        2 => scores_passes::<T, 2, 4, L2>(g, kt, hd, sc, out, at, next),
        3 => scores_passes::<T, 3, 4, L2>(g, kt, hd, sc, out, at, next),
        4 => scores_passes::<T, 4, 2, L2>(g, kt, hd, sc, out, at, next),
        5 => scores_passes::<T, 5, 2, L2>(g, kt, hd, sc, out, at, next),
        6 => scores_passes::<T, 6, 2, L2>(g, kt, hd, sc, out, at, next),
        7 => scores_passes::<T, 7, 1, L2>(g, kt, hd, sc, out, at, next),
        _ => scores_passes::<T, 8, 1, L2>(g, kt, hd, sc, out, at, next),
    }
}

pub unsafe fn softmax_in_place(s: &mut [f32]) -> (f32, f32) {
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in s.chunks_exact(8) {
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(c.as_ptr()));
    }
    let l = lanes(mv);
    let mx = super::max_like_vector;
    let m = mx(mx(mx(l[0], l[4]), mx(l[1], l[5])), mx(mx(l[2], l[6]), mx(l[3], l[7])));
    let mb = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    for c in s.chunks_exact_mut(8) {
        let p = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mb));
        _mm256_storeu_ps(c.as_mut_ptr(), p);
        sum = _mm256_add_ps(sum, p);
    }
    (m, super::lane_sum(lanes(sum)))
}

/// `o_i[d0..d0 + 8W] += Σ_t p_i[t] · v[t][d0..]` for `NQ` queries: each value vector read
/// once feeds every query's chain; each step over `t` asks for row `t` of `next`, as
/// [`scores_pass`] does.
#[inline(always)]
unsafe fn grouped_pass<T: Src, const NQ: usize, const W: usize, const L2: bool>(
    ps: &[&[f32]],
    v: *const T,
    hd: usize,
    d0: usize,
    o: *mut f32,
    next: *const u8,
) {
    let row_bytes = hd * std::mem::size_of::<T>();
    let n = ps[0].len();
    let mut acc = [[_mm256_setzero_ps(); W]; NQ];
    for (i, a) in acc.iter_mut().enumerate() {
        for (c, a) in a.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.add(i * hd + d0 + 8 * c));
        }
    }
    let mut row = v.add(d0);
    for t in 0..n {
        prefetch_row::<L2>(next, t * row_bytes, row_bytes);
        // As in `scores_pass`: the smaller side stays in registers.
        if NQ <= W {
            let mut pb = [_mm256_setzero_ps(); NQ];
            for (i, b) in pb.iter_mut().enumerate() {
                *b = _mm256_set1_ps(*ps[i].get_unchecked(t));
            }
            for c in 0..W {
                let vv = T::load8(row.add(8 * c));
                for (i, a) in acc.iter_mut().enumerate() {
                    a[c] = _mm256_fmadd_ps(pb[i], vv, a[c]);
                }
            }
        } else {
            let mut vv = [_mm256_setzero_ps(); W];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = T::load8(row.add(8 * c));
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let pb = _mm256_set1_ps(*ps[i].get_unchecked(t));
                for c in 0..W {
                    a[c] = _mm256_fmadd_ps(pb, vv[c], a[c]);
                }
            }
        }
        row = row.add(hd);
    }
    for (i, a) in acc.iter().enumerate() {
        for (c, a) in a.iter().enumerate() {
            _mm256_storeu_ps(o.add(i * hd + d0 + 8 * c), *a);
        }
    }
}

/// [`grouped_pass`] over every `d`: thirty-two at a time for up to three queries, sixteen
/// for up to six, else eight (the widest whose accumulators fit the registers). `next` is
/// asked for during the first pass only.
#[inline(always)]
unsafe fn grouped_passes<T: Src, const NQ: usize, const L2: bool>(
    ps: &[&[f32]],
    v: *const T,
    hd: usize,
    o: *mut f32,
    mut next: *const u8,
) {
    let mut d0 = 0;
    if NQ <= 3 {
        while d0 + 32 <= hd {
            grouped_pass::<T, NQ, 4, L2>(ps, v, hd, d0, o, next);
            (d0, next) = (d0 + 32, std::ptr::null());
        }
    }
    if NQ <= 6 {
        while d0 + 16 <= hd {
            grouped_pass::<T, NQ, 2, L2>(ps, v, hd, d0, o, next);
            (d0, next) = (d0 + 16, std::ptr::null());
        }
    }
    while d0 < hd {
        grouped_pass::<T, NQ, 1, L2>(ps, v, hd, d0, o, next);
        (d0, next) = (d0 + 8, std::ptr::null());
    }
}

/// [`super::weighted_values`] for a group of up to eight queries with the same positions
/// (`ps[i]`, all of one length), outputs one after another at `o`. `next`: the region read
/// after this one.
pub unsafe fn grouped_values<T: Src>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32, next: Next) {
    debug_assert!(hd.is_multiple_of(8) && ps.iter().all(|p| p.len() == ps[0].len()));
    at_level!(next, grouped_sizes::<T>(ps, v, hd, o))
}

#[inline(always)]
unsafe fn grouped_sizes<T: Src, const L2: bool>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32, next: *const u8) {
    match ps.len() {
        1 => grouped_passes::<T, 1, L2>(ps, v, hd, o, next),
        2 => grouped_passes::<T, 2, L2>(ps, v, hd, o, next),
        3 => grouped_passes::<T, 3, L2>(ps, v, hd, o, next),
        4 => grouped_passes::<T, 4, L2>(ps, v, hd, o, next),
        5 => grouped_passes::<T, 5, L2>(ps, v, hd, o, next),
        6 => grouped_passes::<T, 6, L2>(ps, v, hd, o, next),
        7 => grouped_passes::<T, 7, L2>(ps, v, hd, o, next),
        8 => grouped_passes::<T, 8, L2>(ps, v, hd, o, next),
        n => unreachable!("a group of {n} queries"),
    }
}
