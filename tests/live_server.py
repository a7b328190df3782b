"""``candle-gate serve`` as a subprocess on loopback (tests/server, tests/probe, tests/ray, ...), and
waiting for a state without calling a slow machine hung."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional

#: How long a wait for a server's state may last before the test calls the server hung. A guard
#: against hanging, never a claim about speed: the tests wait for states and events (a count in
#: /metrics, a streamed chunk), which on a loaded 2-core machine can take seconds.
HANG_S = 300


def wait_until(cond, what: str, timeout: float = HANG_S) -> None:
    """Polls ``cond()`` until it holds; fails (``what``) only if it never does within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"hung after {timeout} s: {what}")
        time.sleep(0.05)


def _series(s: str):
    """``name{a="x",b="y"}`` as ``("name", {"a": "x", "b": "y"})``."""
    name, _, labels = s.partition("{")
    return name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`candle-gate serve --port P *extra` on loopback, ready when /health says 200; ``env``: set
    in the server's environment, over this process's."""

    def __init__(self, *extra: str, env: Optional[Dict[str, str]] = None):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "--port", str(self.port), *extra]
        cmd = [sys.executable, "-m", "candle_gate", *argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.log = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader thread takes the last lines
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n" + "".join(self.log))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("the server did not become healthy:\n" + "".join(self.log))
            time.sleep(0.2)

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def client(self, key: str = "unused"):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        """The value of the first series of ``name`` (``name{label="v",...}``: of the first series
        with those labels, in any order, among others) in /metrics."""
        import httpx
        from candle_gate.server.metrics import samples
        want, labels = _series(name)
        for got, got_labels, value in samples(httpx.get(self.url + "/metrics", timeout=30).text):
            if got == want and labels.items() <= got_labels.items():
                return value
        raise KeyError(name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 120):
        """SIGTERM, as a supervisor stops the server (it drains first), then SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
