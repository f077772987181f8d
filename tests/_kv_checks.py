"""The KV meter's reading checked against vLLM's own block pool, the slow, exact way: one function for the in-process
engine (test_vllm_kv_holdings), the served engine's checking scheduler (_kv_served_probe, in the engine-core process)
and the checks' own test on a bare KV cache manager (test_kv_checks).

A reading is what the recorder hands its meter: each holder's effective blocks, the held blocks and the idle cached
blocks, plus the recorder's running idle count. Against the pool they must agree on: the blocks requests reference
(their block lists, read whole) being what vLLM counts as used (the pool less its free queue); the holders' shares
(1/k of a block k requests reference, `pool_snapshot`'s rule) summing to it; held + idle cache + free blocks (free
counted from the blocks' own reference counts and hashes) filling the pool; only running requests holding blocks;
and the meter having been given exactly those holders, shares, held and idle counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from llmvisor.core.kv_memory import KvMemoryError, PoolSnapshot
from llmvisor.engines.vllm.kv_holdings import blocks_by_request, engine_used_blocks, pool_snapshot

SHARE_TOLERANCE = 1e-9
"""The meter's shares are floats (Σ 1/k from reference counts); the exact ones are Fractions."""


@dataclass
class PoolCheck:
    """The pool read the exact way at one reading, and what in the reading disagrees with it (empty: nothing)."""

    pool: PoolSnapshot | None
    used: int
    blocks: dict[str, list[int]]
    free: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        """Some block is referenced by two or more requests."""
        readers = Counter(b for ids in self.blocks.values() for b in ids)
        return any(k > 1 for k in readers.values())


def free_by_ref_counts(kv_cache_manager) -> int:
    """Free blocks counted from the pool's own blocks (no reference, no hash), not from the holders' lists."""
    return sum(1 for b in kv_cache_manager.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is None and not b.is_null)


def check_reading(kv_cache_manager, running_ids, holders, held: int, idle: int, idle_count: int) -> PoolCheck:
    """The pool as it stands against one reading of the meter (``holders``, ``held``, ``idle``) and the recorder's
    running idle count (``idle_count``)."""
    used = engine_used_blocks(kv_cache_manager)
    blocks = blocks_by_request(kv_cache_manager)
    free = free_by_ref_counts(kv_cache_manager)
    try:
        pool = pool_snapshot(kv_cache_manager)
    except KvMemoryError as error:
        return PoolCheck(None, used, blocks, free, [f"the pool cannot be read: {error}"])
    out = PoolCheck(pool, used, blocks, free)
    wrong = out.mismatches.append
    if pool.held_blocks != used:
        wrong(f"requests reference {pool.held_blocks} blocks, the engine counts {used} used")
    if sum(pool.effective_blocks, Fraction(0)) != pool.held_blocks:
        wrong(f"shares sum to {sum(pool.effective_blocks, Fraction(0))}, not the {pool.held_blocks} blocks held")
    if pool.held_blocks + pool.idle_cached_blocks + free != pool.pool_blocks:
        wrong(f"{pool.held_blocks} held + {pool.idle_cached_blocks} idle + {free} free != pool {pool.pool_blocks}")
    not_running = sorted(set(blocks) - set(running_ids))
    if not_running:
        wrong(f"requests not running hold blocks: {not_running}")
    if (held, idle, idle_count) != (pool.held_blocks, pool.idle_cached_blocks, pool.idle_cached_blocks):
        wrong(f"meter given held {held}, idle {idle}, running idle count {idle_count}; the pool has held "
              f"{pool.held_blocks}, idle {pool.idle_cached_blocks}")
    exact = dict(zip(pool.holders, pool.effective_blocks))
    if holders.keys() != exact.keys():
        wrong(f"meter given holders {sorted(holders)}, the pool's are {sorted(exact)}")
    else:
        off = {h: (holders[h], float(exact[h])) for h in exact if abs(holders[h] - float(exact[h])) >= SHARE_TOLERANCE}
        if off:
            wrong(f"meter given shares (given, exact) {off}")
    return out
