"""Ctrl-C during a generation (issue 53): ``Model.generate``, ``Engine.generate`` and ``Engine.run``
raise ``KeyboardInterrupt`` within a step, cancel their requests and leave the engine usable, and
a process's first generation never ends in a Rust panic (rust-numpy's "Failed to access NumPy
array API capsule: PyErr KeyboardInterrupt"). A real SIGINT, sent to a child process on the
default model."""
import signal
import subprocess
import sys
import time

import pytest

from ..live_server import HANG_S

pytestmark = pytest.mark.model  # loads a model, or serves one

CHILD = r'''
import signal
import sys
# Python's own Ctrl-C handler, whatever the parent left: a process started in the background of a
# non-interactive shell (`cmd &`, as CI runners may start the suite) inherits SIGINT ignored, and
# Python then never installs its handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
import candle_gate
model = candle_gate.Model.load()
eng = candle_gate.Engine(model)
# A long prompt and a long generation (4000 tokens without an end of text, over a minute here):
# still running when the signal comes.
prompt = "Once upon a time, in a land far away, " * 150
call = sys.argv[1]
print("ready", flush=True)
try:
    if call == "Model.generate":
        model.generate([prompt], max_new_tokens=4000)
    elif call == "Engine.generate":
        eng.generate([prompt], max_new_tokens=4000)
    else:
        eng.run([eng.submit(prompt, max_new_tokens=4000)])
    print("completed", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
kv = eng.kv_stats()
print("left", eng.num_running, eng.num_waiting, kv["used"], flush=True)
# The blocks computed before the interrupt stay as cached prefixes: far fewer than the whole run's.
print("computed", kv["cached"] * eng.kv_block_size, len(model.tokenize(prompt)) + 4000, flush=True)
[r] = eng.generate(["The capital of France is"], max_new_tokens=4)
print("reused", len(r.token_ids), r.finish_reason, flush=True)
'''


@pytest.mark.parametrize("call", ["Model.generate", "Engine.generate", "Engine.run"])
def test_ctrl_c_interrupts_a_generation_and_the_engine_goes_on(call):
    p = subprocess.Popen([sys.executable, "-c", CHILD, call], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline() == "ready\n", p.stderr.read()
        time.sleep(2)  # into the generation (the prompt alone takes longer to prefill)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=HANG_S)
    finally:
        if p.poll() is None:
            p.kill()
    assert "PanicException" not in err and "panicked" not in err, err
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "interrupted", (out, err)  # not "completed": the 4000 tokens did not run
    assert lines[1] == "left 0 0 0"  # cancelled: nothing running or waiting, no KV block held
    if call != "Model.generate":  # (its engine is its own)
        computed, whole = map(int, lines[2].split()[1:])
        assert computed < whole - 1000, "the generation ran on after the interrupt"
    assert lines[3].startswith("reused 4 ")
