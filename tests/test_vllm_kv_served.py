"""KV memory-time from a served engine that preempts (issue #37): vLLM's OpenAI server started the documented way
(`python -m llmvisor.engines.vllm.openai_server`, the recorder pushing every step to a real `llmvisor serve`), prefix
caching on as vLLM ships it, a pool of 12 blocks of 32 tokens that seven concurrent requests of three tenants cannot
fit (six of them read one 2-block document), so the engine must preempt; vLLM's own `/metrics` says it did.

The engine-core process runs the recorder through `_kv_served_probe.KvCheckingScheduler`, which at every reading the
recorder hands its KV meter reads the block pool the slow, exact way (`_kv_checks.check_reading`): the blocks the
requests reference are the engine's used blocks, holders + idle cache + free fill the pool, and the meter was given
exactly that. It integrates the exact readings over time beside the meter. Then:

- the trace the served run wrote reads back (the readers check format 3's per-step identity) and, per step,
  Σ slice block-ns − carried in + carried out + idle + free = pool × interval exactly, and each step's held and idle
  block-ns and its interval are the engine's exact holdings over that interval; the intervals tile the engine-core's
  wall time from the meter's start to the last step; each request's block-ns is its exact share within one block-ns
  per step that apportioned it some (the equal split among readers is the only rounding);
- the ledger the run was delivered to holds, per request and per tenant, the trace's block-ns exactly.

In GiB-seconds (block-ns × block bytes / 2^30 / 10^9), the requests' plus the idle cache's plus the free memory-time
is the pool's bytes × wall time: compared in integer byte-nanoseconds, exactly.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from fractions import Fraction
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from prometheus_client.parser import text_string_to_metric_families

from _billing_checks import check_exports_tie_to_the_ledger, price_every_class, read_csv
from _kv_served_probe import ENV_CHECKS_PATH
from _processes import stop_process
from llmvisor.core.trace import read_trace
from llmvisor.ledger import Ledger
from test_vllm_delivery import ApiServer
from test_vllm_usage import service  # noqa: F401

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
POOL_BLOCKS = 12  # usable blocks (vLLM adds its null block): 384 tokens, against 7 requests of 150-214 tokens each
MAX_TOKENS = 80
PREEMPTIONS = "vllm:num_preemptions_total"  # vLLM's counter `vllm:num_preemptions` (vllm/v1/metrics/loggers.py)
GIB_NS = 2**30 * 10**9


def workload() -> list[tuple[str, list[int]]]:
    """(tenant, prompt token ids): six prompts behind one 64-token document (2 full blocks), one reading nothing
    shared; each request's prompt and output fit the pool alone, four of them running at once do not."""
    rng = np.random.default_rng(7)
    document = rng.integers(10, 1000, 64).tolist()
    tenants = ["doc-a", "doc-b", "doc-a", "doc-b", "doc-a", "doc-b", "solo"]
    prompts = [document + rng.integers(10, 1000, int(n)).tolist() for n in (40, 60, 30, 50, 45, 70)]
    prompts.append(rng.integers(10, 1000, 90).tolist())
    return list(zip(tenants, prompts))


def preemptions(base: str) -> float:
    """vLLM's own count of preemptions, from the server's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == PREEMPTIONS]
    assert found, f"no {PREEMPTIONS} on /metrics"
    return sum(found)


def test_a_served_engine_that_preempts_meters_kv_memory_time_that_fills_the_pool(service, tmp_path, monkeypatch):
    """``service``: a real `llmvisor serve` billing every engine class with one model (the fallback)."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # the server's wrapper makes its own
    started = time.monotonic()
    started_s = time.time()
    checks_path = tmp_path / "kv-checks.json"
    server = ApiServer(
        service, tmp_path, "kv", entry_point="llmvisor.engines.vllm.openai_server",
        scheduler_cls="_kv_served_probe.KvCheckingScheduler", prefix_caching=True, max_model_len=256,
        extra_args=("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(POOL_BLOCKS + 1)),
        extra_env={ENV_CHECKS_PATH: str(checks_path)}, extra_path=(str(Path(__file__).parent),),
    )  # fmt: skip
    answers: dict[int, dict] = {}
    try:
        ready_s = time.monotonic() - started

        def complete(index: int, tenant: str, prompt: list[int]) -> None:
            body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "vllm_xargs": {"tenant": tenant}}
            response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
            answers[index] = {"status": response.status_code, "body": response.json() if response.status_code == 200 else response.text}

        threads = [threading.Thread(target=complete, args=(i, *job)) for i, job in enumerate(workload())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [answers[i]["status"] for i in range(len(threads))] == [200] * len(threads), answers
        assert all(a["body"]["usage"]["completion_tokens"] == MAX_TOKENS for a in answers.values())
        served_preemptions = preemptions(server.base)
        server.process.send_signal(signal.SIGINT)
        server.wait()
    finally:
        stop_process(server.process, sig=signal.SIGKILL)
    assert served_preemptions > 0, f"vLLM counted no preemption: the pool of {POOL_BLOCKS} blocks never ran out"

    # In the engine-core process, at every reading the recorder's meter was given: the pool read the exact way agrees
    facts = json.loads(checks_path.read_text(encoding="utf-8"))
    assert "error" not in facts, facts
    print(f"served: ready in {ready_s:.1f} s; vLLM counted {served_preemptions:g} preemptions; {facts['readings']} readings "
          f"checked over {facts['steps']} steps, {facts['shared_readings']} with a shared block, "
          f"{facts['idle_readings']} with idle cache; at most {facts['max_held_blocks']} blocks held")
    assert facts["num_mismatches"] == 0, facts["mismatches"]
    assert facts["kv_errors"] == 0
    assert facts["readings"] >= 2 * facts["steps"] > 100
    assert facts["preempted_requests"] > 0, "the engine's requests record no preemption"
    assert facts["shared_readings"] > 10, "the document's blocks were never held by two requests at once"
    assert facts["idle_readings"] > 0, "no cached block was ever left idle"

    # The trace the served run wrote (format 3, each step's identity checked by the reader): every step the meter
    # closed, in one run, on the pool the engine had
    trace = read_trace(tmp_path / "trace.jsonl")
    mine = trace.select_steps(trace.run_id_per_step == server.run_id)
    assert mine.n_steps == trace.n_steps == facts["steps"]
    extra = {name: np.asarray(values, dtype=np.int64) for name, values in mine.extra.items() if name.startswith("kv_")}
    assert set(extra["kv_pool_blocks"].tolist()) == {POOL_BLOCKS}
    (block_bytes,) = set(extra["kv_block_bytes"].tolist())
    starts = mine.step_starts
    step = {name: extra[name][starts] for name in ("kv_interval_ns", "kv_idle_block_ns", "kv_free_block_ns",
                                                     "kv_carried_in_block_ns", "kv_carried_out_block_ns")}
    slices_ns = np.add.reduceat(extra["kv_block_ns"], starts)
    held_ns = slices_ns - step["kv_carried_in_block_ns"] + step["kv_carried_out_block_ns"]
    assert np.array_equal(held_ns + step["kv_idle_block_ns"] + step["kv_free_block_ns"], POOL_BLOCKS * step["kv_interval_ns"])
    assert (step["kv_free_block_ns"] >= 0).all() and (step["kv_idle_block_ns"] >= 0).all()
    # each step's interval, held and idle block-ns are the engine's exact holdings over it, and the intervals tile the
    # engine's wall time from the meter's start to the last step's end
    assert step["kv_interval_ns"].tolist() == facts["step_interval_ns"]
    assert held_ns.tolist() == facts["step_held_block_ns"]
    assert step["kv_idle_block_ns"].tolist() == facts["step_idle_block_ns"]
    wall_ns = int(step["kv_interval_ns"].sum())
    assert wall_ns == facts["wall_ns"] > 0 and held_ns.sum() > 0 and step["kv_idle_block_ns"].sum() > 0
    assert int(step["kv_carried_in_block_ns"].sum()) > 0, "no request was ever skipped by a step while holding blocks"
    assert int(step["kv_carried_out_block_ns"].sum()) == int(step["kv_carried_in_block_ns"].sum())  # nothing aborted

    requests, tenants = mine.request_id.tolist(), mine.tenant.tolist()
    billed: dict[str, int] = dict.fromkeys(requests, 0)
    for request, block_ns in zip(requests, extra["kv_block_ns"].tolist()):
        billed[request] += block_ns
    tenant_of = dict(zip(requests, tenants))
    assert sorted(tenant_of.values()) == sorted(t for t, _ in workload())  # one engine request per completion
    exact = {r: Fraction(v) for r, v in facts["exact_block_ns"].items()}
    assert exact.keys() == billed.keys() and sum(billed.values()) == sum(facts["step_held_block_ns"])
    for request, exact_ns in exact.items():
        assert abs(billed[request] - exact_ns) <= facts["drains_held"][request], request
    per_tenant: dict[str, int] = {}
    for request, block_ns in billed.items():
        per_tenant[tenant_of[request]] = per_tenant.get(tenant_of[request], 0) + block_ns
    gib_s = {tenant: block_ns * block_bytes / GIB_NS for tenant, block_ns in sorted(per_tenant.items())}
    idle_ns, free_ns = int(step["kv_idle_block_ns"].sum()), int(step["kv_free_block_ns"].sum())
    print(f"pool {POOL_BLOCKS} blocks of {block_bytes} bytes over {wall_ns / 1e9:.3f} s: tenants' GiB-s {gib_s}, idle cache "
          f"{idle_ns * block_bytes / GIB_NS:.3e}, free {free_ns * block_bytes / GIB_NS:.3e}")
    # GiB-seconds of the requests + idle cache + free = the pool's bytes × wall time, in integer byte-ns
    assert (sum(billed.values()) + idle_ns + free_ns) * block_bytes == POOL_BLOCKS * block_bytes * wall_ns

    # The ledger the run was delivered to: per request and per tenant, the trace's block-ns exactly
    ledger = Ledger(service["db_url"])
    try:
        rows = ledger.request_usage(run_id=server.run_id, limit=1000)
        tenant_rows = ledger.top_tenants(100)
    finally:
        ledger.close()
    assert {r.request_id: r.kv_block_ns for r in rows} == billed
    assert {r.request_id: r.tenant for r in rows} == tenant_of
    assert all(r.kv_byte_ns == billed[r.request_id] * block_bytes for r in rows)
    assert {r.tenant: r.kv_block_ns for r in tenant_rows} == per_tenant

    # That run's ledger, billed (issue #37's second Done-when on the same run): every export ties to the ledger,
    # each tenant's block-ns in them are the trace's, and FOCUS has a GiB-Hours row beside each tenant's
    # Engine-Seconds charge and passes the FOCUS validator
    period_s = (int(started_s) // 3600 * 3600, int(time.time()) // 3600 * 3600 + 3600)
    price_every_class(service["db_url"], period_s, tmp_path, engine_hour_price="1234567.89", gib_hour_price="98765.4321")
    billing = tmp_path / "billing"
    billing.mkdir()
    summary = check_exports_tie_to_the_ledger(service["db_url"], period_s, billing)
    assert summary["kv_block_ns"] == per_tenant
    focus = read_csv(billing / "focus.csv")
    charged = {(r["SubAccountId"], r["ChargePeriodStart"]) for r in focus if r["ConsumedUnit"] == "Engine-Seconds"}
    assert {r["SubAccountId"] for r in focus if r["ConsumedUnit"] == "GiB-Hours"} == set(per_tenant)
    assert {(r["SubAccountId"], r["ChargePeriodStart"]) for r in focus if r["ConsumedUnit"] == "GiB-Hours"} == charged
    print(f"test took {time.monotonic() - started:.1f} s")
    if not summary["focus_validated"]:
        pytest.skip("no FOCUS validator at .venv-focus/bin/focus-validator (scripts/install-test.sh creates it); every other check passed")
