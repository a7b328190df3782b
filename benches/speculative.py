"""Speculative decoding side by side, greedy, on two tasks:

* `edits`: code-edit prompts (the prompt holds a 45–60-line function and asks for it back with
  a small change: benches/prompts/code_edits.json), with n-gram (prompt lookup) drafts and with
  the draft model;
* `completion`: code-completion prompts (a signature and a docstring to complete:
  benches/prompts/code_completion.json), with the draft model;

plain decode against each, one stream and several; and llama.cpp on the same GGUFs, one stream:
llama-cpp-python plain and with its `LlamaPromptLookupDecoding` (n-gram), and llama.cpp's own
`llama-server` plain and with `--spec-draft-model` (the draft model) when it is built
(benches/build_llama_server.sh).

    python benches/speculative.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m]
        [--draft-model qwen2.5-coder-0.5b-instruct-q4_k_m] [--tasks edits,completion]
        [--k 5,8] [--draft-k 3,4] [--max-new-tokens 96] [--streams 1,8]
        [--llama-server PATH] [--no-llama-cpp] [--json OUT]

Decode tok/s is timed from each request's first token to its last (the prompt's prefill, and
the draft model's, is not in it). Per row: tok/s, the ratio to plain, the acceptance rate
(drafts kept / drafts proposed), tokens per target pass (a single stream's tokens per step),
and whether every request's tokens equal plain decoding's (ours must: speculation changes no
bit; llama.cpp's is shown as it is). For the draft model it also prints the acceptance rate at
which drafting breaks even, from the two models' measured plain decode speeds.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import candle_gate
from candle_gate import Engine, Model

PROMPTS = {"edits": Path(__file__).parent / "prompts" / "code_edits.json",
           "completion": Path(__file__).parent / "prompts" / "code_completion.json"}
DEFAULT_LLAMA_SERVER = Path(__file__).parent.parent / "target" / "llama-server" / "build" / "bin" / "llama-server"


def ours(model, chats, streams, max_new, spec):
    """Decode tok/s of the prompts, `streams` at a time (one stream: each prompt alone, one after
    another, as llama.cpp runs them), the outputs, the counts."""
    if streams == 1:
        runs = [_ours(model, [c], 1, max_new, spec) for c in chats]
        secs = sum(r["secs"] for r in runs)
        tokens = sum(r["decoded"] for r in runs)
        return {"tok_per_s": tokens / secs if secs > 0 else 0.0, "tokens": [t for r in runs for t in r["tokens"]],
                "drafted": sum(r["drafted"] for r in runs), "accepted": sum(r["accepted"] for r in runs),
                "tokens_per_pass": tokens / max(1, sum(r["passes"] for r in runs))}
    return _ours(model, chats, streams, max_new, spec)


def _ours(model, chats, streams, max_new, spec):
    eng = Engine(model, speculative=spec, max_num_seqs=max(16, streams))
    reqs = [chats[i % len(chats)] for i in range(streams)]
    ids = [eng.submit(c, max_new_tokens=max_new) for c in reqs]
    first, times, decode_steps = {}, [], 0
    while eng.has_work:
        eng.step()
        now = time.perf_counter()
        for ev in eng.events():
            if ev["type"] == "token":
                first.setdefault(ev["id"], now)
                times.append(now)
        decode_steps += len(first) == len(ids)
    res = eng.run(ids)
    # from the moment every stream decodes (its prompt's prefill is behind it) to the last token
    t0 = max(first.values())
    tokens = sum(1 for t in times if t > t0)
    secs = max(times) - t0
    stats = eng.spec_stats()
    return {
        "tok_per_s": tokens / secs if secs > 0 else 0.0,
        "tokens": [r.token_ids.tolist() for r in res],
        "drafted": stats["draft_tokens"], "accepted": stats["accepted_tokens"],
        "tokens_per_pass": None, "secs": secs, "decoded": tokens, "passes": max(1, decode_steps - 1),
    }


def llama_cpp_run(path, chats, model, max_new, k, threads):
    """llama.cpp, one stream: each prompt's decode tok/s and tokens, plain (k=0) or with prompt
    lookup drafts of k tokens."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                          draft_model=draft, verbose=False, logits_all=bool(k))
    out, secs, n = [], 0.0, 0
    stop = set(model.stop_ids)
    for c in chats:
        ids = model.encode_prompt(c)
        llm.reset()
        toks, t_first, t_last = [], None, None
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            now = time.perf_counter()
            toks.append(t)
            t_first = t_first or now
            t_last = now
            if t in stop or len(toks) >= max_new:
                break
        out.append(toks)
        secs += (t_last - t_first) if t_first else 0.0
        n += max(0, len(toks) - 1)
    return {"tok_per_s": n / secs if secs > 0 else 0.0, "tokens": out}


def llama_server_run(a, chats, model, draft_path, k):
    """llama.cpp's own server, one stream: each prompt's decode tok/s and tokens, plain (`k` 0)
    or drafting up to `k` tokens with the draft model."""
    import httpx
    from prefix_cache import Server, free_port
    port = free_port()
    cmd = [a.llama_server, "-m", model.path, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
           "--parallel", "1", "-c", "4096", "--no-webui"]
    if k:
        cmd += ["--spec-draft-model", draft_path, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                "--spec-draft-threads", str(a.threads)]
    server = Server("llama-server", cmd, port)
    try:
        out, secs, n, drafted, accepted = [], 0.0, 0, 0, 0
        for c in chats:
            body = {"prompt": model.encode_prompt(c), "n_predict": a.max_new_tokens, "temperature": 0.0,
                    "top_k": 1, "cache_prompt": False, "return_tokens": True}
            r = httpx.post(server.url + "/completion", json=body, timeout=3600).json()
            out.append(r["tokens"])
            t = r["timings"]
            secs += t["predicted_ms"] / 1000
            n += t["predicted_n"]
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
        return {"tok_per_s": n / secs if secs > 0 else 0.0, "tokens": out, "drafted": drafted, "accepted": accepted}
    finally:
        server.stop()


def draft_cost(model, draft):
    """A draft model's decode step as a fraction of the target's (plain, single stream)."""
    def step_secs(m):
        eng = Engine(m)
        eng.generate(["def f(x):"], max_new_tokens=4)
        t = time.perf_counter()
        eng.generate(["def fibonacci(n):"], max_new_tokens=32)
        return (time.perf_counter() - t) / 32
    return step_secs(draft) / step_secs(model)


def break_even(c, k):
    """The per-draft acceptance rate at which drafting k tokens, each costing c of a target
    step, pays for itself with the verification pass costed at one decode step (optimistic:
    its extra rows cost compute too)."""
    # expected tokens per pass (1 - α^(k+1)) / (1 - α) against the cost 1 + k·c
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        tokens = sum(mid ** i for i in range(k + 1))
        lo, hi = (mid, hi) if tokens < 1 + k * c else (lo, mid)
    return lo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--tasks", default="edits,completion")
    ap.add_argument("--k", default="5,8", help="n-gram drafts per step to try")
    ap.add_argument("--draft-k", default="3,4", help="draft-model drafts per step to try")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER) if DEFAULT_LLAMA_SERVER.exists() else None,
                    help="llama.cpp's llama-server (default: the one benches/build_llama_server.sh built, if any)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = Model.load(a.model, quiet=True)
    draft = Model.load(a.draft_model, quiet=True)
    ks, draft_ks = [int(x) for x in a.k.split(",")], [int(x) for x in a.draft_k.split(",")]
    rows = []
    print(f"{a.model}, draft {a.draft_model}, greedy, {a.max_new_tokens} new tokens; "
          f"candle-gate {candle_gate.__version__}", flush=True)
    c = draft_cost(model, draft)
    print(f"a draft step costs {c:.2f} of a target step; drafting breaks even at "
          + ", ".join(f"{break_even(c, k):.0%} (k={k})" for k in draft_ks)
          + " acceptance per draft, verification costed as one step", flush=True)
    for task in a.tasks.split(","):
        chats = json.loads(PROMPTS[task].read_text())[: a.prompts]
        methods = [("ngram", k) for k in ks if task == "edits"] + [("draft", k) for k in draft_ks]
        print(f"\n{task}: {len(chats)} prompts", flush=True)
        print(f"{'who':>11} {'streams':>7} {'drafts':>10} {'tok/s':>7} {'vs plain':>8} {'accept':>7} "
              f"{'tok/pass':>8} {'= plain':>7}", flush=True)
        for streams in [int(x) for x in a.streams.split(",")]:
            Engine(model).generate([chats[0]], max_new_tokens=2)  # warms the code paths
            plain = ours(model, chats, streams, a.max_new_tokens, None)
            rows.append(_row(task, "candle-gate", streams, "off", plain, plain))
            for method, k in methods:
                spec = dict(method=method, num_speculative_tokens=k, disable_by_batch_size=max(streams, 4))
                if method == "draft":
                    spec.update(draft_model=draft, disable_by_batch_size=streams)
                r = ours(model, chats, streams, a.max_new_tokens, spec)
                rows.append(_row(task, "candle-gate", streams, f"{method} k={k}", r, plain))
        if a.no_llama_cpp:
            continue
        plain = llama_cpp_run(model.path, chats, model, a.max_new_tokens, 0, a.threads)
        rows.append(_row(task, "llama.cpp", 1, "off", plain, plain))
        for k in ks if task == "edits" else []:
            rows.append(_row(task, "llama.cpp", 1, f"lookup k={k}",
                             llama_cpp_run(model.path, chats, model, a.max_new_tokens, k, a.threads), plain))
        if a.llama_server:
            plain = llama_server_run(a, chats, model, None, 0)
            rows.append(_row(task, "llama-server", 1, "off", plain, plain))
            for k in draft_ks:
                rows.append(_row(task, "llama-server", 1, f"draft k={k}",
                                 llama_server_run(a, chats, model, draft.path, k), plain))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "draft_model": a.draft_model,
                                            "max_new_tokens": a.max_new_tokens, "rows": rows}, indent=1))


def _row(task, who, streams, drafts, r, plain):
    acc = r.get("accepted", 0) / r["drafted"] if r.get("drafted") else None
    same = r["tokens"] == plain["tokens"]
    ratio = r["tok_per_s"] / plain["tok_per_s"] if plain["tok_per_s"] else float("nan")
    tpp = r.get("tokens_per_pass")
    print(f"{who:>11} {streams:>7} {drafts:>10} {r['tok_per_s']:7.1f} {ratio:7.2f}x "
          f"{'' if acc is None else f'{acc:.0%}':>7} {'' if tpp is None else f'{tpp:.2f}':>8} "
          f"{'yes' if same else 'NO':>7}", flush=True)
    return {"task": task, "who": who, "streams": streams, "drafts": drafts, "tok_per_s": r["tok_per_s"], "vs_plain": ratio,
            "acceptance": acc, "tokens_per_pass": tpp, "equal_to_plain": same}


if __name__ == "__main__":
    sys.exit(main())
