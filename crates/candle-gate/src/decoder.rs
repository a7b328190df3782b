//! Decoder-only models (`llama`: SmolLM2, Llama 3.x; `qwen2`: Qwen2/2.5; `gemma3`: Gemma 3) over a
//! *varlen batch*: one forward call
//! takes rows from many sequences at different positions — decode rows and prefill chunks
//! together — each sequence with its own KV cache.
//!
//! The layer loop is written once and runs in a [`Lane`]: the fast lane (a [`Policy`]: the
//! fast kernels) or the reference lane ([`crate::reference::ReferenceWeights`]: exact FP32). Only
//! the lane's matmul sees more than one row at a time. Everything else (norms, RoPE, activations,
//! attention, in [`crate::ops`]) is computed per row in a fixed order that depends only on that
//! row and its own sequence's cache, so with a batch-invariant kernel the logits of a sequence
//! are bitwise the same whatever else shares the step.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::attention::{attend_rows, Heads, Tier};
use crate::dispatch::{Lane, Policy, QMatMul, WeightLayout};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::ops::{gelu_tanh_mul, rms_norm, rope_tables, silu_mul};
use crate::reference::ReferenceWeights;
use crate::scratch::{sized, Scratch, ScratchPool};

pub use crate::kv_cache::{BlockLayout, KvCache, KvDtype, SavedPosition};
pub use crate::ops::argmax_margin;

/// The architectures the layer loop runs. They share it; what differs is here and in the
/// config (RoPE, activation, windows) and in which optional weights a layer has (biases,
/// q/k norms, sandwich norms), not in a second copy of the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Qwen2/2.5: biases on the q/k/v projections, NeoX-style RoPE.
    Qwen2,
    /// Gemma 3: embeddings scaled by √hidden, RMSNorm on each q and k head, norms after
    /// attention and after the FFN too, GELU(tanh)-gated FFN, NeoX RoPE, and layers that
    /// alternate sliding-window (local, their own RoPE base) with global attention.
    Gemma3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }
    fn from_name(s: &str) -> Option<Self> {
        [Arch::Llama, Arch::Qwen2, Arch::Gemma3].into_iter().find(|a| a.name() == s)
    }
}

/// The FFN's gate activation: SwiGLU's SiLU, or GeGLU's tanh-approximated GELU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

/// Which dimensions RoPE rotates together: llama.cpp's `LLAMA_ROPE_TYPE_NORM` (adjacent pairs,
/// the layout GGUF's converter permutes llama's q/k weights into) or `LLAMA_ROPE_TYPE_NEOX`
/// (dimension i with i + head_dim/2, as Qwen2 was trained).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Adjacent,
    Neox,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    pub arch: Arch,
    pub rope_style: RopeStyle,
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
    /// What the embeddings are multiplied by (Gemma: √hidden).
    pub embed_scale: Option<f32>,
    /// What an attention score `q·k` is multiplied by.
    pub attn_scale: f32,
    pub activation: Activation,
    /// Sliding-window attention: how many positions a local layer's row sees.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is local (the sliding window, `inv_freq_local`).
    pub local_layers: Vec<bool>,
    /// Local layers' inverse RoPE frequencies (their own base, never scaled).
    pub inv_freq_local: Vec<f32>,
}

impl DecoderConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    /// Width of the query rows (Gemma's heads are wider than `hidden / n_head`).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    /// KV cache bytes one token occupies (K and V, every layer) when stored as `dtype`.
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        self.n_layer * 2 * self.kv_dim() * dtype.size()
    }
    /// Layer `li`'s attention: its shapes, scale and window.
    pub fn heads(&self, li: usize) -> Heads {
        let local = self.local_layers.get(li).copied().unwrap_or(false);
        Heads {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            scale: self.attn_scale,
            window: if local { self.sliding_window } else { None },
        }
    }
    /// How a KV block of this model is laid out when it stores `dtype`.
    pub fn block_layout(&self, dtype: KvDtype) -> BlockLayout {
        BlockLayout { n_layer: self.n_layer, n_kv_head: self.n_kv_head, head_dim: self.head_dim, dtype }
    }

    /// The hyperparameters from a GGUF file's metadata (and the shape of its embedding), with
    /// clear errors for what candle-gate does not run.
    pub fn from_gguf(f: &mut GgufFile) -> Result<Self> {
        let arch = f.get_str("general.architecture")?;
        let bad = |msg: String| Error::Model { path: f.path.display().to_string(), msg };
        let Some(arch_kind) = Arch::from_name(&arch) else {
            return Err(bad(format!(
                "unsupported architecture `{arch}` (candle-gate runs `llama`: SmolLM2, Llama 3.x; `qwen2`: Qwen2, Qwen2.5; `gemma3`: Gemma 3)"
            )));
        };
        let gemma = arch_kind == Arch::Gemma3;
        let key = |k: &str| format!("{arch}.{k}");
        let n_layer = f.get_usize(&key("block_count"))?;
        let hidden = f.get_usize(&key("embedding_length"))?;
        let ffn = f.get_usize(&key("feed_forward_length"))?;
        let n_head = f.get_usize(&key("attention.head_count"))?;
        let n_kv_head = match f.metadata().contains_key(&key("attention.head_count_kv")) {
            true => f.get_usize(&key("attention.head_count_kv"))?,
            false => n_head,
        };
        let key_length = f.metadata().contains_key(&key("attention.key_length"));
        if n_head == 0 || n_kv_head == 0 || (!key_length && hidden % n_head != 0) || n_head % n_kv_head != 0 {
            return Err(bad(format!(
                "inconsistent attention metadata: hidden {hidden}, heads {n_head}, kv heads {n_kv_head}"
            )));
        }
        let head_dim = if key_length { f.get_usize(&key("attention.key_length"))? } else { hidden / n_head };
        if f.metadata().contains_key(&key("attention.value_length"))
            && f.get_usize(&key("attention.value_length"))? != head_dim
        {
            return Err(Error::Unsupported("value heads of another width than key heads".into()));
        }
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!("head width {head_dim} is not a positive even number")));
        }
        for capping in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if f.metadata().contains_key(&key(capping)) {
                return Err(Error::Unsupported(format!("{arch} with `{capping}` (Gemma 2's logit soft-capping)")));
            }
        }
        if f.metadata().contains_key(&key("rope.dimension_count"))
            && f.get_usize(&key("rope.dimension_count"))? != head_dim
        {
            return Err(Error::Unsupported("partial rotary embeddings".into()));
        }
        let dims = f.tensor_dims("token_embd.weight")?;
        if dims.len() != 2 || dims[1] != hidden {
            return Err(bad(format!("token_embd.weight has shape {dims:?}, expected [vocab, {hidden}]")));
        }
        let vocab = dims[0];
        if let Ok(v) = f.get_usize(&key("vocab_size")) {
            if v != vocab {
                return Err(bad(format!("token_embd.weight has {vocab} rows but {arch}.vocab_size is {v}")));
            }
        }
        let rope_base = f.opt_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
        if arch_kind == Arch::Qwen2 && f.metadata().contains_key(&key("rope.scaling.type")) {
            let kind = f.get_str(&key("rope.scaling.type")).unwrap_or_default();
            if kind != "none" {
                return Err(Error::Unsupported(format!("qwen2 with rope scaling `{kind}` (YaRN long-context files)")));
            }
        }
        let (sliding_window, local_layers, inv_freq_local) = if gemma {
            let window = f.get_usize(&key("attention.sliding_window"))?;
            if window == 0 {
                return Err(bad("attention.sliding_window is 0".into()));
            }
            let local = local_layer_pattern(f, &key("attention.sliding_window_pattern"), n_layer)?;
            // llama.cpp's local base for Gemma 3 when the file does not give one.
            let base = f.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(10000.0);
            (Some(window), local, plain_inv_freq(base, head_dim))
        } else {
            (None, vec![false; n_layer], Vec::new())
        };
        // Gemma 3 scales queries by 1/√query_pre_attn_scalar, which GGUF does not carry:
        // llama.cpp's rule, head_dim except for the 27B model (62 layers), hidden / n_head.
        let attn_scale = match (gemma, n_layer) {
            (true, 62) => 1.0 / ((hidden / n_head) as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        Ok(DecoderConfig {
            arch: arch_kind,
            rope_style: match arch_kind {
                Arch::Llama => RopeStyle::Adjacent,
                Arch::Qwen2 | Arch::Gemma3 => RopeStyle::Neox,
            },
            n_layer,
            hidden,
            ffn,
            n_head,
            n_kv_head,
            head_dim,
            vocab,
            context_length: f.get_usize(&key("context_length"))?,
            rope_base,
            rms_eps: f.opt_f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
            inv_freq: inv_freq(f, &key, rope_base, head_dim)?,
            embed_scale: gemma.then(|| (hidden as f32).sqrt()),
            attn_scale,
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            sliding_window,
            local_layers,
            inv_freq_local,
        })
    }
}

/// Which layers are local: the metadata's pattern (one flag per layer, or a period `n`: every
/// n-th layer global) or Gemma 3's own, five local layers to one global.
fn local_layer_pattern(f: &GgufFile, key: &str, n_layer: usize) -> Result<Vec<bool>> {
    let period = |n: usize| (0..n_layer).map(|i| n == 0 || i % n < n - 1).collect();
    match f.metadata().get(key) {
        None => Ok(period(6)),
        Some(Value::Array(a)) if a.len() == n_layer => {
            a.iter().map(|v| v.to_bool().map_err(|e| Error::Unsupported(format!("{key}: {e}")))).collect()
        }
        Some(v) => match v.to_u32() {
            Ok(n) => Ok(period(n as usize)),
            Err(_) => Err(Error::Unsupported(format!("{key} of an unknown form ({v:?})"))),
        },
    }
}

fn plain_inv_freq(base: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / crate::detmath::powf(base, 2.0 * i as f32 / head_dim as f32)).collect()
}

/// RoPE's inverse frequencies, with the metadata's linear scaling and Llama 3.1+'s stored
/// per-frequency divisors applied.
fn inv_freq(f: &mut GgufFile, key: &dyn Fn(&str) -> String, base: f32, head_dim: usize) -> Result<Vec<f32>> {
    let mut inv = plain_inv_freq(base, head_dim);
    let kind = f.get_str(&key("rope.scaling.type")).unwrap_or_else(|_| "linear".into());
    if !matches!(kind.as_str(), "linear" | "none") {
        return Err(Error::Unsupported(format!("rope scaling `{kind}`")));
    }
    if let Some(factor) = f.opt_f32(&key("rope.scaling.factor"))? {
        if kind == "linear" && factor > 0.0 {
            inv.iter_mut().for_each(|x| *x /= factor);
        }
    }
    if f.has_tensor("rope_freqs.weight") {
        let factors = to_f32(f.tensor_shaped("rope_freqs.weight", &[head_dim / 2])?)?;
        inv.iter_mut().zip(&factors).for_each(|(x, d)| *x /= d);
    }
    Ok(inv)
}

/// Where each row of one pass through the layers belongs: the index of its sequence among the
/// pass's caches, its position there, and its token.
pub(crate) struct Rows {
    pub seq: Vec<usize>,
    pub pos: Vec<usize>,
    pub tokens: Vec<u32>,
}

pub struct Attention {
    pub wq: QMatMul,
    pub wk: QMatMul,
    pub wv: QMatMul,
    pub wo: QMatMul,
    /// Qwen2's projection biases (q, k, v), added after the matmul in either lane.
    pub bias: Option<[Vec<f32>; 3]>,
    /// Gemma's RMSNorm weights for each q head and each k head, before RoPE.
    pub qk_norm: Option<[Vec<f32>; 2]>,
}

impl Attention {
    /// Self-attention of every row of `s.xn`: projections, RoPE, the rows' K/V written at their
    /// positions in their own caches (layer `li`), then each row attends over its own sequence
    /// up to and including its position; the output projection lands in `s.proj`.
    fn forward(
        &self,
        lane: &dyn Lane,
        cfg: &DecoderConfig,
        li: usize,
        rows: &Rows,
        caches: &mut [&mut KvCache],
        s: &mut Scratch,
    ) -> Result<()> {
        let (r, hd, kvd) = (rows.tokens.len(), cfg.head_dim, cfg.kv_dim());
        let (xn, q, k, v) = (&s.xn, &mut s.q, &mut s.k, &mut s.v);
        side_by_side(
            || lane.matmul_into(&self.wq, xn, r, q),
            || side_by_side(|| lane.matmul_into(&self.wk, xn, r, k), || lane.matmul_into(&self.wv, xn, r, v)),
        )?;
        if let Some([bq, bk, bv]) = &self.bias {
            add_rowwise(&mut s.q, bq);
            add_rowwise(&mut s.k, bk);
            add_rowwise(&mut s.v, bv);
        }
        if let Some([nq, nk]) = &self.qk_norm {
            norm_heads(&mut s.q, nq, cfg.rms_eps);
            norm_heads(&mut s.k, nk, cfg.rms_eps);
        }
        let qd = s.q.len() / r;
        let rope = match cfg.rope_style {
            RopeStyle::Adjacent => crate::ops::rope,
            RopeStyle::Neox => crate::ops::rope_neox,
        };
        let half = hd / 2;
        let heads = cfg.heads(li);
        let (cos, sin) = match heads.window {
            Some(_) => (&s.cos_local, &s.sin_local),
            None => (&s.cos, &s.sin),
        };
        for row in 0..r {
            let (c, sn) = (&cos[row * half..(row + 1) * half], &sin[row * half..(row + 1) * half]);
            s.q[row * qd..(row + 1) * qd].chunks_exact_mut(hd).for_each(|head| rope(head, c, sn));
            let k = &mut s.k[row * kvd..(row + 1) * kvd];
            k.chunks_exact_mut(hd).for_each(|head| rope(head, c, sn));
            caches[rows.seq[row]].write(li, rows.pos[row], k, &s.v[row * kvd..(row + 1) * kvd])?;
        }
        let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
        let out = sized(&mut s.attn, r * qd);
        attend_rows(heads, li, &s.q, &rows.seq, &rows.pos, &caches, out, Tier::current());
        lane.matmul_into(&self.wo, &s.attn, r, &mut s.proj)
    }
}

/// Two independent matmuls of the same rows side by side on the rayon pool: the workers that
/// finish one's columns start on the other's instead of waiting at its join, so a single decode
/// row pays fewer idle ends. Every output element is still computed whole by one worker, so the
/// bits are those of running them in turn. Candle's barrier pool is not reentrant: in turn there.
fn side_by_side(a: impl FnOnce() -> Result<()> + Send, b: impl FnOnce() -> Result<()> + Send) -> Result<()> {
    if crate::kernels::pool() == crate::kernels::Pool::Rayon {
        let (x, y) = rayon::join(a, b);
        x.and(y)
    } else {
        a()?;
        b()
    }
}

pub struct Mlp {
    pub w_gate: QMatMul,
    pub w_up: QMatMul,
    pub w_down: QMatMul,
}

impl Mlp {
    /// The gated FFN of the `r` rows of `s.xn`, `down(act(gate(x)) * up(x))`, into `s.proj`.
    fn forward(&self, lane: &dyn Lane, act: Activation, r: usize, s: &mut Scratch) -> Result<()> {
        let (xn, gate, up) = (&s.xn, &mut s.gate, &mut s.up);
        side_by_side(|| lane.matmul_into(&self.w_gate, xn, r, gate), || lane.matmul_into(&self.w_up, xn, r, up))?;
        match act {
            Activation::Silu => silu_mul(&mut s.up, &s.gate),
            Activation::GeluTanh => gelu_tanh_mul(&mut s.up, &s.gate),
        }
        lane.matmul_into(&self.w_down, &s.up, r, &mut s.proj)
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    /// Gemma's sandwich norm on the attention output, before it joins the residual.
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub mlp: Mlp,
    /// Gemma's sandwich norm on the FFN output.
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl Layer {
    pub fn linears(&self) -> [&QMatMul; 7] {
        let (a, m) = (&self.attn, &self.mlp);
        [&a.wq, &a.wk, &a.wv, &a.wo, &m.w_gate, &m.w_up, &m.w_down]
    }
}

pub struct Decoder {
    pub cfg: DecoderConfig,
    /// `token_embd.weight`, or `None` where the output matrix is the embedding (tied): the
    /// output `QMatMul` then holds it alone, so that it may pack it, and embedding rows are
    /// read through it ([`Decoder::embed_rows`]).
    pub embed: Option<Arc<QTensor>>,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    pub lm_head: QMatMul,
    pub weight_bytes: usize,
    scratch: ScratchPool,
}

/// One sequence's share of a forward step: `tokens` go at positions `cache.len()..`.
pub struct SeqRows<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    /// How many of its last rows need logits: 1 for a decode row or a final prefill chunk, the
    /// whole verification run for a speculating sequence, 0 for other prefill chunks.
    pub logit_rows: usize,
}

fn to_f32(t: QTensor) -> Result<Vec<f32>> {
    Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rms_norm(xr, w, eps, or);
    }
}

/// RMSNorm of every head (`w.len()` wide) of `x`, in place.
fn norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let mut tmp = vec![0f32; w.len()];
    for head in x.chunks_exact_mut(w.len()) {
        rms_norm(head, w, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
}

/// `x += sublayer`, through the sublayer's own norm first when it has one (Gemma): `norm_out`
/// is free space for it.
fn add_sublayer(x: &mut [f32], sub: &[f32], post_norm: Option<&[f32]>, eps: f32, norm_out: &mut Vec<f32>) {
    match post_norm {
        Some(w) => {
            let n = sized(norm_out, sub.len());
            norm_rows(sub, w, eps, n);
            add(x, n);
        }
        None => add(x, sub),
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `x[row] += b` for every row of `x`.
fn add_rowwise(x: &mut [f32], b: &[f32]) {
    x.chunks_exact_mut(b.len()).for_each(|row| add(row, b));
}

impl Decoder {
    pub fn load(path: &Path, layout: WeightLayout) -> Result<Self> {
        let mut f = GgufFile::open(path)?;
        Self::from_gguf(&mut f, layout)
    }

    /// The decoder of `f`, its matmul weights in `layout`.
    pub fn from_gguf(f: &mut GgufFile, layout: WeightLayout) -> Result<Self> {
        let cfg = DecoderConfig::from_gguf(f)?;
        // What a weight's `Module::forward` would run: the engine passes its own policy instead.
        let policy = Arc::new(Policy::new(layout.mode()));
        let (h, kv, qd, ffn, vocab) = (cfg.hidden, cfg.kv_dim(), cfg.q_dim(), cfg.ffn, cfg.vocab);
        let gemma = cfg.arch == Arch::Gemma3;
        let mut weight_bytes = 0usize;
        // Every matmul weight side by side in huge pages: most are too small to hold one alone.
        let arena = crate::huge_pages::WeightArena::new();
        let mut lin = |f: &mut GgufFile, name: &str, dims: &[usize]| -> Result<QMatMul> {
            let t = f.tensor_shaped(name, dims)?;
            weight_bytes += t.storage_size_in_bytes();
            QMatMul::laid_out_in(Arc::new(t), layout, policy.clone(), Some(&arena))
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}.weight");
            let norm = |f: &mut GgufFile, s: &str, n: usize| to_f32(f.tensor_shaped(&name(s), &[n])?);
            let bias = match cfg.arch {
                Arch::Llama | Arch::Gemma3 => None,
                Arch::Qwen2 => {
                    let b = |f: &mut GgufFile, s: &str, n: usize| -> Result<Vec<f32>> {
                        to_f32(f.tensor_shaped(&format!("blk.{i}.{s}.bias"), &[n])?)
                    };
                    Some([b(f, "attn_q", h)?, b(f, "attn_k", kv)?, b(f, "attn_v", kv)?])
                }
            };
            let hd = cfg.head_dim;
            let qk_norm = if gemma { Some([norm(f, "attn_q_norm", hd)?, norm(f, "attn_k_norm", hd)?]) } else { None };
            layers.push(Layer {
                attn_norm: norm(f, "attn_norm", h)?,
                attn: Attention {
                    wq: lin(f, &name("attn_q"), &[qd, h])?,
                    wk: lin(f, &name("attn_k"), &[kv, h])?,
                    wv: lin(f, &name("attn_v"), &[kv, h])?,
                    wo: lin(f, &name("attn_output"), &[h, qd])?,
                    bias,
                    qk_norm,
                },
                post_attn_norm: if gemma { Some(norm(f, "post_attention_norm", h)?) } else { None },
                ffn_norm: norm(f, "ffn_norm", h)?,
                mlp: Mlp {
                    w_gate: lin(f, &name("ffn_gate"), &[ffn, h])?,
                    w_up: lin(f, &name("ffn_up"), &[ffn, h])?,
                    w_down: lin(f, &name("ffn_down"), &[h, ffn])?,
                },
                post_ffn_norm: if gemma { Some(norm(f, "post_ffw_norm", h)?) } else { None },
            });
        }
        let out_norm = to_f32(f.tensor_shaped("output_norm.weight", &[h])?)?;
        let embed = Arc::new(f.tensor_shaped("token_embd.weight", &[vocab, h])?);
        let (embed, lm_head) = if f.has_tensor("output.weight") {
            (Some(embed), lin(f, "output.weight", &[vocab, h])?)
        } else {
            weight_bytes += embed.storage_size_in_bytes();
            (None, QMatMul::laid_out_in(embed, layout, policy.clone(), Some(&arena))?)
        };
        Ok(Decoder { cfg, embed, layers, out_norm, lm_head, weight_bytes, scratch: ScratchPool::default() })
    }

    /// Fast-lane logits of the last of `tokens`, prefilled from an empty cache in one call.
    pub fn last_logits(&self, policy: &Policy, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut cache = self.new_cache();
        let mut out = self.forward(policy, &mut [SeqRows { cache: &mut cache, tokens, logit_rows: 1 }])?;
        out.pop().flatten().ok_or_else(|| Error::BadInput("no tokens".into()))
    }

    /// An empty f16 cache (the default K/V storage) in a pool of its own.
    pub fn new_cache(&self) -> KvCache {
        self.new_cache_with(KvDtype::F16)
    }
    pub fn new_cache_with(&self, dtype: KvDtype) -> KvCache {
        KvCache::new(self.cfg.block_layout(dtype))
    }

    /// Bytes of weights one decode step reads (every linear layer plus one embedding row).
    pub fn bytes_per_decode_token(&self) -> usize {
        let embedding_row = match &self.embed {
            Some(e) => e.storage_size_in_bytes() / self.cfg.vocab,
            None => self.lm_head.weight_bytes() / self.cfg.vocab,
        };
        self.weight_bytes + embedding_row
    }

    /// Bytes an FP32 copy of every linear layer would take (the reference lane's dense weights).
    pub fn dense_f32_bytes(&self) -> usize {
        let linears = self.layers.iter().flat_map(|l| l.linears()).chain([&self.lm_head]);
        linears.map(|w| w.dims().0 * w.dims().1 * 4).sum()
    }

    pub fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(Error::BadInput(format!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab)));
        }
        match &self.embed {
            Some(embed) => {
                let ids = Tensor::new(tokens, &Device::Cpu)?;
                Ok(embed.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?)
            }
            // The same dequantization of the same blocks (GGML's `to_float`), from the output
            // matrix's layout.
            None => {
                let mut rows = Vec::with_capacity(tokens.len() * self.cfg.hidden);
                for &t in tokens {
                    rows.extend(self.lm_head.dequantize_rows(t as usize..t as usize + 1)?);
                }
                Ok(rows)
            }
        }
    }

    /// The layer loop, once for both lanes: `rows` (whose positions already exist in their
    /// caches) through every layer in `lane`, their K/V written in place; returns the logits of
    /// `logit_rows`, row-major. With `trace`, the residual stream after each layer is recorded.
    pub(crate) fn run_layers(
        &self,
        lane: &dyn Lane,
        caches: &mut [&mut KvCache],
        rows: &Rows,
        logit_rows: &[usize],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let mut s = self.scratch.take();
        let out = self.run_layers_with(&mut s, lane, caches, rows, logit_rows, trace);
        self.scratch.give_back(s);
        out
    }

    fn run_layers_with(
        &self,
        s: &mut Scratch,
        lane: &dyn Lane,
        caches: &mut [&mut KvCache],
        rows: &Rows,
        logit_rows: &[usize],
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (h, r, half) = (cfg.hidden, rows.tokens.len(), cfg.head_dim / 2);
        let mut x = self.embed_rows(&rows.tokens)?;
        if let Some(scale) = cfg.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let tables =
            [(&cfg.inv_freq, &mut s.cos, &mut s.sin), (&cfg.inv_freq_local, &mut s.cos_local, &mut s.sin_local)];
        for (inv_freq, cos, sin) in tables.into_iter().filter(|t| !t.0.is_empty()) {
            let (cos, sin) = (sized(cos, r * half), sized(sin, r * half));
            for (i, &p) in rows.pos.iter().enumerate() {
                rope_tables(inv_freq, p, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
            }
        }
        for (li, layer) in self.layers.iter().enumerate() {
            norm_rows(&x, &layer.attn_norm, cfg.rms_eps, sized(&mut s.xn, r * h));
            layer.attn.forward(lane, cfg, li, rows, caches, s)?;
            add_sublayer(&mut x, &s.proj, layer.post_attn_norm.as_deref(), cfg.rms_eps, &mut s.xn);
            norm_rows(&x, &layer.ffn_norm, cfg.rms_eps, sized(&mut s.xn, r * h));
            layer.mlp.forward(lane, cfg.activation, r, s)?;
            add_sublayer(&mut x, &s.proj, layer.post_ffn_norm.as_deref(), cfg.rms_eps, &mut s.xn);
            if let Some(t) = trace.as_deref_mut() {
                t.push(x.clone());
            }
        }
        if logit_rows.is_empty() {
            return Ok(Vec::new());
        }
        // The final norm and the output matrix only for the rows whose logits someone needs.
        let hn = sized(&mut s.xn, logit_rows.len() * h);
        for (i, &row) in logit_rows.iter().enumerate() {
            rms_norm(&x[row * h..(row + 1) * h], &self.out_norm, cfg.rms_eps, &mut hn[i * h..(i + 1) * h]);
        }
        lane.matmul(&self.lm_head, &s.xn, logit_rows.len())
    }

    /// One step over a varlen batch. Returns, per sequence, the logits of its last row when it
    /// asked for them.
    pub fn forward(&self, policy: &Policy, batch: &mut [SeqRows<'_>]) -> Result<Vec<Option<Vec<f32>>>> {
        self.forward_traced(policy, batch, None)
    }

    /// [`Decoder::forward`], also recording the residual stream (every row of the step) after
    /// each layer into `trace`, so that a bit difference can be traced to the first layer
    /// whose output it shows in. On an error every cache is left as it was before the call.
    pub fn forward_traced(
        &self,
        policy: &Policy,
        batch: &mut [SeqRows<'_>],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        self.forward_in(policy, batch, trace)
    }

    /// [`Decoder::forward_traced`] in any lane.
    pub fn forward_in(
        &self,
        lane: &dyn Lane,
        batch: &mut [SeqRows<'_>],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        // A parallel loop started from outside the pool parks the caller until it is done: a
        // sleep and a wake per matmul. Started from a worker, the caller works along with the
        // others, so the whole forward moves onto one once.
        if rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_in(lane, batch, trace));
        }
        let cfg = &self.cfg;
        let mut rows = Rows { seq: Vec::new(), pos: Vec::new(), tokens: Vec::new() };
        let mut logit_rows = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(Error::BadInput(format!("sequence {i} of the step has no tokens")));
            }
            let end = s.cache.len() + s.tokens.len();
            if end > cfg.context_length {
                return Err(Error::BadInput(format!(
                    "sequence {i} would reach position {end} but the context length is {}",
                    cfg.context_length
                )));
            }
            rows.seq.extend(std::iter::repeat_n(i, s.tokens.len()));
            rows.pos.extend(s.cache.len()..end);
            rows.tokens.extend_from_slice(s.tokens);
            if s.logit_rows > s.tokens.len() {
                return Err(Error::BadInput(format!("sequence {i} wants logits for more rows than it has")));
            }
            logit_rows.extend(rows.tokens.len() - s.logit_rows..rows.tokens.len());
        }
        if rows.tokens.is_empty() {
            return Ok(Vec::new());
        }
        let before: Vec<usize> = batch.iter().map(|s| s.cache.len()).collect();
        let mut caches: Vec<&mut KvCache> = batch.iter_mut().map(|s| &mut *s.cache).collect();
        let rollback = |caches: &mut [&mut KvCache]| {
            for (c, &len) in caches.iter_mut().zip(&before) {
                c.truncate(len);
            }
        };
        for i in 0..caches.len() {
            let n = rows.seq.iter().filter(|&&s| s == i).count();
            if let Err(e) = caches[i].extend(n) {
                rollback(&mut caches);
                return Err(e);
            }
        }
        let logits = match self.run_layers(lane, &mut caches, &rows, &logit_rows, trace) {
            Ok(l) => l,
            Err(e) => {
                rollback(&mut caches);
                return Err(e);
            }
        };
        if logit_rows.len() == 1 {
            // One row's logits leave as they are, without a copy.
            let mut one = Some(logits);
            return Ok(batch.iter().map(|s| if s.logit_rows > 0 { one.take() } else { None }).collect());
        }
        let mut from = 0;
        Ok(batch
            .iter()
            .map(|s| {
                let n = s.logit_rows * cfg.vocab;
                from += n;
                (n > 0).then(|| logits[from - n..from].to_vec())
            })
            .collect())
    }
}

/// The layer loop in the reference lane (exact FP32, [`ReferenceWeights`]): what the gate's
/// rechecks and the exact caches run.
impl Decoder {
    /// Appends `token` at the next position computed entirely in the reference lane.
    pub fn reference_append(&self, cache: &mut KvCache, token: u32, how: ReferenceWeights) -> Result<Vec<f32>> {
        self.reference_extend(cache, &[token], how)
    }

    /// Appends `tokens` computed entirely in the reference lane, all positions in one pass over
    /// the weights; returns the logits after the last. Bitwise the same as appending them one
    /// at a time.
    pub fn reference_extend(&self, cache: &mut KvCache, tokens: &[u32], how: ReferenceWeights) -> Result<Vec<f32>> {
        self.reference_extend_traced(cache, tokens, how, None)
    }

    /// [`Decoder::reference_extend`], recording the residual stream after each layer into
    /// `trace` (as [`Decoder::forward_traced`] does). On an error the cache is left as it was.
    pub fn reference_extend_traced(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        how: ReferenceWeights,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::BadInput("reference lane: no tokens".into()));
        }
        let first = cache.len();
        cache.extend(tokens.len())?;
        let out = self.reference_rows(cache, first, tokens, how, trace);
        if out.is_err() {
            cache.truncate(first);
        }
        out
    }

    /// Reference-lane logits after the last of `tokens`, from an empty cache (for checks): the
    /// exact lane keeps its K/V in f32.
    pub fn reference_logits(&self, tokens: &[u32], how: ReferenceWeights) -> Result<Vec<f32>> {
        self.reference_extend(&mut self.new_cache_with(KvDtype::F32), tokens, how)
    }

    /// Recomputes position `cache.len() - 1`'s step in the reference lane: the cache must
    /// already hold that position (written by the fast lane); its K/V are replaced in every
    /// layer, and the reference logits are returned.
    pub fn reference_step(&self, cache: &mut KvCache, token: u32, how: ReferenceWeights) -> Result<Vec<f32>> {
        if cache.is_empty() {
            return Err(Error::BadInput("reference step on an empty cache".into()));
        }
        let pos = cache.len() - 1;
        self.reference_rows(cache, pos, &[token], how, None)
    }

    /// Positions `first..first + tokens.len()` (already in the cache) recomputed in the
    /// reference lane, K/V written in every layer; the logits of the last. Each row's
    /// arithmetic depends only on its token, its position and the cache before it.
    pub(crate) fn reference_rows(
        &self,
        cache: &mut KvCache,
        first: usize,
        tokens: &[u32],
        how: ReferenceWeights,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let m = tokens.len();
        debug_assert!(first + m <= cache.len());
        let rows = Rows { seq: vec![0; m], pos: (first..first + m).collect(), tokens: tokens.to_vec() };
        self.run_layers(&how, &mut [cache], &rows, &[m - 1], trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    /// A Gemma 3 header (no weights but the embedding's shape) with `extra` metadata.
    fn gemma_config(extra: &[(&str, Value)]) -> Result<DecoderConfig> {
        let mut md: Vec<(String, Value)> = vec![("general.architecture".into(), Value::String("gemma3".into()))];
        for (k, v) in [
            ("context_length", 32768u32),
            ("embedding_length", 64),
            ("block_count", 12),
            ("feed_forward_length", 128),
            ("attention.head_count", 2),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 64),
            ("attention.sliding_window", 16),
        ] {
            md.push((format!("gemma3.{k}"), Value::U32(v)));
        }
        md.push(("gemma3.rope.freq_base".into(), Value::F32(1e6)));
        md.extend(extra.iter().map(|(k, v)| (format!("gemma3.{k}"), v.clone())));
        let embd = QTensor::quantize(
            &Tensor::zeros((10, 64), candle_core::DType::F32, &Device::Cpu)?,
            candle_core::quantized::GgmlDType::F32,
        )?;
        let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut w = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut w, &md, &[("token_embd.weight", &embd)])?;
        // One file per call: the tests run side by side.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("candle-gate-gemma-config-{}-{n}.gguf", std::process::id()));
        std::fs::write(&path, w.into_inner())?;
        let got = DecoderConfig::from_gguf(&mut GgufFile::open(&path)?);
        let _ = std::fs::remove_file(&path);
        got
    }

    #[test]
    fn gemma3_config_local_layers_windows_and_rope() {
        let c = gemma_config(&[]).unwrap();
        assert_eq!((c.head_dim, c.q_dim(), c.sliding_window), (64, 128, Some(16)));
        // Five local layers to one global.
        let globals: Vec<usize> = (0..12).filter(|&i| !c.local_layers[i]).collect();
        assert_eq!(globals, vec![5, 11]);
        assert_eq!(c.heads(0).window, Some(16));
        assert_eq!(c.heads(5).window, None);
        assert_eq!(c.embed_scale, Some(8.0));
        assert_eq!(c.attn_scale, 0.125);
        assert_eq!(c.inv_freq_local[1], 1.0 / crate::detmath::powf(10000.0, 2.0 / 64.0));
        // The larger files' linear scaling applies to the global layers only.
        let s = gemma_config(&[
            ("rope.scaling.type", Value::String("linear".into())),
            ("rope.scaling.factor", Value::F32(8.0)),
        ])
        .unwrap();
        assert_eq!(s.inv_freq[1], c.inv_freq[1] / 8.0);
        assert_eq!(s.inv_freq_local, c.inv_freq_local);
        // A pattern from the metadata: a period, or one flag per layer.
        let p = gemma_config(&[("attention.sliding_window_pattern", Value::U32(3))]).unwrap();
        assert_eq!((0..12).filter(|&i| !p.local_layers[i]).collect::<Vec<_>>(), vec![2, 5, 8, 11]);
        let flags: Vec<Value> = (0..12).map(|i| Value::Bool(i % 2 == 0)).collect();
        let p = gemma_config(&[("attention.sliding_window_pattern", Value::Array(flags))]).unwrap();
        assert!(p.local_layers[0] && !p.local_layers[1]);
    }

    #[test]
    fn gemma3_what_is_not_supported_is_refused_by_name() {
        for (key, v, needle) in [
            ("rope.scaling.type", Value::String("yarn".into()), "rope scaling `yarn`"),
            ("final_logit_softcapping", Value::F32(30.0), "final_logit_softcapping"),
            ("attention.value_length", Value::U32(32), "value heads"),
        ] {
            let e = gemma_config(&[(key, v)]).err().expect("refused").to_string();
            assert!(e.contains(needle), "{key}: {e}");
        }
    }
}
