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
baseline's tokens) and returns the results (:class:`Runs`); :mod:`.report` scores them. The
prompts are checked and loaded by :mod:`.common` (shared with the endpoint probe).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _native
from ..engine import Engine, Model, Result, SamplingParams
from .common import progress_bar

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


# ----------------------------------------------------------------------------- compositions


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
        self.gate_totals = dict.fromkeys(_native.GATE_COUNTERS, 0)
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
        tokens, with a progress bar on stderr (:func:`.common.progress_bar`)."""
        with progress_bar(1 + 2 * len(names), enabled=progress) as bar:
            bar.set_postfix_str("baseline (batch 1)")
            base = self.baseline()
            bar.update()
            forced_tokens = [r.token_ids for r in base]
            runs = Runs(list(names), base, {}, {})
            for name in names:
                bar.set_postfix_str(name)
                runs.free[name] = self.run(name)
                bar.update()
                bar.set_postfix_str(f"{name} (teacher-forced)")
                runs.forced[name] = self.run(name, forced=forced_tokens)
                bar.update()
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


