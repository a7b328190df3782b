"""The probes: does the batch (or the load) change what a model decodes, and where?

Two probes share this package:

- the in-process probe (this module; ``candle-gate probe``, :mod:`candle_gate.cli.probe`): :mod:`.runner` runs the prompts
  under batch compositions it builds itself (``COMPOSITIONS``), :mod:`.report` scores the runs
  and writes the table, the JSON report and the PNG;
- the endpoint probe (:mod:`.endpoint`, ``candle-gate probe --endpoint URL``, docs/ENDPOINT_PROBE.md):
  :mod:`.endpoint_client` sends the requests to an OpenAI-compatible server, :mod:`.endpoint_report`
  scores the completions and writes the table and the PNG;
- :mod:`.common`: what both use (the prompts, the first difference of two outputs, the progress
  bar, writing the JSON and the PNG).

The in-process probe runs a prompt set alone (the baseline: batch 1, one request per engine)
and under other batch compositions, then compares every composition with the baseline and with
each other (docs/DESIGN.md §2 "Probe", §5 "Measuring"). :func:`run_probe` (also
``candle_gate.run_probe``) does both and returns the report (``candle-gate probe --json``):

Per composition:

- ``step_flip_rate``: teacher-forced. The composition is run again with every request fed its
  baseline tokens (``forced_tokens``); a step flips when the argmax the engine recorded differs
  from the baseline token. Flipped steps / all steps.
- ``diverging_sequences``: free-running requests whose tokens differ from their baseline run;
  ``first_divergence`` lists the first differing position of each, ``margins_at_divergence``
  the baseline's top1-top2 margin there.
- ``logit_bit_mismatches``: steps of the teacher-forced run whose logits are not bitwise equal
  to the baseline's (hash of the f32 bits), so positions align even after a flip.

Top-level extras: ``scored_steps`` (steps per composition), ``distinct_outputs`` (per prompt,
the number of distinct token sequences over the baseline and all free-running compositions),
``identical_sequences_share`` (share of prompts with one distinct output),
``pairwise_diverging`` (for every pair of runs, the number of prompts whose tokens differ) and
``flip_margins`` (per composition, the baseline margins at the flipped steps) and
``baseline_margins`` (min, 1st and 10th percentile and median of the baseline's margins: how
close the near-ties come).
``sampling`` is null for greedy decoding, else the sampling keywords and the base ``seed``
(prompt i is keyed by seed + i); the step flip rate then compares the sampled decisions.
``gate`` sums ``gate_stats`` over every free-running engine (baseline included), or is null when
the gate is off: ``mode``, ``tau``, ``steps``, ``rechecks``, ``corrections``, then any further
counter the engine reports (``deep_rechecks``) and the ``deep_tau`` in use.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..engine import DEFAULT_MODE, Model, layout_for, resolve_gate
from .common import (check_concurrency, check_prompts, first_difference, is_chat, load_prompts, progress_bar,
                     prompt_kind, write_json)
from .report import (COMPOSITION_KEYS, EXTRA_KEYS, GATE_KEYS, PLOT_SIZE, REPORT_KEYS, compare,
                     counts, format_report, plot_report, summarize, summary_line)
from .runner import (COMPOSITIONS, DEFAULT_PROMPTS, FILLER_TOKENS, MAX_TOKENS_PER_STEP,
                     MIXED_PREFILL_EVERY, PREFILL_CHUNK, STAGGER_EVERY, Runner, Runs,
                     parse_compositions)

__all__ = [
    "run_probe", "measure",
    "COMPOSITIONS", "DEFAULT_PROMPTS", "FILLER_TOKENS", "MAX_TOKENS_PER_STEP", "MIXED_PREFILL_EVERY",
    "PREFILL_CHUNK", "STAGGER_EVERY", "Runner", "Runs", "parse_compositions", "resolve_gate",
    "REPORT_KEYS", "EXTRA_KEYS", "COMPOSITION_KEYS", "GATE_KEYS", "PLOT_SIZE", "compare",
    "counts", "format_report", "plot_report", "summarize", "summary_line",
    "check_concurrency", "check_prompts", "first_difference", "is_chat", "load_prompts", "progress_bar",
    "prompt_kind", "write_json",
]


def measure(model: Union[None, str, Model] = None, prompts: Optional[Sequence[Any]] = None,
            max_new_tokens: int = 32, mode: str = DEFAULT_MODE, gate: str = "off",
            tau: Optional[float] = None, profile: Optional[str] = None,
            compositions: Union[None, str, Sequence[str]] = None, progress: bool = True,
            row_split_max: Optional[int] = None,
            mixed_prefill_every: int = MIXED_PREFILL_EVERY,
            deep_tau: Optional[float] = None,
            sampling: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Runs]:
    """:func:`run_probe`'s report and the runs behind it (for :func:`plot_report`'s margins)."""
    names = parse_compositions(compositions)
    prompts = check_prompts(DEFAULT_PROMPTS if prompts is None else prompts)
    # The gate's and the mode's names, tau and deep_tau, and max_new_tokens are checked by the
    # Rust side: resolve_gate here (before a model download), Model.load / the engines below.
    resolve_gate(gate, tau, deep_tau, profile)
    if not isinstance(model, Model):
        model = Model.load(model, layout=layout_for(mode))
    tau_v, deep_tau, source = resolve_gate(gate, tau, deep_tau, profile, model, mode)
    runner = Runner(model, prompts, max_new_tokens, mode, gate, tau_v, profile, row_split_max,
                    mixed_prefill_every, deep_tau, sampling)
    runner.gate_source = source
    runs = runner.run_all(names, progress=progress)
    return summarize(runs, runner), runs


def run_probe(model: Union[None, str, Model] = None, prompts: Optional[Sequence[Any]] = None,
              max_new_tokens: int = 32, mode: str = DEFAULT_MODE, gate: str = "off",
              tau: Optional[float] = None, profile: Optional[str] = None,
              compositions: Union[None, str, Sequence[str]] = None, progress: bool = True,
              row_split_max: Optional[int] = None,
              mixed_prefill_every: int = MIXED_PREFILL_EVERY,
              deep_tau: Optional[float] = None,
              sampling: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Runs ``prompts`` (default :data:`DEFAULT_PROMPTS`) alone and under ``compositions``
    (default all of :data:`COMPOSITIONS`) and returns the report (see the module docstring).

    ``model``: a name, a path or a loaded :class:`Model` (its fast lane is replaced by ``mode``
    in every engine). ``row_split_max`` overrides the row-split threshold; ``mixed_prefill_every``
    the decode steps between two filler prefills in ``mixed_prefill``; ``deep_tau`` is passed to
    every engine when given. ``sampling``: :class:`SamplingParams` keywords (``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``seed``, ...) for every request; prompt i is keyed by
    ``seed + i`` (seed 0 when sampling without one)."""
    report, _ = measure(model, prompts, max_new_tokens, mode, gate, tau, profile, compositions,
                        progress, row_split_max, mixed_prefill_every, deep_tau, sampling)
    return report
