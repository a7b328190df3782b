"""The ``candle-gate`` command (also ``python -m candle_gate``).

Every argparse adapter lives in this package, one module per subcommand (``generate`` and
``fetch``, ``calibrate``, ``probe``, ``bench``, ``serve``, ``verify``) and the flag groups they
share in :mod:`.common`; the library modules they call take typed arguments and never import
this package.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .. import _native
from . import bench, calibrate, generate, probe, serve, verify
from .common import HelpFormatter, all_parsers, parse_concurrency, sampling_args, speculative_from_args

__all__ = ["main", "build_parser", "all_parsers", "HelpFormatter", "parse_concurrency", "sampling_args",
           "speculative_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """The ``candle-gate`` parser: one ``add_parser`` per subcommand, in the order of ``--help``."""
    ap = argparse.ArgumentParser(prog="candle-gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"candle-gate {_native.__version__} (CPU kernels: {_native.kernel_tier()})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (generate.add_generate_parser, generate.add_fetch_parser, calibrate.add_parser, probe.add_parser,
                bench.add_parser, serve.add_parser, verify.add_parser):
        add(sub)
    for p in all_parsers(ap):
        p.formatter_class = HelpFormatter
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, TypeError, FileNotFoundError, _native.CandleGateError) as e:
        print(f"candle-gate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
