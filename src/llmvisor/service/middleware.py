"""`RequestGuard`: body-size limits on every route and keys checked before a byte of the body is read.

FastAPI reads and parses a declared body before it resolves a route's dependencies, so without this an
unauthenticated client could make the service read and parse a body of any size. The guard is a pure ASGI
middleware in front of the app:

- a declared ``Content-Length`` over the route's limit is a 413 without reading the body;
- a body sent without a length (chunked) is counted as it is read, and reading stops with a 413 at the limit;
- on the routes that need a key, a missing or invalid bearer key is a 401 before the body is read, and on
  the routes that take a body and need an admin key (ingest, key creation) a tenant key is a 403;
- a body sent with ``Content-Encoding: gzip`` (the engines' pushers compress theirs) is inflated as it is read,
  at most the route's limit once decoded (beyond it a 413, so a zip bomb is never inflated whole); a corrupt or
  truncated gzip stream is a 400 naming zlib's reason; any other encoding, or gzip on a service started with
  ``gzip_bodies=False``, is a 415 with ``Accept-Encoding`` saying what it takes (RFC 7694). The route reads the
  decoded body as if it had been sent plain, so what is stored (and each window's or step's content digest) is
  the same either way.

POST /v1/steps and POST /v1/windows (ingest) may carry ``max_body_bytes`` (an engine's pusher sends many windows at
once after an outage); every other route ``max_small_body_bytes``. The principal found
is handed to the route's key dependency in the ASGI scope.
"""

from __future__ import annotations

import zlib

from fastapi import HTTPException
from fastapi.concurrency import run_in_threadpool
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy.exc import DBAPIError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmvisor.ledger import Ledger
from llmvisor.service.config import ServiceSettings
from llmvisor.service.deps import INGEST_FORBIDDEN_DETAIL, PRINCIPAL_SCOPE_KEY
from llmvisor.service.metrics import ServiceMetrics
from llmvisor.service.responses import database_unavailable, error, unauthorized
from llmvisor.service.routes.keys import KEYS_PATH
from llmvisor.service.routes.models import MODELS_PATH
from llmvisor.service.routes.page import PAGE_PATHS
from llmvisor.service.routes.steps import INGEST_PATH, is_database_outage
from llmvisor.service.routes.windows import WINDOWS_PATH

OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}) | PAGE_PATHS
ADMIN_BODY_ROUTES = {
    ("POST", INGEST_PATH): INGEST_FORBIDDEN_DETAIL,
    ("POST", WINDOWS_PATH): INGEST_FORBIDDEN_DETAIL,
    ("POST", KEYS_PATH): "this needs an admin key",
    ("POST", MODELS_PATH): "this needs an admin key",
}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body without a declared length passes the limit: FastAPI passes an
    HTTPException raised while it reads a body on unchanged, so the answer is this 413."""

    def __init__(self, limit_bytes: int, *, decoded: bool = False):
        what = "request body that decodes to" if decoded else "request body of"
        super().__init__(413, f"{what} more than {limit_bytes} bytes; at most {limit_bytes}")


GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})
INLINE_GZIP_BYTES = 16 << 10
"""A gzip chunk this small (a live window's POST is one) is inflated on the event loop; a larger one in a worker thread."""


class BadGzip(HTTPException):
    """Raised from ``receive`` when a gzip body cannot be inflated: corrupt, truncated, not gzip at all."""

    def __init__(self, reason: str):
        super().__init__(400, f"request body (Content-Encoding: gzip): {reason}")


class GzipReader:
    """Inflate a gzip body chunk by chunk, refusing (`BodyTooLarge`) as soon as it decodes to more than
    ``limit_bytes``: zlib is asked for at most one byte past what is left, so a bomb costs the limit, not its size.
    Several gzip members one after another (RFC 1952) are one body."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.decoded_bytes = 0
        self._inflater = zlib.decompressobj(wbits=31)  # 16 + 15: a gzip header and trailer, the largest window

    def feed(self, chunk: bytes, *, last: bool) -> bytes:
        out = []
        try:
            while chunk:
                if self._inflater.eof:  # another member follows
                    self._inflater = zlib.decompressobj(wbits=31)
                piece = self._inflater.decompress(chunk, self.limit_bytes - self.decoded_bytes + 1)
                self.decoded_bytes += len(piece)
                if self.decoded_bytes > self.limit_bytes:
                    raise BodyTooLarge(self.limit_bytes, decoded=True)
                out.append(piece)
                chunk = self._inflater.unused_data if self._inflater.eof else self._inflater.unconsumed_tail
        except zlib.error as bad:
            raise BadGzip(f"not a valid gzip stream ({bad})") from None
        if last and not self._inflater.eof:
            raise BadGzip("the gzip stream is truncated (the body ends before its end)")
        return b"".join(out)


def body_encoding(headers: Headers) -> str | None:
    """``"gzip"``, ``""`` (identity: no Content-Encoding, or only ``identity``), or None: an encoding not read here."""
    codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return ""
    return "gzip" if len(codings) == 1 and codings[0] in GZIP_ENCODINGS else None


class RequestGuard:
    def __init__(self, app: ASGIApp, *, ledger: Ledger, metrics: ServiceMetrics, settings: ServiceSettings):
        self.app = app
        self.ledger = ledger
        self.metrics = metrics
        self.settings = settings

    def needs_key(self, path: str) -> bool:
        if path == "/metrics":
            return not self.settings.public_metrics
        return path not in OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        is_ingest = method == "POST" and path in (INGEST_PATH, WINDOWS_PATH)
        limit_bytes = self.settings.max_body_bytes if is_ingest else self.settings.max_small_body_bytes

        def refuse(reason: str, response) -> ASGIApp:
            if is_ingest:
                self.metrics.count_ingest_error(reason)
            return response

        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await refuse("bad_json", error(400, "Content-Length is not a number"))(scope, receive, send)
                return
            if int(declared) > limit_bytes:
                detail = f"request body of {declared} bytes, at most {limit_bytes}"
                await refuse("too_large", error(413, detail))(scope, receive, send)
                return
        if self.needs_key(path):
            scheme, credentials = get_authorization_scheme_param(headers.get("authorization"))
            principal = None
            if scheme.lower() == "bearer" and credentials:
                try:
                    principal = await run_in_threadpool(self.ledger.authenticate, credentials)
                except DBAPIError as database_error:
                    if not is_database_outage(database_error):
                        raise
                    await refuse("database", database_unavailable())(scope, receive, send)
                    return
            if principal is None:
                await refuse("unauthorized", unauthorized())(scope, receive, send)
                return
            forbidden = ADMIN_BODY_ROUTES.get((method, path))
            if forbidden is not None and not principal.is_admin:
                await refuse("forbidden", error(403, forbidden))(scope, receive, send)
                return
            scope[PRINCIPAL_SCOPE_KEY] = principal
        encoding = body_encoding(headers)
        if encoding is None or (encoding == "gzip" and not self.settings.gzip_bodies):
            accepted = "gzip, identity" if self.settings.gzip_bodies else "identity"
            detail = f"Content-Encoding {headers.get('content-encoding')!r} is not accepted here; send {accepted}"
            await refuse("bad_encoding", error(415, detail, headers={"Accept-Encoding": accepted}))(scope, receive, send)
            return
        gzip_reader = GzipReader(limit_bytes) if encoding == "gzip" else None
        if gzip_reader is not None:  # the route sees the decoded body, as if it had been sent plain
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")])

        received_bytes = 0

        async def limited_receive() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > limit_bytes:
                    refuse("too_large", None)
                    raise BodyTooLarge(limit_bytes)
                if gzip_reader is not None:
                    chunk, last = message.get("body", b""), not message.get("more_body", False)
                    try:
                        if len(chunk) <= INLINE_GZIP_BYTES:
                            decoded = gzip_reader.feed(chunk, last=last)
                        else:  # up to the limit decoded: not on the event loop (zlib lets go of the GIL meanwhile)
                            decoded = await run_in_threadpool(gzip_reader.feed, chunk, last=last)
                    except BodyTooLarge:
                        refuse("too_large", None)
                        raise
                    except BadGzip:
                        refuse("bad_gzip", None)
                        raise
                    message = dict(message, body=decoded)
            return message

        await self.app(scope, limited_receive, send)
