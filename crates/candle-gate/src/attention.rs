//! Causal attention over the paged KV cache, with one fixed order of arithmetic per row.
//!
//! A row at position `p` attends to positions `0..=p` of its own sequence. Those positions are
//! cut into splits of [`SPLIT`] positions counted from position 0. Within a split, a query's
//! partial is `(m, l, o)`: the split's largest score, `l = Σ exp(s − m)` and
//! `o = Σ exp(s − m) · v`; the partials are then folded in position order, each fold rescaling
//! what came before (the online softmax). What every value depends on is fixed by the row's
//! position alone:
//!
//! * a score is `(Σ_d q[d] · k[d]) · scale`, one fused multiply-add chain over `d` in order;
//! * `m` is the maximum over the split (exact in any order);
//! * `l` is summed in eight lanes by position mod 8, then `((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7))`;
//! * `o[d]` is one fused multiply-add chain over the split's positions in order;
//! * `exp` is [`exp_neg`], our own f32 polynomial.
//!
//! So a row's output is the same bits whether it is computed in a prefill chunk of any size, as
//! a decode step, next to any other rows, on any number of threads, and wherever its blocks are
//! in the pool. How the work is spread — tiles of rows, the query heads that share a KV head
//! read together, splits computed in parallel or one after another — changes only which
//! thread computes a partial, never a partial's arithmetic or the fold's order.
//!
//! The vectorized tier puts eight positions (scores) or eight `d` (values) in one register's
//! lanes: each lane runs exactly the scalar definition's operations, so the tiers agree bit
//! for bit (tested, with the tier forced).

use rayon::prelude::*;

use crate::kernels::{isa, Isa};
use crate::kv_cache::{BlockLayout, KvCache, KvDtype, KV_BLOCK};

/// Positions per split: the partials are folded at these boundaries, counted from position 0.
pub const SPLIT: usize = 256;
const BLOCKS_PER_SPLIT: usize = SPLIT / KV_BLOCK;
/// Rows of one sequence that one task attends for together (they share the blocks it reads).
const TILE_ROWS: usize = 16;
/// How many blocks ahead of their use the kernel asks for a block's keys or values.
const AHEAD: usize = 2;

/// The attention tiers: the scalar definition, and AVX2 or AVX-512 lanes running the same
/// operations (every tier gives the definition's bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Portable,
    Avx2,
    Avx512,
}

impl Tier {
    /// The tier the kernels' [`Isa`] setting allows.
    pub fn current() -> Tier {
        let vector = cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"));
        match isa() {
            Isa::Portable => Tier::Portable,
            _ if !vector => Tier::Portable,
            Isa::Avx2 => Tier::Avx2,
            Isa::Avx512 => Tier::Avx512,
        }
    }

    /// Whether the vector kernels run (AVX2's, some with AVX-512's in their place).
    fn vector(self) -> bool {
        self >= Tier::Avx2
    }
}

// ---------------------------------------------------------------------------------------------
// exp

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts (Cody–Waite): `k · LN2_HI` is exact for the `k` here.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this, `exp_neg` is 0 (e^-87.33 is the smallest normal f32).
const EXP_MIN: f32 = -87.33;
/// Cephes' `expf` polynomial: e^r ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2.
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];

/// e^x for x ≤ 0 (softmax's arguments), within 2 ulp, 0 below [`EXP_MIN`] (and for -∞ and NaN).
/// The definition every tier follows: round to nearest even, two fused reductions, Horner with
/// fused multiply-adds, and the scale 2^k put into the exponent bits.
#[inline]
#[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN takes this branch too
pub fn exp_neg(x: f32) -> f32 {
    if !(x >= EXP_MIN) {
        return 0.0;
    }
    let k = (x * LOG2E).round_ties_even();
    let r = k.mul_add(-LN2_HI, x);
    let r = k.mul_add(-LN2_LO, r);
    let z = r * r;
    let mut y = EXP_P[0];
    for c in &EXP_P[1..] {
        y = y.mul_add(r, *c);
    }
    let y = y.mul_add(z, r) + 1.0;
    y * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// `if a > b { a } else { b }`: the vector `max` instruction's exact rule (zeros and NaN too).
#[inline]
fn max_like_vector(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

// ---------------------------------------------------------------------------------------------
// Reading one sequence's blocks

/// One layer of one sequence's cache, as the kernel reads it.
#[derive(Clone, Copy)]
pub(crate) struct LayerKv<'a> {
    blocks: &'a [*const u8],
    /// Bytes between a block's regions (`KvPool::stride`).
    stride: usize,
    layout: BlockLayout,
    layer: usize,
}

impl LayerKv<'_> {
    /// Block `b`'s keys (or values) of KV head `kvh` in this layer.
    fn region(&self, b: usize, kvh: usize, values: bool) -> *const u8 {
        self.blocks[b].wrapping_add(self.layout.region(self.layer, kvh, values) * self.stride)
    }
    /// The same region as a slice of its stored values.
    fn view(&self, b: usize, kvh: usize, values: bool) -> Block<'_> {
        let (p, n) = (self.region(b, kvh, values), self.layout.head_dim * KV_BLOCK);
        // SAFETY: a region of one of the sequence's blocks holds n values of the pool's dtype,
        // not written while the pool's caches are read.
        unsafe {
            match self.layout.dtype {
                KvDtype::F32 => Block::F32(std::slice::from_raw_parts(p as *const f32, n)),
                KvDtype::F16 => Block::F16(std::slice::from_raw_parts(p as *const u16, n)),
            }
        }
    }
}

/// One region's values, as stored or widened to f32.
#[derive(Clone, Copy)]
enum Block<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

/// The most queries one pass of the vector kernels carries (their accumulators in registers).
const GROUP_MAX: usize = 8;

/// How many of `left` queries the next group takes: all of them when they fit one pass, else
/// six (the widest group whose accumulators cover two vectors of positions or of `d`).
fn group_len(left: usize) -> usize {
    if left <= GROUP_MAX {
        left
    } else {
        6
    }
}

/// `o_i[d] += Σ_t p_i[t] · v[t][d]` for a group of queries (`ps[i]` their weights, `o` their
/// outputs one after another): the vector tier's [`weighted_values`], each value vector read
/// once for the whole group.
///
/// # Safety
/// `tier` must be a vector tier this host runs; `o` holds `ps.len() × hd` values, `v`
/// `ps[0].len()` rows.
unsafe fn grouped_values(ps: &[&[f32]], v: Block, hd: usize, o: *mut f32, tier: Tier, next: *const u8) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if tier == Tier::Avx512 && hd.is_multiple_of(16) {
        match v {
            Block::F32(v) => avx512::grouped_values(ps, v.as_ptr(), hd, o, next),
            Block::F16(v) => avx512::grouped_values(ps, v.as_ptr(), hd, o, next),
        }
        return;
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    match v {
        Block::F32(v) => avx2::grouped_values(ps, v.as_ptr(), hd, o),
        Block::F16(v) => avx2::grouped_values(ps, v.as_ptr(), hd, o),
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    {
        let _ = (ps, v, hd, o, tier, next);
        unreachable!("the vector tier is compiled out");
    }
}

// SAFETY: the pointers are into blocks of a pool kept alive (and not written) for the call.
unsafe impl Send for LayerKv<'_> {}
unsafe impl Sync for LayerKv<'_> {}

/// Block `b`'s transposed keys (`[head_dim][KV_BLOCK]`, into `kt`) and/or values
/// (`[KV_BLOCK][head_dim]`, into `v`) of one KV head, widened to f32 exactly.
fn widen_block(kv: &LayerKv, kvh: usize, b: usize, kt: Option<&mut Vec<f32>>, v: Option<&mut Vec<f32>>, tier: Tier) {
    let n = kv.layout.head_dim * KV_BLOCK;
    for (dst, values) in [(kt, false), (v, true)] {
        let Some(dst) = dst else { continue };
        let src = kv.region(b, kvh, values);
        // SAFETY: a region of one of the sequence's blocks holds n values.
        unsafe {
            match kv.layout.dtype {
                KvDtype::F32 => dst[..n].copy_from_slice(std::slice::from_raw_parts(src as *const f32, n)),
                KvDtype::F16 => widen_f16(std::slice::from_raw_parts(src as *const u16, n), &mut dst[..n], tier),
            }
        }
    }
}

fn widen_f16(src: &[u16], dst: &mut [f32], tier: Tier) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "f16c"))]
    if tier.vector() && src.len().is_multiple_of(8) {
        // SAFETY: F16C is enabled at compile time; both slices hold src.len() elements.
        unsafe { avx2::widen_f16(src, dst) };
        return;
    }
    let _ = tier;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(s).to_f32();
    }
}

// ---------------------------------------------------------------------------------------------
// One split's partials

/// One query: its vector (`head_dim`) and the positions it attends to, `start..len`.
#[derive(Clone, Copy)]
struct Query<'a> {
    q: &'a [f32],
    len: usize,
    /// 0, or where a sliding window begins.
    start: usize,
}

impl Query<'_> {
    /// The positions of split `split` this query attends to, counted from the split's start.
    fn span(&self, split: usize) -> std::ops::Range<usize> {
        let s0 = split * SPLIT;
        let (lo, hi) = (self.start.max(s0), self.len.min(s0 + SPLIT));
        if hi > lo {
            lo - s0..hi - s0
        } else {
            0..0
        }
    }
    fn first_split(&self) -> usize {
        self.start / SPLIT
    }
    fn splits(&self) -> std::ops::Range<usize> {
        self.first_split()..self.len.div_ceil(SPLIT)
    }
}

/// Working space of one task, kept per thread between calls.
#[derive(Default)]
struct Work {
    kt: Vec<f32>,
    v: Vec<f32>,
    /// `[query][SPLIT]` scores, then probabilities.
    s: Vec<f32>,
}

/// A partial `(m, l, o)` per query, `o` of `head_dim`.
struct Partials {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partials {
    fn new(n: usize, hd: usize) -> Self {
        Partials { m: vec![0.0; n], l: vec![0.0; n], o: vec![0.0; n * hd] }
    }
}

/// The partials of split `split` for every query that reaches into it (others are left as
/// they were). `qs` all read KV head `kvh` of `kv`.
#[allow(clippy::too_many_arguments)]
fn split_partials(
    kv: &LayerKv,
    kvh: usize,
    qs: &[Query],
    split: usize,
    scale: f32,
    w: &mut Work,
    out: &mut Partials,
    tier: Tier,
) {
    let hd = kv.layout.head_dim;
    let spans: Vec<std::ops::Range<usize>> = qs.iter().map(|q| q.span(split)).collect();
    let reach = spans.iter().map(|r| r.end).max().unwrap_or(0);
    if reach == 0 {
        return;
    }
    let nb = reach.div_ceil(KV_BLOCK);
    // Blocks wholly before every query's window are not read.
    let b0 = spans.iter().filter(|r| !r.is_empty()).map(|r| r.start / KV_BLOCK).min().unwrap_or(0);
    let first = split * BLOCKS_PER_SPLIT;
    // One block widened at a time, so the f32 copy stays in L1 while every query reads it.
    let bsz = hd * KV_BLOCK;
    w.kt.resize(bsz, 0.0);
    w.v.resize(bsz, 0.0);
    w.s.resize(qs.len() * SPLIT, 0.0);
    let q: Vec<&[f32]> = qs.iter().map(|q| q.q).collect();
    // The vector tier reads a block where it lies when its queries fit one group (a decode
    // row's heads: each value is then converted once either way, and the f32 copy's stores and
    // loads are saved); a prefill tile's many groups read one widened copy.
    let grouped = tier.vector() && hd.is_multiple_of(8);
    let direct = grouped && (kv.layout.dtype == KvDtype::F32 || qs.len() <= GROUP_MAX);
    // Blocks ahead: the keys of the split's blocks, then its first values. Not for the blocks
    // read in place: there a block's whole region requested at once (64–128 lines) held up the
    // loads of the block being computed, and a decode step ran up to 1.6x faster with the
    // hardware's prefetch alone (docs/BENCHMARKS.md "Decode reads without software prefetch").
    let prefetch = !direct;
    let cnt = nb - b0;
    let ahead = |i: usize| if i < cnt { (first + b0 + i, false) } else { (first + b0 + i - cnt, true) };
    if prefetch {
        for i in 0..AHEAD.min(cnt) {
            let (blk, values) = ahead(i);
            prefetch_block(kv, kvh, blk, values);
        }
    }
    for b in b0..nb {
        if prefetch && b - b0 + AHEAD < 2 * cnt {
            let (blk, values) = ahead(b - b0 + AHEAD);
            prefetch_block(kv, kvh, blk, values);
        }
        let at = |i: usize| i * SPLIT + b * KV_BLOCK;
        if direct {
            // The region after this one: the next block's keys, else the first values.
            let next = if b + 1 < nb { kv.region(first + b + 1, kvh, false) } else { kv.region(first + b0, kvh, true) };
            scores_block(&q, kv.view(first + b, kvh, false), hd, scale, &mut w.s, at, tier, next);
        } else {
            widen_block(kv, kvh, first + b, Some(&mut w.kt), None, tier);
            // Every query against the block while it is in L1 (a few at a time share its loads).
            scores_block(&q, Block::F32(&w.kt), hd, scale, &mut w.s, at, tier, std::ptr::null());
        }
    }
    for (i, span) in spans.iter().enumerate() {
        if span.is_empty() {
            continue;
        }
        let s = &mut w.s[i * SPLIT..i * SPLIT + span.end.next_multiple_of(8)];
        // Positions before the window (some never scored) weigh exactly 0.
        s[..span.start].fill(f32::NEG_INFINITY);
        s[span.end..].fill(f32::NEG_INFINITY);
        let (m, l) = softmax_in_place(s, tier);
        out.m[i] = m;
        out.l[i] = l;
        out.o[i * hd..(i + 1) * hd].fill(0.0);
    }
    for b in b0..nb {
        if prefetch && b + AHEAD < nb {
            prefetch_block(kv, kvh, first + b + AHEAD, true);
        }
        // This query's positions in the block: o's chain goes on where the last block left
        // it. A block wholly before its window is skipped (its weights are all 0).
        let n_of = |span: &std::ops::Range<usize>| {
            let n = span.end.saturating_sub(b * KV_BLOCK).min(KV_BLOCK);
            if span.start < (b + 1) * KV_BLOCK {
                n
            } else {
                0
            }
        };
        // The region after this one: the next block's values, else the next split's first keys.
        let mut next = if !direct {
            std::ptr::null()
        } else if b + 1 < nb {
            kv.region(first + b + 1, kvh, true)
        } else if first + BLOCKS_PER_SPLIT < kv.blocks.len() {
            kv.region(first + BLOCKS_PER_SPLIT, kvh, false)
        } else {
            std::ptr::null()
        };
        let v = if direct {
            kv.view(first + b, kvh, true)
        } else {
            widen_block(kv, kvh, first + b, None, Some(&mut w.v), tier);
            Block::F32(&w.v)
        };
        if !grouped {
            for (i, span) in spans.iter().enumerate() {
                let n = n_of(span);
                if n > 0 {
                    let p = &w.s[i * SPLIT + b * KV_BLOCK..][..n];
                    weighted_values(p, &w.v, hd, &mut out.o[i * hd..(i + 1) * hd]);
                }
            }
            continue;
        }
        // Runs of queries with the same positions in the block (a row's heads always are one)
        // share each value vector they read, a group at a time.
        let mut i = 0;
        while i < spans.len() {
            let n = n_of(&spans[i]);
            let run = 1 + spans[i + 1..].iter().take_while(|sp| n_of(sp) == n).count();
            if n > 0 {
                let mut j = i;
                while j < i + run {
                    let len = group_len(i + run - j);
                    // On the stack: this runs once per block and group.
                    let mut ps: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
                    for (p, k) in ps.iter_mut().zip(j..j + len) {
                        *p = &w.s[k * SPLIT + b * KV_BLOCK..][..n];
                    }
                    let os = out.o[j * hd..(j + len) * hd].as_mut_ptr();
                    // SAFETY: the vector tier was checked (`grouped`); `os` holds len × hd values.
                    unsafe { grouped_values(&ps[..len], v, hd, os, tier, next) };
                    (j, next) = (j + len, std::ptr::null());
                }
            }
            i += run;
        }
    }
}

/// Asks for block `b`'s keys (or values) of KV head `kvh` ahead of their use: blocks are
/// scattered, so the hardware prefetcher cannot see the next one coming.
#[inline]
fn prefetch_block(kv: &LayerKv, kvh: usize, b: usize, values: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let bytes = kv.layout.region_bytes();
        let base = kv.region(b, kvh, values) as *const i8;
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint; the address is inside the block.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(line)) };
        }
    }
}

/// `s[t] = (Σ_d q[d]·kt[d][t]) · scale` for the block's 32 positions, for each query, into
/// `out[at(i)..at(i) + 32]`. `next`: the region read after this one, for the AVX-512 tier to
/// ask for as it goes (null: none).
#[allow(clippy::too_many_arguments)]
fn scores_block(
    qs: &[&[f32]],
    kt: Block,
    hd: usize,
    scale: f32,
    out: &mut [f32],
    at: impl Fn(usize) -> usize,
    tier: Tier,
    next: *const u8,
) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if tier == Tier::Avx512 && hd.is_multiple_of(16) {
        // SAFETY: the tier is never wider than the host (`Tier::current`, `Isa`); `kt` holds
        // hd × 32 values, each q hd.
        unsafe {
            match kt {
                Block::F32(kt) => avx512::scores_block(qs, kt.as_ptr(), hd, scale, out, at, next),
                Block::F16(kt) => avx512::scores_block(qs, kt.as_ptr(), hd, scale, out, at, next),
            }
        }
        return;
    }
    let _ = next;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if tier.vector() {
        // SAFETY: AVX2/FMA/F16C are enabled at compile time; `kt` holds hd × 32 values, each q hd.
        unsafe {
            match kt {
                Block::F32(kt) => avx2::scores_block(qs, kt.as_ptr(), hd, scale, out, at),
                Block::F16(kt) => avx2::scores_block(qs, kt.as_ptr(), hd, scale, out, at),
            }
        }
        return;
    }
    let _ = tier;
    let Block::F32(kt) = kt else { unreachable!("the portable tier reads widened keys") };
    for (i, q) in qs.iter().enumerate() {
        let o = at(i);
        for t in 0..KV_BLOCK {
            let mut acc = 0f32;
            for d in 0..hd {
                acc = q[d].mul_add(kt[d * KV_BLOCK + t], acc);
            }
            out[o + t] = acc * scale;
        }
    }
}

/// A split's scores (a multiple of 8 long, padded with -∞) become `exp(s − m)` in place;
/// returns `(m, l)`.
fn softmax_in_place(s: &mut [f32], tier: Tier) -> (f32, f32) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    if tier.vector() {
        // SAFETY: AVX2/FMA are enabled at compile time; s.len() is a multiple of 8.
        return unsafe { avx2::softmax_in_place(s) };
    }
    let _ = tier;
    let mut lanes = [f32::NEG_INFINITY; 8];
    for c in s.chunks_exact(8) {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = max_like_vector(*m, x);
        }
    }
    let m = max_like_vector(
        max_like_vector(max_like_vector(lanes[0], lanes[4]), max_like_vector(lanes[1], lanes[5])),
        max_like_vector(max_like_vector(lanes[2], lanes[6]), max_like_vector(lanes[3], lanes[7])),
    );
    let mut sum = [0f32; 8];
    for c in s.chunks_exact_mut(8) {
        for (a, x) in sum.iter_mut().zip(c) {
            *x = exp_neg(*x - m);
            *a += *x;
        }
    }
    (m, lane_sum(sum))
}

#[inline]
fn lane_sum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// `o[d] += p[t] · v[t][d]` for the block's positions in order (`v`: `[t][head_dim]`): one
/// fused chain per `d` that goes on from block to block. The definition; the vector tier runs
/// it a group of queries at a time ([`grouped_values`]).
fn weighted_values(p: &[f32], v: &[f32], hd: usize, o: &mut [f32]) {
    for (t, &pt) in p.iter().enumerate() {
        for (od, &vd) in o.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
            *od = pt.mul_add(vd, *od);
        }
    }
}

/// Folds split partial `(m, l, o)` into the running `(M, L, O)` of one query (the first split
/// initializes it).
fn fold(first: bool, m: f32, l: f32, o: &[f32], big_m: &mut f32, big_l: &mut f32, big_o: &mut [f32]) {
    if first {
        *big_m = m;
        *big_l = l;
        big_o.copy_from_slice(o);
        return;
    }
    let new_m = max_like_vector(*big_m, m);
    let (a, b) = (exp_neg(*big_m - new_m), exp_neg(m - new_m));
    *big_m = new_m;
    *big_l = l.mul_add(b, *big_l * a);
    // Elementwise, so any vector width gives these bits.
    for (bo, &x) in big_o.iter_mut().zip(o) {
        *bo = x.mul_add(b, *bo * a);
    }
}

// ---------------------------------------------------------------------------------------------
// A layer's attention for a step

/// Output rows of a layer's attention, written by tasks into disjoint (row, head) slices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each (row, head) output is written by exactly one task.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(&self, offset: usize) -> *mut f32 {
        // SAFETY (of the caller's use): offsets stay inside the output buffer.
        self.0.wrapping_add(offset)
    }
}

/// One task: rows `rows` (consecutive positions of one sequence) × the query heads of KV head
/// `kvh`.
struct Task {
    seq: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
}

/// Shapes of a layer's attention, its score scale, and its sliding window if it has one.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// What a score `q·k` is multiplied by.
    pub scale: f32,
    /// A row at position `p` attends to the last `window` positions, `p + 1 - window ..= p`.
    pub window: Option<usize>,
}

impl Heads {
    /// Full causal attention with the usual scale, `1/√head_dim`.
    pub fn new(n_head: usize, n_kv_head: usize, head_dim: usize) -> Self {
        Heads { n_head, n_kv_head, head_dim, scale: 1.0 / (head_dim as f32).sqrt(), window: None }
    }
}

thread_local! {
    static WORK: std::cell::RefCell<Work> = std::cell::RefCell::new(Work::default());
}

/// Causal attention of a step's rows in layer `layer`: row `i` (of sequence `seq[i]`, at
/// position `pos[i]`, its K/V already in the cache) attends to positions `0..=pos[i]` of its
/// own cache, or the last `window` of them. Splits stay counted from position 0: a window
/// skips the splits (and blocks) before it and gives the positions before it inside its first
/// split a weight of exactly 0, so a row's bits still depend on its position alone. `q` and `out` are `rows × n_head × head_dim`. Rows of one sequence must be
/// consecutive positions, in order.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    heads: Heads,
    layer: usize,
    q: &[f32],
    seq: &[usize],
    pos: &[usize],
    caches: &[&KvCache],
    out: &mut [f32],
    tier: Tier,
) {
    let Heads { n_head, n_kv_head, head_dim: hd, scale, window } = heads;
    let (qd, group) = (n_head * hd, n_head / n_kv_head);
    let r = seq.len();
    assert!(q.len() == r * qd && out.len() == r * qd && pos.len() == r);
    let ptrs: Vec<Vec<*const u8>> = caches.iter().map(|c| c.block_ptrs().collect()).collect();
    let kvs: Vec<LayerKv> = caches
        .iter()
        .zip(&ptrs)
        .map(|(c, p)| LayerKv { blocks: p, stride: c.pool().stride(), layout: *c.layout(), layer })
        .collect();
    let mut tasks = Vec::new();
    let mut i = 0;
    while i < r {
        let mut j = i + 1;
        while j < r && j - i < TILE_ROWS && seq[j] == seq[i] && pos[j] == pos[j - 1] + 1 {
            j += 1;
        }
        tasks.extend((0..n_kv_head).map(|kvh| Task { seq: seq[i], rows: i..j, kvh }));
        i = j;
    }
    let start_of = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
    let out_ptr = OutPtr(out.as_mut_ptr());
    let queries = |t: &Task| -> Vec<Query> {
        t.rows
            .clone()
            .flat_map(|row| (0..group).map(move |g| (row, t.kvh * group + g)))
            .map(|(row, h)| Query {
                q: &q[row * qd + h * hd..row * qd + (h + 1) * hd],
                len: pos[row] + 1,
                start: start_of(pos[row]),
            })
            .collect()
    };
    let write = |t: &Task, k: usize, o: &[f32], l: f32| {
        let (row, h) = (t.rows.start + k / group, t.kvh * group + k % group);
        // SAFETY: this (row, head) slice of `out` belongs to this task alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(row * qd + h * hd), hd) };
        for (d, &x) in dst.iter_mut().zip(o) {
            *d = x / l;
        }
    };
    // The splits some row of the task attends to (its rows are consecutive positions).
    let splits_of = |t: &Task| start_of(pos[t.rows.start]) / SPLIT..(pos[t.rows.end - 1] + 1).div_ceil(SPLIT);
    let threads = rayon::current_num_threads();
    let total_splits: usize = tasks.iter().map(|t| splits_of(t).len()).sum();
    if tasks.len() >= 2 * threads || total_splits <= tasks.len() {
        // Enough tasks to share out: each folds its splits as it computes them.
        tasks.par_iter().for_each(|t| {
            let qs = queries(t);
            let mut part = Partials::new(qs.len(), hd);
            let (mut big_m, mut big_l, mut big_o) =
                (vec![0f32; qs.len()], vec![0f32; qs.len()], vec![0f32; qs.len() * hd]);
            WORK.with_borrow_mut(|w| {
                for s in splits_of(t) {
                    split_partials(&kvs[t.seq], t.kvh, &qs, s, scale, w, &mut part, tier);
                    for (k, qk) in qs.iter().enumerate() {
                        if qk.splits().contains(&s) {
                            let o = &part.o[k * hd..(k + 1) * hd];
                            fold(
                                s == qk.first_split(),
                                part.m[k],
                                part.l[k],
                                o,
                                &mut big_m[k],
                                &mut big_l[k],
                                &mut big_o[k * hd..(k + 1) * hd],
                            );
                        }
                    }
                }
            });
            for k in 0..qs.len() {
                write(t, k, &big_o[k * hd..(k + 1) * hd], big_l[k]);
            }
        });
        return;
    }
    // Few rows over long contexts (decode): every split is a task of its own, the partials are
    // kept, and each task's queries fold them in order afterwards.
    // A few consecutive splits a job, about four jobs a thread: enough to balance, few enough
    // that scheduling them costs little.
    let per_job = total_splits.div_ceil(4 * threads).max(1);
    let jobs: Vec<(usize, std::ops::Range<usize>)> = tasks
        .iter()
        .enumerate()
        .flat_map(|(ti, t)| {
            let n = splits_of(t);
            n.clone().step_by(per_job).map(move |s0| (ti, s0..(s0 + per_job).min(n.end)))
        })
        .collect();
    let parts: Vec<Vec<Partials>> = jobs
        .par_iter()
        .map(|(ti, splits)| {
            let t = &tasks[*ti];
            let qs = queries(t);
            WORK.with_borrow_mut(|w| {
                splits
                    .clone()
                    .map(|s| {
                        let mut part = Partials::new(qs.len(), hd);
                        split_partials(&kvs[t.seq], t.kvh, &qs, s, scale, w, &mut part, tier);
                        part
                    })
                    .collect()
            })
        })
        .collect();
    let parts: Vec<Partials> = parts.into_iter().flatten().collect();
    let mut first_job = 0;
    let starts: Vec<usize> = tasks
        .iter()
        .map(|t| {
            let at = first_job;
            first_job += splits_of(t).len();
            at
        })
        .collect();
    // The folds are a few hundred values a query: on the calling thread they cost less than
    // another parallel loop's wake and join.
    tasks.iter().zip(starts).for_each(|(t, at)| {
        let qs = queries(t);
        let (mut big_m, mut big_l, mut big_o) = (0f32, 0f32, vec![0f32; hd]);
        let s0 = splits_of(t).start;
        for (k, qk) in qs.iter().enumerate() {
            for s in qk.splits() {
                let p = &parts[at + s - s0];
                fold(
                    s == qk.first_split(),
                    p.m[k],
                    p.l[k],
                    &p.o[k * hd..(k + 1) * hd],
                    &mut big_m,
                    &mut big_l,
                    &mut big_o,
                );
            }
            write(t, k, &big_o, big_l);
        }
    });
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{EXP_MIN, EXP_P, KV_BLOCK, LN2_HI, LN2_LO, LOG2E};

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
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(LOG2E),
        ));
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
    /// lane.
    #[inline(always)]
    unsafe fn scores_pass<T: Src, const NQ: usize, const P: usize>(
        qs: &[&[f32]],
        kt: *const T,
        hd: usize,
        t0: usize,
        scale: __m256,
        out: &mut [f32],
        at: &impl Fn(usize) -> usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); P]; NQ];
        let k = kt.add(t0);
        for d in 0..hd {
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

    /// Every pass over the block's 32 positions for one group of up to eight queries.
    #[inline(always)]
    unsafe fn scores_passes<T: Src, const NQ: usize, const P: usize>(
        qs: &[&[f32]],
        kt: *const T,
        hd: usize,
        scale: __m256,
        out: &mut [f32],
        at: &impl Fn(usize) -> usize,
    ) {
        for t0 in (0..KV_BLOCK).step_by(8 * P) {
            scores_pass::<T, NQ, P>(qs, kt, hd, t0, scale, out, at);
        }
    }

    /// Scores of the block's 32 positions (`kt`: `[hd][32]`) for each of `qs`, a group of
    /// queries at a time ([`super::group_len`]): each key vector is read once per group.
    pub unsafe fn scores_block<T: Src>(
        qs: &[&[f32]],
        kt: *const T,
        hd: usize,
        scale: f32,
        out: &mut [f32],
        at: impl Fn(usize) -> usize,
    ) {
        debug_assert!(qs.iter().all(|q| q.len() >= hd));
        let sc = _mm256_set1_ps(scale);
        let mut j = 0;
        while j < qs.len() {
            let n = super::group_len(qs.len() - j);
            let (g, at_j) = (&qs[j..j + n], |i: usize| at(j + i));
            match n {
                1 => scores_passes::<T, 1, 4>(g, kt, hd, sc, out, &at_j),
                2 => scores_passes::<T, 2, 4>(g, kt, hd, sc, out, &at_j),
                3 => scores_passes::<T, 3, 4>(g, kt, hd, sc, out, &at_j),
                4 => scores_passes::<T, 4, 2>(g, kt, hd, sc, out, &at_j),
                5 => scores_passes::<T, 5, 2>(g, kt, hd, sc, out, &at_j),
                6 => scores_passes::<T, 6, 2>(g, kt, hd, sc, out, &at_j),
                7 => scores_passes::<T, 7, 1>(g, kt, hd, sc, out, &at_j),
                _ => scores_passes::<T, 8, 1>(g, kt, hd, sc, out, &at_j),
            }
            j += n;
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
    /// once feeds every query's chain.
    #[inline(always)]
    unsafe fn grouped_pass<T: Src, const NQ: usize, const W: usize>(
        ps: &[&[f32]],
        v: *const T,
        hd: usize,
        d0: usize,
        o: *mut f32,
    ) {
        let n = ps[0].len();
        let mut acc = [[_mm256_setzero_ps(); W]; NQ];
        for (i, a) in acc.iter_mut().enumerate() {
            for (c, a) in a.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(i * hd + d0 + 8 * c));
            }
        }
        let mut row = v.add(d0);
        for t in 0..n {
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
    /// for up to six, else eight (the widest whose accumulators fit the registers).
    #[inline(always)]
    unsafe fn grouped_passes<T: Src, const NQ: usize>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32) {
        let mut d0 = 0;
        if NQ <= 3 {
            while d0 + 32 <= hd {
                grouped_pass::<T, NQ, 4>(ps, v, hd, d0, o);
                d0 += 32;
            }
        }
        if NQ <= 6 {
            while d0 + 16 <= hd {
                grouped_pass::<T, NQ, 2>(ps, v, hd, d0, o);
                d0 += 16;
            }
        }
        while d0 < hd {
            grouped_pass::<T, NQ, 1>(ps, v, hd, d0, o);
            d0 += 8;
        }
    }

    /// [`super::weighted_values`] for a group of up to eight queries with the same positions
    /// (`ps[i]`, all of one length), outputs one after another at `o`.
    pub unsafe fn grouped_values<T: Src>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32) {
        debug_assert!(hd.is_multiple_of(8) && ps.iter().all(|p| p.len() == ps[0].len()));
        match ps.len() {
            1 => grouped_passes::<T, 1>(ps, v, hd, o),
            2 => grouped_passes::<T, 2>(ps, v, hd, o),
            3 => grouped_passes::<T, 3>(ps, v, hd, o),
            4 => grouped_passes::<T, 4>(ps, v, hd, o),
            5 => grouped_passes::<T, 5>(ps, v, hd, o),
            6 => grouped_passes::<T, 6>(ps, v, hd, o),
            7 => grouped_passes::<T, 7>(ps, v, hd, o),
            8 => grouped_passes::<T, 8>(ps, v, hd, o),
            n => unreachable!("a group of {n} queries"),
        }
    }
}

/// The AVX-512 tier of the two kernels that carry the arithmetic, [`avx2::scores_block`] and
/// [`avx2::grouped_values`]: sixteen lanes where those have eight, each lane still one
/// (query, position) or (query, d) chain of fused multiply-adds in the same order, so the bits
/// are the AVX2 tier's (and the definition's) whatever the width. What the width buys is
/// registers: a group of up to eight queries keeps every accumulator of a block's 32 positions
/// (or of 32 `d`) in registers with one broadcast per two multiply-adds, where the AVX2 tier's
/// sixteen registers allow one per multiply-add at seven queries (Qwen2.5 0.5B's group) and
/// pass over the block four times. The softmax, the folds and `exp` stay the AVX2 tier's.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx512 {
    use std::arch::x86_64::*;

    use super::KV_BLOCK;

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

    /// Asks for the `bytes` at `offset` in `region`, a row of the region read next (null: none;
    /// checked before the offset is added, so that nothing is asked of a page that is not there).
    #[inline(always)]
    unsafe fn prefetch_row(region: *const u8, offset: usize, bytes: usize) {
        if !region.is_null() {
            let p = region.wrapping_add(offset);
            for off in (0..bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8);
            }
        }
    }

    /// The block's 32 scores for `NQ` queries: two vectors of sixteen positions per query. Each
    /// step over `d` asks for the same row of `next`, the region read after this one: a block is
    /// its own 4 KiB page or more, where the hardware's prefetch stops, and a row a step keeps
    /// few enough requests in flight that the block's own loads are not held up behind them.
    #[inline(always)]
    unsafe fn scores_group<T: Src, const NQ: usize>(
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
            prefetch_row(next, d * row_bytes, row_bytes);
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
    /// `next`: the region read after this one, asked for as the first group goes (null: none).
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn scores_block<T: Src>(
        qs: &[&[f32]],
        kt: *const T,
        hd: usize,
        scale: f32,
        out: &mut [f32],
        at: impl Fn(usize) -> usize,
        next: *const u8,
    ) {
        debug_assert!(qs.iter().all(|q| q.len() >= hd));
        let mut j = 0;
        while j < qs.len() {
            let n = super::group_len(qs.len() - j);
            let (g, at_j) = (&qs[j..j + n], |i: usize| at(j + i));
            let next = if j == 0 { next } else { std::ptr::null() };
            match n {
                1 => scores_group::<T, 1>(g, kt, hd, scale, out, &at_j, next),
                2 => scores_group::<T, 2>(g, kt, hd, scale, out, &at_j, next),
                3 => scores_group::<T, 3>(g, kt, hd, scale, out, &at_j, next),
                4 => scores_group::<T, 4>(g, kt, hd, scale, out, &at_j, next),
                5 => scores_group::<T, 5>(g, kt, hd, scale, out, &at_j, next),
                6 => scores_group::<T, 6>(g, kt, hd, scale, out, &at_j, next),
                7 => scores_group::<T, 7>(g, kt, hd, scale, out, &at_j, next),
                _ => scores_group::<T, 8>(g, kt, hd, scale, out, &at_j, next),
            }
            j += n;
        }
    }

    /// `o_i[d0..d0 + 16W] += Σ_t p_i[t] · v[t][d0..]` for `NQ` queries, the value vectors read
    /// once for every query's chains; each step over `t` asks for row `t` of `next` (null: none),
    /// as [`scores_group`] does.
    #[inline(always)]
    unsafe fn grouped_pass<T: Src, const NQ: usize, const W: usize>(
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
            prefetch_row(next, t * row_bytes, row_bytes);
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
    unsafe fn grouped_passes<T: Src, const NQ: usize>(
        ps: &[&[f32]],
        v: *const T,
        hd: usize,
        o: *mut f32,
        mut next: *const u8,
    ) {
        let mut d0 = 0;
        if NQ <= 3 {
            while d0 + 64 <= hd {
                grouped_pass::<T, NQ, 4>(ps, v, hd, d0, o, next);
                (d0, next) = (d0 + 64, std::ptr::null());
            }
        }
        while d0 + 32 <= hd {
            grouped_pass::<T, NQ, 2>(ps, v, hd, d0, o, next);
            (d0, next) = (d0 + 32, std::ptr::null());
        }
        while d0 < hd {
            grouped_pass::<T, NQ, 1>(ps, v, hd, d0, o, next);
            (d0, next) = (d0 + 16, std::ptr::null());
        }
    }

    /// [`super::avx2::grouped_values`] in sixteen lanes; `hd` a multiple of 16. `next`: the
    /// region read after this one (null: none).
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn grouped_values<T: Src>(ps: &[&[f32]], v: *const T, hd: usize, o: *mut f32, next: *const u8) {
        debug_assert!(hd.is_multiple_of(16) && ps.iter().all(|p| p.len() == ps[0].len()));
        match ps.len() {
            1 => grouped_passes::<T, 1>(ps, v, hd, o, next),
            2 => grouped_passes::<T, 2>(ps, v, hd, o, next),
            3 => grouped_passes::<T, 3>(ps, v, hd, o, next),
            4 => grouped_passes::<T, 4>(ps, v, hd, o, next),
            5 => grouped_passes::<T, 5>(ps, v, hd, o, next),
            6 => grouped_passes::<T, 6>(ps, v, hd, o, next),
            7 => grouped_passes::<T, 7>(ps, v, hd, o, next),
            8 => grouped_passes::<T, 8>(ps, v, hd, o, next),
            n => unreachable!("a group of {n} queries"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kv_cache::KvPool;

    fn noise(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }

    /// A sequence: its K/V for layer 0 (`[pos][kv_dim]`) and one query row per position.
    struct Seq {
        k: Vec<f32>,
        v: Vec<f32>,
        q: Vec<f32>,
    }

    fn seq(h: Heads, len: usize, seed: u64) -> Seq {
        let mut next = noise(seed);
        let kvd = h.n_kv_head * h.head_dim;
        // Spread wide enough that some probabilities underflow, as in real models.
        Seq {
            k: (0..len * kvd).map(|_| 6.0 * next()).collect(),
            v: (0..len * kvd).map(|_| 2.0 * next()).collect(),
            q: (0..len * h.n_head * h.head_dim).map(|_| 6.0 * next()).collect(),
        }
    }

    fn cache(h: Heads, s: &Seq, len: usize, dtype: KvDtype, scatter: Option<u64>) -> KvCache {
        let lay = BlockLayout { n_layer: 1, n_kv_head: h.n_kv_head, head_dim: h.head_dim, dtype };
        let pool = KvPool::bounded(lay, len.div_ceil(KV_BLOCK) + 40);
        if let Some(seed) = scatter {
            pool.shuffle_free_list(seed);
        }
        let mut c = KvCache::in_pool(pool);
        c.extend(len).unwrap();
        let kvd = h.n_kv_head * h.head_dim;
        for p in 0..len {
            c.write(0, p, &s.k[p * kvd..(p + 1) * kvd], &s.v[p * kvd..(p + 1) * kvd]).unwrap();
        }
        c
    }

    /// Attention of the rows `(seq, first..last)` of several sequences in one call.
    fn run(
        h: Heads,
        caches: &[&KvCache],
        seqs: &[&Seq],
        rows: &[(usize, std::ops::Range<usize>)],
        tier: Tier,
    ) -> Vec<Vec<u32>> {
        let qd = h.n_head * h.head_dim;
        let (mut q, mut sq, mut pos) = (vec![], vec![], vec![]);
        for (i, r) in rows {
            for p in r.clone() {
                q.extend_from_slice(&seqs[*i].q[p * qd..(p + 1) * qd]);
                sq.push(*i);
                pos.push(p);
            }
        }
        let mut out = vec![f32::NAN; q.len()];
        attend_rows(h, 0, &q, &sq, &pos, caches, &mut out, tier);
        out.chunks(qd).map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
    }

    fn tiers() -> Vec<Tier> {
        let mut t = vec![Tier::Portable];
        if cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")) {
            t.push(Tier::Avx2);
            if Isa::best() == Isa::Avx512 {
                t.push(Tier::Avx512);
            }
        }
        t
    }

    fn pools() -> [rayon::ThreadPool; 2] {
        [1, 3].map(|n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap())
    }

    /// A row's output bits depend only on its query and its own sequence's K/V: alone as a
    /// decode row, inside prefill tiles of any size, next to another sequence's rows, on 1 or 3
    /// threads, with its blocks scattered over the pool, and in either tier.
    #[test]
    fn a_rows_bits_depend_on_nothing_but_its_own_history() {
        let shapes = [
            Heads::new(9, 3, 64),
            Heads::new(14, 2, 64),
            Heads::new(4, 2, 128),
            Heads::new(2, 1, 36),
            // Sliding windows: one ending inside a split, one shorter than a block.
            Heads { window: Some(300), ..Heads::new(4, 1, 256) },
            Heads { window: Some(20), ..Heads::new(2, 1, 36) },
            // The vector tier's groups: eight queries a pass, five over a head_dim that ends in
            // half a pass, and three over one that takes a pass of 32 values, then of 16.
            Heads::new(16, 2, 64),
            Heads::new(10, 2, 72),
            Heads::new(3, 1, 48),
        ];
        for (si, h) in shapes.into_iter().enumerate() {
            let len = [600, 530, 300, 280, 600, 280, 290, 300, 290][si];
            for dtype in KvDtype::ALL {
                let a = seq(h, len, 11 + si as u64);
                let b = seq(h, 90, 23 + si as u64);
                let (ca, cb) = (cache(h, &a, len, dtype, None), cache(h, &b, 90, dtype, None));
                let scattered = cache(h, &a, len, dtype, Some(7));
                assert_ne!(ca.block_ids(), scattered.block_ids());
                // Each probed row alone, as a decode step, is the reference.
                let mut probes: Vec<usize> =
                    [0, 1, 31, 32, 255, 256, 257, 511, 512].into_iter().filter(|&p| p < len).collect();
                probes.push(len - 1);
                let alone: Vec<Vec<u32>> =
                    probes.iter().map(|&p| run(h, &[&ca], &[&a], &[(0, p..p + 1)], Tier::Portable).remove(0)).collect();
                for tier in tiers() {
                    for pool in pools() {
                        pool.install(|| {
                            for (&p, want) in probes.iter().zip(&alone) {
                                let got = run(h, &[&scattered], &[&a], &[(0, p..p + 1)], tier).remove(0);
                                assert_eq!(&got, want, "{h:?} {dtype:?} {tier:?} row {p} alone, scattered");
                            }
                            // The whole sequence as one prefill, next to another sequence's rows.
                            let all = run(h, &[&cb, &ca], &[&b, &a], &[(0, 60..90), (1, 0..len)], tier);
                            for (&p, want) in probes.iter().zip(&alone) {
                                assert_eq!(&all[30 + p], want, "{h:?} {dtype:?} {tier:?} row {p} in a prefill");
                            }
                            // Chunks of 7 positions.
                            for &p in &probes {
                                let c0 = p - p % 7;
                                let got = run(h, &[&ca], &[&a], &[(0, c0..(c0 + 7).min(len))], tier);
                                assert_eq!(
                                    &got[p - c0],
                                    &alone[probes.iter().position(|&x| x == p).unwrap()],
                                    "{h:?} {tier:?} row {p} in a chunk of 7"
                                );
                            }
                        });
                    }
                }
            }
        }
    }

    /// Against attention in f64 over the same (stored) K/V: the kernel's error stays small.
    #[test]
    fn attention_is_close_to_an_f64_reference() {
        for window in [None, Some(300), Some(5)] {
            close_to_f64(Heads { window, ..Heads::new(4, 2, 64) });
        }
    }

    fn close_to_f64(h: Heads) {
        let len = 1100;
        let a = seq(h, len, 5);
        let c = cache(h, &a, len, KvDtype::F32, None);
        let rows: Vec<usize> = vec![0, 7, 255, 256, 700, len - 1];
        let (hd, kvd, qd) = (64, 128, 256);
        let mut worst = 0f64;
        for &p in &rows {
            let got = run(h, &[&c], &[&a], &[(0, p..p + 1)], Tier::current()).remove(0);
            for hh in 0..4 {
                let kvh = hh / 2;
                let q = &a.q[p * qd + hh * hd..p * qd + (hh + 1) * hd];
                let from = h.window.map_or(0, |w| (p + 1).saturating_sub(w));
                let s: Vec<f64> = (from..=p)
                    .map(|t| {
                        (0..hd).map(|d| q[d] as f64 * a.k[t * kvd + kvh * hd + d] as f64).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let want = (from..=p).map(|t| e[t - from] * a.v[t * kvd + kvh * hd + d] as f64).sum::<f64>() / z;
                    let g = f32::from_bits(got[hh * hd + d]) as f64;
                    worst = worst.max((g - want).abs());
                }
            }
        }
        // Values are within ±1; f32 accumulation over ~1000 positions.
        assert!(worst < 2e-6, "{h:?}: largest absolute error {worst:e}");
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_neg_is_within_two_ulp_of_exp() {
        let mut worst = 0;
        let mut x = EXP_MIN;
        while x <= 0.0 {
            let want = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp_neg(x), want));
            x += 0.000_731;
        }
        assert!(worst <= 2, "exp_neg off by {worst} ulp");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-88.0), 0.0);
        assert_eq!(exp_neg(f32::NAN), 0.0);
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    #[test]
    fn exp_neg8_is_exp_neg_bit_for_bit() {
        use std::arch::x86_64::*;
        let ln2 = std::f32::consts::LN_2;
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            -1e-30,
            -1e-10,
            EXP_MIN,
            EXP_MIN - 1e-5,
            -87.0,
            -87.5,
            -88.0,
            -1000.0,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::MIN_POSITIVE,
        ];
        for k in 0..130 {
            let mid = -(k as f32 + 0.5) * ln2;
            xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
        }
        let mut s = 0x9E3779B97F4A7C15u64;
        for _ in 0..40_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            xs.push(-((s >> 40) as f32 / (1u64 << 24) as f32) * 90.0);
        }
        while xs.len() % 8 != 0 {
            xs.push(-1.0);
        }
        for c in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 is enabled at compile time.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp_neg8(_mm256_loadu_ps(c.as_ptr()))) };
            for (g, &x) in got.iter().zip(c) {
                assert_eq!(g.to_bits(), exp_neg(x).to_bits(), "exp_neg({x:e})");
            }
        }
    }
}
