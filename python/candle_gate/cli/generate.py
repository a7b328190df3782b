"""``candle-gate generate``: one prompt through the engine; ``candle-gate fetch``: known models into
the cache."""
from __future__ import annotations

import argparse
import json
import sys

from ..engine import DEFAULT_MAX_NEW_TOKENS
from ..models import DEFAULT_MODEL
from .common import gate_args, kv_args, model_args, sampling_args, sampling_flags, speculative_args, \
    speculative_from_args


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generation for one prompt (greedy unless --temperature)")
    g.add_argument("prompt", help="the prompt (with --chat, the user's message)")
    model_args(g)
    gate_args(g)
    kv_args(g)
    sampling_flags(g)
    speculative_args(g)
    g.add_argument("--n", type=int, default=1, help="choices from the one prompt")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens to generate at most")
    g.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=generate)


def generate(a: argparse.Namespace) -> int:
    from ..engine import Engine, Model, SamplingParams, layout_for
    # Checked before the model loads: a bad parameter should not wait for a download.
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop=a.stop, n=a.n, **sampling_args(a))
    model = Model.load(a.model, layout=layout_for(a.mode))
    eng = Engine(model, mode=a.mode, gate=a.gate, tau=a.tau, deep_tau=a.deep_tau, profile=a.profile, kv_dtype=a.kv_dtype,
                 speculative=speculative_from_args(a))
    if eng.gate_source:
        print(f"gate: tau {eng.tau:.4g}, deep_tau {eng.deep_tau:.4g} from {eng.gate_source}", file=sys.stderr)
    rid = eng.submit(a.prompt, chat=a.chat, params=params)
    if a.json:
        [r] = eng.run([rid])
        choices = []
        drew = params.temperature > 0 or params.seed is not None
        for c in r.choices:
            out = c.to_json()
            if not drew:  # greedy: nothing was drawn, and a fresh seed would make equal runs differ
                del out["seed"]
            out.update({"model": model.path, "mode": a.mode, "gate": a.gate, "index": c.index})
            choices.append(out)
        print(json.dumps(choices[0] if params.n == 1 else choices))
        return 0
    for ev in eng.stream():
        if ev["type"] == "token" and ev["index"] == 0:
            sys.stdout.write(ev["text"])
            sys.stdout.flush()
    r = eng.result(rid)
    sys.stdout.write("\n")
    for c in r.choices[1:]:
        sys.stdout.write(f"--- choice {c.index}\n{c.text}\n")
    spec = f", drafts {r.accepted_tokens}/{r.draft_tokens} kept" if r.draft_tokens else ""
    seed = f", seed={r.seed}" if params.temperature > 0 or params.seed is not None else ""
    print(f"[{len(r.token_ids)} tokens, finish={r.finish_reason}{seed}, fingerprint={r.fingerprint}{spec}]",
          file=sys.stderr)
    return 0


def add_fetch_parser(sub) -> None:
    f = sub.add_parser("fetch", help="download known models into the cache")
    f.add_argument("--model", action="append", default=None,
                   help=f"a known model name, or `all` (repeatable; default {DEFAULT_MODEL})")
    f.set_defaults(func=fetch_models)


def fetch_models(a: argparse.Namespace) -> int:
    from ..models import KNOWN_MODELS, fetch
    names = a.model or [DEFAULT_MODEL]
    for name in (list(KNOWN_MODELS) if "all" in names else names):
        print(fetch(name))
    return 0
