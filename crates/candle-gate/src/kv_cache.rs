//! Each sequence's K/V cache: every layer's keys and values, one row per position, f32.

use crate::llama::LlamaConfig;

/// One sequence's keys and values, per layer, `[position][kv_head * head_dim]` row-major.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(cfg: &LlamaConfig) -> Self {
        KvCache { k: vec![Vec::new(); cfg.n_layer], v: vec![Vec::new(); cfg.n_layer], len: 0 }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Makes room for one more position (zeros) in every layer.
    pub fn push_empty(&mut self, kv_dim: usize) {
        for l in 0..self.k.len() {
            self.k[l].resize((self.len + 1) * kv_dim, 0.0);
            self.v[l].resize((self.len + 1) * kv_dim, 0.0);
        }
        self.len += 1;
    }

    /// Drops positions `len..` (used to roll back or repair).
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        for l in 0..self.k.len() {
            self.k[l].truncate(len * kv_dim);
            self.v[l].truncate(len * kv_dim);
        }
        self.len = self.len.min(len);
    }

    /// A copy of one position's K/V in every layer, to put back with [`KvCache::restore_position`].
    pub fn save_position(&self, pos: usize, kv_dim: usize) -> SavedPosition {
        let r = pos * kv_dim..(pos + 1) * kv_dim;
        SavedPosition {
            pos,
            k: self.k.iter().map(|l| l[r.clone()].to_vec()).collect(),
            v: self.v.iter().map(|l| l[r.clone()].to_vec()).collect(),
        }
    }

    pub fn restore_position(&mut self, saved: SavedPosition) {
        for (l, (k, v)) in saved.k.iter().zip(&saved.v).enumerate() {
            self.write(l, saved.pos, k, v);
        }
    }

    /// Writes one position's K and V in one layer; the position must exist.
    pub(crate) fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let kvd = k.len();
        self.k[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(k);
        self.v[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(v);
    }
}

/// One position's K/V in every layer, saved by [`KvCache::save_position`].
pub struct SavedPosition {
    pos: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}
