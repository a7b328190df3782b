"""The prefix cache never changes a bit: held-out chats continued over several turns give the
same tokens, logits hashes and logprobs when each turn's history came from the cache as when it
was prefilled cold, in process and through the server with the official ``openai`` client."""
import json

import numpy as np
import pytest

import candle_gate
from candle_gate import Engine

from ..paths import DATA

pytestmark = pytest.mark.model  # loads a model, or serves one


def _chats(k):
    with open(DATA / "heldout_chats.json") as f:
        return json.load(f)[:k]


def _bits(r):
    return (r.token_ids.tolist(), r.logit_hashes.tolist(), np.asarray(r.logprobs, np.float32).view(np.uint32).tolist())


def _turns(model, eng, chats, turns, max_new):
    """Each chat continued for `turns` turns (all chats in one batch per turn); per turn, the
    results in chat order."""
    history = [list(c) for c in chats]
    out = []
    for t in range(turns):
        ids = [eng.submit(h, chat=True, max_new_tokens=max_new, logprobs=True) for h in history]
        res = eng.run(ids)
        out.append(res)
        for h, r in zip(history, res):
            h.append({"role": "assistant", "content": r.text})
            h.append({"role": "user", "content": f"Thanks. Now say it again in other words ({t})."})
    return out


def test_multi_turn_held_out_chats_warm_equal_cold(model):
    chats = _chats(4)
    warm = Engine(model, record_logit_hashes=True)
    cold = Engine(model, record_logit_hashes=True, enable_prefix_caching=False)
    assert warm.prefix_caching and not cold.prefix_caching
    w = _turns(model, warm, chats, 3, 24)
    c = _turns(model, cold, chats, 3, 24)
    for t, (wt, ct) in enumerate(zip(w, c)):
        for i, (a, b) in enumerate(zip(wt, ct)):
            assert _bits(a) == _bits(b), f"turn {t}, chat {i}"
            assert b.cached_tokens == 0
            if t > 0:
                assert a.cached_tokens >= warm.kv_block_size, f"turn {t}, chat {i}: the history is a hit"
    st = warm.kv_stats()
    assert 0 < st["prefix_hits"] < st["prefix_queries"] and st["used"] == 0 and st["cached"] > 0
    assert cold.kv_stats()["prefix_hits"] == 0
    warm.reset_prefix_cache()
    assert warm.kv_stats()["cached"] == 0


openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _replay(server, chat, turns=3):
    """A chat continued for `turns` turns through the server: each turn's text, token logprobs
    and usage."""
    client = server.client()
    history = list(chat)
    out = []
    for t in range(turns):
        r = client.chat.completions.create(model=candle_gate.DEFAULT_MODEL, messages=history, max_tokens=20,
                                           temperature=0, logprobs=True, top_logprobs=2)
        c = r.choices[0]
        lps = [(x.token, x.logprob, [(y.token, y.logprob) for y in x.top_logprobs]) for x in c.logprobs.content]
        out.append((c.message.content, lps, r.usage.prompt_tokens_details.cached_tokens))
        history += [{"role": "assistant", "content": c.message.content},
                    {"role": "user", "content": f"And one more detail, please ({t})."}]
    return out


def test_the_server_replays_a_chat_warm_and_cold_identically_and_reports_cached_tokens():
    from ..live_server import Server
    chat = _chats(1)[0]
    warm, cold = Server(), Server("--no-prefix-cache")
    try:
        w, c = _replay(warm, chat), _replay(cold, chat)
        assert [x[:2] for x in w] == [x[:2] for x in c]
        assert [x[2] for x in c] == [0, 0, 0]
        assert w[0][2] == 0 and w[1][2] > 0 and w[2][2] > w[1][2], [x[2] for x in w]
        # Replayed again on the warm server: every turn's history is now cached, same answers.
        again = _replay(warm, chat)
        assert [x[:2] for x in again] == [x[:2] for x in w]
        assert again[0][2] > 0
        assert warm.metric("candle_gate:prefix_cache_hits_total") > 0
        assert warm.metric("candle_gate:prefix_cache_queries_total") > warm.metric("candle_gate:prefix_cache_hits_total")
        assert cold.metric("candle_gate:prefix_cache_hits_total") == 0
        assert warm.metric("candle_gate:kv_cache_cached_blocks") > 0
        # Streamed usage carries the same count; after a reset nothing is cached.
        stream = warm.client().chat.completions.create(
            model=candle_gate.DEFAULT_MODEL, messages=chat, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})
        usage = [ch.usage for ch in stream if ch.usage is not None]
        assert usage[-1].prompt_tokens_details.cached_tokens > 0
        assert httpx.post(warm.url + "/reset_prefix_cache", timeout=30).status_code == 200
        assert warm.metric("candle_gate:kv_cache_cached_blocks") == 0
        r = warm.client().chat.completions.create(model=candle_gate.DEFAULT_MODEL, messages=chat, max_tokens=4,
                                                  temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        warm.stop()
        cold.stop()
