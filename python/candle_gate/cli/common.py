"""What several subcommands share: the help formatter, the flags of the server's settings
(:func:`setting_flag`: every subcommand's ``--model``, ``--gate``, ``--kv-dtype``, ... is the
:class:`~candle_gate.server.Settings` field's), the sampling flags, and turning parsed values
into the library's typed arguments."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Dict, List, Optional

from .. import _native
from ..engine import ENGINE_DEFAULTS, SamplingParams, speculative_options
from ..server.settings import DEPRECATED_FLAGS, FLAG_NAMES, Settings

#: the sampling defaults, Rust's (``SamplingParams::default``), for the help texts
_SAMPLING = SamplingParams()
#: the sampling flags' names, as :class:`SamplingParams` takes them
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")
_SETTINGS = {f.name: f for f in dataclasses.fields(Settings)}
_SETTING_TYPES = typing.get_type_hints(Settings)


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has a value (a flag whose default is
    None says in its text what not giving it means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is x for x in (None, False, True, argparse.SUPPRESS))  # (1.0 == True)
        if unset or "%(default)" in text or "default" in text:
            return text
        if not action.option_strings and action.nargs in (argparse.ONE_OR_MORE, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


def all_parsers(p: argparse.ArgumentParser):
    """``p`` and every subcommand's parser under it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


class RenamedFlag(argparse.Action):
    """Stores the value; the flag's old names (after its first) still work, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"{parser.prog}: {option_string} is deprecated, use {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def setting_flag(p: Any, name: str, extra_help: str = "", **overrides: Any) -> argparse.Action:
    """The flag of the :class:`~candle_gate.server.Settings` field ``name``: its name (``--`` and the
    field's with dashes, or :data:`~candle_gate.server.settings.FLAG_NAMES`'), type, default (the
    engine's where the field leaves it to the engine) and help, all the field's;
    ``extra_help`` is added to the help, ``overrides`` go to argparse as they are."""
    f = _SETTINGS[name]
    flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    if flag is None:
        raise ValueError(f"the setting {name} has no flag")
    old = [o for o, field_name in DEPRECATED_FLAGS.items() if field_name == name]
    kw: Dict[str, Any] = {k: v for k, v in f.metadata.items() if k != "help"}
    kw["help"] = f.metadata["help"] + extra_help + "".join(f"; {o} is its old name, deprecated" for o in old)
    kw["dest"] = name
    kind = _SETTING_TYPES[name]
    kind = next((t for t in typing.get_args(kind) if t is not type(None)), kind)  # Optional[X] -> X
    if kind is bool:
        # A flag turns on what is off by default, and off (``--no-...``) what is on.
        kw["action"] = "store_false" if f.default else "store_true"
    else:
        kw["default"] = ENGINE_DEFAULTS.get(name) if f.default is None else f.default
        if kind is not str:
            kw["type"] = kind
        if old:
            kw["action"] = RenamedFlag
    kw.update(overrides)
    return p.add_argument(flag, *old, **kw)


def model_args(p: argparse.ArgumentParser, **mode: Any) -> None:
    """``--model``, ``--mode`` (``mode``: its overrides, :func:`setting_flag`'s) and ``--profile``."""
    for name in ("model", "mode", "profile"):
        setting_flag(p, name, **(mode if name == "mode" else {}))


def kv_args(p: argparse.ArgumentParser) -> None:
    setting_flag(p, "kv_dtype")


def speculative_args(p: argparse.ArgumentParser) -> None:
    for name in ("speculative_method", "draft_model", "num_speculative_tokens", "speculative_disable_by_batch_size"):
        setting_flag(p, name)


def speculative_from_args(a: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``Engine(speculative=...)`` from the ``--speculative-*`` and ``--draft-model`` flags."""
    return speculative_options(a.speculative_method, a.num_speculative_tokens, a.speculative_disable_by_batch_size,
                               a.draft_model)


def gate_args(p: argparse.ArgumentParser, choose_gate: bool = True) -> None:
    """``--gate`` (unless the command runs every gate itself), ``--tau`` and ``--deep-tau``."""
    for name in ("gate", "tau", "deep_tau") if choose_gate else ("tau", "deep_tau"):
        setting_flag(p, name)


def _interval(name: str) -> str:
    """The engine's bounds on the sampling parameter ``name`` as an interval: ``(0, 1]``."""
    b = _native.SAMPLING_BOUNDS[name]
    lo, hi = ("(", b["gt"]) if "gt" in b else ("[", b["ge"]), (b["lt"], ")") if "lt" in b else (b["le"], "]")
    return f"in {lo[0]}{lo[1]:g}, {hi[0]:g}{hi[1]}"


def sampling_flags(p: argparse.ArgumentParser) -> None:
    d = _SAMPLING
    p.add_argument("--temperature", type=float, default=None,
                   help=f"softmax temperature; 0 is greedy (default: {d.temperature:g}, greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the K most likely tokens; 0 is off (default: {d.top_k}, off)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"sample among the most likely tokens holding this much probability, {_interval('top_p')} "
                        f"(default: {d.top_p:g}, off)")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this fraction of the most likely one's probability, "
                        f"{_interval('min_p')} (default: {d.min_p:g}, off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"CTRL's penalty on tokens already in the prompt or output, {_interval('repetition_penalty')} "
                        f"(default: {d.repetition_penalty:g}, off)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted from the logit of every token already generated, {_interval('presence_penalty')} "
                        f"(default: {d.presence_penalty:g}, off)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted once per occurrence in the output so far, {_interval('frequency_penalty')} "
                        f"(default: {d.frequency_penalty:g}, off)")
    p.add_argument("--seed", type=int, default=None,
                   help="key of every draw (default: one drawn per request and reported)")


def sampling_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The sampling keywords the command line was given (``--temperature``, ``--top-p``, ...)."""
    return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}


def parse_concurrency(spec: str) -> List[int]:
    """``--concurrency 1,4,8`` as concurrency levels: positive, in order, without repeats."""
    msg = f"--concurrency must be a comma-separated list of positive ints, got {spec!r}"
    try:
        vals = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        raise ValueError(msg) from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(msg)
    return list(dict.fromkeys(vals))
