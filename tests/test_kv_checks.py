"""The checks the engine tests run at every KV meter reading (`_kv_checks.check_reading`, used by test_vllm_kv_holdings
in process and by the served engine's checking scheduler in test_vllm_kv_served) can fail: on a real vLLM KV cache
manager (no engine: its block pool, prefix caching on, requests allocated and freed as the scheduler does), the
recorder's own readers pass, and each way a reading or the pool can go wrong is reported."""

from __future__ import annotations

import pytest

from _kv_checks import check_reading
from llmvisor.engines.vllm.kv_holdings import IdleCacheCount, engine_used_blocks, request_holdings

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 4
POOL_BLOCKS = 8


@pytest.fixture
def pool():
    """A pool of 8 blocks of 4 tokens: requests a and b read a 2-block document (a: 3 blocks, b: 3 with its own
    partial one), c ran and finished, leaving one full block cached and unreferenced (idle), and 3 blocks free."""
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=POOL_BLOCKS + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=32, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                             enable_caching=True)
    idle = IdleCacheCount(manager.block_pool)  # the recorder's running count, wrapping the pool before any change
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    document = list(range(100, 108))
    requests = {}
    for name, tokens in (("a", document + [1, 2, 3, 4]), ("b", document + [5, 6]), ("c", [7, 8, 9, 10, 11])):
        request = Request(name, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        hits, num_hits = manager.get_computed_blocks(request)[:2]
        assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is not None
        request.num_computed_tokens = request.num_tokens
        requests[name] = request
    manager.free(requests["c"])
    return manager, idle


def recorder_reading(manager, idle: IdleCacheCount) -> dict:
    """What the recorder hands its meter (`RecordingScheduler._kv_observe`)."""
    held = engine_used_blocks(manager)
    return {"holders": request_holdings(manager, held), "held": held, "idle": idle.count, "idle_count": idle.count}


def test_the_recorders_reading_of_a_real_pool_passes(pool):
    manager, idle = pool
    reading = recorder_reading(manager, idle)
    check = check_reading(manager, {"a", "b"}, **reading)
    assert check.mismatches == []
    assert (check.pool.held_blocks, check.pool.idle_cached_blocks, check.free) == (4, 1, 3)
    assert reading["holders"] == {"a": 2.0, "b": 2.0} and check.shared


@pytest.mark.parametrize("wrong, expected", [
    ({"held": 5}, "meter given held 5"),
    ({"idle": 0}, "meter given held 4, idle 0"),
    ({"idle_count": 2}, "running idle count 2"),
    ({"holders": {"a": 3.0, "b": 1.0}}, "meter given shares"),  # a shared block billed whole to one reader
    ({"holders": {"a": 4.0}}, "meter given holders ['a']"),
])
def test_a_reading_that_differs_from_the_pool_is_reported(pool, wrong, expected):
    manager, idle = pool
    check = check_reading(manager, {"a", "b"}, **{**recorder_reading(manager, idle), **wrong})
    assert len(check.mismatches) == 1 and expected in check.mismatches[0], check.mismatches


def test_a_block_the_engine_counts_used_that_no_request_references_is_reported(pool):
    manager, idle = pool
    manager.block_pool.get_new_blocks(1)  # taken from the free queue, in no request's list
    check = check_reading(manager, {"a", "b"}, **recorder_reading(manager, idle))
    assert "requests reference 4 blocks, the engine counts 5 used" in check.mismatches
    assert "4 held + 1 idle + 2 free != pool 8" in check.mismatches


def test_blocks_held_by_a_request_not_running_are_reported(pool):
    manager, idle = pool
    check = check_reading(manager, {"a"}, **recorder_reading(manager, idle))
    assert check.mismatches == ["requests not running hold blocks: ['b']"]
