"""Live metrics at the edge: each closed window's numbers as Prometheus counters of the process that closed it.

Why: with window aggregates (``LLMVISOR_STORE_STEPS=0``) the engine side attributes every step, so it can tell
Prometheus what it billed without the accounting service: an engine's own ``/metrics`` then carries per-tenant
attributed seconds and the model's residuals, and Prometheus sums them over the fleet.

`EdgeMetrics.record_window` counts a `WindowAggregate` once, when `WindowAggregator` closes it (its ``on_close``
hook), from the window's own integers (`WindowAggregate.tenant_totals`) and the per-step relative residuals the
aggregation computed: nothing is attributed twice, so a tenant's counter is the sum of the ``attributed_ns`` its
windows carry, in seconds.

How the numbers reach vLLM's ``/metrics``: the window is closed in the recorder's delivery process (or in the
engine-core process, when it delivers by itself), never in the API server process that serves ``/metrics``.
prometheus_client's multiprocess mode joins them: with ``PROMETHEUS_MULTIPROC_DIR`` set, every process writes its
values to memory-mapped files in that directory and vLLM's API server reads all of them
(``prometheus_client.multiprocess.MultiProcessCollector``, `vllm.v1.metrics.prometheus.get_prometheus_registry`).
vLLM sets the directory itself with ``--api-server-count`` > 1; `llmvisor.engines.vllm.openai_server` sets one for
a single API server. Counters of a process that has ended stay in the directory, so totals survive the delivery
process ending after the engine. Without the directory the metrics stay in the closing process (its
``LLMVISOR_DELIVERY_METRICS_PORT`` serves them).

Engine-free: prometheus_client and numpy.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger("llmvisor.metering")

OTHER_TENANT_LABEL = "other"
DEFAULT_MAX_TENANT_LABELS = 1000
PENDING_MODEL_VERSION = "pending"
"""The ``model_version`` label of windows whose class had no active model (nothing attributed)."""
RELATIVE_RESIDUAL_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, -0.01, 0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Buckets of (measured − predicted) / predicted step time, the service's and the engines' alike."""
PREFIX = "llmvisor_engine"


class TenantLabels:
    """Each tenant's own label while fewer than ``max_tenant_labels`` tenants are named, then ``"other"``: one
    Prometheus series per tenant named, so their number is capped. ``folded`` counts the tenants folded."""

    def __init__(self, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS):
        self.max_tenant_labels = max_tenant_labels
        self._labelled: set[str] = set()
        self._folded: set[str] = set()
        self._lock = threading.Lock()

    @property
    def folded(self) -> int:
        return len(self._folded)

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._labelled:
                return tenant
            if len(self._labelled) < self.max_tenant_labels:
                self._labelled.add(tenant)
                return tenant
            self._folded.add(tenant)
            return OTHER_TENANT_LABEL


class EdgeMetrics:
    """The engine-side counters (names under ``llmvisor_engine_``), labelled by engine class and the registry
    version that attributed the window (``"pending"`` for none); the per-tenant ones by tenant too."""

    def __init__(self, registry: CollectorRegistry | None = prometheus_client.REGISTRY, *,
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS):
        self.tenant_label = TenantLabels(max_tenant_labels)
        tenant_labels = ["tenant", "engine_class", "model_version"]
        class_labels = ["engine_class", "model_version"]
        self.attributed_seconds = Counter(
            f"{PREFIX}_attributed_seconds", "Engine seconds attributed to each tenant at the edge (window aggregates closed "
            "by this engine; the windows' attributed_ns in seconds).", tenant_labels, registry=registry,
        )
        self.tenant_measured_seconds = Counter(
            f"{PREFIX}_tenant_measured_seconds", "Per tenant: the measured time of the steps each of its requests ran in "
            "(a step counts once per request of the tenant in it).", tenant_labels, registry=registry,
        )
        self.slices = Counter(
            f"{PREFIX}_slices", "Per tenant: request slices, one per request per step it ran in.", tenant_labels, registry=registry,
        )
        self.new_tokens = Counter(f"{PREFIX}_new_tokens", "Per tenant: tokens run through the engine.", tenant_labels, registry=registry)
        self.steps = Counter(f"{PREFIX}_steps", "Engine steps in the windows closed.", class_labels, registry=registry)
        self.measured_seconds = Counter(
            f"{PREFIX}_measured_seconds", "Measured engine seconds of the steps in the windows closed (equals the sum of "
            "attributed seconds over tenants, except pending windows).", class_labels, registry=registry,
        )
        self.pending_measured_seconds = Counter(
            f"{PREFIX}_pending_measured_seconds", "Measured seconds of the steps in pending windows (their class had no "
            "active model at the edge: nothing attributed).", ["engine_class"], registry=registry,
        )
        self.kv_gib_seconds = Counter(
            f"{PREFIX}_kv_gib_seconds", "KV cache GiB-seconds held by each tenant's requests (window format 2: a block "
            "split equally among the requests referencing it, over wall time; GiB = 2^30 bytes).", tenant_labels,
            registry=registry,
        )
        self.kv_pool_gib_seconds = Counter(
            f"{PREFIX}_kv_pool_gib_seconds", "The KV cache pool over wall time, by state: held (by requests, carried to "
            "a request's next step included), idle_cache (cached, referenced by none: billed to no one), free. The "
            "states add up to the pool's size times the time metered.", ["engine_class", "state"], registry=registry,
        )
        self.windows = Counter(f"{PREFIX}_windows", "Window aggregates closed (each sent to the service once).", class_labels,
                               registry=registry)
        self.relative_residual = Histogram(
            f"{PREFIX}_model_relative_residual_distribution",
            "(measured - predicted) / predicted step time of the steps attributed at the edge.", class_labels,
            buckets=RELATIVE_RESIDUAL_BUCKETS, registry=registry,
        )
        self._broken = False

    def record_window(self, window, relative_residuals: np.ndarray) -> None:
        """Count one closed `llmvisor.metering.WindowAggregate` and its steps' relative residuals. A metrics
        failure (e.g. the multiprocess directory removed under a delivery process that outlived the server) is
        logged once and turns the metrics off; it never stops the window's delivery."""
        if self._broken:
            return
        try:
            self._record(window, relative_residuals)
        except (OSError, ValueError) as problem:
            self._broken = True
            log.warning("llmvisor: engine-side metrics off from window %s of run %s on (%s); the windows still go to the service",
                        window.window_start_us, window.run_id, problem)

    def _record(self, window, relative_residuals: np.ndarray) -> None:
        version = PENDING_MODEL_VERSION if window.model_version is None else str(window.model_version)
        engine_class = window.engine_class
        for tenant, totals in window.tenant_totals().items():
            labels = (self.tenant_label(tenant), engine_class, version)
            self.attributed_seconds.labels(*labels).inc(totals["attributed_ns"] / 1e9)
            self.tenant_measured_seconds.labels(*labels).inc(totals["measured_ns"] / 1e9)
            self.slices.labels(*labels).inc(totals["num_slices"])
            self.new_tokens.labels(*labels).inc(totals["num_new_tokens"])
        kv = window.kv
        if kv is not None:
            gib_s = kv.block_bytes / (1 << 30) / 1e9
            for tenant, block_ns in window.tenant_kv_block_ns().items():
                self.kv_gib_seconds.labels(self.tenant_label(tenant), engine_class, version).inc(block_ns * gib_s)
            held = sum(int(q.kv_block_ns or 0) for q in window.requests) - kv.carried_in_block_ns + kv.carried_out_block_ns
            self.kv_pool_gib_seconds.labels(engine_class, "held").inc(held * gib_s)
            self.kv_pool_gib_seconds.labels(engine_class, "idle_cache").inc(kv.idle_block_ns * gib_s)
            self.kv_pool_gib_seconds.labels(engine_class, "free").inc(kv.free_block_ns * gib_s)
        self.steps.labels(engine_class, version).inc(window.num_steps)
        self.measured_seconds.labels(engine_class, version).inc(window.measured_ns / 1e9)
        if window.pending:
            self.pending_measured_seconds.labels(engine_class).inc(window.measured_ns / 1e9)
        residuals = self.relative_residual.labels(engine_class, version)
        for value in np.asarray(relative_residuals, dtype=np.float64).tolist():
            if value == value and abs(value) != float("inf"):
                residuals.observe(value)
        self.windows.labels(engine_class, version).inc()


_default: EdgeMetrics | None = None
_default_lock = threading.Lock()


def edge_metrics() -> EdgeMetrics:
    """This process's `EdgeMetrics` in prometheus_client's default registry (made on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = EdgeMetrics()
        return _default
