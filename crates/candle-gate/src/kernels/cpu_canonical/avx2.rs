//! The AVX2 tier of the same kernels: a group's sixteen columns as two halves of eight (the low
//! and high 32 bytes of each of the tile's 64-byte vectors), each half a pass over the group's
//! tiles (in L2 by then) with eight columns in a vector. `vpdpbusd`'s sums are `maddubs` then
//! `madd` with ones, which equals it wherever no pair of products leaves i16: weights below 64
//! against |q| ≤ 127 cannot; Q8_0's signed weights go in as `|w|` against `q · sign(w)`.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::{q6k_slot, GroupOut, Layout, Pass, PACK_COLS};
use crate::kernels::canonical::{BUTTERFLY, LANES};
use candle_core::quantized::GgmlDType;

/// Each row's 32 lane accumulators, eight columns a vector.
type Lanes<const R: usize> = [[MaybeUninit<__m256>; LANES]; R];

/// [`super::avx512`]'s float step, eight outputs at once.
#[inline(always)]
unsafe fn step(lanes: &mut [MaybeUninit<__m256>; LANES], u: usize, first: bool, coef: __m256, d: f32, c: __m256) {
    let lane = &mut lanes[u % LANES];
    let acc = if first && u < LANES { _mm256_setzero_ps() } else { lane.assume_init() };
    lane.write(_mm256_fmadd_ps(_mm256_mul_ps(coef, _mm256_set1_ps(d)), c, acc));
}

/// The four-product sums `vpdpbusd` would add, exact on the ranges here (module docs).
#[inline(always)]
unsafe fn dot4(w: __m256i, q: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1))
}

#[inline(always)]
unsafe fn dot(pass: &Pass, r: usize, u: usize, w: &[__m256i], first: usize) -> __m256i {
    let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for i in (0..w.len()).step_by(2) {
        even = _mm256_add_epi32(even, dot4(w[i], _mm256_set1_epi32(pass.word(r, u, first + i))));
        odd = _mm256_add_epi32(odd, dot4(w[i + 1], _mm256_set1_epi32(pass.word(r, u, first + i + 1))));
    }
    _mm256_add_epi32(even, odd)
}

/// Half `h` (eight columns) of the 64-byte vector at `p`.
#[inline(always)]
unsafe fn load(p: *const u8, h: usize) -> __m256i {
    _mm256_loadu_si256(p.add(32 * h) as *const __m256i)
}

/// Half `h` of the sixteen f16 at `p`, as f32.
#[inline(always)]
unsafe fn halves_f32(p: *const u8, h: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i))
}

/// The low 16 bits of each lane of `v` as f16, widened to f32.
#[inline(always)]
unsafe fn low_f16(v: __m256i) -> __m256 {
    let low = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(low, low));
    _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
}

#[inline(always)]
unsafe fn byte_u(v: __m256i, byte: u32) -> __m256i {
    _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(8 * byte as i32)), _mm256_set1_epi32(0xFF))
}

/// [`super::avx512`]'s Q4_K, eight columns a vector.
#[inline(always)]
unsafe fn q4k<const R: usize>(tile: *const u8, sb: usize, h: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let v = |s: usize, t: usize| load(tile.add(256 * s + 64 * t), h);
    let head = v(0, 0);
    let d = low_f16(head);
    let neg_dmin = _mm256_xor_ps(low_f16(_mm256_srli_epi32::<16>(head)), _mm256_set1_ps(-0.0));
    let (s0, s1, s2) = (v(0, 1), v(0, 2), v(0, 3));
    let (m63, m15, m3) = (_mm256_set1_epi32(63), _mm256_set1_epi32(15), _mm256_set1_epi32(3));
    let scale_min = |j: u32| -> (__m256, __m256) {
        let (sc, mn) = if j < 4 {
            (_mm256_and_si256(byte_u(s0, j), m63), _mm256_and_si256(byte_u(s1, j), m63))
        } else {
            let i = j - 4;
            let (lo, a, b) = (byte_u(s2, i), byte_u(s0, i), byte_u(s1, i));
            let high = |x: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(x), m3));
            (_mm256_or_si256(_mm256_and_si256(lo, m15), high(a)), _mm256_or_si256(_mm256_srli_epi32::<4>(lo), high(b)))
        };
        (_mm256_cvtepi32_ps(sc), _mm256_cvtepi32_ps(mn))
    };
    let low4 = _mm256_set1_epi8(0x0F);
    for p in 0..4 {
        let mut w = [[_mm256_setzero_si256(); 8]; 2];
        for i in 0..8 {
            let x = v(1 + 2 * p + i / 4, i % 4);
            w[0][i] = _mm256_and_si256(x, low4);
            w[1][i] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
        }
        for (half, w) in w.iter().enumerate() {
            let j = 2 * p + half;
            let u = 8 * sb + j;
            let (sc, mn) = scale_min(j as u32);
            for (r, lanes) in acc.iter_mut().enumerate() {
                let c = _mm256_mul_ps(_mm256_cvtepi32_ps(dot(pass, r, u, w, 0)), sc);
                let dr = pass.d(r, u);
                step(lanes, u, true, d, dr, c);
                step(lanes, u, false, neg_dmin, dr, _mm256_mul_ps(mn, _mm256_set1_ps(pass.sum(r, u) as f32)));
            }
        }
    }
}

/// [`super::avx512`]'s Q6_K, eight columns a vector, in the same order: the tile from its start
/// to its end, `d` last.
#[inline(always)]
unsafe fn q6k<const R: usize>(tile: *const u8, sb: usize, h8: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let (low4, bits45) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let six = |ql: __m256i, high: __m256i| _mm256_or_si256(_mm256_and_si256(ql, low4), _mm256_and_si256(high, bits45));
    let scales: [__m256i; 4] = std::array::from_fn(|i| load(tile.add(64 * q6k_slot(48 + i)), h8));
    let mut sums = [[MaybeUninit::uninit(); 8]; R];
    for h in 0..2 {
        for half in 0..2 {
            let mut w = [[_mm256_setzero_si256(); 4]; 4];
            for i in 0..4 {
                let word = 4 * half + i;
                let ql0 = load(tile.add(64 * q6k_slot(16 * h + word)), h8);
                let ql1 = load(tile.add(64 * q6k_slot(16 * h + 8 + word)), h8);
                let qh = load(tile.add(64 * q6k_slot(32 + 8 * h + word)), h8);
                w[0][i] = six(ql0, _mm256_slli_epi16::<4>(qh));
                w[1][i] = six(ql1, _mm256_slli_epi16::<2>(qh));
                w[2][i] = six(_mm256_srli_epi16::<4>(ql0), qh);
                w[3][i] = six(_mm256_srli_epi16::<4>(ql1), _mm256_srli_epi16::<2>(qh));
            }
            for (t, w) in w.iter().enumerate() {
                let (j, u) = (4 * h + t, 8 * sb + 4 * h + t);
                let signed_byte = |byte: usize| {
                    let shifted = _mm256_sllv_epi32(scales[2 * h + t / 2], _mm256_set1_epi32(24 - 8 * byte as i32));
                    _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(shifted))
                };
                let sc = (half == 1).then(|| (signed_byte(2 * (t % 2)), signed_byte(2 * (t % 2) + 1)));
                for (r, sums) in sums.iter_mut().enumerate() {
                    let offset = _mm256_set1_epi32(32 * pass.half(r, u, half));
                    let sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot(pass, r, u, w, 4 * half), offset));
                    let whole = match sc {
                        None => sum,
                        Some((sc_lo, sc_hi)) => {
                            _mm256_fmadd_ps(sc_lo, sums[j].assume_init(), _mm256_mul_ps(sc_hi, sum))
                        }
                    };
                    sums[j].write(whole);
                }
            }
        }
    }
    let d = halves_f32(tile.add(super::Q6K_TILE.d_at()), h8);
    for (r, (lanes, sums)) in acc.iter_mut().zip(&sums).enumerate() {
        for (j, c) in sums.iter().enumerate() {
            let u = 8 * sb + j;
            step(lanes, u, true, d, pass.d(r, u), c.assume_init());
        }
    }
}

/// [`super::avx512`]'s Q4_1 and Q5_0; Q5_0's lane masks become byte masks (bit `b` of the
/// 64-bit mask is byte `b` of the 64-byte vector).
#[inline(always)]
unsafe fn q32<const R: usize, const Q5: bool>(tile: *const u8, u: usize, h: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let low4 = _mm256_set1_epi8(0x0F);
    let qs_at = if Q5 { 96 } else { 64 };
    let mut w = [_mm256_setzero_si256(); 8];
    for t in 0..4 {
        let x = load(tile.add(qs_at + 64 * t), h);
        w[t] = _mm256_and_si256(x, low4);
        w[4 + t] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
    }
    if Q5 {
        // Byte i of the half takes bit i of its 32 mask bits: bytes 8j..8j+8 read mask byte
        // j, each testing its own bit.
        let select = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let fifth = _mm256_set1_epi8(0x10);
        for t in 0..4 {
            for (slot, i) in [(t, 2 * t), (4 + t, 2 * t + 1)] {
                let mask = std::ptr::read_unaligned(tile.add(32 + 8 * i + 4 * h) as *const i32);
                let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(mask), select);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                w[slot] = _mm256_add_epi8(w[slot], _mm256_and_si256(set, fifth));
            }
        }
    }
    let d = halves_f32(tile, h);
    let m = halves_f32(tile.add(32), h);
    for (r, lanes) in acc.iter_mut().enumerate() {
        let mut c = dot(pass, r, u, &w, 0);
        if Q5 {
            c = _mm256_sub_epi32(c, _mm256_set1_epi32(16 * pass.sum(r, u)));
        }
        let dr = pass.d(r, u);
        step(lanes, u, true, d, dr, _mm256_cvtepi32_ps(c));
        if !Q5 {
            step(lanes, u, false, m, dr, _mm256_set1_ps(pass.sum(r, u) as f32));
        }
    }
}

/// [`super::avx512`]'s Q8_0: `|w|` against `q · sign(w)` (the same exact sums as
/// `(w + 128) · q − 128 · Σq`, with no pair leaving i16).
#[inline(always)]
unsafe fn q8_0<const R: usize>(tile: *const u8, u: usize, h: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let mut w = [_mm256_setzero_si256(); 8];
    for (i, w) in w.iter_mut().enumerate() {
        *w = load(tile.add(2 * PACK_COLS + 64 * i), h);
    }
    let d = halves_f32(tile, h);
    for (r, lanes) in acc.iter_mut().enumerate() {
        let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for i in (0..8).step_by(2) {
            let q = |i: usize| _mm256_set1_epi32(pass.word(r, u, i));
            even = _mm256_add_epi32(even, dot4(_mm256_abs_epi8(w[i]), _mm256_sign_epi8(q(i), w[i])));
            odd = _mm256_add_epi32(odd, dot4(_mm256_abs_epi8(w[i + 1]), _mm256_sign_epi8(q(i + 1), w[i + 1])));
        }
        let c = _mm256_add_epi32(even, odd);
        step(lanes, u, true, d, pass.d(r, u), _mm256_cvtepi32_ps(c));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<const R: usize>(layout: Layout, tiles: *const u8, blocks: usize, pass: &Pass, out: &mut GroupOut) {
    for h in 0..2 {
        let mut acc: Lanes<R> = [[MaybeUninit::uninit(); LANES]; R];
        for b in 0..blocks {
            let tile = tiles.add(b * layout.tile_bytes());
            match layout.dtype {
                GgmlDType::Q4K => q4k(tile, b, h, pass, &mut acc),
                GgmlDType::Q6K => q6k(tile, b, h, pass, &mut acc),
                GgmlDType::Q4_1 => q32::<R, false>(tile, b, h, pass, &mut acc),
                GgmlDType::Q5_0 => q32::<R, true>(tile, b, h, pass, &mut acc),
                _ => q8_0(tile, b, h, pass, &mut acc),
            }
        }
        for (lanes, out) in acc.iter_mut().zip(out.iter_mut()) {
            _mm256_storeu_ps(out[8 * h..].as_mut_ptr(), fold(lanes, blocks * layout.units_per_block));
        }
    }
}

/// [`super::avx512`]'s `fold`, eight columns a vector.
#[inline(always)]
unsafe fn fold(lanes: &mut [MaybeUninit<__m256>; LANES], units: usize) -> __m256 {
    for lane in lanes.iter_mut().skip(units) {
        lane.write(_mm256_setzero_ps());
    }
    for off in BUTTERFLY {
        for l in 0..off {
            let sum = _mm256_add_ps(lanes[l].assume_init(), lanes[l + off].assume_init());
            lanes[l].write(sum);
        }
    }
    lanes[0].assume_init()
}

pub(super) fn pass(layout: Layout, tiles: *const u8, blocks: usize, pass: &Pass, count: usize, out: &mut GroupOut) {
    // SAFETY: the caller checked the AVX2 tier at run time (`isa()`); the group's tiles lie
    // inside its data (`drive`).
    unsafe {
        match count {
            1 => group::<1>(layout, tiles, blocks, pass, out),
            2 => group::<2>(layout, tiles, blocks, pass, out),
            3 => group::<3>(layout, tiles, blocks, pass, out),
            4 => group::<4>(layout, tiles, blocks, pass, out),
            5 => group::<5>(layout, tiles, blocks, pass, out),
            6 => group::<6>(layout, tiles, blocks, pass, out),
            7 => group::<7>(layout, tiles, blocks, pass, out),
            _ => group::<8>(layout, tiles, blocks, pass, out),
        }
    }
}
