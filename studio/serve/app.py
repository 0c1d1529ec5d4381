"""`dlm-studio serve`: the OpenAI-compatible HTTP API on FastAPI (docs/serving.md).

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events, or whole),
GET /v1/traces/{id} (a finished request's trace, JSON Lines as `--trace` writes them). Handlers parse and tokenize;
the `Scheduler`'s thread does all decoding. Every failure is an OpenAI error object with its status (400 bad request,
401 key, 404 model/route/trace, 413 body, 429 queue full, 500 internal); a traceback only reaches the log.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import shutil
import socket
import tempfile
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from studio.errors import BadInput
from studio.run.config import RunConfig
from studio.run.session import encode_messages
from studio.serve.protocol import FINISH, ApiError, Limits, Request, bad, chunk, error_body, parse, response, usage_chunk
from studio.serve.scheduler import Job, Scheduler

log = logging.getLogger("dlm-studio.serve")

POLL_S = 0.25          # how often a waiting handler checks that its client is still there
CLIENT_GONE = 499      # the status logged for a request whose client left (nobody reads it)


class ClientGone(Exception):
    pass


def build_app(engine, default: RunConfig, *, served: str = "default", chat_template: bool = True,
              api_key: str | None = None, limits: Limits = Limits(), trace_dir: Path | None = None) -> FastAPI:
    """The app for `engine`, served under the model name `served`; requests that name no strategy run `default`.
    Traces go to `trace_dir` (None: a temporary directory removed at shutdown)."""
    app = FastAPI(title="dlm-studio", lifespan=_lifespan(engine, limits, trace_dir), docs_url=None, redoc_url=None,
                  openapi_url=None, dependencies=[Depends(_authorizer(api_key))])
    _add_error_handlers(app)
    _add_routes(app, engine, default, served=served, chat_template=chat_template, limits=limits)
    return app


def _lifespan(engine, limits: Limits, trace_dir: Path | None):
    """The app's lifespan: the scheduler's thread runs while the app serves; its own trace directory (where
    `trace_dir` is None) is removed at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        own = trace_dir is None
        where = Path(tempfile.mkdtemp(prefix="dlm-studio-traces-")) if own else Path(trace_dir)
        where.mkdir(parents=True, exist_ok=True)
        app.state.scheduler = Scheduler(engine, where, limits).start()
        try:
            yield
        finally:
            app.state.scheduler.stop()
            if own:
                shutil.rmtree(where, ignore_errors=True)
    return lifespan


def _authorizer(api_key: str | None):
    """The dependency every route has: with an API key, the request must carry it."""
    key = api_key.encode() if api_key else None

    def authorize(request: HttpRequest) -> None:
        """With an API key, every route wants it as a bearer token (compared in constant time)."""
        if key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if not hmac.compare_digest(token.encode(), key) or scheme.lower() != "bearer":
                raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               type="authentication_error", code="invalid_api_key")
    return authorize


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI error object with its status."""

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


def _add_routes(app: FastAPI, engine, default: RunConfig, *, served: str, chat_template: bool,
                limits: Limits) -> None:
    """GET /v1/models, POST /v1/chat/completions and /v1/completions, GET /v1/traces/{rid}."""
    runnable = _runnable(engine)   # the model names GET /v1/models lists (read once: it reads every preset file)

    async def complete(http: HttpRequest, chat: bool):
        return await _complete(http, chat, engine, default, served=served, chat_template=chat_template, limits=limits)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "dlm-studio"}
                                           for m in [served] + [f"{served}:{n}" for n in runnable]]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    @app.get("/v1/traces/{rid}")
    async def trace(rid: str, request: HttpRequest):
        path = request.app.state.scheduler.trace(rid)
        if path is None or not path.exists():
            raise ApiError(404, f"no finished request {rid!r} among the traces this server keeps", code="not_found")
        return FileResponse(path, media_type="application/x-ndjson")


async def _complete(http: HttpRequest, chat: bool, engine, default: RunConfig, *, served: str, chat_template: bool,
                    limits: Limits):
    """A completion request: parsed and tokenized here, decoded by the scheduler's thread; streamed as server-sent
    events or answered whole."""
    request = parse(await _read_json(http, limits.max_body_bytes), chat=chat, served=served, default=default,
                    limits=limits)
    prompt_ids = _prompt_ids(engine, request, chat_template)
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    job = Job(request, prompt_ids, request.new_id(), lambda msg: loop.call_soon_threadsafe(inbox.put_nowait, msg))
    http.app.state.scheduler.submit(job)
    try:
        kind, payload = await _next(inbox, http, job)
        if kind == "error":
            raise payload
        if request.stream:
            return StreamingResponse(_stream(request, job, inbox, payload, len(prompt_ids)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        while kind != "done":
            kind, payload = await _next(inbox, http, job)
            if kind == "error":
                raise payload
        return JSONResponse(response(request, job.id, payload.footer["text"], payload.footer, len(prompt_ids)))
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    finally:
        if not request.stream:
            job.cancel()   # a no-op once done; stops the run when the handler ends early


def _runnable(engine) -> list[str]:
    """The strategies that fit the model and find what they load by default (DFlash: a drafter shipped for it), then
    the strategy presets whose strategy fits (a preset named like its strategy, once)."""
    from studio.engine.strategies import STRATEGIES
    from studio.run.config import presets_for
    names = [n for n, s in STRATEGIES.items() if s.fits(engine.config) and s.ready_for(engine.name)]
    return names + [p for p in presets_for(engine.config) if p not in names]


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_json(http: HttpRequest, limit: int):
    """The body as JSON; 413 past `limit` bytes (before reading it, when the length is declared)."""
    declared = http.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                       code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise bad("the request body is not valid JSON") from None


def _prompt_ids(engine, request: Request, chat_template: bool) -> list[int]:
    if request.chat:
        return encode_messages(engine, list(request.messages), chat_template)
    if isinstance(request.prompt, str):
        return engine.tokenizer.encode(request.prompt)
    vocab = engine.config.vocab_size
    if max(request.prompt) >= vocab:
        raise bad(f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
    return list(request.prompt)


async def _next(inbox: asyncio.Queue, http: HttpRequest, job: Job) -> tuple:
    """The job's next message; ClientGone (the job cancelled) if the client disconnects while it waits."""
    while True:
        try:
            return await asyncio.wait_for(inbox.get(), POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                job.cancel()
                raise ClientGone from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(request: Request, job: Job, inbox: asyncio.Queue, header: dict, n_prompt: int):
    """Server-sent events: a chunk per step that emitted text (or, with include_events, per step), the finish
    reason, the usage when asked, then [DONE]. A client that disconnects cancels the stream, and so the job."""
    rid, created, events = job.id, int(time.time()), request.include_events
    try:
        if request.chat or events:
            yield _sse(chunk(request, rid, created, first=True, trace={"header": header} if events else None))
        while True:
            kind, payload = await inbox.get()
            if kind == "events":
                text = "".join(e["text"] for e in payload if e["t"] == "emit")
                if text or events:
                    yield _sse(chunk(request, rid, created, text, trace={"events": payload} if events else None))
            elif kind == "done":
                footer = payload.footer
                yield _sse(chunk(request, rid, created, finish=FINISH.get(footer["stop_reason"], "stop"),
                                 trace={"footer": footer} if events else None))
                if request.include_usage:
                    yield _sse(usage_chunk(request, rid, created, footer, n_prompt))
                break
            else:
                yield _sse(payload.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (before the model loads: a taken port is a one-line error at once)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise BadInput(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


@contextlib.contextmanager
def serving_in_thread(app: FastAPI, host: str = "127.0.0.1"):
    """Serve `app` on a free port of `host` from a thread until the block ends; yields the base URL (the load
    measurement of `bench clients N` and the tests talk HTTP to it)."""
    import threading

    import uvicorn
    sock = listen(host, 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dlm-studio-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve on `sock` until Ctrl+C (uvicorn)."""
    import uvicorn
    uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])
