"""Who holds vLLM's KV blocks right now: the engine's block pool read into `llmvisor.core.kv_memory`'s snapshot.

A request's blocks are the KV cache manager's per-request lists (``req_to_blocks``, one per KV cache group; the
groups draw from one block pool, so a request's blocks are the union over groups). vLLM's null block (a
placeholder, never allocated) is no one's and not part of the pool. A cached block no request references sits in
the pool's free queue with its hash: the idle cache. What the engine reports as used (``get_usage``: the pool less
its null block, less the free queue) is what requests reference; `engine_used_blocks` reads it for the check.

The recorder's per-step reading is cheaper than `pool_snapshot`: `request_holdings` reads each request's shares from
its blocks' reference counts, and `IdleCacheCount` keeps the idle cache as a running count.
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


def is_idle_cached(block) -> bool:
    """A cached block that no request references (evictable; in the free queue with a hash), vLLM's null block aside."""
    return block.ref_cnt == 0 and block.block_hash is not None and not block.is_null


def idle_cached_blocks(kv_cache_manager) -> int:
    """The pool's idle cached blocks (`is_idle_cached`), from one pass over the pool; the recorder keeps a running
    count instead (`IdleCacheCount`)."""
    return sum(1 for block in kv_cache_manager.block_pool.blocks if is_idle_cached(block))


def engine_used_blocks(kv_cache_manager) -> int:
    """The blocks vLLM counts as in use (its ``get_usage`` × pool): the pool less the free queue."""
    return pool_blocks(kv_cache_manager) - kv_cache_manager.block_pool.get_num_free_blocks()


def pool_snapshot(kv_cache_manager) -> PoolSnapshot:
    """The pool as it stands: each request's share of its blocks (1/k of a block k requests reference), the idle
    cache and the free blocks (`llmvisor.core.kv_memory`)."""
    return snapshot(blocks_by_request(kv_cache_manager), pool_blocks=pool_blocks(kv_cache_manager),
                    idle_cached_blocks=idle_cached_blocks(kv_cache_manager))


class IdleCacheCount:
    """The pool's idle cached blocks (unreferenced, hashed), kept as a running count instead of a pass over the
    pool at every step. The block pool's own methods are wrapped on this one instance, each adjusting the count by
    the blocks it moves into or out of the idle cache: `free_blocks` (a freed hashed block becomes idle), `touch` (a
    prefix hit takes an idle block back), `_maybe_evict_cached_block` (an allocation or eviction drops its hash),
    `unpin_blocks` and `reset_prefix_cache`. vLLM's logic runs unchanged; `scan` recounts, for checks.

    ``refs_changed`` is set whenever a wrapped call may have changed a held block's reference count (a free, a prefix
    hit, an unpin, a reset); a new block vLLM hands out starts at one reference and changes no one else's share.
    `RequestHoldings` clears it once it has re-read the shares."""

    def __init__(self, block_pool) -> None:
        self.block_pool = block_pool
        self.count = self.scan()
        self.refs_changed = True
        pool = block_pool
        free_blocks, touch, evict = pool.free_blocks, pool.touch, pool._maybe_evict_cached_block
        unpin, reset = pool.unpin_blocks, pool.reset_prefix_cache
        idle = is_idle_cached

        def counted_free_blocks(ordered_blocks):
            blocks = list(ordered_blocks)
            self.refs_changed = True
            free_blocks(blocks)
            self.count += sum(1 for b in blocks if (b.pool is None or b.pool is pool) and idle(b))

        def counted_touch(blocks):
            self.refs_changed = True
            self.count -= sum(1 for b in blocks if idle(b))
            touch(blocks)

        def counted_evict(block):
            was_idle = idle(block)
            evicted = evict(block)
            if was_idle and evicted:
                self.count -= 1
            return evicted

        def counted_unpin(blocks, on_reuse):
            blocks = list(blocks)
            self.refs_changed = True
            unpin(blocks, on_reuse)
            self.count += sum(1 for b in blocks if idle(b))

        def counted_reset():
            self.refs_changed = True
            done = reset()
            if done:
                self.count = 0
            return done

        pool.free_blocks, pool.touch, pool._maybe_evict_cached_block = counted_free_blocks, counted_touch, counted_evict
        pool.unpin_blocks, pool.reset_prefix_cache = counted_unpin, counted_reset

    def scan(self) -> int:
        """The count from one pass over the pool (O(pool))."""
        return sum(1 for block in self.block_pool.blocks if is_idle_cached(block))


def _leading_shares(blocks) -> float:
    """A request's effective blocks from its list: shared (ref count > 1) and null blocks read from the front, the
    rest one each."""
    effective = float(len(blocks))
    for block in blocks:
        if block.is_null:
            effective -= 1.0
        elif block.ref_cnt > 1:
            effective -= 1.0 - 1.0 / block.ref_cnt
        else:
            break
    return effective


class RequestHoldings:
    """`request_holdings` kept between readings. A request's share is its block count less a discount (1 − 1/k for
    each block k requests reference, 1 for a null block) that only a reference count change can move; while none
    changed (`IdleCacheCount.refs_changed` clear), new blocks come with one reference each and a new request with no
    shared block, so a reading costs a length per request. Every reading is still checked against the engine's used
    blocks, and re-read in full when it does not add up."""

    def __init__(self, kv_cache_manager, watch: IdleCacheCount) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.watch = watch
        self._discount: dict[str, float] = {}
        self.num_full_reads = 0

    def read(self, num_held_blocks: int) -> dict[str, float]:
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if not self.watch.refs_changed and len(managers) == 1:
            discount = self._discount
            out = {r: len(b) - discount.get(r, 0.0) for r, b in managers[0].req_to_blocks.items()}
            if abs(sum(out.values()) - num_held_blocks) <= 1e-6 * max(len(out), 1):
                return out
        self.watch.refs_changed = False
        self.num_full_reads += 1
        out = request_holdings(self.kv_cache_manager, num_held_blocks)
        if len(managers) == 1:
            self._discount = {r: len(b) - out.get(r, 0.0) for r, b in managers[0].req_to_blocks.items()}
        return out


def request_holdings(kv_cache_manager, num_held_blocks: int) -> dict[str, float]:
    """Each request's effective blocks (Σ 1/k over the blocks it references, k its block's readers), summing to
    ``num_held_blocks`` (the engine's used blocks).

    Fast path: prefix caching shares a prompt's leading blocks, so a request's readers per block fall along its
    list; its shared blocks (ref count > 1) are read from the front, the rest count 1 each. When that does not add
    up to the engine's count (a layout it does not fit), each block's readers are counted from every request's
    list instead (`pool_snapshot`'s rule), which is exact for any layout."""
    out: dict[str, float] = {}
    for manager in kv_cache_manager.coordinator.single_type_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            effective = _leading_shares(blocks)
            if effective > 0:
                out[request_id] = out.get(request_id, 0.0) + effective
    if abs(sum(out.values()) - num_held_blocks) <= 1e-6 * max(len(out), 1):
        return out
    exact = snapshot(blocks_by_request(kv_cache_manager), pool_blocks=num_held_blocks, idle_cached_blocks=0)
    return {holder: float(share) for holder, share in zip(exact.holders, exact.effective_blocks)}


def block_bytes(kv_cache_config, tensor_parallel_size: int = 1) -> int:
    """Bytes of KV memory one block id stands for, over every tensor-parallel rank: `kv_block_bytes` of each KV cache
    group's spec (its layers × KV heads × head size × element bytes × block size; keys and values, or MLA's one
    latent) summed over the groups, which share the pool's block ids, times the ranks (each holds its heads' part)."""
    from llmvisor.core.kv_memory import kv_block_bytes

    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += kv_block_bytes(num_layers=len(group.layer_names), num_kv_heads=int(spec.num_kv_heads),
                                head_size=int(spec.head_size), dtype_bytes=int(spec.dtype.itemsize),
                                block_size=int(spec.block_size), kv_factor=1 if "MLA" in type(spec).__name__ else 2)
    return total * int(tensor_parallel_size)
