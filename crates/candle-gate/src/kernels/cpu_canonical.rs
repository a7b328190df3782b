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
//! ([`super::cpu::pack`]); Q6_K and Q8_0 get tiles of their own here (the `invariant` mode packs
//! Q6_K in these too), each sixteen columns' block `b` with its bytes transposed a dword at a
//! time (vector `slot(t)`, lane `c`: column `c`'s dword `t`; Q6_K's [`q6k_slot`] puts them in
//! the order its `invariant` kernel reads) and the sixteen f16 scales `d` as one vector. A pack
//! only permutes bytes: the size is the GGUF size and [`unpack`] restores it exactly.

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
    /// `x` (`m` rows of `k`) quantized by the scalar definition ([`quantize_rows`]).
    pub fn new(x: &[f32], m: usize, k: usize) -> Rows {
        Rows::new_on(super::Isa::Portable, x, m, k)
    }

    /// [`Rows::new`] on kernel tier `isa`: with AVX-512, sixteen values a vector, the same bits
    /// (every step is one IEEE operation, or a max, which is exact; tested).
    pub fn new_on(isa: super::Isa, x: &[f32], m: usize, k: usize) -> Rows {
        #[cfg(target_arch = "x86_64")]
        if isa == super::Isa::Avx512 && isa <= super::Isa::best() && x.len() == m * k && k.is_multiple_of(UNIT) {
            let units = m * k / UNIT;
            let mut rows =
                Rows { q: vec![0; m * k], d: vec![0.0; units], sum: vec![0; units], halves: vec![0; 2 * units], k };
            // SAFETY: the AVX-512 tier was checked at run time; every slice holds `units` units.
            unsafe { avx512::quantize_units(x, &mut rows.q, &mut rows.d, &mut rows.sum, &mut rows.halves) };
            return rows;
        }
        let _ = isa;
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
/// many, which vector of the tile holds each, where its f16 `d` lies, and whether the tile puts
/// the `d` vector first.
struct DwordTile {
    body: usize,
    words: usize,
    slot: fn(usize) -> usize,
    f16_at: usize,
    d_first: bool,
}

const Q6K_TILE: DwordTile = DwordTile {
    body: 0,
    words: super::cpu_kquant::Q6K_WORDS,
    slot: q6k_slot,
    f16_at: 4 * super::cpu_kquant::Q6K_WORDS,
    d_first: false,
};
const Q8_0_TILE: DwordTile = DwordTile { body: 2, words: 8, slot: |word| word, f16_at: 0, d_first: true };

/// The vector of a Q6_K tile that holds the block's dword `word` (its `ql` are dwords 0..32,
/// `qh` 32..48, the scales 48..52): the scales first, then for each 16-weight half `half` of
/// each 128-weight chunk `n` four dwords of `ql`'s low nibbles (`ql[64n + 16half..]`), four
/// of its high nibbles (`ql[64n + 32 + 16half..]`) and four of `qh` (`qh[32n + 16half..]`).
/// That is the order the `invariant` kernel needs them in, so it reads a tile from its start
/// to its end: any other order (the GGUF block's, which this was) left the hardware
/// prefetchers behind, and the tiles streamed from memory at a third of the rate.
pub(crate) const fn q6k_slot(word: usize) -> usize {
    let (part, four) = match word {
        0..32 => {
            let (n, r) = (word / 16, word % 16);
            (2 * n + (r % 8) / 4, 4 * (r / 8) + r % 4)
        }
        32..48 => {
            let v = word - 32;
            (2 * (v / 8) + (v % 8) / 4, 8 + v % 4)
        }
        _ => return word - 48,
    };
    4 + 12 * part + four
}

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
                let words = (0..tile.words).map(|word| {
                    (plain + tile.body + 4 * word, t + tile.words_at() + 64 * (tile.slot)(word) + 4 * c, 4)
                });
                for (p, q, len) in words.chain([(plain + tile.f16_at, t + tile.d_at() + 2 * c, 2)]) {
                    let (from, to) = if pack { (p, q) } else { (q, p) };
                    d[to..to + len].copy_from_slice(&s[from..from + len]);
                }
            }
        }
    }
    out
}

/// Q6_K blocks (`n` columns of `kb`) packed in this file's tiles, unpacked: the GGUF layout
/// that the `invariant` kernels' other tiers read (the two modes share the Q6_K tiles).
pub(crate) fn unpack_q6k(
    packed: &[candle_core::quantized::k_quants::BlockQ6K],
    n: usize,
    kb: usize,
) -> Vec<candle_core::quantized::k_quants::BlockQ6K> {
    use candle_core::quantized::k_quants::BlockQ6K;
    let layout = Layout::of(GgmlDType::Q6K).expect("a tile layout");
    assert_eq!(packed.len(), n * kb);
    // SAFETY: Candle's `BlockQ6K` is `#[repr(C)]` plain bytes, `block_bytes` long.
    let bytes = unsafe { std::slice::from_raw_parts(packed.as_ptr() as *const u8, std::mem::size_of_val(packed)) };
    let plain = permute_dwords(bytes, layout, kb, false);
    let mut out: Vec<BlockQ6K> = Vec::with_capacity(packed.len());
    // SAFETY: `plain` holds exactly `packed.len()` blocks' bytes; any bytes are a valid block.
    unsafe {
        std::ptr::copy_nonoverlapping(plain.as_ptr(), out.as_mut_ptr() as *mut u8, plain.len());
        out.set_len(packed.len());
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
        let rows = Rows::new_on(isa, x, m, k);
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
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;

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
    fn vector_quantization_gives_the_scalar_definitions_bits() {
        let mut next = noise(9);
        let k = 32 * 9;
        let mut x: Vec<f32> = (0..3 * k).map(|_| next() * 8.0).collect();
        // Units of zeros, of signed zeros and subnormals, a huge value, infinities, NaN, and
        // exact ties of x · (1/d).
        x[..32].fill(0.0);
        x[32..64].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 1e-42 });
        x[70] = 3.0e38;
        x[100] = f32::INFINITY;
        x[130] = f32::NEG_INFINITY;
        x[160] = f32::NAN;
        x[192..224].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.5);
        x[200] = 127.0 * 0.5;
        for isa in crate::kernels::Isa::available() {
            let (a, b) = (Rows::new(&x, 3, k), Rows::new_on(isa, &x, 3, k));
            assert_eq!(a.q, b.q, "{isa:?}");
            assert_eq!(
                a.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{isa:?}"
            );
            assert_eq!((&a.sum, &a.halves), (&b.sum, &b.halves), "{isa:?}");
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
