"""Probe: does the batch change greedy decoding, and where?

Runs a prompt set alone (the baseline: batch 1, one request per engine) and under other batch
compositions, then compares every composition with the baseline and with each other
(docs/DESIGN.md §2 "Probe", §5 "Measuring").

Compositions (``COMPOSITIONS``):

- ``batch2`` ... ``batch16``: the prompts in groups of that size, one engine per group; the last
  group is padded by cycling through the prompts (padding requests are not scored).
- ``staggered``: one engine; the requests arrive one by one, a new one every 3 steps.
- ``mixed_prefill``: all prompts in one batch; once every request decodes, a filler request
  with a 120-token prompt arrives (then again every 8 decode steps, ``mixed_prefill_every``)
  and is prefilled in one chunk (prefill_chunk 128) in the same step as the decode rows of the
  probed requests; fillers stop after their first token and are not scored. Compare it with
  ``threads2``/``reversed`` (the same batch without fillers) to isolate the filler's effect.
- ``reversed``: all prompts in one batch, submitted in reverse order.
- ``threads1`` / ``threads2``: all prompts in one batch on a 1- / 2-thread pool.

Every engine here uses prefill_chunk 128 and 256 tokens per step, the baseline included, so
that a composition differs from the baseline only in what shares the steps.

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
``gate`` sums ``gate_stats`` over every free-running engine (baseline included), or is null when
the gate is off: ``mode``, ``tau``, ``steps``, ``rechecks``, ``corrections``, then any further
counter the engine reports (``deep_rechecks``) and the ``deep_tau`` in use.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .engine import GATES, MODES, Engine, Model, Result, resolve_gate

COMPOSITIONS = ("batch2", "batch3", "batch4", "batch5", "batch8", "batch16", "staggered",
                "mixed_prefill", "reversed", "threads1", "threads2")

REPORT_KEYS = ("model", "mode", "prompts", "max_new_tokens", "compositions", "gate")
EXTRA_KEYS = ("scored_steps", "distinct_outputs", "identical_sequences_share",
              "pairwise_diverging", "flip_margins", "baseline_margins")
COMPOSITION_KEYS = ("name", "step_flip_rate", "diverging_sequences", "logit_bit_mismatches",
                    "first_divergence", "margins_at_divergence")
GATE_KEYS = ("mode", "tau", "steps", "rechecks", "corrections")

PREFILL_CHUNK = 128
MAX_TOKENS_PER_STEP = 256
STAGGER_EVERY = 3
MIXED_PREFILL_EVERY = 8
FILLER_TOKENS = 120

# Disjoint from calibrate.CALIBRATION_PROMPTS.
DEFAULT_PROMPTS: List[Any] = [
    "The history of the printing press begins in",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "Q: What is 17 times 23?\nA:",
    "A recipe for pancakes:\n1.",
    "In 1969, astronauts",
    "Dear hiring manager,\n\nI am writing to apply for",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "List of prime numbers: 2, 3, 5, 7,",
    "The mitochondria is",
    "import numpy as np\n\n# compute the mean of each column\n",
    "Water boils at 100 degrees Celsius because",
    "Here is a haiku about autumn:\n",
    "The quick brown fox",
    "Machine learning models can overfit when",
    "The best way to learn a new language is",
    [{"role": "user", "content": "Explain why the sky is blue in two sentences."}],
    [{"role": "user", "content": "Write a short poem about a cat."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What are three tips for staying focused while studying?"}],
    [{"role": "user", "content": "Give me a Python one-liner that reverses a string."}],
    [{"role": "user", "content": "What is the difference between weather and climate?"}],
    [{"role": "user", "content": "Summarize the plot of Romeo and Juliet."}],
]

_FILLER_TEXT = (
    "The following is an excerpt from a long technical report about the maintenance of old "
    "railway bridges. Engineers inspected every span, measured the corrosion of the steel "
    "girders, recorded the condition of the rivets and bearings, and compared the results with "
    "the drawings made when the bridge was built. Where the paint had failed, rust had eaten "
    "into the flanges, and several cross beams had lost a tenth of their thickness. The report "
    "recommends replacing the worst members, cleaning and repainting the rest, and installing "
    "sensors that measure strain and temperature so that future inspections can be planned "
    "from data rather than from the calendar. It also notes that traffic has grown heavier "
    "since the bridge opened and that the original load tables no longer apply."
)


# ----------------------------------------------------------------------------- prompts


def check_prompts(prompts: Any) -> List[Any]:
    """A non-empty list of prompts: strings, chats (lists of message dicts) or token-id lists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("the prompt list is empty")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
        elif isinstance(p, list) and p and all(isinstance(m, dict) for m in p):
            pass  # a chat: the model's template (Rust) validates its messages when encoding
        elif isinstance(p, (list, tuple)) and p and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in p):
            p = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} must be a non-empty string, a chat (list of "
                             f"{{'role', 'content'}} dicts) or a list of token ids, got {p!r:.80}")
        out.append(p)
    return out


def load_prompts(path: str) -> List[Any]:
    """A JSON list of prompts (strings or chats), or a text file with one prompt per line.
    A file whose first non-blank character is ``[`` or ``{``, or whose name ends in ``.json``,
    is read as JSON. Raises ValueError with the reason for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"prompts file {path!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path!r} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path!r}: {e}") from None
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    if str(path).endswith(".json") or stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"prompts file {path!r} is not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise ValueError(f"prompts file {path!r} must hold a JSON list of prompts "
                             f"(strings or lists of chat messages), got a {type(data).__name__}")
    else:
        data = [line for line in text.splitlines() if line.strip()]
    if not data:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    try:
        return check_prompts(data)
    except ValueError as e:
        raise ValueError(f"prompts file {path!r}: {e}") from None


def parse_compositions(names: Union[None, str, Sequence[str]]) -> List[str]:
    if names is None:
        return list(COMPOSITIONS)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names)
    bad = [n for n in names if n not in COMPOSITIONS]
    if bad:
        raise ValueError(f"unknown composition(s) {', '.join(bad)}; expected a subset of {', '.join(COMPOSITIONS)}")
    if not names:
        raise ValueError("no compositions selected")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- running


class Progress:
    """A small progress indicator on stderr (a bar on a terminal, one line per phase otherwise)."""

    def __init__(self, total: int, enabled: bool = True, label: str = "probe"):
        self.total, self.done, self.enabled, self.label = total, 0, enabled, label
        self.tty = enabled and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        self.t0 = time.time()

    def start(self, what: str) -> None:
        if not self.enabled:
            return
        n = 24
        fill = n * self.done // max(self.total, 1)
        msg = (f"{self.label} [{'#' * fill}{'.' * (n - fill)}] {self.done}/{self.total} "
               f"{time.time() - self.t0:5.0f}s {what}")
        if self.tty:
            sys.stderr.write("\r\x1b[K" + msg)
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def finish(self) -> None:
        if not self.enabled:
            return
        msg = f"{self.label}: {self.done}/{self.total} done in {time.time() - self.t0:.1f}s"
        sys.stderr.write(("\r\x1b[K" if self.tty else "") + msg + "\n")
        sys.stderr.flush()


class Runner:
    """Runs prompt sets under batch compositions with one engine configuration. Shared by the
    probe and by ``calibrate --gate``."""

    def __init__(self, model: Model, prompts: Sequence[Any], max_new_tokens: int, mode: str,
                 gate: str = "off", tau: float = 0.0, profile: Optional[str] = None,
                 row_split_max: Optional[int] = None, mixed_prefill_every: int = MIXED_PREFILL_EVERY,
                 deep_tau: Optional[float] = None):
        if isinstance(mixed_prefill_every, bool) or not isinstance(mixed_prefill_every, int) or mixed_prefill_every <= 0:
            raise ValueError(f"mixed_prefill_every must be a positive int, got {mixed_prefill_every!r}")
        self.mixed_prefill_every = mixed_prefill_every
        self.model, self.mode, self.gate, self.tau = model, mode, gate, float(tau)
        self.profile, self.row_split_max, self.deep_tau = profile, row_split_max, deep_tau
        self.max_new_tokens = max_new_tokens
        self.ids: List[List[int]] = []
        for i, p in enumerate(prompts):
            try:
                self.ids.append(model.encode_prompt(p))
            except (TypeError, ValueError) as e:
                raise ValueError(f"prompt {i}: {e}") from None
        filler = model.tokenize(_FILLER_TEXT)
        while len(filler) < FILLER_TOKENS:
            filler = filler + filler
        self.filler = filler[:FILLER_TOKENS]
        self.gate_totals = {"steps": 0, "rechecks": 0, "corrections": 0}
        self.deep_tau_used: Optional[float] = None

    @property
    def n(self) -> int:
        return len(self.ids)

    def engine(self, n_seqs: int, threads: Optional[int] = None, budget: int = MAX_TOKENS_PER_STEP) -> Engine:
        extra = {} if self.deep_tau is None else {"deep_tau": self.deep_tau}
        eng = Engine(self.model, mode=self.mode, profile=self.profile, gate=self.gate, tau=self.tau,
                     max_num_seqs=max(16, n_seqs + 1), max_tokens_per_step=budget,
                     prefill_chunk=PREFILL_CHUNK, threads=threads, record_logit_hashes=True,
                     row_split_max=self.row_split_max, **extra)
        self.deep_tau_used = eng.deep_tau
        return eng

    def _submit(self, eng: Engine, i: int, forced: Optional[Sequence[np.ndarray]]) -> int:
        if forced is None:
            return eng.submit(self.ids[i], max_new_tokens=self.max_new_tokens)
        f = [int(t) for t in forced[i]]
        return eng.submit(self.ids[i], max_new_tokens=max(len(f), 1), forced_tokens=f)

    def _done(self, eng: Engine, forced: Optional[Sequence[np.ndarray]]) -> None:
        if forced is None:
            for k, v in eng.gate_stats().items():
                self.gate_totals[k] = self.gate_totals.get(k, 0) + int(v)

    def baseline(self) -> List[Result]:
        out = []
        for i in range(self.n):
            eng = self.engine(1)
            out.extend(eng.run([self._submit(eng, i, None)]))
            self._done(eng, None)
        return out

    def run(self, name: str, forced: Optional[Sequence[np.ndarray]] = None) -> List[Result]:
        """The scored results of composition ``name`` in prompt order; teacher-forced to
        ``forced`` (one token array per prompt) when given."""
        if name.startswith("batch") and name[5:].isdigit():
            return self._batches(int(name[5:]), forced)
        if name == "staggered":
            return self._staggered(forced)
        if name == "mixed_prefill":
            return self._mixed_prefill(forced)
        if name == "reversed":
            return self._all(list(reversed(range(self.n))), None, forced)
        if name.startswith("threads") and name[7:].isdigit():
            return self._all(list(range(self.n)), int(name[7:]), forced)
        raise ValueError(f"unknown composition {name!r}")

    def _batches(self, k: int, forced) -> List[Result]:
        out: Dict[int, Result] = {}
        pad = itertools.cycle(range(self.n))
        for start in range(0, self.n, k):
            members = list(range(start, min(start + k, self.n)))
            pads = [next(pad) for _ in range(k - len(members))]
            eng = self.engine(k)
            rids = [self._submit(eng, i, forced) for i in members + pads]
            res = eng.run(rids)
            out.update(zip(members, res[:len(members)]))
            self._done(eng, forced)
        return [out[i] for i in range(self.n)]

    def _staggered(self, forced) -> List[Result]:
        eng = self.engine(self.n)
        rids = []
        for i in range(self.n):
            rids.append(self._submit(eng, i, forced))
            if i + 1 < self.n:
                for _ in range(STAGGER_EVERY):
                    eng.step()
        res = eng.run(rids)
        self._done(eng, forced)
        return res

    def _mixed_prefill(self, forced) -> List[Result]:
        eng = self.engine(self.n, budget=max(MAX_TOKENS_PER_STEP, self.n + FILLER_TOKENS))
        rids = [self._submit(eng, i, forced) for i in range(self.n)]
        probed, started = set(rids), set()
        k = 0
        while any(not eng._native.is_finished(r) for r in rids):
            if len(started) == self.n and k % self.mixed_prefill_every == 0:
                eng.submit(self.filler, max_new_tokens=1)
            if eng.step() == 0 and not eng.has_work:
                break
            if len(started) == self.n:
                k += 1
            for ev in eng._native.events():
                if ev["id"] in probed:
                    started.add(ev["id"])
        res = eng.run(rids)
        self._done(eng, forced)
        return res

    def _all(self, order: List[int], threads: Optional[int], forced) -> List[Result]:
        eng = self.engine(self.n, threads=threads)
        rids = [self._submit(eng, i, forced) for i in order]
        res = eng.run(rids)
        self._done(eng, forced)
        by_prompt = dict(zip(order, res))
        return [by_prompt[i] for i in range(self.n)]


# ----------------------------------------------------------------------------- comparing


def first_difference(a: np.ndarray, b: np.ndarray) -> Optional[int]:
    """The first position where two token sequences differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    m = min(len(a), len(b))
    d = np.nonzero(np.asarray(a[:m]) != np.asarray(b[:m]))[0]
    if len(d):
        return int(d[0])
    return None if len(a) == len(b) else m


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


def run_probe(model: Union[None, str, Model] = None, prompts: Optional[Sequence[Any]] = None,
              max_new_tokens: int = 32, mode: str = "invariant", gate: str = "off",
              tau: Optional[float] = None, profile: Optional[str] = None,
              compositions: Union[None, str, Sequence[str]] = None, progress: bool = True,
              row_split_max: Optional[int] = None,
              mixed_prefill_every: int = MIXED_PREFILL_EVERY,
              deep_tau: Optional[float] = None) -> Dict[str, Any]:
    """Runs ``prompts`` (default :data:`DEFAULT_PROMPTS`) alone and under ``compositions``
    (default all of :data:`COMPOSITIONS`) and returns the report (see the module docstring).

    ``model``: a name, a path or a loaded :class:`Model` (its fast lane is replaced by ``mode``
    in every engine). ``row_split_max`` overrides the row-split threshold; ``mixed_prefill_every``
    the decode steps between two filler prefills in ``mixed_prefill``; ``deep_tau`` is passed to
    every engine when given."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; expected one of {', '.join(GATES)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    names = parse_compositions(compositions)
    prompts = check_prompts(DEFAULT_PROMPTS if prompts is None else prompts)
    tau_v, deep_tau = resolve_gate(gate, tau, deep_tau, profile)
    if not isinstance(model, Model):
        model = Model.load(model, mode=mode, profile=profile)
    runner = Runner(model, prompts, max_new_tokens, mode, gate, tau_v, profile, row_split_max,
                    mixed_prefill_every, deep_tau)

    prog = Progress(1 + 2 * len(names), enabled=progress)
    prog.start("baseline (batch 1)")
    base = runner.baseline()
    prog.advance()
    forced_tokens = [r.token_ids for r in base]
    entries, free_runs, flip_margins = [], {}, {}
    scored_steps = sum(len(r.token_ids) for r in base)
    for name in names:
        prog.start(name)
        free = runner.run(name)
        prog.advance()
        prog.start(f"{name} (teacher-forced)")
        forced = runner.run(name, forced=forced_tokens)
        prog.advance()
        entry, _, fm = compare(name, base, free, forced)
        entries.append(entry)
        free_runs[name] = free
        flip_margins[name] = fm
    prog.finish()

    run_names = ["baseline"] + names
    outputs = [[tuple(int(t) for t in r.token_ids) for r in base]]
    outputs += [[tuple(int(t) for t in r.token_ids) for r in free_runs[n]] for n in names]
    distinct = [len({o[i] for o in outputs}) for i in range(runner.n)]
    matrix = [[sum(a[i] != b[i] for i in range(runner.n)) for b in outputs] for a in outputs]
    report: Dict[str, Any] = {
        "model": model.path,
        "mode": mode,
        "prompts": runner.n,
        "max_new_tokens": max_new_tokens,
        "compositions": entries,
        "gate": None if gate == "off" else {"mode": gate, "tau": tau_v, **runner.gate_totals,
                                            "deep_tau": runner.deep_tau_used},
        "scored_steps": scored_steps,
        "distinct_outputs": distinct,
        "identical_sequences_share": sum(d == 1 for d in distinct) / max(runner.n, 1),
        "pairwise_diverging": {"names": run_names, "matrix": matrix},
        "flip_margins": flip_margins,
        "baseline_margins": _quantiles(np.concatenate([r.margins for r in base]) if base else np.zeros(0)),
    }
    return report


# ----------------------------------------------------------------------------- output


def _fmt_list(xs: Sequence[Any], fmt: str = "{}", limit: int = 6) -> str:
    if not xs:
        return "-"
    s = ",".join("?" if x is None else fmt.format(x) for x in xs[:limit])
    return s + (f",+{len(xs) - limit}" if len(xs) > limit else "")


def format_report(r: Dict[str, Any]) -> str:
    lines = [f"model {os.path.basename(r['model'])}  mode {r['mode']}  prompts {r['prompts']}  "
             f"max_new_tokens {r['max_new_tokens']}  steps/composition {r.get('scored_steps', '?')}"]
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
        lines.append(f"gate {g['mode']} tau={g['tau']:g}: {g['steps']} steps, {g['rechecks']} rechecks "
                     f"({g['rechecks'] / max(g['steps'], 1) * 100:.1f}%), {g['corrections']} corrections"
                     + "".join(f", {v} {k.replace('_', ' ')}" for k, v in g.items() if k not in GATE_KEYS))
    else:
        lines.append("gate off")
    return "\n".join(lines)


def plot_report(r: Dict[str, Any], path: str) -> None:
    """PNG: baseline margins at flipped steps and at divergence, and first divergence positions,
    per composition. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = r["compositions"]
    names = [c["name"] for c in comps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.8 * len(names) + 2), 7), sharex=True)
    fm = r.get("flip_margins", {})
    for x, c in enumerate(comps):
        ys = fm.get(c["name"], [])
        ax1.scatter([x - 0.1] * len(ys), ys, marker="x", color="tab:red",
                    label="flipped step (teacher-forced)" if x == 0 else None)
        ms = [m for m in c["margins_at_divergence"] if m is not None]
        ax1.scatter([x + 0.1] * len(ms), ms, marker="o", facecolors="none", edgecolors="tab:blue",
                    label="first divergence (free-running)" if x == 0 else None)
        ax2.scatter([x] * len(c["first_divergence"]), c["first_divergence"], color="tab:blue")
    ax1.set_ylabel("baseline margin (top1 - top2)")
    ax1.set_title(f"{os.path.basename(r['model'])}, mode {r['mode']}, {r['prompts']} prompts x "
                  f"{r['max_new_tokens']} tokens")
    ax1.legend(loc="upper right", fontsize="small")
    ax2.set_ylabel("first divergent position")
    ax2.set_ylim(-0.5, r["max_new_tokens"])
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(args) -> int:
    prompts = load_prompts(args.prompts) if getattr(args, "prompts", None) else None
    k = getattr(args, "num_prompts", None)
    if k is not None:
        if k <= 0:
            raise ValueError(f"--num-prompts must be positive, got {k}")
        prompts = (DEFAULT_PROMPTS if prompts is None else prompts)[:k]
    report = run_probe(model=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens,
                       mode=args.mode, gate=args.gate, tau=args.tau, profile=args.profile,
                       compositions=args.compositions, progress=True, deep_tau=args.deep_tau)
    print(format_report(report))
    if getattr(args, "json_out", None):
        write_json(report, args.json_out)
        print(f"probe: report written to {args.json_out}", file=sys.stderr)
    if getattr(args, "plot", None):
        try:
            plot_report(report, args.plot)
        except ImportError:
            print(f"probe: --plot needs matplotlib (pip install 'candle-gate[plot]'); "
                  f"no plot written to {args.plot}", file=sys.stderr)
        else:
            print(f"probe: plot written to {args.plot}", file=sys.stderr)
    return 0


class _CallableModule(type(sys)):
    """Importing ``candle_gate.probe`` replaces the package's ``probe`` function with this module;
    keep ``candle_gate.probe(...)`` working by making the module callable (= run_probe)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return run_probe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
