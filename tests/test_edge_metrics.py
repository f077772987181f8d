"""Engine-side window metrics (`llmvisor.metering.prometheus`): the counters are the windows' own integers in
seconds, the residual histogram the windows' steps, and in prometheus_client's multiprocess mode (the way they
reach vLLM's /metrics) the totals of several processes, ended ones included, add up."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from _service_fixtures import model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.metering import WindowAggregator
from llmvisor.metering.prometheus import PENDING_MODEL_VERSION, RELATIVE_RESIDUAL_BUCKETS, EdgeMetrics

T0_S = 1_750_000_000.0
REL_TOL = 1e-12
"""Float rounding only: the counters add each window's integer nanoseconds / 1e9 in float64."""


def relayed_steps(n_steps: int, seed: int, n_tenants: int = 3) -> list[list]:
    """Relayed steps ``[step_id, timestamp_s, latency_s, slices]``: a few requests per step, steps 20 ms apart."""
    rng = np.random.default_rng(seed)
    out = []
    for step_id in range(n_steps):
        slices = []
        for k in range(int(rng.integers(1, 6))):
            prefill = bool(rng.random() < 0.2)
            slices.append([f"req-{seed}-{step_id // 7}-{k}", f"tenant-{(step_id + k) % n_tenants}", int(rng.integers(2, 200)) if prefill else 1,
                           int(rng.integers(0, 2000)), prefill, 0, None])
        out.append([step_id, T0_S + 0.02 * step_id, float(rng.uniform(0.005, 0.05)), slices])
    return out


def run_windows(model, steps, metrics: EdgeMetrics, version: int = 4):
    seen = []

    def on_close(window, relative):
        seen.append((window, relative))
        metrics.record_window(window, relative)

    agg = WindowAggregator("run-a", "class-x", lambda: None if model is None else (model, version), on_close=on_close)
    closed = []
    for step in steps:
        closed += agg.add(*step)
    closed += agg.close()
    assert [w for w, _ in seen] == closed  # every window closed was counted, once
    return seen


def samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def by_tenant(found: dict, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (sample, labels), value in found.items():
        if sample == name:
            out[dict(labels)["tenant"]] += value
    return dict(out)


def test_the_counters_are_the_windows_integers_in_seconds_and_the_histogram_their_steps(model_path):  # noqa: F811
    model = StepLatencyModel.from_json(model_path)
    registry = CollectorRegistry()
    seen = run_windows(model, relayed_steps(400, seed=1), EdgeMetrics(registry))
    found = samples(registry)
    expected = defaultdict(lambda: defaultdict(int))
    for window, _ in seen:
        for tenant, totals in window.tenant_totals().items():
            for key, value in totals.items():
                expected[tenant][key] += value
    assert len(seen) > 3 and len(expected) == 3
    attributed = by_tenant(found, "llmvisor_engine_attributed_seconds_total")
    measured = by_tenant(found, "llmvisor_engine_tenant_measured_seconds_total")
    for tenant, totals in expected.items():
        assert math.isclose(attributed[tenant], totals["attributed_ns"] / 1e9, rel_tol=REL_TOL)
        assert math.isclose(measured[tenant], totals["measured_ns"] / 1e9, rel_tol=REL_TOL)
    assert by_tenant(found, "llmvisor_engine_slices_total") == {t: float(v["num_slices"]) for t, v in expected.items()}
    assert by_tenant(found, "llmvisor_engine_new_tokens_total") == {t: float(v["num_new_tokens"]) for t, v in expected.items()}
    labels = (("engine_class", "class-x"), ("model_version", "4"))
    assert found["llmvisor_engine_steps_total", labels] == 400
    assert found["llmvisor_engine_windows_total", labels] == len(seen)
    assert math.isclose(found["llmvisor_engine_measured_seconds_total", labels], sum(w.measured_ns for w, _ in seen) / 1e9, rel_tol=REL_TOL)
    # Σ attributed over tenants = Σ measured steps (the windows reconcile), within float rounding
    assert math.isclose(sum(attributed.values()), found["llmvisor_engine_measured_seconds_total", labels], rel_tol=REL_TOL)
    # the histogram holds each step's relative residual, the same values the windows' residual statistics summarise
    relative = np.concatenate([r for _, r in seen])
    assert relative.size == 400 == sum(w.residual.count for w, _ in seen)
    for bound in RELATIVE_RESIDUAL_BUCKETS:
        key = ("llmvisor_engine_model_relative_residual_distribution_bucket", tuple(sorted((*labels, ("le", repr(float(bound)))))))
        assert found[key] == int((relative <= bound).sum()), bound
    # the window's residual sum (measured − predicted, s) is the relative residuals times the predictions
    window, rel = seen[0]
    steps = relayed_steps(400, seed=1)[: window.num_steps]
    latency = np.array([s[2] for s in steps])
    predicted = latency / (1.0 + rel)
    assert math.isclose(float((latency - predicted).sum()), window.residual.sum_s, rel_tol=1e-9, abs_tol=1e-12)


def test_pending_windows_count_measured_time_under_pending_and_attribute_nothing():
    registry = CollectorRegistry()
    seen = run_windows(None, relayed_steps(100, seed=2), EdgeMetrics(registry))
    found = samples(registry)
    assert all(window.pending for window, _ in seen)
    assert set(by_tenant(found, "llmvisor_engine_attributed_seconds_total").values()) == {0.0}
    assert sum(by_tenant(found, "llmvisor_engine_tenant_measured_seconds_total").values()) > 0
    assert found["llmvisor_engine_steps_total", (("engine_class", "class-x"), ("model_version", PENDING_MODEL_VERSION))] == 100
    assert not [k for k in found if k[0].startswith("llmvisor_engine_model_relative_residual") and k[0].endswith("_count") and found[k]]


def test_tenants_past_the_cap_are_counted_under_other(model_path):  # noqa: F811
    model = StepLatencyModel.from_json(model_path)
    registry = CollectorRegistry()
    seen = run_windows(model, relayed_steps(200, seed=3, n_tenants=6), EdgeMetrics(registry, max_tenant_labels=2))
    attributed = by_tenant(samples(registry), "llmvisor_engine_attributed_seconds_total")
    assert len(attributed) == 3 and "other" in attributed
    total_ns = sum(t["attributed_ns"] for w, _ in seen for t in w.tenant_totals().values())
    assert math.isclose(sum(attributed.values()), total_ns / 1e9, rel_tol=REL_TOL)


CHILD = """
import json, sys
from llmvisor.core.model import StepLatencyModel
from llmvisor.metering import WindowAggregator
from llmvisor.metering.prometheus import edge_metrics
from test_edge_metrics import relayed_steps
model = StepLatencyModel.from_json(sys.argv[1])
agg = WindowAggregator(sys.argv[2], "class-x", lambda: (model, 1), on_close=edge_metrics().record_window)
windows = []
for step in relayed_steps(300, seed=int(sys.argv[3])):
    windows += agg.add(*step)
windows += agg.close()
totals = {}
for w in windows:
    for tenant, t in w.tenant_totals().items():
        totals[tenant] = totals.get(tenant, 0) + t["attributed_ns"]
print(json.dumps({"attributed_ns": totals, "windows": len(windows)}))
"""


def test_several_processes_add_up_in_multiprocess_mode_after_they_end(model_path, tmp_path):  # noqa: F811
    """Two processes (a delivery process and its replacement, say) count windows into one PROMETHEUS_MULTIPROC_DIR
    and exit; a collector over the directory, as vLLM's API server runs it, sees the sum of both."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder),
           "PYTHONPATH": os.pathsep.join([os.path.abspath("src"), os.path.abspath("tests"), os.environ.get("PYTHONPATH", "")])}
    expected: dict[str, int] = defaultdict(int)
    n_windows = 0
    for k, seed in enumerate((11, 12)):
        done = subprocess.run([sys.executable, "-c", CHILD, str(model_path), f"run-{k}", str(seed)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.splitlines()[-1])
        n_windows += result["windows"]
        for tenant, ns in result["attributed_ns"].items():
            expected[tenant] += ns
    assert sorted(p.name.split("_")[0] for p in folder.glob("*.db")).count("counter") == 2
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    found = samples(registry)
    attributed = by_tenant(found, "llmvisor_engine_attributed_seconds_total")
    assert set(attributed) == set(expected)
    for tenant, ns in expected.items():
        assert math.isclose(attributed[tenant], ns / 1e9, rel_tol=REL_TOL), tenant
    labels = (("engine_class", "class-x"), ("model_version", "1"))
    assert found["llmvisor_engine_windows_total", labels] == n_windows
    assert found["llmvisor_engine_steps_total", labels] == 600
    assert found["llmvisor_engine_model_relative_residual_distribution_bucket", tuple(sorted((*labels, ("le", "+Inf"))))] == 600


def test_a_metrics_failure_turns_them_off_and_the_window_still_closes(model_path, caplog):  # noqa: F811
    model = StepLatencyModel.from_json(model_path)
    metrics = EdgeMetrics(CollectorRegistry())

    def broken(*_):
        raise OSError("No such file or directory: the multiprocess directory was removed")

    metrics._record = broken
    seen = run_windows(model, relayed_steps(100, seed=4), metrics)
    assert seen and metrics._broken
    assert sum("engine-side metrics off" in r.message for r in caplog.records) == 1
