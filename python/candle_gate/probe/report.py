"""Reporting the probe: scoring the runs against the baseline (the report dict, written as JSON
by :func:`.common.write_json`), the terminal table and the PNG. The keys are described in
:mod:`candle_gate.probe`."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _native
from ..engine import Result
from .common import first_difference, write_json
from .runner import Runner, Runs

__all__ = ["REPORT_KEYS", "EXTRA_KEYS", "COMPOSITION_KEYS", "GATE_KEYS", "PLOT_SIZE", "compare", "counts",
           "first_difference", "format_report", "plot_report", "summarize", "summary_line", "write_json"]

REPORT_KEYS = ("model", "mode", "prompts", "max_new_tokens", "sampling", "compositions", "gate")
EXTRA_KEYS = ("scored_steps", "distinct_outputs", "identical_sequences_share",
              "pairwise_diverging", "flip_margins", "baseline_margins")
COMPOSITION_KEYS = ("name", "step_flip_rate", "diverging_sequences", "logit_bit_mismatches",
                    "first_divergence", "margins_at_divergence")
#: the report's ``gate`` begins with these (the engine's counters, ``_native.GATE_COUNTERS``), then
#: ``deep_tau`` and ``calibration``
GATE_KEYS = ("mode", "tau", *_native.GATE_COUNTERS)

#: The PNG's size in pixels (width, height): PLOT_INCHES at PLOT_DPI.
PLOT_INCHES = (10.0, 10.0)
PLOT_DPI = 100
PLOT_SIZE = (int(PLOT_INCHES[0] * PLOT_DPI), int(PLOT_INCHES[1] * PLOT_DPI))


# ----------------------------------------------------------------------------- scoring


def compare(name: str, base: Sequence[Result], free: Sequence[Result],
            forced: Sequence[Result]):
    """One composition's report entry, its number of scored steps, and the baseline margins
    at its flipped steps."""
    steps = flips = mism = 0
    flip_margins: List[float] = []
    for b, f in zip(base, forced):
        m = min(len(b.token_ids), len(f.token_ids))
        steps += len(b.token_ids)
        flipped = np.nonzero(b.token_ids[:m] != f.token_ids[:m])[0]
        flips += len(flipped) + (len(b.token_ids) - m)
        flip_margins.extend(float(b.margins[j]) for j in flipped)
        h = min(len(b.logit_hashes), len(f.logit_hashes))
        mism += int(np.count_nonzero(b.logit_hashes[:h] != f.logit_hashes[:h]))
        mism += max(len(b.logit_hashes), len(f.logit_hashes)) - h
    firsts, margins = [], []
    for b, f in zip(base, free):
        pos = first_difference(b.token_ids, f.token_ids)
        if pos is not None:
            firsts.append(pos)
            margins.append(float(b.margins[pos]) if pos < len(b.margins) else None)
    entry = {
        "name": name,
        "step_flip_rate": flips / steps if steps else 0.0,
        "diverging_sequences": len(firsts),
        "logit_bit_mismatches": mism,
        "first_divergence": firsts,
        "margins_at_divergence": margins,
    }
    return entry, steps, flip_margins


def _quantiles(m: np.ndarray) -> Dict[str, Optional[float]]:
    keys = ("min", "p1", "p10", "median")
    if len(m) == 0:
        return dict.fromkeys(keys)
    q = np.percentile(m.astype(np.float64), [0, 1, 10, 50])
    return {k: float(v) for k, v in zip(keys, q)}


def summarize(runs: Runs, runner: Runner) -> Dict[str, Any]:
    """The report of ``runs`` (run by ``runner``): every composition against the baseline and
    the runs against each other."""
    base = runs.baseline
    entries, flip_margins = [], {}
    for name in runs.names:
        entry, _, fm = compare(name, base, runs.free[name], runs.forced[name])
        entries.append(entry)
        flip_margins[name] = fm
    n = len(base)
    run_names = ["baseline"] + list(runs.names)
    outputs = [[tuple(int(t) for t in r.token_ids) for r in base]]
    outputs += [[tuple(int(t) for t in r.token_ids) for r in runs.free[name]] for name in runs.names]
    distinct = [len({o[i] for o in outputs}) for i in range(n)]
    matrix = [[sum(a[i] != b[i] for i in range(n)) for b in outputs] for a in outputs]
    return {
        "model": runner.model.path,
        "mode": runner.mode,
        "prompts": n,
        "max_new_tokens": runner.max_new_tokens,
        "sampling": runner.sampling_report(),
        "compositions": entries,
        "gate": None if runner.gate == "off" else {"mode": runner.gate, "tau": runner.tau,
                                                   **runner.gate_totals,
                                                   "deep_tau": runner.deep_tau_used,
                                                   "calibration": runner.gate_source},
        "scored_steps": sum(len(r.token_ids) for r in base),
        "distinct_outputs": distinct,
        "identical_sequences_share": sum(d == 1 for d in distinct) / max(n, 1),
        "pairwise_diverging": {"names": run_names, "matrix": matrix},
        "flip_margins": flip_margins,
        "baseline_margins": _quantiles(runs.baseline_margins),
    }


def counts(r: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per composition of report ``r``: its teacher-forced ``steps``, ``flips`` and
    ``bit_mismatches`` (steps), and ``diverged`` (free-running sequences)."""
    steps = int(r.get("scored_steps") or 0)
    return [{"name": c["name"], "steps": steps, "flips": int(round(c["step_flip_rate"] * steps)),
             "bit_mismatches": int(c["logit_bit_mismatches"]),
             "diverged": int(c["diverging_sequences"])} for c in r["compositions"]]


def summary_line(r: Dict[str, Any]) -> str:
    """Flips and divergences over all compositions, in one line: "0 flips in N steps, ..."."""
    cs = counts(r)
    steps, flips = sum(c["steps"] for c in cs), sum(c["flips"] for c in cs)
    diverged = sum(c["diverged"] for c in cs)
    mism = sum(c["bit_mismatches"] for c in cs)
    return (f"{flips} flip{'' if flips == 1 else 's'} in {steps} steps, "
            f"{diverged} of {r['prompts'] * len(cs)} sequences diverged, "
            f"{mism} steps with logits not bitwise equal "
            f"({len(cs)} composition{'' if len(cs) == 1 else 's'} x {r.get('scored_steps', 0)} steps)")


# ----------------------------------------------------------------------------- output


def _fmt_list(xs: Sequence[Any], fmt: str = "{}", limit: int = 6) -> str:
    if not xs:
        return "-"
    s = ",".join("?" if x is None else fmt.format(x) for x in xs[:limit])
    return s + (f",+{len(xs) - limit}" if len(xs) > limit else "")


def format_report(r: Dict[str, Any]) -> str:
    lines = [f"model {os.path.basename(r['model'])}  mode {r['mode']}  prompts {r['prompts']}  "
             f"max_new_tokens {r['max_new_tokens']}  steps/composition {r.get('scored_steps', '?')}"]
    if r.get("sampling"):
        lines.append("sampling " + "  ".join(f"{k} {v}" for k, v in r["sampling"].items()))
    hdr = f"{'composition':<14} {'flip rate':>9} {'diverging':>9} {'bit mism.':>9}  {'first divergence':<22} margins there"
    lines += [hdr, "-" * len(hdr)]
    for c in r["compositions"]:
        lines.append(f"{c['name']:<14} {c['step_flip_rate'] * 100:8.2f}% "
                     f"{c['diverging_sequences']:>4}/{r['prompts']:<4} {c['logit_bit_mismatches']:>9}  "
                     f"{_fmt_list(c['first_divergence']):<22} {_fmt_list(c['margins_at_divergence'], '{:.3f}')}")
    bm = r.get("baseline_margins") or {}
    if bm.get("min") is not None:
        lines.append(f"baseline margins: min {bm['min']:.3g}, p1 {bm['p1']:.3g}, p10 {bm['p10']:.3g}, "
                     f"median {bm['median']:.3g}")
    if "distinct_outputs" in r:
        d = r["distinct_outputs"]
        lines.append(f"identical output across all runs: {sum(x == 1 for x in d)}/{len(d)} prompts "
                     f"(max {max(d) if d else 0} distinct outputs for one prompt)")
    g = r.get("gate")
    if g:
        counts = [f"{g[k]} {k.replace('_', ' ')}" + (f" ({g[k] / max(g['steps'], 1) * 100:.1f}%)" if k == "rechecks" else "")
                  for k in _native.GATE_COUNTERS if k in g]
        counts += [f"{v} {k.replace('_', ' ')}" for k, v in g.items() if k not in GATE_KEYS]
        lines.append(f"gate {g['mode']} tau={g['tau']:g}: " + ", ".join(counts))
    else:
        lines.append("gate off")
    return "\n".join(lines)


def _thresholds(r: Dict[str, Any]) -> List[Tuple[str, float, str]]:
    """The gate's thresholds worth marking: (label, value, line style)."""
    g = r.get("gate") or {}
    out = []
    for key, style in (("tau", "--"), ("deep_tau", ":")):
        v = g.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            out.append((f"{key} = {v:.3g}", float(v), style))
    return out


@dataclass
class _MarginAxis:
    """The plot's shared margin axis (log x): the flipped steps and first divergences as
    (composition index, baseline margin), the baseline margins, and the axis limits."""
    flips: List[Tuple[int, float]]
    divs: List[Tuple[int, float]]
    base: Optional[np.ndarray]
    lo: float
    hi: float

    def clip(self, v: float) -> float:
        """Exact ties (margin 0) and anything off the axis are drawn at its edge."""
        return min(max(v, self.lo), self.hi)


def _margin_axis(r: Dict[str, Any], margins: Optional[Sequence[float]]) -> _MarginAxis:
    comps = r["compositions"]
    fm = r.get("flip_margins") or {}
    flips = [(i, float(m)) for i, c in enumerate(comps) for m in fm.get(c["name"], [])]
    divs = [(i, float(m)) for i, c in enumerate(comps) for m in c["margins_at_divergence"] if m is not None]
    base = None if margins is None else np.asarray(margins, dtype=np.float64)
    values = [v for _, v in flips + divs] + [v for _, v, _ in _thresholds(r)]
    if base is not None:
        values += base.tolist()
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    lo, hi = (min(pos) / 2, max(pos) * 2) if pos else (1e-3, 10.0)
    if hi / lo < 100:
        lo, hi = math.sqrt(lo * hi) / 10, math.sqrt(lo * hi) * 10
    return _MarginAxis(flips, divs, base, lo, hi)


def _plot_margins(ax_h: Any, ax_s: Any, r: Dict[str, Any], m: _MarginAxis) -> None:
    """Panel 1: the baseline margins' histogram, the gate's thresholds (also on panel 2), the
    flips and divergences on the x axis, and the counts line."""
    base, clip = m.base, m.clip
    if base is not None and len(base):
        ties = int(np.count_nonzero(base <= 0))
        bins = np.geomspace(m.lo, m.hi, 50)
        ax_h.hist([clip(v) for v in base], bins=bins, color="tab:gray", alpha=0.7,
                  label=f"baseline margins ({len(base)} steps"
                        + (f", {ties} exact tie{'' if ties == 1 else 's'} at the left edge)" if ties else ")"))
    else:
        ax_h.text(0.5, 0.5, "no baseline margins" if base is not None
                  else "baseline margins not in this report\n(the plot of a run has them)",
                  transform=ax_h.transAxes, ha="center", va="center", color="tab:gray")
    for label, v, style in _thresholds(r):
        for ax in (ax_h, ax_s):
            ax.axvline(v, color="black", linestyle=style, linewidth=1,
                       label=label if ax is ax_h else None)
    if m.flips:
        ax_h.plot([clip(v) for _, v in m.flips], [0] * len(m.flips), "x", color="tab:red",
                  markersize=8, clip_on=False, label="flipped step (teacher-forced)")
    if m.divs:
        ax_h.plot([clip(v) for _, v in m.divs], [0] * len(m.divs), "o", mfc="none",
                  color="tab:blue", markersize=8, clip_on=False, label="first divergence (free-running)")
    ax_h.set_xscale("log")
    ax_h.set_xlim(m.lo, m.hi)
    if base is not None and len(base):
        ax_h.set_ylim(0, ax_h.get_ylim()[1] * 1.7)  # room for the counts line and the legend
        ax_h.yaxis.get_major_locator().set_params(integer=True)
        ax_h.set_ylabel("steps")
    else:
        ax_h.set_ylim(0, 1)
        ax_h.set_yticks([])
    ax_h.set_title("baseline margin (top1 - top2 logit) at every step", fontsize="medium")
    ax_h.text(0.01, 0.97, summary_line(r), transform=ax_h.transAxes, ha="left", va="top",
              fontsize="small", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})
    if ax_h.get_legend_handles_labels()[0]:
        ax_h.legend(loc="upper right", bbox_to_anchor=(1.0, 0.9), ncol=2, fontsize="small")


def _plot_points(ax_s: Any, r: Dict[str, Any], names: List[str], m: _MarginAxis) -> None:
    """Panel 2: per composition, its flipped steps and first divergences at their margins."""
    if m.flips:
        ax_s.plot([m.clip(v) for _, v in m.flips], [i - 0.12 for i, _ in m.flips], "x",
                  color="tab:red", markersize=7)
    if m.divs:
        ax_s.plot([m.clip(v) for _, v in m.divs], [i + 0.12 for i, _ in m.divs], "o", mfc="none",
                  color="tab:blue", markersize=7)
    if not (m.flips or m.divs):
        ax_s.text(0.5, 0.5, f"{summary_line(r).split(', ')[0]}: no flipped steps and no divergences",
                  transform=ax_s.transAxes, ha="center", va="center", color="tab:gray")
    ax_s.set_yticks(range(len(names)))
    ax_s.set_yticklabels(names, fontsize="small")
    ax_s.set_ylim(len(names) - 0.5, -0.5)
    ax_s.grid(axis="y", color="0.9")
    ax_s.set_xlabel("baseline margin (log); x = flipped step, o = first divergence")


def _plot_counts(ax_b: Any, r: Dict[str, Any], names: List[str]) -> None:
    """Panel 3: steps, steps whose logits are not bitwise equal, flipped steps and diverged
    sequences, per composition (symlog bars)."""
    cs = counts(r)
    series = (("steps", "steps", "tab:gray"), ("bit_mismatches", "steps, logits not bitwise equal", "tab:orange"),
              ("flips", "flipped steps", "tab:red"), ("diverged", f"diverged sequences (of {r['prompts']})", "tab:blue"))
    width = 0.8 / len(series)
    x = np.arange(len(names))
    for j, (key, label, color) in enumerate(series):
        vals = [c[key] for c in cs]
        bars = ax_b.bar(x + (j - (len(series) - 1) / 2) * width, vals, width, label=label, color=color)
        ax_b.bar_label(bars, labels=[str(v) for v in vals], fontsize=7, padding=2, rotation=90)
    ax_b.set_yscale("symlog", linthresh=1)
    top = max([c["steps"] for c in cs] + [1])
    ax_b.set_ylim(0, top * 20)  # room for the labels
    pad = max(0.0, (4 - len(names)) / 2)  # a few compositions: bars of the usual width
    ax_b.set_xlim(-0.5 - pad, len(names) - 0.5 + pad)
    ax_b.set_xticks(x)
    ax_b.set_xticklabels(names, rotation=30, ha="right")
    ax_b.set_ylabel("count (symlog)")
    ax_b.set_title("counts per composition", fontsize="medium", loc="left")
    ax_b.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(series), fontsize="small",
                frameon=False, borderaxespad=0.2)


def plot_report(r: Dict[str, Any], path: str, margins: Optional[Sequence[float]] = None) -> None:
    """Writes a PNG of report ``r`` (:data:`PLOT_SIZE` pixels) to ``path``:

    1. the histogram of ``margins`` (the baseline's top1-top2 margin at every step, log x), with
       the gate's tau and deep_tau marked and a line of counts ("0 flips in N steps, ...");
    2. on the same margin axis, one row per composition: its flipped steps (teacher-forced) and
       first divergences (free-running) at their baseline margins;
    3. counts per composition: steps, steps whose logits are not bitwise equal, flipped steps,
       diverged sequences.

    Without ``margins`` (a report read back from JSON) the histogram is left out with a note.
    Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = r["compositions"]
    names = [c["name"] for c in comps]
    axis = _margin_axis(r, margins)
    gate = r.get("gate")
    gate_desc = "gate off" if not gate else f"gate {gate['mode']}"
    fig = plt.figure(figsize=PLOT_INCHES, dpi=PLOT_DPI, constrained_layout=True)
    fig.suptitle(f"probe: {os.path.basename(str(r['model']))}, mode {r['mode']}, {gate_desc}\n"
                 f"{r['prompts']} prompts x up to {r['max_new_tokens']} new tokens, "
                 f"each alone (baseline) vs {len(comps)} batch composition{'' if len(comps) == 1 else 's'}")
    gs = fig.add_gridspec(3, 1, height_ratios=[3.0, max(1.2, 0.3 * len(comps) + 0.6), 2.6])
    ax_h = fig.add_subplot(gs[0])
    ax_s = fig.add_subplot(gs[1], sharex=ax_h)
    ax_b = fig.add_subplot(gs[2])
    _plot_margins(ax_h, ax_s, r, axis)
    _plot_points(ax_s, r, names, axis)
    _plot_counts(ax_b, r, names)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
