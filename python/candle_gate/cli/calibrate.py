"""``candle-gate calibrate``: kernel crossovers (``--kernels``) and the gate's tau (``--gate``),
:mod:`candle_gate.calibrate`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..calibrate import CALIBRATION_MODE
from ..engine import DEFAULT_MAX_NEW_TOKENS
from .common import model_args


def add_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure kernel crossovers (--kernels) and the gate's tau (--gate)")
    model_args(c, default=CALIBRATION_MODE,
               extra_help=" (default: %(default)s, whose bits follow the batch by construction, so that --gate "
                         "has margin movements to measure; bench gate measures the gate on it too)")
    c.add_argument("--kernels", action="store_true", help="time the kernels and write their crossover thresholds")
    c.add_argument("--gate", action="store_true", help="measure the gate's tau and deep_tau for --mode")
    c.add_argument("--quick", action="store_true", help="only the default model's dtypes and shapes")
    c.add_argument("--out", default=None,
                   help="the profile to write or update (default: the user's, which gated engines read first: "
                        "profile-cpu.json in the model cache)")
    c.add_argument("--prompts", default=None,
                   help="calibration prompts for --gate (JSON list or text file; default: the built-in set)")
    c.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens per calibration prompt")
    c.add_argument("--safety", type=float, default=2.0, help="tau = safety x the largest measured margin movement")
    c.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    from .. import calibrate
    from ..engine import user_profile_path
    from ..probe import load_prompts
    if not (a.kernels or a.gate):
        print("calibrate: pass --kernels and/or --gate", file=sys.stderr)
        return 2
    out = a.out if a.out is not None else user_profile_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if a.kernels:
        table = calibrate.calibrate_kernels(out, quick=a.quick)
        if table.strip():
            print(table.rstrip())
        print(f"kernels: crossover profile written to {out}")
    if a.gate:
        g = calibrate.calibrate_gate(model=a.model, mode=a.mode, prompts=load_prompts(a.prompts) if a.prompts else None,
                                     max_new_tokens=a.max_new_tokens, safety=a.safety, quick=a.quick,
                                     profile=a.profile)
        calibrate.merge_gate(out, g)
        print(f"gate: mode {g['mode']}, {g['calibration_prompts']} prompts x {g['max_new_tokens']} tokens "
              f"({g['steps']} steps): batch shift {g['batch_shift']:.4g}, reference shift "
              f"{g['reference_shift']:.4g} -> tau = {g['safety']:g} x {g['max_margin_shift']:.4g} = {g['tau']:.4g}; "
              f"recheck shift {g['recheck_shift']:.4g} -> deep_tau = {g['deep_tau']:.4g}")
        print(f"gate: written to {out}")
        print(json.dumps(g, indent=2))
    return 0
