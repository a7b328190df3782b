//! Shared by the cargo benches (`#[path]`-included): the machine's read bandwidth.

use std::time::Instant;

use rayon::prelude::*;

/// Read bandwidth: a parallel sum over 1 GiB on the rayon pool, best of 5, in GB/s.
pub fn bandwidth_gbs() -> f64 {
    let v = vec![1u64; 1 << 27];
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = v.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        std::hint::black_box(s);
        best = best.max((v.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}
