"""The error answers shared by the middleware, the dependencies and the routes, each built in one place."""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse

UNAUTHORIZED_DETAIL = "missing or invalid API key (Authorization: Bearer <key>)"
DATABASE_UNAVAILABLE_DETAIL = "database unavailable; retry"


def unauthorized() -> JSONResponse:
    return JSONResponse(status_code=401, content={"detail": UNAUTHORIZED_DETAIL}, headers={"WWW-Authenticate": "Bearer"})


def unauthorized_error() -> HTTPException:
    return HTTPException(401, UNAUTHORIZED_DETAIL, headers={"WWW-Authenticate": "Bearer"})


def database_unavailable() -> JSONResponse:
    """A 503 with Retry-After: the database is down or busy, and the same request will succeed later."""
    return JSONResponse(status_code=503, content={"detail": DATABASE_UNAVAILABLE_DETAIL}, headers={"Retry-After": "1"})


def error(status: int, detail: str, *, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)
