"""``candle-gate bench throughput``: aggregate decode tok/s at several concurrencies.
``candle-gate bench gate``: the margin gate's cost, off / gated / always in one run.
``candle-gate bench sampling``: seeded sampling's cost against greedy decoding, side by side.

For each concurrency c a fresh engine gets c requests with distinct prompts. The engine is
stepped until every request has produced its first token (the prefill, not timed); then the
rest of the run is timed, and tok/s = tokens generated in that phase / its wall time.
Requests that stop early (EOS) simply contribute fewer tokens. A short warm-up run comes first.
Timings are ratios taken side by side in one run (docs/DESIGN.md §5): compare modes and
concurrencies within one invocation, not across machines.

The gate benchmark runs the same requests (concurrency c) with the gate off, gated and always,
``repeats`` times in turn, and keeps each setting's fastest run. From the time per decoded token
it reports the time the gate adds over off and the time always adds, and their ratio
(gated's added time / always's added time: 0 = free, 1 = as costly as checking every step),
with the recheck rate of the gated run. With sampling arguments (``--temperature 0.8 --top-p
0.95``) every request samples, keyed by ``seed + i``.

The sampling benchmark runs the same requests greedy and sampled in turn at each concurrency,
``repeats`` times, keeps each side's fastest run and prints sampled tok/s / greedy tok/s.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Union

from .calibrate import CALIBRATION_MODE
from .engine import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE, Engine, Model, layout_for, resolve_gate
from .probe.common import check_concurrency

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


def chat_ids(model: Model, chat: List[Dict[str, str]]) -> List[int]:
    """A chat as token ids: through the model's template, or for a base model (no template) its
    last message as plain text."""
    return model.encode_chat(chat) if model.chat_template is not None else model.tokenize(chat[-1]["content"])


def bench_ids(model: Model, i: int) -> List[int]:
    """Request ``i``'s prompt as token ids (:func:`chat_ids`)."""
    return chat_ids(model, bench_prompt(i))


def _sampling_for(sampling: Optional[Dict[str, Any]], i: int) -> Dict[str, Any]:
    """Request i's sampling keywords: ``sampling`` with its seed offset by i."""
    kw = dict(sampling or {})
    if kw.get("temperature"):
        kw["seed"] = int(kw.get("seed") or 0) + i
    return kw


def _measure(model: Model, mode: str, c: int, max_new_tokens: int, gate: str,
             tau: Optional[float], profile: Optional[str], deep_tau: Optional[float] = None,
             sampling: Optional[Dict[str, Any]] = None,
             speculative: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    eng = Engine(model, mode=mode, profile=profile, gate=gate, tau=tau, deep_tau=deep_tau,
                 max_num_seqs=max(16, c), max_tokens_per_step=max(256, 64 * c), speculative=speculative)
    ids = [eng.submit(bench_ids(model, i), max_new_tokens=max_new_tokens, **_sampling_for(sampling, i))
           for i in range(c)]
    started = set()
    while len(started) < c and eng.has_work:
        eng.step()
        for ev in eng.events():
            if ev["type"] == "token":
                started.add(ev["id"])
    decode_tokens = 0
    t0 = time.perf_counter()
    while eng.has_work:
        eng.step()
        decode_tokens += sum(1 for ev in eng.events() if ev["type"] == "token")
    dt = time.perf_counter() - t0
    eng.run(ids)
    spec = eng.spec_stats()
    return {"concurrency": c, "tok_per_s": decode_tokens / dt if dt > 0 and decode_tokens > 0 else 0.0,
            "decode_tokens": decode_tokens, "seconds": dt, "gate_stats": eng.gate_stats(),
            "acceptance": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None}


def throughput(model: Union[None, str, Model] = None, mode: str = DEFAULT_MODE,
               concurrency_list: Union[int, Sequence[int]] = (1, 2, 4, 8, 16), max_new_tokens: int = 32,
               gate: str = "off", tau: Optional[float] = None, profile: Optional[str] = None,
               warmup: bool = True, deep_tau: Optional[float] = None,
               speculative: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``{"mode", "gate", "speculative", "results": [{"concurrency": c, "tok_per_s": x,
    "acceptance": drafts kept / proposed or None}]}``: aggregate decode tok/s for each concurrency
    (see the module docstring), with ``speculative`` as ``Engine(speculative=...)`` takes it. The
    mode, the gate and its numbers are checked by the Rust side (resolve_gate, the
    engines)."""
    resolve_gate(gate, tau, deep_tau, profile)  # a bad gate fails before the model loads
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2 (the first token is not timed), got {max_new_tokens!r}")
    cs = check_concurrency(concurrency_list)
    if not isinstance(model, Model):
        model = Model.load(model, layout=layout_for(mode))
    if warmup:
        _measure(model, mode, 1, 2, gate, tau, profile, deep_tau, speculative=speculative)
    results = []
    for c in cs:
        m = _measure(model, mode, c, max_new_tokens, gate, tau, profile, deep_tau, speculative=speculative)
        results.append({"concurrency": c, "tok_per_s": m["tok_per_s"], "acceptance": m["acceptance"]})
    named = speculative and {k: v for k, v in speculative.items() if k != "draft_model"}
    return {"mode": mode, "gate": gate, "speculative": named or None, "results": results}


def gate_cost(model: Union[None, str, Model] = None, mode: str = CALIBRATION_MODE, concurrency: int = 4,
              max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, tau: Optional[float] = None, deep_tau: Optional[float] = None,
              profile: Optional[str] = None, repeats: int = 2,
              sampling: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Off / gated / always side by side (see the module docstring). The mode and the gate's
    numbers are checked by the Rust side (the engines)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency <= 0:
        raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2, got {max_new_tokens!r}")
    if not isinstance(model, Model):
        model = Model.load(model, layout=layout_for(mode))
    # Resolve tau once (explicit, else the profile's) so that every run uses the same numbers.
    probe_engine = Engine(model, mode=mode, profile=profile, gate="gated", tau=tau, deep_tau=deep_tau)
    tau, deep_tau = probe_engine.tau, probe_engine.deep_tau
    _measure(model, mode, 1, 2, "off", None, profile)
    best: Dict[str, Dict[str, Any]] = {}
    for _ in range(max(1, repeats)):
        for gate in ("off", "gated", "always"):
            m = _measure(model, mode, concurrency, max_new_tokens, gate,
                         tau if gate == "gated" else None, profile, deep_tau, sampling)
            if gate not in best or m["tok_per_s"] > best[gate]["tok_per_s"]:
                best[gate] = m
    ms = {g: 1000.0 / best[g]["tok_per_s"] for g in best}
    added_gated, added_always = ms["gated"] - ms["off"], ms["always"] - ms["off"]
    st = best["gated"]["gate_stats"]
    return {
        "mode": mode, "concurrency": concurrency, "tau": tau, "deep_tau": deep_tau,
        "sampling": sampling or None,
        "tok_per_s": {g: best[g]["tok_per_s"] for g in ("off", "gated", "always")},
        "ms_per_token": ms,
        "added_ms_gated": added_gated,
        "added_ms_always": added_always,
        "gated_vs_always": added_gated / added_always if added_always > 0 else float("nan"),
        "recheck_rate": st["rechecks"] / st["steps"] if st["steps"] else 0.0,
        "deep_rechecks": st.get("deep_rechecks", 0),
    }


def sampling_cost(model: Union[None, str, Model] = None, mode: str = DEFAULT_MODE,
                  concurrency_list: Union[int, Sequence[int]] = (1, 8), max_new_tokens: int = 32,
                  sampling: Optional[Dict[str, Any]] = None, repeats: int = 2) -> Dict[str, Any]:
    """Greedy and sampled decoding of the same requests in turn (see the module docstring)."""
    sampling = dict(sampling or {"temperature": 0.8, "top_p": 0.95, "seed": 0})
    if not sampling.get("temperature"):
        raise ValueError("the sampling benchmark needs a temperature > 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2, got {max_new_tokens!r}")
    cs = check_concurrency(concurrency_list)
    if not isinstance(model, Model):
        model = Model.load(model, layout=layout_for(mode))
    _measure(model, mode, 1, 2, "off", None, None, sampling=sampling)
    results = []
    for c in cs:
        best = {"greedy": 0.0, "sampled": 0.0}
        for _ in range(max(1, repeats)):
            for name, kw in (("greedy", None), ("sampled", sampling)):
                best[name] = max(best[name], _measure(model, mode, c, max_new_tokens, "off", None, None,
                                                      sampling=kw)["tok_per_s"])
        ratio = best["sampled"] / best["greedy"] if best["greedy"] > 0 else float("nan")
        results.append({"concurrency": c, **best, "ratio": ratio})
    return {"mode": mode, "sampling": sampling, "results": results}


def format_sampling_cost(r: Dict[str, Any]) -> str:
    lines = [f"mode {r['mode']}  sampling " + " ".join(f"{k}={v}" for k, v in r["sampling"].items()),
             f"{'concurrency':>11} {'greedy tok/s':>13} {'sampled tok/s':>14} {'sampled/greedy':>15}"]
    for x in r["results"]:
        lines.append(f"{x['concurrency']:>11} {x['greedy']:13.1f} {x['sampled']:14.1f} {x['ratio']:14.3f}x")
    return "\n".join(lines)


def format_gate_cost(r: Dict[str, Any]) -> str:
    lines = [f"mode {r['mode']}  concurrency {r['concurrency']}  tau {r['tau']:.4g}  deep_tau {r['deep_tau']:.4g}"
             + ("  sampling " + " ".join(f"{k}={v}" for k, v in r["sampling"].items()) if r.get("sampling") else ""),
             f"{'gate':>7} {'tok/s':>8} {'ms/token':>9}"]
    for g in ("off", "gated", "always"):
        lines.append(f"{g:>7} {r['tok_per_s'][g]:8.1f} {r['ms_per_token'][g]:9.2f}")
    lines.append(f"added ms/token: gated {r['added_ms_gated']:.2f}, always {r['added_ms_always']:.2f} "
                 f"-> gated/always = {r['gated_vs_always']:.2f}x  (recheck rate {100 * r['recheck_rate']:.1f}%, "
                 f"{r['deep_rechecks']} deep rechecks)")
    return "\n".join(lines)


def format_table(r: Dict[str, Any]) -> str:
    res = r["results"]
    ref = next((x["tok_per_s"] for x in res if x["concurrency"] == 1), res[0]["tok_per_s"] if res else 0.0)
    ref_c = 1 if any(x["concurrency"] == 1 for x in res) else (res[0]["concurrency"] if res else 1)
    spec = r.get("speculative")
    head = f"mode {r['mode']}  gate {r['gate']}" + (f"  speculative {spec}" if spec else "")
    lines = [head, f"{'concurrency':>11} {'tok/s':>9} {f'vs c={ref_c}':>8}" + (f" {'accepted':>9}" if spec else "")]
    for x in res:
        sp = x["tok_per_s"] / ref if ref > 0 else float("nan")
        acc = x.get("acceptance")
        tail = f" {'-' if acc is None else f'{acc:.0%}':>9}" if spec else ""
        lines.append(f"{x['concurrency']:>11} {x['tok_per_s']:9.1f} {sp:7.2f}x{tail}")
    return "\n".join(lines)
