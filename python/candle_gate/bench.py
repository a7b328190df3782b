"""``candle-gate bench throughput``: aggregate decode tok/s at several concurrencies.

For each concurrency c a fresh engine gets c requests with distinct prompts. The engine is
stepped until every request has produced its first token (the prefill, not timed); then the
rest of the run is timed, and tok/s = tokens generated in that phase / its wall time.
Requests that stop early (EOS) simply contribute fewer tokens. A short warm-up run comes first.
Timings are ratios taken side by side in one run (DESIGN.md §5): compare modes and
concurrencies within one invocation, not across machines.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from .engine import GATES, MODES, Engine, Model

# Chat prompts that ask for long answers, so requests rarely stop before max_new_tokens.
BENCH_TOPICS = [
    "the history of the bicycle", "how volcanoes form", "the rules of chess",
    "how a refrigerator works", "the life cycle of a star", "the causes of the French Revolution",
    "how vaccines train the immune system", "the water cycle", "how compilers work",
    "the migration of birds", "the invention of paper", "how bees make honey",
    "the theory of plate tectonics", "how airplanes stay in the air", "the history of jazz",
    "how the internet routes packets",
]


def bench_prompt(i: int) -> List[Dict[str, str]]:
    topic = BENCH_TOPICS[i % len(BENCH_TOPICS)]
    extra = "" if i < len(BENCH_TOPICS) else f" (version {i // len(BENCH_TOPICS) + 1})"
    return [{"role": "user", "content": f"Write a long, detailed essay about {topic}{extra}."}]


def parse_concurrency(spec: Union[str, Sequence[int]]) -> List[int]:
    if isinstance(spec, str):
        try:
            vals = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--concurrency must be a comma-separated list of positive ints, got {spec!r}") from None
    else:
        vals = [int(x) for x in spec]
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"concurrency values must be positive ints, got {spec!r}")
    return vals


def _measure(model: Model, mode: str, c: int, max_new_tokens: int, gate: str,
             tau: Optional[float], profile: Optional[str]) -> Dict[str, Any]:
    eng = Engine(model, mode=mode, profile=profile, gate=gate, tau=tau, max_num_seqs=max(16, c),
                 max_tokens_per_step=max(256, 64 * c))
    ids = [eng.submit(bench_prompt(i), max_new_tokens=max_new_tokens, chat=True) for i in range(c)]
    started = set()
    while len(started) < c and eng.has_work:
        eng.step()
        for ev in eng._native.events():
            if ev["type"] == "token":
                started.add(ev["id"])
    decode_tokens = 0
    t0 = time.perf_counter()
    while eng.has_work:
        eng.step()
        decode_tokens += sum(1 for ev in eng._native.events() if ev["type"] == "token")
    dt = time.perf_counter() - t0
    eng.run(ids)
    return {"concurrency": c, "tok_per_s": decode_tokens / dt if dt > 0 and decode_tokens > 0 else 0.0,
            "decode_tokens": decode_tokens, "seconds": dt}


def throughput(model: Union[None, str, Model] = None, mode: str = "invariant",
               concurrency_list: Union[str, Sequence[int]] = (1, 2, 4, 8, 16), max_new_tokens: int = 32,
               gate: str = "off", tau: Optional[float] = None, profile: Optional[str] = None,
               warmup: bool = True) -> Dict[str, Any]:
    """``{"mode", "gate", "results": [{"concurrency": c, "tok_per_s": x}]}``: aggregate decode
    tok/s for each concurrency (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; expected one of {', '.join(GATES)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2 (the first token is not timed), got {max_new_tokens!r}")
    cs = parse_concurrency(concurrency_list)
    if not isinstance(model, Model):
        model = Model.load(model, mode=mode, profile=profile)
    if warmup:
        _measure(model, mode, 1, 2, gate, tau, profile)
    results = []
    for c in cs:
        m = _measure(model, mode, c, max_new_tokens, gate, tau, profile)
        results.append({"concurrency": c, "tok_per_s": m["tok_per_s"]})
    return {"mode": mode, "gate": gate, "results": results}


def format_table(r: Dict[str, Any]) -> str:
    res = r["results"]
    ref = next((x["tok_per_s"] for x in res if x["concurrency"] == 1), res[0]["tok_per_s"] if res else 0.0)
    ref_c = 1 if any(x["concurrency"] == 1 for x in res) else (res[0]["concurrency"] if res else 1)
    lines = [f"mode {r['mode']}  gate {r['gate']}", f"{'concurrency':>11} {'tok/s':>9} {f'vs c={ref_c}':>8}"]
    for x in res:
        sp = x["tok_per_s"] / ref if ref > 0 else float("nan")
        lines.append(f"{x['concurrency']:>11} {x['tok_per_s']:9.1f} {sp:7.2f}x")
    return "\n".join(lines)


def main(args) -> int:
    if getattr(args, "bench", "throughput") != "throughput":
        raise ValueError(f"unknown benchmark {args.bench!r}")
    r = throughput(model=args.model, mode=args.mode, concurrency_list=args.concurrency,
                   max_new_tokens=args.max_new_tokens, gate=args.gate, tau=args.tau,
                   profile=args.profile)
    if args.json:
        print(json.dumps(r))
    else:
        print(format_table(r))
    sys.stdout.flush()
    return 0
