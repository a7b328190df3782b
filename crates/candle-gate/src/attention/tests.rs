use super::*;

use crate::kv_cache::KvPool;

fn noise(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// A sequence: its K/V for layer 0 (`[pos][kv_dim]`) and one query row per position.
struct Seq {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

fn seq(h: Heads, len: usize, seed: u64) -> Seq {
    let mut next = noise(seed);
    let kvd = h.n_kv_head * h.head_dim;
    // Spread wide enough that some probabilities underflow, as in real models.
    Seq {
        k: (0..len * kvd).map(|_| 6.0 * next()).collect(),
        v: (0..len * kvd).map(|_| 2.0 * next()).collect(),
        q: (0..len * h.n_head * h.head_dim).map(|_| 6.0 * next()).collect(),
    }
}

fn cache(h: Heads, s: &Seq, len: usize, dtype: KvDtype, scatter: Option<u64>) -> KvCache {
    let lay = BlockLayout { n_layer: 1, n_kv_head: h.n_kv_head, head_dim: h.head_dim, dtype };
    let pool = KvPool::bounded(lay, len.div_ceil(KV_BLOCK) + 40);
    if let Some(seed) = scatter {
        pool.shuffle_free_list(seed);
    }
    let mut c = KvCache::in_pool(pool);
    c.extend(len).unwrap();
    let kvd = h.n_kv_head * h.head_dim;
    for p in 0..len {
        c.write(0, p, &s.k[p * kvd..(p + 1) * kvd], &s.v[p * kvd..(p + 1) * kvd]).unwrap();
    }
    c
}

/// Attention of the rows `(seq, first..last)` of several sequences in one call.
fn run(
    h: Heads,
    caches: &[&KvCache],
    seqs: &[&Seq],
    rows: &[(usize, std::ops::Range<usize>)],
    tier: Tier,
) -> Vec<Vec<u32>> {
    let qd = h.n_head * h.head_dim;
    let (mut q, mut sq, mut pos) = (vec![], vec![], vec![]);
    for (i, r) in rows {
        for p in r.clone() {
            q.extend_from_slice(&seqs[*i].q[p * qd..(p + 1) * qd]);
            sq.push(*i);
            pos.push(p);
        }
    }
    let mut out = vec![f32::NAN; q.len()];
    attend_rows(h, 0, &q, &sq, &pos, caches, &mut out, tier);
    out.chunks(qd).map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
}

fn tiers() -> Vec<Tier> {
    let mut t = vec![Tier::Portable];
    if cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")) {
        t.push(Tier::Avx2);
        if Isa::best() == Isa::Avx512 {
            t.push(Tier::Avx512);
        }
    }
    t
}

fn pools() -> [rayon::ThreadPool; 2] {
    [1, 3].map(|n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap())
}

/// A row's output bits depend only on its query and its own sequence's K/V: alone as a
/// decode row, inside prefill tiles of any size, next to another sequence's rows, on 1 or 3
/// threads, with its blocks scattered over the pool, and in either tier.
#[test]
fn a_rows_bits_depend_on_nothing_but_its_own_history() {
    let shapes = [
        Heads::new(9, 3, 64),
        Heads::new(14, 2, 64),
        Heads::new(4, 2, 128),
        Heads::new(2, 1, 36),
        // Sliding windows: one ending inside a split, one shorter than a block.
        Heads { window: Some(300), ..Heads::new(4, 1, 256) },
        Heads { window: Some(20), ..Heads::new(2, 1, 36) },
        // The vector tier's groups: eight queries a pass, five over a head_dim that ends in
        // half a pass, and three over one that takes a pass of 32 values, then of 16.
        Heads::new(16, 2, 64),
        Heads::new(10, 2, 72),
        Heads::new(3, 1, 48),
    ];
    for (si, h) in shapes.into_iter().enumerate() {
        let len = [600, 530, 300, 280, 600, 280, 290, 300, 290][si];
        for dtype in KvDtype::ALL {
            let a = seq(h, len, 11 + si as u64);
            let b = seq(h, 90, 23 + si as u64);
            let (ca, cb) = (cache(h, &a, len, dtype, None), cache(h, &b, 90, dtype, None));
            let scattered = cache(h, &a, len, dtype, Some(7));
            assert_ne!(ca.block_ids(), scattered.block_ids());
            // Each probed row alone, as a decode step, is the reference.
            let mut probes: Vec<usize> =
                [0, 1, 31, 32, 255, 256, 257, 511, 512].into_iter().filter(|&p| p < len).collect();
            probes.push(len - 1);
            let alone: Vec<Vec<u32>> =
                probes.iter().map(|&p| run(h, &[&ca], &[&a], &[(0, p..p + 1)], Tier::Portable).remove(0)).collect();
            for tier in tiers() {
                for pool in pools() {
                    pool.install(|| {
                        for (&p, want) in probes.iter().zip(&alone) {
                            let got = run(h, &[&scattered], &[&a], &[(0, p..p + 1)], tier).remove(0);
                            assert_eq!(&got, want, "{h:?} {dtype:?} {tier:?} row {p} alone, scattered");
                        }
                        // The whole sequence as one prefill, next to another sequence's rows.
                        let all = run(h, &[&cb, &ca], &[&b, &a], &[(0, 60..90), (1, 0..len)], tier);
                        for (&p, want) in probes.iter().zip(&alone) {
                            assert_eq!(&all[30 + p], want, "{h:?} {dtype:?} {tier:?} row {p} in a prefill");
                        }
                        // Chunks of 7 positions.
                        for &p in &probes {
                            let c0 = p - p % 7;
                            let got = run(h, &[&ca], &[&a], &[(0, c0..(c0 + 7).min(len))], tier);
                            assert_eq!(
                                &got[p - c0],
                                &alone[probes.iter().position(|&x| x == p).unwrap()],
                                "{h:?} {tier:?} row {p} in a chunk of 7"
                            );
                        }
                    });
                }
            }
        }
    }
}

/// Against attention in f64 over the same (stored) K/V: the kernel's error stays small.
#[test]
fn attention_is_close_to_an_f64_reference() {
    for window in [None, Some(300), Some(5)] {
        close_to_f64(Heads { window, ..Heads::new(4, 2, 64) });
    }
}

fn close_to_f64(h: Heads) {
    let len = 1100;
    let a = seq(h, len, 5);
    let c = cache(h, &a, len, KvDtype::F32, None);
    let rows: Vec<usize> = vec![0, 7, 255, 256, 700, len - 1];
    let (hd, kvd, qd) = (64, 128, 256);
    let mut worst = 0f64;
    for &p in &rows {
        let got = run(h, &[&c], &[&a], &[(0, p..p + 1)], Tier::current()).remove(0);
        for hh in 0..4 {
            let kvh = hh / 2;
            let q = &a.q[p * qd + hh * hd..p * qd + (hh + 1) * hd];
            let from = h.window.map_or(0, |w| (p + 1).saturating_sub(w));
            let s: Vec<f64> = (from..=p)
                .map(|t| {
                    (0..hd).map(|d| q[d] as f64 * a.k[t * kvd + kvh * hd + d] as f64).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let want = (from..=p).map(|t| e[t - from] * a.v[t * kvd + kvh * hd + d] as f64).sum::<f64>() / z;
                let g = f32::from_bits(got[hh * hd + d]) as f64;
                worst = worst.max((g - want).abs());
            }
        }
    }
    // Values are within ±1; f32 accumulation over ~1000 positions.
    assert!(worst < 2e-6, "{h:?}: largest absolute error {worst:e}");
}

fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

#[test]
fn exp_neg_is_within_two_ulp_of_exp() {
    let mut worst = 0;
    let mut x = EXP_MIN;
    while x <= 0.0 {
        let want = (x as f64).exp() as f32;
        worst = worst.max(ulps(exp_neg(x), want));
        x += 0.000_731;
    }
    assert!(worst <= 2, "exp_neg off by {worst} ulp");
    assert_eq!(exp_neg(0.0), 1.0);
    assert_eq!(exp_neg(-0.0), 1.0);
    assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_neg(-88.0), 0.0);
    assert_eq!(exp_neg(f32::NAN), 0.0);
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
#[test]
fn exp_neg8_is_exp_neg_bit_for_bit() {
    use std::arch::x86_64::*;
    let ln2 = std::f32::consts::LN_2;
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        -1e-30,
        -1e-10,
        EXP_MIN,
        EXP_MIN - 1e-5,
        -87.0,
        -87.5,
        -88.0,
        -1000.0,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::MIN_POSITIVE,
    ];
    for k in 0..130 {
        let mid = -(k as f32 + 0.5) * ln2;
        xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
    }
    let mut s = 0x9E3779B97F4A7C15u64;
    for _ in 0..40_000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        xs.push(-((s >> 40) as f32 / (1u64 << 24) as f32) * 90.0);
    }
    while xs.len() % 8 != 0 {
        xs.push(-1.0);
    }
    for c in xs.chunks_exact(8) {
        let mut got = [0f32; 8];
        // SAFETY: AVX2 is enabled at compile time.
        unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp_neg8(_mm256_loadu_ps(c.as_ptr()))) };
        for (g, &x) in got.iter().zip(c) {
            assert_eq!(g.to_bits(), exp_neg(x).to_bits(), "exp_neg({x:e})");
        }
    }
}
