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
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from llmvisor.metering.prometheus import OTHER_TENANT_LABEL, RELATIVE_RESIDUAL_BUCKETS, TenantLabels

log = logging.getLogger("llmvisor.service")

RUN_RESIDUAL_QUANTILES = (0.1, 0.5, 0.9)
MAX_RUNS_WITH_RESIDUALS = 20
RUN_RESIDUAL_WINDOW_STEPS = 2000
MAX_RUNS_REMEMBERED = 10_000
MAX_CLASSES_WITH_RESIDUALS = 100
INGEST_ERROR_REASONS = ("unauthorized", "forbidden", "too_large", "bad_encoding", "bad_gzip", "bad_json", "bad_parquet", "bad_shape", "invalid_trace", "conflict", "duplicate_run", "database")
_RESIDUAL_BOUNDS_S = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
RESIDUAL_BUCKETS_S = tuple(sorted(-b for b in _RESIDUAL_BOUNDS_S)) + (0.0,) + _RESIDUAL_BOUNDS_S


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


class ResidualWindows(Collector):
    """Quantiles of the relative residual (measured − predicted) / measured over the latest steps of each key
    (a run, or an engine class).

    Bounded cardinality: the ``max_keys`` keys that ingested steps most recently are exported, each over its
    last ``window_steps`` steps; an older key's series disappears when a newer one takes its place."""

    metric = "llmvisor_run_relative_residual"
    label = "run_id"
    what = "run"

    def __init__(self, *, max_keys: int = MAX_RUNS_WITH_RESIDUALS, window_steps: int = RUN_RESIDUAL_WINDOW_STEPS):
        self.max_keys = max_keys
        self.window_steps = window_steps
        self._windows: OrderedDict[str, deque] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, keys: np.ndarray, relative_residuals: np.ndarray) -> dict[str, int]:
        """Add each key's values to its window; returns the number of values each key received."""
        keys = np.asarray(keys, dtype=object)
        values = np.asarray(relative_residuals, dtype=np.float64)
        finite = np.isfinite(values)
        received = {}
        with self._lock:
            for key in dict.fromkeys(keys[finite].tolist()):
                window = self._windows.pop(key, None) or deque(maxlen=self.window_steps)
                new = values[finite & (keys == key)]
                window.extend(new.tolist())
                self._windows[key] = window
                received[key] = int(new.size)
                self.observed(key, window, int(new.size))
            while len(self._windows) > self.max_keys:
                self.forget(self._windows.popitem(last=False)[0])
        return received

    def observed(self, key: str, window: deque, n_new: int) -> None:
        """Called under the lock after ``n_new`` values joined ``key``'s window."""

    def forget(self, key: str) -> None:
        """Called under the lock when ``key``'s window is dropped."""

    def reset(self, key: str) -> None:
        with self._lock:
            if self._windows.pop(key, None) is not None:
                self.forget(key)

    def values(self, key: str) -> np.ndarray:
        with self._lock:
            return np.asarray(list(self._windows.get(key, ())), dtype=np.float64)

    def quantiles(self, key: str) -> dict[float, float]:
        window = self.values(key)
        if not window.size:
            return {}
        return dict(zip(RUN_RESIDUAL_QUANTILES, np.quantile(window, RUN_RESIDUAL_QUANTILES).tolist()))

    def collect(self):
        with self._lock:
            windows = {key: np.asarray(window) for key, window in self._windows.items()}
        residual = GaugeMetricFamily(
            self.metric,
            f"Quantiles of (measured - predicted) / measured step time over each {self.what}'s last {self.window_steps} "
            f"steps (the {self.max_keys} {self.what}s that ingested most recently).",
            labels=[self.label, "quantile"],
        )
        steps = GaugeMetricFamily(f"{self.metric}_window_steps", f"Steps in each {self.what}'s residual window.", labels=[self.label])
        for key, values in windows.items():
            for q, value in zip(RUN_RESIDUAL_QUANTILES, np.quantile(values, RUN_RESIDUAL_QUANTILES).tolist()):
                residual.add_metric([key, repr(q)], value)
            steps.add_metric([key], float(values.size))
        yield residual
        yield steps
        yield from self.collect_more(windows)

    def collect_more(self, windows: dict[str, np.ndarray]):
        return iter(())


class RunResidualWindows(ResidualWindows):
    """Per run (the ``max_runs`` runs that ingested most recently)."""

    def __init__(self, *, max_runs: int = MAX_RUNS_WITH_RESIDUALS, window_steps: int = RUN_RESIDUAL_WINDOW_STEPS):
        super().__init__(max_keys=max_runs, window_steps=window_steps)


@dataclass(frozen=True)
class DriftSettings:
    """When a class's model is said to drift: the median signed relative residual of its last
    ``window_steps`` steps (once at least ``min_window_steps``) lies outside ``±band`` for ``alarm_after_steps``
    consecutive steps."""

    band: float = 0.10
    window_steps: int = 2000
    min_window_steps: int = 200
    alarm_after_steps: int = 500


class ClassDrift(ResidualWindows):
    """Per engine class: signed and absolute residual quantiles and the drift alarm (`DriftSettings`)."""

    metric = "llmvisor_class_relative_residual"
    label = "engine_class"
    what = "engine class"

    def __init__(self, settings: DriftSettings | None = None, *, max_classes: int = MAX_CLASSES_WITH_RESIDUALS):
        settings = settings or DriftSettings()
        super().__init__(max_keys=max_classes, window_steps=settings.window_steps)
        self.settings = settings
        self._out_of_band: dict[str, int] = {}
        self._median: dict[str, float] = {}

    def observed(self, key: str, window: deque, n_new: int) -> None:
        if len(window) < self.settings.min_window_steps:
            self._out_of_band[key] = 0
            self._median.pop(key, None)
            return
        median = float(np.median(np.fromiter(window, dtype=np.float64, count=len(window))))
        self._median[key] = median
        self._out_of_band[key] = self._out_of_band.get(key, 0) + n_new if abs(median) > self.settings.band else 0

    def forget(self, key: str) -> None:
        self._out_of_band.pop(key, None)
        self._median.pop(key, None)

    def state(self, key: str) -> dict:
        """The class's window, quantiles and alarm, as the API reports it."""
        window = self.values(key)
        with self._lock:
            out_of_band = self._out_of_band.get(key, 0)
            median = self._median.get(key)
        signed = np.quantile(window, RUN_RESIDUAL_QUANTILES).tolist() if window.size else []
        absolute = np.quantile(np.abs(window), RUN_RESIDUAL_QUANTILES).tolist() if window.size else []
        return {
            "engine_class": key,
            "window_steps": int(window.size),
            "relative_residual": dict(zip(map(str, RUN_RESIDUAL_QUANTILES), signed)),
            "abs_relative_residual": dict(zip(map(str, RUN_RESIDUAL_QUANTILES), absolute)),
            "median_relative_residual": median,
            "out_of_band_steps": out_of_band,
            "alarm": out_of_band >= self.settings.alarm_after_steps,
        }

    def classes(self) -> list[str]:
        with self._lock:
            return list(self._windows)

    def collect_more(self, windows: dict[str, np.ndarray]):
        absolute = GaugeMetricFamily(
            "llmvisor_class_abs_relative_residual",
            f"Quantiles of |measured - predicted| / measured step time over each engine class's last {self.window_steps} steps.",
            labels=[self.label, "quantile"],
        )
        alarm = GaugeMetricFamily(
            "llmvisor_class_drift_alarm",
            f"1 while the median signed relative residual of the class has been outside +-{self.settings.band:g} for "
            f"{self.settings.alarm_after_steps} steps or more (its model drifts: refit it).",
            labels=[self.label],
        )
        out = GaugeMetricFamily(
            "llmvisor_class_drift_out_of_band_steps",
            "Steps ingested since the class's median signed relative residual left the band (0 inside it).",
            labels=[self.label],
        )
        with self._lock:
            out_of_band = dict(self._out_of_band)
        for key, values in windows.items():
            for q, value in zip(RUN_RESIDUAL_QUANTILES, np.quantile(np.abs(values), RUN_RESIDUAL_QUANTILES).tolist()):
                absolute.add_metric([key, repr(q)], value)
            n = out_of_band.get(key, 0)
            alarm.add_metric([key], float(n >= self.settings.alarm_after_steps))
            out.add_metric([key], float(n))
        yield absolute
        yield alarm
        yield out


def kv_gib_seconds_of(records, slices: np.ndarray) -> np.ndarray | None:
    """Per selected slice of a `llmvisor.ledger.records.StepRecords`, its KV GiB-seconds (block-ns × block bytes);
    None for a batch not metered (trace format 1 or 2)."""
    kv = records.kv_columns
    if not kv:
        return None
    block_ns = np.asarray(kv["kv_block_ns"], dtype=np.float64)[slices]
    return block_ns * np.asarray(kv["kv_block_bytes"], dtype=np.float64)[slices] / 2**30 / 1e9


class ServiceMetrics:
    def __init__(self, *, max_tenant_labels: int = 1000, drift: DriftSettings | None = None):
        self.max_tenant_labels = max_tenant_labels
        self._tenant_labels = TenantLabels(max_tenant_labels)
        self.registry = CollectorRegistry(auto_describe=True)
        self.attributed_seconds = Counter(
            "llmvisor_attributed_seconds", "Engine seconds attributed to each tenant (steps ingested by this process).",
            ["tenant"], registry=self.registry,
        )
        self.kv_gib_seconds = Counter(
            "llmvisor_kv_gib_seconds", "KV cache GiB-seconds held by each tenant's requests (trace format 3 steps and "
            "window format 2 aggregates stored by this process; GiB = 2^30 bytes).", ["tenant"], registry=self.registry,
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
        self.class_drift = ClassDrift(drift)
        self.pending_steps = Counter(
            "llmvisor_pending_steps", "Steps stored pending: their engine class had no active model.", registry=self.registry
        )
        self.pending_measured_seconds = Counter(
            "llmvisor_pending_measured_seconds", "Measured seconds of the steps stored pending.", registry=self.registry
        )
        self.pending_attributed_steps = Counter(
            "llmvisor_pending_attributed_steps",
            "Pending steps this process attributed once their class had a model (their seconds then join the tenants').",
            registry=self.registry,
        )
        self.windows_ingested = Counter("llmvisor_windows_ingested", "Window aggregates stored (POST /v1/windows).", registry=self.registry)
        self.window_steps_ingested = Counter(
            "llmvisor_window_steps_ingested", "Steps covered by the window aggregates stored.", registry=self.registry
        )
        self._mismatched_runs: OrderedDict[str, None] = OrderedDict()
        self._mismatch_lock = threading.Lock()
        self._n_mismatched_runs = 0
        for collector in (self.residual_seconds, self.abs_relative_residual, self.residual_distribution,
                          self.relative_residual_distribution, self.run_residuals, self.class_drift):
            self.registry.register(collector)

    def count_ingest_error(self, reason: str) -> None:
        """One rejected POST /v1/steps request (whatever the number of steps in it), by reason."""
        if reason not in INGEST_ERROR_REASONS:
            raise ValueError(f"unknown ingest error reason {reason!r}")
        self.ingest_errors.labels(reason).inc()

    def tenant_label(self, tenant: str) -> str:
        """The tenant's own label while fewer than ``max_tenant_labels`` tenants are named, else "other"."""
        label = self._tenant_labels(tenant)
        if label == OTHER_TENANT_LABEL:
            self.tenants_folded.set(self._tenant_labels.folded)
        return label

    def record_ingest(
        self,
        tenants: np.ndarray,
        attributed_ns: np.ndarray,
        measured_ns: np.ndarray,
        residual_s: np.ndarray,
        predicted_s: np.ndarray,
        n_steps: int,
        n_duplicate: int,
        kv_gib_s: np.ndarray | None = None,
    ) -> None:
        """Count the newly stored part of a batch (tenants/attributed_ns: its slices, and their KV GiB-seconds when
        metered; the rest: its steps)."""
        if len(tenants):
            encoded = pc.dictionary_encode(pa.array(tenants, pa.string()))
            names = encoded.dictionary.to_pylist()
            codes = encoded.indices.to_numpy(zero_copy_only=False)
            per_tenant_ns = np.bincount(codes, weights=attributed_ns, minlength=len(names))
            for name, total_ns in zip(names, per_tenant_ns.tolist()):
                self.attributed_seconds.labels(self.tenant_label(name)).inc(total_ns / 1e9)
            if kv_gib_s is not None:
                per_tenant_gib_s = np.bincount(codes, weights=kv_gib_s, minlength=len(names))
                for name, total in zip(names, per_tenant_gib_s.tolist()):
                    self.kv_gib_seconds.labels(self.tenant_label(name)).inc(total)
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

    def record_windows(self, windows) -> None:
        """Count window aggregates (`llmvisor.metering.WindowAggregate`) newly stored: their tenants' attributed
        seconds and their measured seconds, as `record_ingest` counts steps; a pending window's measured seconds
        and steps as pending."""
        for window in windows:
            for tenant, totals in window.tenant_totals().items():
                self.attributed_seconds.labels(self.tenant_label(tenant)).inc(totals["attributed_ns"] / 1e9)
            if window.kv is not None:
                for tenant, block_ns in window.tenant_kv_block_ns().items():
                    self.kv_gib_seconds.labels(self.tenant_label(tenant)).inc(block_ns * window.kv.block_bytes / 2**30 / 1e9)
            if window.pending:
                self.pending_steps.inc(window.num_steps)
                self.pending_measured_seconds.inc(window.measured_ns / 1e9)
            else:
                self.measured_seconds.inc(window.measured_ns / 1e9)
            self.windows_ingested.inc()
            self.window_steps_ingested.inc(window.num_steps)

    def record_attributed_pending(self, prepared, resolved: np.ndarray, engine_class: str) -> None:
        """Count pending steps this process attributed: their seconds join the tenants' and the measured total,
        their residuals the class's window."""
        records = prepared.records
        slices = np.repeat(resolved, np.diff(records.step_offsets))
        self.record_ingest(
            records.tenant[slices], records.attributed_ns[slices], records.measured_ns[resolved], prepared.residual_s[resolved],
            prepared.predicted_step_s[resolved], 0, 0, kv_gib_seconds_of(records, slices),
        )
        self.pending_attributed_steps.inc(int(resolved.sum()))
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = prepared.residual_s[resolved] / records.step_latency_s[resolved]
        self.class_drift.observe(np.full(relative.size, engine_class, dtype=object), relative)

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
