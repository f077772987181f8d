"""KV memory read from the real engine (vLLM CPU build, tiny Llama, prefix caching on as shipped): at every step,
before and after vLLM's own bookkeeping, the blocks requests hold equal what the engine counts as used, the
holders' shares plus idle cache plus free blocks equal the pool, and a shared document's blocks are split among
its readers. A pool of 12 blocks of 32 tokens makes memory bind: the run must preempt."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from _kv_checks import check_reading
from _tiny_llama import lift_cpu_async_override, tiny_engine_args, write_tiny_llama

vllm = pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
POOL_BLOCKS = 12  # usable blocks (vLLM adds its null block): 384 tokens for 4 requests of ~130-170 tokens each


def probe_class():
    from llmvisor.engines.vllm.kv_holdings import blocks_by_request
    from llmvisor.engines.vllm.recorder import RecordingScheduler

    class KvProbe(RecordingScheduler):
        """The recorder as shipped (its KV meter on), reading the pool after each of its two calls per step the
        slow, exact way (`_kv_checks.check_reading`), and keeping every reading its meter was given."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list[dict] = []
            self.meter_readings: list[tuple] = []
            observe = self._kv_meter.observe

            def kept(now_ns, holders, held, idle):
                whole = {r: len(ids) for r, ids in blocks_by_request(self.kv_cache_manager).items()}
                self.meter_readings.append((now_ns, dict(holders), held, idle, whole))
                observe(now_ns, holders, held, idle)

            self._kv_meter.observe = kept

        def _look(self, when: str) -> None:
            _, holders, held, idle, _ = self.meter_readings[-1]
            check = check_reading(self.kv_cache_manager, {r.request_id for r in self.running}, holders, held, idle,
                                  self._kv_idle.count)
            self.seen.append({
                "when": when, "check": check, "pool": check.pool,
                "preemptions": sum(r.num_preemptions for r in self.requests.values()),
            })

        def schedule(self, *args, **kwargs):
            out = super().schedule(*args, **kwargs)
            self._look("scheduled")
            return out

        def update_from_output(self, *args, **kwargs):
            out = super().update_from_output(*args, **kwargs)
            self._look("updated")
            return out

    return KvProbe


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_held_blocks_equal_the_engines_used_blocks_and_the_recorded_kv_memory_adds_up(tmp_path, monkeypatch, async_scheduling):
    """With async scheduling (vLLM's default where the platform allows it; the CPU platform's override lifted) the
    engine schedules step k+1 before step k's output is processed: the meter's readings interleave across steps."""
    from vllm import LLM, SamplingParams

    from llmvisor.core.trace import read_trace
    from llmvisor.engines.vllm.kv_holdings import block_bytes, pool_snapshot

    trace_path = tmp_path / "kv.jsonl"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("LLMVISOR_TRACE_PATH", str(trace_path))
    monkeypatch.setenv("LLMVISOR_RUN_ID", "kv-run")
    monkeypatch.setenv("LLMVISOR_UNIQUE_RUN_ID", "0")
    model = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=4, max_position_embeddings=1024, vocab_size=1024)
    args = tiny_engine_args(model, probe_class())
    args.update(enable_prefix_caching=True, block_size=BLOCK_SIZE, num_gpu_blocks_override=POOL_BLOCKS + 1, max_num_seqs=4,
                max_model_len=256, async_scheduling=async_scheduling)
    if async_scheduling:
        lift_cpu_async_override(monkeypatch)
    llm = LLM(**args)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    assert isinstance(llm.llm_engine.engine_core.engine_core.scheduler, AsyncScheduler) == async_scheduling
    rng = np.random.default_rng(7)
    document = rng.integers(10, 1000, 64).tolist()  # 2 full blocks every reader shares
    prompts = [document + rng.integers(10, 1000, int(n)).tolist() for n in (40, 60, 30, 50, 45, 70)]
    prompts.append(rng.integers(10, 1000, 90).tolist())  # a request reading nothing shared
    tenants = ["doc-a", "doc-b", "doc-a", "doc-b", "doc-a", "doc-b", "solo"]
    params = [SamplingParams(max_tokens=60, ignore_eos=True, detokenize=False, extra_args={"tenant": t}) for t in tenants]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [60] * len(prompts)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen = scheduler.seen
    # all done: nothing held, the finished requests' full blocks left cached for later hits; a prefix-cache reset
    # evicts them, and the whole pool is free
    done = pool_snapshot(scheduler.kv_cache_manager)
    assert done.held_blocks == 0 and 0 < done.idle_cached_blocks < POOL_BLOCKS
    assert scheduler._kv_idle.count == done.idle_cached_blocks
    assert scheduler.kv_cache_manager.reset_prefix_cache()
    reset = pool_snapshot(scheduler.kv_cache_manager)
    assert (reset.held_blocks, reset.idle_cached_blocks, reset.free_blocks) == (0, 0, POOL_BLOCKS)
    assert scheduler._kv_idle.count == 0
    # the block's bytes: the formula on the spec equals vLLM's own per-layer page size times the layers
    groups = scheduler.kv_cache_config.kv_cache_groups
    assert block_bytes(scheduler.kv_cache_config) == sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    readings = scheduler.meter_readings
    # the recorder's cheap reading (a length per request while no reference count changed) was used, and checked
    assert 0 < scheduler._kv_holdings.num_full_reads < len(readings) / 2
    llm.llm_engine.engine_core.shutdown()

    assert len(seen) > 50
    assert max(look["preemptions"] for look in seen) > 0, (
        f"the small pool never preempted (at most {max(look['pool'].held_blocks for look in seen)} blocks held)")
    shared_steps = 0
    for look in seen:
        # what requests reference is what vLLM counts as used; holders, idle cache and free blocks fill the pool; the
        # recorder's meter was given that pool (its running idle count, its fast per-request shares)
        assert not look["check"].mismatches, (look["when"], look["check"].mismatches)
        assert look["pool"].pool_blocks == POOL_BLOCKS
        if look["check"].shared:
            shared_steps += 1
            pool, blocks = look["pool"], look["check"].blocks
            shares = dict(zip(pool.holders, pool.effective_blocks))
            assert any(shares[r] < len(ids) for r, ids in blocks.items())  # a reader pays part of a block
    assert shared_steps > 10, "the document's blocks were never held by two requests at once"
    assert any(look["pool"].idle_cached_blocks > 0 for look in seen), "no cached block was ever left idle"

    # The trace (format 3, checked step by step by the reader) against the engine's own pool over wall time:
    # held blocks × time integrated here from the readings, per request with the exact 1/k split.
    trace = read_trace(trace_path)
    extra = trace.extra
    assert set(extra["kv_pool_blocks"].tolist()) == {POOL_BLOCKS}
    assert set(extra["kv_block_bytes"].tolist()) == {block_bytes(scheduler.kv_cache_config)}
    held_ns: dict[str, Fraction] = {}
    held_total = 0
    whole_ns: dict[str, int] = {}  # a wrong rule: every reader pays each block it reads in full
    for (t0, holders, held, _, whole), (t1, *_) in zip(readings, readings[1:]):
        held_total += held * (t1 - t0)
        for holder, n_blocks in whole.items():
            whole_ns[holder] = whole_ns.get(holder, 0) + n_blocks * (t1 - t0)
        for holder, share in holders.items():
            held_ns[holder] = held_ns.get(holder, Fraction(0)) + Fraction(share).limit_denominator(1000) * (t1 - t0)
    starts = trace.step_starts
    carried_in = extra["kv_carried_in_block_ns"][starts].astype(object)
    carried_out = extra["kv_carried_out_block_ns"][starts].astype(object)
    assert sum(carried_in) > 0, "no request was ever skipped by a step while holding blocks"
    requests, block_ns = trace.request_id.tolist(), extra["kv_block_ns"].tolist()
    billed = dict.fromkeys(requests, 0)
    for request, value in zip(requests, block_ns):
        billed[request] += value
    # nothing held after the last step and nothing aborted: every held block-ns of the run is billed, exactly
    assert sum(held_ns.values()) == held_total
    assert sum(carried_out) == sum(carried_in)
    assert sum(billed.values()) == held_total
    # each request's and each tenant's block-ns is its exact holding (1/k of each block k requests held), to one
    # block-ns per step it was billed in
    for request, exact_ns in held_ns.items():
        assert abs(billed[request] - exact_ns) <= requests.count(request), request
    tenant_of = dict(zip(requests, trace.tenant.tolist()))
    assert set(tenant_of.values()) == set(tenants)
    for tenant in set(tenants):
        mine = [r for r in billed if tenant_of[r] == tenant]
        assert abs(sum(billed[r] for r in mine) - sum(held_ns.get(r, 0) for r in mine)) <= sum(map(requests.count, mine))
    # the document's readers split its blocks: each is billed less than if it paid every block it read in full,
    # while the request reading nothing shared pays exactly that
    solo = [r for r in billed if tenant_of[r] == "solo"]
    assert len(solo) == 1 and abs(billed[solo[0]] - whole_ns[solo[0]]) <= requests.count(solo[0])
    assert all(billed[r] < whole_ns[r] - requests.count(r) for r in billed if tenant_of[r] != "solo")
