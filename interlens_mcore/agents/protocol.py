"""The OpenAI wire format the endpoint speaks: request bodies read and checked, responses built.

A request body becomes a `CallSpec` (what to sample and how) or a `BadRequest` that names the
field and says what was expected; the server answers the latter with status 400 and OpenAI's
error body (`{"error": {"message", "type", "param", "code"}}`), which the `openai` client raises
as `openai.BadRequestError`.

Chat messages are kept in a canonical form (`canonical`): text content as one string, tool
calls as (name, arguments object) without their ids. Two histories are the same history when
their canonical forms are equal, whatever spelling an agent framework gave them (content
parts or a string, `None` or "", arguments re-serialised with other spacing).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engines.base import Generation
from ..tools.parser import ParsedCalls

ROLES = ("system", "developer", "user", "assistant", "tool")
# sampling fields passed to the engine as they are (vLLM's meanings, as in SamplingOptions)
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# every field a request may carry besides the sampling ones: those read below, and those agents
# send that change nothing here (accepted and ignored)
KNOWN = (
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "response_format",
    "service_tier",
    "stream_options",
    "logit_bias",
    "echo",
    "best_of",
    "suffix",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "web_search_options",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
    "top_logprobs",
    "logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "tools",
    "tool_choice",
    "model",
    "messages",
    "prompt",
    "functions",
    "function_call",
)


class BadRequest(Exception):
    """A request the endpoint refuses: answered with `status` and OpenAI's error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CallSpec:
    """One request: what to sample (a chat history or a prompt) and how."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[Mapping[str, Any], ...] = ()  # canonical chat history (chat)
    tools: tuple[Mapping[str, Any], ...] = ()  # the request's tool schemas, as sent
    tool_choice: object = "auto"
    prompt: str | tuple[int, ...] = ""  # text or token ids (completion)
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingOptions fields the request set
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens "token_id:123"
    ignore_eos: bool = False  # vLLM's: the template's end of turn does not stop the reply

    @property
    def tools_key(self) -> str:
        """The tools presented, as one string: a history under other tools is another history."""
        if not self.tools or self.tool_choice == "none":
            return ""
        return json.dumps(list(self.tools), sort_keys=True)


def _int(body: Mapping[str, Any], name: str, *, low: int, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadRequest(f"'{name}' must be an integer >= {low}, got {value!r}", param=name)
    return value


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"'{name}' must be a number, got {value!r}", param=name)
        out[name] = int(value) if name == "top_k" else float(value)
    return out


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > 16:
        raise BadRequest(
            f"'stop' must be a non-empty string or a list of at most 16 of them, got {stop!r}", param="stop"
        )
    return tuple(items)


def _common(body: object, kind: Literal["chat", "completion"]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(KNOWN) - set(SAMPLING_FIELDS))
    if unknown:
        raise BadRequest(f"unknown request field {unknown[0]!r}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(f"'model' must be a non-empty string, got {model!r}", param="model")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    logprobs = body.get("logprobs")
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadRequest(f"'logprobs' must be true or false, got {logprobs!r}", param="logprobs")
        top = _int(body, "top_logprobs", low=0, default=0)
        wants_logprobs = bool(logprobs)
    else:  # the legacy completions API: logprobs is the number of top tokens
        top = _int(body, "logprobs", low=0, default=None)
        wants_logprobs, top = top is not None, top or 0
    if top is not None and top > 20:
        raise BadRequest(f"'top_logprobs' must be at most 20, got {top}", param="top_logprobs")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest(f"'stream_options' must be an object, got {options!r}", param="stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}", param="stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", param="seed")
    return {
        "kind": kind,
        "model": model,
        "sampling": _sampling(body),
        "stop": _stop(body),
        "max_tokens": _int(body, limit_field, low=1),
        "n": _int(body, "n", low=1, default=1),
        "seed": seed,
        "logprobs": wants_logprobs,
        "top_logprobs": top or 0,
        "stream": stream,
        "include_usage": bool(options.get("include_usage")),
        "token_ids_as_text": bool(body.get("return_tokens_as_token_ids")),
        "ignore_eos": ignore_eos,
    }


def chat_call(body: object) -> CallSpec:
    """The CallSpec of a /v1/chat/completions body, or BadRequest naming what is wrong."""
    spec = _common(body, "chat")
    assert isinstance(body, dict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise BadRequest(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ...}} objects',
            param="tools",
        )
    choice = body.get("tool_choice", "auto")
    if not (choice in ("auto", "none", "required") or isinstance(choice, dict)):
        raise BadRequest(
            f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}",
            param="tool_choice",
        )
    canon = tuple(canonical(m, where=f"messages[{i}]") for i, m in enumerate(messages))
    return CallSpec(messages=canon, tools=tuple(tools), tool_choice=choice, **spec)


def completion_call(body: object) -> CallSpec:
    """The CallSpec of a /v1/completions body: a text prompt or a list of token ids."""
    spec = _common(body, "completion")
    assert isinstance(body, dict)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list, as the client may send it
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return CallSpec(prompt=tuple(prompt), **spec)
    if isinstance(prompt, str) and prompt:
        return CallSpec(prompt=prompt, **spec)
    raise BadRequest(
        "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", param="prompt"
    )


def _is_tool(tool: object) -> bool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return False
    fn = tool.get("function")
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"])


def text_of(content: object, where: str) -> str:
    """A message's content as one string: a string, None (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{where}.content[{k}] is of type {kind!r}; only text parts are served", param=where
                )
        return "".join(parts)
    raise BadRequest(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}", param=where
    )


def canonical(message: object, *, where: str) -> dict[str, Any]:
    """A chat message in the form histories are compared in (see the module docstring)."""
    if not isinstance(message, dict):
        raise BadRequest(
            f"{where} must be an object with 'role' and 'content', got {type(message).__name__}", param=where
        )
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=where)
    role = "system" if role == "developer" else role
    out: dict[str, Any] = {"role": role, "content": text_of(message.get("content"), where)}
    calls = message.get("tool_calls") or []
    if calls and role != "assistant":
        raise BadRequest(f"{where}: only assistant messages carry tool_calls", param=where)
    if calls:
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    return out


def _call(call: object, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(
            f'{where} must be {{"type": "function", "function": {{"name", "arguments"}}}}', param=where
        )
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the text it is: compared as text, rendered as text
    return {"name": fn["name"], "arguments": args}


def assistant_message(text: str, parsed: ParsedCalls | None) -> dict[str, Any]:
    """The canonical assistant message of a reply: tool calls where the parser found some."""
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text}
    head = text.split("<tool_call>", 1)[0].rstrip()
    calls = [{"name": c.name, "arguments": dict(c.arguments)} for c in parsed.calls]
    return {"role": "assistant", "content": head, "tool_calls": calls}


@dataclass(frozen=True)
class Choice:
    """One sampled choice, as the response reports it."""

    generation: Generation
    message: Mapping[str, Any]  # canonical assistant message (chat) or {"content": text}
    finish_reason: str
    tokens: Sequence[str]  # each sampled id as text, for logprobs


def _logprobs(spec: CallSpec, choice: Choice) -> dict[str, Any] | None:
    if not spec.logprobs:
        return None
    g = choice.generation
    names = [f"token_id:{t}" for t in g.token_ids] if spec.token_ids_as_text else list(choice.tokens)
    if spec.kind == "completion":
        return {
            "tokens": names,
            "token_logprobs": list(g.logprobs),
            "top_logprobs": [{n: lp} for n, lp in zip(names, g.logprobs, strict=True)]
            if spec.top_logprobs
            else None,
            "text_offset": None,
        }
    content = []
    for name, lp in zip(names, g.logprobs, strict=True):
        entry = {"token": name, "logprob": lp, "bytes": list(name.encode())}
        # engines report the sampled token's logprob only: it is the one top entry given
        content.append({**entry, "top_logprobs": [entry] if spec.top_logprobs else []})
    return {"content": content}


def tool_calls_out(message: Mapping[str, Any], call_ids: Sequence[str]) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls")
    if not calls:
        return None
    return [
        {
            "id": cid,
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for cid, c in zip(call_ids, calls, strict=True)
    ]


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.generation.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def response(
    spec: CallSpec,
    rid: str,
    prompt_ids: Sequence[int],
    choices: Sequence[Choice],
    call_ids: Sequence[Sequence[str]],
) -> dict[str, Any]:
    """The non-streamed response body; `prompt_token_ids` and each choice's `token_ids` are the
    ids the engine conditioned on and sampled (the fields vLLM's server uses for RL)."""
    out: list[dict[str, Any]] = []
    for i, (c, ids) in enumerate(zip(choices, call_ids, strict=True)):
        item: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason, "logprobs": _logprobs(spec, c)}
        if spec.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.message.get("content") or None}
            calls = tool_calls_out(c.message, ids)
            if calls:
                message["tool_calls"] = calls
            elif message["content"] is None:
                message["content"] = ""
            item["message"] = message
        else:
            item["text"] = c.message["content"]
        item["token_ids"] = list(c.generation.token_ids)
        if spec.kind == "completion":  # vLLM's completions put the prompt's ids on each choice
            item["prompt_token_ids"] = list(prompt_ids)
        out.append(item)
    return {
        "id": rid,
        "object": "chat.completion" if spec.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": spec.model,
        "choices": out,
        "usage": usage(len(prompt_ids), choices),
        "prompt_token_ids": list(prompt_ids),
    }


def stream_chunks(
    spec: CallSpec,
    rid: str,
    prompt_ids: Sequence[int],
    choices: Sequence[Choice],
    call_ids: Sequence[Sequence[str]],
) -> list[dict[str, Any]]:
    """The chunks of a streamed chat response (each sent as one `data:` event): per choice its
    role, its content, its tool calls, then its finish reason; the usage last when asked."""
    created, chunks = int(time.time()), []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        body = {
            "index": index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": extra.pop("logprobs", None),
        }
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": spec.model,
            "choices": [{**body, **extra}],
        }

    for i, (c, ids) in enumerate(zip(choices, call_ids, strict=True)):
        chunks.append(chunk(i, {"role": "assistant", "content": ""}))
        text = c.message.get("content") or ""
        if text:
            chunks.append(chunk(i, {"content": text}, logprobs=_logprobs(spec, c)))
        calls = tool_calls_out(c.message, ids) or []
        for k, call in enumerate(calls):
            chunks.append(chunk(i, {"tool_calls": [{"index": k, **call}]}))
        chunks.append(chunk(i, {}, c.finish_reason, token_ids=list(c.generation.token_ids)))
    if spec.include_usage:
        chunks.append(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": spec.model,
                "choices": [],
                "usage": usage(len(prompt_ids), choices),
            }
        )
    return chunks
