//! The canonical order ([`super::canonical`]) at the CPU's speed: the same IEEE operations per
//! output, on weights packed so that sixteen columns sit in the lanes of one AVX-512 vector.
//!
//! What fixes the bits is per output: unit `u` of 32 weights gives an exact integer dot product
//! and one or two f32 coefficients, and is added into lane `u % 32` of that output's 32 lane
//! accumulators with `acc = fma(coef · d, c, acc)` (then the min term the same way); the lanes
//! fold by the xor butterfly. [`super::canonical::matmul`] walks one column at a time with
//! scalar code. Here a vector lane holds one *column*, so a vector operation is sixteen
//! outputs' scalar operation side by side: `fma(coef · d, c, acc)` with `coef` and `c` vectors
//! over the columns and `d` the row's scalar, the 32 lane accumulators are 32 vectors (kept
//! in L1, one per `u % 32`), and the butterfly is 31 vertical adds. Nothing is reassociated,
//! so every output has the scalar definition's bits (tested against it and against
//! [`super::canonical::emulate_warp`]).
//!
//! The integer parts are exact however they are grouped, which is what lets `vpdpbusd` (u8 ×
//! i8, four products a lane) compute them: a signed weight `w` is stored or read as
//! `w + offset ≥ 0` and `offset · Σq` subtracted after, in integers. Products of small integers
//! with the unit's integer scales (Q4_K's 6-bit `sc`, `m`) are done in f32 where both factors
//! and the product are below 2^24, hence exact: the same float the scalar code converts from
//! its integer product.
//!
//! Layouts ([`pack`]): Q4_K, Q4_1 and Q5_0 use the `invariant` mode's packed tiles
//! ([`super::cpu::pack`]); Q6_K and Q8_0 get tiles of their own here, each sixteen columns'
//! block `b` with its bytes transposed a dword at a time (vector `t`, lane `c`: column `c`'s
//! dword `t`) and the sixteen f16 scales `d` as one vector. A pack only permutes bytes: the
//! size is the GGUF size and [`unpack`] restores it exactly.

use candle_core::quantized::{GgmlDType, QStorage, QTensor};

use super::canonical::{quantize_rows, UNIT};
use crate::error::{Error, Result};

/// Columns per packed group: one AVX-512 vector of f32.
pub const PACK_COLS: usize = 16;
/// Rows that share one pass over a group's tiles: every row's 32 lane vectors stay in L1
/// (8 × 2 KiB), and the tiles are decoded once for all of them.
const PASS_ROWS: usize = 8;

/// Activation rows quantized the canonical way, with the sums of `q` the offset and min terms
/// take: per unit, and per half unit (values 0..16, 16..32) for Q6_K's two scales.
pub struct Rows {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<i32>,
    halves: Vec<i32>,
    k: usize,
}

impl Rows {
    pub fn new(x: &[f32], m: usize, k: usize) -> Rows {
        let qa = quantize_rows(x, m, k);
        let units = m * k / UNIT;
        let mut sum = Vec::with_capacity(units);
        let mut halves = Vec::with_capacity(2 * units);
        for unit in qa.q.chunks_exact(UNIT) {
            let lo: i32 = unit[..UNIT / 2].iter().map(|&v| v as i32).sum();
            let hi: i32 = unit[UNIT / 2..].iter().map(|&v| v as i32).sum();
            sum.push(lo + hi);
            halves.extend([lo, hi]);
        }
        Rows { q: qa.q, d: qa.d, sum, halves, k }
    }
    fn units(&self) -> usize {
        self.k / UNIT
    }
}

/// A dtype's tile: sixteen columns' block `b` (a K-quant super-block: 8 units).
#[derive(Clone, Copy, Debug)]
struct Layout {
    dtype: GgmlDType,
    block_bytes: usize,
    units_per_block: usize,
}

impl Layout {
    fn of(dtype: GgmlDType) -> Option<Layout> {
        let (block_bytes, units_per_block) = match dtype {
            GgmlDType::Q4K => (144, 8),
            GgmlDType::Q6K => (210, 8),
            GgmlDType::Q4_1 => (20, 1),
            GgmlDType::Q5_0 => (22, 1),
            GgmlDType::Q8_0 => (34, 1),
            _ => return None,
        };
        Some(Layout { dtype, block_bytes, units_per_block })
    }
    fn tile_bytes(self) -> usize {
        PACK_COLS * self.block_bytes
    }
}

/// The dword-transposed tiles of this file (Q6_K, Q8_0): where a block's dwords start and how
/// many, where its f16 `d` lies, and whether the tile puts the `d` vector first.
struct DwordTile {
    body: usize,
    words: usize,
    f16_at: usize,
    d_first: bool,
}

const Q6K_TILE: DwordTile = DwordTile { body: 0, words: 52, f16_at: 208, d_first: false };
const Q8_0_TILE: DwordTile = DwordTile { body: 2, words: 8, f16_at: 0, d_first: true };
/// Where a Q6_K tile's `qh` and scale vectors start (after 32 vectors of `ql`, then 16 of `qh`).
const Q6K_QH: usize = 32 * 64;
const Q6K_SCALES: usize = 48 * 64;

impl DwordTile {
    fn words_at(&self) -> usize {
        if self.d_first {
            2 * PACK_COLS
        } else {
            0
        }
    }
    fn d_at(&self) -> usize {
        if self.d_first {
            0
        } else {
            64 * self.words
        }
    }
}

/// Whether [`pack`] takes `w`: a Q4_K, Q6_K, Q4_1, Q5_0 or Q8_0 weight on the CPU in whole
/// groups of sixteen columns.
pub fn packable(w: &QTensor) -> bool {
    let Some(layout) = Layout::of(w.dtype()) else { return false };
    match w.shape().dims2() {
        Ok((n, k)) => w.device().is_cpu() && n % PACK_COLS == 0 && k > 0 && k % (UNIT * layout.units_per_block) == 0,
        Err(_) => false,
    }
}

/// `w` with its bytes permuted for [`matmul_packed_into`] (same dtype, shape and size), or
/// `None` where [`packable`] is false.
pub fn pack(w: &QTensor) -> Result<Option<QTensor>> {
    if !packable(w) {
        return Ok(None);
    }
    match w.dtype() {
        GgmlDType::Q6K | GgmlDType::Q8_0 => permuted(w, true).map(Some),
        _ => super::cpu::pack(w),
    }
}

/// [`pack`] undone: the GGUF layout.
pub fn unpack(w: &QTensor) -> Result<QTensor> {
    match w.dtype() {
        GgmlDType::Q6K | GgmlDType::Q8_0 => permuted(w, false),
        _ => super::cpu::unpack(w),
    }
}

fn dword_tile(dtype: GgmlDType) -> &'static DwordTile {
    match dtype {
        GgmlDType::Q6K => &Q6K_TILE,
        _ => &Q8_0_TILE,
    }
}

/// The byte permutation of [`DwordTile`]s: each group of sixteen columns keeps its byte range;
/// inside it, block `b` of the sixteen columns is tile `b`.
fn permute_dwords(src: &[u8], layout: Layout, kb: usize, pack: bool) -> Vec<u8> {
    let tile = dword_tile(layout.dtype);
    let block = layout.block_bytes;
    let mut out = vec![0u8; src.len()];
    let group = PACK_COLS * kb * block;
    for (s, d) in src.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        for c in 0..PACK_COLS {
            for b in 0..kb {
                let plain = (c * kb + b) * block;
                let t = b * layout.tile_bytes();
                let words = (0..tile.words)
                    .map(|word| (plain + tile.body + 4 * word, t + tile.words_at() + 64 * word + 4 * c, 4));
                for (p, q, len) in words.chain([(plain + tile.f16_at, t + tile.d_at() + 2 * c, 2)]) {
                    let (from, to) = if pack { (p, q) } else { (q, p) };
                    d[to..to + len].copy_from_slice(&s[from..from + len]);
                }
            }
        }
    }
    out
}

fn permuted(w: &QTensor, pack: bool) -> Result<QTensor> {
    let layout =
        Layout::of(w.dtype()).ok_or_else(|| Error::Unsupported(format!("no packed layout for {:?}", w.dtype())))?;
    let (n, k) = w.shape().dims2()?;
    let data = w.data()?;
    let bytes = permute_dwords(&data, layout, k / (UNIT * layout.units_per_block), pack);
    debug_assert_eq!(bytes.len(), n * k / (UNIT * layout.units_per_block) * layout.block_bytes);
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &candle_core::Device::Cpu, w.dtype())?;
    Ok(QTensor::new(storage, (n, k))?)
}

/// Rows `rows` of a weight [`pack`] made, dequantized to f32 row-major: only the groups of
/// sixteen rows that hold them are unpacked, into a temporary.
pub fn dequantize_rows_packed(w: &QTensor, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let (n, k) = w.shape().dims2()?;
    if rows.end > n || !packable(w) {
        return Err(Error::BadInput(format!("rows {rows:?} of a packed [{n}, {k}] {:?} weight", w.dtype())));
    }
    if !matches!(w.dtype(), GgmlDType::Q6K | GgmlDType::Q8_0) {
        return super::cpu::dequantize_rows_packed(w, rows);
    }
    let layout = Layout::of(w.dtype()).expect("packable");
    let group_bytes = k / (UNIT * layout.units_per_block) * layout.tile_bytes();
    let (g0, g1) = (rows.start / PACK_COLS, rows.end.div_ceil(PACK_COLS));
    let data = w.data()?;
    let plain =
        permute_dwords(&data[g0 * group_bytes..g1 * group_bytes], layout, k / (UNIT * layout.units_per_block), false);
    let storage = QStorage::from_data(std::borrow::Cow::Owned(plain), &candle_core::Device::Cpu, w.dtype())?;
    let dense = QTensor::new(storage, ((g1 - g0) * PACK_COLS, k))?.dequantize(&candle_core::Device::Cpu)?;
    let first = rows.start - g0 * PACK_COLS;
    Ok(dense.narrow(0, first, rows.len())?.flatten_all()?.to_vec1::<f32>()?)
}

/// The canonical matmul over a weight [`pack`] made: `m` rows of `x` in, `m` rows of `n` in
/// `out`, the bits of [`super::canonical::matmul`]. Hosts (or forced tiers) without AVX-512
/// unpack a copy and run the scalar definition.
pub fn matmul_packed_into(w: &QTensor, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    matmul_packed_on(super::isa(), w, x, m, out)
}

/// [`matmul_packed_into`] on kernel tier `isa` (which the host must run).
fn matmul_packed_on(isa: super::Isa, w: &QTensor, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    let (n, k) = w.shape().dims2()?;
    if !packable(w) {
        return Err(Error::BadInput(format!("not a packed canonical weight: {:?} [{n}, {k}]", w.dtype())));
    }
    if x.len() != m * k || out.len() != m * n {
        return Err(Error::BadInput(format!(
            "input has {} values and output {}, expected {m} rows of {k} and of {n}",
            x.len(),
            out.len()
        )));
    }
    #[cfg(target_arch = "x86_64")]
    if isa >= super::Isa::Avx2 && isa <= super::Isa::best() {
        let layout = Layout::of(w.dtype()).expect("packable");
        let data = w.data()?;
        let rows = Rows::new(x, m, k);
        let tier = if isa == super::Isa::Avx512 { avx512::pass } else { avx2::pass };
        drive(layout, &data, &rows, m, n, out, |g, blocks, p, count, got| tier(layout, g, blocks, p, count, got));
        return Ok(());
    }
    out.copy_from_slice(&super::canonical::matmul(&unpack(w)?, x, m)?);
    Ok(())
}

/// What a tile's units need from the activation rows of one pass: rows `first..`.
#[cfg(target_arch = "x86_64")]
struct Pass<'a> {
    rows: &'a Rows,
    first: usize,
}

#[cfg(target_arch = "x86_64")]
impl Pass<'_> {
    /// Dword `i` of unit `u`'s quantized values in row `r` of the pass.
    #[inline(always)]
    unsafe fn word(&self, r: usize, u: usize, i: usize) -> i32 {
        let at = (self.first + r) * self.rows.k + u * UNIT + 4 * i;
        std::ptr::read_unaligned(self.rows.q.as_ptr().add(at) as *const i32)
    }
    #[inline(always)]
    fn at(&self, r: usize, u: usize) -> usize {
        (self.first + r) * self.rows.units() + u
    }
    #[inline(always)]
    unsafe fn d(&self, r: usize, u: usize) -> f32 {
        *self.rows.d.get_unchecked(self.at(r, u))
    }
    #[inline(always)]
    unsafe fn sum(&self, r: usize, u: usize) -> i32 {
        *self.rows.sum.get_unchecked(self.at(r, u))
    }
    #[inline(always)]
    unsafe fn half(&self, r: usize, u: usize, h: usize) -> i32 {
        *self.rows.halves.get_unchecked(2 * self.at(r, u) + h)
    }
}

/// Rows of one pass's output for one group: sixteen columns a row.
type GroupOut = [[f32; PACK_COLS]; PASS_ROWS];

/// The work split both tiers share: groups of sixteen columns over the pool, each group's rows
/// [`PASS_ROWS`] at a time through `pass(group bytes, pass, rows in it, out)`.
#[cfg(target_arch = "x86_64")]
fn drive(
    layout: Layout,
    data: &[u8],
    rows: &Rows,
    m: usize,
    n: usize,
    out: &mut [f32],
    pass: impl Fn(*const u8, usize, &Pass, usize, &mut GroupOut) + Sync,
) {
    let blocks = rows.k / (UNIT * layout.units_per_block);
    let group_bytes = blocks * layout.tile_bytes();
    assert!(data.len() == n / PACK_COLS * group_bytes && out.len() == m * n);
    let ptr = super::OutPtr(out.as_mut_ptr());
    super::parallel_for(n / PACK_COLS, |g| {
        let p = ptr;
        let base = data[g * group_bytes..].as_ptr();
        let mut got = [[0f32; PACK_COLS]; PASS_ROWS];
        for first in (0..m).step_by(PASS_ROWS) {
            let count = PASS_ROWS.min(m - first);
            pass(base, blocks, &Pass { rows, first }, count, &mut got);
            for (i, row) in got[..count].iter().enumerate() {
                // SAFETY: this task alone writes these sixteen columns of row first + i.
                unsafe {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), p.0.add((first + i) * n + g * PACK_COLS), PACK_COLS)
                };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{GroupOut, Layout, Pass, PACK_COLS, Q6K_QH, Q6K_SCALES};
    use crate::kernels::canonical::{BUTTERFLY, LANES};
    use candle_core::quantized::GgmlDType;

    /// How far ahead of the tile it reads the kernel asks for memory, at up to
    /// [`PREFETCH_ROWS_MAX`] rows (beyond them each tile's bytes take long enough to use).
    const PREFETCH_AHEAD: usize = 4096;
    const PREFETCH_ROWS_MAX: usize = 2;

    /// Each row's 32 lane accumulators, sixteen columns a vector.
    type Lanes<const R: usize> = [[__m512; LANES]; R];

    /// The order's one float step, sixteen outputs at once: `acc = fma(coef · d, c, acc)`.
    #[inline(always)]
    unsafe fn step(acc: &mut __m512, coef: __m512, d: f32, c: __m512) {
        *acc = _mm512_fmadd_ps(_mm512_mul_ps(coef, _mm512_set1_ps(d)), c, *acc);
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
                (
                    _mm512_or_si512(_mm512_and_si512(lo, m15), high(a)),
                    _mm512_or_si512(_mm512_srli_epi32::<4>(lo), high(b)),
                )
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
                    let lane = &mut lanes[u % LANES];
                    // (sc · isum) and (m · Σq) as f32: exact products of exact floats (< 2^24).
                    let c = _mm512_mul_ps(_mm512_cvtepi32_ps(dot(pass, r, u, w, 0)), sc);
                    let dr = pass.d(r, u);
                    step(lane, d, dr, c);
                    step(lane, neg_dmin, dr, _mm512_mul_ps(mn, _mm512_set1_ps(pass.sum(r, u) as f32)));
                }
            }
        }
    }

    /// Q6_K super-block `sb`, this file's tile: `ql` as 32 vectors, `qh` as 16 (from
    /// [`Q6K_QH`]), the scales as 4 (from [`Q6K_SCALES`]), then the sixteen `d`. Unit
    /// `j = 4h + t` takes `ql[64h + 32(t % 2)..][..32]` shifted by `4(t / 2)` and bits `2t, 2t+1`
    /// of `qh[32h..][..32]`, as `w + 32` (0..64), and the int8 scales `sc[8h + 2t]` (values
    /// 0..16) and `sc[8h + 2t + 1]` (16..32). Units `t` and `t + 2` share their `ql` and `qh`
    /// bytes, so they are decoded from one load of each.
    #[inline(always)]
    unsafe fn q6k<const R: usize>(tile: *const u8, sb: usize, pass: &Pass, acc: &mut Lanes<R>) {
        let d = halves_f32(tile.add(super::Q6K_TILE.d_at()));
        let (low4, bits45) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        for h in 0..2 {
            for t in 0..2 {
                let mut w = [[_mm512_setzero_si512(); 8]; 2];
                for i in 0..8 {
                    let ql = load(tile.add(64 * (16 * h + 8 * t + i)));
                    let qh = load(tile.add(Q6K_QH + 64 * (8 * h + i)));
                    // Bits 2t, 2t + 1 (unit t) and 2t + 4, 2t + 5 (unit t + 2) of each qh byte
                    // to bits 4, 5; a 16-bit shift moves bits across bytes only into places
                    // the mask clears.
                    let (high_t, high_t2) = if t == 0 {
                        (_mm512_slli_epi16::<4>(qh), qh)
                    } else {
                        (_mm512_slli_epi16::<2>(qh), _mm512_srli_epi16::<2>(qh))
                    };
                    // (ql & 0x0F) | (high & 0x30)
                    w[0][i] = _mm512_ternarylogic_epi32::<0xEC>(ql, _mm512_and_si512(high_t, bits45), low4);
                    w[1][i] = _mm512_ternarylogic_epi32::<0xEC>(
                        _mm512_srli_epi16::<4>(ql),
                        _mm512_and_si512(high_t2, bits45),
                        low4,
                    );
                }
                for (pair, w) in w.iter().enumerate() {
                    let tt = t + 2 * pair;
                    let scales = load(tile.add(Q6K_SCALES + 64 * (2 * h + tt / 2)));
                    // Bytes 2t and 2t + 1 of the dword, sign-extended, as f32 (exact).
                    let signed_byte = |byte: usize| {
                        let shifted = _mm512_sllv_epi32(scales, _mm512_set1_epi32(24 - 8 * byte as i32));
                        _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(shifted))
                    };
                    let (sc_lo, sc_hi) = (signed_byte(2 * t), signed_byte(2 * t + 1));
                    let u = 8 * sb + 4 * h + tt;
                    for (r, lanes) in acc.iter_mut().enumerate() {
                        let offset = |h: usize| _mm512_set1_epi32(32 * pass.half(r, u, h));
                        let lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot(pass, r, u, &w[..4], 0), offset(0)));
                        let hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot(pass, r, u, &w[4..], 4), offset(1)));
                        // sc_lo · lo + sc_hi · hi in f32 is the integer sum exactly: each
                        // product is below 2^23 and the sum below 2^24.
                        let c = _mm512_fmadd_ps(sc_lo, lo, _mm512_mul_ps(sc_hi, hi));
                        step(&mut lanes[u % LANES], d, pass.d(r, u), c);
                    }
                }
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
            let lane = &mut lanes[u % LANES];
            let mut c = dot(pass, r, u, &w, 0);
            if Q5 {
                c = _mm512_sub_epi32(c, _mm512_set1_epi32(16 * pass.sum(r, u)));
            }
            let dr = pass.d(r, u);
            step(lane, d, dr, _mm512_cvtepi32_ps(c));
            if !Q5 {
                step(lane, m, dr, _mm512_set1_ps(pass.sum(r, u) as f32));
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
            step(&mut lanes[u % LANES], d, pass.d(r, u), _mm512_cvtepi32_ps(c));
        }
    }

    /// Rows `pass.first..pass.first + R` against one group: every tile in order, then each
    /// row's butterfly, into `out[r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn group<const R: usize>(
        layout: Layout,
        group: *const u8,
        blocks: usize,
        pass: &Pass,
        out: &mut [[f32; 16]],
    ) {
        let mut acc: Lanes<R> = [[_mm512_setzero_ps(); LANES]; R];
        for b in 0..blocks {
            let tile = group.add(b * layout.tile_bytes());
            if R <= PREFETCH_ROWS_MAX {
                // A group's tiles are one run of bytes; at few rows the kernel reads them
                // faster than the hardware prefetcher alone brings them (past the group's end
                // this asks for the next group's, or for nothing: a prefetch never faults).
                for line in (0..layout.tile_bytes()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(tile.wrapping_add(PREFETCH_AHEAD + line) as *const i8);
                }
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
            // The xor butterfly: after offset `off`, lane l < off holds lane l + lane l + off
            // (lanes l ≥ off would hold the same sums, commuted; nothing reads them).
            for off in BUTTERFLY {
                for l in 0..off {
                    lanes[l] = _mm512_add_ps(lanes[l], lanes[l + off]);
                }
            }
            _mm512_storeu_ps(out.as_mut_ptr(), lanes[0]);
        }
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
}

/// The AVX2 tier of the same kernels: a group's sixteen columns as two halves of eight (the low
/// and high 32 bytes of each of the tile's 64-byte vectors), each half a pass over the group's
/// tiles (in L2 by then) with eight columns in a vector. `vpdpbusd`'s sums are `maddubs` then
/// `madd` with ones, which equals it wherever no pair of products leaves i16: weights below 64
/// against |q| ≤ 127 cannot; Q8_0's signed weights go in as `|w|` against `q · sign(w)`.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{GroupOut, Layout, Pass, PACK_COLS, Q6K_QH, Q6K_SCALES};
    use crate::kernels::canonical::{BUTTERFLY, LANES};
    use candle_core::quantized::GgmlDType;

    /// Each row's 32 lane accumulators, eight columns a vector.
    type Lanes<const R: usize> = [[__m256; LANES]; R];

    #[inline(always)]
    unsafe fn step(acc: &mut __m256, coef: __m256, d: f32, c: __m256) {
        *acc = _mm256_fmadd_ps(_mm256_mul_ps(coef, _mm256_set1_ps(d)), c, *acc);
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
                (
                    _mm256_or_si256(_mm256_and_si256(lo, m15), high(a)),
                    _mm256_or_si256(_mm256_srli_epi32::<4>(lo), high(b)),
                )
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
                    let lane = &mut lanes[u % LANES];
                    let c = _mm256_mul_ps(_mm256_cvtepi32_ps(dot(pass, r, u, w, 0)), sc);
                    let dr = pass.d(r, u);
                    step(lane, d, dr, c);
                    step(lane, neg_dmin, dr, _mm256_mul_ps(mn, _mm256_set1_ps(pass.sum(r, u) as f32)));
                }
            }
        }
    }

    /// [`super::avx512`]'s Q6_K, eight columns a vector.
    #[inline(always)]
    unsafe fn q6k<const R: usize>(tile: *const u8, sb: usize, h8: usize, pass: &Pass, acc: &mut Lanes<R>) {
        let d = halves_f32(tile.add(super::Q6K_TILE.d_at()), h8);
        let (low4, bits45) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        for h in 0..2 {
            for t in 0..2 {
                let mut w = [[_mm256_setzero_si256(); 8]; 2];
                for i in 0..8 {
                    let ql = load(tile.add(64 * (16 * h + 8 * t + i)), h8);
                    let qh = load(tile.add(Q6K_QH + 64 * (8 * h + i)), h8);
                    let (high_t, high_t2) = if t == 0 {
                        (_mm256_slli_epi16::<4>(qh), qh)
                    } else {
                        (_mm256_slli_epi16::<2>(qh), _mm256_srli_epi16::<2>(qh))
                    };
                    let six = |ql: __m256i, high: __m256i| {
                        _mm256_or_si256(_mm256_and_si256(ql, low4), _mm256_and_si256(high, bits45))
                    };
                    w[0][i] = six(ql, high_t);
                    w[1][i] = six(_mm256_srli_epi16::<4>(ql), high_t2);
                }
                for (pair, w) in w.iter().enumerate() {
                    let tt = t + 2 * pair;
                    let scales = load(tile.add(Q6K_SCALES + 64 * (2 * h + tt / 2)), h8);
                    let signed_byte = |byte: usize| {
                        let shifted = _mm256_sllv_epi32(scales, _mm256_set1_epi32(24 - 8 * byte as i32));
                        _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(shifted))
                    };
                    let (sc_lo, sc_hi) = (signed_byte(2 * t), signed_byte(2 * t + 1));
                    let u = 8 * sb + 4 * h + tt;
                    for (r, lanes) in acc.iter_mut().enumerate() {
                        let offset = |h: usize| _mm256_set1_epi32(32 * pass.half(r, u, h));
                        let lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot(pass, r, u, &w[..4], 0), offset(0)));
                        let hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot(pass, r, u, &w[4..], 4), offset(1)));
                        let c = _mm256_fmadd_ps(sc_lo, lo, _mm256_mul_ps(sc_hi, hi));
                        step(&mut lanes[u % LANES], d, pass.d(r, u), c);
                    }
                }
            }
        }
    }

    /// [`super::avx512`]'s Q4_1 and Q5_0; Q5_0's lane masks become byte masks (bit `b` of the
    /// 64-bit mask is byte `b` of the 64-byte vector).
    #[inline(always)]
    unsafe fn q32<const R: usize, const Q5: bool>(
        tile: *const u8,
        u: usize,
        h: usize,
        pass: &Pass,
        acc: &mut Lanes<R>,
    ) {
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
            let lane = &mut lanes[u % LANES];
            let mut c = dot(pass, r, u, &w, 0);
            if Q5 {
                c = _mm256_sub_epi32(c, _mm256_set1_epi32(16 * pass.sum(r, u)));
            }
            let dr = pass.d(r, u);
            step(lane, d, dr, _mm256_cvtepi32_ps(c));
            if !Q5 {
                step(lane, m, dr, _mm256_set1_ps(pass.sum(r, u) as f32));
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
            step(&mut lanes[u % LANES], d, pass.d(r, u), _mm256_cvtepi32_ps(c));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const R: usize>(layout: Layout, tiles: *const u8, blocks: usize, pass: &Pass, out: &mut GroupOut) {
        for h in 0..2 {
            let mut acc: Lanes<R> = [[_mm256_setzero_ps(); LANES]; R];
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
                for off in BUTTERFLY {
                    for l in 0..off {
                        lanes[l] = _mm256_add_ps(lanes[l], lanes[l + off]);
                    }
                }
                _mm256_storeu_ps(out[8 * h..].as_mut_ptr(), lanes[0]);
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::canonical;
    use candle_core::{Device, Tensor};

    const DTYPES: [GgmlDType; 5] = [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0];

    fn noise(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        }
    }

    fn weights(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
        let mut next = noise(seed);
        let vals: Vec<f32> = (0..n * k).map(|_| next() * 0.2).collect();
        QTensor::quantize(&Tensor::from_vec(vals, (n, k), &Device::Cpu).unwrap(), dtype).unwrap()
    }

    /// Every byte random except the f16 fields, which get finite values of both signs: every
    /// bit pattern of the integer parts (Q4_K's 6-bit scales, Q6_K's negative scales).
    fn random_bytes(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
        let layout = Layout::of(dtype).unwrap();
        let mut s = seed;
        let mut byte = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        };
        let blocks = n * k / (UNIT * layout.units_per_block);
        let mut bytes: Vec<u8> = (0..blocks * layout.block_bytes).map(|_| byte()).collect();
        let f16s: &[usize] = match dtype {
            GgmlDType::Q4K => &[0, 2],
            GgmlDType::Q6K => &[208],
            GgmlDType::Q4_1 => &[0, 2],
            _ => &[0],
        };
        for b in bytes.chunks_exact_mut(layout.block_bytes) {
            for &at in f16s {
                let v = half::f16::from_f32((byte() as f32 - 127.5) / 4096.0);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &Device::Cpu, dtype).unwrap();
        QTensor::new(storage, (n, k)).unwrap()
    }

    #[test]
    fn pack_then_unpack_restores_every_byte() {
        for dtype in DTYPES {
            let w = random_bytes(dtype, 32, 512, 3);
            let packed = pack(&w).unwrap().unwrap();
            assert_eq!(packed.data().unwrap().len(), w.data().unwrap().len());
            assert_ne!(packed.data().unwrap(), w.data().unwrap(), "{dtype:?}: packing moved nothing");
            assert_eq!(unpack(&packed).unwrap().data().unwrap(), w.data().unwrap(), "{dtype:?}");
        }
    }

    #[test]
    fn packed_kernel_gives_the_scalar_definitions_bits() {
        for dtype in DTYPES {
            for (n, k) in [(16, 256), (48, 768), (32, 1536)] {
                for (wi, w) in [weights(dtype, n, k, 11), random_bytes(dtype, n, k, 12)].into_iter().enumerate() {
                    let packed = pack(&w).unwrap().unwrap();
                    let mut next = noise(k as u64);
                    for m in [1, 2, 3, 7, 8, 9, 17] {
                        let x: Vec<f32> = (0..m * k)
                            .map(|i| {
                                if i % 53 == 7 {
                                    0.0
                                } else if i % 101 == 3 {
                                    40.0 * next()
                                } else {
                                    next()
                                }
                            })
                            .collect();
                        let want = canonical::matmul(&w, &x, m).unwrap();
                        for isa in crate::kernels::Isa::available() {
                            let mut got = vec![0f32; m * n];
                            matmul_packed_on(isa, &packed, &x, m, &mut got).unwrap();
                            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "{dtype:?} [{n}, {k}] weights {wi} m {m} tier {isa:?}: output {i} is {a}, the definition {b}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rows_sums_match_the_quantized_values() {
        let mut next = noise(5);
        let x: Vec<f32> = (0..2 * 64).map(|_| next()).collect();
        let rows = Rows::new(&x, 2, 64);
        let qa = quantize_rows(&x, 2, 64);
        for u in 0..4 {
            let q = &qa.q[u * 32..][..32];
            let lo: i32 = q[..16].iter().map(|&v| v as i32).sum();
            let hi: i32 = q[16..].iter().map(|&v| v as i32).sum();
            assert_eq!((rows.halves[2 * u], rows.halves[2 * u + 1], rows.sum[u]), (lo, hi, lo + hi));
        }
    }
}
