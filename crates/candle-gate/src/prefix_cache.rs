//! The prefix cache's index over KV blocks: which full blocks hold which token history, and
//! which unreferenced ones may be reused, least recently used first.
//!
//! A full block is found by a hash chained from its parent block's hash and its own token ids,
//! seeded by a salt that names everything else deciding its bits (model file, kernel policy,
//! K/V dtype). The hash only narrows the search: a hit also compares the block's token ids and
//! its parent's *serial*, the number given to each registered content when it was registered
//! and never reused. So a hit is a block whose whole token history equals the request's, even
//! when every hash collides (tested with [`colliding_hash`]).
//!
//! The index knows nothing of the blocks' bytes; the pool ([`crate::kv_cache::KvPool`]) calls it
//! when a block's reference count reaches or leaves zero and when it needs a block.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Positions per block: a cached prefix is shared in whole blocks of this many tokens.
pub const KV_BLOCK: usize = 32;

/// How a block's chain hash is made from its parent's and its token ids.
pub type HashFn = fn(u64, &[u32]) -> u64;

/// The default chain hash (SipHash, fixed keys: stable within a build, which is all an
/// in-memory index needs).
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// A hash under which every block collides: for tests that a collision cannot serve wrong K/V.
#[doc(hidden)]
pub fn colliding_hash(_parent: u64, _tokens: &[u32]) -> u64 {
    7
}

/// The salt that seeds a chain: everything besides the tokens that decides a block's bits.
pub fn salt(parts: &[&str]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// One registered block's identity.
struct Entry {
    hash: u64,
    parent_serial: u64,
    serial: u64,
    tokens: Box<[u32]>,
    /// Its place in `evictable` while no cache holds it.
    tick: Option<u64>,
}

/// A block found by [`PrefixIndex::find`]: its id, and the serial its children chain from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub block: u32,
    pub serial: u64,
}

pub(crate) struct PrefixIndex {
    hash_fn: HashFn,
    buckets: HashMap<u64, Vec<u32>>,
    entries: HashMap<u32, Entry>,
    /// Registered blocks no cache holds, by when they were released.
    evictable: BTreeMap<u64, u32>,
    next_serial: u64,
    next_tick: u64,
}

impl PrefixIndex {
    pub fn new(hash_fn: HashFn) -> Self {
        PrefixIndex {
            hash_fn,
            buckets: HashMap::new(),
            entries: HashMap::new(),
            evictable: BTreeMap::new(),
            next_serial: 1,
            next_tick: 0,
        }
    }
    pub fn hash_fn(&self) -> HashFn {
        self.hash_fn
    }
    pub fn evictable_len(&self) -> usize {
        self.evictable.len()
    }
    #[cfg(test)]
    pub fn is_registered(&self, block: u32) -> bool {
        self.entries.contains_key(&block)
    }

    /// The registered block holding `tokens` after the block of serial `parent_serial` (0: at
    /// the start of a sequence), if any.
    pub fn find(&self, hash: u64, parent_serial: u64, tokens: &[u32]) -> Option<Hit> {
        let ids = self.buckets.get(&hash)?;
        ids.iter().find_map(|id| {
            let e = &self.entries[id];
            (e.parent_serial == parent_serial && *e.tokens == *tokens).then_some(Hit { block: *id, serial: e.serial })
        })
    }

    /// Registers `block` as holding `tokens` after `parent_serial`; returns the serial of that
    /// content. If another block already holds it, that one stays the cached copy and `block`
    /// is left unregistered.
    pub fn register(&mut self, block: u32, hash: u64, parent_serial: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), KV_BLOCK);
        if let Some(hit) = self.find(hash, parent_serial, tokens) {
            return hit.serial;
        }
        if let Some(e) = self.entries.get(&block) {
            return e.serial;
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        self.buckets.entry(hash).or_default().push(block);
        self.entries.insert(block, Entry { hash, parent_serial, serial, tokens: tokens.into(), tick: None });
        serial
    }

    /// Forgets `block` (its bytes are about to change, or it is being reused).
    pub fn unregister(&mut self, block: u32) {
        let Some(e) = self.entries.remove(&block) else { return };
        if let Some(t) = e.tick {
            self.evictable.remove(&t);
        }
        if let Some(ids) = self.buckets.get_mut(&e.hash) {
            ids.retain(|&id| id != block);
            if ids.is_empty() {
                self.buckets.remove(&e.hash);
            }
        }
    }

    /// `block`'s last holder let it go. Returns whether the index keeps it (registered: it
    /// becomes evictable); otherwise it is free.
    pub fn released(&mut self, block: u32) -> bool {
        let Some(e) = self.entries.get_mut(&block) else { return false };
        let tick = self.next_tick;
        self.next_tick += 1;
        e.tick = Some(tick);
        self.evictable.insert(tick, block);
        true
    }

    /// A cache takes `block` again: it is no longer evictable.
    pub fn retained(&mut self, block: u32) {
        if let Some(t) = self.entries.get_mut(&block).and_then(|e| e.tick.take()) {
            self.evictable.remove(&t);
        }
    }

    /// The least recently released cached block, unregistered, for reuse.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, block) = self.evictable.pop_first()?;
        self.unregister(block);
        Some(block)
    }

    /// Forgets every block; returns those that were evictable (now free).
    pub fn clear(&mut self) -> Vec<u32> {
        let free = self.evictable.values().copied().collect();
        self.evictable.clear();
        self.entries.clear();
        self.buckets.clear();
        free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(seed: u32) -> Vec<u32> {
        (0..KV_BLOCK as u32).map(|i| seed * 100 + i).collect()
    }

    #[test]
    fn a_hit_needs_the_same_tokens_and_the_same_parent_even_when_hashes_collide() {
        let mut ix = PrefixIndex::new(colliding_hash);
        let h = colliding_hash(0, &[]);
        let a = ix.register(10, h, 0, &block(1));
        let b = ix.register(11, h, a, &block(2));
        // Same tokens as block 11 after another parent: a different content.
        let c = ix.register(12, h, 99, &block(2));
        assert_ne!(b, c);
        assert_eq!(ix.find(h, a, &block(2)), Some(Hit { block: 11, serial: b }));
        assert_eq!(ix.find(h, 99, &block(2)), Some(Hit { block: 12, serial: c }));
        assert_eq!(ix.find(h, 0, &block(2)), None);
        assert_eq!(ix.find(h, a, &block(3)), None);
        // Registering the same content again keeps the first block.
        assert_eq!(ix.register(13, h, 0, &block(1)), a);
        assert!(!ix.is_registered(13));
    }

    #[test]
    fn eviction_is_least_recently_released_first_and_retaining_protects() {
        let mut ix = PrefixIndex::new(chain_hash);
        let mut parent = 0;
        for b in 0..3u32 {
            let toks = block(b);
            parent = ix.register(b, chain_hash(b as u64, &toks), parent, &toks);
        }
        // Released last block first (as a cache drops its table), so the first block is newest.
        for b in (0..3).rev() {
            assert!(ix.released(b));
        }
        assert!(!ix.released(9), "an unregistered block is simply free");
        ix.retained(2);
        assert_eq!(ix.evictable_len(), 2);
        assert_eq!(ix.evict(), Some(1));
        assert_eq!(ix.evict(), Some(0));
        assert_eq!(ix.evict(), None);
        assert!(ix.is_registered(2) && !ix.is_registered(0));
        assert!(ix.released(2));
        assert_eq!(ix.clear(), vec![2]);
        assert!(!ix.is_registered(2));
    }
}
