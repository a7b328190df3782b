"""``candle-gate calibrate``: kernel crossovers (``--kernels``) and the gate's tau (``--gate``).

Gate calibration (docs/DESIGN.md §2 "Gate": tau is calibrated from measured discrepancy, not guessed).
The calibration prompts (``CALIBRATION_PROMPTS``, disjoint from the probe's default prompts and
from the prompts the tests judge determinism on, or ``--prompts``) are decoded alone in ``mode``
(default :data:`CALIBRATION_MODE`, a lane whose numbers depend on the batch by construction) and then, teacher-forced to those
tokens, under the compositions batch4, batch8 and mixed_prefill (see :mod:`candle_gate.probe`).
Every run uses ``gate="shadow"``: each step also runs the reference step over the cache the fast
lane wrote (exactly what a recheck computes), records its margin and puts the fast lane's K/V
back, so the tokens are the ungated lane's. Three movements are measured per step (a margin
"moves" by ``|m1 - m2|``, or by ``m1 + m2`` when the two top tokens differ, the change of the gap
between the two tokens that swapped; when the top token of a recheck is unknown because the
reference lane would have changed it, the sum is taken too):

1. ``batch_shift``: the fast lane's margin, alone vs each composition.
2. ``reference_shift``: the fast lane's margin vs the recheck's, at the same step.
3. ``recheck_shift``: the recheck's margin, alone vs each composition. A recheck removes the
   step's own batch noise but not what earlier fast-lane steps left in the cache.

Rule: ``tau = safety x max(batch_shift, reference_shift)``: a step whose fast-lane margin is at
least tau keeps its argmax under every composition measured and agrees with the reference lane,
with room to spare (``safety``, default 2); steps below tau are rechecked.
``deep_tau = safety x recheck_shift``: a recheck whose own margin is below it rebuilds the
sequence's cache in the reference lane ("deep recheck"), after which the token depends on the
token history alone. If nothing moved (an invariant lane that matches the reference bit for bit)
both are 0 and the gate never rechecks.

The result is merged into the profile JSON at ``--out`` (default: the user's profile, which a
gated engine reads before the one shipped in the package) under ``"gates"``, one entry per
mode and model file (sha256); other entries and keys of an existing profile are kept.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from . import _native
from .engine import DEFAULT_MAX_NEW_TOKENS, MODES, Model, Result, layout_for
from .probe import Runner, check_prompts, progress_bar

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

#: The mode the gate is calibrated in (``calibrate --gate``) and measured in (``bench gate``) by
#: default: a lane whose bits follow the batch by construction (the stand-in for a GPU's
#: half-precision lane), so there are margin movements to measure and flips to catch; in
#: ``invariant`` mode nothing moves and tau comes out 0.
CALIBRATION_MODE = "split_k_f16"

GATE_COMPOSITIONS = ("batch4", "batch8", "mixed_prefill")
RULE = ("tau = safety x max(batch_shift, reference_shift); deep_tau = safety x recheck_shift. "
        "batch_shift: the fast lane's top1-top2 margin, alone vs teacher-forced in batch4/batch8/"
        "mixed_prefill; reference_shift: fast lane vs the reference step over the same cache; "
        "recheck_shift: the reference step's margin, alone vs those compositions "
        "(movement |m1-m2|, or m1+m2 where the top token changed)")


def calibrate_kernels(out: str, quick: bool = False) -> str:
    """Times the kernels (``quick``: only the default model's dtypes and shapes), writes their
    crossover thresholds into the profile at ``out`` (its gate calibrations kept) and returns the
    table. The measuring is the Rust crate's (``profile::measure``)."""
    return _native.calibrate_kernels(quick=bool(quick), out=str(out))


def _moves(m1: np.ndarray, m2: np.ndarray, swapped: np.ndarray) -> np.ndarray:
    m1, m2 = m1.astype(np.float64), m2.astype(np.float64)
    return np.where(swapped, m1 + m2, np.abs(m1 - m2))


def _steps(a: Result, b: Result) -> int:
    return min(len(a.token_ids), len(b.token_ids))


def batch_shifts(base: Sequence[Result], comp: Sequence[Result]) -> np.ndarray:
    """Fast-lane margin movement, step by step, between two runs of the same tokens."""
    out = [np.zeros(0)]
    for a, b in zip(base, comp):
        n = _steps(a, b)
        out.append(_moves(a.margins[:n], b.margins[:n], a.token_ids[:n] != b.token_ids[:n]))
    return np.concatenate(out)


def reference_shifts(runs: Sequence[Result]) -> np.ndarray:
    """Fast lane vs the recheck at the same step (shadow runs)."""
    out = [np.zeros(0)]
    for r in runs:
        out.append(_moves(r.margins, r.reference_margins, r.corrected.astype(bool)))
    return np.concatenate(out)


def recheck_shifts(base: Sequence[Result], comp: Sequence[Result]) -> np.ndarray:
    """The recheck's margin movement between two shadow runs of the same tokens. The recheck's
    top token is the fast lane's unless it would have corrected it; when either would have, the
    tokens are taken to differ (an upper bound)."""
    out = [np.zeros(0)]
    for a, b in zip(base, comp):
        n = _steps(a, b)
        swapped = ((a.token_ids[:n] != b.token_ids[:n]) | a.corrected[:n].astype(bool)
                   | b.corrected[:n].astype(bool))
        out.append(_moves(a.reference_margins[:n], b.reference_margins[:n], swapped))
    return np.concatenate(out)


def _max(x: np.ndarray) -> float:
    return float(x.max()) if len(x) else 0.0


def _shadow_runs(runner: Runner, progress: bool):
    """The prompts alone, then teacher-forced under each of :data:`GATE_COMPOSITIONS` (shadow
    runs): the baseline's results, the three movements' arrays (one per run) and the largest
    movements per composition."""
    by_comp: Dict[str, Dict[str, float]] = {}
    with progress_bar(1 + len(GATE_COMPOSITIONS), label="calibrate", enabled=progress) as bar:
        bar.set_postfix_str("alone (batch 1)")
        base = runner.baseline()
        bar.update()
        forced_tokens = [r.token_ids for r in base]
        batch, ref, recheck = [], [reference_shifts(base)], []
        for name in GATE_COMPOSITIONS:
            bar.set_postfix_str(f"{name} (teacher-forced)")
            comp = runner.run(name, forced=forced_tokens)
            b, r, c = batch_shifts(base, comp), reference_shifts(comp), recheck_shifts(base, comp)
            by_comp[name] = {"batch_shift": _max(b), "reference_shift": _max(r), "recheck_shift": _max(c)}
            batch.append(b)
            ref.append(r)
            recheck.append(c)
            bar.update()
    return base, batch, ref, recheck, by_comp


def calibrate_gate(model: Union[None, str, Model] = None, mode: str = CALIBRATION_MODE,
                   prompts: Optional[Sequence[Any]] = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                   safety: float = 2.0, quick: bool = False, profile: Optional[str] = None,
                   progress: bool = True) -> Dict[str, Any]:
    """Measures the margin movements and returns the profile's ``"gate"`` entry (see the module
    docstring). ``quick``: 6 prompts, at most 16 new tokens."""
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
    if isinstance(model, Model):
        if model.layout != layout_for(mode):
            model = Model.load(model.path, layout=layout_for(mode))
    else:
        model = Model.load(model, layout=layout_for(mode))

    runner = Runner(model, prompts, max_new_tokens, mode, "shadow", 0.0, profile)
    base, batch, ref, recheck, by_comp = _shadow_runs(runner, progress)
    batch_a, ref_a, recheck_a = (np.concatenate(x) for x in (batch, ref, recheck))
    m = max(_max(batch_a), _max(ref_a))
    return {
        "tau": float(safety) * m,
        "deep_tau": float(safety) * _max(recheck_a),
        "rule": RULE,
        "safety": float(safety),
        "max_margin_shift": m,
        "mode": mode,
        "model": os.path.basename(model.path),
        "model_sha256": model.sha256(),
        "host": _native.host_signature(mode),
        "calibration_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "steps": sum(len(r.token_ids) for r in base),
        "batch_shift": _max(batch_a),
        "reference_shift": _max(ref_a),
        "recheck_shift": _max(recheck_a),
        "batch_shift_p99": float(np.percentile(batch_a, 99)) if len(batch_a) else 0.0,
        "by_composition": by_comp,
        "reference_disagreements": int(sum(int(r.corrected.sum()) for r in base)),
    }


def merge_gate(path: str, gate: Dict[str, Any]) -> Dict[str, Any]:
    """Writes ``gate`` into ``"gates"`` of the profile at ``path``, replacing the calibration of
    the same mode and model (created when missing; other keys kept). Refuses to overwrite a
    file that is not a JSON object. The profile format is the Rust crate's
    (``Profile::merge_gate``)."""
    return json.loads(_native.merge_gate(str(path), json.dumps(gate)))
