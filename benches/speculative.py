"""Speculative decoding side by side: plain decode against n-gram (prompt lookup) speculation on
code-edit prompts (the prompt holds a 45–60-line function and asks for it back with a small
change: benches/prompts/code_edits.json), one stream and several, greedy; and llama.cpp on the
same GGUF, plain and with llama-cpp-python's `LlamaPromptLookupDecoding`, one stream.

    python benches/speculative.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m] [--k 5,8]
        [--max-new-tokens 96] [--streams 1,8] [--no-llama-cpp] [--json OUT]

Decode tok/s is timed from each request's first token to its last (the prompt's prefill is not
in it). Per row: tok/s, the ratio to plain, the acceptance rate (drafts kept / drafts proposed),
tokens per target pass (a single stream's tokens per step), and whether every request's tokens
equal plain decoding's (ours must: speculation changes no bit; llama.cpp's is shown as it is).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import candle_gate
from candle_gate import Engine, Model

PROMPTS = Path(__file__).parent / "prompts" / "code_edits.json"


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
        ids = model.encode_chat(c)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("--k", default="5,8", help="drafts per step to try")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    chats = json.loads(PROMPTS.read_text())[: a.prompts]
    model = Model.load(a.model, quiet=True)
    ks = [int(x) for x in a.k.split(",")]
    rows = []
    print(f"{a.model}, {len(chats)} code-edit prompts, greedy, {a.max_new_tokens} new tokens; "
          f"candle-gate {candle_gate.__version__}", flush=True)
    print(f"{'who':>10} {'streams':>7} {'drafts':>9} {'tok/s':>7} {'vs plain':>8} {'accept':>7} "
          f"{'tok/pass':>8} {'= plain':>7}", flush=True)
    for streams in [int(x) for x in a.streams.split(",")]:
        for c in chats:  # the prompts' K/V warm nothing across engines; this warms the code paths
            Engine(model).generate([c], max_new_tokens=2)
            break
        plain = ours(model, chats, streams, a.max_new_tokens, None)
        rows.append(_row("candle-gate", streams, "off", plain, plain))
        for k in ks:
            spec = dict(method="ngram", num_speculative_tokens=k, disable_by_batch_size=max(streams, 4))
            rows.append(_row("candle-gate", streams, f"ngram k={k}", ours(model, chats, streams, a.max_new_tokens, spec),
                             plain))
    if not a.no_llama_cpp:
        plain = llama_cpp_run(model.path, chats, model, a.max_new_tokens, 0, a.threads)
        rows.append(_row("llama.cpp", 1, "off", plain, plain))
        for k in ks:
            rows.append(_row("llama.cpp", 1, f"lookup k={k}",
                             llama_cpp_run(model.path, chats, model, a.max_new_tokens, k, a.threads), plain))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "max_new_tokens": a.max_new_tokens, "rows": rows},
                                           indent=1))


def _row(who, streams, drafts, r, plain):
    acc = r.get("accepted", 0) / r["drafted"] if r.get("drafted") else None
    same = r["tokens"] == plain["tokens"]
    ratio = r["tok_per_s"] / plain["tok_per_s"] if plain["tok_per_s"] else float("nan")
    tpp = r.get("tokens_per_pass")
    print(f"{who:>10} {streams:>7} {drafts:>9} {r['tok_per_s']:7.1f} {ratio:7.2f}x "
          f"{'' if acc is None else f'{acc:.0%}':>7} {'' if tpp is None else f'{tpp:.2f}':>8} "
          f"{'yes' if same else 'NO':>7}", flush=True)
    return {"who": who, "streams": streams, "drafts": drafts, "tok_per_s": r["tok_per_s"], "vs_plain": ratio,
            "acceptance": acc, "tokens_per_pass": tpp, "equal_to_plain": same}


if __name__ == "__main__":
    sys.exit(main())
