"""Recorder → accounting service on the real engine: every step the engine ran is in the ledger exactly once."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from _tiny_llama import tiny_engine_args, write_tiny_llama
from llmvisor.client import wait_for_delivery
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import read_trace
from llmvisor.ledger import Ledger
from llmvisor.service.process import ServerProcess
from llmvisor.service.registry import activate
from test_vllm_recorder import ENGINE_ENV, TINY_FIELDS

pytestmark = pytest.mark.vllm


def test_recorder_pushes_every_step_to_the_service_once(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    from llmvisor.engines.vllm.recorder import RecordingScheduler

    model_dir = write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)
    model_path = tmp_path / "model.json"
    StepLatencyModel().fit(synthetic_trace(1000)).to_json(model_path)
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    admin_key = ledger.create_key(is_admin=True)
    ledger.close()
    server = ServerProcess(model_path, db_url, log_path=tmp_path / "server.log").start()
    try:
        for name, value in ENGINE_ENV.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("LLMVISOR_TRACE_PATH", str(tmp_path / "trace.jsonl"))
        monkeypatch.setenv("LLMVISOR_RUN_ID", "push-test")
        monkeypatch.setenv("LLMVISOR_SERVICE_URL", server.url)
        monkeypatch.setenv("LLMVISOR_SERVICE_KEY", admin_key)
        monkeypatch.setenv("LLMVISOR_SPOOL", str(tmp_path / "spool.jsonl"))
        llm = LLM(**tiny_engine_args(model_dir, RecordingScheduler))
        rng = np.random.default_rng(1)
        requests = [(120, 6, "alice"), (30, 8, "bob"), (70, 4, "alice")]
        llm.generate(
            [{"prompt_token_ids": rng.integers(10, 1000, n).tolist()} for n, _, _ in requests],
            [SamplingParams(max_tokens=out, ignore_eos=True, detokenize=False, extra_args={"tenant": t}) for _, out, t in requests],
            use_tqdm=False,
        )
        delivery_pid = llm.llm_engine.engine_core.engine_core.scheduler.delivery_pid
        llm.llm_engine.engine_core.shutdown()
        assert wait_for_delivery(delivery_pid, 60)
    finally:
        server.stop()

    trace = read_trace(tmp_path / "trace.jsonl")
    engine_class = trace.engine_fingerprint_ids()[0]
    ledger = Ledger(db_url)
    held = ledger.totals()
    # The service's model was fitted on no recorded engine: the engine's steps wait, measured, for a model of its class.
    assert ledger.pending_classes() == {engine_class: trace.n_steps} and held.num_steps == 0 and held.attributed_ns == 0
    version = ledger.add_model(engine_class, json.dumps(StepLatencyModel.from_json(model_path).to_dict()), "model.json")
    assert activate(ledger, engine_class, version).steps_attributed == trace.n_steps
    totals = ledger.totals()
    usage = {row.tenant: row.attributed_ns for row in ledger.tenant_usage()}
    ledger.close()
    assert held.pending_measured_ns == totals.measured_ns
    assert not (tmp_path / "spool.jsonl").exists()
    assert totals.num_steps == trace.n_steps > 0
    assert totals.num_slices == trace.n_slices
    measured_ns = int(round(trace.step_latency_s_per_step.sum() * 1e9))
    assert abs(totals.measured_ns - measured_ns) <= trace.n_steps
    assert totals.attributed_ns == totals.measured_ns
    assert set(usage) == {"alice", "bob"}
    assert sum(usage.values()) == totals.attributed_ns
