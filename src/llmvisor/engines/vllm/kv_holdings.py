"""Who holds vLLM's KV blocks right now: the engine's block pool read into `llmvisor.core.kv_memory`'s snapshot.

A request's blocks are the KV cache manager's per-request lists (``req_to_blocks``, one per KV cache group; the
groups draw from one block pool, so a request's blocks are the union over groups). vLLM's null block (a
placeholder, never allocated) is no one's and not part of the pool. A cached block no request references sits in
the pool's free queue with its hash: the idle cache. What the engine reports as used (``get_usage``: the pool less
its null block, less the free queue) is what requests reference; `engine_used_blocks` reads it for the check.
"""

from __future__ import annotations

from llmvisor.core.kv_memory import PoolSnapshot, snapshot


def blocks_by_request(kv_cache_manager) -> dict[str, list[int]]:
    """Each request's referenced block ids, over every KV cache group, the null block left out."""
    out: dict[str, list[int]] = {}
    for manager in kv_cache_manager.coordinator.single_type_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            ids = [block.block_id for block in blocks if not block.is_null]
            if ids:
                out.setdefault(request_id, []).extend(ids)
    return out


def pool_blocks(kv_cache_manager) -> int:
    """The blocks requests can be given: vLLM's ``num_gpu_blocks`` less its null block."""
    return kv_cache_manager.block_pool.num_gpu_blocks - 1


def idle_cached_blocks(kv_cache_manager) -> int:
    """Cached blocks that no request references (evictable; in the free queue with a hash). One pass over the pool:
    the recorder will need a running count kept from vLLM's allocations and frees before it reads this per step."""
    return sum(1 for block in kv_cache_manager.block_pool.blocks
               if block.ref_cnt == 0 and block.block_hash is not None and not block.is_null)


def engine_used_blocks(kv_cache_manager) -> int:
    """The blocks vLLM counts as in use (its ``get_usage`` × pool): the pool less the free queue."""
    return pool_blocks(kv_cache_manager) - kv_cache_manager.block_pool.get_num_free_blocks()


def pool_snapshot(kv_cache_manager) -> PoolSnapshot:
    """The pool as it stands: each request's share of its blocks (1/k of a block k requests reference), the idle
    cache and the free blocks (`llmvisor.core.kv_memory`)."""
    return snapshot(blocks_by_request(kv_cache_manager), pool_blocks=pool_blocks(kv_cache_manager),
                    idle_cached_blocks=idle_cached_blocks(kv_cache_manager))
