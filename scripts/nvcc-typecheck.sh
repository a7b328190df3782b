#!/usr/bin/env bash
# Stands in for nvcc while `scripts/build-cuda.sh check` type-checks the `cuda` feature: Candle's
# build script (cudaforge, through $NVCC) compiles Candle's own CUDA kernels, which takes minutes
# and is not part of type-checking Rust. This writes the files it would (empty PTX, an empty
# archive) and passes version queries to the real nvcc ($CANDLE_GATE_REAL_NVCC). candle-gate's
# own kernels are compiled for real by the check (nvcc, ptxas sm_90, NVRTC). Never use the
# outputs for a build: `check` keeps them in a target directory of their own.
set -euo pipefail
args=" $* "
case "$args" in
    *" --version "*|*" --list-gpu-code "*|*" --list-gpu-arch "*) exec "$CANDLE_GATE_REAL_NVCC" "$@" ;;
esac
out="" outdir="" prev="" last=""
for a in "$@"; do
    case "$prev" in -o) out="$a" ;; --output-directory) outdir="$a" ;; esac
    prev="$a" last="$a"
done
if [[ "$args" == *" --ptx "* ]]; then
    [ -n "$out" ] || out="${outdir:-.}/$(basename "${last%.*}").ptx"
    printf '// candle-gate type-check stub: no code\n' > "$out"
elif [[ "$args" == *" --lib "* ]]; then
    printf '!<arch>\n' > "$out"
elif [ -n "$out" ]; then
    : > "$out"
fi
