"""A caller reads what its completion cost, with its own key, by the ``id`` vLLM's OpenAI server answered with:
on the real server (vLLM CPU build) with the recorder pushing to a real `llmvisor serve`, each completion's
``GET /v1/usage/requests/{id}`` answers once its steps are delivered, holds all its tokens, equals the attribution
of the run's trace for that request to the nanosecond, and is a 404 to another tenant's key.

The same served run's ledger is then priced and exported in every billing format (`_billing_checks`): FOCUS passes
the FOCUS validator, its per-tenant costs equal the ledger's seconds × price, a re-export gives the same ids, and the
CloudEvents, Stripe and Lago exports validate and sum to the same totals.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from _billing_checks import check_exports_tie_to_the_ledger, price_every_class, read_csv
from _processes import stop_process
from _tiny_llama import write_tiny_llama
from llmvisor.core.attribution import attribute
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import read_trace
from llmvisor.ledger import Ledger
from llmvisor.service.ingest import apportion_ns
from llmvisor.service.process import ServerProcess
from test_vllm_delivery import ApiServer
from test_vllm_recorder import TINY_FIELDS

pytestmark = pytest.mark.vllm
READABLE_WITHIN_S = 5.0
"""Generous: the delivery path adds at most the pusher's 0.2 s batch wait and one POST (docs/usage-page.md);
the figure measured is printed."""


@pytest.fixture
def service(tmp_path_factory):
    """A real `llmvisor serve` whose model also bills the engine's class (as the fallback), an admin key for the
    recorder and the tiny model for vLLM (as in test_vllm_delivery)."""
    folder = tmp_path_factory.mktemp("service")
    model_path = folder / "model.json"
    StepLatencyModel().fit(synthetic_trace(1000)).to_json(model_path)
    db_url = f"sqlite:///{folder}/ledger.db"
    ledger = Ledger(db_url)
    admin_key = ledger.create_key(is_admin=True)
    ledger.close()
    server = ServerProcess(model_path, db_url, log_path=folder / "service.log", extra_args=("--fallback-model", str(model_path))).start()
    yield {"url": server.url, "key": admin_key, "db_url": db_url, "model_path": model_path,
           "model_dir": write_tiny_llama(folder / "tiny", **TINY_FIELDS)}
    server.stop()


def trace_attributed_ns(trace_path, model_path, run_id: str) -> dict[str, int]:
    """Per engine request id: the trace's steps attributed offline by the service's model, in integer ns."""
    trace = read_trace(trace_path)
    mine = trace.select_steps(trace.run_id_per_step == run_id)
    share_s = attribute(StepLatencyModel.from_json(model_path), mine).share_s
    measured_ns = np.rint(mine.step_latency_s_per_step * 1e9).astype(np.int64)
    attributed = apportion_ns(share_s, mine.step_offsets, measured_ns)
    totals: dict[str, int] = {}
    for request_id, ns in zip(mine.request_id, attributed):
        totals[str(request_id)] = totals.get(str(request_id), 0) + int(ns)
    return totals


def test_a_caller_reads_its_completions_attributed_seconds_right_after_it_finishes(service, tmp_path):
    ledger = Ledger(service["db_url"])
    keys = {tenant: ledger.create_key(tenant) for tenant in ("caller-a", "caller-b")}
    ledger.close()
    started_s = time.time()
    server = ApiServer(service, tmp_path, "usage")
    answers: dict[str, dict] = {}
    try:
        rng = np.random.default_rng(7)

        def complete(tenant: str, prompt_len: int, max_tokens: int) -> None:
            body = {"model": server.model, "prompt": rng.integers(10, 1000, prompt_len).tolist(), "max_tokens": max_tokens,
                    "ignore_eos": True, "vllm_xargs": {"tenant": tenant}}
            response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answers[tenant] = {"id": response.json()["id"], "tokens": prompt_len + response.json()["usage"]["completion_tokens"] - 1,
                               "answered": time.monotonic()}

        threads = [threading.Thread(target=complete, args=args) for args in (("caller-a", 60, 12), ("caller-b", 90, 6))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(answers) == {"caller-a", "caller-b"}
        readable: dict[str, dict] = {}
        while len(readable) < 2:
            for tenant, answer in answers.items():
                if tenant in readable:
                    continue
                response = httpx.get(f"{service['url']}/v1/usage/requests/{answer['id']}", headers={"Authorization": f"Bearer {keys[tenant]}"})
                if response.status_code == 200 and response.json()["num_new_tokens"] == answer["tokens"]:
                    readable[tenant] = {**response.json(), "after_s": time.monotonic() - answer["answered"]}
                else:
                    assert response.status_code in (200, 404), response.text
                    waited_s = time.monotonic() - answer["answered"]
                    assert waited_s < READABLE_WITHIN_S, f"{tenant}: {answer['id']} not readable {waited_s:.2f} s after its answer"
            time.sleep(0.01)
        for tenant, usage in readable.items():
            print(f"{tenant}: {answers[tenant]['id']} readable {usage['after_s']:.3f} s after its answer: "
                  f"{usage['attributed_s']:.6f} s over {usage['num_steps']} steps")
            other = "caller-b" if tenant == "caller-a" else "caller-a"
            refused = httpx.get(f"{service['url']}/v1/usage/requests/{answers[tenant]['id']}", headers={"Authorization": f"Bearer {keys[other]}"})
            assert refused.status_code == 404
            assert usage["tenant"] == tenant and usage["runs"] == [server.run_id] and len(usage["parts"]) == 1
            assert usage["parts"][0]["request_id"].startswith(answers[tenant]["id"] + "-0-")  # vLLM's engine id
        server.process.send_signal(signal.SIGINT)
        server.wait()
    finally:
        stop_process(server.process, sig=signal.SIGKILL)
    offline = trace_attributed_ns(tmp_path / "trace.jsonl", service["model_path"], server.run_id)
    for tenant, usage in readable.items():
        engine_id = usage["parts"][0]["request_id"]
        assert usage["attributed_ns"] == offline[engine_id] > 0, (tenant, usage, offline)

    # The served run's ledger, billed: every export format of the hours the run spans (the price is high so that
    # a few seconds of engine time cost more than a cent and the rounding is exercised).
    period_s = (int(started_s) // 3600 * 3600, int(time.time()) // 3600 * 3600 + 3600)
    price_every_class(service["db_url"], period_s, tmp_path, engine_hour_price="1234567.89", gib_hour_price="98765.4321")
    billing = tmp_path / "billing"
    billing.mkdir()
    summary = check_exports_tie_to_the_ledger(service["db_url"], period_s, billing)
    print(f"billing exports of the served run: {summary}")
    assert {"caller-a", "caller-b"} <= set(summary["tenants"])
    for tenant, usage in readable.items():  # the callers' own requests are all they ran
        assert summary["owed_ns"][tenant] == usage["attributed_ns"]
    # KV memory (trace format 3, written by the recorder): each tenant's block-ns in every export (checked against
    # the ledger above) equal the recorder's trace, to the block-nanosecond, and FOCUS has a GiB-Hours row per
    # tenant charge
    trace = read_trace(tmp_path / "trace.jsonl")
    mine = trace.select_steps(trace.run_id_per_step == server.run_id)
    traced_kv: dict[str, int] = {}
    for tenant, block_ns in zip(mine.tenant.tolist(), np.asarray(mine.extra["kv_block_ns"], dtype=np.int64).tolist()):
        traced_kv[tenant] = traced_kv.get(tenant, 0) + block_ns
    assert {t: ns for t, ns in summary["kv_block_ns"].items() if t in readable} == {t: traced_kv[t] for t in readable}
    assert all(traced_kv[t] > 0 for t in readable)
    focus = read_csv(billing / "focus.csv")
    charged = {(r["SubAccountId"], r["ChargePeriodStart"]) for r in focus if r["ConsumedUnit"] == "Engine-Seconds"}
    assert {(r["SubAccountId"], r["ChargePeriodStart"]) for r in focus if r["ConsumedUnit"] == "GiB-Hours"} == charged
    if not summary["focus_validated"]:
        pytest.skip("no FOCUS validator at .venv-focus/bin/focus-validator (scripts/install-test.sh creates it); every other check passed")
