"""An OpenAI-compatible endpoint over any `Engine`, with token-exact sessions.

    POST /v1/chat/completions      messages, tools, tool_choice, sampling, n, seed, logprobs, stream
    POST /v1/completions           a text prompt or a list of token ids (token-in)
    GET  /v1/models                the one model served
    POST /tokenize, /detokenize    vLLM's: a prompt or messages to ids, ids to text

Each agent run is a session, named in the path (`/s/<session>/v1/...`, the base URL its
client gets) or by an `X-Session-Id` header; calls without one go to the session "default".
The session keeps the run's token sequence (`session.py`), so what the trainer learns on is,
token for token, what the engine conditioned on and sampled. Responses carry those ids, where
vLLM's server puts them for RL: `prompt_token_ids` at the top, `token_ids` per choice; with
`return_tokens_as_token_ids` the logprob tokens read `token_id:<id>`.

The server is aiohttp's (one package, and its server runs inside the caller's event loop, so a
rollout's agents, this server and the lockstep rounds share one loop and one thread). It never
generates by itself: a `Batcher` decides when the engine runs. `DirectBatcher` generates what
has arrived whenever the engine is free (standalone use, `serve`); a rollout's lockstep rounds
(`rounds.AgentRounds`) gather the calls of every live agent into one engine call per round.

Sampling: the request's fields win over the server's `sampling` (the trainer's settings); the
server's `max_new_tokens` is the ceiling of `max_tokens`, so an agent cannot make a step cost
more than the trainer allows. `ignore_eos` (vLLM's field, sent through the client's
`extra_body`) samples past the template's end of turn, up to `max_tokens`. Tool calls are
parsed from the reply with the tool layer's parser (Hermes `<tool_call>` blocks by default)
when the request gave tools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from aiohttp import web

from ..chat import ChatFormat, Tokenizer
from ..engines.base import Engine, Generation, GenerationRequest, SamplingParams, check_temperature
from ..engines.sampler import mix_seed
from ..tools.parser import HermesParser, ToolCallParser
from . import protocol
from .defaults import REPLY_MATCH, ReplyMatch
from .protocol import BadRequest, CallSpec, Choice
from .session import Node, Renderer, Session


class Batcher(Protocol):
    """Decides when the engine runs: `generate` returns once the rows have been sampled."""

    async def generate(self, session: Session, requests: list[GenerationRequest]) -> list[Generation]: ...


class DirectBatcher:
    """Generates what has arrived as soon as the engine is free, in a worker thread (so the
    server keeps accepting calls meanwhile); calls that arrive during a generation go together
    into the next one."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.engine_calls = 0
        self._queue: list[tuple[list[GenerationRequest], asyncio.Future[list[Generation]]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def generate(self, session: Session, requests: list[GenerationRequest]) -> list[Generation]:
        future: asyncio.Future[list[Generation]] = asyncio.get_running_loop().create_future()
        self._queue.append((requests, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let calls sent together arrive together
        while self._queue:
            batch, self._queue = self._queue, []
            rows = [r for reqs, _ in batch for r in reqs]
            try:
                out = await asyncio.to_thread(self.engine.generate, rows)
                self.engine_calls += 1
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            hand_out([(reqs, future) for reqs, future in batch], out)


def hand_out(
    batch: list[tuple[list[GenerationRequest], asyncio.Future[list[Generation]]]], out: list[Generation]
) -> None:
    """Give each call of `batch` its rows of `out` (the engine's answer, in batch order)."""
    at = 0
    for reqs, future in batch:
        if not future.done():
            future.set_result(out[at : at + len(reqs)])
        at += len(reqs)


@dataclasses.dataclass
class _Call:
    """One chat or completions request on its way through a session."""

    spec: CallSpec
    session: Session
    base: Node | None
    context: list[int]  # the history's ids
    opener: list[int]  # the assistant turn's opener (chat), or nothing (completions)

    @property
    def prompt(self) -> list[int]:
        return self.context + self.opener


class AgentEndpoint:
    """The endpoint (see the module docstring). `open_sessions`: calls may name sessions the
    caller did not `open` (standalone use); a rollout opens one per agent run and refuses others."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        sampling: SamplingParams | None = None,
        batcher: Batcher | None = None,
        model: str = "policy",
        parser: ToolCallParser | None = None,
        open_sessions: bool = True,
        seed: int = 0,
        reply_match: ReplyMatch = REPLY_MATCH,
    ):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.chat = ChatFormat(tokenizer)
        self.renderer = Renderer(self.chat)
        self.sampling = sampling or SamplingParams()
        self.batcher: Batcher = batcher or DirectBatcher(engine)
        self.parser = parser or HermesParser()
        self.open_sessions, self.seed, self.reply_match = open_sessions, seed, reply_match
        self.sessions: dict[str, Session] = {}
        self.requests = 0  # answered, over every session
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    # -- sessions -----------------------------------------------------------------------------
    def open(self, session_id: str, *, seed: int = 0) -> Session:
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions[session_id] = Session(id=session_id, seed=seed, reply_match=self.reply_match)
        return self.sessions[session_id]

    def url(self, session_id: str | None = None) -> str:
        """The base URL an OpenAI client gets (`OpenAI(base_url=...)`): of one session, or the default."""
        if not self.base_url:
            raise RuntimeError("the endpoint is not started: await endpoint.start() (or use serve())")
        return f"{self.base_url}/v1" if session_id is None else f"{self.base_url}/s/{session_id}/v1"

    def _session(self, request: web.Request) -> Session:
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id") or "default"
        if sid not in self.sessions:
            if not self.open_sessions:
                raise BadRequest(
                    f"no agent session {sid!r} is running here", status=404, code="session_not_found"
                )
            self.open(sid, seed=mix_seed(self.seed, len(self.sessions)))
        return self.sessions[sid]

    # -- the server ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("", "/s/{sid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._guard(self._chat))
            app.router.add_post(prefix + "/v1/completions", self._guard(self._completions))
            app.router.add_get(prefix + "/v1/models", self._guard(self._models))
            app.router.add_post(prefix + "/tokenize", self._guard(self._tokenize))
            app.router.add_post(prefix + "/detokenize", self._guard(self._detokenize))
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on `host` and a free port (or `port`); returns the base URL."""
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        server = site._server  # the bound socket: the port the system picked
        sockets = getattr(server, "sockets", None) or []
        bound = sockets[0].getsockname()[1] if sockets else port
        self._runner, self.base_url = runner, f"http://{host}:{bound}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _guard(self, handler: Any) -> Any:
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except BadRequest as exc:
                return web.json_response(exc.body(), status=exc.status)
            except (asyncio.CancelledError, web.HTTPException):
                raise
            except Exception as exc:  # the engine or the rollout failed: the client gets why
                body = BadRequest(f"{type(exc).__name__}: {exc}", status=500).body()
                return web.json_response(body, status=500)

        return guarded

    async def _body(self, request: web.Request) -> object:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON ({exc})") from None

    # -- endpoints ----------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "interlens_mcore",
            "max_model_len": self.engine.max_context,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        spec = protocol.chat_call(await self._body(request))
        key = spec.tools_key
        base = session.base_for_chat(spec.messages, key)
        session.note_base(base, spec.messages)
        if base is not None:
            context = base.ids + self.renderer.messages(spec.messages[len(base.messages or ()) :])
        else:
            context = self.renderer.opening(spec.messages, spec.tools, key)
        call = _Call(spec, session, base, context, self.chat.generation_prompt_ids())
        return await self._answer(request, call)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        spec = protocol.completion_call(await self._body(request))
        if spec.stream:
            raise BadRequest("'stream' is served for chat completions only", param="stream")
        ids = list(spec.prompt) if isinstance(spec.prompt, tuple) else self.chat.encode_text(spec.prompt)
        vocab = len(self.tokenizer)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise BadRequest(
                f"'prompt' holds token id {bad[0]}, beyond the vocabulary of {vocab}", param="prompt"
            )
        base = session.base_for_ids(ids)
        session.note_base(base, None)
        return await self._answer(request, _Call(spec, session, base, ids, []))

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if "messages" in body:
            spec = protocol.chat_call({"model": self.model, **body, "add_generation_prompt": None})
            ids = self.renderer.opening(spec.messages, spec.tools, spec.tools_key)
            if body.get("add_generation_prompt", True):
                ids += self.chat.generation_prompt_ids()
        elif isinstance(body.get("prompt"), str):
            ids = self.chat.encode_text(body["prompt"])
        else:
            raise BadRequest("/tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        return web.json_response({"count": len(ids), "max_model_len": self.engine.max_context, "tokens": ids})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise BadRequest("/detokenize needs 'tokens', a list of token ids", param="tokens")
        return web.json_response({"prompt": self.chat.decode(tokens)})

    # -- sampling and answering ---------------------------------------------------------------
    def _requests(self, call: _Call) -> list[GenerationRequest]:
        spec, session = call.spec, call.session
        room = self.engine.max_context - len(call.prompt)
        if room < 1:
            session.truncated = True
            raise BadRequest(
                f"the prompt is {len(call.prompt)} tokens, which leaves no room for a reply in the "
                f"model's context length of {self.engine.max_context}",
                param="messages" if spec.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        ceiling = self.sampling.max_new_tokens
        cap = min(spec.max_tokens or ceiling, ceiling, room)
        options = {**self.sampling.options(), **spec.sampling, "stop": spec.stop}
        # ignore_eos (vLLM's field) drops the template's end of turn; the trainer's stop ids stay
        own = () if spec.ignore_eos else self.chat.stop_token_ids
        options["stop_token_ids"] = tuple(dict.fromkeys([*own, *self.sampling.stop_token_ids]))
        try:
            check_temperature(float(options["temperature"]), "temperature")
            return [
                GenerationRequest(
                    prompt_ids=call.prompt,
                    max_new_tokens=cap,
                    seed=mix_seed(session.seed, session.calls, i, spec.seed if spec.seed is not None else -1),
                    tag=f"{session.id}/call{session.calls + 1}/choice{i}",
                    **options,
                )
                for i in range(spec.n)
            ]
        except ValueError as exc:  # a sampling field out of range: SamplingOptions names it
            field = next((f for f in protocol.SAMPLING_FIELDS if f in str(exc)), None)
            raise BadRequest(str(exc), param=field) from None

    def _choice(self, call: _Call, g: Generation) -> Choice:
        spec = call.spec
        text = self.chat.decode(list(g.token_ids))
        cuts = [i for i in (text.find(s) for s in spec.stop) if i != -1]
        if cuts:
            text = text[: min(cuts)]  # as OpenAI's API: the stop string is not in the text
        parsed = self.parser.parse(text) if spec.kind == "chat" and spec.tools_key else None
        if spec.kind == "chat":
            message = protocol.assistant_message(text, parsed)
            history: tuple[Mapping[str, Any], ...] | None = (*spec.messages, message)
            ends = () if spec.ignore_eos else self.chat.stop_token_ids  # a sampled eos did not stop it
            stopped = bool(g.token_ids) and g.token_ids[-1] in ends
            close = self.chat.close_ids("stop" if stopped else "length")
        else:
            message, history, close = {"content": text}, None, []
        call.session.commit(
            call.base,
            call.context,
            call.opener,
            g.token_ids,
            g.logprobs,
            g.finish_reason,
            close,
            history,
            spec.tools_key,
        )
        finish = "tool_calls" if parsed is not None and parsed.calls else g.finish_reason
        tokens = self.tokenizer.convert_ids_to_tokens(list(g.token_ids)) if spec.logprobs else []
        return Choice(g, message, finish, [str(t) for t in tokens])

    async def _answer(self, request: web.Request, call: _Call) -> web.StreamResponse:
        requests = self._requests(call)
        generations = await self.batcher.generate(call.session, requests)
        if len(generations) != len(requests):
            raise RuntimeError(f"the engine returned {len(generations)} rows for {len(requests)}")
        session = call.session
        choices = [self._choice(call, g) for g in generations]
        session.calls += 1
        self.requests += 1
        rid = f"{'chatcmpl' if call.spec.kind == 'chat' else 'cmpl'}-{session.id}-{session.calls}"
        call_ids = [
            [f"call_{session.calls}_{i}_{k}" for k in range(len(c.message.get("tool_calls") or []))]
            for i, c in enumerate(choices)
        ]
        if not call.spec.stream:
            return web.json_response(protocol.response(call.spec, rid, call.prompt, choices, call_ids))
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        for chunk in protocol.stream_chunks(call.spec, rid, call.prompt, choices, call_ids):
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


@contextmanager
def serve(
    engine: Engine, tokenizer: Tokenizer, *, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> Iterator[AgentEndpoint]:
    """An endpoint serving `engine` from a thread of its own, for synchronous callers::

        with serve(engine, tokenizer) as endpoint:
            client = openai.OpenAI(base_url=endpoint.url(), api_key="none")
            client.chat.completions.create(model="policy", messages=[...])

    `options` are `AgentEndpoint`'s. The sessions stay readable after the block.
    """
    endpoint = AgentEndpoint(engine, tokenizer, **options)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            await endpoint.start(host, port)
        except BaseException as exc:
            failure.append(exc)
            started.set()
            return
        started.set()
        while endpoint._runner is not None:
            await asyncio.sleep(0.05)

    thread = threading.Thread(
        target=loop.run_until_complete, args=(main(),), daemon=True, name="agent-endpoint"
    )
    thread.start()
    started.wait()
    if failure:
        raise failure[0]
    try:
        yield endpoint
    finally:
        asyncio.run_coroutine_threadsafe(endpoint.stop(), loop).result(timeout=30)
        thread.join(timeout=30)
        loop.close()
