"""What several subcommands share: the help formatter, the flag groups (model, gate, K/V,
speculation, sampling) and turning their parsed values into the library's typed arguments."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Optional

from ..engine import ENGINE_DEFAULTS, GATES, MODES, SPECULATIVE_METHODS, SamplingParams, speculative_options
from ..server.settings import Settings

#: ``candle-gate serve``'s defaults: the fields of :class:`~candle_gate.server.Settings` (one owner)
SERVE_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Settings)}
#: the sampling defaults, Rust's (``SamplingParams::default``), for the help texts
_SAMPLING = SamplingParams()
#: the sampling flags' names, as :class:`SamplingParams` takes them
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")
KV_DTYPES = ("f16", "f32")


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


def model_args(p: argparse.ArgumentParser, mode_default: str = SERVE_DEFAULTS["mode"], mode_help: str = "") -> None:
    p.add_argument("--model", default=SERVE_DEFAULTS["model"], help="a known model name or a path to a .gguf file")
    p.add_argument("--mode", default=mode_default, choices=MODES, help="fast-lane kernel policy" + mode_help)
    p.add_argument("--profile", default=None,
                   help="a crossover/gate profile (JSON) to load (default: none; a gated engine without --tau "
                        "reads the user's profile, then the packaged one)")


def kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=ENGINE_DEFAULTS["kv_dtype"], choices=KV_DTYPES, help="how K/V values are stored")


def speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding (ngram: prompt lookup; draft: a smaller model of the same "
                        "vocabulary, --draft-model); changes no token, only speed (default: off)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of --speculative-method draft: a known model name or a .gguf path "
                        "(default: none)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per sequence and step (default: ngram 12, draft 3)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafts in a step with more decoding sequences than this (default: ngram 8, draft 1)")


def speculative_from_args(a: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``Engine(speculative=...)`` from the ``--speculative-*`` and ``--draft-model`` flags."""
    return speculative_options(a.speculative_method, a.num_speculative_tokens, a.speculative_disable_by_batch_size,
                               a.draft_model)


def gate_args(p: argparse.ArgumentParser, choose_gate: bool = True) -> None:
    """``--gate`` (unless the command runs every gate itself), ``--tau`` and ``--deep-tau``."""
    if choose_gate:
        p.add_argument("--gate", default=SERVE_DEFAULTS["gate"], choices=GATES,
                       help="the margin gate: gated rechecks steps whose top-1/top-2 margin is below --tau in the "
                            "FP32 reference lane; always rechecks every step; shadow measures without acting")
    p.add_argument("--tau", type=float, default=None,
                   help="margin threshold for --gate gated (default: the profile's calibrated tau)")
    p.add_argument("--deep-tau", type=float, default=None,
                   help="a recheck whose own margin is below this rebuilds the cache in the reference "
                        "lane (default: the profile's, else tau/2)")


def sampling_flags(p: argparse.ArgumentParser) -> None:
    d = _SAMPLING
    p.add_argument("--temperature", type=float, default=None,
                   help=f"softmax temperature; 0 is greedy (default: {d.temperature:g}, greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the K most likely tokens; 0 is off (default: {d.top_k}, off)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"sample among the most likely tokens holding this much probability, in (0, 1] "
                        f"(default: {d.top_p:g}, off)")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this fraction of the most likely one's probability, "
                        f"in [0, 1] (default: {d.min_p:g}, off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"CTRL's penalty on tokens already in the prompt or output, in (0, 10] "
                        f"(default: {d.repetition_penalty:g}, off)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted from the logit of every token already generated, in [-2, 2] "
                        f"(default: {d.presence_penalty:g}, off)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted once per occurrence in the output so far, in [-2, 2] "
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
