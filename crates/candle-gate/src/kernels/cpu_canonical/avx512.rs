//! The AVX-512 tier: sixteen columns a vector, one `vpdpbusd` per four weights of sixteen
//! columns against a row's broadcast bytes, every row's 32 lane vectors in L1.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::{q6k_slot, GroupOut, Layout, Pass, PACK_COLS};
use crate::kernels::canonical::{BUTTERFLY, LANES};
use candle_core::quantized::GgmlDType;

/// Each row's 32 lane accumulators, sixteen columns a vector.
type Lanes<const R: usize> = [[MaybeUninit<__m512>; LANES]; R];

/// The order's one float step, sixteen outputs at once: `acc = fma(coef · d, c, acc)` on lane
/// `u % LANES`; `first` marks a unit's first step. A lane starts at +0, and the first step of
/// its first unit (`u < LANES`) takes that zero from a register, so the lanes are never zeroed
/// in memory (at eight rows that was 16 KiB a group and pass, as long as a small matrix's
/// arithmetic).
#[inline(always)]
unsafe fn step(lanes: &mut [MaybeUninit<__m512>; LANES], u: usize, first: bool, coef: __m512, d: f32, c: __m512) {
    let lane = &mut lanes[u % LANES];
    let acc = if first && u < LANES { _mm512_setzero_ps() } else { lane.assume_init() };
    lane.write(_mm512_fmadd_ps(_mm512_mul_ps(coef, _mm512_set1_ps(d)), c, acc));
}

/// `Σ_i dpbusd(w[i], word(i))` over `w.len()` dwords of a unit (or half unit) of row `r`,
/// `first` the first dword, in two chains (exact: integers).
#[inline(always)]
unsafe fn dot(pass: &Pass, r: usize, u: usize, w: &[__m512i], first: usize) -> __m512i {
    let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for i in (0..w.len()).step_by(2) {
        even = _mm512_dpbusd_epi32(even, w[i], _mm512_set1_epi32(pass.word(r, u, first + i)));
        odd = _mm512_dpbusd_epi32(odd, w[i + 1], _mm512_set1_epi32(pass.word(r, u, first + i + 1)));
    }
    _mm512_add_epi32(even, odd)
}

#[inline(always)]
unsafe fn load(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const _)
}

/// Sixteen f16 at `p` as f32.
#[inline(always)]
unsafe fn halves_f32(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Byte `byte` of each lane of `v`, zero-extended.
#[inline(always)]
unsafe fn byte_u(v: __m512i, byte: u32) -> __m512i {
    _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(8 * byte as i32)), _mm512_set1_epi32(0xFF))
}

/// Q4_K super-block `sb` (units `8sb..8sb + 8`), the `invariant` mode's packed tile: segment
/// `s` (16 bytes of each column) at `256s`, as four vectors of a dword per column. Segment
/// 0 is `(d, dmin)` and the twelve scale bytes; 1..9 are `qs`, unit `2p` in the low
/// nibbles of `qs[32p..32p + 32]` and unit `2p + 1` in the high ones.
#[inline(always)]
unsafe fn q4k<const R: usize>(tile: *const u8, sb: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let v = |s: usize, t: usize| load(tile.add(256 * s + 64 * t));
    let head = v(0, 0);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head)));
    let neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin), _mm512_set1_epi32(i32::MIN)));
    let (s0, s1, s2) = (v(0, 1), v(0, 2), v(0, 3));
    let (m63, m15, m3) = (_mm512_set1_epi32(63), _mm512_set1_epi32(15), _mm512_set1_epi32(3));
    // llama.cpp's `get_scale_min_k4`, sixteen columns a vector, as f32 (exact: < 64).
    let scale_min = |j: u32| -> (__m512, __m512) {
        let (sc, mn) = if j < 4 {
            (_mm512_and_si512(byte_u(s0, j), m63), _mm512_and_si512(byte_u(s1, j), m63))
        } else {
            let i = j - 4;
            let (lo, a, b) = (byte_u(s2, i), byte_u(s0, i), byte_u(s1, i));
            let high = |x: __m512i| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(x), m3));
            (_mm512_or_si512(_mm512_and_si512(lo, m15), high(a)), _mm512_or_si512(_mm512_srli_epi32::<4>(lo), high(b)))
        };
        (_mm512_cvtepi32_ps(sc), _mm512_cvtepi32_ps(mn))
    };
    let low4 = _mm512_set1_epi8(0x0F);
    for p in 0..4 {
        let mut w = [[_mm512_setzero_si512(); 8]; 2];
        for i in 0..8 {
            let x = v(1 + 2 * p + i / 4, i % 4);
            w[0][i] = _mm512_and_si512(x, low4);
            w[1][i] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low4);
        }
        for (half, w) in w.iter().enumerate() {
            let j = 2 * p + half;
            let u = 8 * sb + j;
            let (sc, mn) = scale_min(j as u32);
            for (r, lanes) in acc.iter_mut().enumerate() {
                // (sc · isum) and (m · Σq) as f32: exact products of exact floats (< 2^24).
                let c = _mm512_mul_ps(_mm512_cvtepi32_ps(dot(pass, r, u, w, 0)), sc);
                let dr = pass.d(r, u);
                step(lanes, u, true, d, dr, c);
                step(lanes, u, false, neg_dmin, dr, _mm512_mul_ps(mn, _mm512_set1_ps(pass.sum(r, u) as f32)));
            }
        }
    }
}

/// Q6_K super-block `sb`, this file's tile: the block's 52 dwords as vectors in
/// [`q6k_slot`]'s order, then the sixteen `d`. Unit `j = 4h + t` takes
/// `ql[64h + 32(t % 2)..][..32]` shifted by `4(t / 2)` and bits `2t, 2t+1` of `qh[32h..][..32]`,
/// as `w + 32` (0..64), and the int8 scales `sc[8h + 2t]` (values 0..16) and `sc[8h + 2t + 1]`
/// (16..32).
///
/// The tile is read from its start to its end, as the hardware prefetchers need (see
/// [`q6k_slot`]): the scales, then one part `(h, half)` at a time, twelve vectors that hold
/// half (sixteen values) of each of the units `4h..4h + 4`, and `d` last. So every unit's
/// float step waits for the end of the tile. The eight units add into eight different lane
/// accumulators, so neither the wait nor their order changes a bit.
#[inline(always)]
unsafe fn q6k<const R: usize>(tile: *const u8, sb: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let (low4, bits45) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // (ql & 0x0F) | (high & 0x30)
    let six = |ql: __m512i, high: __m512i| _mm512_ternarylogic_epi32::<0xEC>(ql, _mm512_and_si512(high, bits45), low4);
    let scales: [__m512i; 4] = std::array::from_fn(|i| load(tile.add(64 * q6k_slot(48 + i))));
    // Each row's units: the first half's sum less its offset, then the unit's whole sum.
    let mut sums = [[MaybeUninit::uninit(); 8]; R];
    for h in 0..2 {
        for half in 0..2 {
            let mut w = [[_mm512_setzero_si512(); 4]; 4];
            for i in 0..4 {
                let word = 4 * half + i;
                let ql0 = load(tile.add(64 * q6k_slot(16 * h + word)));
                let ql1 = load(tile.add(64 * q6k_slot(16 * h + 8 + word)));
                let qh = load(tile.add(64 * q6k_slot(32 + 8 * h + word)));
                // Bits 2t, 2t + 1 of each qh byte to bits 4, 5; a 16-bit shift moves bits
                // across bytes only into places the mask clears.
                w[0][i] = six(ql0, _mm512_slli_epi16::<4>(qh));
                w[1][i] = six(ql1, _mm512_slli_epi16::<2>(qh));
                w[2][i] = six(_mm512_srli_epi16::<4>(ql0), qh);
                w[3][i] = six(_mm512_srli_epi16::<4>(ql1), _mm512_srli_epi16::<2>(qh));
            }
            for (t, w) in w.iter().enumerate() {
                let (j, u) = (4 * h + t, 8 * sb + 4 * h + t);
                // Bytes 2(t % 2) and 2(t % 2) + 1 of the unit's scale dword, sign-extended, as
                // f32 (exact).
                let signed_byte = |byte: usize| {
                    let shifted = _mm512_sllv_epi32(scales[2 * h + t / 2], _mm512_set1_epi32(24 - 8 * byte as i32));
                    _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(shifted))
                };
                // The unit's two scales, for its second half.
                let sc = (half == 1).then(|| (signed_byte(2 * (t % 2)), signed_byte(2 * (t % 2) + 1)));
                for (r, sums) in sums.iter_mut().enumerate() {
                    let offset = _mm512_set1_epi32(32 * pass.half(r, u, half));
                    let sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot(pass, r, u, w, 4 * half), offset));
                    let whole = match sc {
                        None => sum,
                        // sc_lo · lo + sc_hi · hi in f32 is the integer sum exactly: each
                        // product is below 2^23 and the sum below 2^24.
                        Some((sc_lo, sc_hi)) => {
                            _mm512_fmadd_ps(sc_lo, sums[j].assume_init(), _mm512_mul_ps(sc_hi, sum))
                        }
                    };
                    sums[j].write(whole);
                }
            }
        }
    }
    let d = halves_f32(tile.add(super::Q6K_TILE.d_at()));
    for (r, (lanes, sums)) in acc.iter_mut().zip(&sums).enumerate() {
        for (j, c) in sums.iter().enumerate() {
            let u = 8 * sb + j;
            step(lanes, u, true, d, pass.d(r, u), c.assume_init());
        }
    }
}

/// Q4_1 or Q5_0 unit `u`, the `invariant` mode's packed tile (`cpu_q32::Packed`): the
/// sixteen `d`, then Q4_1's `m` or Q5_0's fifth bits as eight 64-bit lane masks (from byte
/// 32), then the nibbles as four vectors (from `qs_at`), vector t lane c holding column c's
/// `qs[4t..4t + 4]`: weights 4t.. in the low nibbles, 16 + 4t.. in the high.
#[inline(always)]
unsafe fn q32<const R: usize, const Q5: bool>(tile: *const u8, u: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let low4 = _mm512_set1_epi8(0x0F);
    let qs_at = if Q5 { 96 } else { 64 };
    // Dwords in the order of the unit's values: low nibbles (values 0..16), then high.
    let mut w = [_mm512_setzero_si512(); 8];
    for t in 0..4 {
        let x = load(tile.add(qs_at + 64 * t));
        w[t] = _mm512_and_si512(x, low4);
        w[4 + t] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low4);
    }
    if Q5 {
        let fifth = _mm512_set1_epi8(0x10);
        let mask = |i: usize| std::ptr::read_unaligned(tile.add(32 + 8 * i) as *const u64);
        for t in 0..4 {
            w[t] = _mm512_mask_add_epi8(w[t], mask(2 * t), w[t], fifth);
            w[4 + t] = _mm512_mask_add_epi8(w[4 + t], mask(2 * t + 1), w[4 + t], fifth);
        }
    }
    let d = halves_f32(tile);
    let m = halves_f32(tile.add(32));
    for (r, lanes) in acc.iter_mut().enumerate() {
        let mut c = dot(pass, r, u, &w, 0);
        if Q5 {
            c = _mm512_sub_epi32(c, _mm512_set1_epi32(16 * pass.sum(r, u)));
        }
        let dr = pass.d(r, u);
        step(lanes, u, true, d, dr, _mm512_cvtepi32_ps(c));
        if !Q5 {
            step(lanes, u, false, m, dr, _mm512_set1_ps(pass.sum(r, u) as f32));
        }
    }
}

/// Q8_0 unit `u`, this file's tile: the sixteen `d`, then `qs` as eight vectors, read as
/// `w + 128` (one xor) with `128 · Σq` taken off after.
#[inline(always)]
unsafe fn q8_0<const R: usize>(tile: *const u8, u: usize, pass: &Pass, acc: &mut Lanes<R>) {
    let mut w = [_mm512_setzero_si512(); 8];
    let bias = _mm512_set1_epi8(i8::MIN);
    for (i, w) in w.iter_mut().enumerate() {
        *w = _mm512_xor_si512(load(tile.add(2 * PACK_COLS + 64 * i)), bias);
    }
    let d = halves_f32(tile);
    for (r, lanes) in acc.iter_mut().enumerate() {
        let c = _mm512_sub_epi32(dot(pass, r, u, &w, 0), _mm512_set1_epi32(128 * pass.sum(r, u)));
        step(lanes, u, true, d, pass.d(r, u), _mm512_cvtepi32_ps(c));
    }
}

/// Rows `pass.first..pass.first + R` against one group: every tile in order, then each
/// row's butterfly, into `out[r]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group<const R: usize>(layout: Layout, group: *const u8, blocks: usize, pass: &Pass, out: &mut [[f32; 16]]) {
    let mut acc: Lanes<R> = [[MaybeUninit::uninit(); LANES]; R];
    // Only a group's first pass reads it from memory; the others find it cached.
    let prefetch = crate::kernels::prefetches_tiles(R, pass.first == 0);
    for b in 0..blocks {
        let tile = group.add(b * layout.tile_bytes());
        if prefetch {
            crate::kernels::prefetch_tile_ahead(tile, layout.tile_bytes());
        }
        match layout.dtype {
            GgmlDType::Q4K => q4k(tile, b, pass, &mut acc),
            GgmlDType::Q6K => q6k(tile, b, pass, &mut acc),
            GgmlDType::Q4_1 => q32::<R, false>(tile, b, pass, &mut acc),
            GgmlDType::Q5_0 => q32::<R, true>(tile, b, pass, &mut acc),
            _ => q8_0(tile, b, pass, &mut acc),
        }
    }
    for (lanes, out) in acc.iter_mut().zip(out) {
        _mm512_storeu_ps(out.as_mut_ptr(), fold(lanes, blocks * layout.units_per_block));
    }
}

/// One row's output from its lanes, after `units` units: the lanes no unit reached (fewer units
/// than lanes) at the order's +0, then the xor butterfly. After offset `off`, lane l < off
/// holds lane l + lane l + off (lanes l ≥ off would hold the same sums, commuted; nothing reads
/// them).
#[inline(always)]
unsafe fn fold(lanes: &mut [MaybeUninit<__m512>; LANES], units: usize) -> __m512 {
    for lane in lanes.iter_mut().skip(units) {
        lane.write(_mm512_setzero_ps());
    }
    for off in BUTTERFLY {
        for l in 0..off {
            let sum = _mm512_add_ps(lanes[l].assume_init(), lanes[l + off].assume_init());
            lanes[l].write(sum);
        }
    }
    lanes[0].assume_init()
}

/// Rows `pass.first..pass.first + count` against one group, into `out`.
pub(super) fn pass(layout: Layout, tiles: *const u8, blocks: usize, pass: &Pass, count: usize, out: &mut GroupOut) {
    // SAFETY: the caller checked the AVX-512 tier at run time (`isa()`); the group's tiles
    // lie inside its data (`drive`).
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

/// The canonical activation quantization (`canonical::quantize_rows`) a unit at a time in two
/// vectors, with each unit's sums of `q`: `amax` as a max of absolute values (exact in any
/// order; `max(|x|, acc)` keeps `acc` where `|x|` is NaN, as `f32::max` does), the scale and its
/// inverse as the scalar code computes them, `q = rint(x · inv)` clamped to ±127 with NaN to 0
/// (what the scalar code's `as i8` makes of it).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn quantize_units(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], halves: &mut [i32]) {
    let magnitude = _mm512_set1_epi32(i32::MAX);
    let (lo_bound, hi_bound) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for (u, (xs, qs)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let v = [_mm512_loadu_ps(xs.as_ptr()), _mm512_loadu_ps(xs.as_ptr().add(16))];
        let abs = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude));
        let acc = _mm512_max_ps(abs(v[1]), _mm512_max_ps(abs(v[0]), _mm512_setzero_ps()));
        let amax = _mm512_reduce_max_ps(acc);
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        d[u] = scale;
        let mut part = [0i32; 2];
        for (h, v) in v.into_iter().enumerate() {
            let y = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                v,
                _mm512_set1_ps(inv),
            ));
            let clamped = _mm512_min_ps(_mm512_max_ps(y, lo_bound), hi_bound);
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y);
            let ints = _mm512_maskz_cvtps_epi32(ordered, clamped);
            _mm_storeu_si128(qs.as_mut_ptr().add(16 * h) as *mut __m128i, _mm512_cvtepi32_epi8(ints));
            part[h] = _mm512_reduce_add_epi32(ints);
        }
        sum[u] = part[0] + part[1];
        halves[2 * u] = part[0];
        halves[2 * u + 1] = part[1];
    }
}
