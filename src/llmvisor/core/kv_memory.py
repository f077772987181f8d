"""KV-cache memory-time: who holds the engine's KV blocks, for how long, in block-nanoseconds.

Step time is one resource a request uses; the KV blocks it holds are the other (vLLM admits and preempts by free
blocks). This module is the one place that turns what the engine's block pool looked like over an interval into
per-holder block-nanoseconds, so that whatever meters memory meters it alike: `KvMeter` is the recorder's meter
(`llmvisor.engines.vllm.recorder`, which writes trace format 3), fed by the engine reading in
`llmvisor.engines.vllm.kv_holdings`. `snapshot` sums exact fractions per block (checks, small pools); the engine's
per-step reading counts the same shares as floats from the blocks' reference counts.

The rule, per interval of wall time in which the pool did not change (between two of the engine's block
allocations or frees):

- a block held by k requests (prefix caching: a shared prompt's blocks are referenced by every request reading
  them) is split equally among them, 1/k each, for the whole interval, whether or not a holder ran tokens in the
  step (a request in the running set that the token budget skipped still keeps its blocks from everyone else);
- a cached block that no request holds (evictable, in the pool's free queue with its hash) is the pool's **idle
  cache**, billed to no one: any new request may evict it, so none keeps it from the others;
- the rest of the pool is **free**.

So at every instant Σ holders' shares + idle cache + free = the pool, and over an interval of ``interval_ns``
the holders' block-nanoseconds sum to ``held_blocks × interval_ns`` exactly: `apportion_block_ns` hands out
that integer with each holder within one block-nanosecond of its exact share (the equal split among readers is
the only rounding).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from llmvisor.errors import LlmvisorError

GIB = 1 << 30
NS_PER_S = 1_000_000_000


class KvMemoryError(LlmvisorError, ValueError):
    """A pool snapshot that cannot be (more held than the pool, negative counts, shares that do not add up)."""


def kv_block_bytes(*, num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int, block_size: int,
                   kv_factor: int = 2) -> int:
    """Bytes one KV block occupies across the model's layers: ``kv_factor`` (2: a key and a value; 1 for MLA's
    joint latent) × layers × KV heads × head size × bytes per element × tokens per block. vLLM's per-layer
    ``page_size_bytes`` of a full-attention spec is this without the layer factor."""
    factors = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_size": head_size,
               "dtype_bytes": dtype_bytes, "block_size": block_size, "kv_factor": kv_factor}
    for name, value in factors.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise KvMemoryError(f"kv_block_bytes: {name}: expected a positive integer, got {value!r}")
    return int(kv_factor * num_layers * num_kv_heads * head_size * dtype_bytes * block_size)


def gib_seconds(block_ns, block_bytes: int) -> np.ndarray:
    """Block-nanoseconds as GiB-seconds (float; the ledger keeps the integer block-nanoseconds)."""
    return np.asarray(block_ns, dtype=np.float64) * (block_bytes / GIB / NS_PER_S)


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool as it stood over one interval.

    ``holders``: each holder (a request id) and its share of the held blocks, Σ 1/k over the blocks it references
    (`effective_blocks`); ``held_blocks``: blocks at least one request references (vLLM's used blocks);
    ``idle_cached_blocks``: cached blocks no request references; ``pool_blocks``: the blocks requests can use
    (vLLM's ``num_gpu_blocks`` less its null block)."""

    holders: tuple[Hashable, ...]
    effective_blocks: tuple[Fraction, ...]
    held_blocks: int
    idle_cached_blocks: int
    pool_blocks: int

    @property
    def free_blocks(self) -> int:
        return self.pool_blocks - self.held_blocks - self.idle_cached_blocks


def snapshot(blocks_by_holder: Mapping[Hashable, Iterable[int]], *, pool_blocks: int, idle_cached_blocks: int) -> PoolSnapshot:
    """The pool from each holder's block ids (the KV cache manager's per-request block lists): a block listed by
    k holders is theirs 1/k each. Refused, naming the reason: a count below 0, a holder listing one block twice,
    or more blocks held and cached than the pool has."""
    if pool_blocks < 0 or idle_cached_blocks < 0:
        raise KvMemoryError(f"pool_blocks ({pool_blocks}) and idle_cached_blocks ({idle_cached_blocks}) must be >= 0")
    lists = {holder: list(ids) for holder, ids in blocks_by_holder.items()}
    readers: Counter[int] = Counter()
    for holder, ids in lists.items():
        if len(set(ids)) != len(ids):
            raise KvMemoryError(f"holder {holder!r} lists a block more than once")
        readers.update(ids)
    held = len(readers)
    if held + idle_cached_blocks > pool_blocks:
        raise KvMemoryError(
            f"{held} held + {idle_cached_blocks} idle cached blocks, more than the pool's {pool_blocks}")
    shares = tuple(sum((Fraction(1, readers[b]) for b in ids), Fraction(0)) for ids in lists.values())
    return PoolSnapshot(tuple(lists), shares, held, idle_cached_blocks, pool_blocks)


def apportion_block_ns(effective_blocks, held_blocks: int, interval_ns: int) -> np.ndarray:
    """Each holder's block-nanoseconds over an interval: ``held_blocks × interval_ns`` handed out in proportion to
    the holders' effective blocks, largest remainder (Hamilton), so they sum to it exactly and each is within one
    block-nanosecond of ``effective × interval_ns``. ``effective_blocks`` must sum to ``held_blocks`` (exactly, as
    Fractions or integers; within 1e-9 per holder as floats, the form a trace file carries)."""
    if isinstance(held_blocks, bool) or held_blocks < 0 or interval_ns < 0:
        raise KvMemoryError(f"held_blocks ({held_blocks}) and interval_ns ({interval_ns}) must be >= 0")
    values = list(effective_blocks)
    if any(v < 0 for v in values):
        raise KvMemoryError("a holder's effective blocks are negative")
    total = sum(values, Fraction(0)) if all(isinstance(v, (int, Fraction)) for v in values) else float(sum(values))
    tolerance = 0 if isinstance(total, Fraction) else 1e-9 * max(len(values), 1)
    if abs(total - held_blocks) > tolerance:
        raise KvMemoryError(f"holders' effective blocks sum to {float(total):g}, not the {held_blocks} blocks held")
    out = np.zeros(len(values), dtype=np.int64)
    budget = int(held_blocks) * int(interval_ns)
    if not values or budget == 0:
        return out
    if isinstance(total, Fraction):
        exact = [Fraction(v) * interval_ns for v in values]
        floors = [int(e) for e in exact]  # e >= 0: int() floors
        remainders = [e - f for e, f in zip(exact, floors)]
    else:
        exact_f = np.asarray(values, dtype=np.float64) / float(total) * budget
        floors = np.floor(exact_f).astype(np.int64).tolist()
        remainders = (exact_f - np.floor(exact_f)).tolist()
    out[:] = floors
    left = budget - int(out.sum())
    if left:
        # The largest remainders get the leftover nanoseconds; ties go to the earlier holder (a stable order).
        order = sorted(range(len(values)), key=lambda i: -remainders[i])
        for i in order[:left]:
            out[i] += 1
    return out


@dataclass(frozen=True)
class IntervalUsage:
    """One interval's block-nanoseconds: per holder (aligned with the snapshot's ``holders``), idle cache, free."""

    holders: tuple[Hashable, ...]
    block_ns: np.ndarray
    idle_cached_block_ns: int
    free_block_ns: int
    pool_block_ns: int


def interval_usage(pool: PoolSnapshot, interval_ns: int) -> IntervalUsage:
    """The snapshot held for ``interval_ns``: the holders' apportioned block-nanoseconds, idle cache and free, which
    add up to ``pool_blocks × interval_ns`` exactly."""
    block_ns = apportion_block_ns(pool.effective_blocks, pool.held_blocks, interval_ns)
    return IntervalUsage(pool.holders, block_ns, pool.idle_cached_blocks * interval_ns, pool.free_blocks * interval_ns,
                         pool.pool_blocks * interval_ns)


MAX_UNHELD_SEGMENT_NS = 3600 * NS_PER_S
"""The longest stretch with no holder (an idle engine) that one step's interval counts: a pool of up to 2.5 million
blocks × one hour fits the trace's 64-bit block-nanoseconds. Idle time beyond it is not metered (no one held
anything in it)."""


@dataclass(frozen=True)
class StepKv:
    """The pool over one recorded step's interval (the wall time since the previous recorded step's): idle cache,
    free, and the block-nanoseconds that cross steps. ``carried_in``: part of this step's slices' block-ns held
    before this interval (while the request waited unscheduled); ``carried_out``: held in this interval by requests
    with no slice in this step, billed in their next slice (or never, for a request that left between steps).
    Per step: Σ slices' block-ns − carried_in + carried_out + idle + free = pool × interval."""

    interval_ns: int
    idle_cached_block_ns: int
    free_block_ns: int
    carried_in_block_ns: int
    carried_out_block_ns: int


class KvMeter:
    """Per-request KV block-nanoseconds over wall time, handed out at each recorded step.

    `observe` is called whenever the pool may have changed (after the engine schedules, after it processes an
    output, after it aborts requests): the time since the previous call is billed by the pool as it stood then.
    `drain` closes a recorded step: each of its slices gets what its request held since its previous slice,
    holders' block-ns apportioned to sum exactly to the held blocks × time (`apportion_block_ns`). Engine-free:
    the engine side reads the holdings."""

    def __init__(self, pool_blocks: int, now_ns: int) -> None:
        if pool_blocks < 0:
            raise KvMemoryError(f"pool_blocks ({pool_blocks}) must be >= 0")
        self.pool_blocks = int(pool_blocks)
        self._since_ns = int(now_ns)
        self._holders: dict[Hashable, float] = {}
        self._held = 0
        self._idle = 0
        self._exact: dict[Hashable, float] = {}
        self._held_ns = 0
        self._idle_ns = 0
        self._interval_ns = 0
        self._carried: dict[Hashable, int] = {}
        self._gone: set[Hashable] = set()

    def observe(self, now_ns: int, holders: Mapping[Hashable, float], held_blocks: int, idle_cached_blocks: int) -> None:
        """Bill the time since the last call to the pool as it stood, then take the pool as it stands now:
        ``holders`` maps each request to its effective blocks (Σ 1/k over the blocks it references), which
        must sum to ``held_blocks``."""
        self.advance(now_ns)
        if held_blocks < 0 or idle_cached_blocks < 0 or held_blocks + idle_cached_blocks > self.pool_blocks:
            raise KvMemoryError(
                f"{held_blocks} held + {idle_cached_blocks} idle cached blocks: not within the pool's {self.pool_blocks}")
        total = sum(holders.values())
        if abs(total - held_blocks) > 1e-6 * max(len(holders), 1):
            raise KvMemoryError(f"holders' effective blocks sum to {total:g}, not the {held_blocks} blocks held")
        self._holders = holders if isinstance(holders, dict) else dict(holders)
        self._held = int(held_blocks)
        self._idle = int(idle_cached_blocks)

    def advance(self, now_ns: int) -> None:
        """Bill the time since the last call to the pool as it stood, which still stands (no reading needed)."""
        dt = int(now_ns) - self._since_ns
        if dt > 0:
            if not self._holders:
                dt = min(dt, MAX_UNHELD_SEGMENT_NS)
            self._interval_ns += dt
            self._held_ns += self._held * dt
            self._idle_ns += self._idle * dt
            exact = self._exact
            for request, blocks in self._holders.items():
                exact[request] = exact.get(request, 0.0) + blocks * dt
            self._since_ns = int(now_ns)

    @property
    def reading(self) -> tuple[int, Mapping[Hashable, float]]:
        """(the time in ns the meter has billed up to, each holder's effective blocks as last observed): right after
        `observe`, the pool as it stands from then until the next reading. A scheduler that charges memory as it goes
        reads it there (do not change the mapping)."""
        return self._since_ns, self._holders

    def discard(self) -> None:
        """Drop what was metered since the last `drain` (and what waits to be carried) when no step will take it:
        a meter read only through `reading` stays bounded."""
        self._exact = {}
        self._held_ns = self._idle_ns = self._interval_ns = 0
        self._carried.clear()
        self._gone.clear()

    def forget(self, request) -> None:
        """A request that left (aborted) with no slice to come: what it held is carried out and never billed."""
        self._carried.pop(request, None)
        self._gone.add(request)

    def drain(self, requests) -> tuple[list[int], StepKv]:
        """Close a recorded step whose slices are ``requests``: each one's block-ns since its previous slice, and
        the step's `StepKv`."""
        exact = self._exact
        block_ns = dict(zip(exact, _apportion(list(exact.values()), self._held_ns)))
        carried, gone = self._carried, self._gone
        out = []
        carried_in = 0
        for request in requests:
            earlier = carried.pop(request, 0)
            carried_in += earlier
            out.append(earlier + block_ns.pop(request, 0))
            gone.discard(request)
        carried_out = 0
        for request, value in block_ns.items():
            carried_out += value
            if request in gone:
                gone.discard(request)
            elif value:
                carried[request] = carried.get(request, 0) + value
        step = StepKv(self._interval_ns, self._idle_ns, self.pool_blocks * self._interval_ns - self._held_ns - self._idle_ns,
                      carried_in, carried_out)
        self._exact = {}
        self._held_ns = self._idle_ns = self._interval_ns = 0
        return out, step

    @property
    def num_carried(self) -> int:
        """Requests whose block-ns wait for their next slice."""
        return len(self._carried)


def _apportion(weights: list[float], budget: int) -> list[int]:
    """``budget`` (an integer) split in proportion to nonnegative float ``weights`` by largest remainder, in exact
    integer arithmetic (weights to 2^-20): the parts sum to the budget and each is within one unit of its exact
    share. A budget with no positive weight to take it is refused."""
    if not weights:
        if budget:
            raise KvMemoryError(f"{budget} block-ns held with no holder")
        return []
    if budget < 1 << 40 and len(weights) < 1 << 10:
        # floats carry budget × weight / total to well under 1e-3 here: the same parts, without big integers
        total_f = math.fsum(weights)
        if total_f > 0:
            exact = [budget * w / total_f for w in weights]
            parts = [math.floor(e) for e in exact]
            left = budget - sum(parts)
            if 0 <= left <= len(parts):
                if left:
                    for i in sorted(range(len(parts)), key=lambda i: exact[i] - parts[i], reverse=True)[:left]:
                        parts[i] += 1
                return parts
    scaled = [int(w * 1048576.0) for w in weights]
    total = sum(scaled)
    if total <= 0:
        if budget:
            raise KvMemoryError(f"{budget} block-ns held with no holder")
        return [0] * len(weights)
    parts = []
    remainders = []
    for q in scaled:
        part, remainder = divmod(budget * q, total)
        parts.append(part)
        remainders.append(remainder)
    left = budget - sum(parts)
    if left:
        # the largest remainders get the leftover units; ties go to the earlier holder
        for i in sorted(range(len(parts)), key=remainders.__getitem__, reverse=True)[:left]:
            parts[i] += 1
    return parts
