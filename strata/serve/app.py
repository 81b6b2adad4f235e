"""The FastAPI app: routes, the guard in front of them, and the error handlers behind them.

`create_app(llm, options)` returns an ASGI app ready for uvicorn. Its worker threads start with the app's
lifespan and stop with it. Every response that is not a success is a JSON error object in the shape of the
API family the path belongs to (strata.serve.errors); unexpected exceptions are logged and answered as a plain
500 without internals.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from strata.api import LLM
from strata.serve import anthropic_api, openai_api
from strata.serve.context import ServeOptions, ServerContext
from strata.serve.errors import ApiError, error_body, error_bytes, style_for_path
from strata.serve.metrics import geometry, memory_info, weight_placement
from strata.serve.scheduler import Steer

log = logging.getLogger("strata.serve")

STATIC_DIR = Path(__file__).parent / "static"
# Reachable without the API key: the web page itself (it asks for the key) and the liveness probe.
PUBLIC_PATHS = ("/", "/health", "/favicon.ico")
PUBLIC_PREFIXES = ("/static/",)
# The page's content security policy: its own scripts, styles and API only.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a bind address or a Host header name) is this machine's loopback."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name part of a Host header ("127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "::1")."""
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class _BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes")


class Guard:
    """Checks that run before any route: Host header, API key, content type and body size; also counts every
    response for /metrics and adds security headers. A pure ASGI middleware, so it can stop a request before
    its body is read and count a streamed body as it arrives."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], ctx: ServerContext):
        self.app = app
        self.ctx = ctx
        key = ctx.options.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        style = style_for_path(path)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = [500]

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                extra = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
                if path == "/" or path.startswith("/static/"):
                    extra.append((b"content-security-policy", PAGE_CSP.encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            refusal = self._refusal(path, scope["method"], headers)
            if refusal is not None:
                await self._reply(counted_send, refusal, style)
                return
            limit = self.ctx.options.max_body_bytes
            received = 0

            async def limited_receive() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise _BodyTooLarge(limit)
                return message

            await self.app(scope, limited_receive, counted_send)
        finally:
            self.ctx.metrics.count_request(path, status[0])

    def _refusal(self, path: str, method: str, headers: dict[str, str]) -> ApiError | None:
        if self.ctx.options.loopback_hosts_only and not is_loopback_host(_host_name(headers.get("host", ""))):
            return ApiError(403, "this server does not answer requests for that Host name")
        public = path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
        if self.key is not None and not public:
            bearer = headers.get("authorization", "")
            token = bearer[7:].strip() if bearer[:7].lower() == "bearer " else ""
            x_key = headers.get("x-api-key", "")
            if not token and not x_key:
                return ApiError(401, "an API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                code="invalid_api_key")
            # Both compared in constant time, every time, so response timing says nothing about the key.
            ok_bearer = hmac.compare_digest(token.encode(), self.key)
            ok_x = hmac.compare_digest(x_key.encode(), self.key)
            if not (ok_bearer or ok_x):
                return ApiError(401, "invalid API key", code="invalid_api_key")
        if method == "POST":
            length = headers.get("content-length")
            if length is not None:
                if not length.isdigit():
                    return ApiError(400, "invalid Content-Length header")
                if int(length) > self.ctx.options.max_body_bytes:
                    return _BodyTooLarge(self.ctx.options.max_body_bytes)
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return ApiError(415, "send the request body as JSON with 'Content-Type: application/json'")
        return None

    @staticmethod
    async def _reply(send: Send, err: ApiError, style: str) -> None:
        body = error_bytes(err, style)
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err, style_for_path(request.url.path)), status_code=err.status)


def create_app(llm: LLM, options: ServeOptions | None = None, *, steer: Steer | None = None) -> FastAPI:
    """The server for `llm`. `steer` is the scheduler's logits seam (see strata.serve.scheduler); leave it
    None to serve the model as it is."""
    ctx = ServerContext(llm, options or ServeOptions(), steer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.scheduler.start()
        try:
            yield
        finally:
            ctx.scheduler.stop()

    app = FastAPI(title="strata", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        messages = {404: f"no route {request.method} {request.url.path[:200]}",
                    405: f"{request.method} is not allowed on {request.url.path[:200]}"}
        return _error_response(request, ApiError(exc.status_code, messages.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, ApiError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(request, ApiError(500, "internal server error; see the server log"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": ctx.model_name}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        engine = llm.engine
        snap = ctx.metrics.snapshot()
        return {
            "model": ctx.model_name, "path": str(llm.path),
            "geometry": geometry(engine),
            "placement": {"device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                          "weights_bytes_by_device": weight_placement(engine)},
            "memory": {**memory_info(engine), "cache_bytes": ctx.cache.stats().bytes},
            "queue": ctx.scheduler.queue_info(),
            "cache": ctx.cache.stats().as_dict(),
            "limits": {"max_prompt_tokens": ctx.max_prompt_tokens, "max_tokens": ctx.max_tokens_limit,
                       "max_body_bytes": ctx.options.max_body_bytes, "context": ctx.context_length},
            "chat_template": llm.chat_template is not None,
            "last_request": snap.pop("last_request"),
            "totals": snap,
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = ctx.metrics.prometheus(ctx.scheduler.queue_info(), ctx.cache.stats().as_dict(),
                                      memory_info(llm.engine))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico")
    async def favicon() -> Response:
        return Response(status_code=204)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.add_middleware(Guard, ctx=ctx)
    return app
