"""`llmvisor load --engines N`: simulated engines pushing at a fixed step rate into several service processes
(small N here; scripts/measure-fleet.sh runs the large fleets)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from _processes import cli_process, run_process
from _service_fixtures import POSTGRES_URL, empty_postgres, model_path  # noqa: F401
from llmvisor.service.fleet import FleetSettings, SimulatedEngine, load_fleet
from llmvisor.service.ingest import read_batch


def test_a_simulated_engines_body_is_a_valid_batch_of_its_steps():
    settings = FleetSettings(engines=1, processes=1, batch_size=6, n_tenants=3)
    engine = SimulatedEngine(7, "t", settings, 1_750_000_000.0, np.random.default_rng(0))
    trace = read_batch(engine.body(195, 10), max_steps=100, max_rows=10_000, max_decoded_bytes=10**7)
    assert trace.n_steps == 10 and trace.n_slices == 60
    assert trace.step_id_per_step.tolist() == list(range(195, 205))
    assert set(trace.run_id_per_step.tolist()) == {engine.run_id}
    assert trace.extra["timestamp_s"][trace.step_starts].tolist() == pytest.approx([1_750_000_000.0 + k / 50 for k in range(195, 205)])
    # The long request runs in every step; the others change every STEPS_PER_REQUEST steps.
    assert (trace.request_id == "long").sum() == 10
    assert {"r1-0", "r1-1"} <= set(trace.request_id.tolist())
    assert trace.is_prefill.sum() == 1  # step 200: one prefill in ten steps
    assert engine.ended_by(1_750_000_000.0 + 1.0) == 50 and engine.step_end_s(49) == pytest.approx(1_750_000_001.0)


@pytest.mark.parametrize(
    "database",
    [
        "sqlite",
        pytest.param("postgresql", marks=[pytest.mark.postgres, pytest.mark.skipif(not POSTGRES_URL, reason="LLMVISOR_TEST_POSTGRES_URL not set")]),
    ],
)
def test_a_small_fleet_is_accepted_in_full_with_usage_queryable_soon(model_path, database):
    target = "sqlite" if database == "sqlite" else empty_postgres(POSTGRES_URL)
    settings = FleetSettings(engines=4, processes=2, steps_per_s_per_engine=20.0, batch_size=4, duration_s=5.0, warmup_s=1.5)
    result = load_fleet(target, settings, model_path=model_path)
    assert result.reconciled
    assert result.failed_posts == 0 and result.staleness_probes_timed_out == 0
    # A small fleet is not throttled: what ended was sent, in the pusher's small batches.
    assert result.offered_steps_per_s == 80.0
    assert result.accepted_steps_per_s == pytest.approx(80.0, rel=0.35)
    assert result.steps_acknowledged >= 0.6 * 80 * settings.duration_s
    assert 1 <= result.mean_steps_per_post <= 10
    assert result.staleness_s["n"] >= 5 and 0 < result.staleness_s["p50"] < 5.0
    assert result.ingest_latency_s["n"] > 0 and result.ingest_latency_s["p99"] < 5.0
    assert result.service_cpu_s_per_step is None or result.service_cpu_s_per_step > 0
    if database == "postgresql":
        assert result.postgres_per_step["wal_bytes"] > 0 and result.postgres_per_step["steps_bytes"] >= 0
    else:
        assert result.postgres_per_step is None


def test_the_fleet_command_refuses_a_running_service_in_one_line():
    completed = cli_process("load", "--engines", "3", "--url", "http://127.0.0.1:9", timeout_s=60)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].endswith("--engines starts its own service processes; it does not take --url")


def test_the_fleet_command_prints_its_figures_as_json(model_path):
    completed = run_process(
        [sys.executable, "-m", "llmvisor.cli", "load", "--engines", "2", "--processes", "1", "--engine-steps-per-s", "10",
         "--batch-size", "2", "--max-seconds", "4", "--model", str(model_path), "--json"],
        timeout_s=300,
    )  # it starts its own service processes: stopped with the command's group however the test ends
    assert completed.returncode == 0, completed.stderr
    [run] = json.loads(completed.stdout)["runs"]
    assert run["settings"]["engines"] == 2 and run["database"] == "sqlite" and run["reconciled"]


def test_a_probe_of_a_step_its_engine_never_sent_is_no_timeout():
    """A probe taken in the last flush interval before the end can pick a step the pusher stops before sending (it
    sends what ended when it flushes, and stops at the end): once the pushers are done it ends with no sample, instead
    of waiting out its 30 s and counting a timeout (a busy machine's pusher runs late, so this happened there)."""
    import asyncio
    import time

    import httpx

    from llmvisor.service.fleet import PROBE_TIMEOUT_S, probe_staleness

    settings = FleetSettings(engines=1, processes=1, batch_size=4)
    engine = SimulatedEngine(0, "t", settings, time.time() - 5.0, np.random.default_rng(0))  # 100 steps ended, none sent
    counts = {"probe_timeouts": 0}
    staleness: list[float] = []

    async def run() -> float:
        pushed_all = asyncio.Event()
        pushed_all.set()
        started = time.monotonic()
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as client:  # never asked: the steps were never sent
            now = time.time()
            await probe_staleness([engine], [client], request_id="long", start_s=now, end_s=now + 0.3, interval_s=0.1,
                                  clock_s=0.0, staleness=staleness, counts=counts, pushed_all=pushed_all)
        return time.monotonic() - started

    took_s = asyncio.run(run())
    assert counts["probe_timeouts"] == 0 and counts["probes_unsent"] >= 2 and not staleness
    assert took_s < PROBE_TIMEOUT_S / 3
