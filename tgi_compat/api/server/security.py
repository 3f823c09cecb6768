"""TGI's transport guards as one pure-ASGI middleware (docs/contract.md §1): CORS, `--api-key`, `--payload-limit`.

Order follows TGI's axum stack, outermost first:
  1. CORS (tower-http `CorsLayer`): every OPTIONS request is a preflight answered here with 200 and
     an empty body, on any path, with or without `access-control-request-method`: tower-http 0.5.2
     tests only the method, and axum 0.7's `Router::layer` wraps the 404 and 405 fallbacks too.
     Other responses gain `access-control-allow-origin` and `vary`.
  2. API key: only the generation routes, and only their POST handlers, require
     `Authorization: Bearer <key>` (the whole header compared case-insensitively); else 401, empty body.
  3. Payload limit: a JSON body larger than the limit gets 413 text/plain
     `Failed to buffer the request body: length limit exceeded`. A declared Content-Length is
     refused before reading; a chunked body is cut off as soon as it passes the limit. Non-JSON
     bodies are left to the route, which answers 415 first, as axum's `Json` extractor does.

Pure ASGI (not BaseHTTPMiddleware) so streamed SSE responses pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

GENERATION_ROUTES = frozenset(
    [
        "/",
        "/generate",
        "/generate_stream",
        "/v1/chat/completions",
        "/v1/completions",
        "/vertex",
        "/invocations",
        "/tokenize",
    ]
)
BODY_ROUTES = GENERATION_ROUTES | {"/chat_tokenize"}
PAYLOAD_TOO_LARGE = b"Failed to buffer the request body: length limit exceeded"
_VARY = b"origin, access-control-request-method, access-control-request-headers"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _is_json(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    mime = content_type.split(b";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition(b"/")
    return kind == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


async def _send_plain(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = list(extra)
    if body:
        headers.append((b"content-type", b"text/plain; charset=utf-8"))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class SecurityMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        cors_origins: Iterable[str] | None = None,
        payload_limit: int = 2_000_000,
    ) -> None:
        self.app = app
        self._expected_auth = f"Bearer {api_key}".lower() if api_key else None
        origins = [o for o in (cors_origins or []) if o]
        self._origins = frozenset(o.encode() for o in origins) if origins else None  # None: any origin
        self.payload_limit = payload_limit

    def _allow_origin(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        if self._origins is None:
            return [(b"access-control-allow-origin", b"*")]
        origin = _header(scope, b"origin")
        return [(b"access-control-allow-origin", origin)] if origin in self._origins else []

    def _needs_key(self, scope: Scope) -> bool:
        if self._expected_auth is None or scope["path"] not in GENERATION_ROUTES:
            return False
        return not (scope["path"] == "/" and scope["method"] in ("GET", "HEAD"))  # GET / is the health route

    def _authorized(self, scope: Scope) -> bool:
        header = _header(scope, b"authorization")
        try:
            return header is not None and header.decode("latin-1").lower() == self._expected_auth
        except UnicodeDecodeError:
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cors = [(b"vary", _VARY)] + self._allow_origin(scope)
        if scope["method"] == "OPTIONS":
            preflight = cors + [
                (b"access-control-allow-methods", b"GET,POST"),
                (b"access-control-allow-headers", b"content-type"),
            ]
            await _send_plain(send, 200, b"", preflight)
            return
        if self._needs_key(scope) and not self._authorized(scope):
            await _send_plain(send, 401, b"", cors)
            return
        if scope["method"] == "POST" and scope["path"] in BODY_ROUTES and _is_json(_header(scope, b"content-type")):
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.payload_limit:
                await _send_plain(send, 413, PAYLOAD_TOO_LARGE, cors)
                return
            await _LimitedBody(self.app, self.payload_limit, cors)(scope, receive, send)
            return
        await self.app(scope, receive, _with_headers(send, cors))


def _start_with_headers(message: Message, extra: list[tuple[bytes, bytes]]) -> Message:
    """`http.response.start` with `extra` replacing same-named headers (`vary` is added to)."""
    names = {name for name, _ in extra if name != b"vary"}
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
    return {**message, "headers": headers + extra}


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = _start_with_headers(message, extra)
        await send(message)

    return wrapped


class _LimitedBody:
    """Counts a streamed request body; past the limit the app sees a disconnect and the client a 413."""

    def __init__(self, app: ASGIApp, limit: int, cors: list[tuple[bytes, bytes]]) -> None:
        self.app, self.limit, self.cors = app, limit, cors
        self.received = 0
        self.exceeded = False
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def limited_receive() -> Message:
            if self.exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.limit:
                    self.exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            # One wrapper, not two: streamed responses pass every SSE event through here.
            if self.exceeded:
                return  # the app is answering a "disconnected" client; the 413 below replaces it
            if message["type"] == "http.response.start":
                self.started = True
                message = _start_with_headers(message, self.cors)
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not self.exceeded:
                raise
        if self.exceeded and not self.started:
            await _send_plain(send, 413, PAYLOAD_TOO_LARGE, self.cors)


def install_security(app, api_key: str | None, cors_origins: Iterable[str] | None, payload_limit: int) -> None:
    """Wrap a FastAPI/Starlette app; call once, after routes are added, before serving."""
    app.add_middleware(
        SecurityMiddleware, api_key=api_key, cors_origins=list(cors_origins or []), payload_limit=payload_limit
    )
