#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` from the llama.cpp sources vendored in the
# llama-cpp-python sdist, with CMake from PyPI: the serving peer of benches/prefix_cache.py.
# An optional bench step, never a CI dependency.
#
#   benches/build_llama_server.sh [OUT_DIR]     # default target/llama-server; prints the binary's path
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="$(realpath -m "${1:-target/llama-server}")"
mkdir -p "$OUT"
if [ -x "$OUT/build/bin/llama-server" ]; then
  echo "$OUT/build/bin/llama-server"
  exit 0
fi
python -m pip install --quiet "cmake>=3.21" >&2
# The sdist itself, from PyPI's simple index (`pip download` would build its metadata, and its
# build dependencies from source).
python - "$VERSION" "$OUT" >&2 <<'PY'
import hashlib, json, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req))["files"]
sdist = next(f for f in files if f["filename"] == f"llama_cpp_python-{version}.tar.gz")
data = urllib.request.urlopen(sdist["url"]).read()
assert hashlib.sha256(data).hexdigest() == sdist["hashes"]["sha256"], "sha256 mismatch"
open(f"{out}/{sdist['filename']}", "wb").write(data)
print(f"downloaded {sdist['filename']} ({len(data) >> 20} MiB, sha256 checked)")
PY
tar -xzf "$OUT"/llama_cpp_python-"$VERSION".tar.gz -C "$OUT"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
# Native CPU code as llama-cpp-python builds it; no network features.
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$OUT/build" --target llama-server -j "$(nproc)" >&2
echo "$OUT/build/bin/llama-server"
