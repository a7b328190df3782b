"""Writes tests/data/gemma3_llama_cpp_tokens.json: llama.cpp's token ids (through
llama-cpp-python, `pip install ".[peer]"`) for tests/models/test_gemma.py's texts on Gemma 3's GGUF,
the ids the tokenizer test holds candle-gate to. Rerun after changing the texts:

    python scripts/gemma_golden_tokens.py
"""
import json
import sys
from pathlib import Path

import llama_cpp

import candle_gate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.models.test_gemma import GEMMA, TEXTS  # noqa: E402

llm = llama_cpp.Llama(str(candle_gate.resolve(GEMMA)), vocab_only=True, verbose=False)
golden = {
    "llama_cpp_python": llama_cpp.__version__,
    "model": GEMMA,
    "ids": {t: llm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS},
}
out = ROOT / "tests" / "data" / "gemma3_llama_cpp_tokens.json"
out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
print(f"{out}: {len(TEXTS)} texts (llama-cpp-python {llama_cpp.__version__})")
