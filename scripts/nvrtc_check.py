"""Compiles candle-gate's CUDA sources with NVRTC (no GPU needed), as the runtime compiler a
GPU-less build machine and a deployment both have: the sources must stay NVRTC-clean, not only
nvcc-clean. Usage: python scripts/nvrtc_check.py CUDA_HOME [--arch compute_80] FILE.cu...

Prints one line per file and exits non-zero with NVRTC's log on the first failure."""
import argparse
import ctypes
import pathlib
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cuda_home")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--arch", default="compute_80")
    a = ap.parse_args()
    home = pathlib.Path(a.cuda_home)
    # NVRTC dlopens its builtins by name: load them first so that no LD_LIBRARY_PATH is needed.
    ctypes.CDLL(str(home / "lib" / "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(home / "lib" / "libnvrtc.so.13"))
    for f in a.files:
        src = pathlib.Path(f).read_bytes()
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), src, f.encode(), 0, None, None) != 0:
            print(f"nvrtc: cannot create a program for {f}", file=sys.stderr)
            return 1
        opts = [f"--gpu-architecture={a.arch}", "--fmad=false", "-std=c++17",
                f"-I{home / 'include'}", f"-I{home / 'include' / 'cccl'}"]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            print(f"nvrtc: {f} failed ({a.arch}):\n{log.value.decode(errors='replace')}", file=sys.stderr)
            return 1
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        entries = ptx.value.count(b".entry ")
        print(f"nvrtc {a.arch}: {f}: {entries} kernels, {size.value} bytes of PTX")
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return 0


if __name__ == "__main__":
    sys.exit(main())
