"""Moved: the endpoint probe is :mod:`candle_gate.probe.endpoint` (with
:mod:`~candle_gate.probe.endpoint_client`, :mod:`~candle_gate.probe.endpoint_report` and
:mod:`~candle_gate.probe.common`). This name stays only for ``cli.cmd_probe``'s import."""
from .probe.endpoint import *  # noqa: F401,F403
from .probe.endpoint import main  # noqa: F401
