//! Kernels, one file per backend as in Candle's own `quantized/{cpu,cuda,metal}.rs`; the
//! GPU backends are stubs unless their cargo feature is on.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod canonical;
pub mod canonical_emulate;
pub mod cpu;
pub mod cpu_canonical;
mod cpu_kquant;
mod cpu_q32;
mod cpu_q8_0;
pub mod cpu_split_k;
pub mod quantize;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;

#[cfg(feature = "metal")]
pub mod metal;
#[cfg(not(feature = "metal"))]
#[path = "dummy_metal.rs"]
pub mod metal;

use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::{quantized::QMatMul, Module, Tensor};
use rayon::prelude::*;

/// The lowercase GGML name used in profiles and messages (`q4_1`, `q8_0`, `q4k`, ...).
pub fn dtype_name(d: candle_core::quantized::GgmlDType) -> String {
    format!("{d:?}").to_lowercase()
}

/// The worker pool the CPU kernels split output columns over. Which pool (and how many threads)
/// never changes a result: every output element is computed whole by one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// rayon: the current rayon pool, so `Engine(threads=N)` applies; degrades gracefully when
    /// the machine is shared. The default.
    Rayon,
    /// Candle's own spinning barrier pool: lower wake-up cost on an idle machine, but spinning
    /// workers collapse when other processes compete for the cores.
    Candle,
}

static POOL: AtomicU8 = AtomicU8::new(u8::MAX);

/// The pool in use: set by [`set_pool`], else `CANDLE_GATE_POOL=candle|rayon`, else rayon.
pub fn pool() -> Pool {
    match POOL.load(Ordering::Relaxed) {
        0 => Pool::Rayon,
        1 => Pool::Candle,
        _ => {
            let p = match std::env::var("CANDLE_GATE_POOL").as_deref() {
                Ok("candle") => Pool::Candle,
                _ => Pool::Rayon,
            };
            set_pool(p);
            p
        }
    }
}

pub fn set_pool(p: Pool) {
    POOL.store(if p == Pool::Rayon { 0 } else { 1 }, Ordering::Relaxed);
}

/// The widest vector instructions the CPU kernels may pick at run time. Every tier gives the
/// same bits: integer block sums are exact whatever the width, and every float lane runs the
/// same operations in the same order, so a wider tier only computes more columns at once. The
/// tests force each tier on one host and compare (`tests/kernels.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Scalar code, and Candle's own block dot products where a kernel has no scalar form.
    Portable,
    /// AVX2 with FMA and F16C: every `x86-64-v3` host.
    Avx2,
    /// AVX-512 F/BW/VL with VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The widest tier this host runs.
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f")
                && has!("avx512bw")
                && has!("avx512vl")
                && has!("avx512vnni")
                && has!("avx2")
                && has!("fma")
                && has!("f16c")
            {
                return Isa::Avx512;
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every tier this host runs, narrowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= Isa::best()).collect()
    }
}

static ISA: AtomicU8 = AtomicU8::new(u8::MAX);

/// The tier in use: set by [`set_isa`], else `CANDLE_GATE_ISA=portable|avx2|avx512`, else
/// [`Isa::best`]; never wider than the host runs.
pub fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        0 => Isa::Portable,
        1 => Isa::Avx2,
        2 => Isa::Avx512,
        _ => {
            let wanted = match std::env::var("CANDLE_GATE_ISA").as_deref() {
                Ok("portable") => Isa::Portable,
                Ok("avx2") => Isa::Avx2,
                Ok("avx512") | Err(_) => Isa::Avx512,
                Ok(other) => {
                    eprintln!("candle-gate: CANDLE_GATE_ISA={other:?} is not portable, avx2 or avx512; using the widest tier this host runs");
                    Isa::Avx512
                }
            };
            set_isa(wanted)
        }
    }
}

/// Caps the kernels' tier at `wanted` (for tests and comparisons: every tier gives the same
/// bits); returns the tier in effect, which is narrower where the host lacks `wanted`.
pub fn set_isa(wanted: Isa) -> Isa {
    let isa = wanted.min(Isa::best());
    ISA.store(isa as u8, Ordering::Relaxed);
    isa
}

/// How far ahead of the block it reads a one-column loop asks for memory. On the 2-core EPYC
/// host, the 151936 × 896 Q8_0 output matrix of Qwen2.5 0.5B ran 1.5x faster at one row with
/// 4 KiB than with none (1 KiB: 1.3x; 8 KiB: 1.4x): the hardware prefetcher alone keeps too
/// few lines in flight for a GEMV. A prefetch is a hint: it changes no result.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 4096;

/// Asks for the cache lines of the `T` that lies [`PREFETCH_AHEAD`] bytes after `block`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(block: &T) {
    prefetch_at(block, PREFETCH_AHEAD)
}

/// Asks for the cache lines of the `T` that lies `distance` bytes after `block`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_at<T>(block: &T, distance: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(
        (block as *const T as *const u8).wrapping_add(distance),
        std::mem::size_of::<T>(),
    )
}

/// Asks for the cache lines of the `bytes` at `p`, into the cache level `HINT` names.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address (SSE is in the x86-64 baseline).
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.wrapping_add(off) as *const i8) };
    }
}

/// From how many rows a packed sixteen-column kernel asks for the tile [`TILE_PREFETCH_AHEAD`]
/// bytes ahead of the one it reads ([`prefetch_tile_ahead`]), on its first pass over a group
/// (a prefill's later passes find the group cached). With the weights in huge pages
/// (`huge_pages::WeightArena`), at eight rows the hardware prefetcher alone left a tile's
/// compute and its read from memory one after the other; at two and three rows `canonical`
/// decoded slower with a prefetch (docs/BENCHMARKS.md, "Weights in one huge-page arena").
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_ROWS: usize = 4;

/// How far ahead of the tile it reads a multi-row kernel asks for memory, into L2. Asked for
/// 4 KiB ahead into L1, `invariant`'s Q4_K and `canonical`'s Q6_K tiles read from memory slower
/// than with no prefetch; 16 KiB ahead into L2, every packed layout read faster (eight-stream
/// decode of Qwen 1.5B 1.23-1.37x in either mode, docs/BENCHMARKS.md). L2 holds the lines
/// ahead where L1, which also holds the pass's rows and sums, has little room.
#[cfg(target_arch = "x86_64")]
pub(crate) const TILE_PREFETCH_AHEAD: usize = 16 << 10;

/// Asks for the `bytes` of a tile that lie [`TILE_PREFETCH_AHEAD`] bytes after `tile`, into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_tile_ahead(tile: *const u8, bytes: usize) {
    prefetch_into_l2(tile.wrapping_add(TILE_PREFETCH_AHEAD), bytes)
}

/// How far ahead of what it reads a one-row pass over a packed group asks for memory, into L2
/// ([`prefetch_one_row_ahead`]): AVX2's packed Q4_K (four of a 2,304-byte tile's nine
/// segments) and Q4_1/Q5_0 (about three tiles of 320 or 352 bytes). One row computes so little per
/// byte that lines asked for [`TILE_PREFETCH_AHEAD`] ahead arrived no sooner than the hardware
/// prefetcher's; a few lines ahead keep the read in flight through each tile's arithmetic. Of
/// 512 bytes to 64 KiB tried on a Zen 2, 1 KiB read from memory fastest (docs/BENCHMARKS.md,
/// "One row of a packed group asks 1 KiB ahead").
#[cfg(target_arch = "x86_64")]
pub(crate) const ONE_ROW_AHEAD: usize = 1 << 10;

/// How far ahead of the tile it reads the AVX-512 packed Q4_1/Q5_0 kernel asks for memory below
/// [`PREFETCH_ROWS`] rows ([`prefetches_segments`]), into L2: about twelve of its 320- or
/// 352-byte tiles. Its groups are short (sixteen columns of Qwen 0.5B's k = 896 are 10 KB), so
/// lines [`TILE_PREFETCH_AHEAD`] ahead lie past much of a worker's share. On a Xeon, 4 KiB read
/// Qwen 0.5B's 4864 × 896 Q5_0 matrices from memory about 1.35x as fast at one and two rows;
/// 1 KiB gained nothing, 16 KiB less steadily (docs/BENCHMARKS.md, "Decode's segments asked
/// for ahead on the Xeon").
#[cfg(target_arch = "x86_64")]
pub(crate) const SHORT_GROUP_AHEAD: usize = 4 << 10;

/// Asks for the `bytes` that lie [`ONE_ROW_AHEAD`] bytes after `p`, into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_one_row_ahead(p: *const u8, bytes: usize) {
    prefetch_into_l2(p.wrapping_add(ONE_ROW_AHEAD), bytes)
}

/// Asks for the cache lines of the `bytes` at `p`, into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_into_l2(p: *const u8, bytes: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(p, bytes)
}

/// Whether a pass of `rows` rows over a packed group asks for its tiles ahead
/// ([`PREFETCH_ROWS`]): from that many rows, and only on the group's first pass.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetches_tiles(rows: usize, first_pass: bool) -> bool {
    first_pass && rows >= PREFETCH_ROWS
}

/// Whether a pass of `rows` rows over a packed AVX-512 group asks for what it reads ahead, below
/// [`PREFETCH_ROWS`], where [`prefetches_tiles`] does not: the K-quants each 256-byte segment
/// [`TILE_PREFETCH_AHEAD`] bytes ahead as they read it, Q4_1 and Q5_0 each tile
/// [`SHORT_GROUP_AHEAD`] ahead. On a Xeon (2 cores, 260 MiB of L3) the hardware prefetcher
/// alone left Qwen 1.5B's Q4_K and Q6_K matrices at one and two rows reading memory 1.3-1.6x
/// slower than with it; 2 KiB ahead gained less, 8 KiB about as much (docs/BENCHMARKS.md,
/// "Decode's segments asked for ahead on the Xeon").
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetches_segments(rows: usize, first_pass: bool) -> bool {
    first_pass && rows < PREFETCH_ROWS
}

/// Output pointer shared by workers that write disjoint elements of one output buffer.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Runs `run(task)` for every task in `0..total` on the chosen pool.
pub(crate) fn parallel_for(total: usize, run: impl Fn(usize) + Sync + Send) {
    if total <= 1 {
        (0..total).for_each(run);
        return;
    }
    match pool() {
        Pool::Rayon => (0..total).into_par_iter().for_each(run),
        Pool::Candle => candle_core::utils::barrier_pool().execute_chunked(total, |range| range.for_each(&run)),
    }
}

/// Row-split on a GPU: every row through Candle's own single-row (mat-vec) kernel. Shared by
/// the CUDA and Metal backends, whose single-row kernels Candle picks for one-row inputs.
#[allow(dead_code)]
pub(crate) fn row_split_via_candle(native: &QMatMul, xs2: &Tensor) -> candle_core::Result<Tensor> {
    let m = xs2.dim(0)?;
    let rows = (0..m).map(|r| native.forward(&xs2.narrow(0, r, 1)?)).collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&rows, 0)
}
