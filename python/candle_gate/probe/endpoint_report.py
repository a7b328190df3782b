"""The endpoint probe's report: scoring one prompt's completions (:func:`score_completions`), the
report around them (:func:`summarize`), the table (:func:`format_report`) and the PNG
(:func:`plot_report`); the answer extractors of ``--extract`` / ``--json-field``
(:func:`make_extractor`). The JSON format is documented in docs/ENDPOINT_PROBE.md ("The JSON
report"); it is written by :func:`.common.write_json` (``ensure_ascii=False``).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .common import first_difference, is_chat, prompt_kind

FORMAT = "candle-gate endpoint probe 1"


# ------------------------------------------------------------------------------------- extraction

def make_extractor(extract: Optional[str] = None,
                   json_field: Optional[str] = None) -> Optional[Callable[[str], Optional[str]]]:
    """The answer of a completion: ``extract`` a regex (its first group, else the whole match),
    or ``json_field`` a dotted path (``a.b.0``) into the completion parsed as JSON (the text,
    else its outermost ``{...}``/``[...]``), the value as canonical JSON. None: no answer found.
    Raises ValueError for a bad regex or both given."""
    if extract is not None and json_field is not None:
        raise ValueError("give --extract or --json-field, not both")
    if extract is not None:
        try:
            rx = re.compile(extract)
        except re.error as e:
            raise ValueError(f"--extract: bad regular expression {extract!r}: {e}") from None

        def by_regex(text: str) -> Optional[str]:
            m = rx.search(text)
            if m is None:
                return None
            return m.group(1) if rx.groups else m.group(0)
        return by_regex
    if json_field is not None:
        if not json_field.strip():
            raise ValueError("--json-field: empty path")
        path = json_field.split(".")

        def by_json(text: str) -> Optional[str]:
            obj = _parse_json(text)
            if obj is _MISSING:
                return None
            for key in path:
                if isinstance(obj, dict) and key in obj:
                    obj = obj[key]
                elif isinstance(obj, list) and re.fullmatch(r"-?\d+", key) and -len(obj) <= int(key) < len(obj):
                    obj = obj[int(key)]
                else:
                    return None
            return json.dumps(obj, sort_keys=True, ensure_ascii=False)
        return by_json
    return None


_MISSING = object()


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    for open_, close in (("{", "}"), ("[", "]")):
        i, j = text.find(open_), text.rfind(close)
        if 0 <= i < j:
            try:
                return json.loads(text[i:j + 1])
            except ValueError:
                pass
    return _MISSING


# ---------------------------------------------------------------------------------------- scoring

def _gap(top: Optional[Sequence[Sequence[float]]], pos: int) -> Optional[float]:
    if top is None or pos >= len(top) or len(top[pos]) < 2:
        return None
    lp = sorted(top[pos], reverse=True)
    return float(lp[0] - lp[1])


def _majority(values: Sequence[Any]) -> Tuple[Any, int]:
    """The most frequent value (ties: the first seen) and its count."""
    c = Counter(values)
    best = max(c.values())
    for v in values:
        if c[v] == best:
            return v, best
    raise ValueError("no values")


def _load_key(c: Dict[str, Any]) -> str:
    return str(c.get("concurrency", 1))


def _empty_score() -> Dict[str, Any]:
    """The entry of a prompt without a completion (every request failed)."""
    return {"distinct": 0, "k_of_n": [0, 0], "flips": 0, "identical": False, "majority": None,
            "first_divergence": None, "divergence_unit": None, "gap_at_divergence": None,
            "divergences": [], "fingerprints": [], "fingerprint_change": False,
            "flip_under_one_fingerprint": False, "by_fingerprint": {}, "by_concurrency": {},
            "by_order": {}, "completions": [], "answer": None}


def _divergences(completions: Sequence[Dict[str, Any]], maj: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Where each completion that is not the majority's text leaves it: in tokens when both
    have token strings that differ (with the majority run's logprob gap there), else in
    characters."""
    divs: List[Dict[str, Any]] = []
    for c in completions:
        if c["text"] == maj["text"]:
            continue
        pos = None
        if maj.get("tokens") is not None and c.get("tokens") is not None:
            pos = first_difference(maj["tokens"], c["tokens"])
        if pos is not None:
            unit, gap = "tokens", _gap(maj.get("top"), pos)
        else:
            pos, unit, gap = first_difference(maj["text"], c["text"]), "chars", None
        divs.append({"position": pos, "unit": unit, "gap": gap, "order": c.get("order"),
                     "concurrency": c.get("concurrency"), "repeat": c.get("repeat"),
                     "fingerprint": c.get("fingerprint")})
    return divs


def _by_fingerprint(completions: Sequence[Dict[str, Any]]) -> Tuple[List[Any], Dict[str, Any], Dict[str, str]]:
    """The fingerprints in order, the per-fingerprint counts (``n``, ``distinct``, ``k_of_n``)
    and each fingerprint's majority text."""
    texts = [c["text"] for c in completions]
    fps = [c.get("fingerprint") for c in completions]
    by_fp: Dict[str, Any] = {}
    majorities: Dict[str, str] = {}
    for fp in dict.fromkeys(fps):
        group = [t for t, f in zip(texts, fps) if f == fp]
        mg, kg = _majority(group)
        by_fp[str(fp)] = {"n": len(group), "distinct": len(set(group)), "k_of_n": [kg, len(group)]}
        majorities[str(fp)] = mg
    return fps, by_fp, majorities


def _breakdown(completions: Sequence[Dict[str, Any]], maj_text: str,
               key: Callable[[Dict[str, Any]], str]) -> Dict[str, Any]:
    """Per load (``key``): ``n``, ``distinct`` and ``flips`` against the overall majority."""
    res: Dict[str, Any] = {}
    for c in completions:
        e = res.setdefault(key(c), {"n": 0, "texts": set(), "flips": 0})
        e["n"] += 1
        e["texts"].add(c["text"])
        e["flips"] += c["text"] != maj_text
    return {kk: {"n": v["n"], "distinct": len(v["texts"]), "flips": v["flips"]} for kk, v in res.items()}


def _distinct_completions(completions: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The distinct texts, most frequent first, with the fingerprints and loads they came under."""
    out = []
    for t, cnt in Counter(c["text"] for c in completions).most_common():
        same = [c for c in completions if c["text"] == t]
        out.append({"text": t, "count": cnt,
                    "fingerprints": sorted({str(c.get("fingerprint")) for c in same}),
                    "loads": sorted({f"{c.get('order')}@{c.get('concurrency')}" for c in same})})
    return out


def _answer_score(texts: Sequence[str], extractor: Callable[[str], Optional[str]]) -> Dict[str, Any]:
    """The same counts over the extracted answers (None: no answer, counted as ``null``)."""
    answers = [extractor(t) for t in texts]
    amaj, ak = _majority(answers)
    return {"distinct": len(set(answers)), "k_of_n": [ak, len(texts)], "flips": len(texts) - ak,
            "majority": amaj, "unparsed": sum(a is None for a in answers),
            "values": dict(Counter("null" if a is None else a for a in answers))}


def score_completions(completions: Sequence[Dict[str, Any]],
                      extractor: Optional[Callable[[str], Optional[str]]] = None,
                      errors: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """Scores one prompt's completions (in the order they were sent; ties for the majority go
    to the first seen, i.e. the first ``alone`` run). Each completion is a dict with ``text``
    and optionally ``tokens`` (token strings), ``top`` (per position, the top logprobs),
    ``fingerprint`` (``system_fingerprint``), ``order``, ``concurrency``, ``repeat``.
    ``errors``: the prompt's failed requests (counted, listed; never scored).
    Returns the report's per-prompt entry (docs/ENDPOINT_PROBE.md)."""
    n = len(completions)
    out: Dict[str, Any] = {"n": n, "errors": len(errors), "error_list": list(errors)}
    if n == 0:
        out.update(_empty_score())
        return out
    texts = [c["text"] for c in completions]
    maj_text, k = _majority(texts)
    divs = _divergences(completions, completions[texts.index(maj_text)])
    first = min(divs, key=lambda d: (d["unit"] != "tokens", d["position"])) if divs else None
    fps, by_fp, fp_majorities = _by_fingerprint(completions)
    out.update({
        "distinct": len(set(texts)),
        "k_of_n": [k, n],
        "flips": n - k,
        "identical": len(set(texts)) == 1,
        "majority": maj_text,
        "first_divergence": first["position"] if first else None,
        "divergence_unit": first["unit"] if first else None,
        "gap_at_divergence": first["gap"] if first else None,
        "divergences": divs,
        "fingerprints": sorted({str(f) for f in fps}),
        "fingerprint_change": len(set(fps)) > 1,
        "flip_under_one_fingerprint": any(v["distinct"] > 1 for v in by_fp.values()),
        "outputs_differ_across_fingerprints": len(set(fp_majorities.values())) > 1,
        "by_fingerprint": by_fp,
        "by_concurrency": _breakdown(completions, maj_text, _load_key),
        "by_order": _breakdown(completions, maj_text, lambda c: str(c.get("order"))),
        "completions": _distinct_completions(completions),
        "answer": None if extractor is None else _answer_score(texts, extractor),
    })
    return out


def summarize(prompts: Sequence[Any], per_prompt: Sequence[Dict[str, Any]],
              settings: Dict[str, Any]) -> Dict[str, Any]:
    """The top-level report around the per-prompt entries."""
    entries = []
    for i, (p, e) in enumerate(zip(prompts, per_prompt)):
        entries.append({"index": i, "kind": prompt_kind(p), "prompt": p, **e})
    scored = [e for e in entries if e["n"] > 0]
    has_answer = any(e["answer"] is not None for e in entries)
    fps = sorted({f for e in entries for f in e["fingerprints"]})
    return {
        "format": FORMAT,
        **settings,
        "requests": sum(e["n"] + e["errors"] for e in entries),
        "completions": sum(e["n"] for e in entries),
        "errors": sum(e["errors"] for e in entries),
        "all_identical": bool(scored) and len(scored) == len(entries) and all(e["identical"] for e in entries),
        "prompts_with_flips": sum(e["distinct"] > 1 for e in entries),
        "prose_flips": sum(e["flips"] for e in entries),
        "answer_flips": sum(e["answer"]["flips"] for e in entries if e["answer"]) if has_answer else None,
        "prompts_with_answer_flips": (sum(e["answer"]["distinct"] > 1 for e in entries if e["answer"])
                                      if has_answer else None),
        "fingerprints": fps,
        "fingerprint_change": len(fps) > 1,
        "flip_under_one_fingerprint": any(e["flip_under_one_fingerprint"] for e in entries),
        "prompts": entries,
    }


# ---------------------------------------------------------------------------------------- output

def _short(p: Any, width: int = 34) -> str:
    if is_chat(p):
        s = p[-1].get("content")
    elif isinstance(p, str):
        s = p
    else:
        s = f"<{len(p)} token ids: {' '.join(map(str, p[:6]))}{' ...' if len(p) > 6 else ''}>"
    s = str(s).replace("\n", " ")
    return s if len(s) <= width else s[:width - 1] + "…"


def format_report(r: Dict[str, Any]) -> str:
    lines = [f"endpoint probe: {r['endpoint']} model {r['model']}: {len(r['prompts'])} prompts x {r['repeats']} "
             f"repeats, concurrency {','.join(map(str, r['concurrency']))}, orders {','.join(r['orders'])}, "
             f"max_tokens {r['max_tokens']}, temperature {r['temperature']}"
             + (", streaming" if r.get("stream") else "")]
    ans = r["answer_flips"] is not None
    head = ["#", "prompt", "ok", "err", "distinct", "k/n", "per C (distinct)", "1st div", "gap", "fp"]
    if ans:
        head += ["answer k/n"]
    rows = [head]
    for e in r["prompts"]:
        div = "-" if e["first_divergence"] is None else f"{e['first_divergence']}{'t' if e['divergence_unit'] == 'tokens' else 'c'}"
        gap = "-" if e["gap_at_divergence"] is None else f"{e['gap_at_divergence']:.3f}"
        perc = " ".join(f"{c}:{v['distinct']}" for c, v in e["by_concurrency"].items())
        fp = str(len(e["fingerprints"])) + ("!" if e["fingerprint_change"] else "")
        row = [str(e["index"]), _short(e["prompt"]), str(e["n"]), str(e["errors"]), str(e["distinct"]),
               f"{e['k_of_n'][0]}/{e['k_of_n'][1]}", perc, div, gap, fp]
        if ans:
            row.append("-" if e["answer"] is None else f"{e['answer']['k_of_n'][0]}/{e['answer']['k_of_n'][1]}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    lines.append(f"all identical: {'yes' if r['all_identical'] else 'no'}; prompts with flips "
                 f"{r['prompts_with_flips']}/{len(r['prompts'])}; prose flips {r['prose_flips']}"
                 + (f"; answer flips {r['answer_flips']}" if ans else "")
                 + f"; errors {r['errors']} of {r['requests']} requests; fingerprints {len(r['fingerprints'])}"
                 + (" (changed during the run)" if r["fingerprint_change"] else ""))
    if r["flip_under_one_fingerprint"]:
        lines.append("flips under one system_fingerprint: yes")
    if r["logprobs"]["note"]:
        lines.append("note: " + r["logprobs"]["note"])
    for e in r["prompts"]:
        for err in e["error_list"][:3]:
            lines.append(f"error: prompt {e['index']} ({err['order']}@{err['concurrency']}, repeat {err['repeat']}, "
                         f"{err['attempts']} attempts): {err['error']}")
    return "\n".join(lines)


def plot_report(r: Dict[str, Any], path: str) -> None:
    """A PNG: distinct completions per prompt and concurrency (bars); the divergence positions
    per prompt; the logprob gaps at the divergences. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    prompts = r["prompts"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10))
    ax = axes[0]
    levels = [str(c) for c in r["concurrency"]]
    if "alone" in r["orders"] and "1" not in levels:
        levels = ["1"] + levels
    w = 0.8 / max(1, len(levels))
    for j, c in enumerate(levels):
        ys = [e["by_concurrency"].get(c, {}).get("distinct", 0) for e in prompts]
        ax.bar([i - 0.4 + (j + 0.5) * w for i in range(len(prompts))], ys, width=w, label=f"C={c}")
    ax.set_title("distinct completions per prompt and concurrency")
    ax.set_xlabel("prompt")
    ax.set_ylabel("distinct")
    ax.legend(fontsize="small")
    ax = axes[1]
    xs, ys = [], []
    for e in prompts:
        for d in e["divergences"]:
            xs.append(e["index"])
            ys.append(d["position"])
    if xs:
        ax.scatter(xs, ys, marker="x")
    else:
        ax.text(0.5, 0.5, "no divergences", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("first divergence against the majority completion (tokens, else characters)")
    ax.set_xlabel("prompt")
    ax.set_ylabel("position")
    ax = axes[2]
    gaps = [(e["index"], d["gap"]) for e in prompts for d in e["divergences"] if d["gap"] is not None]
    if gaps:
        ax.scatter([g[0] for g in gaps], [g[1] for g in gaps], marker="o")
    else:
        ax.text(0.5, 0.5, "no logprob gaps (no divergences, or no logprobs)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title("top-1 minus top-2 logprob in the majority run at the divergence")
    ax.set_xlabel("prompt")
    ax.set_ylabel("gap (nats)")
    from matplotlib.ticker import MaxNLocator
    for a in axes:
        a.set_xlim(-0.5, max(len(prompts), 1) - 0.5)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
