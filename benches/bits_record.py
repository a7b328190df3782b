"""Record what a refactor must not move, and compare two records.

For every kernel mode, one batch of eight requests (six greedy, two seeded and sampled with
logprobs, so the gate, the sampler and the logprob path all run) through the engine, with the
gate off and with it always on. Per request it keeps the tokens, every step's logit hash, the
margins, the logprobs and the fingerprint. A record made before a change and one made after it
must be equal, key for key.

    python benches/bits_record.py --out /tmp/before.json
    ... change the code, rebuild ...
    python benches/bits_record.py --out /tmp/after.json --compare /tmp/before.json

The record is this host's: the fast lanes other than `invariant` depend on the host, so compare
records made on one machine.
"""
import argparse
import hashlib
import json
import sys
from typing import Any, Dict, List

import numpy as np

import candle_gate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "Explain why the sky is blue."}],
    "List three prime numbers:",
    "Once upon a time",
    "import numpy as np\n\n# a 3x3 identity matrix\n",
]
SAMPLED = [("Write a haiku about rust.", 7), ("The best way to learn a language is", 11)]
MAX_NEW_TOKENS = 24


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _one(r: candle_gate.Result) -> Dict[str, Any]:
    return {
        "tokens": r.token_ids.tolist(),
        "logit_hashes": [f"{int(h):016x}" for h in r.logit_hashes],
        "margins": _sha(r.margins),
        "logprobs": _sha(r.logprobs),
        "fingerprint": r.fingerprint,
        "rechecked": int(r.rechecked.sum()),
    }


def record_mode(model_name: str, mode: str) -> Dict[str, Any]:
    model = candle_gate.Model.load(model_name, layout=candle_gate.layout_for(mode), quiet=True)
    out: Dict[str, Any] = {}
    for gate in ("off", "always"):
        eng = candle_gate.Engine(model, mode=mode, gate=gate, max_num_seqs=8, record_logit_hashes=True)
        ids = [eng.submit(p, max_new_tokens=MAX_NEW_TOKENS) for p in PROMPTS]
        ids += [eng.submit(p, max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=s, logprobs=True)
                for p, s in SAMPLED]
        out[gate] = [_one(r) for r in eng.run(ids)]
        eng.shutdown()
    return out


def compare(now: Dict[str, Any], before: Dict[str, Any]) -> List[str]:
    diffs = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and a and isinstance(a[0], dict):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            diffs.append(path)

    walk(now["runs"], before["runs"], "")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--modes", default=",".join(candle_gate.MODES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a record to compare with; exit 1 on any difference")
    a = ap.parse_args()
    runs: Dict[str, Any] = {}
    for name in a.models.split(","):
        for mode in a.modes.split(","):
            print(f"{name} {mode}", file=sys.stderr, flush=True)
            runs[f"{name}/{mode}"] = record_mode(name, mode)
    rec = {"host": candle_gate._native.host_signature("split_k_f16"), "runs": runs}
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    if a.compare:
        with open(a.compare) as f:
            before = json.load(f)
        diffs = compare(rec, before)
        for d in diffs[:40]:
            print("differs:", d)
        print(f"{len(diffs)} differences over {len(runs)} model/mode runs")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
