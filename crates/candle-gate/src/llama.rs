//! Llama-architecture model (SmolLM2, Llama 3.x) over a *varlen batch*: one forward call
//! takes rows from many sequences at different positions — decode rows and prefill chunks
//! together — each sequence with its own KV cache.
//!
//! Only the linear layers see more than one row at a time; they go through [`GateMatMul`] and
//! so through the policy's kernel. Everything else (norms, RoPE, activations, attention) is
//! computed per row in a fixed order that depends only on that row and its own sequence's
//! cache, so with a batch-invariant kernel the logits of a sequence are bitwise the same
//! whatever else shares the step.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::dispatch::{GateMatMul, Policy};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Inverse RoPE frequencies after any scaling from the metadata (`rope_freqs.weight`,
    /// linear `rope.scaling.factor`).
    pub inv_freq: Vec<f32>,
}

impl LlamaConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    /// KV cache bytes one token occupies (K and V, every layer, f32).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.n_layer * 2 * self.kv_dim() * std::mem::size_of::<f32>()
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: GateMatMul,
    pub wk: GateMatMul,
    pub wv: GateMatMul,
    pub wo: GateMatMul,
    pub ffn_norm: Vec<f32>,
    pub w_gate: GateMatMul,
    pub w_up: GateMatMul,
    pub w_down: GateMatMul,
}

impl Layer {
    pub fn linears(&self) -> [&GateMatMul; 7] {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down]
    }
}

pub struct Llama {
    pub cfg: LlamaConfig,
    pub embed: Arc<QTensor>,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    pub lm_head: GateMatMul,
    pub weight_bytes: usize,
}

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
}

/// One sequence's share of a forward step: `tokens` go at positions `cache.len()..`.
pub struct SeqRows<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    /// Whether this sequence needs logits for its last row (decode rows and final prefill chunks).
    pub want_logits: bool,
}

fn to_f32(t: QTensor) -> Result<Vec<f32>> {
    Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Dot product with eight fixed lanes: vectorizes, and its order depends only on the length.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Four independent [`dot`]s, each with exactly `dot`'s arithmetic (so the same bits), run
/// side by side: one `dot` is bound by the latency of its accumulator chain, four interleaved
/// keep the vector units busy. All slices must have the same length.
#[inline]
pub(crate) fn dot4(a: [&[f32]; 4], b: [&[f32]; 4]) -> [f32; 4] {
    let len = a[0].len();
    assert!(a.iter().chain(&b).all(|s| s.len() == len), "dot4: slices of different lengths");
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    {
        // SAFETY: AVX is enabled at compile time; every load reads 8 floats inside `..body`.
        unsafe { dot4_avx(a, b, len) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
    {
        [dot(a[0], b[0]), dot(a[1], b[1]), dot(a[2], b[2]), dot(a[3], b[3])]
    }
}

/// `dot`'s eight lanes as one AVX register per pair: lane i adds x[i] * y[i] (a multiply, then
/// an add: no FMA, as in `dot`), then the same reduction order and tail.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
unsafe fn dot4_avx(a: [&[f32]; 4], b: [&[f32]; 4], len: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    let body = len - len % 8;
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut j = 0;
    while j < body {
        for t in 0..4 {
            let x = _mm256_loadu_ps(a[t].as_ptr().add(j));
            let y = _mm256_loadu_ps(b[t].as_ptr().add(j));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(x, y));
        }
        j += 8;
    }
    let mut out = [0f32; 4];
    for t in 0..4 {
        let mut c = [0f32; 8];
        _mm256_storeu_ps(c.as_mut_ptr(), acc[t]);
        let mut tail = 0f32;
        for (x, y) in a[t][body..].iter().zip(&b[t][body..]) {
            tail += x * y;
        }
        out[t] = ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])) + tail;
    }
    out
}

pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// Interleaved-pair RoPE (GGUF llama layout) on one head.
#[inline]
pub(crate) fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    for i in 0..cos.len() {
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos[i] - b * sin[i];
        head[2 * i + 1] = a * sin[i] + b * cos[i];
    }
}

pub(crate) fn rope_tables(inv_freq: &[f32], pos: usize) -> (Vec<f32>, Vec<f32>) {
    let mut c = Vec::with_capacity(inv_freq.len());
    let mut s = Vec::with_capacity(inv_freq.len());
    for &f in inv_freq {
        let (sin, cos) = crate::detmath::sin_cos_f64((pos as f32 * f) as f64);
        c.push(cos as f32);
        s.push(sin as f32);
    }
    (c, s)
}

#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + crate::detmath::exp_f32(-x))
}

/// Causal attention of one query row (all heads) over `len` cached positions; fixed order.
pub(crate) fn attend(cfg: &LlamaConfig, q: &[f32], k: &[f32], v: &[f32], len: usize, out: &mut [f32]) {
    let hd = cfg.head_dim;
    let kvd = cfg.kv_dim();
    let group = cfg.n_head / cfg.n_kv_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0f32; len];
    for h in 0..cfg.n_head {
        let kvh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (t, s) in scores.iter_mut().enumerate() {
            *s = dot(qh, &k[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = crate::detmath::exp_f32(*s - max);
            sum += *s;
        }
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (t, &p) in scores.iter().enumerate() {
            let vt = &v[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd];
            for (o, &x) in oh.iter_mut().zip(vt) {
                *o += p * x;
            }
        }
        let inv = 1.0 / sum;
        for o in oh.iter_mut() {
            *o *= inv;
        }
    }
}

impl Llama {
    pub fn load(path: &Path, policy: Arc<Policy>) -> Result<Self> {
        let mut f = GgufFile::open(path)?;
        Self::from_gguf(&mut f, policy)
    }

    pub fn from_gguf(f: &mut GgufFile, policy: Arc<Policy>) -> Result<Self> {
        let arch = f.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::Model {
                path: f.path.display().to_string(),
                msg: format!("unsupported architecture `{arch}` (candle-gate runs `llama`: SmolLM2, Llama 3.x)"),
            });
        }
        let a = |k: &str| format!("llama.{k}");
        let n_layer = f.get_usize(&a("block_count"))?;
        let hidden = f.get_usize(&a("embedding_length"))?;
        let ffn = f.get_usize(&a("feed_forward_length"))?;
        let n_head = f.get_usize(&a("attention.head_count"))?;
        let n_kv_head = if f.metadata().contains_key(&a("attention.head_count_kv")) {
            f.get_usize(&a("attention.head_count_kv"))?
        } else {
            n_head
        };
        let fpath = f.path.display().to_string();
        let bad = |msg: String| Error::Model { path: fpath.clone(), msg };
        if n_head == 0 || n_kv_head == 0 || hidden % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(bad(format!(
                "inconsistent attention metadata: hidden {hidden}, heads {n_head}, kv heads {n_kv_head}"
            )));
        }
        let head_dim = hidden / n_head;
        if f.metadata().contains_key(&a("rope.dimension_count"))
            && f.get_usize(&a("rope.dimension_count"))? != head_dim
        {
            return Err(Error::Unsupported("partial rotary embeddings".into()));
        }
        let rope_base = f.opt_f32(&a("rope.freq_base"))?.unwrap_or(10000.0);
        let rms_eps = f.opt_f32(&a("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5);
        let context_length = f.get_usize(&a("context_length"))?;
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / crate::detmath::powf(rope_base, 2.0 * i as f32 / head_dim as f32))
            .collect();
        if let Some(factor) = f.opt_f32(&a("rope.scaling.factor"))? {
            let kind = f.get_str(&a("rope.scaling.type")).unwrap_or_else(|_| "linear".into());
            match kind.as_str() {
                "linear" if factor > 0.0 => inv_freq.iter_mut().for_each(|x| *x /= factor),
                "none" => {}
                other => return Err(Error::Unsupported(format!("rope scaling `{other}`"))),
            }
        }
        if f.has_tensor("rope_freqs.weight") {
            // Llama 3.1+ stores its frequency-dependent scaling as per-frequency divisors.
            let factors = to_f32(f.tensor_shaped("rope_freqs.weight", &[head_dim / 2])?)?;
            inv_freq.iter_mut().zip(&factors).for_each(|(x, d)| *x /= d);
        }
        let embed = f.tensor("token_embd.weight")?;
        let vocab = embed.shape().dims2()?.0;
        if embed.shape().dims() != [vocab, hidden] {
            return Err(bad(format!("token_embd.weight has shape {:?}, expected [vocab, {hidden}]", embed.shape().dims())));
        }
        if let Ok(v) = f.get_usize(&a("vocab_size")) {
            if v != vocab {
                return Err(bad(format!("token_embd.weight has {vocab} rows but llama.vocab_size is {v}")));
            }
        }
        let cfg = LlamaConfig {
            n_layer, hidden, ffn, n_head, n_kv_head, head_dim, vocab, context_length, rope_base, rms_eps, inv_freq,
        };
        let kv = cfg.kv_dim();
        let mut weight_bytes = 0usize;
        let mut lin = |f: &mut GgufFile, name: &str, dims: &[usize]| -> Result<GateMatMul> {
            let t = f.tensor_shaped(name, dims)?;
            weight_bytes += t.storage_size_in_bytes();
            GateMatMul::from_arc(Arc::new(t), policy.clone())
        };
        let mut layers = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: to_f32(f.tensor_shaped(&p("attn_norm"), &[hidden])?)?,
                wq: lin(f, &p("attn_q"), &[hidden, hidden])?,
                wk: lin(f, &p("attn_k"), &[kv, hidden])?,
                wv: lin(f, &p("attn_v"), &[kv, hidden])?,
                wo: lin(f, &p("attn_output"), &[hidden, hidden])?,
                ffn_norm: to_f32(f.tensor_shaped(&p("ffn_norm"), &[hidden])?)?,
                w_gate: lin(f, &p("ffn_gate"), &[ffn, hidden])?,
                w_up: lin(f, &p("ffn_up"), &[ffn, hidden])?,
                w_down: lin(f, &p("ffn_down"), &[hidden, ffn])?,
            });
        }
        let out_norm = to_f32(f.tensor_shaped("output_norm.weight", &[hidden])?)?;
        let embed = Arc::new(embed);
        let lm_head = if f.has_tensor("output.weight") {
            lin(f, "output.weight", &[vocab, hidden])?
        } else {
            weight_bytes += embed.storage_size_in_bytes();
            GateMatMul::from_arc(embed.clone(), policy.clone())?
        };
        Ok(Llama { cfg, embed, layers, out_norm, lm_head, weight_bytes })
    }

    /// Fast-lane logits of the last of `tokens`, prefilled from an empty cache in one call.
    pub fn last_logits(&self, policy: &Policy, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut cache = self.new_cache();
        let mut out = self.forward(policy, &mut [SeqRows { cache: &mut cache, tokens, want_logits: true }])?;
        out.pop().flatten().ok_or_else(|| Error::BadInput("no tokens".into()))
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg)
    }

    /// Bytes of weights one decode step reads (every linear layer plus one embedding row).
    pub fn bytes_per_decode_token(&self) -> usize {
        self.weight_bytes + self.embed.storage_size_in_bytes() / self.cfg.vocab
    }

    pub fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(Error::BadInput(format!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab)));
        }
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        Ok(self.embed.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// One step over a varlen batch. Returns, per sequence, the logits of its last row when it
    /// asked for them.
    pub fn forward(&self, policy: &Policy, batch: &mut [SeqRows<'_>]) -> Result<Vec<Option<Vec<f32>>>> {
        self.forward_traced(policy, batch, None)
    }

    /// [`Llama::forward`], also recording the residual stream (every row of the step) after
    /// each layer into `trace`, so that a bit difference can be traced to the first layer
    /// whose output it shows in.
    pub fn forward_traced(
        &self,
        policy: &Policy,
        batch: &mut [SeqRows<'_>],
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let cfg = &self.cfg;
        let (h, hd, kvd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
        let mut row_seq = Vec::new();
        let mut row_pos = Vec::new();
        let mut tokens = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(Error::BadInput(format!("sequence {i} of the step has no tokens")));
            }
            if s.cache.len() + s.tokens.len() > cfg.context_length {
                return Err(Error::BadInput(format!(
                    "sequence {i} would reach position {} but the context length is {}",
                    s.cache.len() + s.tokens.len(),
                    cfg.context_length
                )));
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                row_seq.push(i);
                row_pos.push(s.cache.len() + j);
                tokens.push(t);
            }
        }
        let r = tokens.len();
        if r == 0 {
            return Ok(Vec::new());
        }
        let mut x = self.embed_rows(&tokens)?;
        let ropes: Vec<(Vec<f32>, Vec<f32>)> = row_pos.iter().map(|&p| rope_tables(&cfg.inv_freq, p)).collect();
        let mut xn = vec![0f32; r * h];
        let mut attn = vec![0f32; r * h];
        for (li, layer) in self.layers.iter().enumerate() {
            for (xr, nr) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
                rms_norm(xr, &layer.attn_norm, cfg.rms_eps, nr);
            }
            let mut q = layer.wq.forward_rows(policy, &xn, r)?;
            let mut k = layer.wk.forward_rows(policy, &xn, r)?;
            let v = layer.wv.forward_rows(policy, &xn, r)?;
            for row in 0..r {
                let (c, s) = &ropes[row];
                for head in q[row * h..(row + 1) * h].chunks_exact_mut(hd) {
                    rope(head, c, s);
                }
                for head in k[row * kvd..(row + 1) * kvd].chunks_exact_mut(hd) {
                    rope(head, c, s);
                }
            }
            let mut off = 0;
            for s in batch.iter_mut() {
                let n = s.tokens.len();
                s.cache.k[li].extend_from_slice(&k[off * kvd..(off + n) * kvd]);
                s.cache.v[li].extend_from_slice(&v[off * kvd..(off + n) * kvd]);
                off += n;
            }
            let caches: Vec<&KvCache> = batch.iter().map(|s| &*s.cache).collect();
            let attend_row = |(row, out): (usize, &mut [f32])| {
                let c = caches[row_seq[row]];
                attend(cfg, &q[row * h..(row + 1) * h], &c.k[li], &c.v[li], row_pos[row] + 1, out);
            };
            if r == 1 {
                attend_row((0, &mut attn[..]));
            } else {
                attn.par_chunks_mut(h).enumerate().for_each(attend_row);
            }
            let o = layer.wo.forward_rows(policy, &attn, r)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            for (xr, nr) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
                rms_norm(xr, &layer.ffn_norm, cfg.rms_eps, nr);
            }
            let g = layer.w_gate.forward_rows(policy, &xn, r)?;
            let mut u = layer.w_up.forward_rows(policy, &xn, r)?;
            u.iter_mut().zip(&g).for_each(|(u, &g)| *u *= silu(g));
            let d = layer.w_down.forward_rows(policy, &u, r)?;
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            if let Some(t) = trace.as_deref_mut() {
                t.push(x.clone());
            }
        }
        for s in batch.iter_mut() {
            let n = s.tokens.len();
            s.cache.len += n;
        }
        // Final norm and the output matrix only for the rows whose logits someone needs.
        let mut last_rows = Vec::new();
        let mut off = 0;
        for s in batch.iter() {
            off += s.tokens.len();
            if s.want_logits {
                last_rows.push(off - 1);
            }
        }
        let mut out: Vec<Option<Vec<f32>>> = vec![None; batch.len()];
        if !last_rows.is_empty() {
            let mut hn = vec![0f32; last_rows.len() * h];
            for (i, &row) in last_rows.iter().enumerate() {
                rms_norm(&x[row * h..(row + 1) * h], &self.out_norm, cfg.rms_eps, &mut hn[i * h..(i + 1) * h]);
            }
            let logits = self.lm_head.forward_rows(policy, &hn, last_rows.len())?;
            let mut li = 0;
            for (i, s) in batch.iter().enumerate() {
                if s.want_logits {
                    out[i] = Some(logits[li * cfg.vocab..(li + 1) * cfg.vocab].to_vec());
                    li += 1;
                }
            }
        }
        Ok(out)
    }
}

/// Greedy choice with its margin: (argmax, top1 − top2). Ties go to the lower id.
pub fn argmax_margin(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut b1, mut b2) = (0usize, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > b1 {
            b2 = b1;
            b1 = v;
            best = i;
        } else if v > b2 {
            b2 = v;
        }
    }
    (best as u32, b1 - b2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot4_is_four_dots_bit_for_bit() {
        let mut s = 0x243F6A8885A308D3u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for len in [0, 1, 7, 8, 9, 31, 64, 577] {
            let v: Vec<Vec<f32>> = (0..8).map(|_| (0..len).map(|_| next()).collect()).collect();
            let a = [&v[0][..], &v[1][..], &v[2][..], &v[3][..]];
            let b = [&v[4][..], &v[5][..], &v[6][..], &v[7][..]];
            let got = dot4(a, b);
            for t in 0..4 {
                assert_eq!(got[t].to_bits(), dot(a[t], b[t]).to_bits(), "len {len} lane {t}");
            }
        }
    }
}
