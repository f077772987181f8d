"""Dependencies of the routes (`Annotated` types to declare as parameters) and the checks they share.

The service's state lives on ``app.state`` (`create_app` puts it there): the ledger, the latency model, the
model registry, the metrics and the settings. Keys are checked by `RequestGuard` before the body is read; the principal it found
is passed on in the ASGI scope, so a route's key dependency costs no second database lookup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger, Principal
from llmvisor.ledger.schema import USAGE_RESOLUTION_US
from llmvisor.service.config import ServiceSettings
from llmvisor.service.ingest import MAX_STRING_CHARS, MAX_TIMESTAMP_S
from llmvisor.service.metrics import ServiceMetrics
from llmvisor.service.registry import ModelRegistry
from llmvisor.service.responses import unauthorized_error

PRINCIPAL_SCOPE_KEY = "llmvisor.principal"

bearer = HTTPBearer(auto_error=False, description="an llmvisor API key (`llmvisor keys create`)")


def get_ledger(request: Request) -> Ledger:
    return request.app.state.ledger


def get_model(request: Request) -> StepLatencyModel:
    return request.app.state.model


def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def get_metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


def get_settings(request: Request) -> ServiceSettings:
    return request.app.state.settings


LedgerDep = Annotated[Ledger, Depends(get_ledger)]
ModelDep = Annotated[StepLatencyModel, Depends(get_model)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
SettingsDep = Annotated[ServiceSettings, Depends(get_settings)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def find_principal(request: Request, credentials: Credentials, ledger: LedgerDep) -> Principal | None:
    """The key's principal: the one the guard found, else looked up (a database error is the app's 503)."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if principal is None and credentials is not None:
        principal = ledger.authenticate(credentials.credentials)
    return principal


MaybePrincipal = Annotated[Principal | None, Depends(find_principal)]


def any_key(principal: MaybePrincipal) -> Principal:
    if principal is None:
        raise unauthorized_error()
    return principal


AnyKey = Annotated[Principal, Depends(any_key)]


def admin_key(principal: AnyKey) -> Principal:
    if not principal.is_admin:
        raise HTTPException(403, "this needs an admin key")
    return principal


AdminKey = Annotated[Principal, Depends(admin_key)]


INGEST_FORBIDDEN_DETAIL = "ingest needs an admin key"


def ingest_key(principal: MaybePrincipal, metrics: MetricsDep) -> Principal:
    """An admin key, with refusals counted in the ingest error metric."""
    if principal is None:
        metrics.count_ingest_error("unauthorized")
        raise unauthorized_error()
    if not principal.is_admin:
        metrics.count_ingest_error("forbidden")
        raise HTTPException(403, INGEST_FORBIDDEN_DETAIL)
    return principal


IngestKey = Annotated[Principal, Depends(ingest_key)]


def metrics_access(principal: MaybePrincipal, settings: SettingsDep) -> None:
    """/metrics names every tenant and its usage: an admin key, unless the service was started with public metrics."""
    if settings.public_metrics:
        return
    if principal is None:
        raise unauthorized_error()
    if not principal.is_admin:
        raise HTTPException(403, "/metrics names every tenant; it needs an admin key")


MetricsAccess = Annotated[None, Depends(metrics_access)]

# ---------------------------------------------------------------------------------------------------------
# Query parameters


def to_datetime(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1e6, tz=UTC)


def parse_time_us(name: str, value: str | None) -> int | None:
    """A query time as integer µs since the epoch: ISO 8601 (naive means UTC) or Unix seconds."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        # An unescaped "+" in a URL arrives as a space: "...T15:00:00 00:00" means "+00:00".
        candidates = [value] + ([value[::-1].replace(" ", "+", 1)[::-1]] if " " in value.strip() else [])
        for candidate in candidates:
            try:
                moment = datetime.fromisoformat(candidate.strip())
                break
            except ValueError:
                continue
        else:
            raise HTTPException(422, f"{name}: expected an ISO 8601 time or Unix seconds, got {value!r}")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        seconds = moment.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds < MAX_TIMESTAMP_S:
        raise HTTPException(422, f"{name}: {value!r} is out of range (Unix seconds from 0 to {MAX_TIMESTAMP_S:g})")
    return int(round(seconds * 1e6))


@dataclass(frozen=True)
class TimeRange:
    """``[start_us, end_us)`` on the step's start, either end open (None)."""

    start_us: int | None
    end_us: int | None

    @property
    def start(self) -> datetime | None:
        return None if self.start_us is None else to_datetime(self.start_us)

    @property
    def end(self) -> datetime | None:
        return None if self.end_us is None else to_datetime(self.end_us)


def time_range(
    start: Annotated[str | None, Query(description="ISO 8601 time or Unix seconds, a whole second; inclusive")] = None,
    end: Annotated[str | None, Query(description="ISO 8601 time or Unix seconds, a whole second; exclusive")] = None,
) -> TimeRange:
    start_us, end_us = parse_time_us("start", start), parse_time_us("end", end)
    for name, value, us in (("start", start, start_us), ("end", end, end_us)):
        if us is not None and us % USAGE_RESOLUTION_US:
            raise HTTPException(422, f"{name}: usage is kept per second; give a whole second, not {value!r}")
    if start_us is not None and end_us is not None and end_us <= start_us:
        raise HTTPException(422, "end must be after start")
    return TimeRange(start_us, end_us)


TimeRangeDep = Annotated[TimeRange, Depends(time_range)]
NameParam = Annotated[str | None, Query(max_length=MAX_STRING_CHARS)]


def check_name(name: str, value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise HTTPException(422, f"{name}: must not contain NUL characters")
    return value


def scoped_tenant(principal: Principal, tenant: str | None) -> str | None:
    """The tenant a read is limited to: a tenant key reads its own tenant and nothing else."""
    if principal.is_admin:
        return tenant
    if tenant is not None and tenant != principal.tenant:
        raise HTTPException(403, "this key reads its own tenant's usage only")
    return principal.tenant
