//! The reference lane: one decode step of one sequence in FP32 with exactly dequantized
//! weights and a fixed reduction order that depends on nothing but that row and its own cache.
//! The gate trusts its argmax over the fast lane's and writes its K/V in place of the fast
//! lane's.

use candle_core::{Storage, Tensor};
use rayon::prelude::*;

use crate::dispatch::GateMatMul;
use crate::error::{Error, Result};
use crate::kernels::cpu::dequantize_rows;
use crate::llama::{attend, dot, rms_norm, rope, rope_tables, silu, KvCache, Llama};

/// Output rows dequantized at a time when no dense copy is kept: 64 rows of k=4096 is 1 MiB.
const ROWS_PER_BLOCK: usize = 64;

/// Whether the reference lane keeps dense FP32 copies of the weights (fast) or dequantizes
/// block by block on every step (no extra memory: what a 7B model on a small machine needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceWeights {
    Dense,
    Blockwise,
}

impl ReferenceWeights {
    /// Dense when the FP32 copy fits the budget, else blockwise.
    pub fn for_budget(model: &Llama, max_dense_bytes: usize) -> Self {
        let params: usize = model
            .layers
            .iter()
            .flat_map(|l| l.linears())
            .chain([&model.lm_head])
            .map(|w| w.dims().0 * w.dims().1)
            .sum();
        if params * 4 <= max_dense_bytes {
            ReferenceWeights::Dense
        } else {
            ReferenceWeights::Blockwise
        }
    }
}

fn tensor_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (st, layout) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(c) => {
            let s = c.as_slice::<f32>()?;
            let o = layout.start_offset();
            Ok(f(&s[o..o + layout.shape().elem_count()]))
        }
        _ => Err(Error::Unsupported("the reference lane runs on the CPU".into())),
    }
}

/// `y = W x` for one row with dequantized weights: each output one 8-lane `dot` over k.
pub fn matvec(w: &GateMatMul, how: ReferenceWeights, x: &[f32]) -> Result<Vec<f32>> {
    let (n, k) = w.dims();
    if x.len() != k {
        return Err(Error::BadInput(format!("reference matvec: input {} != k {k}", x.len())));
    }
    let mut y = vec![0f32; n];
    match how {
        ReferenceWeights::Dense => {
            let dense = w.dense_f32()?;
            tensor_slice(dense, |wd| {
                y.par_chunks_mut(ROWS_PER_BLOCK).enumerate().for_each(|(b, ys)| {
                    for (i, yo) in ys.iter_mut().enumerate() {
                        let j = b * ROWS_PER_BLOCK + i;
                        *yo = dot(&wd[j * k..(j + 1) * k], x);
                    }
                })
            })?;
        }
        ReferenceWeights::Blockwise => {
            y.par_chunks_mut(ROWS_PER_BLOCK).enumerate().try_for_each(|(b, ys)| -> Result<()> {
                let r0 = b * ROWS_PER_BLOCK;
                let wd = dequantize_rows(w.weight(), r0..r0 + ys.len())?;
                for (i, yo) in ys.iter_mut().enumerate() {
                    *yo = dot(&wd[i * k..(i + 1) * k], x);
                }
                Ok(())
            })?;
        }
    }
    Ok(y)
}

impl Llama {
    /// Appends `token` at the next position computed entirely in the reference lane.
    pub fn reference_append(&self, cache: &mut KvCache, token: u32, how: ReferenceWeights) -> Result<Vec<f32>> {
        cache.push_empty(self.cfg.kv_dim());
        self.reference_step(cache, token, how)
    }

    /// Reference-lane logits after each of `tokens`, from an empty cache (for checks).
    pub fn reference_logits(&self, tokens: &[u32], how: ReferenceWeights) -> Result<Vec<f32>> {
        let mut cache = self.new_cache();
        let mut last = Vec::new();
        for &t in tokens {
            last = self.reference_append(&mut cache, t, how)?;
        }
        Ok(last)
    }

    /// Recomputes position `cache.len() - 1`'s step in the reference lane: the cache must
    /// already hold that position (written by the fast lane); its K/V are replaced in every
    /// layer, and the reference logits are returned.
    pub fn reference_step(&self, cache: &mut KvCache, token: u32, how: ReferenceWeights) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        if cache.is_empty() {
            return Err(Error::BadInput("reference step on an empty cache".into()));
        }
        let pos = cache.len() - 1;
        let (h, hd, kvd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
        let mut x = self.embed_rows(&[token])?;
        let (c, s) = rope_tables(&cfg.inv_freq, pos);
        let mut xn = vec![0f32; h];
        let mut attn = vec![0f32; h];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, cfg.rms_eps, &mut xn);
            let mut q = matvec(&layer.wq, how, &xn)?;
            let mut k = matvec(&layer.wk, how, &xn)?;
            let v = matvec(&layer.wv, how, &xn)?;
            q.chunks_exact_mut(hd).for_each(|hh| rope(hh, &c, &s));
            k.chunks_exact_mut(hd).for_each(|hh| rope(hh, &c, &s));
            cache.k[li][pos * kvd..(pos + 1) * kvd].copy_from_slice(&k);
            cache.v[li][pos * kvd..(pos + 1) * kvd].copy_from_slice(&v);
            attend(cfg, &q, &cache.k[li], &cache.v[li], pos + 1, &mut attn);
            let o = matvec(&layer.wo, how, &attn)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            rms_norm(&x, &layer.ffn_norm, cfg.rms_eps, &mut xn);
            let g = matvec(&layer.w_gate, how, &xn)?;
            let mut u = matvec(&layer.w_up, how, &xn)?;
            u.iter_mut().zip(&g).for_each(|(u, &g)| *u *= silu(g));
            let d = matvec(&layer.w_down, how, &u)?;
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
        rms_norm(&x.clone(), &self.out_norm, cfg.rms_eps, &mut x);
        matvec(&self.lm_head, how, &x)
    }
}
