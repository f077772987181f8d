"""``/metrics`` (Prometheus) and ``/healthz`` (liveness and database reachability)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmvisor.service.deps import LedgerDep, MetricsAccess, MetricsDep
from llmvisor.service.responses import database_unavailable

router = APIRouter(tags=["operations"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def prometheus_metrics(_access: MetricsAccess, metrics: MetricsDep):
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="Liveness and database reachability", responses={503: {"description": "database unavailable"}})
def healthz(ledger: LedgerDep):
    if not ledger.ping():
        return database_unavailable()
    return {"status": "ok"}
