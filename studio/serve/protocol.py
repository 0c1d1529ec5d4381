"""The OpenAI wire format, both ways: a request body parsed into a validated `Request` (or an `ApiError`), and the
response, chunk, usage and error objects built from what a run produced (docs/serving.md).

Pure functions over plain dicts: no web framework and no engine here, so every rule is testable on its own.
Strict where a silent default would mislead: an unknown field, `n` > 1 or a sampling value out of range is a 400
naming it, not ignored. The fields OpenAI clients send by habit are accepted at their neutral values only.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from studio.errors import BadInput
from studio.run.config import RunConfig, strategy_or_preset

# Fields clients send by default; accepted only at the value that changes nothing.
NEUTRAL = {"frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logprobs": (False, None),
           "top_logprobs": (0, None), "logit_bias": ({}, None), "user": None, "echo": (False, None),
           "best_of": (1, None), "suffix": (None, ""), "parallel_tool_calls": None, "store": (False, None),
           "metadata": None, "service_tier": None}
COMMON = ("temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "max_tokens",
            "max_completion_tokens", "model", "strategy", "params")
CHAT_FIELDS = frozenset(COMMON + ("messages",))
TEXT_FIELDS = frozenset(COMMON + ("prompt",))
ROLES = ("system", "user", "assistant")
MAX_STOPS = 4


class ApiError(Exception):
    """An answer other than 200: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Request:
    """One completion request, validated: what to decode (chat `messages` or a text `prompt`), how (`config`), and
    how to answer (`stream`, with usage and the per-step trace in the stream when asked)."""
    chat: bool
    model: str                    # echoed in the response: the name the client used
    config: RunConfig
    messages: tuple[dict, ...] = ()
    prompt: str | tuple[int, ...] = ""
    stream: bool = False
    include_usage: bool = False
    include_events: bool = False

    def new_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def prompt_text(self) -> str:
        """The prompt as a trace header shows it."""
        if self.chat:
            return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)
        return self.prompt if isinstance(self.prompt, str) else ""


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 2048          # the largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20   # a request body's size
    max_queued: int = 32            # requests waiting beyond the running ones before 429
    max_running: int = 8            # requests decoding at once


def parse(body: Any, *, chat: bool, served: str, default: RunConfig, limits: Limits) -> Request:
    """A request body as a `Request`; ApiError (400, or 404 for another model's name) naming the bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else TEXT_FIELDS
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL:
            if NEUTRAL[key] is not None and value not in NEUTRAL[key]:
                raise bad(f"{key}={value!r} is not supported (only its default)", key)
            continue
        raise bad(f"unknown parameter {key!r}", key)
    model = body.get("model", served)
    config = _config(body, model, served, default, limits)
    options = body.get("stream_options")
    stream = _typed(body, "stream", bool, False)
    if options is not None:
        if not stream:
            raise bad("stream_options applies to streamed requests (stream: true)", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_events"}:
            raise bad("stream_options takes include_usage and include_events (true or false)", "stream_options")
    options = options or {}
    common = dict(chat=chat, model=model, config=config, stream=stream,
                  include_usage=_typed(options, "include_usage", bool, False, "stream_options.include_usage"),
                  include_events=_typed(options, "include_events", bool, False, "stream_options.include_events"))
    if chat:
        return Request(messages=_messages(body.get("messages")), **common)
    return Request(prompt=_prompt(body.get("prompt")), **common)


def _typed(obj: dict, key: str, kind: type | tuple, default, name: str | None = None):
    value = obj.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join({"bool": "true or false", "int": "a whole number", "float": "a number",
                             "str": "a string", "dict": "an object"}[k.__name__] for k in kinds)
        raise bad(f"{name or key} must be {names}, got {value!r}", name or key)
    return value


def _config(body: dict, model: Any, served: str, default: RunConfig, limits: Limits) -> RunConfig:
    """The run the request asks for: the strategy or preset from `strategy`, else from `model`'s ':' suffix, else the
    server's default; the sampling fields over it; checked by building it."""
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    name, _, suffix = model.partition(":")
    if name != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r} "
                       f"(add ':STRATEGY' to choose a strategy, see GET /v1/models)", param="model",
                       code="model_not_found")
    strategy = _typed(body, "strategy", str, None)
    if strategy and suffix and strategy != suffix:
        raise bad(f"the model names strategy {suffix!r} and the strategy field {strategy!r}: give one", "strategy")
    config = default
    if strategy or suffix:
        try:
            named, preset = strategy_or_preset(strategy or suffix)
        except BadInput as e:
            raise bad(str(e), "strategy" if strategy else "model") from None
        config = dataclasses.replace(default, strategy=named, preset=preset, params={})
    params = _typed(body, "params", dict, {})
    if any(not isinstance(v, (bool, int, float, str)) for v in params.values()):
        raise bad("params values must be numbers, strings or booleans", "params")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        limit = _typed(body, key, int, None)
        if not 1 <= limit <= limits.max_tokens:
            raise bad(f"{key} must be between 1 and {limits.max_tokens} (this server's limit), got {limit}", key)
    if _typed(body, "n", int, 1) != 1:
        raise bad("n must be 1: one completion per request", "n")
    seed = _typed(body, "seed", int, default.seed)
    if seed < 0:
        raise bad(f"seed must be >= 0, got {seed}", "seed")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stop is not None and (not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS):
        raise bad(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    config = dataclasses.replace(
        config, params={**config.params, **params}, seed=seed, stop=stop if stop is not None else config.stop,
        temperature=_typed(body, "temperature", (int, float), config.temperature),
        top_p=_typed(body, "top_p", (int, float), config.top_p), top_k=_typed(body, "top_k", int, config.top_k),
        max_new_tokens=limit if limit is not None else config.max_new_tokens)
    try:
        _, settings = config.build()
    except (BadInput, TypeError) as e:
        named = next((k for k in ("temperature", "top_k", "top_p") if str(e).startswith(k)), None)
        raise bad(str(e), named) from None
    if settings.max_new_tokens > limits.max_tokens:   # a preset's or the default length past this server's limit
        config = dataclasses.replace(config, max_new_tokens=limits.max_tokens)
    return config


def _messages(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"{where} must be an object with role {', '.join(ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):   # the parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content: only text parts are supported", where)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string", where)
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    """A string, a list of one string, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return tuple(prompt)
    raise bad("prompt must be a non-empty string (or a list of one, or of token ids): one completion per request",
              "prompt")


# -- answers ----------------------------------------------------------------------------------------------------

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}


def usage(prompt_tokens: int, footer: dict, label: str) -> dict:
    """OpenAI's token counts, and the decoding statistics (docs/metrics.md) under `decoding`."""
    n = footer["n_tokens"]
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "decoding": {"strategy": label, "forwards": footer["forwards"], "tpf": footer["tpf"],
                         "accept_rate": footer["accept_rate"] if footer["accept_by_pos"] else None, "tok_s": footer["tok_s"],
                         "wall_s": footer["wall_s"], "prefill_s": footer["prefill_s"]}}


def response(request: Request, rid: str, text: str, footer: dict, prompt_tokens: int) -> dict:
    """The whole answer of a request that did not stream."""
    finish = FINISH.get(footer["stop_reason"], "stop")
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": request.model, "choices": [choice], "usage": usage(prompt_tokens, footer, request.config.label)}


def chunk(request: Request, rid: str, created: int, text: str | None = None, *, first: bool = False,
          finish: str | None = None, trace: dict | None = None) -> dict:
    """One streamed chunk: new text (the role first, in a chat), the finish reason at the end, and with
    include_events the trace's header, a step's events or its footer under `dlm_trace`."""
    if request.chat:
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    out = {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion", "created": created,
           "model": request.model, "choices": [choice]}
    if trace is not None:
        out["dlm_trace"] = trace
    return out


def usage_chunk(request: Request, rid: str, created: int, footer: dict, prompt_tokens: int) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion", "created": created,
            "model": request.model, "choices": [], "usage": usage(prompt_tokens, footer, request.config.label)}
