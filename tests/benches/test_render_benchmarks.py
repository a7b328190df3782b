"""benches/render_benchmarks.py: the measured tables of docs/BENCHMARKS.md and the README are
what the result files say (model-free, no native module)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "benches" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rb = _renderer()


def test_the_documents_are_what_the_result_files_render(capsys):
    # A hand-edited number, a table whose result file changed, a marker without a table, a table
    # in no document or a link to a missing BENCHMARKS section all fail here.
    code = rb.main(["--check", "--root", str(ROOT)])
    assert code == 0, capsys.readouterr().err


# A tiny synthetic vs_llama_cpp.py result: one model, one and eight streams.
SYNTH = {
    "read_bandwidth_gbs": 40.0,
    "threads": 2,
    "rows": [
        {"model": "smollm2-135m-instruct-q4_1", "streams": 1,
         "candle_gate": {"prefill_tok_s": 300.0, "decode_tok_s": 150.0},
         "llama_cpp": {"prefill_tok_s": 200.0, "decode_tok_s": 100.0},
         "bandwidth_share": 0.456},
        {"model": "smollm2-135m-instruct-q4_1", "streams": 8,
         "candle_gate": {"decode_tok_s": 400.0}, "llama_cpp": {"decode_tok_s": 160.0}},
    ],
}
PROV = {"synth.json": dict(at="abc1234", host="xeon", date="2026-01-02")}


def _synth_results(data=SYNTH, provenance=PROV):
    return rb.Results(ROOT, files={"synth.json": data}, provenance=provenance)


def _tables():
    return {"synth": lambda res, doc: rb.short_prompt_table(res, doc, "synth.json")}


def test_a_table_renders_its_numbers_and_where_they_were_measured():
    out = "\n".join(rb.short_prompt_table(_synth_results(), "docs/BENCHMARKS.md", "synth.json"))
    assert "| SmolLM2-135M Q4_1 | 300.0 vs 200.0 (1.50x) | 150.0 vs 100.0 (1.50x) | 400.0 vs 160.0 (2.50x) | 46% |" in out
    assert "Read bandwidth 40.0 GB/s" in out
    # Not recorded in the file: from PROVENANCE, marked with a dagger; linked relative to the doc.
    assert "[`synth.json`](../benches/results/synth.json) (at abc1234, on the 2-core Intel Xeon" in out
    assert "2026-01-02†)" in out


def test_a_file_that_records_its_commit_and_host_is_believed():
    data = dict(SYNTH, commit="def5678", host="Some CPU")
    where, told = _synth_results(data, {"synth.json": dict(host="xeon", date="2026-01-02")}).where("synth.json")
    assert where.startswith("at def5678, on the 2-core Intel Xeon")
    assert "“Some CPU”" in where and told  # the date still came from PROVENANCE


def test_a_file_that_records_commit_host_and_date_needs_no_provenance_entry():
    # what benches/provenance.py writes
    data = dict(SYNTH, commit="def5678", host="AMD EPYC (family 25 model 17, 2 cores, avx512)", date="2026-12-06",
                before_build="73deae7")
    where, told = _synth_results(data, {}).where("synth.json")
    assert (where, told) == ("at def5678 against 73deae7, on AMD EPYC (family 25 model 17, 2 cores, avx512), "
                             "2026-12-06", False)


def test_a_file_with_no_provenance_is_an_error():
    with pytest.raises(rb.RenderError, match="PROVENANCE"):
        _synth_results(provenance={}).where("synth.json")


def test_only_the_marked_block_is_rewritten_and_prose_is_kept():
    doc = ("Prose, 1.23x by hand.\n\n  <!-- table:synth -->\n  | stale | table |\n  <!-- /table:synth -->\n\n"
           "More prose.\n")
    new, names = rb.render_document(doc, "README.md", _synth_results(), _tables())
    assert names == ["synth"]
    assert new.startswith("Prose, 1.23x by hand.\n\n  <!-- table:synth -->\n  | model |")
    assert "stale" not in new and new.endswith("  <!-- /table:synth -->\n\nMore prose.\n")
    assert "](benches/results/synth.json)" in new  # a link from the README is relative to the root
    # Rendering is idempotent: what --check compares against is a fixed point.
    assert rb.render_document(new, "README.md", _synth_results(), _tables())[0] == new


def test_a_hand_edited_number_is_caught():
    doc = "<!-- table:synth -->\n<!-- /table:synth -->\n"
    good, _ = rb.render_document(doc, "README.md", _synth_results(), _tables())
    edited = good.replace("150.0 vs 100.0", "160.0 vs 100.0")
    assert rb.render_document(edited, "README.md", _synth_results(), _tables())[0] != edited


def test_unknown_and_unpaired_markers_are_errors():
    with pytest.raises(rb.RenderError, match="names no table"):
        rb.render_document("<!-- table:nope -->\n<!-- /table:nope -->\n", "README.md", _synth_results(), _tables())
    with pytest.raises(rb.RenderError, match="unpaired"):
        rb.render_document("<!-- table:synth -->\nno end\n", "README.md", _synth_results(), _tables())


def test_section_anchors_are_githubs():
    assert rb.slug("Against llama.cpp at chat length") == "against-llamacpp-at-chat-length"
    assert rb.slug("Attention, context limits, K/V storage and sampling") == \
        "attention-context-limits-kv-storage-and-sampling"
    assert rb.slug("One-column Q8_0 and an AVX-512 attention tier") == "one-column-q8_0-and-an-avx-512-attention-tier"
    text = "# T\n\n## Prefix cache\n\n```\n## not a heading\n```\n\n## Prefix cache\n"
    assert rb.anchors(text) == {"t", "prefix-cache", "prefix-cache-1"}
