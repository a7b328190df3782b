//! `cargo bench --bench ops`: the elementwise steps of a layer, in nanoseconds per element over
//! a hidden width of Qwen 1.5B's MLP (8,960): our `exp` through `exp_f32_in_place` and one
//! element at a time (`exp_f32`, the scalar definition it equals bit for bit), and the gated
//! activations built on it; and `exp_f64` over a vocabulary (Qwen's 151,936 logits), which
//! seeded sampling and logprobs take each step. Best of several rounds; run two builds' binaries
//! alternately to compare commits.
use std::hint::black_box;
use std::time::Instant;

use candle_gate::detmath::{exp_f32, exp_f32_in_place, exp_f64, exp_f64_in_place};
use candle_gate::ops::{gelu_tanh_mul, silu_mul};

const WIDTH: usize = 8960;
const VOCAB: usize = 151_936;
const ROUNDS: usize = 7;

/// Nanoseconds per element of `f` over `n` elements, best of `ROUNDS` rounds of ~20 ms.
fn ns_per_element(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let reps = ((0.02 / t.elapsed().as_secs_f64().max(1e-7)) as usize).clamp(1, 100_000);
    (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            (0..reps).for_each(|_| f());
            t.elapsed().as_secs_f64() / reps as f64
        })
        .fold(f64::INFINITY, f64::min)
        * 1e9
        / n as f64
}

fn main() {
    // Gate values as a trained MLP's are: mostly within a few units of zero.
    let mut s = 0x9E3779B97F4A7C15u64;
    let gate: Vec<f32> = (0..WIDTH)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
        })
        .collect();
    let up = vec![0.5f32; WIDTH];
    let mut buf = gate.clone();
    // Logits over temperature, less their maximum: a spread of some tens.
    let scaled: Vec<f64> = (0..VOCAB).map(|i| -((i * 7919 % VOCAB) as f64) / VOCAB as f64 * 40.0).collect();
    let mut wide = scaled.clone();
    let rows = [
        (
            "exp, exp_f32 per element",
            ns_per_element(WIDTH, || black_box(&gate).iter().zip(&mut buf).for_each(|(&x, b)| *b = exp_f32(x))),
        ),
        (
            "exp, exp_f32_in_place",
            ns_per_element(WIDTH, || {
                buf.copy_from_slice(black_box(&gate));
                exp_f32_in_place(&mut buf)
            }),
        ),
        (
            "silu_mul",
            ns_per_element(WIDTH, || {
                buf.copy_from_slice(black_box(&up));
                silu_mul(&mut buf, &gate)
            }),
        ),
        (
            "gelu_tanh_mul",
            ns_per_element(WIDTH, || {
                buf.copy_from_slice(black_box(&up));
                gelu_tanh_mul(&mut buf, &gate)
            }),
        ),
        (
            "exp_f64 per element, vocab",
            ns_per_element(VOCAB, || black_box(&scaled).iter().zip(&mut wide).for_each(|(&x, w)| *w = exp_f64(x))),
        ),
        (
            "exp_f64_in_place, vocab",
            ns_per_element(VOCAB, || {
                wide.copy_from_slice(black_box(&scaled));
                exp_f64_in_place(&mut wide)
            }),
        ),
    ];
    println!("{:<28} {:>12}", "step", "ns/element");
    for (name, ns) in rows {
        println!("{name:<28} {ns:>12.3}");
    }
}
