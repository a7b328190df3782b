//! The AVX-512 tier of the two kernels that carry the arithmetic, [`super::avx2::scores_block`] and
//! [`super::avx2::grouped_values`]: sixteen lanes where those have eight, each lane still one
//! (query, position) or (query, d) chain of fused multiply-adds in the same order, so the bits
//! are the AVX2 tier's (and the definition's) whatever the width. What the width buys is
//! registers: a group of up to eight queries keeps every accumulator of a block's 32 positions
//! (or of 32 `d`) in registers with one broadcast per two multiply-adds, where the AVX2 tier's
//! sixteen registers allow one per multiply-add at seven queries (Qwen2.5 0.5B's group) and
//! pass over the block four times. The softmax, the folds and `exp` stay the AVX2 tier's.

use std::arch::x86_64::*;

use super::{prefetch_row, Next, KV_BLOCK};

/// Stored values, sixteen at a time as f32 (widening f16 is exact).
pub trait Src: Copy {
    unsafe fn load16(p: *const Self) -> __m512;
}
impl Src for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}
impl Src for u16 {
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// The block's 32 scores for `NQ` queries: two vectors of sixteen positions per query. Each
/// step over `d` asks for the same row of `next`, the region read after this one: a block is
/// its own 4 KiB page or more, where the hardware's prefetch stops, and a row a step keeps
/// few enough requests in flight that the block's own loads are not held up behind them.
#[inline(always)]
unsafe fn scores_group<T: Src, const NQ: usize, const L2: bool>(
    qs: &[&[f32]],
    kt: *const T,
    hd: usize,
    scale: f32,
    out: &mut [f32],
    at: &impl Fn(usize) -> usize,
    next: *const u8,
) {
    const { assert!(KV_BLOCK == 32) };
    let q: [*const f32; NQ] = std::array::from_fn(|j| qs[j].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 2]; NQ];
    let row_bytes = KV_BLOCK * std::mem::size_of::<T>();
    for d in 0..hd {
        let row = kt.add(d * KV_BLOCK);
        prefetch_row::<L2>(next, d * row_bytes, row_bytes);
        let (k0, k1) = (T::load16(row), T::load16(row.add(16)));
        for j in 0..NQ {
            let qb = _mm512_set1_ps(*q[j].add(d));
            acc[j][0] = _mm512_fmadd_ps(qb, k0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(qb, k1, acc[j][1]);
        }
    }
    let sc = _mm512_set1_ps(scale);
    for (j, a) in acc.iter().enumerate() {
        let o = out[at(j)..at(j) + KV_BLOCK].as_mut_ptr();
        _mm512_storeu_ps(o, _mm512_mul_ps(a[0], sc));
        _mm512_storeu_ps(o.add(16), _mm512_mul_ps(a[1], sc));
    }
}

/// [`super::avx2::scores_block`] in sixteen lanes, a group of up to eight queries at a time.
/// `next`: the region read after this one, asked for as the first group goes.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
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
    for (j, n, next) in super::query_groups(qs.len(), super::Tier::Avx512, next) {
        let (g, at_j) = (&qs[j..j + n], |i: usize| at(j + i));
        at_level!(next, scores_group_of::<T>(g, kt, hd, scale, out, &at_j));
    }
}

/// One group's scores, its size a const.
#[inline(always)]
unsafe fn scores_group_of<T: Src, const L2: bool>(
    g: &[&[f32]],
    kt: *const T,
    hd: usize,
    scale: f32,
    out: &mut [f32],
    at: &impl Fn(usize) -> usize,
    next: *const u8,
) {
    match g.len() {
        1 => scores_group::<T, 1, L2>(g, kt, hd, scale, out, at, next),
        2 => scores_group::<T, 2, L2>(g, kt, hd, scale, out, at, next),
        3 => scores_group::<T, 3, L2>(g, kt, hd, scale, out, at, next),
        4 => scores_group::<T, 4, L2>(g, kt, hd, scale, out, at, next),
        5 => scores_group::<T, 5, L2>(g, kt, hd, scale, out, at, next),
        6 => scores_group::<T, 6, L2>(g, kt, hd, scale, out, at, next),
        7 => scores_group::<T, 7, L2>(g, kt, hd, scale, out, at, next),
        _ => scores_group::<T, 8, L2>(g, kt, hd, scale, out, at, next),
    }
}

/// `o_i[d0..d0 + 16W] += Σ_t p_i[t] · v[t][d0..]` for `NQ` queries, the value vectors read
/// once for every query's chains; each step over `t` asks for row `t` of `next`,
/// as [`scores_group`] does.
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
    let p: [*const f32; NQ] = std::array::from_fn(|i| ps[i].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); W]; NQ];
    for (i, a) in acc.iter_mut().enumerate() {
        for (c, a) in a.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(o.add(i * hd + d0 + 16 * c));
        }
    }
    let mut row = v.add(d0);
    for t in 0..n {
        prefetch_row::<L2>(next, t * row_bytes, row_bytes);
        let mut vv = [_mm512_setzero_ps(); W];
        for (c, x) in vv.iter_mut().enumerate() {
            *x = T::load16(row.add(16 * c));
        }
        for (i, a) in acc.iter_mut().enumerate() {
            let pb = _mm512_set1_ps(*p[i].add(t));
            for c in 0..W {
                a[c] = _mm512_fmadd_ps(pb, vv[c], a[c]);
            }
        }
        row = row.add(hd);
    }
    for (i, a) in acc.iter().enumerate() {
        for (c, a) in a.iter().enumerate() {
            _mm512_storeu_ps(o.add(i * hd + d0 + 16 * c), *a);
        }
    }
}

/// [`grouped_pass`] over every `d` (a multiple of 16): 64 at a time for up to three
/// queries, else 32, else 16 (the widest whose accumulators fit the 32 registers).
/// `next` is asked for during the first pass only.
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
        while d0 + 64 <= hd {
            grouped_pass::<T, NQ, 4, L2>(ps, v, hd, d0, o, next);
            (d0, next) = (d0 + 64, std::ptr::null());
        }
    }
    while d0 + 32 <= hd {
        grouped_pass::<T, NQ, 2, L2>(ps, v, hd, d0, o, next);
        (d0, next) = (d0 + 32, std::ptr::null());
    }
    while d0 < hd {
        grouped_pass::<T, NQ, 1, L2>(ps, v, hd, d0, o, next);
        (d0, next) = (d0 + 16, std::ptr::null());
    }
}

/// [`super::avx2::grouped_values`] in sixteen lanes; `hd` a multiple of 16. `next`: the
/// region read after this one.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub unsafe fn grouped_values<T: Src>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32, next: Next) {
    debug_assert!(hd.is_multiple_of(16) && ps.iter().all(|p| p.len() == ps[0].len()));
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
