"""Probe, bench and calibrate on the default model (small sizes: the file runs in about a minute
on 2 cores)."""
import io
import json
import os
import subprocess
import sys

import pytest

import candle_gate
import candle_gate.calibrate as calibrate
import candle_gate.probe as probe

from ..paths import DATA

PROMPTS = [
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "List of prime numbers: 2, 3, 5, 7,",
    [{"role": "user", "content": "Write a short poem about a cat."}],
]


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "candle_gate", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def invariant_report(model):
    # One filler prefill per request in mixed_prefill keeps the file fast.
    return probe.run_probe(model, prompts=PROMPTS, max_new_tokens=12, mode="invariant",
                           progress=False, mixed_prefill_every=1000)


@pytest.mark.model
def test_invariant_mode_is_bitwise_invariant_under_every_composition(invariant_report):
    r = invariant_report
    assert [c["name"] for c in r["compositions"]] == list(probe.COMPOSITIONS)
    assert r["scored_steps"] > 0
    for c in r["compositions"]:
        assert c["logit_bit_mismatches"] == 0, c
        assert c["diverging_sequences"] == 0, c
        assert c["step_flip_rate"] == 0.0, c
        assert c["first_divergence"] == [] and c["margins_at_divergence"] == [], c
    assert r["distinct_outputs"] == [1] * len(PROMPTS)
    assert r["identical_sequences_share"] == 1.0
    m = r["pairwise_diverging"]["matrix"]
    assert len(m) == 1 + len(probe.COMPOSITIONS) and all(x == 0 for row in m for x in row)
    assert r["gate"] is None


@pytest.mark.model
def test_non_invariant_lane_logits_depend_on_the_batch(model):
    # split_k_f16 splits k by the row count, so a request's logits change bits with what shares
    # its steps (on every host: a property of the lane, not of the CPU); the tokens usually stay.
    r = probe.run_probe(model, prompts=PROMPTS[:3], max_new_tokens=8, mode="split_k_f16",
                        compositions="batch2,mixed_prefill", progress=False)
    by_name = {c["name"]: c for c in r["compositions"]}
    assert set(by_name) == {"batch2", "mixed_prefill"}
    assert any(c["logit_bit_mismatches"] > 0 for c in r["compositions"]), r["compositions"]
    for c in r["compositions"]:
        assert c["logit_bit_mismatches"] <= r["scored_steps"]
        assert len(c["first_divergence"]) == c["diverging_sequences"] == len(c["margins_at_divergence"])


@pytest.mark.model
def test_gate_numbers_are_summed_over_engines(model):
    r = probe.run_probe(model, prompts=PROMPTS[:2], max_new_tokens=4, mode="gemm", gate="always",
                        compositions=["batch2"], progress=False)
    g = r["gate"]
    assert list(g)[:len(probe.GATE_KEYS)] == list(probe.GATE_KEYS)  # then extra counters, if any
    assert all(isinstance(g[k], int) for k in g if k not in ("mode", "tau", "deep_tau", "calibration"))
    assert g["calibration"] is None  # tau was not looked up: "always" needs none
    assert isinstance(g["deep_tau"], float)
    assert g["mode"] == "always"
    # baseline (2 engines) + batch2 (1 engine), each request's steps all rechecked
    assert g["steps"] == g["rechecks"] == 2 * r["scored_steps"]
    assert 0 <= g["corrections"] <= g["rechecks"]


@pytest.mark.model
def test_cli_json_has_exactly_the_documented_keys(tmp_path):
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(["The quick brown fox", [{"role": "user", "content": "Name a colour."}]]))
    out, png = tmp_path / "report.json", tmp_path / "plot.png"
    r = run_cli("probe", "--prompts", str(pf), "--max-new-tokens", "4", "--mode", "invariant",
                "--compositions", "batch2,staggered", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "batch2" in r.stdout and "staggered" in r.stdout  # the table
    assert "|" not in r.stderr  # no progress bar on a pipe
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 0 and png_size(png) == probe.PLOT_SIZE
    except ImportError:
        assert "needs matplotlib" in r.stderr and not png.exists(), r.stderr
    rep = json.loads(out.read_text())
    assert set(rep) == set(probe.REPORT_KEYS) | set(probe.EXTRA_KEYS)
    assert rep["mode"] == "invariant" and rep["prompts"] == 2 and rep["max_new_tokens"] == 4
    assert rep["gate"] is None
    assert [c["name"] for c in rep["compositions"]] == ["batch2", "staggered"]
    for c in rep["compositions"]:
        assert list(c) == list(probe.COMPOSITION_KEYS)
        assert isinstance(c["step_flip_rate"], float)
        assert isinstance(c["diverging_sequences"], int) and isinstance(c["logit_bit_mismatches"], int)
        assert isinstance(c["first_divergence"], list) and isinstance(c["margins_at_divergence"], list)


@pytest.mark.parametrize("content,needle", [
    ("[\"unterminated", "not valid JSON"),
    ("{\"prompts\": [\"a\"]}", "JSON list"),
    ("", "no prompts"),
    ("[\"ok\", 3.5]", "prompt 1"),
    ("[[{\"role\": \"user\"}]]", "prompt 0"),
])
def test_bad_prompts_file_exits_2_with_a_clear_message(tmp_path, content, needle):
    pf = tmp_path / "bad.json"
    pf.write_text(content)
    r = run_cli("probe", "--prompts", str(pf), "--max-new-tokens", "4", "--compositions", "batch2")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "candle-gate: error: prompts file" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_missing_prompts_file_and_unknown_composition_exit_2(tmp_path):
    r = run_cli("probe", "--prompts", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    r = run_cli("probe", "--compositions", "batch2,batch7")
    assert r.returncode == 2 and "batch7" in r.stderr, r.stderr


def test_load_prompts_text_and_json(tmp_path):
    t = tmp_path / "p.txt"
    t.write_text("first prompt\n\n  second prompt\n")
    assert probe.load_prompts(str(t)) == ["first prompt", "  second prompt"]
    j = tmp_path / "p.json"
    chat = [{"role": "user", "content": "hi"}]
    j.write_text(json.dumps(["a", chat]))
    assert probe.load_prompts(str(j)) == ["a", chat]
    with pytest.raises(ValueError, match="unknown composition"):
        probe.parse_compositions("batch2,nope")
    with pytest.raises(ValueError, match="unknown gate"):
        probe.resolve_gate("maybe", None, None, None)
    with pytest.raises(ValueError, match="deep_tau"):
        probe.resolve_gate("gated", 0.1, float("nan"), None)
    assert probe.resolve_gate("gated", 0.1, None, None) == (0.1, None, None)


def test_default_prompt_sets_are_disjoint_and_run_probe_is_exported():
    key = lambda p: json.dumps(p, sort_keys=True)
    assert len(probe.DEFAULT_PROMPTS) >= 20 and len(calibrate.CALIBRATION_PROMPTS) >= 12
    assert not {key(p) for p in probe.DEFAULT_PROMPTS} & {key(p) for p in calibrate.CALIBRATION_PROMPTS}
    # the held-out chats the gate is judged on were not used for calibration either
    with open(DATA / "heldout_chats.json") as f:
        heldout = json.load(f)
    assert len(heldout) >= 24
    assert not {key(p) for p in heldout} & {key(p) for p in calibrate.CALIBRATION_PROMPTS}
    assert sum(isinstance(p, list) for p in probe.DEFAULT_PROMPTS) >= 3
    # candle_gate.probe is the package (runner, report); its entry point is exported
    assert callable(candle_gate.run_probe) and candle_gate.run_probe is probe.run_probe
    assert probe.Runner is probe.runner.Runner and probe.plot_report is probe.report.plot_report


def test_progress_bar_only_on_a_terminal_and_never_when_quiet(monkeypatch):
    """The probes' and calibrate's progress (tqdm, on stderr): drawn on a terminal, nothing on a
    pipe or when the caller asks for quiet."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    for stream, enabled, shown in ((Tty(), True, True), (Tty(), False, False), (io.StringIO(), True, False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with probe.progress_bar(3, label="probe", enabled=enabled) as bar:
            bar.set_postfix_str("baseline (batch 1)")
            bar.update(3)
        out = stream.getvalue()
        assert ("3/3" in out and "probe" in out and "baseline (batch 1)" in out) is shown, (enabled, out)
        assert bool(out) is shown


def png_size(path):
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.model
def test_plot_without_flips_shows_the_margins_and_the_counts(model, tmp_path):
    pytest.importorskip("matplotlib")
    r, runs = probe.measure(model, prompts=PROMPTS[:2], max_new_tokens=4, mode="invariant",
                            compositions="batch2", progress=False)
    assert len(runs.baseline_margins) == r["scored_steps"] > 0
    assert probe.counts(r) == [{"name": "batch2", "steps": r["scored_steps"], "flips": 0,
                                "bit_mismatches": 0, "diverged": 0}]
    assert probe.summary_line(r).startswith(f"0 flips in {r['scored_steps']} steps")
    png = tmp_path / "probe.png"
    probe.plot_report(r, str(png), margins=runs.baseline_margins)
    assert png.stat().st_size > 10_000 and png_size(png) == probe.PLOT_SIZE


def test_plot_marks_flips_divergences_and_the_gate(tmp_path):
    pytest.importorskip("matplotlib")
    comps = [{"name": "batch2", "step_flip_rate": 2 / 40, "diverging_sequences": 1,
              "logit_bit_mismatches": 9, "first_divergence": [3], "margins_at_divergence": [0.02]},
             {"name": "staggered", "step_flip_rate": 0.0, "diverging_sequences": 1,
              "logit_bit_mismatches": 0, "first_divergence": [7], "margins_at_divergence": [None]}]
    r = {"model": "/m/x.gguf", "mode": "split_k_f16", "prompts": 4, "max_new_tokens": 10,
         "compositions": comps, "scored_steps": 40, "flip_margins": {"batch2": [0.0, 0.01], "staggered": []},
         "gate": {"mode": "gated", "tau": 0.3, "steps": 40, "rechecks": 5, "corrections": 1, "deep_tau": 0.15}}
    assert [c["flips"] for c in probe.counts(r)] == [2, 0]
    assert probe.summary_line(r).startswith("2 flips in 80 steps, 2 of 8 sequences diverged")
    margins = [0.0] + [0.005 * 1.3 ** i for i in range(39)]
    for name, kw in (("with.png", {"margins": margins}), ("from_json.png", {})):
        probe.plot_report(r, str(tmp_path / name), **kw)
        assert (tmp_path / name).stat().st_size > 10_000 and png_size(tmp_path / name) == probe.PLOT_SIZE


@pytest.mark.model
def test_bench_gate_json():
    r = run_cli("bench", "gate", "--mode", "split_k_f16", "--tau", "0.5", "--concurrency", "2",
                "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "split_k_f16" and out["tau"] == 0.5 and out["deep_tau"] == 0.25
    assert set(out["tok_per_s"]) == {"off", "gated", "always"}
    assert all(v > 0 for v in out["tok_per_s"].values())
    assert out["added_ms_gated"] == pytest.approx(out["ms_per_token"]["gated"] - out["ms_per_token"]["off"])
    assert 0 <= out["recheck_rate"] <= 1
    # without --tau: the packaged profile has no calibration for this model in gemm
    r = run_cli("bench", "gate", "--mode", "gemm", "--max-new-tokens", "4")
    assert r.returncode == 2 and "no gate calibration" in r.stderr and "in mode gemm" in r.stderr, r.stderr


@pytest.mark.model
def test_bench_throughput_json(tmp_path):
    r = run_cli("bench", "throughput", "--concurrency", "1,2", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"mode", "gate", "speculative", "results"}
    assert out["mode"] == "invariant" and out["gate"] == "off" and out["speculative"] is None
    assert [x["concurrency"] for x in out["results"]] == [1, 2]
    for x in out["results"]:
        assert set(x) == {"concurrency", "tok_per_s", "acceptance"}
        assert isinstance(x["tok_per_s"], float) and x["tok_per_s"] > 0 and x["acceptance"] is None


@pytest.mark.model
def test_bench_throughput_reports_the_acceptance_rate():
    # the model drafting for itself keeps every greedy draft
    r = run_cli("bench", "throughput", "--concurrency", "1", "--max-new-tokens", "8", "--speculative-method", "draft",
                "--draft-model", candle_gate.DEFAULT_MODEL)
    assert r.returncode == 0, r.stderr
    assert "speculative {'method': 'draft'}" in r.stdout and r.stdout.rstrip().endswith("100%"), r.stdout


@pytest.mark.model
def test_calibrate_gate_merges_into_an_existing_profile(model, tmp_path):
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"backend": "cpu", "created": "x", "candle_gate_version": "0",
                               "dtypes": {"q4_1": {"row_split_max": 4, "crossover_rows": 5}}}))
    g = calibrate.calibrate_gate(model, mode="split_k_f16", prompts=PROMPTS[:2], max_new_tokens=4,
                                 safety=3.0, progress=False)
    assert g["tau"] == pytest.approx(3.0 * g["max_margin_shift"])
    assert g["max_margin_shift"] == max(g["batch_shift"], g["reference_shift"]) > 0
    assert g["deep_tau"] == pytest.approx(3.0 * g["recheck_shift"])
    assert set(g["by_composition"]) == set(calibrate.GATE_COMPOSITIONS)
    assert g["calibration_prompts"] == 2 and g["mode"] == "split_k_f16" and g["rule"]
    calibrate.merge_gate(str(out), g)
    prof = json.loads(out.read_text())
    assert g["model_sha256"] == model.sha256() and g["model"] == os.path.basename(model.path)
    [entry] = prof["gates"]
    assert prof["dtypes"]["q4_1"]["row_split_max"] == 4 and entry["tau"] == g["tau"]
    # the engine reads tau back from the profile, and says from where
    e = candle_gate.Engine(model, mode="split_k_f16", gate="gated", profile=str(out))
    assert "gated" in e.gate
    assert (e.tau, e.deep_tau) == (pytest.approx(g["tau"]), pytest.approx(g["deep_tau"]))
    assert e.gate_source == f"{out} ({g['model']}/split_k_f16)"
    # one calibration per mode and model: a recalibration replaces it, another mode is added
    calibrate.merge_gate(str(out), {**g, "tau": 0.5})
    calibrate.merge_gate(str(out), {**g, "mode": "gemm", "tau": 0.25})
    prof = json.loads(out.read_text())
    assert [(x["mode"], x["tau"]) for x in prof["gates"]] == [("split_k_f16", 0.5), ("gemm", 0.25)]
    assert candle_gate.Engine(model, mode="gemm", gate="gated", profile=str(out)).tau == 0.25
    with pytest.raises(candle_gate.CandleGateError, match="no gate calibration .* in mode row_split"):
        candle_gate.Engine(model, mode="row_split", gate="gated", profile=str(out))
    fresh = tmp_path / "new.json"
    calibrate.merge_gate(str(fresh), g)
    p2 = json.loads(fresh.read_text())
    assert set(p2) == {"backend", "created", "candle_gate_version", "dtypes", "gates"}
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not overwriting"):
        calibrate.merge_gate(str(bad), g)
