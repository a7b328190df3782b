#!/usr/bin/env bash
# The CUDA check: batch invariance and CPU == GPU bits on a real GPU, and the timings
# (docs/CUDA.md). Two halves, because the GPU machine has no Rust and cannot download:
#
#   benches/cuda_check.sh prepare     here: builds `cuda_check` with the `cuda` feature from the
#                                     committed tree (scripts/build-cuda.sh, in target/cuda-build),
#                                     samples every registry model's weights (fetched first) with
#                                     it, packs both into target/cuda-check/ (under 64 MiB)
#   benches/cuda_check.sh run [OUT]   there, from the repo root with target/cuda-check/ copied
#                                     in: inventory, then `cuda_check run`; tables on stdout,
#                                     cuda_check.json and profile-cuda.json in OUT (default .)
#
# `run` exits non-zero when a bitwise claim fails.
set -uo pipefail
cd "$(dirname "$0")/.."
pack=target/cuda-check

case "${1:-}" in
prepare)
    set -e
    python3 -m candle_gate fetch --model all || echo "fetch failed: sampling the models already fetched" >&2
    # Built from the committed tree (git archive HEAD), so that uncommitted edits in the working
    # tree neither break the build nor slip into the binary, in a target directory of its own
    # (CPU builds are neither blocked nor rebuilt).
    target="${CARGO_TARGET_DIR:-$PWD/target/cuda-build}"
    src="$(mktemp -d)"
    git archive HEAD | tar -x -C "$src"
    (cd "$src" && CARGO_TARGET_DIR="$target" scripts/build-cuda.sh build --example cuda_check)
    rm -rf "$src"
    bin="$target/release/examples/cuda_check"
    # The sampler runs here, on that build: it makes no CUDA call, so the link stub stands in for
    # the driver's libcuda.so.1.
    eval "$(scripts/build-cuda.sh env)"
    stub="$(mktemp -d)"
    ln -s "$CUDA_HOME/lib/libcuda.so" "$stub/libcuda.so.1"
    mkdir -p "$pack"
    LD_LIBRARY_PATH="$stub:$CUDA_HOME/lib" "$bin" extract --out "$pack"
    rm -rf "$stub"
    gzip -9 -c "$bin" > "$pack/cuda_check.gz"
    git rev-parse HEAD > "$pack/commit"
    du -ch "$pack"/* | tail -1
    ;;
run)
    out="${2:-.}"
    mkdir -p "$out"
    echo "## Inventory"
    echo "built from: $(cat "$pack/commit" 2>/dev/null | tr '\n' ' ')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
    command -v nvcc >/dev/null && nvcc --version | tail -2
    ldconfig -p | grep -E 'libcuda\.so|cublas|nvrtc|curand|cudart' | head -20
    # The CUDA 13 libraries the binary links (cuBLAS, cuRAND, the runtime): the system's, or the
    # ones in Python's site-packages (PyTorch's wheels), whichever are found.
    dirs=()
    for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13; do
        if ! ldconfig -p | grep -q "$lib"; then
            hit="$(find /usr/local/cuda*/ /opt $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
                -name "$lib" 2>/dev/null | head -1)"
            [ -n "$hit" ] && dirs+=("$(dirname "$hit")")
        fi
    done
    if [ ${#dirs[@]} -gt 0 ]; then
        LD_LIBRARY_PATH="$(printf '%s:' "${dirs[@]}")${LD_LIBRARY_PATH:-}"
        export LD_LIBRARY_PATH
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    fi
    bin="$(mktemp -d)/cuda_check"
    gunzip -c "$pack/cuda_check.gz" > "$bin" && chmod +x "$bin"
    ldd "$bin" | grep -E "not found|cuda|cublas|curand" || true
    echo
    "$bin" run --weights "$pack/weights.gguf" --out "$out"
    ;;
*)
    echo "usage: benches/cuda_check.sh prepare | run [OUT]" >&2
    exit 2
    ;;
esac
