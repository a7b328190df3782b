"""Thin Python layer over the Rust engine: prompt preparation and result objects.

The scheduler, the model and the gate live in Rust; this module turns strings and chats into
token ids and dicts into :class:`Result` objects.
"""
from __future__ import annotations

import difflib
import inspect
import json
import os

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from .models import resolve

MODES = tuple(_native.MODES)  # the Rust enums own the names
LAYOUTS = tuple(_native.LAYOUTS)
DEFAULT_MODE: str = _native.DEFAULT_MODE
layout_for = _native.layout_for  # the weight layout a mode reads fastest
GATES = tuple(_native.GATES)
SPECULATIVE_METHODS = tuple(_native.SPECULATIVE_METHODS)

#: How a request decodes: ``max_new_tokens``, ``stop``, ``temperature`` (0: greedy), ``top_k``,
#: ``top_p``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
#: ``seed``, ``n``, ``logprobs``, ``top_logprobs``. Rust's type: validated when built.
SamplingParams = _native.SamplingParams
#: The keywords :class:`SamplingParams` takes (read off Rust's signature, not restated).
SAMPLING_KEYWORDS = frozenset(inspect.signature(SamplingParams).parameters)
#: The engine's defaults and the default length of a generation: Rust's (`EngineConfig::default`,
#: `SamplingParams::default`), read here rather than restated.
ENGINE_DEFAULTS: Dict[str, Any] = dict(_native.ENGINE_DEFAULTS)
DEFAULT_MAX_NEW_TOKENS: int = _native.DEFAULT_MAX_NEW_TOKENS
_D = ENGINE_DEFAULTS

#: other libraries' names for a keyword (OpenAI's and vLLM's, Hugging Face's): a near miss gets
#: a suggestion
KEYWORD_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "max_length": "max_new_tokens", "num_return_sequences": "n", "stop_sequences": "stop",
                   "stop_strings": "stop", "top_n_logprobs": "top_logprobs"}


def did_you_mean(name: str, accepted: Iterable[str]) -> str:
    """``"; did you mean X?"`` for a near miss of one of ``accepted`` (another API's name for it,
    or a close spelling), else ``""``."""
    accepted = list(accepted)
    alias = KEYWORD_ALIASES.get(name)
    if alias in accepted:
        return f"; did you mean {alias}?"
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _check_sampling_keywords(given: Iterable[str]) -> None:
    """A TypeError naming the first keyword SamplingParams does not take, with a suggestion."""
    for k in given:
        if k not in SAMPLING_KEYWORDS:
            raise TypeError(f"unknown sampling keyword {k!r}{did_you_mean(k, SAMPLING_KEYWORDS)} "
                            f"(sampling takes {', '.join(sorted(SAMPLING_KEYWORDS))})")


Chat = List[Dict[str, str]]
Prompt = Union[str, Chat, Sequence[int]]


@dataclass(eq=False)
class Result:
    """One choice of a finished request (choice 0 for a request of ``n`` choices, whose
    :attr:`choices` holds all of them)."""
    text: str
    token_ids: np.ndarray
    margins: np.ndarray
    fingerprint: str
    finish_reason: str
    rechecked: np.ndarray
    corrected: np.ndarray
    gate: Dict[str, int]
    prompt_tokens: int
    #: the reference lane's margin on rechecked steps, NaN on steps the gate let through
    reference_margins: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.float32))
    logit_hashes: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.uint64))
    id: int = 0
    #: why the engine failed this request alone (``finish_reason == "error"``), else None
    error: Optional[str] = None
    #: which of the request's choices this is
    index: int = 0
    #: the seed the request's draws were keyed by (its own, or the one drawn at submit)
    seed: int = 0
    #: prompt tokens whose K/V came from the prefix cache
    cached_tokens: int = 0
    #: per step, the chosen token's log-probability (empty unless ``logprobs``)
    logprobs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.float32))
    #: ``[steps, top_logprobs]``: the most likely tokens per step and their log-probabilities
    top_logprob_ids: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0), np.uint32))
    top_logprobs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0), np.float32))
    #: drafts proposed for this choice and kept (speculative decoding; 0 without it)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: every choice of the request, in index order (this one first)
    choices: List["Result"] = field(repr=False, default_factory=list)

    @classmethod
    def _from(cls, d: Dict[str, Any]) -> "Result":
        shared = {"id": d["id"], "prompt_tokens": d["prompt_tokens"], "seed": d["seed"],
                  "cached_tokens": d["cached_tokens"]}
        choices = [cls(**shared, **c) for c in d["choices"]]
        for c in choices:
            c.choices = choices
        return choices[0]

    def to_json(self) -> Dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids.tolist(),
            "margins": [float(m) for m in self.margins],
            "fingerprint": self.fingerprint,
            "finish_reason": self.finish_reason,
            "rechecked": int(self.rechecked.sum()),
            "corrected": int(self.corrected.sum()),
            "seed": self.seed,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
        }


def speculative_options(method: Optional[str], num_speculative_tokens: Optional[int] = None,
                        disable_by_batch_size: Optional[int] = None,
                        draft_model: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """``Engine(speculative=...)`` from flags (None: off); what is not given is the engine's
    default. The checks are the Rust engine's."""
    given = {"num_speculative_tokens": num_speculative_tokens, "disable_by_batch_size": disable_by_batch_size,
             "draft_model": draft_model}
    if method is None:
        if any(v is not None for v in given.values()):
            raise _invalid("speculative_method",
                           f"the speculative options need a speculative method ({', '.join(SPECULATIVE_METHODS)})")
        return None
    return {"method": method, **{k: v for k, v in given.items() if v is not None}}


def _with_loaded_draft(speculative: Optional[Dict[str, Any]], layout: Optional[str] = None,
                       quiet: bool = False) -> Optional[Dict[str, Any]]:
    """``speculative`` with its ``draft_model`` (a known name, a path or a :class:`Model`) loaded,
    in ``layout`` (the target's)."""
    if not isinstance(speculative, dict) or "draft_model" not in speculative:
        return speculative
    draft = speculative["draft_model"]
    if isinstance(draft, (str, os.PathLike)):
        draft = Model.load(os.fspath(draft), layout=layout, quiet=quiet)
    return {**speculative, "draft_model": draft._native if isinstance(draft, Model) else draft}


def _chat_json(chat: Any) -> str:
    """The chat as JSON for the Rust side, which validates it (one place for the rules)."""
    if not isinstance(chat, list):
        raise TypeError(f"a chat must be a list of message dicts, got {type(chat).__name__}")
    try:
        return json.dumps(chat, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"a chat must be JSON-serializable message dicts: {e}") from None


def _invalid(param: str, msg: str) -> "_native.InvalidParameter":
    """The error Rust raises for a bad parameter, for the few checks made before reaching it."""
    e = _native.InvalidParameter(msg)
    e.param = param
    return e


class Model:
    """A loaded GGUF model: its weights in one ``layout`` and its tokenizer. Which kernels run
    over it (the mode, a profile's thresholds) is an :class:`Engine`'s to choose."""

    def __init__(self, native: "_native.Model"):
        self._native = native

    @classmethod
    def load(cls, name_or_path: Optional[str] = None, layout: Optional[str] = None, quiet: bool = False,
             **removed: Any) -> "Model":
        """``layout``: how the weights sit in memory (``_native.LAYOUTS``); every mode reads every
        layout with the same bits, the mode a layout was made for fastest. Default: the default
        mode's (``layout_for(mode)`` gives a mode's)."""
        if removed:
            raise TypeError(
                f"Model.load() takes no {', '.join(sorted(removed))}: the kernel mode and profile are "
                "the engine's (Engine(model, mode=..., profile=...)); load the weights in that mode's "
                "layout with Model.load(name, layout=candle_gate.layout_for(mode))")
        if layout is not None and layout not in LAYOUTS:  # before resolve() may download
            raise _invalid("layout", f"unknown weight layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        path = resolve(name_or_path, quiet=quiet)
        return cls(_native.Model.load(str(path), layout))

    @property
    def path(self) -> str:
        return self._native.path

    @property
    def layout(self) -> str:
        """How the weights sit in memory; an engine given no mode runs the one it was made for."""
        return self._native.layout

    @property
    def config(self) -> Dict[str, Any]:
        return self._native.config

    @property
    def stop_ids(self) -> List[int]:
        """The token ids that end a generation (end of text, end of turn)."""
        return self._native.stop_ids

    def sha256(self) -> str:
        return self._native.sha256()

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._native.tokenize(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._native.detokenize([int(i) for i in ids])

    def chat_prompt(self, chat: Chat, tools: Optional[List[Dict[str, Any]]] = None) -> str:
        """The chat rendered by the model's template (with the generation prompt), as text."""
        return self._native.apply_chat_template(_chat_json(chat), None if tools is None else _chat_json(tools))

    def encode_chat(self, chat: Chat, tools: Optional[List[Dict[str, Any]]] = None) -> List[int]:
        """Token ids of a chat. Control tokens come only from the template: ``<|im_end|>`` written
        in a message stays text."""
        return self._native.encode_chat(_chat_json(chat), None if tools is None else _chat_json(tools))

    @property
    def chat_template(self) -> Optional[str]:
        return self._native.chat_template

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> List[int]:
        """A string (wrapped in the chat template when ``chat``), a chat (list of messages), or
        token ids."""
        if isinstance(prompt, str):
            ids = self.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tokenize(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.encode_chat(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
            if any(t < 0 for t in ids):
                raise _invalid("prompt", "token ids must be non-negative")
        else:
            raise TypeError(f"a prompt must be a str, a chat (list of message dicts) or token ids, got {type(prompt).__name__}")
        if not ids:
            raise _invalid("prompt", "empty prompt")
        return ids

    def engine(self, **kwargs: Any) -> "Engine":
        return Engine(self, **kwargs)

    def generate(self, prompts: Union[Prompt, List[Prompt]], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 stop: Optional[Sequence[str]] = None, chat: bool = False,
                 params: Optional[SamplingParams] = None, **kwargs: Any) -> List[Result]:
        """Generation for a list of prompts, batched together; results in input order. Greedy
        unless ``params`` (a :class:`SamplingParams`) or sampling keywords (``temperature``,
        ``top_p``, ``seed``, ``n``, ``logprobs``, ...) say otherwise; the other keywords configure
        the :class:`Engine` (``mode``, ``gate``, ``kv_dtype``, ...)."""
        sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_KEYWORDS}
        engine_kwargs = {k: v for k, v in kwargs.items() if k not in SAMPLING_KEYWORDS}
        engine_params = [p for p in inspect.signature(Engine).parameters if p != "model"]
        unknown = sorted(set(engine_kwargs) - set(engine_params))
        if unknown:
            hint = did_you_mean(unknown[0], [*SAMPLING_KEYWORDS, *engine_params])
            raise TypeError(f"unknown keyword {', '.join(unknown)}{hint} (sampling takes "
                            f"{', '.join(sorted(SAMPLING_KEYWORDS))} or params=; the engine "
                            f"{', '.join(engine_params)})")
        return Engine(self, **engine_kwargs).generate(prompts, max_new_tokens=max_new_tokens, stop=stop,
                                                      chat=chat, params=params, **sampling)


class Engine:
    """Continuous-batching engine. ``submit`` at any time (also from another thread while
    another thread steps), ``step`` runs one forward with the GIL released."""

    def __init__(self, model: Union[Model, str, None] = None, mode: Optional[str] = None,
                 profile: Optional[str] = None, gate: str = "off", tau: Optional[float] = None,
                 max_num_seqs: int = _D["max_num_seqs"], max_tokens_per_step: int = _D["max_tokens_per_step"],
                 prefill_chunk: int = _D["prefill_chunk"], kv_budget_tokens: int = _D["kv_budget_tokens"],
                 threads: Optional[int] = None, record_logit_hashes: bool = False,
                 row_split_max: Optional[int] = None, deep_tau: Optional[float] = None,
                 kv_dtype: str = _D["kv_dtype"], enable_prefix_caching: bool = _D["enable_prefix_caching"],
                 speculative: Optional[Dict[str, Any]] = None):
        if not isinstance(model, Model):
            model = Model.load(model, layout=_native.layout_for(mode or _native.DEFAULT_MODE))
        self.model = model
        # Every argument is checked by the Rust engine (names, numbers, budgets, the profile and
        # the gate rule), with errors that name the argument.
        self._native = _native.Engine(
            model._native, mode=mode, profile=profile, gate=gate, tau=tau, deep_tau=deep_tau,
            max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step,
            prefill_chunk=prefill_chunk, kv_budget_tokens=kv_budget_tokens, kv_dtype=kv_dtype, threads=threads,
            record_logit_hashes=record_logit_hashes, row_split_max=row_split_max,
            gate_profiles=gate_profiles(profile), enable_prefix_caching=enable_prefix_caching,
            speculative=_with_loaded_draft(speculative, layout=model.layout))

    @property
    def speculative(self) -> Optional[str]:
        """The engine's speculative decoding in one line (None: off), e.g.
        ``"ngram;k=12;lookup=2..64;max_batch=8"`` or
        ``"draft;k=3;max_batch=1;draft_model=FILE.gguf"``. Speculation changes how many tokens a step
        emits, never which."""
        return self._native.speculative

    @property
    def system_fingerprint(self) -> str:
        """``fp_`` + 16 hex over the stack every result of this engine is fingerprinted with
        (model file, version, kernels, gate, host): what the server reports."""
        return self._native.system_fingerprint

    def spec_stats(self) -> Dict[str, int]:
        """Drafts proposed (``draft_tokens``) and kept (``accepted_tokens``) since the engine
        started."""
        return self._native.spec_stats()

    @property
    def kv_block_size(self) -> int:
        """Positions per KV block: the pool, prefix-cache hits and preemption work in blocks."""
        return self._native.kv_block_size

    @property
    def prefix_caching(self) -> bool:
        """Whether whole blocks of a token history another request computed are reused."""
        return self._native.prefix_caching

    def kv_stats(self) -> Dict[str, int]:
        """The KV pool now, in blocks (``used``: held by running requests; ``cached``: kept for
        prefix hits, reused when the free ones run out; ``free``; ``total``), and the counters
        since the engine started: ``prefix_queries`` and ``prefix_hits`` (prompt tokens looked
        up and found in the cache), ``preemptions``."""
        n = self._native
        used, cached, total = n.kv_used_blocks, n.kv_cached_blocks, n.kv_total_blocks
        return {"used": used, "cached": cached, "free": total - used - cached, "total": total, **n.cache_stats()}

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (blocks held by running requests stay with them)."""
        self._native.reset_prefix_cache()

    @property
    def kv_dtype(self) -> str:
        """How K/V values are stored: ``"f16"`` (the default) or ``"f32"``."""
        return self._native.kv_dtype

    @property
    def gate_source(self) -> Optional[str]:
        """``"PATH (model/mode)"``: the profile and calibration the gate's tau came from (None
        when tau was given or the engine is not gated)."""
        return self._native.gate_source

    def submit(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Union[str, Sequence[str], None] = None,
               chat: bool = False, forced_tokens: Optional[Sequence[int]] = None,
               params: Optional[SamplingParams] = None, **sampling: Any) -> int:
        """Queues a prompt; returns its request id. Decoding is ``params``, or a
        :class:`SamplingParams` built from ``max_new_tokens``, ``stop`` and the keyword
        arguments (``temperature``, ``top_p``, ``seed``, ``n``, ``logprobs``, ...)."""
        if params is None:
            _check_sampling_keywords(sampling)
            params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop, **sampling)
        elif sampling:
            raise TypeError(f"pass either params= or sampling keywords, not both ({', '.join(sampling)})")
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.model.encode_prompt(prompt, chat=chat)
        forced = None if forced_tokens is None else [int(t) for t in forced_tokens]
        return self._native.submit(ids, params, forced)

    def step(self) -> int:
        return self._native.step()

    def events(self) -> List[Dict[str, Any]]:
        """The events since the last call (the dicts :meth:`stream` yields), without stepping."""
        return self._native.events()

    def is_finished(self, request_id: int) -> bool:
        return self._native.is_finished(int(request_id))

    @property
    def num_running(self) -> int:
        return self._native.num_running

    @property
    def num_waiting(self) -> int:
        return self._native.num_waiting

    @property
    def kernels(self) -> str:
        """The kernel policy and K/V storage as they enter the fingerprint (``mode=…;kv=f16``)."""
        return self._native.kernels

    @property
    def gate(self) -> str:
        """The gate's settings as they enter the fingerprint (``gate=off``, ``gate=gated;tau=…``)."""
        return self._native.gate

    @property
    def kv_budget_tokens(self) -> int:
        return self._native.kv_budget_tokens

    def cancel(self, request_id: int) -> None:
        self._native.cancel(int(request_id))

    def shutdown(self) -> None:
        self._native.shutdown()

    @property
    def has_work(self) -> bool:
        return self._native.has_work

    @property
    def tau(self) -> float:
        """The gate's margin threshold in use (0 when the gate is off)."""
        return float(self._native.tau)

    @property
    def deep_tau(self) -> float:
        """Rechecks whose reference margin is below this rebuild the cache in the reference lane."""
        return float(self._native.deep_tau)

    def gate_stats(self) -> Dict[str, int]:
        return self._native.gate_stats()

    def result(self, request_id: int) -> Optional[Result]:
        """The finished request's result (choice 0; ``.choices`` has all), or None."""
        d = self._native.take_output(int(request_id))
        return None if d is None else Result._from(d)

    def stream(self) -> Iterator[Dict[str, Any]]:
        """Steps until no work is left, yielding events as they happen: ``{"type": "token",
        "id", "index", "token", "text"}`` (text is a UTF-8-safe delta; with ``logprobs``, also
        ``logprob``, ``top_logprob_ids``, ``top_logprobs``) and ``{"type": "finished", "id",
        "index", "reason"}``."""
        while True:
            for ev in self._native.events():
                yield ev
            if not self._native.has_work:
                for ev in self._native.events():
                    yield ev
                return
            self._native.step()

    def run(self, ids: Sequence[int]) -> List[Result]:
        return [Result._from(d) for d in self._native.run([int(i) for i in ids])]

    def generate(self, prompts: Union[Prompt, List[Prompt]], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 stop: Optional[Sequence[str]] = None, chat: bool = False,
                 params: Optional[SamplingParams] = None, **sampling: Any) -> List[Result]:
        """Submits every prompt (decoded as :meth:`submit` says) and runs them together;
        results in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts")
        ids = [self.submit(p, max_new_tokens=max_new_tokens, stop=stop, chat=chat, params=params, **sampling)
               for p in prompts]
        return self.run(ids)


#: The profile shipped inside the package: kernel timings and gate calibrations measured on
#: the machine named in it (its ``"host"``). A gated engine given neither ``tau`` nor
#: ``profile`` uses it for models and modes it has a calibration for, after the user's own
#: (:func:`user_profile_path`, where ``candle-gate calibrate`` writes).
PACKAGED_PROFILE = str(Path(__file__).parent / "profiles" / "cpu.json")


def user_profile_path() -> str:
    """The profile ``candle-gate calibrate`` writes by default: ``profile-cpu.json`` in the
    model cache directory (the Rust crate's ``profile::user_profile_path``)."""
    return _native.user_profile_path()


def gate_profiles(profile: Optional[str] = None) -> List[str]:
    """Where a gated engine looks for its calibration, first match wins: ``profile`` alone when
    given, else the user's profile (when it exists), then :data:`PACKAGED_PROFILE`."""
    if profile is not None:
        return [str(profile)]
    return [p for p in (user_profile_path(), PACKAGED_PROFILE) if os.path.exists(p)]


def resolve_gate(gate: str, tau: Optional[float], deep_tau: Optional[float],
                 profile: Optional[str], model: Optional[Model] = None,
                 mode: Optional[str] = None) -> Tuple[float, Optional[float], Optional[str]]:
    """``(tau, deep_tau, source)`` an engine over ``model`` in ``mode`` would use: explicit
    values first, then the calibrated ones of the first of :func:`gate_profiles` with a
    calibration for that model and mode (``source`` names it; deep_tau None: the engine's
    default, tau/2). Gated with neither is an error. Without ``model`` only the names and
    numbers are checked. The rule and the checks are the Rust engine's
    (``GateConfig::resolve_values``)."""
    native = None if model is None else model._native
    t, d, source = _native.resolve_gate(gate, tau, deep_tau, gate_profiles(profile), native, mode)
    # Values given here come back as given, not through Rust's f32.
    return (float(tau) if tau is not None else t), (float(deep_tau) if deep_tau is not None else d), source
