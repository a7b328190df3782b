//! The buffers one step of the layer loop writes, kept between steps so that a step reuses the
//! previous step's allocations instead of making its own. Values never carry over: [`sized`]
//! zeroes a buffer before a step writes it, so reuse cannot change a bit.

use std::sync::Mutex;

#[derive(Default)]
pub(crate) struct Scratch {
    /// The normalized residual rows: the input of the q/k/v and gate/up projections.
    pub xn: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Attention's output rows, the input of `wo`.
    pub attn: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// The output of `wo` or `w_down`: what a sublayer adds to the residual.
    pub proj: Vec<f32>,
    /// RoPE tables, `rows × head_dim / 2` each.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// Local (sliding-window) layers' RoPE tables, when their base differs (Gemma).
    pub cos_local: Vec<f32>,
    pub sin_local: Vec<f32>,
}

/// Scratch for the forwards running at once (usually one per model: the engine steps from one
/// thread). A forward takes one for its duration and gives it back; none is shared.
#[derive(Default)]
pub(crate) struct ScratchPool(Mutex<Vec<Scratch>>);

impl ScratchPool {
    pub fn take(&self) -> Scratch {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }
    pub fn give_back(&self, s: Scratch) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }
}

/// `buf` as `len` zeros, in its own allocation when that is big enough.
pub(crate) fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.clear();
    buf.resize(len, 0.0);
    &mut buf[..len]
}
