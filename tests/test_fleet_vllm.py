"""The fleet experiment for real, briefly: two vLLM OpenAI API servers (the suite's engine model, dummy weights)
with Redis-shared attributed VTC behind vllm-router, a few seconds of light load. Every replica writes its
trace, the router keeps the sticky tenant on one replica and spreads the others, every request is answered, and
the pool's Redis counters hold at least every charge the replicas' traces show (charges plus VTC's lifts)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)
pytest.importorskip("redis", reason="needs redis-py, part of the [vllm] extra (pip install -e '.[vllm]')")

from _tiny_llama import write_suite_engine  # noqa: E402
from llmvisor.fairness.fleet_experiment import fleet_tenants, run_fleet_experiment  # noqa: E402

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # two replicas, a router and Redis
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server binary (scripts/install-test.sh installs it)"),
    pytest.mark.skipif(not Path(ROUTER).exists(), reason="needs vllm-router (pip install vllm-router)"),
]


def test_two_replicas_behind_the_router_share_their_counters_through_redis(tmp_path):
    workload = {
        "tenants": fleet_tenants(2, heavy_rate_rps=2.0, light_rate_rps=2.0, prompt_tokens=32, output_tokens=8),
        "duration_s": 8.0,
        "seed": 0,
    }
    engine = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_cache_gib": 1, "seed": 0}
    result = run_fleet_experiment(
        tmp_path, latency_model_path=None, engine_dir=write_suite_engine(tmp_path / "suite-engine"), engine=engine, replicas=2,
        workload=workload, warmup_s=1.0, policies=["shared"], drain_s=3.0,
    )  # fmt: skip
    run = result["runs"]["shared"]
    summary = run["summary"]
    for k in range(2):
        assert (tmp_path / "shared" / f"replica-{k}.jsonl").stat().st_size > 0, k
        assert summary["replica_busy_fraction"][k] > 0, k
    assert summary["requests_failed"] == 0
    per_replica = summary["requests_per_replica"]
    assert sum(1 for row in per_replica if row["heavy"] > 0) == 1, per_replica  # one session key: one replica
    for tenant in ("light-1", "light-2"):
        assert all(row[tenant] > 0 for row in per_replica), (tenant, per_replica)  # a key per request: both
    assert sum(summary["requests_finished"].values()) > 0
    pool = run["pool_counters"]
    assert pool["replicas_applied"] == 2
    for tenant, row in pool["tenants"].items():
        assert row["charged_s"] > 0, tenant
        assert row["redis_counter"] is not None, tenant
        assert row["redis_counter"] >= row["charged_s"] * (1 - 1e-6) - 1e-9, (tenant, row)
    assert (tmp_path / "fleet.json").is_file() and (tmp_path / "fleet.png").is_file()
