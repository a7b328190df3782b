"""``candle-gate probe``: the in-process probe (:mod:`candle_gate.probe`), or with ``--endpoint URL``
the endpoint probe (:mod:`candle_gate.probe.endpoint`, docs/ENDPOINT_PROBE.md)."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, List, Optional, Sequence

from .common import gate_args, model_args, parse_concurrency, sampling_args, sampling_flags


def _endpoint_args(p: argparse.ArgumentParser) -> List[argparse.Action]:
    """``--endpoint URL`` and the flags that only it takes, which are returned. Their defaults
    are None here, so that giving one without ``--endpoint`` is caught; the endpoint probe's
    defaults fill them in."""
    ep = p.add_argument_group("endpoint probe (docs/ENDPOINT_PROBE.md): probe an OpenAI-compatible server")
    ep.add_argument("--endpoint", default=None, metavar="URL",
                    help="probe this OpenAI-compatible server (http://host:port/v1) instead of the in-process engine "
                         "(default: the in-process engine)")
    ep.add_argument("--repeats", type=int, default=None, help="requests per prompt per load (default 3)")
    ep.add_argument("--concurrency", default=None, help="comma-separated thread-pool sizes (default 1,4)")
    ep.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 32)")
    ep.add_argument("--api-key-env", default=None, metavar="VAR",
                    help="read the API key from this environment variable (never printed; default: no key)")
    ep.add_argument("--top-logprobs", type=int, default=None,
                    help="top_logprobs to ask for (default 2; -1: no logprobs)")
    ep.add_argument("--orders", default=None, help="comma-separated subset of alone,burst,interleaved (default: all three)")
    ep.add_argument("--stream", action="store_true", default=None,
                    help="send streaming requests (SSE) and assemble each completion from its chunks")
    ans = ep.add_mutually_exclusive_group()
    ans.add_argument("--extract", default=None, metavar="REGEX",
                     help="the answer: the regex's first group (else the whole match; default: the whole completion)")
    ans.add_argument("--json-field", default=None, metavar="PATH",
                     help="the answer: this dotted path (a.b.0) in the completion parsed as JSON (default: the whole completion)")
    return [a for a in ep._group_actions if a.dest != "endpoint"]


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="measure flip rates across batch compositions")
    model_args(p)
    gate_args(p)
    p.add_argument("--prompts", default=None,
                   help="JSON list of prompts (strings or chats) or a text file, one per line (default: the "
                        "built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here (default: not written)")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib; default: none)")
    p.add_argument("--compositions", default=None,
                   help="comma-separated subset of composition names (default: all)")
    sampling_flags(p)
    p.set_defaults(func=functools.partial(main, endpoint_only=_endpoint_args(p)))


def main(a: argparse.Namespace, endpoint_only: Sequence[argparse.Action] = ()) -> int:
    if a.endpoint:
        return endpoint(a)
    given = [x for x in endpoint_only if getattr(a, x.dest) is not None]
    if given:
        print(f"candle-gate probe: {given[0].option_strings[0]} needs --endpoint URL", file=sys.stderr)
        return 2
    return in_process(a)


def prompts_from_args(a: argparse.Namespace, default: Optional[Sequence[Any]] = None) -> Optional[List[Any]]:
    """``--prompts FILE`` (else ``default``), the first ``--num-prompts`` of them when given."""
    from ..probe import load_prompts
    prompts = load_prompts(a.prompts) if a.prompts else default
    k = a.num_prompts
    if k is not None:
        if k <= 0:
            raise ValueError(f"--num-prompts must be positive, got {k}")
        prompts = list(prompts)[:k]
    return None if prompts is None else list(prompts)


def write_outputs(a: argparse.Namespace, report: Any, plot: Callable[[str], None], ensure_ascii: bool = True) -> None:
    """``--json OUT`` and ``--plot PNG``: the report as JSON, the PNG by ``plot(path)`` (a note
    instead without matplotlib); each file written is named on stderr."""
    from ..probe import write_json
    if a.json_out:
        write_json(report, a.json_out, ensure_ascii=ensure_ascii)
        print(f"probe: report written to {a.json_out}", file=sys.stderr)
    if a.plot:
        try:
            plot(a.plot)
        except ImportError:
            print(f"probe: --plot needs matplotlib (pip install 'candle-gate[plot]'); "
                  f"no plot written to {a.plot}", file=sys.stderr)
        else:
            print(f"probe: plot written to {a.plot}", file=sys.stderr)


def in_process(a: argparse.Namespace) -> int:
    """``candle-gate probe`` without ``--endpoint``."""
    from .. import probe
    report, runs = probe.measure(model=a.model, prompts=prompts_from_args(a, default=probe.DEFAULT_PROMPTS),
                                 max_new_tokens=a.max_new_tokens, mode=a.mode, gate=a.gate, tau=a.tau,
                                 profile=a.profile, compositions=a.compositions, progress=True,
                                 deep_tau=a.deep_tau, sampling=sampling_args(a))
    print(probe.format_report(report))
    write_outputs(a, report, lambda path: probe.plot_report(report, path, margins=runs.baseline_margins))
    return 0


def endpoint(a: argparse.Namespace) -> int:
    """``candle-gate probe --endpoint URL ...``: exit status 0 when the run produced at least one
    completion, 1 when every request failed."""
    from ..probe import endpoint as ep
    if not a.prompts:
        raise ValueError("--endpoint needs --prompts FILE")
    report = ep.probe_endpoint(
        a.endpoint, a.model, prompts_from_args(a),
        repeats=ep.DEFAULT_REPEATS if a.repeats is None else a.repeats,
        concurrency=ep.DEFAULT_CONCURRENCY if a.concurrency is None else parse_concurrency(a.concurrency),
        max_tokens=a.max_new_tokens if a.max_tokens is None else a.max_tokens,
        temperature=0.0 if a.temperature is None else a.temperature,
        seed=a.seed, api_key_env=a.api_key_env, extract=a.extract, json_field=a.json_field,
        top_logprobs=ep.DEFAULT_TOP_LOGPROBS if a.top_logprobs is None else a.top_logprobs,
        orders=a.orders, progress=True, stream=bool(a.stream))
    print(ep.format_report(report))
    write_outputs(a, report, lambda path: ep.plot_report(report, path), ensure_ascii=False)
    return 0 if report["completions"] > 0 else 1
