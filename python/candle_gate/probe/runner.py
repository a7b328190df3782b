"""Running the probe: the prompt sets, the batch compositions and the engines that run them.

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
that a composition differs from the baseline only in what shares the steps. :meth:`Runner.run_all`
runs the baseline and every composition twice (free-running, and teacher-forced to the
baseline's tokens) and returns the results (:class:`Runs`); :mod:`.report` scores them.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _native
from ..engine import Engine, Model, Result, SamplingParams

COMPOSITIONS = ("batch2", "batch3", "batch4", "batch5", "batch8", "batch16", "staggered",
                "mixed_prefill", "reversed", "threads1", "threads2")

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
            try:
                _native.check_chat(json.dumps(p, ensure_ascii=False))
            except TypeError as e:
                raise ValueError(f"prompt {i}: {e}") from None
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


@dataclass
class Runs:
    """What one probe ran, every list in prompt order: the baseline (each prompt alone) and, per
    composition, the free-running and the teacher-forced results."""

    names: List[str]
    baseline: List[Result]
    free: Dict[str, List[Result]]
    forced: Dict[str, List[Result]]

    @property
    def baseline_margins(self) -> np.ndarray:
        """The baseline's top1-top2 margin at every scored step."""
        if not self.baseline:
            return np.zeros(0, np.float32)
        return np.concatenate([r.margins for r in self.baseline])


class Runner:
    """Runs prompt sets under batch compositions with one engine configuration. Shared by the
    probe and by ``calibrate --gate``."""

    def __init__(self, model: Model, prompts: Sequence[Any], max_new_tokens: int, mode: str,
                 gate: str = "off", tau: float = 0.0, profile: Optional[str] = None,
                 row_split_max: Optional[int] = None, mixed_prefill_every: int = MIXED_PREFILL_EVERY,
                 deep_tau: Optional[float] = None, sampling: Optional[Dict[str, Any]] = None):
        if isinstance(mixed_prefill_every, bool) or not isinstance(mixed_prefill_every, int) or mixed_prefill_every <= 0:
            raise ValueError(f"mixed_prefill_every must be a positive int, got {mixed_prefill_every!r}")
        self.mixed_prefill_every = mixed_prefill_every
        self.model, self.mode, self.gate, self.tau = model, mode, gate, float(tau)
        self.profile, self.row_split_max, self.deep_tau = profile, row_split_max, deep_tau
        self.max_new_tokens = max_new_tokens
        # Sampling keywords (temperature, top_p, ..., seed); prompt i is keyed by seed + i, so
        # that the prompts do not share their draws.
        self.sampling = dict(sampling or {})
        self.seed = self.sampling.pop("seed", None)
        if self.sampling.get("temperature", 0) and self.seed is None:
            self.seed = 0
        SamplingParams(max_new_tokens=max_new_tokens, seed=self.seed, **self.sampling)  # checked once, here
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
        self.gate_source: Optional[str] = None  # the calibration tau came from, when it did

    @property
    def n(self) -> int:
        return len(self.ids)

    def sampling_report(self) -> Optional[Dict[str, Any]]:
        """The sampling keywords and the base seed (prompt i: seed + i); None when greedy."""
        if not self.sampling.get("temperature", 0):
            return None
        return {**self.sampling, "seed": self.seed}

    def engine(self, n_seqs: int, threads: Optional[int] = None, budget: int = MAX_TOKENS_PER_STEP) -> Engine:
        extra = {} if self.deep_tau is None else {"deep_tau": self.deep_tau}
        # The probe measures what the kernels do with each composition: every run prefills its
        # prompt itself (in a non-invariant mode a cached prefix would carry another run's bits).
        eng = Engine(self.model, mode=self.mode, profile=self.profile, gate=self.gate, tau=self.tau,
                     max_num_seqs=max(16, n_seqs + 1), max_tokens_per_step=budget,
                     prefill_chunk=PREFILL_CHUNK, threads=threads, record_logit_hashes=True,
                     row_split_max=self.row_split_max, enable_prefix_caching=False, **extra)
        self.deep_tau_used = eng.deep_tau
        return eng

    def _submit(self, eng: Engine, i: int, forced: Optional[Sequence[np.ndarray]]) -> int:
        kw = dict(self.sampling)
        if self.seed is not None:
            kw["seed"] = (int(self.seed) + i) % (1 << 64)
        if forced is None:
            return eng.submit(self.ids[i], max_new_tokens=self.max_new_tokens, **kw)
        f = [int(t) for t in forced[i]]
        return eng.submit(self.ids[i], max_new_tokens=max(len(f), 1), forced_tokens=f, **kw)

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

    def run_all(self, names: Sequence[str], progress: bool = True) -> Runs:
        """The baseline, then each of ``names`` free-running and teacher-forced to the baseline's
        tokens, with a progress indicator on stderr."""
        prog = Progress(1 + 2 * len(names), enabled=progress)
        prog.start("baseline (batch 1)")
        base = self.baseline()
        prog.advance()
        forced_tokens = [r.token_ids for r in base]
        runs = Runs(list(names), base, {}, {})
        for name in names:
            prog.start(name)
            runs.free[name] = self.run(name)
            prog.advance()
            prog.start(f"{name} (teacher-forced)")
            runs.forced[name] = self.run(name, forced=forced_tokens)
            prog.advance()
        prog.finish()
        return runs

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
        while any(not eng.is_finished(r) for r in rids):
            if len(started) == self.n and k % self.mixed_prefill_every == 0:
                eng.submit(self.filler, max_new_tokens=1)
            if eng.step() == 0 and not eng.has_work:
                break
            if len(started) == self.n:
                k += 1
            for ev in eng.events():
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


