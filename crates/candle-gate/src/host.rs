//! What decides a result's bits besides the weights, the policy and the tokens: the target the
//! binary was compiled for, and the run-time dispatched code a mode runs on this host.
//!
//! candle-gate's own kernels (`invariant`, `gemv`, `split_k_f16`, the reference lane) and its
//! math (`detmath`) are compiled for a fixed target with no run-time dispatch, so in those modes
//! the compile target is the whole story. Candle's dense matmul (the `gemm` crate: its
//! micro-kernel ISA is picked at run time and its k blocking follows the host's cache sizes) and
//! Candle's repacked quantized kernels (AVX-512 VNNI, AVX-VNNI or AVX2, picked at run time) are
//! not: modes that use them also carry what those picked here, so two hosts whose bits may
//! differ never share a fingerprint.

use crate::dispatch::Mode;

macro_rules! enabled_features {
    ($($f:literal),* $(,)?) => {{
        let mut v: Vec<&'static str> = Vec::new();
        $(if cfg!(target_feature = $f) { v.push($f); })*
        v
    }};
}

/// The compile target: architecture and the SIMD features enabled at compile time, e.g.
/// `x86_64:avx,avx2,bmi2,f16c,fma,...`.
pub fn compile_target() -> String {
    let features = enabled_features!(
        "sse2",
        "sse3",
        "ssse3",
        "sse4.1",
        "sse4.2",
        "popcnt",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "bmi1",
        "bmi2",
        "lzcnt",
        "movbe",
        "avx512f",
        "avx512bw",
        "avx512dq",
        "avx512vl",
        "avx512vnni",
        "avxvnni",
        "neon",
        "fp16",
        "dotprod",
        "simd128",
    );
    format!("{}:{}", std::env::consts::ARCH, features.join(","))
}

/// The CPU's model name (`/proc/cpuinfo`), for records of where bits were produced.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// What the `gemm` crate (Candle's dense CPU matmul) picks on this host: its micro-kernel ISA and
/// the cache sizes its blocking is computed from.
pub fn gemm_dispatch() -> String {
    let caches = gemm_common::cache::CACHE_INFO.iter().map(|c| c.cache_bytes.to_string()).collect::<Vec<_>>();
    format!("gemm[{};caches={}]", gemm_isa(), caches.join("/"))
}

#[cfg(target_arch = "x86_64")]
fn gemm_isa() -> String {
    // The crate prefers AVX-512F when built with its x86-v4 feature, else FMA, else scalar;
    // both detections are recorded so that either build is covered.
    let f = |name: &str, on: bool| if on { name.to_string() } else { format!("no-{name}") };
    format!(
        "{},{}",
        f("fma", std::is_x86_feature_detected!("fma")),
        f("avx512f", std::is_x86_feature_detected!("avx512f"))
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn gemm_isa() -> String {
    std::env::consts::ARCH.to_string()
}

/// The tier Candle's repacked quantized CPU kernels (Q4K, Q6K, ...) pick on this host, with the
/// same rule Candle applies (including its environment overrides).
#[cfg(target_arch = "x86_64")]
pub fn candle_quantized_dispatch() -> String {
    let on = |f: &str| std::env::var(f).as_deref() == Ok("1");
    let (force_avx2, force_vnni) = (on("MISTRALRS_FORCE_AVX2"), on("MISTRALRS_FORCE_AVXVNNI"));
    let level = if !force_avx2
        && !force_vnni
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512vnni")
    {
        "avx512vnni"
    } else if !force_avx2
        && (force_vnni || std::is_x86_feature_detected!("avxvnni"))
        && std::is_x86_feature_detected!("avx2")
    {
        "avxvnni"
    } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        "avx2"
    } else {
        "generic"
    };
    // AMX tiles (CPUID leaf 7, EDX bits 24 and 25) are used on top of the AVX-512 VNNI tier.
    let info = std::arch::x86_64::__cpuid_count(7, 0);
    let amx = info.edx & (1 << 24) != 0 && info.edx & (1 << 25) != 0;
    format!("candle_q[{level}{}]", if amx { ",amx" } else { "" })
}

#[cfg(not(target_arch = "x86_64"))]
pub fn candle_quantized_dispatch() -> String {
    format!("candle_q[{}]", std::env::consts::ARCH)
}

/// Whether a mode's CPU fast lane runs Candle's dense matmul / Candle's quantized dispatch.
fn uses_gemm(mode: Mode) -> bool {
    // row_split runs the dense GEMM above its threshold; native runs it for F32/F16 weights.
    matches!(mode, Mode::Gemm | Mode::GemmF16 | Mode::RowSplit | Mode::Native)
}

/// Candle's block dot products (`vec_dot*`, used by every quantized kernel of ours) take their
/// AVX2+FMA path after a run-time check: every host that runs an `x86-64-v3` build passes it,
/// but a build for an older target would not record the choice in `compile_target`.
#[cfg(target_arch = "x86_64")]
fn candle_vec_dot() -> &'static str {
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        "vec_dot[avx2+fma]"
    } else {
        "vec_dot[generic]"
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn candle_vec_dot() -> &'static str {
    "vec_dot[generic]"
}

/// Everything about this host and build that can change a result's bits in `mode`: hashed into
/// fingerprints. Equal signatures (with equal weights, policy and gate) mean equal bits.
pub fn signature(mode: Mode) -> String {
    let mut s = format!("target={};{}", compile_target(), candle_vec_dot());
    if uses_gemm(mode) {
        s.push(';');
        s.push_str(&gemm_dispatch());
    }
    if mode == Mode::Native {
        s.push(';');
        s.push_str(&candle_quantized_dispatch());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_names_the_target_and_the_dispatch_a_mode_uses() {
        let inv = signature(Mode::Invariant);
        assert!(inv.starts_with(&format!("target={}:", std::env::consts::ARCH)), "{inv}");
        assert!(!inv.contains("gemm[") && !inv.contains("candle_q["), "{inv}");
        assert_eq!(signature(Mode::SplitKF16), inv);
        assert!(signature(Mode::Gemm).contains("gemm["));
        assert!(signature(Mode::Native).contains("candle_q["));
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
        assert!(inv.contains("avx2") && inv.contains("fma"), "{inv}");
    }
}
