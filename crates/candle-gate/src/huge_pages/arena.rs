//! One model's weights side by side in memory mapped for huge pages.
//!
//! [`super::advise`] can only give huge pages to the whole, aligned 2 MB pages inside one
//! weight's own allocation: none inside a weight under 2 MB, and at best two of a 3 MB one. A
//! small model's matrices are all that small (SmolLM2's are 0.1-0.7 MB), and a 0.5B model's are
//! 0.1-3 MB, so most of their bytes stayed on 4 KB pages (Qwen2.5 0.5B: 200 of its 400 MB
//! huge), where a decode step's stream stops at every page. A [`WeightArena`] copies each
//! weight into chunks mapped 2 MB-aligned and advised huge before their first byte is written,
//! so every page they fault in can be huge. The bytes are the same; only where they live moves.

use std::sync::{Arc, Mutex};

use candle_core::quantized::k_quants::*;
use candle_core::quantized::{GgmlDType, QStorage, QTensor, QuantizedType};
use candle_core::{CpuStorage, Result};
use half::{bf16, f16};

/// What a new chunk maps when a weight fits in it (a weight of this size or more gets a chunk
/// of its own). Only the pages written are backed, so a chunk's unused tail costs address
/// space alone. (Smaller in tests, so that a test's weight can exceed it.)
const CHUNK_BYTES: usize = if cfg!(test) { 8 << 20 } else { 64 << 20 };
const HUGE: usize = 2 << 20;
/// Where each weight starts in a chunk: a cache line, as the kernels' tiles assume nothing more.
const ALIGN: usize = 64;

/// Anonymous memory mapped 2 MB-aligned, advised huge; unmapped when the last weight in it is
/// dropped.
struct Chunk {
    base: *mut u8,
    len: usize,
}

// SAFETY: a chunk is plain memory; the weights placed in it own disjoint ranges.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `bytes` (rounded up to 2 MB), or `None` where the mapping fails.
    fn map(bytes: usize) -> Option<Chunk> {
        let len = bytes.next_multiple_of(HUGE);
        // SAFETY: a fresh private anonymous mapping, trimmed to its 2 MB-aligned part; nothing
        // else refers to the ranges unmapped.
        unsafe {
            // One huge page more than needed, so that an aligned start lies inside.
            let raw = libc::mmap(
                std::ptr::null_mut(),
                len + HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if raw == libc::MAP_FAILED {
                return None;
            }
            let start = (raw as usize).next_multiple_of(HUGE);
            let head = start - raw as usize;
            if head > 0 {
                libc::munmap(raw, head);
            }
            if HUGE - head > 0 {
                libc::munmap((start + len) as *mut libc::c_void, HUGE - head);
            }
            // Before any write: each page faulted in from now on can be a huge one.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            Some(Chunk { base: start as *mut u8, len })
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, which no weight refers to any more.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Places weights one after another in huge-page chunks (see the module's docs). Each placed
/// weight keeps its chunk alive; the arena itself may be dropped once a model is loaded.
#[derive(Default)]
pub struct WeightArena {
    /// The chunk being filled and the bytes of it in use.
    filling: Mutex<Option<(Arc<Chunk>, usize)>>,
}

impl WeightArena {
    pub fn new() -> WeightArena {
        WeightArena::default()
    }

    /// Room for `bytes`: the chunk and where in it.
    fn room(&self, bytes: usize) -> Option<(Arc<Chunk>, *mut u8)> {
        if bytes >= CHUNK_BYTES {
            let chunk = Arc::new(Chunk::map(bytes)?);
            let at = chunk.base;
            return Some((chunk, at));
        }
        let mut filling = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        let fits = filling.as_ref().is_some_and(|(c, used)| used + bytes <= c.len);
        if !fits {
            *filling = Some((Arc::new(Chunk::map(CHUNK_BYTES)?), 0));
        }
        let (chunk, used) = filling.as_mut()?;
        // SAFETY: `used + bytes <= chunk.len` (checked, or a fresh chunk of CHUNK_BYTES).
        let at = unsafe { chunk.base.add(*used) };
        *used = (*used + bytes).next_multiple_of(ALIGN);
        Some((chunk.clone(), at))
    }

    /// `w` copied into the arena: the same dtype, shape and bytes. A weight not on the CPU,
    /// or a host that will not map a chunk, or `CANDLE_GATE_HUGE_PAGES=0`, keeps `w` as it is.
    pub fn place(&self, w: &QTensor) -> Result<Option<QTensor>> {
        if !w.device().is_cpu() || !super::enabled() {
            return Ok(None);
        }
        let data = w.data()?;
        let Some((chunk, at)) = self.room(data.len()) else { return Ok(None) };
        // SAFETY: `room` gave `data.len()` bytes of the chunk to this weight alone.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        let blocks = Placed { chunk, at, bytes: data.len() };
        let storage: Box<dyn QuantizedType> = match w.dtype() {
            GgmlDType::F32 => Box::new(blocks.typed::<f32>()),
            GgmlDType::F16 => Box::new(blocks.typed::<f16>()),
            GgmlDType::BF16 => Box::new(blocks.typed::<bf16>()),
            GgmlDType::Q4_0 => Box::new(blocks.typed::<BlockQ4_0>()),
            GgmlDType::Q4_1 => Box::new(blocks.typed::<BlockQ4_1>()),
            GgmlDType::Q5_0 => Box::new(blocks.typed::<BlockQ5_0>()),
            GgmlDType::Q5_1 => Box::new(blocks.typed::<BlockQ5_1>()),
            GgmlDType::Q8_0 => Box::new(blocks.typed::<BlockQ8_0>()),
            GgmlDType::Q8_1 => Box::new(blocks.typed::<BlockQ8_1>()),
            GgmlDType::Q2K => Box::new(blocks.typed::<BlockQ2K>()),
            GgmlDType::Q3K => Box::new(blocks.typed::<BlockQ3K>()),
            GgmlDType::Q4K => Box::new(blocks.typed::<BlockQ4K>()),
            GgmlDType::Q5K => Box::new(blocks.typed::<BlockQ5K>()),
            GgmlDType::Q6K => Box::new(blocks.typed::<BlockQ6K>()),
            GgmlDType::Q8K => Box::new(blocks.typed::<BlockQ8K>()),
        };
        Ok(Some(QTensor::new(QStorage::Cpu(storage), w.shape().clone())?))
    }
}

/// A weight's bytes in a chunk, before they are given a block type.
struct Placed {
    chunk: Arc<Chunk>,
    at: *mut u8,
    bytes: usize,
}

impl Placed {
    fn typed<T: GgmlType>(self) -> ArenaBlocks<T> {
        debug_assert!(self.bytes.is_multiple_of(std::mem::size_of::<T>()));
        debug_assert!((self.at as usize).is_multiple_of(std::mem::align_of::<T>()));
        ArenaBlocks { blocks: self.at as *mut T, len: self.bytes / std::mem::size_of::<T>(), _chunk: self.chunk }
    }
}

/// Candle's storage for a quantized tensor whose blocks lie in a [`WeightArena`] chunk: what
/// `Vec<T>` does as Candle's own storage, over the chunk's range.
struct ArenaBlocks<T> {
    blocks: *mut T,
    len: usize,
    _chunk: Arc<Chunk>,
}

// SAFETY: the blocks are owned by this storage alone (its range of the chunk), as a `Vec<T>`'s.
unsafe impl<T: Send> Send for ArenaBlocks<T> {}
unsafe impl<T: Sync> Sync for ArenaBlocks<T> {}

impl<T: GgmlType> ArenaBlocks<T> {
    fn slice(&self) -> &[T] {
        // SAFETY: `len` initialized blocks (copied in `place`) in a live chunk.
        unsafe { std::slice::from_raw_parts(self.blocks, self.len) }
    }

    fn slice_mut(&mut self) -> &mut [T] {
        // SAFETY: as `slice`, and `&mut self` is the only way to this range.
        unsafe { std::slice::from_raw_parts_mut(self.blocks, self.len) }
    }
}

impl<T: GgmlType + Send + Sync> QuantizedType for ArenaBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }

    fn matmul_t(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> Result<()> {
        candle_core::quantized::k_quants::matmul(mkn, lhs, self.slice(), dst)
    }

    fn matmul_t_f16(&self, mkn: (usize, usize, usize), lhs: &[f16], dst: &mut [f16]) -> Result<()> {
        candle_core::quantized::k_quants::matmul_f16(mkn, lhs, self.slice(), dst)
    }

    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> Result<CpuStorage> {
        if !hidden.is_multiple_of(T::BLCK_SIZE) || self.len != rows * (hidden / T::BLCK_SIZE) {
            candle_core::bail!("quantized embedding: {} blocks are not {rows} rows of {hidden}", self.len)
        }
        let row_blocks = hidden / T::BLCK_SIZE;
        let mut out = vec![0f32; ids.len() * hidden];
        for (dst, &id) in out.chunks_exact_mut(hidden).zip(ids) {
            let row = id as usize;
            if row >= rows {
                candle_core::bail!("embedding id {row} is out of range for {rows} rows")
            }
            T::to_float(&self.slice()[row * row_blocks..(row + 1) * row_blocks], dst);
        }
        Ok(CpuStorage::F32(out))
    }

    fn dequantize(&self, elem_count: usize) -> Result<CpuStorage> {
        let mut ys = vec![0f32; elem_count];
        T::to_float(self.slice(), &mut ys);
        Ok(CpuStorage::F32(ys))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    fn as_ptr(&self) -> *const u8 {
        self.blocks as *const u8
    }

    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }

    fn from_float(&mut self, xs: &[f32]) {
        T::from_float(xs, self.slice_mut())
    }

    fn from_float_imatrix(&mut self, xs: &[f32], imatrix_weights: &[f32], n_per_row: usize) {
        T::from_float_imatrix(xs, self.slice_mut(), imatrix_weights, n_per_row)
    }

    fn size(&self) -> usize {
        self.storage_size_in_bytes()
    }
}
