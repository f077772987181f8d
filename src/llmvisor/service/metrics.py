"""Prometheus metrics of one service process, in a registry of its own (so apps in one process don't mix).

Counters restart at zero with the process, as Prometheus expects; the ledger, not the metrics, is the
record. Each tenant named is a Prometheus series, so the tenants named are capped (``max_tenant_labels``):
tenants first seen after the cap are counted under ``tenant="other"``, and how many were is exported. The residual histograms are filled a whole batch at a time with numpy, since a batch holds
thousands of steps and `Histogram.observe` costs a Python call per value.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("llmvisor.service")

OTHER_TENANT_LABEL = "other"
RUN_RESIDUAL_QUANTILES = (0.1, 0.5, 0.9)
MAX_RUNS_WITH_RESIDUALS = 20
RUN_RESIDUAL_WINDOW_STEPS = 2000
MAX_RUNS_REMEMBERED = 10_000
INGEST_ERROR_REASONS = ("unauthorized", "forbidden", "too_large", "bad_json", "bad_parquet", "bad_shape", "invalid_trace", "conflict", "database")
_RESIDUAL_BOUNDS_S = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
RESIDUAL_BUCKETS_S = tuple(sorted(-b for b in _RESIDUAL_BOUNDS_S)) + (0.0,) + _RESIDUAL_BOUNDS_S
RELATIVE_RESIDUAL_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, -0.01, 0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class BatchHistogram(Collector):
    """A histogram observed many values at a time; exported like a `prometheus_client.Histogram`."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self._counts = np.zeros(self.bounds.size + 1, dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        # side="left": a value equal to a bound falls in that bound's bucket (Prometheus "le").
        counts = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=self.bounds.size + 1)
        with self._lock:
            self._counts += counts
            self._sum += float(values.sum())

    def collect(self):
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        buckets = [(repr(float(b)), c) for b, c in zip(self.bounds.tolist(), cumulative[:-1])]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


class BatchSummary(Collector):
    """Count and sum of values observed many at a time (a Prometheus summary without quantiles)."""

    def __init__(self, name: str, documentation: str):
        self.name = name
        self.documentation = documentation
        self._count = 0
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        with self._lock:
            self._count += int(values.size)
            self._sum += float(values.sum())

    def collect(self):
        with self._lock:
            yield SummaryMetricFamily(self.name, self.documentation, count_value=self._count, sum_value=self._sum)


class RunResidualWindows(Collector):
    """Quantiles of the relative residual (measured − predicted) / measured over each run's latest steps.

    Bounded cardinality: the ``max_runs`` runs that ingested steps most recently are exported, each over its
    last ``window_steps`` steps; an older run's series disappears when a newer run takes its place."""

    def __init__(self, *, max_runs: int = MAX_RUNS_WITH_RESIDUALS, window_steps: int = RUN_RESIDUAL_WINDOW_STEPS):
        self.max_runs = max_runs
        self.window_steps = window_steps
        self._windows: OrderedDict[str, deque] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, run_ids: np.ndarray, relative_residuals: np.ndarray) -> None:
        runs = np.asarray(run_ids, dtype=object)
        values = np.asarray(relative_residuals, dtype=np.float64)
        finite = np.isfinite(values)
        with self._lock:
            for run in dict.fromkeys(runs[finite].tolist()):
                window = self._windows.pop(run, None) or deque(maxlen=self.window_steps)
                window.extend(values[finite & (runs == run)].tolist())
                self._windows[run] = window
            while len(self._windows) > self.max_runs:
                self._windows.popitem(last=False)

    def quantiles(self, run_id: str) -> dict[float, float]:
        with self._lock:
            window = list(self._windows.get(run_id, ()))
        if not window:
            return {}
        return dict(zip(RUN_RESIDUAL_QUANTILES, np.quantile(window, RUN_RESIDUAL_QUANTILES).tolist()))

    def collect(self):
        with self._lock:
            windows = {run: np.asarray(window) for run, window in self._windows.items()}
        residual = GaugeMetricFamily(
            "llmvisor_run_relative_residual",
            f"Quantiles of (measured - predicted) / measured step time over each run's last {self.window_steps} steps "
            f"(the {self.max_runs} runs ingested most recently).",
            labels=["run_id", "quantile"],
        )
        steps = GaugeMetricFamily(
            "llmvisor_run_relative_residual_window_steps", "Steps in each run's residual window.", labels=["run_id"]
        )
        for run, values in windows.items():
            for q, value in zip(RUN_RESIDUAL_QUANTILES, np.quantile(values, RUN_RESIDUAL_QUANTILES).tolist()):
                residual.add_metric([run, repr(q)], value)
            steps.add_metric([run], float(values.size))
        yield residual
        yield steps


class ServiceMetrics:
    def __init__(self, *, max_tenant_labels: int = 1000):
        self.max_tenant_labels = max_tenant_labels
        self._tenants_labelled: set[str] = set()
        self._tenants_folded: set[str] = set()
        self._tenant_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.attributed_seconds = Counter(
            "llmvisor_attributed_seconds", "Engine seconds attributed to each tenant (steps ingested by this process).",
            ["tenant"], registry=self.registry,
        )
        self.measured_seconds = Counter(
            "llmvisor_measured_seconds", "Measured engine seconds of the steps ingested (equals the sum over tenants).",
            registry=self.registry,
        )
        self.tenants_folded = Gauge(
            "llmvisor_tenants_folded",
            f'Distinct tenants counted under tenant="{OTHER_TENANT_LABEL}" in llmvisor_attributed_seconds_total '
            "because the number of tenants named had reached its cap.",
            registry=self.registry,
        )
        self.steps_ingested = Counter("llmvisor_steps_ingested", "Steps stored.", registry=self.registry)
        self.steps_duplicate = Counter(
            "llmvisor_steps_duplicate", "Steps re-sent identically, acknowledged and not stored again.", registry=self.registry
        )
        self.slices_ingested = Counter("llmvisor_slices_ingested", "Request slices stored.", registry=self.registry)
        self.ingest_errors = Counter(
            "llmvisor_ingest_errors", "Rejected POST /v1/steps requests, by reason.", ["reason"], registry=self.registry
        )
        for reason in INGEST_ERROR_REASONS:
            self.ingest_errors.labels(reason)
        self.ingest_batch_seconds = Histogram(
            "llmvisor_ingest_batch_seconds", "Time to validate, attribute and store one POST /v1/steps batch.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=self.registry,
        )
        # Signed residuals: the summaries give the bias (sum / count) and the mean absolute relative error
        # (the accuracy figure the project reports); the histograms the spread. A histogram with negative
        # buckets has no _sum/_count in the exposition format, hence the separate summaries.
        self.residual_seconds = BatchSummary(
            "llmvisor_model_residual_seconds",
            "Measured minus predicted step time of ingested steps; a drifting model shows here.",
        )
        self.abs_relative_residual = BatchSummary(
            "llmvisor_model_abs_relative_residual",
            "|measured - predicted| / measured step time of ingested steps (sum / count: mean absolute relative error).",
        )
        self.residual_distribution = BatchHistogram(
            "llmvisor_model_residual_distribution_seconds",
            "Measured minus predicted step time of ingested steps.",
            RESIDUAL_BUCKETS_S,
        )
        self.relative_residual_distribution = BatchHistogram(
            "llmvisor_model_relative_residual_distribution",
            "(measured - predicted) / predicted step time of ingested steps.",
            RELATIVE_RESIDUAL_BUCKETS,
        )
        self.fingerprint_mismatch_steps = Counter(
            "llmvisor_fingerprint_mismatch_steps",
            "Steps attributed with a latency model fitted on an engine of another fingerprint (calibrate: llmvisor calibrate).",
            registry=self.registry,
        )
        self.fingerprint_mismatch_runs = Gauge(
            "llmvisor_fingerprint_mismatch_runs", "Runs whose steps were attributed with a model of another engine fingerprint.",
            registry=self.registry,
        )
        self.fingerprint_unknown_steps = Counter(
            "llmvisor_fingerprint_unknown_steps",
            "Steps attributed without a fingerprint check: the step or the model carries no engine fingerprint.",
            registry=self.registry,
        )
        self.run_residuals = RunResidualWindows()
        self._mismatched_runs: OrderedDict[str, None] = OrderedDict()
        self._mismatch_lock = threading.Lock()
        self._n_mismatched_runs = 0
        for collector in (self.residual_seconds, self.abs_relative_residual, self.residual_distribution,
                          self.relative_residual_distribution, self.run_residuals):
            self.registry.register(collector)

    def count_ingest_error(self, reason: str) -> None:
        """One rejected POST /v1/steps request (whatever the number of steps in it), by reason."""
        if reason not in INGEST_ERROR_REASONS:
            raise ValueError(f"unknown ingest error reason {reason!r}")
        self.ingest_errors.labels(reason).inc()

    def tenant_label(self, tenant: str) -> str:
        """The tenant's own label while fewer than ``max_tenant_labels`` tenants are named, else "other"."""
        with self._tenant_lock:
            if tenant in self._tenants_labelled:
                return tenant
            if len(self._tenants_labelled) < self.max_tenant_labels:
                self._tenants_labelled.add(tenant)
                return tenant
            if tenant not in self._tenants_folded:
                self._tenants_folded.add(tenant)
                self.tenants_folded.set(len(self._tenants_folded))
            return OTHER_TENANT_LABEL

    def record_ingest(
        self,
        tenants: np.ndarray,
        attributed_ns: np.ndarray,
        measured_ns: np.ndarray,
        residual_s: np.ndarray,
        predicted_s: np.ndarray,
        n_steps: int,
        n_duplicate: int,
    ) -> None:
        """Count the newly stored part of a batch (tenants/attributed_ns: its slices; the rest: its steps)."""
        if len(tenants):
            encoded = pc.dictionary_encode(pa.array(tenants, pa.string()))
            names = encoded.dictionary.to_pylist()
            codes = encoded.indices.to_numpy(zero_copy_only=False)
            per_tenant_ns = np.bincount(codes, weights=attributed_ns, minlength=len(names))
            for name, total_ns in zip(names, per_tenant_ns.tolist()):
                self.attributed_seconds.labels(self.tenant_label(name)).inc(total_ns / 1e9)
        self.measured_seconds.inc(float(np.sum(measured_ns)) / 1e9)
        self.steps_ingested.inc(n_steps)
        self.steps_duplicate.inc(n_duplicate)
        self.slices_ingested.inc(len(tenants))
        self.residual_seconds.observe_many(residual_s)
        self.residual_distribution.observe_many(residual_s)
        measured_s = np.asarray(measured_ns, dtype=np.float64) / 1e9
        with np.errstate(divide="ignore", invalid="ignore"):
            self.abs_relative_residual.observe_many(np.abs(residual_s) / measured_s)
            self.relative_residual_distribution.observe_many(residual_s / predicted_s)

    def check_fingerprints(self, run_ids: np.ndarray, step_fingerprint_ids: np.ndarray, model_fingerprint: dict | None) -> int:
        """Count steps whose engine fingerprint differs from the model's; warn once per run. Returns the count."""
        model_id = model_fingerprint.get("id") if isinstance(model_fingerprint, dict) else None
        ids = np.asarray(step_fingerprint_ids, dtype=object)
        known = ids != ""
        if model_id is None:
            self.fingerprint_unknown_steps.inc(int(ids.size))
            return 0
        self.fingerprint_unknown_steps.inc(int((~known).sum()))
        mismatched = known & (ids != model_id)
        n_mismatched = int(mismatched.sum())
        if not n_mismatched:
            return 0
        self.fingerprint_mismatch_steps.inc(n_mismatched)
        runs = np.asarray(run_ids, dtype=object)
        for run, fingerprint in dict.fromkeys(zip(runs[mismatched].tolist(), ids[mismatched].tolist())):
            with self._mismatch_lock:
                if run in self._mismatched_runs:
                    continue
                self._mismatched_runs[run] = None
                if len(self._mismatched_runs) > MAX_RUNS_REMEMBERED:
                    self._mismatched_runs.popitem(last=False)
                self._n_mismatched_runs += 1
                self.fingerprint_mismatch_runs.set(self._n_mismatched_runs)
            log.warning(
                "llmvisor: run %s ran on engine fingerprint %s but is attributed with a model fitted on %s; "
                "its shares follow a cost model of another engine (fit one with `llmvisor calibrate`)",
                run, fingerprint, model_id,
            )
        return n_mismatched
