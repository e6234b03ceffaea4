"""`mobilec serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) over one Engine.

One thread runs the engine's steps; a request handler tokenizes off the event loop, submits to the engine and reads
its events from an asyncio queue the engine's thread fills, so no model call ever runs on the event loop. Every error
is an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import signal
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MobilecError
from .engine import MAX_SESSIONS, Engine, Failed, Finished, QueueFull, Request, SamplingParams, Token
from .structured import Grammars

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's API allows
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI's API allows
RETRY_AFTER_S = 1  # what a 429 tells the client to wait: about one decode step of every session
# after the shutdown deadline's cancellations, how long the cancelled streams get to send their final chunks before
# uvicorn cuts their connections
FINAL_CHUNKS_GRACE_S = 5.0


class ApiError(Exception):
    """An error answered as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(name, f"'{name}' must be a number from {low:g} to {high:g}, got {json.dumps(value)}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limits = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise _bad(name, f"'{name}' must be an integer {limits}, got {json.dumps(value)}")
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise _bad("stop", "'stop' must be a non-empty string or a list of up to 4 of them")
    return tuple(stops)


@dataclasses.dataclass
class _Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int  # choices: as many sequences of the prompt, each with its own seed

    def choice_params(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: the request's, with seed + index so that seeded choices differ."""
        if self.params.seed is None or index == 0:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index)


class Server:
    """The app and the engine thread behind it."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.stop_ids = frozenset(i for i in [tokenizer.eos_token_id] if i is not None)
        self.grammars = Grammars(tokenizer, int(engine.model.artifact.config["model"]["config"]["vocab_size"]))
        self.created = int(time.time())
        self.stopping = threading.Event()  # set when the server stops accepting (SIGTERM)
        self.cancelled_because: str | None = None  # why in-flight requests were cancelled (the shutdown deadline)
        self._in_flight: set[Request] = set()
        self._in_flight_lock = threading.Lock()
        self._engine_done = threading.Event()
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # --- the engine's thread ---

    def start_engine(self) -> None:
        self._engine_done.clear()
        self._thread = threading.Thread(target=self._run_engine, name="mobilec-engine", daemon=True)
        self._thread.start()

    def _run_engine(self) -> None:
        try:
            self.engine.run(self._engine_done)
        finally:
            self.engine.fail_all("the server stopped")

    def stop_engine(self) -> None:
        self.stopping.set()
        self._engine_done.set()
        self.engine.wake()
        if self._thread is not None:
            self._thread.join(30)

    def cancel_in_flight(self, why: str) -> None:
        """Cancel every request still running or waiting (the shutdown deadline passed): each ends with its final
        chunk (finish_reason "cancelled"), and says on stderr what was cancelled."""
        self.cancelled_because = why
        with self._in_flight_lock:
            requests = list(self._in_flight)
        for request in requests:
            self.engine.cancel(request)

    def _log_cancelled(self, shape: _Shape, request: Request, finished: Finished, streamed: bool) -> None:
        if finished.reason == "cancelled" and self.cancelled_because is not None:
            kind = ("a streamed " if streamed else "a ") + ("chat completion" if shape.chat else "completion")
            print(f"mobilec serve: {self.cancelled_because}; cancelled {kind} after {finished.completion_tokens} of "
                  f"its {request.params.max_tokens} tokens", file=sys.stderr, flush=True)

    # --- requests ---

    def _check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            what = "no API key was sent" if not given else "the API key is wrong"
            raise ApiError(401, f"{what}; send the server's --api-key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _json_body(self, request: HttpRequest) -> dict[str, Any]:
        length = request.headers.get("content-length")
        too_big = ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes; send a shorter prompt",
                           code="request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > self.max_body_bytes:
                raise too_big
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err}); send a JSON object",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if self.stopping.is_set():
            raise ApiError(503, "the server is shutting down; send the request to another server",
                           kind="server_error", code="shutting_down")
        return body

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects")
        plain = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _bad("messages", "each message must be an object with a 'role' and a 'content'")
            content = message.get("content")
            if isinstance(content, list):  # content parts: only text ones
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise _bad("messages", "only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise _bad("messages", "each message's 'content' must be a string or a list of text parts")
            plain.append({"role": message["role"], "content": content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise _bad("messages", "this model's tokenizer has no chat template; use /v1/completions with the "
                                   "prompt rendered yourself")
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # the template's own errors (raise_exception): any type
            raise _bad("messages", f"the model's chat template refused the messages: {str(err).splitlines()[0]}") \
                from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise _bad("prompt", f"token ids must be from 0 to {vocab - 1}")
            return list(prompt)
        raise _bad("prompt", "'prompt' must be a string or a non-empty list of token ids (one prompt per request)")

    def _parse(self, body: dict, chat: bool) -> _Parsed:
        n = _integer(body, "n", 1, 1, MAX_SESSIONS)
        response_format = body.get("response_format") or {"type": "text"}
        if not isinstance(response_format, dict):
            raise _bad("response_format", "'response_format' must be an object such as {\"type\": \"json_object\"}")
        try:
            mask = self.grammars.mask_factory(response_format)
        except MobilecError as err:
            raise _bad("response_format", str(err)) from None
        if chat:  # logprobs: true, and top_logprobs: how many alternatives (0 to 20)
            logprobs = body.get("logprobs") is True
            top_logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
            if top_logprobs and not logprobs:
                raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
        else:  # logprobs: how many alternatives (0 to 5), or absent for none
            top_logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
            logprobs, top_logprobs = top_logprobs is not None, top_logprobs or 0
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        room = self.engine.context_window - len(prompt_ids) + 1
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        given = next((name for name in names if body.get(name) is not None), names[-1])
        max_tokens = _integer(body, given, max(room, 1) if chat else 16, 1)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "'stream' must be true or false")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), top_k=_integer(body, "top_k", 0, 0),
            seed=_integer(body, "seed", None, 0), stop=_stop_strings(body),
            stop_ids=frozenset() if body.get("ignore_eos") is True else self.stop_ids,
            logprobs=logprobs, top_logprobs=top_logprobs, mask=mask)
        try:
            self.engine.check_fits(len(prompt_ids), max_tokens)
        except MobilecError as err:
            raise _bad(given, str(err)) from None
        return _Parsed(prompt_ids, params, stream, options.get("include_usage") is True, n)

    def _submit(self, parsed: _Parsed) -> tuple[list[Request], asyncio.Queue]:
        """The request's n choices given to the engine; their events arrive on one queue as (choice, event)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(index: int):
            def emit(event) -> None:
                if not loop.is_closed():  # after shutdown nobody listens; the engine must not fail on it
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return emit

        requests: list[Request] = []
        try:
            for index in range(parsed.n):
                request = Request(parsed.prompt_ids, parsed.choice_params(index), emitter(index))
                self.engine.submit(request)
                requests.append(request)
                with self._in_flight_lock:
                    self._in_flight.add(request)
        except MobilecError as err:
            for request in requests:  # all of the choices or none
                self._done(request)
            if isinstance(err, QueueFull):
                raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            raise ApiError(400, str(err)) from None
        return requests, events

    async def generate(self, request: HttpRequest, chat: bool):
        self._check_key(request)
        body = await self._json_body(request)
        parsed = await asyncio.to_thread(self._parse, body, chat)  # tokenizing a long prompt takes a while
        engine_requests, events = self._submit(parsed)
        shape = _Shape(chat, self.model_name)
        if parsed.stream:
            return StreamingResponse(self._sse(engine_requests, events, shape, parsed.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, engine_requests, events, shape)

    async def _whole(self, http: HttpRequest, requests: list[Request], events: asyncio.Queue, shape: _Shape):
        tokens: list[list[Token]] = [[] for _ in requests]
        finished: dict[int, Finished] = {}
        try:
            while len(finished) < len(requests):
                try:
                    index, event = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return JSONResponse({}, status_code=499)  # _done cancels the choices
                    continue
                if isinstance(event, Token):
                    tokens[index].append(event)
                elif isinstance(event, Failed):
                    raise ApiError(500, event.message, kind="server_error")
                else:
                    self._log_cancelled(shape, requests[index], event, streamed=False)
                    finished[index] = event
            return JSONResponse(shape.whole(tokens, [finished[i] for i in range(len(requests))]))
        finally:
            for request in requests:
                self._done(request)

    async def _sse(self, requests: list[Request], events: asyncio.Queue, shape: _Shape, include_usage: bool):
        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        finished: dict[int, Finished] = {}
        try:
            if shape.chat:
                for index in range(len(requests)):
                    yield data(shape.chunk(index, {"role": "assistant", "content": ""}, None, None))
            while len(finished) < len(requests):
                index, event = await events.get()
                if isinstance(event, Token):
                    if event.text or event.logprob is not None:
                        yield data(shape.chunk_for(index, event))
                elif isinstance(event, Failed):
                    yield data({"error": {"message": event.message, "type": "server_error", "param": None,
                                          "code": None}})
                    break
                else:
                    self._log_cancelled(shape, requests[index], event, streamed=True)
                    finished[index] = event
                    yield data(shape.chunk(index, {} if shape.chat else "", None, event.reason))
            if include_usage and len(finished) == len(requests):
                usage = _usage([finished[i] for i in range(len(requests))])
                yield data({**shape.chunk(0, {}, None, None), "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for request in requests:
                self._done(request)

    def _done(self, request: Request) -> None:
        """The handler is over: a request still running (its client went away) is cancelled, and its sequence freed
        at the engine's next step; a no-op once finished."""
        self.engine.cancel(request)
        with self._in_flight_lock:
            self._in_flight.discard(request)

    def metrics_text(self) -> str:
        return self.engine.metrics.text()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            self.start_engine()
            try:
                yield
            finally:
                self.stop_engine()

        app = FastAPI(title="mobilec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_request, err: ApiError):
            return err.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request, err: StarletteHTTPException):
            return ApiError(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None) \
                .response()

        @app.exception_handler(Exception)
        async def unexpected(_request, err: Exception):
            return ApiError(500, f"internal error: {type(err).__name__}: {' '.join(str(err).split())[:300]}",
                            kind="server_error").response()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest):
            return await self.generate(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await self.generate(request, chat=False)

        @app.get("/v1/models")
        async def models(request: HttpRequest):
            self._check_key(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "mobilec"}]}

        @app.get("/health")
        async def health():
            if self.stopping.is_set():
                return JSONResponse({"status": "shutting down"}, status_code=503)
            return {"status": "ok", "sessions": len(self.engine.active), "queue": self.engine.queue_length}

        @app.get("/metrics")
        async def metrics(request: HttpRequest):
            self._check_key(request)
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

        return app


def _usage(choices: list[Finished]) -> dict[str, int]:
    """One prompt, the completion tokens of every choice."""
    prompt, completion = choices[0].prompt_tokens, sum(f.completion_tokens for f in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Shape:
    """The OpenAI response objects of one request: chat completion or text completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _logprobs(self, tokens: list[Token]) -> dict | None:
        if not tokens or tokens[0].logprob is None:
            return None
        if self.chat:
            return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                                 "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}
                                                  for text, lp in t.top_logprobs]} for t in tokens]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        top = [dict(t.top_logprobs) for t in tokens] if tokens[0].top_logprobs else None
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": top, "text_offset": offsets}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, tokens: list[list[Token]], finished: list[Finished]) -> dict:
        """The whole response: choice i from tokens[i] and finished[i]."""
        choices = []
        for index, (choice_tokens, end) in enumerate(zip(tokens, finished)):
            text = "".join(t.text for t in choice_tokens)
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **body, "logprobs": self._logprobs(choice_tokens),
                            "finish_reason": end.reason})
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": _usage(finished)}

    def chunk(self, index: int, delta: dict | str, tokens: list[Token] | None, reason: str | None) -> dict:
        logprobs = self._logprobs(tokens) if tokens else None
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def chunk_for(self, index: int, token: Token) -> dict:
        return self.chunk(index, {"content": token.text} if self.chat else token.text, [token], None)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """`mobilec serve`'s options."""

    artifact: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 4
    max_queue: int = 16
    api_key: str | None = None
    model_name: str | None = None  # default: the artifact directory's name
    max_body_bytes: int = 1 << 20
    shutdown_timeout_s: float = 10.0
    threads: int | None = None


def load_server(options: ServeOptions) -> Server:
    """The artifact loaded into an engine, behind the app (not listening yet)."""
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    from ..artifacts.artifact import load_artifact  # pylint: disable=import-outside-toplevel
    from ..target.cpu_check import check_cpu, this_cpu  # pylint: disable=import-outside-toplevel
    from ..target.host import set_threads  # pylint: disable=import-outside-toplevel
    from ..loaders.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    from ..runtime.session import LoadedArtifact  # pylint: disable=import-outside-toplevel

    artifact = load_artifact(options.artifact)
    check_cpu(artifact.path, artifact.config, this_cpu())
    tokenizer = load_tokenizer(artifact.tokenizer_dir)
    set_threads(options.threads)
    engine = Engine(LoadedArtifact(artifact), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    max_sessions=options.max_sessions, max_queue=options.max_queue)
    return Server(engine, tokenizer, options.model_name or Path(options.artifact).resolve().name, options.api_key,
                  options.max_body_bytes)


def serve(options: ServeOptions, on_ready=None) -> None:
    """Serve until SIGTERM or Ctrl-C: then stop accepting, let in-flight streams finish for up to
    shutdown_timeout_s, cancel the rest (each ends with its final chunk). `on_ready(url, model name)` is called once
    the socket listens."""
    import uvicorn  # pylint: disable=import-outside-toplevel

    server = load_server(options)

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not server.stopping.is_set():
                server.stopping.set()  # new requests on open connections get 503 while streams finish
                why = f"{signal.Signals(sig).name}: the {options.shutdown_timeout_s} s shutdown deadline passed"
                deadline = threading.Timer(options.shutdown_timeout_s, server.cancel_in_flight, (why,))
                deadline.daemon = True
                deadline.start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.started:
                on_ready(f"http://{options.host}:{options.port}", server.model_name)

    config = uvicorn.Config(server.app, host=options.host, port=options.port, log_level="warning",
                            timeout_graceful_shutdown=options.shutdown_timeout_s + FINAL_CHUNKS_GRACE_S,
                            lifespan="on")
    _Uvicorn(config).run()
