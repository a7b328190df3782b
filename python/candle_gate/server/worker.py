"""The engine thread: the one place that steps the :class:`~candle_gate.Engine`.

One dedicated thread runs ``step()`` while there is work and otherwise sleeps on a
``threading.Event`` that a submit or a cancel sets. After each step it drains the engine's events
and hands them, grouped per request, to the asyncio loop with ``loop.call_soon_threadsafe`` into
each request's ``asyncio.Queue``; the HTTP side only awaits its queue (``serving.py``).

What a queue receives, per step: a list of that request's events (the engine's dicts, ``{"type":
"token", "index", "token", "text", ...}`` and ``{"type": "finished", ...}``), the last list
ending with ``("done", Result)`` once every choice has finished, or a list ``[("error", msg)]``
when the engine failed.
"""
from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _native
from ..engine import Engine, SamplingParams
from .metrics import EngineCounts


class QueueFull(Exception):
    """``--max-queue`` requests are waiting already (the server answers 429)."""


class Track:
    """A request the engine thread delivers to: its queue, its choices, how many have finished."""
    __slots__ = ("queue", "n", "finished")

    def __init__(self, queue: asyncio.Queue, n: int):
        self.queue, self.n, self.finished = queue, n, 0


Batch = List[Tuple[asyncio.Queue, List[Any]]]


class EngineWorker:
    """Owns the stepping of ``eng``; requests register an asyncio.Queue (module docstring)."""

    def __init__(self, eng: Engine, loop: asyncio.AbstractEventLoop,
                 on_done: Optional[Callable[[Any], None]] = None):
        self.eng = eng
        self.loop = loop
        self.on_done = on_done  # called on the loop with each finished Result (metrics)
        self.wake = threading.Event()
        self.lock = threading.Lock()  # guards `tracks`; never held across a step
        self.tracks: Dict[int, Track] = {}
        self.stopping = False
        # The native getters take the engine's mutex while holding the GIL, so only this thread
        # (which never steps concurrently with itself) reads them; others read these copies.
        self.num_running = 0
        self.num_waiting = 0
        self.submitted_since_refresh = 0
        #: the KV pool and the prefix cache's counters (``Engine.kv_stats``, as of the last step)
        self.kv_stats: Dict[str, int] = eng.kv_stats()
        self.gate_stats: Dict[str, int] = dict.fromkeys(_native.GATE_COUNTERS, 0)
        #: drafts proposed and kept (``Engine.spec_stats``, as of the last step)
        self.spec_stats: Dict[str, int] = eng.spec_stats()
        self.thread = threading.Thread(target=self._run, name="candle-gate-engine", daemon=True)

    # -- the HTTP side's calls ------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, ids: List[int], params: SamplingParams, queue: asyncio.Queue, max_queue: int) -> int:
        """Queues a request whose events go to ``queue``; raises :class:`QueueFull`, or what the
        engine raises. Blocking (waits for the engine's mutex while a step runs): call it in an
        executor."""
        with self.lock:
            if self.num_waiting + self.submitted_since_refresh >= max_queue:
                raise QueueFull()
            rid = self.eng.submit(ids, params=params)
            self.tracks[rid] = Track(queue, params.n)
            self.submitted_since_refresh += 1
        self.wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        with self.lock:
            live = rid in self.tracks
        if live:
            self.eng.cancel(rid)
            self.wake.set()  # its finished events are drained by the engine thread

    def counts(self) -> EngineCounts:
        """The engine's counts as of the last step (what /metrics serves)."""
        return EngineCounts(running=self.num_running, waiting=self.num_waiting + self.submitted_since_refresh,
                            kv=dict(self.kv_stats), gate=dict(self.gate_stats), spec=dict(self.spec_stats))

    def reset_prefix_cache(self) -> None:
        """Blocking (the engine's mutex): call it in an executor."""
        self.eng.reset_prefix_cache()
        self.kv_stats = self.eng.kv_stats()

    def shutdown(self) -> None:
        """Shuts the engine down, cancels whatever is still running, stops the thread."""
        try:
            self.eng.shutdown()
        except Exception:
            pass
        with self.lock:
            rids = list(self.tracks)
        for rid in rids:
            self.cancel(rid)
        self.stop()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping:
            self.wake.clear()
            try:
                self._drain()
                if self.eng.has_work:
                    self.eng.step()
                    # the counts first: a client that got its answer and reads /metrics at once
                    # sees the state after the step that finished it
                    self._refresh()
                    self._drain()
                    continue
                self._refresh()
            except Exception as e:  # an engine failure fails the requests in flight, not the server
                print(f"candle-gate serve: engine error: {e}", file=sys.stderr, flush=True)
                self._fail_all(f"engine error: {e}")
                continue
            self.wake.wait()
        try:
            self._drain()
        except Exception:
            pass

    def _drain(self) -> None:
        events = self.eng.events()
        if not events:
            return
        per: Dict[int, List[Any]] = {}
        with self.lock:
            for ev in events:
                tr = self.tracks.get(ev["id"])
                if tr is None:
                    continue
                items = per.setdefault(ev["id"], [])
                items.append(ev)
                if ev["type"] == "finished":
                    tr.finished += 1
                    if tr.finished >= tr.n:
                        items.append(("done", self.eng.result(ev["id"])))
            batch = [(self.tracks[rid].queue, items) for rid, items in per.items()]
            for rid, items in per.items():
                if isinstance(items[-1], tuple):
                    del self.tracks[rid]
        self._post(batch)

    def _refresh(self) -> None:
        with self.lock:
            self.num_running, self.num_waiting = self.eng.num_running, self.eng.num_waiting
            self.submitted_since_refresh = 0
        self.kv_stats = self.eng.kv_stats()
        self.gate_stats = self.eng.gate_stats()
        self.spec_stats = self.eng.spec_stats()

    def _fail_all(self, msg: str) -> None:
        with self.lock:
            batch = [(tr.queue, [("error", msg)]) for tr in self.tracks.values()]
            rids = list(self.tracks)
            self.tracks.clear()
        for rid in rids:
            try:
                self.eng.cancel(rid)
            except Exception:
                pass
        self._post(batch)

    def _post(self, batch: Batch) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _deliver(self, batch: Batch) -> None:
        """On the loop: each request's items into its queue."""
        for q, items in batch:
            q.put_nowait(items)
            last = items[-1]
            if self.on_done is not None and isinstance(last, tuple) and last[0] == "done":
                self.on_done(last[1])
