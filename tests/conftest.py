"""Fixtures every test package shares. Helpers are modules of the ``tests`` package
(``tests/live_server.py``, ``tests/paths.py``), imported relatively."""
import pytest


@pytest.fixture(scope="session")
def model():
    import candle_gate
    # Downloads the default model on first use (cached), never skips.
    return candle_gate.Model.load()
