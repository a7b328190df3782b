//! With the `cuda` feature: compiles `cuda/*.cu` to PTX with `nvcc` (found in `$CUDA_HOME/bin`
//! or on `PATH`; `scripts/build-cuda.sh` installs one from PyPI). Without it: nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    // PTX for compute capability 8.0 runs on every later GPU (the driver compiles it at load).
    // --fmad=false: no multiply-add contraction anywhere; the kernels spell out each rounding.
    let status = Command::new(&nvcc)
        .args(["--ptx", "-arch=compute_80", "--fmad=false", "-O3", "-std=c++17", "-o"])
        .arg(out.join("canonical.ptx"))
        .arg("cuda/canonical.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run {} ({e}): install CUDA's nvcc (scripts/build-cuda.sh) or set CUDA_HOME", nvcc.display())
        });
    assert!(status.success(), "nvcc failed on cuda/canonical.cu");
}
