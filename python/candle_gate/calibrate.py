"""``candle-gate calibrate``: kernel crossovers (``--kernels``) and the gate's tau (``--gate``).

Gate calibration (DESIGN.md §2 "Gate": tau is calibrated from measured discrepancy, not guessed)
measures how far the fast lane's top1-top2 margin moves, in two ways:

1. Batch movement. The calibration prompts (``CALIBRATION_PROMPTS``, disjoint from the probe's
   default prompts, or ``--prompts``) are decoded alone in ``mode`` (default ``gemm``, the lane
   whose numbers depend on the batch) and then, teacher-forced to those tokens, under the
   compositions batch4, batch8 and mixed_prefill (see :mod:`candle_gate.probe`). For every step
   the movement is ``|margin_comp - margin_alone|``; on a step whose argmax flipped it is
   ``margin_comp + margin_alone`` (the change of the gap between the two tokens that swapped).
2. Reference discrepancy. For a few short prefixes (prompt + some generated tokens, at most
   ``max_reference_len`` tokens: the reference lane recomputes from scratch at ~0.03-0.1 s per
   position) the fast lane's logits (one prefill call) are compared with the FP32 reference
   lane's: with a, b the fast lane's top-1 / top-2 tokens the movement is
   ``|(fast[a] - fast[b]) - (ref[a] - ref[b])|``. The fast logits come from one prefill call,
   i.e. the kernel the policy picks for ``len(prefix)`` rows (for ``row_split`` that is the gemm
   path once the prefix is longer than the threshold, not the per-row decode path).

Rule: ``tau = safety x max_margin_shift``, where ``max_margin_shift`` is the largest movement
seen in 1 and 2. A step whose fast-lane margin is at least tau keeps the same argmax under every
composition measured and agrees with the reference lane, with room to spare (``safety``,
default 2); steps below tau are rechecked in the reference lane. If nothing moved at all (an
invariant fast lane that matches the reference bit for bit) tau is 0: the gate never rechecks.

The result is merged into the profile JSON at ``--out`` under ``"gate"``; other keys of an
existing profile are kept.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from . import _native
from .engine import MODES, Model
from .models import resolve
from .probe import Progress, Runner, check_prompts, load_prompts, write_json

# Disjoint from probe.DEFAULT_PROMPTS.
CALIBRATION_PROMPTS: List[Any] = [
    "The Roman Empire was founded",
    "To make a cup of green tea, first",
    "class Stack:\n    def __init__(self):\n",
    "The largest planet in the solar system is",
    "Gravity is a force that",
    "Q: How many legs does a spider have?\nA:",
    "My favourite thing about winter is",
    "The stock market fell sharply today after",
    "SELECT name, age FROM users WHERE",
    "The main ingredients of a pizza are",
    "Electric cars are becoming popular because",
    "In the beginning of the novel, the detective",
    [{"role": "user", "content": "How do I sort a list of dictionaries by a key in Python?"}],
    [{"role": "user", "content": "Describe a sunset over the mountains."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Why do leaves change colour in autumn?"}],
    [{"role": "user", "content": "Give three reasons to learn to play a musical instrument."}],
]

GATE_COMPOSITIONS = ("batch4", "batch8", "mixed_prefill")
RULE = ("tau = safety x max_margin_shift; max_margin_shift = the largest |top1-top2 margin movement| "
        "of the fast lane seen between a request decoded alone and teacher-forced in batch4/batch8/"
        "mixed_prefill (margin sum on flipped steps), and between the fast and FP32 reference lanes "
        "on sampled prefixes")


def calibrate_kernels(args) -> Any:
    """Kernel crossovers: delegated to the native ``calibrate_kernels`` when this build has it."""
    fn = getattr(_native, "calibrate_kernels", None)
    if fn is None:
        raise NotImplementedError(
            "calibrate --kernels is not available in this build (candle_gate._native has no "
            "calibrate_kernels); measure crossovers with `cargo bench` for now")
    model_path = str(resolve(getattr(args, "model", None)))
    return fn(model_path, bool(getattr(args, "quick", False)), args.out)


def _batch_shifts(base, forced) -> List[float]:
    shifts: List[float] = []
    for b, f in zip(base, forced):
        m = min(len(b.margins), len(f.margins), len(b.token_ids), len(f.token_ids))
        mb = b.margins[:m].astype(np.float64)
        mf = f.margins[:m].astype(np.float64)
        flipped = b.token_ids[:m] != f.token_ids[:m]
        shifts.extend(np.where(flipped, mb + mf, np.abs(mf - mb)).tolist())
    return shifts


def _reference_shifts(model: Model, prompt_ids: Sequence[Sequence[int]], base, samples: int,
                      max_len: int, seed: int = 0) -> List[Dict[str, Any]]:
    rng = np.random.default_rng(seed)
    cands = [i for i, p in enumerate(prompt_ids) if len(p) <= max_len]
    if not cands or samples <= 0:
        return []
    out = []
    for j in range(samples):
        i = cands[j % len(cands)]
        gen = [int(t) for t in base[i].token_ids]
        room = min(len(gen) - 1, max_len - len(prompt_ids[i]))
        k = int(rng.integers(0, room + 1)) if room > 0 else 0
        toks = list(prompt_ids[i]) + gen[:k]
        fast = np.asarray(model._native.logits(toks, "fast"), dtype=np.float64)
        ref = np.asarray(model._native.logits(toks, "reference"), dtype=np.float64)
        a, b = np.argsort(-fast, kind="stable")[:2]
        shift = abs((fast[a] - fast[b]) - (ref[a] - ref[b]))
        out.append({"prompt": i, "position": len(toks), "shift": float(shift),
                    "agree": bool(int(np.argmax(ref)) == int(a))})
    return out


def calibrate_gate(model: Union[None, str, Model] = None, mode: str = "gemm",
                   prompts: Optional[Sequence[Any]] = None, max_new_tokens: int = 64,
                   safety: float = 2.0, quick: bool = False, profile: Optional[str] = None,
                   reference_samples: Optional[int] = None, max_reference_len: int = 48,
                   progress: bool = True) -> Dict[str, Any]:
    """Measures the margin movement and returns the profile's ``"gate"`` entry (see the module
    docstring). ``quick``: 6 prompts, at most 16 new tokens, 3 reference samples."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not safety > 0 or safety == float("inf"):
        raise ValueError(f"safety must be a positive number, got {safety!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompts = check_prompts(CALIBRATION_PROMPTS if prompts is None else prompts)
    if quick:
        prompts = prompts[:6]
        max_new_tokens = min(max_new_tokens, 16)
    if reference_samples is None:
        reference_samples = 3 if quick else 8
    if isinstance(model, Model):
        if model._native.mode != mode:
            model = Model.load(model.path, mode=mode, profile=profile)
    else:
        model = Model.load(model, mode=mode, profile=profile)

    runner = Runner(model, prompts, max_new_tokens, mode, "off", 0.0, profile)
    prog = Progress(2 + len(GATE_COMPOSITIONS), enabled=progress, label="calibrate")
    prog.start("alone (batch 1)")
    base = runner.baseline()
    prog.advance()
    forced_tokens = [r.token_ids for r in base]
    per_comp: Dict[str, float] = {}
    shifts: List[float] = []
    for name in GATE_COMPOSITIONS:
        prog.start(f"{name} (teacher-forced)")
        s = _batch_shifts(base, runner.run(name, forced=forced_tokens))
        per_comp[name] = max(s) if s else 0.0
        shifts.extend(s)
        prog.advance()
    prog.start("fast vs reference lane")
    ref = _reference_shifts(model, runner.ids, base, reference_samples, max_reference_len)
    prog.advance()
    prog.finish()

    batch_shift = max(shifts) if shifts else 0.0
    reference_shift = max((r["shift"] for r in ref), default=0.0)
    m = max(batch_shift, reference_shift)
    return {
        "tau": float(safety) * m,
        "rule": RULE,
        "safety": float(safety),
        "max_margin_shift": m,
        "mode": mode,
        "calibration_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "steps": sum(len(r.token_ids) for r in base),
        "batch_shift": batch_shift,
        "batch_shift_by_composition": per_comp,
        "batch_shift_p99": float(np.percentile(shifts, 99)) if shifts else 0.0,
        "reference_shift": reference_shift,
        "reference_positions": len(ref),
        "reference_argmax_disagreements": sum(not r["agree"] for r in ref),
    }


def new_profile() -> Dict[str, Any]:
    return {
        "backend": "cpu",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "candle_gate_version": _native.__version__,
        "dtypes": {},
    }


def merge_gate(path: str, gate: Dict[str, Any]) -> Dict[str, Any]:
    """Writes ``gate`` under ``"gate"`` in the profile at ``path`` (created when missing; other
    keys kept). Refuses to overwrite a file that is not a JSON object."""
    if os.path.exists(path):
        try:
            with open(path) as f:
                prof = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} exists but is not a readable JSON profile ({e}); not overwriting it") from None
        if not isinstance(prof, dict):
            raise ValueError(f"{path} exists but is not a JSON object; not overwriting it")
    else:
        prof = new_profile()
    prof["gate"] = gate
    write_json(prof, path)
    return prof


def main(args) -> int:
    rc = 0
    if getattr(args, "kernels", False):
        try:
            r = calibrate_kernels(args)
        except NotImplementedError as e:
            print(f"candle-gate calibrate: {e}", file=sys.stderr)
            rc = 2
        else:
            if isinstance(r, str) and r.strip():
                print(r.rstrip())
            print(f"kernels: crossover profile written to {args.out}")
    if getattr(args, "gate", False):
        prompts = load_prompts(args.prompts) if getattr(args, "prompts", None) else None
        g = calibrate_gate(model=args.model, mode=args.mode, prompts=prompts,
                           max_new_tokens=args.max_new_tokens, safety=args.safety,
                           quick=bool(getattr(args, "quick", False)), profile=args.profile)
        merge_gate(args.out, g)
        print(f"gate: mode {g['mode']}, {g['calibration_prompts']} prompts x {g['max_new_tokens']} tokens "
              f"({g['steps']} steps): max margin shift {g['max_margin_shift']:.4g} "
              f"(batch {g['batch_shift']:.4g}, reference {g['reference_shift']:.4g} over "
              f"{g['reference_positions']} positions) -> tau = {g['safety']:g} x {g['max_margin_shift']:.4g} "
              f"= {g['tau']:.4g}")
        print(f"gate: written to {args.out}")
        print(json.dumps(g, indent=2))
    return rc
