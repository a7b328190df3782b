//! The per-row math of the forward, shared by both lanes: dot products with a fixed reduction
//! order, RMSNorm, RoPE, SiLU and the greedy choice (attention is [`crate::attention`]). Each result
//! depends only on its own row (and its own sequence's cache), never on what else is in the
//! step; transcendental functions come from [`crate::detmath`], not the platform's libm.

/// Dot product with eight fixed lanes: vectorizes, and its order depends only on the length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub fn dot4(a: [&[f32]; 4], b: [&[f32]; 4]) -> [f32; 4] {
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

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// Interleaved-pair RoPE (GGUF llama layout) on one head.
#[inline]
pub fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    for i in 0..cos.len() {
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos[i] - b * sin[i];
        head[2 * i + 1] = a * sin[i] + b * cos[i];
    }
}

/// NeoX-style RoPE: dimension `i` rotates with `i + head_dim / 2`.
pub fn rope_neox(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos[i] - b * sin[i];
        head[i + half] = a * sin[i] + b * cos[i];
    }
}

/// RoPE's cosines and sines at position `pos`, one per inverse frequency.
pub fn rope_tables(inv_freq: &[f32], pos: usize, cos: &mut [f32], sin: &mut [f32]) {
    for ((&f, c), s) in inv_freq.iter().zip(cos).zip(sin) {
        let (sn, cs) = crate::detmath::sin_cos_f64((pos as f32 * f) as f64);
        *c = cs as f32;
        *s = sn as f32;
    }
}

/// `up[i] *= gelu(gate[i])`, GELU's tanh form: `0.5·x·(1 + tanh(u))` with
/// `u = √(2/π)·(x + 0.044715·x³)`, computed as `x / (1 + exp(−2u))` (the same function; `exp`
/// is our own, so the bits do not depend on the host's libm).
pub fn gelu_tanh_mul(up: &mut [f32], gate: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    gated(up, gate, |x| -2.0 * (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)), |x, e| x / (1.0 + e));
}

/// `up[i] *= act(gate[i], exp(arg(gate[i])))`, through [`crate::detmath::exp_f32_in_place`]
/// a few of its batches at a time: the same bits as element by element, with the batches'
/// `exp` chains in flight together.
#[inline(always)]
fn gated(up: &mut [f32], gate: &[f32], arg: impl Fn(f32) -> f32, act: impl Fn(f32, f32) -> f32) {
    assert_eq!(up.len(), gate.len(), "gated activation: different lengths");
    const CHUNK: usize = 4 * crate::detmath::EXP_BATCH;
    for (u, g) in up.chunks_mut(CHUNK).zip(gate.chunks(CHUNK)) {
        let mut e = [0f32; CHUNK];
        let e = &mut e[..g.len()];
        e.iter_mut().zip(g).for_each(|(e, &x)| *e = arg(x));
        crate::detmath::exp_f32_in_place(e);
        for ((u, &x), &e) in u.iter_mut().zip(g).zip(e.iter()) {
            *u *= act(x, e);
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + crate::detmath::exp_f32(-x))
}

/// `up[i] *= silu(gate[i])`: the same bits as [`silu`] element by element.
pub fn silu_mul(up: &mut [f32], gate: &[f32]) {
    gated(up, gate, |x| -x, |x, e| x / (1.0 + e));
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

/// A hash of the exact bits of a vector of floats (logits, a layer's output).
pub fn hash_bits(logits: &[f32]) -> u64 {
    // FNV-1a over the exact bits: equal iff (with overwhelming probability) bitwise equal.
    let mut h = 0xcbf29ce484222325u64;
    for v in logits {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }

    /// Gate values of every size the activations meet, a few past `exp`'s vector range.
    fn gates(next: &mut impl FnMut() -> f32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| match i % 97 {
                5 => 200.0 * next(),
                40 => 1800.0 * next(),
                _ => 16.0 * next(),
            })
            .collect()
    }

    /// Every length around the batch sizes of `exp_f32_in_place` and of the activations' chunks.
    const LENGTHS: [usize; 14] = [0, 1, 7, 8, 9, 17, 31, 32, 33, 127, 128, 129, 161, 1536];

    #[test]
    fn gated_activations_are_their_formulas_element_by_element() {
        fn gelu(x: f32) -> f32 {
            x / (1.0 + crate::detmath::exp_f32(-2.0 * (0.797_884_6 * (x + 0.044715 * x * x * x))))
        }
        type Activation = (&'static str, fn(&mut [f32], &[f32]), fn(f32) -> f32);
        let activations: [Activation; 2] = [("silu", silu_mul, silu), ("gelu_tanh", gelu_tanh_mul, gelu)];
        let mut next = noise(0x13198A2E03707344);
        for (name, mul, one) in activations {
            for len in LENGTHS {
                let gate = gates(&mut next, len);
                let up: Vec<f32> = (0..len).map(|_| next()).collect();
                let mut got = up.clone();
                mul(&mut got, &gate);
                for i in 0..len {
                    assert_eq!(got[i].to_bits(), (up[i] * one(gate[i])).to_bits(), "{name}: len {len} at {i}");
                }
            }
        }
    }

    #[test]
    fn dot4_is_four_dots_bit_for_bit() {
        let mut next = noise(0x243F6A8885A308D3);
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
