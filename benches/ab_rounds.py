"""The order of the two builds within each round of an A/B (`ab_builds.py`, `ab_kernels.py`).
On these shared hosts the build that runs second in a round tends to be favoured, so by
default the rounds alternate which build goes first; give an even number of rounds."""
from __future__ import annotations

import argparse
from typing import Sequence, Tuple, TypeVar

T = TypeVar("T")
ORDERS = ("alternate", "before-first")


def add_order_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--order", choices=ORDERS, default="alternate",
                    help="which build runs first in each round: alternate rounds (default) or --before always")


def in_turn(sides: Sequence[Tuple[str, T]], rnd: int, order: str) -> Sequence[Tuple[str, T]]:
    """`sides` (before first) in the order round `rnd` (from 0) runs them."""
    return sides[::-1] if order == "alternate" and rnd % 2 == 1 else sides


def described(order: str) -> str:
    return "each build first in every other round" if order == "alternate" else "before first in each"
