//! The paged KV cache: a pool of fixed-size blocks of positions, and per sequence a block
//! table ([`KvCache`]) into it.
//!
//! A block holds [`KV_BLOCK`] positions of every layer's keys and values as regions, one per
//! (layer, K or V, KV head), each in the layout the attention kernel ([`crate::attention`])
//! reads: keys transposed (`[head_dim][KV_BLOCK]`: eight positions side by side in one
//! register's lanes) and values row-major (`[KV_BLOCK][head_dim]`). The pool stores region `r`
//! of all its blocks side by side (block `i`'s at `r · stride + i · region_bytes`), so the keys
//! of one layer and head of consecutive blocks are one contiguous stream: what a decode step
//! reads, layer by layer, from memory. Blocks are reference counted: a
//! [`KvCache`] clone shares them read-only (the `n` choices of one prompt, and later prefix
//! hits), and the first write to a shared block copies it (copy on write), so a write never
//! reaches a block another sequence reads.
//!
//! Where a value lives never enters the arithmetic: the kernel reads a sequence's positions in
//! order through its block table, so a sequence's bits do not depend on which blocks it got.

use std::sync::{Arc, Mutex};

use half::f16;

use crate::error::{Error, Result};
/// Positions per block: the prefix cache's unit of sharing, which the pool allocates in.
pub use crate::prefix_cache::KV_BLOCK;
use crate::prefix_cache::{chain_hash, HashFn, Hit, PrefixIndex};

/// How K/V values are stored. Rounding to f16 is round-to-nearest-even, the same on every host;
/// the attention kernel widens them exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub const ALL: [KvDtype; 2] = [KvDtype::F16, KvDtype::F32];
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| Error::invalid("kv_dtype", format!("unknown kv_dtype {s:?}; expected f16 or f32")))
    }
}

/// Where things are inside a block, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl BlockLayout {
    fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    /// Regions in a block: one per (layer, K or V, KV head).
    pub fn regions(&self) -> usize {
        self.n_layer * 2 * self.n_kv_head
    }
    /// Bytes of one region: `head_dim × KV_BLOCK` values.
    pub fn region_bytes(&self) -> usize {
        self.head_dim * KV_BLOCK * self.dtype.size()
    }
    pub fn block_bytes(&self) -> usize {
        self.regions() * self.region_bytes()
    }
    /// The region of `(layer, kv_head)`'s transposed keys (`[head_dim][KV_BLOCK]`) or, with
    /// `values`, its values (`[KV_BLOCK][head_dim]`).
    pub fn region(&self, layer: usize, kv_head: usize, values: bool) -> usize {
        (layer * 2 + values as usize) * self.n_kv_head + kv_head
    }
}

struct PoolInner {
    /// Storage, allocated zeroed (so untouched pages cost nothing); never moved once made.
    slabs: Vec<Box<[u64]>>,
    /// Each block's first region's first byte.
    ptrs: Vec<*mut u8>,
    refs: Vec<u32>,
    /// Free blocks; the next allocation takes the last.
    free: Vec<u32>,
    /// Full blocks registered for prefix hits; unreferenced ones are reused when `free` is
    /// empty, least recently released first.
    index: PrefixIndex,
}

/// A pool of KV blocks. A bounded pool (the engine's) allocates all of its memory when it is
/// made; an unbounded one (a cache made outside an engine) grows by slabs of blocks.
pub struct KvPool {
    layout: BlockLayout,
    max_blocks: Option<usize>,
    /// Blocks per slab: all of a bounded pool's, `GROWTH_BLOCKS` in an unbounded one.
    slab_blocks: usize,
    inner: Mutex<PoolInner>,
}

// SAFETY: the raw block pointers point into `slabs`, owned by the pool and never moved or freed
// before it; a block's bytes are written only through the one `KvCache` holding it with a
// reference count of 1 (`&mut` access), and read through `&KvCache`.
unsafe impl Send for KvPool {}
unsafe impl Sync for KvPool {}

/// Blocks an unbounded pool adds at a time.
const GROWTH_BLOCKS: usize = 64;

impl KvPool {
    /// A pool of exactly `blocks` blocks, allocated now.
    pub fn bounded(layout: BlockLayout, blocks: usize) -> Arc<Self> {
        let blocks = blocks.max(1);
        Self::bounded_with(layout, blocks, chain_hash)
    }
    /// [`KvPool::bounded`] whose prefix index chains block hashes with `hash_fn`.
    pub fn bounded_with(layout: BlockLayout, blocks: usize, hash_fn: HashFn) -> Arc<Self> {
        let blocks = blocks.max(1);
        let inner = Mutex::new(PoolInner::empty(hash_fn));
        let pool = KvPool { layout, max_blocks: Some(blocks), slab_blocks: blocks, inner };
        pool.lock().grow(&layout, blocks);
        Arc::new(pool)
    }
    /// A pool that grows as its caches do.
    pub fn unbounded(layout: BlockLayout) -> Arc<Self> {
        let inner = Mutex::new(PoolInner::empty(chain_hash));
        Arc::new(KvPool { layout, max_blocks: None, slab_blocks: GROWTH_BLOCKS, inner })
    }
    /// Bytes from one region of a block to the next region of the same block.
    pub fn stride(&self) -> usize {
        self.slab_blocks * self.layout.region_bytes()
    }
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// Blocks held by at least one cache.
    pub fn used_blocks(&self) -> usize {
        let g = self.lock();
        g.ptrs.len() - g.free.len() - g.index.evictable_len()
    }
    /// Blocks no cache holds that keep a cached prefix (reused when the free ones run out).
    pub fn cached_blocks(&self) -> usize {
        self.lock().index.evictable_len()
    }
    /// Blocks an allocation can take now: the free ones and the unreferenced cached ones
    /// (`None` for a pool that grows).
    pub fn available_blocks(&self) -> Option<usize> {
        let g = self.lock();
        self.max_blocks.map(|_| g.free.len() + g.index.evictable_len())
    }
    /// The pool's size in blocks (`None` for a pool that grows).
    pub fn max_blocks(&self) -> Option<usize> {
        self.max_blocks
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn alloc(&self) -> Result<(u32, *mut u8)> {
        let mut g = self.lock();
        let id = match g.free.pop() {
            Some(id) => id,
            None => match g.index.evict() {
                Some(id) => id,
                None => match self.max_blocks {
                    Some(n) => {
                        return Err(Error::Engine(format!(
                            "the KV pool is out of blocks ({n} of {KV_BLOCK} positions)"
                        )))
                    }
                    None => {
                        g.grow(&self.layout, self.slab_blocks);
                        g.free.pop().expect("a free block")
                    }
                },
            },
        };
        g.refs[id as usize] = 1;
        Ok((id, g.ptrs[id as usize]))
    }

    fn retain(&self, id: u32) {
        self.lock().retain(id);
    }

    fn release(&self, id: u32) {
        let mut g = self.lock();
        let r = &mut g.refs[id as usize];
        debug_assert!(*r > 0, "releasing a free block");
        *r -= 1;
        if *r == 0 && !g.index.released(id) {
            g.free.push(id);
        }
    }

    /// The chain hash of a whole block of `tokens` after the block hashed `parent` (the salt
    /// for the first block).
    pub fn hash_block(&self, parent: u64, tokens: &[u32]) -> u64 {
        (self.lock().index.hash_fn())(parent, tokens)
    }

    /// The longest run of cached blocks holding `tokens` from position 0, block by block
    /// (`hashes[b]` is block `b`'s chain hash): each hit's id, first byte and content serial.
    /// Each hit is retained for the caller.
    pub fn lookup(&self, hashes: &[u64], tokens: &[u32]) -> Vec<(u32, *mut u8, u64)> {
        let mut g = self.lock();
        let mut hits = Vec::new();
        let mut parent = 0;
        for (b, &hash) in hashes.iter().enumerate() {
            let Some(Hit { block, serial }) = g.index.find(hash, parent, &tokens[b * KV_BLOCK..(b + 1) * KV_BLOCK])
            else {
                break;
            };
            g.retain(block);
            hits.push((block, g.ptrs[block as usize], serial));
            parent = serial;
        }
        hits
    }

    /// Registers `block` as holding `tokens` (a whole block) after the content of serial
    /// `parent_serial`; returns the serial of that content (another block's, if one already
    /// holds it: that one stays the cached copy).
    pub fn register(&self, block: u32, hash: u64, parent_serial: u64, tokens: &[u32]) -> u64 {
        self.lock().index.register(block, hash, parent_serial, tokens)
    }

    /// Forgets every cached prefix: unreferenced cached blocks become free, held ones stay
    /// with their caches.
    pub fn reset_prefix_cache(&self) {
        let mut g = self.lock();
        let freed = g.index.clear();
        g.free.extend(freed);
    }

    fn refs(&self, id: u32) -> u32 {
        self.lock().refs[id as usize]
    }

    /// Shuffles the free list (a fixed permutation from `seed`), so that the next caches take
    /// blocks scattered over the pool: for tests that their bits do not depend on where.
    #[doc(hidden)]
    pub fn shuffle_free_list(&self, seed: u64) {
        let mut g = self.lock();
        let mut s = seed | 1;
        for i in (1..g.free.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let j = (s % (i as u64 + 1)) as usize;
            g.free.swap(i, j);
        }
    }
}

impl PoolInner {
    /// One more holder of block `id`: a cached block no cache held is no longer evictable.
    fn retain(&mut self, id: u32) {
        if self.refs[id as usize] == 0 {
            self.index.retained(id);
        }
        self.refs[id as usize] += 1;
    }

    fn empty(hash_fn: HashFn) -> Self {
        PoolInner {
            slabs: Vec::new(),
            ptrs: Vec::new(),
            refs: Vec::new(),
            free: Vec::new(),
            index: PrefixIndex::new(hash_fn),
        }
    }
    fn grow(&mut self, layout: &BlockLayout, blocks: usize) {
        // `vec![0; n]` asks for zeroed memory: the pages are mapped when first written.
        let mut slab = vec![0u64; (layout.block_bytes() * blocks).div_ceil(8)].into_boxed_slice();
        let base = slab.as_mut_ptr() as *mut u8;
        let first = self.ptrs.len();
        for b in 0..blocks {
            // SAFETY: inside the slab just made (region 0 of block b).
            self.ptrs.push(unsafe { base.add(b * layout.region_bytes()) });
            self.refs.push(0);
        }
        // Lower ids first out.
        self.free.extend((first..first + blocks).rev().map(|i| i as u32));
        self.slabs.push(slab);
    }
}

/// One sequence's K/V: its blocks in position order, and how many positions they hold.
pub struct KvCache {
    pool: Arc<KvPool>,
    blocks: Vec<(u32, *mut u8)>,
    len: usize,
}

// SAFETY: see `KvPool`; the pointers are into the pool this cache keeps alive.
unsafe impl Send for KvCache {}
unsafe impl Sync for KvCache {}

impl Clone for KvCache {
    /// A cache sharing every block of this one (read-only until either writes).
    fn clone(&self) -> Self {
        for &(id, _) in &self.blocks {
            self.pool.retain(id);
        }
        KvCache { pool: self.pool.clone(), blocks: self.blocks.clone(), len: self.len }
    }
}

impl Drop for KvCache {
    /// Last block first: a cached prefix's later blocks are then evicted before its earlier
    /// ones, which every longer hit needs.
    fn drop(&mut self) {
        for &(id, _) in self.blocks.iter().rev() {
            self.pool.release(id);
        }
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<u32> = self.blocks.iter().map(|b| b.0).collect();
        f.debug_struct("KvCache").field("len", &self.len).field("blocks", &ids).finish()
    }
}

impl KvCache {
    /// An empty cache in its own growing pool.
    pub fn new(layout: BlockLayout) -> Self {
        Self::in_pool(KvPool::unbounded(layout))
    }
    pub fn in_pool(pool: Arc<KvPool>) -> Self {
        KvCache { pool, blocks: Vec::new(), len: 0 }
    }
    /// A cache whose first positions are the whole blocks `hits` (from [`KvPool::lookup`],
    /// already retained for it), shared read-only.
    pub fn from_hits(pool: Arc<KvPool>, hits: &[(u32, *mut u8, u64)]) -> Self {
        KvCache { pool, blocks: hits.iter().map(|h| (h.0, h.1)).collect(), len: hits.len() * KV_BLOCK }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> KvDtype {
        self.pool.layout.dtype
    }
    pub fn layout(&self) -> &BlockLayout {
        &self.pool.layout
    }
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }
    /// The ids of this cache's blocks in position order.
    pub fn block_ids(&self) -> Vec<u32> {
        self.blocks.iter().map(|b| b.0).collect()
    }
    /// Each block's first region's first byte, in position order (for the attention kernel;
    /// region `r` is `r · KvPool::stride()` bytes further).
    pub(crate) fn block_ptrs(&self) -> impl Iterator<Item = *const u8> + '_ {
        self.blocks.iter().map(|b| b.1 as *const u8)
    }
    fn region_ptr(&self, b: usize, region: usize) -> *mut u8 {
        self.blocks[b].1.wrapping_add(region * self.pool.stride())
    }

    /// Blocks [`KvCache::extend`]`(n)` would take from the pool: new blocks, and a copy of a
    /// shared partial last block.
    pub fn blocks_to_extend(&self, n: usize) -> usize {
        let new = (self.len + n).div_ceil(KV_BLOCK).saturating_sub(self.blocks.len());
        let copy =
            n > 0 && !self.len.is_multiple_of(KV_BLOCK) && self.pool.refs(self.blocks[self.len / KV_BLOCK].0) > 1;
        new + copy as usize
    }

    /// Makes room for `n` more positions, every block they land in owned by this cache alone.
    /// Their values are undefined until written. On an error nothing changed.
    pub fn extend(&mut self, n: usize) -> Result<()> {
        let new_len = self.len + n;
        let need = new_len.div_ceil(KV_BLOCK);
        let mut added = 0;
        while self.blocks.len() < need {
            match self.pool.alloc() {
                Ok(b) => {
                    self.blocks.push(b);
                    added += 1;
                }
                Err(e) => {
                    for _ in 0..added {
                        let (id, _) = self.blocks.pop().unwrap();
                        self.pool.release(id);
                    }
                    return Err(e);
                }
            }
        }
        if n > 0 && !self.len.is_multiple_of(KV_BLOCK) {
            if let Err(e) = self.make_exclusive(self.len / KV_BLOCK) {
                for _ in 0..added {
                    let (id, _) = self.blocks.pop().unwrap();
                    self.pool.release(id);
                }
                return Err(e);
            }
        }
        self.len = new_len;
        Ok(())
    }

    /// Makes room for one more position (see [`KvCache::extend`]).
    pub fn push_empty(&mut self) -> Result<()> {
        self.extend(1)
    }

    /// Drops positions `len..` (used to roll back or repair); blocks no longer needed go back.
    pub fn truncate(&mut self, len: usize) {
        let keep = len.div_ceil(KV_BLOCK);
        while self.blocks.len() > keep {
            let (id, _) = self.blocks.pop().unwrap();
            self.pool.release(id);
        }
        self.len = self.len.min(len);
    }

    /// Block `b` owned by this cache alone, about to be written: copied first if another
    /// cache shares it; no longer a cached prefix if it was one (its bytes will change).
    fn make_exclusive(&mut self, b: usize) -> Result<()> {
        let (id, ptr) = self.blocks[b];
        if self.pool.refs(id) == 1 {
            self.pool.lock().index.unregister(id);
            return Ok(());
        }
        let (nid, nptr) = self.pool.alloc()?;
        let (stride, bytes) = (self.pool.stride(), self.pool.layout.region_bytes());
        for r in 0..self.pool.layout.regions() {
            // SAFETY: region r of two distinct blocks of the pool; the source is only read.
            unsafe { std::ptr::copy_nonoverlapping(ptr.add(r * stride) as *const u8, nptr.add(r * stride), bytes) };
        }
        self.pool.release(id);
        self.blocks[b] = (nid, nptr);
        Ok(())
    }

    /// Writes one position's K and V (`kv_dim` each, f32, rounded to the cache's dtype) in one
    /// layer; the position must exist. A shared block is copied first.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) -> Result<()> {
        assert!(pos < self.len, "write at position {pos} of a cache of {}", self.len);
        let lay = self.pool.layout;
        assert!(k.len() == lay.kv_dim() && v.len() == lay.kv_dim() && layer < lay.n_layer);
        let b = pos / KV_BLOCK;
        self.make_exclusive(b)?;
        let t = pos % KV_BLOCK;
        let hd = lay.head_dim;
        for h in 0..lay.n_kv_head {
            let (kr, vr) =
                (self.region_ptr(b, lay.region(layer, h, false)), self.region_ptr(b, lay.region(layer, h, true)));
            for d in 0..hd {
                // SAFETY: inside regions of this cache's exclusively held block.
                unsafe {
                    put(kr, lay.dtype, d * KV_BLOCK + t, k[h * hd + d]);
                    put(vr, lay.dtype, t * hd + d, v[h * hd + d]);
                }
            }
        }
        Ok(())
    }

    /// One position's K (or V, with `values`) in one layer as stored, widened to f32.
    pub fn read(&self, layer: usize, pos: usize, values: bool) -> Vec<f32> {
        assert!(pos < self.len, "read at position {pos} of a cache of {}", self.len);
        let lay = self.pool.layout;
        let (b, t, hd) = (pos / KV_BLOCK, pos % KV_BLOCK, lay.head_dim);
        let mut out = Vec::with_capacity(lay.kv_dim());
        for h in 0..lay.n_kv_head {
            let r = self.region_ptr(b, lay.region(layer, h, values)) as *const u8;
            for d in 0..hd {
                let at = if values { t * hd + d } else { d * KV_BLOCK + t };
                // SAFETY: inside a region of one of this cache's blocks.
                out.push(unsafe { get(r, lay.dtype, at) });
            }
        }
        out
    }

    /// Every position's K (or V) in one layer, `[position][kv_dim]` (for tests and checks).
    pub fn layer(&self, layer: usize, values: bool) -> Vec<f32> {
        (0..self.len).flat_map(|p| self.read(layer, p, values)).collect()
    }

    /// A copy of one position's K/V in every layer, to put back with [`KvCache::restore_position`].
    pub fn save_position(&self, pos: usize) -> SavedPosition {
        let n = self.pool.layout.n_layer;
        SavedPosition {
            pos,
            k: (0..n).map(|l| self.read(l, pos, false)).collect(),
            v: (0..n).map(|l| self.read(l, pos, true)).collect(),
        }
    }

    /// Puts back what [`KvCache::save_position`] saved (exactly: the values were widened from
    /// this dtype and round back to themselves).
    pub fn restore_position(&mut self, saved: SavedPosition) -> Result<()> {
        for (l, (k, v)) in saved.k.iter().zip(&saved.v).enumerate() {
            self.write(l, saved.pos, k, v)?;
        }
        Ok(())
    }
}

#[inline]
unsafe fn put(base: *mut u8, dtype: KvDtype, at: usize, x: f32) {
    match dtype {
        KvDtype::F16 => (base as *mut u16).add(at).write_unaligned(f16::from_f32(x).to_bits()),
        KvDtype::F32 => (base as *mut f32).add(at).write_unaligned(x),
    }
}

#[inline]
unsafe fn get(base: *const u8, dtype: KvDtype, at: usize) -> f32 {
    match dtype {
        KvDtype::F16 => f16::from_bits((base as *const u16).add(at).read_unaligned()).to_f32(),
        KvDtype::F32 => (base as *const f32).add(at).read_unaligned(),
    }
}

/// One position's K/V in every layer, saved by [`KvCache::save_position`].
pub struct SavedPosition {
    pos: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: KvDtype) -> BlockLayout {
        BlockLayout { n_layer: 2, n_kv_head: 2, head_dim: 8, dtype }
    }

    fn row(seed: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((seed * 31 + i * 7) % 97) as f32 * 0.25 - 12.0).collect()
    }

    #[test]
    fn writes_read_back_in_either_dtype() {
        for dtype in KvDtype::ALL {
            let mut c = KvCache::in_pool(KvPool::unbounded(layout(dtype)));
            c.extend(70).unwrap();
            for p in 0..70 {
                for l in 0..2 {
                    c.write(l, p, &row(p + l, 16), &row(p * 3 + l, 16)).unwrap();
                }
            }
            for p in 0..70 {
                assert_eq!(c.read(1, p, false), row(p + 1, 16));
                assert_eq!(c.read(0, p, true), row(p * 3, 16));
            }
            assert_eq!(c.block_ids().len(), 3);
        }
    }

    #[test]
    fn clones_share_blocks_and_copy_on_write() {
        let pool = KvPool::bounded(layout(KvDtype::F16), 8);
        let mut a = KvCache::in_pool(pool.clone());
        a.extend(40).unwrap();
        for p in 0..40 {
            a.write(0, p, &row(p, 16), &row(p, 16)).unwrap();
        }
        assert_eq!(pool.used_blocks(), 2);
        let mut b = a.clone();
        assert_eq!(pool.used_blocks(), 2, "a clone shares");
        // b's next position lands in the shared partial block: b gets its own copy.
        b.extend(1).unwrap();
        b.write(0, 40, &row(99, 16), &row(99, 16)).unwrap();
        assert_eq!(pool.used_blocks(), 3);
        assert_eq!(a.block_ids()[0], b.block_ids()[0], "the full block stays shared");
        assert_ne!(a.block_ids()[1], b.block_ids()[1]);
        // rewriting a shared position copies too, and a does not see it
        b.write(0, 3, &row(7, 16), &row(7, 16)).unwrap();
        assert_eq!(a.read(0, 3, false), row(3, 16));
        assert_eq!(b.read(0, 3, false), row(7, 16));
        assert_eq!(b.read(0, 39, false), row(39, 16));
        drop(a);
        drop(b);
        assert_eq!(pool.used_blocks(), 0);
    }

    /// Registers `c`'s whole blocks as the history `tokens`; returns their chain hashes.
    fn publish(pool: &KvPool, c: &KvCache, tokens: &[u32]) -> Vec<u64> {
        let (mut hashes, mut parent) = (Vec::new(), (1u64, 0u64));
        for (b, id) in c.block_ids().into_iter().enumerate().take(c.len() / KV_BLOCK) {
            let t = &tokens[b * KV_BLOCK..(b + 1) * KV_BLOCK];
            let h = pool.hash_block(parent.0, t);
            parent = (h, pool.register(id, h, parent.1, t));
            hashes.push(h);
        }
        hashes
    }

    #[test]
    fn cached_blocks_are_hits_until_evicted_least_recently_released_first() {
        let pool = KvPool::bounded(layout(KvDtype::F16), 4);
        let tokens: Vec<u32> = (0..3 * KV_BLOCK as u32).collect();
        let mut a = KvCache::in_pool(pool.clone());
        a.extend(3 * KV_BLOCK).unwrap();
        for p in 0..3 * KV_BLOCK {
            a.write(1, p, &row(p, 16), &row(p + 1, 16)).unwrap();
        }
        let hashes = publish(&pool, &a, &tokens);
        drop(a);
        assert_eq!((pool.used_blocks(), pool.cached_blocks(), pool.available_blocks()), (0, 3, Some(4)));
        // A hit retains the blocks and reads what was written.
        let hits = pool.lookup(&hashes[..2], &tokens[..2 * KV_BLOCK]);
        assert_eq!(hits.len(), 2);
        let b = KvCache::from_hits(pool.clone(), &hits);
        assert_eq!(b.read(1, 40, false), row(40, 16));
        assert_eq!((pool.used_blocks(), pool.cached_blocks()), (2, 1));
        // Another history's tokens miss.
        let other: Vec<u32> = tokens.iter().map(|t| t + 1).collect();
        assert!(pool.lookup(&hashes[..1], &other[..KV_BLOCK]).is_empty());
        let hits = |n: usize| KvCache::from_hits(pool.clone(), &pool.lookup(&hashes[..n], &tokens[..n * KV_BLOCK]));
        // Two allocations: the free block, then the only cached one no cache holds (the third).
        let mut c = KvCache::in_pool(pool.clone());
        c.extend(2 * KV_BLOCK).unwrap();
        assert_eq!(hits(3).len(), 2 * KV_BLOCK, "the third block was evicted");
        assert!(c.extend(KV_BLOCK).is_err(), "nothing left: b holds two, c two");
        drop(b);
        // Writing into a block this cache alone holds takes it out of the index.
        let mut d = hits(1);
        d.write(0, 3, &row(0, 16), &row(0, 16)).unwrap();
        drop(d);
        assert!(hits(1).is_empty());
        pool.reset_prefix_cache();
        assert_eq!(pool.cached_blocks(), 0);
    }

    #[test]
    fn a_full_pool_is_an_error_that_changes_nothing() {
        let pool = KvPool::bounded(layout(KvDtype::F32), 2);
        let mut a = KvCache::in_pool(pool.clone());
        a.extend(60).unwrap();
        let e = a.extend(10).unwrap_err();
        assert!(e.to_string().contains("out of blocks"), "{e}");
        assert_eq!((a.len(), a.block_ids().len(), pool.used_blocks()), (60, 2, 2));
        a.truncate(10);
        assert_eq!(pool.used_blocks(), 1);
    }
}
