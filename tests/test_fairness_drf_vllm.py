"""DRF inside the real vLLM CPU engine (tiny dummy-weight Llama, prefix caching on, a 16-block pool of 32-token
blocks): the KV meter runs under ``cost = "drf"`` though nothing is recorded, every pool reading's blocks are charged
to their tenants for the time until the next reading, and admissions follow the dominant share."""

from __future__ import annotations

import json

import pytest

from _tiny_llama import tiny_engine_args, write_tiny_llama

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
POOL_BLOCKS = 16


def test_drf_meters_kv_memory_without_recording_and_charges_each_reading_to_its_tenants(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    from llmvisor.core.features import FEATURE_NAMES
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.core.synthetic import DEFAULT_COEF_S
    from llmvisor.engines.vllm.fair import FairScheduler
    from llmvisor.fairness.policy import DominantResourceCounter, FairnessConfig

    model_path = tmp_path / "latency.json"
    StepLatencyModel.from_coefficients([{n: DEFAULT_COEF_S[n] for n in FEATURE_NAMES}]).to_json(model_path)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    for name in ("LLMVISOR_TRACE_PATH", "LLMVISOR_SERVICE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMVISOR_FAIR_CONFIG", json.dumps({"cost": "attributed", "model": str(model_path)}))
    model = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=2, max_position_embeddings=1024, vocab_size=1024)
    args = tiny_engine_args(model, FairScheduler)
    args.update(enable_prefix_caching=True, block_size=BLOCK_SIZE, num_gpu_blocks_override=POOL_BLOCKS + 1, max_num_seqs=4,
                max_model_len=512, max_num_batched_tokens=256)
    llm = LLM(**args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    try:
        # attributed VTC without a trace: the recorder's behaviour as before, no KV meter
        assert not scheduler.is_recording and scheduler._kv_meter is None
        scheduler.configure(FairnessConfig(cost="drf", model=str(model_path)))
        meter = scheduler._kv_meter
        assert meter is not None and isinstance(scheduler.fair.vtc, DominantResourceCounter)
        readings: list[tuple[int, dict]] = []
        observe = meter.observe

        def kept(now_ns, holders, held, idle):
            observe(now_ns, holders, held, idle)
            readings.append((now_ns, dict(holders)))

        meter.observe = kept
        drf = scheduler.fair.vtc
        choices: list[dict] = []
        choose = scheduler.fair.choose

        def recorded(tenants, now_s, decide=None):
            choices.append({t: drf.shares(t) for t in tenants})
            return choose(tenants, now_s, decide)

        scheduler.fair.choose = recorded
        # the hog's requests each hold 7 to 11 blocks of the 16 and decode for 150 steps; the light tenant's 2 or 3
        requests = [(f"hog{k}", "hog", 200, 150) for k in range(3)] + [(f"light{k}", "light", 40, 20) for k in range(8)]
        for request_id, tenant, prompt_len, max_tokens in requests:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant})
            prompt = [(11 * i + 3 * len(request_id) + ord(request_id[-1])) % 900 + 50 for i in range(prompt_len)]
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        finished = {}
        for _ in range(5000):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = len(output.outputs[0].token_ids)
        assert finished == {request_id: max_tokens for request_id, _, _, max_tokens in requests}
        state = scheduler.fair_state()
        admissions = list(scheduler.admissions)
        preemptions = scheduler.num_preempted
        # nothing accumulates in a meter no step drains: what it holds now is at most the last step's stretch
        _, left = meter.drain([])
        assert left.interval_ns < 10**9 and meter.num_carried == 0
    finally:
        engine.engine_core.shutdown()

    assert len(readings) > 100 and preemptions >= 0
    # each reading's effective blocks, by the tenant in the request id, times the time to the next reading
    expected: dict[str, float] = {}
    for (t0, holders), (t1, _) in zip(readings, readings[1:]):
        for request_id, blocks in holders.items():
            tenant = "hog" if request_id.startswith("hog") else "light"
            expected[tenant] = expected.get(tenant, 0.0) + blocks * (t1 - t0)
    assert set(expected) == {"hog", "light"}
    assert state["kv_block_ns"] == pytest.approx(expected, rel=1e-9)
    assert drf.pool_block_ns == pytest.approx(POOL_BLOCKS * (readings[-1][0] - readings[0][0]), rel=1e-12)
    assert sum(expected.values()) <= drf.pool_block_ns
    # engine seconds charged are the steps' measured time (attributed shares sum to it)
    assert drf.engine_s == pytest.approx(sum(state["attributed_s"].values()), rel=1e-9)
    assert state["shares"]["hog"] == dict(zip(("time", "memory"), drf.shares("hog")))
    # memory decided: in some choices between the two tenants a tenant's memory share was its dominant share
    contested = [shares for shares in choices if len(shares) == 2]
    assert any(memory > time for shares in contested for time, memory in shares.values())
    # every admission took the waiting tenant with the lowest dominant share (reservations included)
    assert len(admissions) >= len(requests)
    for admission in admissions:
        assert admission.keys[admission.tenant] == min(admission.keys.values())
    assert any(len(a.keys) == 2 and a.tenant == "light" and a.keys["hog"] > a.keys["light"] for a in admissions)


def test_the_memory_experiment_command_runs_drf_on_a_small_pool_end_to_end(tmp_path):
    """`llmvisor experiment fairness-memory` briefly, one policy and no runs alone: the engine starts with the pool it
    was given and vLLM's CPU default block size, DRF runs, and the JSON carries the memory the trace metered."""
    import os
    import sys

    from _processes import START_TIMEOUT_S, run_process
    from _tiny_llama import write_suite_engine

    out = tmp_path / "experiment"
    done = run_process(
        [sys.executable, "-m", "llmvisor.cli", "experiment", "fairness-memory", "-o", str(out), "--policy", "drf", "--no-alone",
         "--engine-model", str(write_suite_engine(tmp_path / "suite-engine")), "--duration-s", "6", "--warmup-s", "1",
         "--window-s", "1", "--kv-pool-blocks", "12", "--max-model-len", "512", "--max-num-seqs", "6", "--length-scale", "0.1",
         "--enforce-eager", "--json"],
        timeout_s=START_TIMEOUT_S + 300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert json.loads((out / "fairness-memory.json").read_text()) == result and (out / "fairness-memory.png").is_file()
    setup = result["setup"]
    assert (setup["kv_pool_blocks"], setup["block_size"], setup["enable_prefix_caching"]) == (12, 128, True)
    memory = result["policies"]["drf"]["memory"]
    assert set(memory["kv_block_ns"]) == {"hog", "chat", "code"}
    assert sum(memory["kv_block_ns"].values()) > 0 and 0 < sum(memory["memory_share"].values()) <= 1
    assert memory["pool_block_ns"] > 0 and memory["pool_blocks"] == 12
    state = result["policies"]["drf"]["scheduler_state"]
    assert state["cost"] == "drf" and sum(state["kv_block_ns"].values()) > 0  # the policy charged memory as it ran
    assert result["goals"]["met"] is None  # nothing to judge without the runs alone and a baseline
