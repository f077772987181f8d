"""KV memory read from the real engine (vLLM CPU build, tiny Llama, prefix caching on as shipped): at every step,
before and after vLLM's own bookkeeping, the blocks requests hold equal what the engine counts as used, the
holders' shares plus idle cache plus free blocks equal the pool, and a shared document's blocks are split among
its readers. A pool of 12 blocks of 32 tokens makes memory bind: the run must preempt."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from _tiny_llama import tiny_engine_args, write_tiny_llama

vllm = pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
POOL_BLOCKS = 12  # usable blocks (vLLM adds its null block): 384 tokens for 4 requests of ~130-170 tokens each


def probe_class():
    from vllm.v1.core.sched.scheduler import Scheduler

    from llmvisor.engines.vllm.kv_holdings import blocks_by_request, engine_used_blocks, pool_snapshot

    class KvProbe(Scheduler):
        """The scheduler as shipped, reading the pool after each of its two calls per step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list[dict] = []

        def _look(self, when: str) -> None:
            pool = pool_snapshot(self.kv_cache_manager)
            self.seen.append({
                "when": when, "pool": pool, "used": engine_used_blocks(self.kv_cache_manager),
                "blocks": blocks_by_request(self.kv_cache_manager),
                "running": {r.request_id for r in self.running},
                "preemptions": sum(r.num_preemptions for r in self.requests.values()),
                # free blocks counted from the pool's own ref counts, not derived from the holders' lists
                "free": sum(1 for b in self.kv_cache_manager.block_pool.blocks
                            if b.ref_cnt == 0 and b.block_hash is None and not b.is_null),
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


def test_held_blocks_equal_the_engines_used_blocks_and_the_pool_adds_up(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    from llmvisor.engines.vllm.kv_holdings import pool_snapshot

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=4, max_position_embeddings=1024, vocab_size=1024)
    args = tiny_engine_args(model, probe_class())
    args.update(enable_prefix_caching=True, block_size=BLOCK_SIZE, num_gpu_blocks_override=POOL_BLOCKS + 1, max_num_seqs=4,
                max_model_len=256)
    llm = LLM(**args)
    rng = np.random.default_rng(7)
    document = rng.integers(10, 1000, 64).tolist()  # 2 full blocks every reader shares
    prompts = [document + rng.integers(10, 1000, int(n)).tolist() for n in (40, 60, 30, 50, 45, 70)]
    prompts.append(rng.integers(10, 1000, 90).tolist())  # a request reading nothing shared
    params = SamplingParams(max_tokens=100, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [100] * len(prompts)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen = scheduler.seen
    # all done: nothing held, the finished requests' full blocks left cached for later hits; a prefix-cache reset
    # evicts them, and the whole pool is free
    done = pool_snapshot(scheduler.kv_cache_manager)
    assert done.held_blocks == 0 and 0 < done.idle_cached_blocks < POOL_BLOCKS
    assert scheduler.kv_cache_manager.reset_prefix_cache()
    reset = pool_snapshot(scheduler.kv_cache_manager)
    assert (reset.held_blocks, reset.idle_cached_blocks, reset.free_blocks) == (0, 0, POOL_BLOCKS)
    llm.llm_engine.engine_core.shutdown()

    assert len(seen) > 50
    assert max(look["preemptions"] for look in seen) > 0, (
        f"the small pool never preempted (at most {max(look['pool'].held_blocks for look in seen)} blocks held)")
    shared_steps = 0
    for look in seen:
        pool = look["pool"]
        assert pool.pool_blocks == POOL_BLOCKS
        assert pool.held_blocks == look["used"], look["when"]  # what requests reference is what vLLM counts as used
        assert sum(pool.effective_blocks, Fraction(0)) == pool.held_blocks
        # conservation, from two sources: the requests' block lists (held) and the pool's ref counts (idle, free)
        assert pool.held_blocks + pool.idle_cached_blocks + look["free"] == POOL_BLOCKS, look["when"]
        assert set(look["blocks"]) <= look["running"], look["when"]  # only running requests hold blocks
        readers: dict[int, int] = {}
        for ids in look["blocks"].values():
            for block in ids:
                readers[block] = readers.get(block, 0) + 1
        if any(k > 1 for k in readers.values()):
            shared_steps += 1
            shares = dict(zip(pool.holders, pool.effective_blocks))
            assert any(shares[r] < len(ids) for r, ids in look["blocks"].items())  # a reader pays part of a block
    assert shared_steps > 10, "the document's blocks were never held by two requests at once"
    assert any(look["pool"].idle_cached_blocks > 0 for look in seen), "no cached block was ever left idle"
