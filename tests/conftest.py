import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model():
    import candle_gate
    # Downloads the default model on first use (cached), never skips.
    return candle_gate.Model.load()
