"""Where the tests' files are."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: what tests read: golden tokens, the held-out chats (which benches read too)
DATA = ROOT / "tests" / "data"
#: the benchmarks' prompt sets, which some tests borrow
BENCH_PROMPTS = ROOT / "benches" / "prompts"
