"""The fair scheduler inside the real vLLM CPU engine (tiny dummy-weight Llama) with its counters shared
through a real Redis: it steps normally, orders admissions by the pool's counters (which another replica
charged), and leaves the pool holding its own charges."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)
pytest.importorskip("redis", reason="needs redis-py, part of the [vllm] extra (pip install -e '.[vllm]')")

from _redis import REDIS_BINARY, SKIP_REASON, RedisServer  # noqa: E402
from _tiny_llama import write_tiny_llama  # noqa: E402
from llmvisor.fairness.shared_counters import SharedCounters, SharedCountersConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(REDIS_BINARY is None, reason=SKIP_REASON)]

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_theta": 10000.0, "vocab_size": 1024}
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 4
OTHER_REPLICA_CHARGE = 1000.0


def start_engine(folder, fair_config: dict):
    from vllm import LLM

    from llmvisor.engines.vllm.fair import FairScheduler

    model_dir = write_tiny_llama(folder / "model", **TINY_FIELDS)
    variables = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LLMVISOR_WARMUP_STEPS": "0",
        "LLMVISOR_FAIR_CONFIG": json.dumps(fair_config),
    }
    saved = {k: os.environ.get(k) for k in (*variables, "LLMVISOR_TRACE_PATH")}
    os.environ.update(variables)
    os.environ.pop("LLMVISOR_TRACE_PATH", None)
    try:
        return LLM(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            distributed_executor_backend="uni",
            async_scheduling=False,
            enable_prefix_caching=False,
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=1,
            scheduler_cls=FairScheduler,
            seed=0,
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_fair_scheduler_with_shared_counters_steps_and_follows_the_pool(tmp_path):
    from vllm import SamplingParams

    pool = f"pool-{uuid.uuid4().hex[:8]}"
    with RedisServer(tmp_path) as server:
        shared_config = {"url": server.url, "pool": pool, "flush_interval_s": 0.05}
        other = SharedCounters(SharedCountersConfig(**shared_config))
        other.charge("busy", OTHER_REPLICA_CHARGE)  # another replica has served "busy" already
        assert other.flush()
        other.close()

        llm = start_engine(tmp_path, {"cost": "tokens", "shared_counters": shared_config})
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        try:
            wait_for(lambda: scheduler.fair.shared.num_flushes > 0)
            requests = [(f"idle-{k}", "idle") for k in range(3)] + [(f"busy-{k}", "busy") for k in range(3)]
            for request_id, tenant in requests:
                params = SamplingParams(
                    max_tokens=OUTPUT_TOKENS, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant}, temperature=0.0
                )
                prompt = [(7 * i + len(request_id)) % 900 + 50 for i in range(PROMPT_TOKENS)]
                engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            finished: dict[str, int] = {}
            started = time.perf_counter()
            n_steps = 0
            while engine.has_unfinished_requests() and n_steps < 500:
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = len(output.outputs[0].token_ids)
                n_steps += 1
            wall_s = time.perf_counter() - started
            assert finished == {request_id: OUTPUT_TOKENS for request_id, _ in requests}

            cost = PROMPT_TOKENS + 2 * OUTPUT_TOKENS
            order = [a.tenant for a in scheduler.admissions]
            # "busy" starts from the pool's 1000: all of "idle" goes first (without sharing they would alternate)
            assert order == ["idle"] * 3 + ["busy"] * 3
            expected = {"idle": 3.0 * cost, "busy": OTHER_REPLICA_CHARGE + 3 * cost}
            wait_for(lambda: scheduler.fair.shared.value("busy") == expected["busy"] and scheduler.fair.shared.status()["unflushed_tenants"] == 0)
            state = scheduler.fair_state()
            assert state["counter"] == expected
            assert state["served"] == {"idle": 3.0 * cost, "busy": 3.0 * cost}
            assert state["shared_counters"]["connected"] is True and state["shared_counters"]["num_failures"] == 0
            import redis

            with redis.Redis.from_url(server.url) as client:
                stored = {k.decode(): float(v) for k, v in client.hgetall(f"llmvisor:fair:{{{pool}}}:counters").items()}
            assert stored == expected
            overhead = scheduler.fair_overhead()
            print(
                f"\n{n_steps} steps in {wall_s:.2f} s with shared counters ({state['shared_counters']['num_flushes']} flushes); "
                f"fair scheduler's own work {overhead['added_time_per_step_us']:.0f} us/step (p99 {overhead['added_time_per_step_us_p99']:.0f} us)"
            )
        finally:
            engine.engine_core.shutdown()
        assert scheduler.fair.vtc.shared is None  # shutdown closed the shared counters
