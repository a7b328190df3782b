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
/// From this head dim up, the vector kernels ask for the region read next into L2 rather than
/// L1, so that its reads overlap the arithmetic. A decode step's attention at head dim 128 (Qwen
/// 1.5B's six queries a KV head, Llama 3.1 8B's four) ran 1.13–1.15x as fast at 4,096 positions;
/// at head dim 64 (SmolLM2, Qwen 0.5B), half the multiply-adds per byte read, it moved only
/// within the noise (docs/BENCHMARKS.md, "The next K/V region into L2").
const NEXT_INTO_L2_FROM_HEAD_DIM: usize = 128;

/// The region a kernel reads after the one it is on, asked for a row at a time as the kernel
/// goes (a block is its own 4 KiB page or more, where the hardware's prefetch stops), and the
/// cache level it is asked into. A prefetch changes no bit.
#[derive(Clone, Copy)]
pub(crate) struct Next {
    pub(crate) region: *const u8,
    pub(crate) into_l2: bool,
}

impl Next {
    /// Nothing to ask for.
    const NONE: Next = Next { region: std::ptr::null(), into_l2: false };
}

/// `kernel::<.., L2>(args.., region)`: [`Next`]'s level passed on as the const `L2` the
/// kernels take ([`prefetch_row`]), and its region as their last argument.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
macro_rules! at_level {
    ($next:expr, $kernel:ident::<$($t:ty),*>($($arg:expr),* $(,)?)) => {{
        let next: super::Next = $next;
        if next.into_l2 {
            $kernel::<$($t,)* true>($($arg,)* next.region)
        } else {
            $kernel::<$($t,)* false>($($arg,)* next.region)
        }
    }};
}

/// Asks for the `bytes` at `offset` in `region`, a row of the region read next, into L2 (`L2`)
/// or L1 (null: none; checked before the offset is added, so that nothing is asked of a page
/// that is not there). The level is a const parameter: a branch on it in the kernels' innermost
/// loops cost Qwen 0.5B's attention more than the hint was worth.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_row<const L2: bool>(region: *const u8, offset: usize, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    if !region.is_null() {
        let p = region.wrapping_add(offset);
        for off in (0..bytes).step_by(64) {
            let line = p.wrapping_add(off) as *const i8;
            if L2 {
                _mm_prefetch::<_MM_HINT_T1>(line);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(line);
            }
        }
    }
}

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
/// The most queries an AVX2 group takes ([`group_len`]), and AVX-512's past [`GROUP_MAX`]: the
/// widest whose accumulators cover two vectors of positions (or of `d`) in sixteen registers.
const GROUP_TWO_VECTORS: usize = 6;

/// How many of `left` queries the next group takes. AVX-512's thirty-two registers carry up
/// to eight queries in one pass, two vectors of positions (or of `d`) each; past eight, groups
/// of six. AVX2's sixteen hold eight queries' accumulators for one vector only, which then takes
/// as many loads as multiply-adds, so there a group is six at most, and the queries are shared
/// out in equal groups (seven as four and three, not six and one, whose lone query would load a
/// key vector for every multiply-add) so that the multiply-adds set the pace.
fn group_len(left: usize, tier: Tier) -> usize {
    match tier {
        Tier::Avx512 if left <= GROUP_MAX => left,
        Tier::Avx512 => GROUP_TWO_VECTORS,
        _ => left.div_ceil(left.div_ceil(GROUP_TWO_VECTORS)),
    }
}

/// The groups `n` queries go in, as `(first query, length, next)`: the region read after the
/// block is asked for by the first group only, so that it is asked for once.
fn query_groups(n: usize, tier: Tier, next: Next) -> impl Iterator<Item = (usize, usize, Next)> {
    let (mut j, mut next) = (0, next);
    std::iter::from_fn(move || {
        (j < n).then(|| {
            let group = (j, group_len(n - j, tier), next);
            (j, next) = (j + group.1, Next::NONE);
            group
        })
    })
}

/// `o_i[d] += Σ_t p_i[t] · v[t][d]` for a group of queries (`ps[i]` their weights, `o` their
/// outputs one after another): the vector tier's [`weighted_values`], each value vector read
/// once for the whole group.
///
/// # Safety
/// `tier` must be a vector tier this host runs; `o` holds `ps.len() × hd` values, `v`
/// `ps[0].len()` rows.
unsafe fn grouped_values(ps: &[&[f32]], v: Block, hd: usize, o: *mut f32, tier: Tier, next: Next) {
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
        Block::F32(v) => avx2::grouped_values(ps, v.as_ptr(), hd, o, next),
        Block::F16(v) => avx2::grouped_values(ps, v.as_ptr(), hd, o, next),
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
    let Some(pass) = SplitPass::new(kv, kvh, qs, split, tier) else { return };
    let bsz = pass.hd * KV_BLOCK;
    w.kt.resize(bsz, 0.0);
    w.v.resize(bsz, 0.0);
    w.s.resize(qs.len() * SPLIT, 0.0);
    let q: Vec<&[f32]> = qs.iter().map(|q| q.q).collect();
    pass.scores(&q, scale, w);
    pass.softmax(w, out);
    pass.values(w, out);
}

/// One split's blocks for a set of queries of one KV head: which blocks are read, and how.
struct SplitPass<'a> {
    kv: &'a LayerKv<'a>,
    kvh: usize,
    hd: usize,
    /// Each query's positions in the split.
    spans: Vec<std::ops::Range<usize>>,
    /// The split's first block, and the blocks `b0..nb` of it that some query reads (blocks
    /// wholly before every query's window are not read).
    first: usize,
    b0: usize,
    nb: usize,
    /// The vector tier's grouped kernels run (else the scalar definition's loops).
    grouped: bool,
    /// Blocks are read where they lie (else one widened f32 copy at a time, which stays in L1
    /// while every query reads it).
    direct: bool,
    tier: Tier,
}

impl<'a> SplitPass<'a> {
    fn new(kv: &'a LayerKv<'a>, kvh: usize, qs: &[Query], split: usize, tier: Tier) -> Option<Self> {
        let hd = kv.layout.head_dim;
        let spans: Vec<std::ops::Range<usize>> = qs.iter().map(|q| q.span(split)).collect();
        let reach = spans.iter().map(|r| r.end).max().unwrap_or(0);
        if reach == 0 {
            return None;
        }
        let b0 = spans.iter().filter(|r| !r.is_empty()).map(|r| r.start / KV_BLOCK).min().unwrap_or(0);
        // The vector tier reads a block where it lies when its queries fit one group (a decode
        // row's heads: each value is then converted once either way, and the f32 copy's stores
        // and loads are saved); a prefill tile's many groups read one widened copy.
        let grouped = tier.vector() && hd.is_multiple_of(8);
        let direct = grouped && (kv.layout.dtype == KvDtype::F32 || qs.len() <= GROUP_MAX);
        let (first, nb) = (split * BLOCKS_PER_SPLIT, reach.div_ceil(KV_BLOCK));
        Some(SplitPass { kv, kvh, hd, spans, first, b0, nb, grouped, direct, tier })
    }

    /// Blocks ahead: the keys of the split's blocks, then its first values. Not for the blocks
    /// read in place: there a block's whole region requested at once (64–128 lines) held up the
    /// loads of the block being computed, and a decode step ran up to 1.6x faster with the
    /// hardware's prefetch alone (docs/BENCHMARKS.md "Decode reads without software prefetch").
    fn prefetches(&self) -> bool {
        !self.direct
    }

    /// `region`, read after the block being computed, asked for into the level this head dim
    /// wants ([`NEXT_INTO_L2_FROM_HEAD_DIM`]).
    fn next(&self, region: *const u8) -> Next {
        Next { region, into_l2: self.hd >= NEXT_INTO_L2_FROM_HEAD_DIM }
    }

    /// Every query's scores against the split's keys, into `w.s`.
    fn scores(&self, q: &[&[f32]], scale: f32, w: &mut Work) {
        let (kv, kvh, hd, first, b0, nb, tier) = (self.kv, self.kvh, self.hd, self.first, self.b0, self.nb, self.tier);
        let cnt = nb - b0;
        let ahead = |i: usize| if i < cnt { (first + b0 + i, false) } else { (first + b0 + i - cnt, true) };
        if self.prefetches() {
            for i in 0..AHEAD.min(cnt) {
                let (blk, values) = ahead(i);
                prefetch_block(kv, kvh, blk, values);
            }
        }
        for b in b0..nb {
            if self.prefetches() && b - b0 + AHEAD < 2 * cnt {
                let (blk, values) = ahead(b - b0 + AHEAD);
                prefetch_block(kv, kvh, blk, values);
            }
            let at = |i: usize| i * SPLIT + b * KV_BLOCK;
            if self.direct {
                // The region after this one: the next block's keys, else the first values.
                let region =
                    if b + 1 < nb { kv.region(first + b + 1, kvh, false) } else { kv.region(first + b0, kvh, true) };
                let next = self.next(region);
                scores_block(q, kv.view(first + b, kvh, false), hd, scale, &mut w.s, at, tier, next);
            } else {
                widen_block(kv, kvh, first + b, Some(&mut w.kt), None, tier);
                // Every query against the block while it is in L1 (a few at a time share its loads).
                scores_block(q, Block::F32(&w.kt), hd, scale, &mut w.s, at, tier, Next::NONE);
            }
        }
    }

    /// Each query's scores become weights in place; its max, sum and cleared output go to `out`.
    fn softmax(&self, w: &mut Work, out: &mut Partials) {
        let hd = self.hd;
        for (i, span) in self.spans.iter().enumerate() {
            if span.is_empty() {
                continue;
            }
            let s = &mut w.s[i * SPLIT..i * SPLIT + span.end.next_multiple_of(8)];
            // Positions before the window (some never scored) weigh exactly 0.
            s[..span.start].fill(f32::NEG_INFINITY);
            s[span.end..].fill(f32::NEG_INFINITY);
            let (m, l) = softmax_in_place(s, self.tier);
            out.m[i] = m;
            out.l[i] = l;
            out.o[i * hd..(i + 1) * hd].fill(0.0);
        }
    }

    /// This query's positions in block `b`: o's chain goes on where the last block left it. A
    /// block wholly before its window is skipped (its weights are all 0).
    fn positions_in(b: usize, span: &std::ops::Range<usize>) -> usize {
        let n = span.end.saturating_sub(b * KV_BLOCK).min(KV_BLOCK);
        if span.start < (b + 1) * KV_BLOCK {
            n
        } else {
            0
        }
    }

    /// Every query's weighted sum of the split's values, into `out.o`.
    fn values(&self, w: &mut Work, out: &mut Partials) {
        let (kv, kvh, hd, first, nb, tier) = (self.kv, self.kvh, self.hd, self.first, self.nb, self.tier);
        for b in self.b0..nb {
            if self.prefetches() && b + AHEAD < nb {
                prefetch_block(kv, kvh, first + b + AHEAD, true);
            }
            // The region after this one: the next block's values, else the next split's first keys.
            let region = if !self.direct {
                std::ptr::null()
            } else if b + 1 < nb {
                kv.region(first + b + 1, kvh, true)
            } else if first + BLOCKS_PER_SPLIT < kv.blocks.len() {
                kv.region(first + BLOCKS_PER_SPLIT, kvh, false)
            } else {
                std::ptr::null()
            };
            let next = self.next(region);
            let v = if self.direct {
                kv.view(first + b, kvh, true)
            } else {
                widen_block(kv, kvh, first + b, None, Some(&mut w.v), tier);
                Block::F32(&w.v)
            };
            if !self.grouped {
                for (i, span) in self.spans.iter().enumerate() {
                    let n = Self::positions_in(b, span);
                    if n > 0 {
                        let p = &w.s[i * SPLIT + b * KV_BLOCK..][..n];
                        weighted_values(p, &w.v, hd, &mut out.o[i * hd..(i + 1) * hd]);
                    }
                }
                continue;
            }
            self.grouped_block(b, v, next, w, out);
        }
    }

    /// Block `b`'s values for runs of queries with the same positions in it (a row's heads
    /// always are one), which share each value vector they read, a group at a time.
    fn grouped_block(&self, b: usize, v: Block, mut next: Next, w: &Work, out: &mut Partials) {
        let (hd, spans) = (self.hd, &self.spans);
        let mut i = 0;
        while i < spans.len() {
            let n = Self::positions_in(b, &spans[i]);
            let run = 1 + spans[i + 1..].iter().take_while(|sp| Self::positions_in(b, sp) == n).count();
            if n > 0 {
                for (j, len, next) in query_groups(run, self.tier, next) {
                    let j = i + j;
                    // On the stack: this runs once per block and group.
                    let mut ps: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
                    for (p, k) in ps.iter_mut().zip(j..j + len) {
                        *p = &w.s[k * SPLIT + b * KV_BLOCK..][..n];
                    }
                    let os = out.o[j * hd..(j + len) * hd].as_mut_ptr();
                    // SAFETY: the vector tier was checked (`grouped`); `os` holds len × hd values.
                    unsafe { grouped_values(&ps[..len], v, hd, os, self.tier, next) };
                }
                next = Next::NONE;
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
/// `out[at(i)..at(i) + 32]`. `next`: the region read after this one, for the vector tiers to
/// ask for as they go.
#[allow(clippy::too_many_arguments)]
fn scores_block(
    qs: &[&[f32]],
    kt: Block,
    hd: usize,
    scale: f32,
    out: &mut [f32],
    at: impl Fn(usize) -> usize,
    tier: Tier,
    next: Next,
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
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if tier.vector() {
        // SAFETY: AVX2/FMA/F16C are enabled at compile time; `kt` holds hd × 32 values, each q hd.
        unsafe {
            match kt {
                Block::F32(kt) => avx2::scores_block(qs, kt.as_ptr(), hd, scale, out, at, next),
                Block::F16(kt) => avx2::scores_block(qs, kt.as_ptr(), hd, scale, out, at, next),
            }
        }
        return;
    }
    let _ = (tier, next);
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
    let r = seq.len();
    let qd = heads.n_head * heads.head_dim;
    assert!(q.len() == r * qd && out.len() == r * qd && pos.len() == r);
    let ptrs: Vec<Vec<*const u8>> = caches.iter().map(|c| c.block_ptrs().collect()).collect();
    let kvs: Vec<LayerKv> = caches
        .iter()
        .zip(&ptrs)
        .map(|(c, p)| LayerKv { blocks: p, stride: c.pool().stride(), layout: *c.layout(), layer })
        .collect();
    let step = Step { heads, q, pos, kvs, out: OutPtr(out.as_mut_ptr()), tier };
    let tasks = step.tasks(seq);
    let total_splits: usize = tasks.iter().map(|t| step.splits_of(t).len()).sum();
    if tasks.len() >= 2 * rayon::current_num_threads() || total_splits <= tasks.len() {
        step.fold_as_computed(&tasks);
    } else {
        step.splits_as_jobs(&tasks, total_splits);
    }
}

/// One call of [`attend_rows`]: its rows' queries and positions, the caches' layer, where the
/// outputs go.
struct Step<'a> {
    heads: Heads,
    q: &'a [f32],
    pos: &'a [usize],
    kvs: Vec<LayerKv<'a>>,
    out: OutPtr,
    tier: Tier,
}

impl Step<'_> {
    /// Runs of at most [`TILE_ROWS`] consecutive positions of one sequence, for each KV head.
    fn tasks(&self, seq: &[usize]) -> Vec<Task> {
        let (r, pos) = (seq.len(), self.pos);
        let mut tasks = Vec::new();
        let mut i = 0;
        while i < r {
            let mut j = i + 1;
            while j < r && j - i < TILE_ROWS && seq[j] == seq[i] && pos[j] == pos[j - 1] + 1 {
                j += 1;
            }
            tasks.extend((0..self.heads.n_kv_head).map(|kvh| Task { seq: seq[i], rows: i..j, kvh }));
            i = j;
        }
        tasks
    }

    fn start_of(&self, p: usize) -> usize {
        self.heads.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// The splits some row of the task attends to (its rows are consecutive positions).
    fn splits_of(&self, t: &Task) -> std::ops::Range<usize> {
        self.start_of(self.pos[t.rows.start]) / SPLIT..(self.pos[t.rows.end - 1] + 1).div_ceil(SPLIT)
    }

    /// The task's queries: each row's query heads of its KV head.
    fn queries(&self, t: &Task) -> Vec<Query<'_>> {
        let Heads { n_head, n_kv_head, head_dim: hd, .. } = self.heads;
        let (qd, group) = (n_head * hd, n_head / n_kv_head);
        t.rows
            .clone()
            .flat_map(|row| (0..group).map(move |g| (row, t.kvh * group + g)))
            .map(|(row, h)| Query {
                q: &self.q[row * qd + h * hd..row * qd + (h + 1) * hd],
                len: self.pos[row] + 1,
                start: self.start_of(self.pos[row]),
            })
            .collect()
    }

    /// Query `k` of task `t`'s output, `o / l`.
    fn write(&self, t: &Task, k: usize, o: &[f32], l: f32) {
        let Heads { n_head, n_kv_head, head_dim: hd, .. } = self.heads;
        let group = n_head / n_kv_head;
        let (row, h) = (t.rows.start + k / group, t.kvh * group + k % group);
        // SAFETY: this (row, head) slice of `out` belongs to this task alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.out.at(row * n_head * hd + h * hd), hd) };
        for (d, &x) in dst.iter_mut().zip(o) {
            *d = x / l;
        }
    }

    fn split(&self, t: &Task, qs: &[Query], s: usize, w: &mut Work, part: &mut Partials) {
        split_partials(&self.kvs[t.seq], t.kvh, qs, s, self.heads.scale, w, part, self.tier);
    }

    /// Enough tasks to share out: each folds its splits as it computes them.
    fn fold_as_computed(&self, tasks: &[Task]) {
        let hd = self.heads.head_dim;
        tasks.par_iter().for_each(|t| {
            let qs = self.queries(t);
            let mut part = Partials::new(qs.len(), hd);
            let (mut big_m, mut big_l, mut big_o) =
                (vec![0f32; qs.len()], vec![0f32; qs.len()], vec![0f32; qs.len() * hd]);
            WORK.with_borrow_mut(|w| {
                for s in self.splits_of(t) {
                    self.split(t, &qs, s, w, &mut part);
                    for (k, qk) in qs.iter().enumerate() {
                        if qk.splits().contains(&s) {
                            let o = &part.o[k * hd..(k + 1) * hd];
                            let big = (&mut big_m[k], &mut big_l[k], &mut big_o[k * hd..(k + 1) * hd]);
                            fold(s == qk.first_split(), part.m[k], part.l[k], o, big.0, big.1, big.2);
                        }
                    }
                }
            });
            for k in 0..qs.len() {
                self.write(t, k, &big_o[k * hd..(k + 1) * hd], big_l[k]);
            }
        });
    }

    /// Few rows over long contexts (decode): every split is a task of its own, the partials
    /// are kept, and each task's queries fold them in order afterwards. A few consecutive splits
    /// a job, about four jobs a thread: enough to balance, few enough that scheduling them
    /// costs little.
    fn splits_as_jobs(&self, tasks: &[Task], total_splits: usize) {
        let hd = self.heads.head_dim;
        let per_job = total_splits.div_ceil(4 * rayon::current_num_threads()).max(1);
        let jobs: Vec<(usize, std::ops::Range<usize>)> = tasks
            .iter()
            .enumerate()
            .flat_map(|(ti, t)| {
                let n = self.splits_of(t);
                n.clone().step_by(per_job).map(move |s0| (ti, s0..(s0 + per_job).min(n.end)))
            })
            .collect();
        let parts: Vec<Vec<Partials>> = jobs
            .par_iter()
            .map(|(ti, splits)| {
                let t = &tasks[*ti];
                let qs = self.queries(t);
                WORK.with_borrow_mut(|w| {
                    splits
                        .clone()
                        .map(|s| {
                            let mut part = Partials::new(qs.len(), hd);
                            self.split(t, &qs, s, w, &mut part);
                            part
                        })
                        .collect()
                })
            })
            .collect();
        let parts: Vec<Partials> = parts.into_iter().flatten().collect();
        // The folds are a few hundred values a query: on the calling thread they cost less than
        // another parallel loop's wake and join.
        let mut at = 0;
        for t in tasks {
            let qs = self.queries(t);
            let (mut big_m, mut big_l, mut big_o) = (0f32, 0f32, vec![0f32; hd]);
            let s0 = self.splits_of(t).start;
            for (k, qk) in qs.iter().enumerate() {
                for s in qk.splits() {
                    let p = &parts[at + s - s0];
                    let o = &p.o[k * hd..(k + 1) * hd];
                    fold(s == qk.first_split(), p.m[k], p.l[k], o, &mut big_m, &mut big_l, &mut big_o);
                }
                self.write(t, k, &big_o, big_l);
            }
            at += self.splits_of(t).len();
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx2;

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx512;

#[cfg(test)]
mod tests;
