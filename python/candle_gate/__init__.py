"""candle-gate: greedy and seeded decoding that give the same tokens whatever shares the batch.

    import candle_gate
    model = candle_gate.Model.load()                 # SmolLM2-135M-Instruct Q4_1, downloaded once
    [r] = model.generate(["The capital of France is"], max_new_tokens=8)
    r.text, r.token_ids, r.margins, r.fingerprint
    params = candle_gate.SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    [r] = model.generate(["Once upon a time"], params=params)   # the same text in any batch

    report = candle_gate.run_probe(model, mode="split_k_f16", compositions="batch2,batch8")

``candle_gate.probe`` is the probe's package (``runner``: the compositions; ``report``: the table,
the JSON and the PNG); ``candle_gate.run_probe`` is ``candle_gate.probe.run_probe``.
"""
from ._native import (CandleGateError, EngineShutDown, InvalidParameter, CUDA_AVAILABLE, METAL_AVAILABLE, __version__,
                      layout_for)
from .models import DEFAULT_MODEL, cache_dir, fetch, resolve
from .engine import Engine, Model, Result, SamplingParams, MODES, GATES, LAYOUTS, PACKAGED_PROFILE, user_profile_path
from .probe import run_probe
from .audit import Verification, verify

__all__ = [
    "CandleGateError", "EngineShutDown", "InvalidParameter", "CUDA_AVAILABLE", "METAL_AVAILABLE", "__version__",
    "DEFAULT_MODEL", "cache_dir", "fetch", "resolve",
    "Engine", "Model", "Result", "SamplingParams", "MODES", "GATES", "LAYOUTS", "layout_for", "PACKAGED_PROFILE",
    "user_profile_path", "run_probe", "verify", "Verification",
]
