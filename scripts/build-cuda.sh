#!/usr/bin/env bash
# Builds candle-gate with the `cuda` feature on a machine with no GPU and no CUDA install: the
# CUDA 13.0 toolchain comes from PyPI wheels (nvcc, the runtime headers, NVVM, CCCL) into
# $CANDLE_GATE_CUDA (default ~/.cache/candle-gate/cuda-13.0).
#
#   scripts/build-cuda.sh check          our kernels through nvcc and ptxas for sm_90 (fails on
#                                        register spills) and through NVRTC, then cargo check
#                                        --features cuda (Candle's kernels stubbed, not compiled):
#                                        what CI runs
#   scripts/build-cuda.sh build [ARGS]   cargo build --release --features cuda ARGS: also fetches
#                                        cuBLAS and cuRAND (linked by Candle) and makes a libcuda
#                                        link stub; the driver's libcuda.so.1 is used at run time
#   scripts/build-cuda.sh env            prints the environment lines the builds use
#
# CUDA_COMPUTE_CAP picks the GPU generation Candle's own kernels are compiled for (default 90,
# the H100/H200; 80, 86 or 89 for Ampere and Ada). candle-gate's kernels are PTX for 8.0, which
# the driver compiles for any later GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${CANDLE_GATE_CUDA:-$HOME/.cache/candle-gate/cuda-13.0}"
cuda="$root/nvidia/cu13"
toolchain=("nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*")
libraries=("nvidia-cublas==13.0.*" "nvidia-curand==10.*")

install() {  # pip install --target does not merge into an existing tree: install everything at once
    local what="$1"; shift
    [ -e "$root/.installed-$what" ] && return 0
    [ "$what" = toolchain ] && [ -e "$root/.installed-libraries" ] && return 0
    local wheels; wheels="$(mktemp -d)"
    echo "candle-gate: fetching the CUDA 13.0 wheels ($*) into $root" >&2
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "${toolchain[@]}" "$@"
    rm -rf "$root.new" && python3 -m pip install -q --no-deps --target "$root.new" "$wheels"/*.whl
    rm -rf "$root" && mv "$root.new" "$root" && rm -rf "$wheels"
    touch "$root/.installed-$what"
}

link_names() {  # the unversioned names the linker looks for
    for lib in "$cuda"/lib/lib*.so.*; do
        local base="${lib%%.so.*}.so"
        [ -e "$base" ] || ln -s "$(basename "$lib")" "$base"
    done
}

libcuda_stub() {  # libcuda.so.1 is the driver's; a stub with its symbols is enough to link
    [ -e "$cuda/lib/libcuda.so" ] && return 0
    local syms; syms="$(mktemp)"
    nm -u "${CARGO_TARGET_DIR:-target}"/release/deps/libcudarc-*.rlib 2>/dev/null | awk '$1 == "U" && $2 ~ /^cu[A-Z]/ {print $2}' | sort -u > "$syms"
    [ -s "$syms" ] || { echo "no cudarc symbols found: build cudarc first" >&2; exit 1; }
    awk '{print "void " $1 "(void) {}"}' "$syms" > "$syms.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/libcuda.so" "$syms.c"
    rm -f "$syms" "$syms.c"
}

export CUDA_HOME="$cuda" CUDA_ROOT="$cuda" PATH="$cuda/bin:$PATH" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

ptxas_check() {  # our kernels, as CI checks them: PTX, then SASS for sm_90 with no spills
    local out; out="$(mktemp -d)"
    nvcc --ptx -arch=compute_80 --fmad=false -O3 -std=c++17 -o "$out/canonical.ptx" crates/candle-gate/cuda/canonical.cu
    ptxas -arch=sm_90 -O3 -v -o "$out/canonical.cubin" "$out/canonical.ptx" 2> "$out/ptxas.log"
    local kernels spills
    kernels="$(grep -c "Compiling entry function" "$out/ptxas.log")"
    spills="$(grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$out/ptxas.log" || true)"
    if [ -n "$spills" ]; then
        echo "ptxas sm_90: register spills in candle-gate's kernels:" >&2
        grep -E "Compiling entry|spill" "$out/ptxas.log" >&2
        exit 1
    fi
    echo "ptxas sm_90: $kernels kernels, no register spills"
    python3 scripts/nvrtc_check.py "$cuda" crates/candle-gate/cuda/canonical.cu
    rm -rf "$out"
}

case "${1:-check}" in
    check)
        install toolchain
        ptxas_check
        # Candle's own kernels are not compiled here (scripts/nvcc-typecheck.sh stands in for its
        # nvcc): their outputs are empty, so they live in a target directory of their own.
        NVCC="$PWD/scripts/nvcc-typecheck.sh" CANDLE_GATE_REAL_NVCC="$cuda/bin/nvcc" \
            CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/cuda-typecheck" \
            cargo check --release -p candle-gate --features cuda --all-targets
        ;;
    build)
        shift || true
        install libraries "${libraries[@]}"
        link_names
        # cudarc's symbols, for the stub: build the library first (no linking needed).
        cargo build --release -p candle-gate --features cuda
        libcuda_stub
        # cudarc's build script puts $CUDA_ROOT/lib on the link path.
        cargo build --release -p candle-gate --features cuda "$@"
        ;;
    env)
        echo "export CUDA_HOME=$cuda CUDA_ROOT=$cuda PATH=$cuda/bin:\$PATH CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
        ;;
    *)
        echo "usage: scripts/build-cuda.sh [check|build [CARGO ARGS]|env]" >&2
        exit 2
        ;;
esac
