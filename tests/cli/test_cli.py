"""The command line's own behaviour, without a model: every flag says what it does and its
default (issue 53)."""
import argparse
import subprocess
import sys

import pytest

from candle_gate.cli import all_parsers, build_parser


def _flags():
    for p in all_parsers(build_parser()):
        for a in p._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                yield p, a


def test_every_flag_has_help_and_its_default():
    missing, no_default = [], []
    for p, a in _flags():
        help_text = p.formatter_class(prog=p.prog)._get_help_string(a) if a.help else ""
        name = f"{p.prog} {'/'.join(a.option_strings) or a.dest}"
        if not help_text.strip():
            missing.append(name)
        elif a.option_strings and not isinstance(a, argparse._StoreTrueAction) and "default" not in help_text:
            no_default.append(name)
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose help does not say their default: {no_default}"


def _entry(help_out, flag):
    """A flag's entry in --help: its line and the indented lines under it."""
    lines = help_out.split("options:", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -") or not lines[i].strip()),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize("command,expected", [
    ("serve", ["--max-queue MAX_QUEUE", "(default: 64)", "(default: 127.0.0.1)", "(default: 8000)",
               "--api-key-env NAME", "--api-key-file PATH"]),
    ("generate", ["(default: 64)", "(default: invariant)", "(default: off)"]),
])
def test_help_shows_defaults(command, expected):
    out = subprocess.run([sys.executable, "-m", "candle_gate", command, "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    text = " ".join(out.split("options:", 1)[1].split())  # (the flags' help, not the usage line)
    for e in expected:
        assert e in text, e
    for flag in ("--gate", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty"):
        if command == "generate" or flag == "--gate":
            assert "default:" in _entry(out, flag), (flag, _entry(out, flag))
