"""The fair scheduler's per-tenant counters: VTC's (`VirtualTokenCounter`) and DRF's over engine time and KV
memory-time (`DominantResourceCounter`). Engine-free; `llmvisor.fairness.policy.FairShare` drives them and
`llmvisor.fairness.policy` re-exports both."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from llmvisor.errors import LlmvisorError
from llmvisor.fairness.shared_counters import SharedCounters


class VirtualTokenCounter:
    """VTC's counters: weighted service per tenant, lift on return, lowest counter first.

    Counters are in cost units per unit weight. ``backlog`` counts each tenant's waiting requests; a tenant
    is backlogged while it is above zero. Reservations (`reserve`) are provisional charges within one
    scheduling pass, cleared by `clear_reservations`. With ``shared`` set, every change to a counter (charge,
    lift) is also handed to it for the pool, and new tenants start from the pool's counter.
    """

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0):
        self.weights = dict(weights or {})
        self.default_weight = float(default_weight)
        self.counter: dict[str, float] = {}
        self.served: dict[str, float] = {}
        self.backlog: dict[str, int] = {}
        self.reserved: dict[str, float] = {}
        self.order: dict[str, int] = {}
        self.last_departed: float | None = None
        self.num_lifts = 0
        self.shared: SharedCounters | None = None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def _register(self, tenant: str) -> None:
        if tenant not in self.order:
            self.order[tenant] = len(self.order)
            self.counter[tenant] = 0.0 if self.shared is None else self.shared.value(tenant)
            self.served[tenant] = 0.0
            self.backlog[tenant] = 0

    def key(self, tenant: str) -> float:
        """What admission order and preemption compare: the counter plus this pass's reservations."""
        return self.counter.get(tenant, 0.0) + self.reserved.get(tenant, 0.0)

    def backlogged(self) -> list[str]:
        return [t for t, n in self.backlog.items() if n > 0]

    def arrive(self, tenant: str) -> None:
        """A new request from ``tenant`` joins the queue; lift its counter if it was not backlogged."""
        self._register(tenant)
        if self.backlog[tenant] == 0:
            others = [self.counter[t] for t, n in self.backlog.items() if n > 0 and t != tenant]
            floor = min(others) if others else self.last_departed
            if floor is not None and floor > self.counter[tenant]:
                self.counter[tenant] = floor
                self.num_lifts += 1
                if self.shared is not None:
                    self.shared.lift(tenant, floor)
        self.backlog[tenant] += 1

    def requeue(self, tenant: str, n: int = 1) -> None:
        """Requests return to the queue (preempted, or skipped this pass): backlogged again, no lift."""
        self._register(tenant)
        self.backlog[tenant] += n

    def leave(self, tenant: str, n: int = 1) -> None:
        """Requests leave the queue (admitted or finished while waiting)."""
        left = self.backlog[tenant] - n
        if left < 0:
            raise LlmvisorError(f"tenant {tenant!r} left the queue more often than it joined")
        self.backlog[tenant] = left
        if left == 0:
            self.last_departed = self.counter[tenant]

    def charge(self, tenant: str, cost: float) -> None:
        self._register(tenant)
        self.served[tenant] += cost
        amount = cost / self.weight(tenant)
        self.counter[tenant] += amount
        if self.shared is not None:
            self.shared.charge(tenant, amount)

    def reserve(self, tenant: str, cost: float) -> None:
        self.reserved[tenant] = self.reserved.get(tenant, 0.0) + cost / self.weight(tenant)

    def unreserve(self, tenant: str, cost: float) -> None:
        self.reserved[tenant] = self.reserved.get(tenant, 0.0) - cost / self.weight(tenant)

    def clear_reservations(self) -> None:
        self.reserved.clear()

    def lowest(self, tenants: Iterable[str]) -> str | None:
        """The tenant with the lowest key; ties go to the tenant seen first."""
        best = None
        best_key = (math.inf, math.inf)
        for tenant in tenants:
            key = (self.key(tenant), self.order.get(tenant, math.inf))
            if key < best_key:
                best, best_key = tenant, key
        return best

    def snapshot(self) -> dict[str, float]:
        return {t: self.key(t) for t in self.order}



# --------------------------------------------------------------------------------------------------------
# DRF


class DominantResourceCounter(VirtualTokenCounter):
    """Dominant Resource Fairness (Ghodsi et al., NSDI'11) over the engine's two resources, kept as VTC keeps one.

    Per tenant, two weighted counters: ``counter`` (attributed engine seconds / weight, charged per step exactly
    as attributed VTC charges) and ``memory`` (KV block-nanoseconds / weight, charged per pool reading by
    `charge_memory`: what the tenant's requests held, blocks counted while they are held, not only while they run).
    The capacities they are shares of grow as the engine runs: ``engine_s``, the engine seconds charged so far (the
    steps' measured time), and ``pool_block_ns``, the pool's blocks × the wall time metered so far. A tenant's
    dominant share (its `key`) is the larger of ``(counter + reserved) / engine_s`` and ``memory / pool_block_ns``;
    the backlogged tenant with the lowest is admitted next (ties to the tenant seen first), as VTC admits the
    lowest counter.

    Lift on return, as VTC's: a tenant whose queue was empty and gets a request has its dominant share raised to
    the lowest dominant share among backlogged tenants (or to that of the last tenant whose queue emptied, from its
    counters when it left), by raising each of its two counters to that share of its capacity; idle time banks no
    credit in either resource. With one resource this orders tenants exactly as VTC's counters do. Counters are
    local to this engine (no ``shared``: a pool's replicas do not share a KV pool)."""

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0):
        super().__init__(weights, default_weight)
        self.memory: dict[str, float] = {}
        self.memory_served: dict[str, float] = {}
        self.engine_s = 0.0
        self.pool_block_ns = 0.0
        self._departed: tuple[float, float] | None = None

    def _register(self, tenant: str) -> None:
        if tenant not in self.order:
            super()._register(tenant)
            self.memory[tenant] = 0.0
            self.memory_served[tenant] = 0.0

    def shares(self, tenant: str) -> tuple[float, float]:
        """(time share, memory share) of ``tenant``'s counters, this pass's reservations left out."""
        return self._share_of(self.counter.get(tenant, 0.0), self.memory.get(tenant, 0.0))

    def _share_of(self, time_counter: float, memory_counter: float) -> tuple[float, float]:
        time_share = time_counter / self.engine_s if self.engine_s > 0 else 0.0
        memory_share = memory_counter / self.pool_block_ns if self.pool_block_ns > 0 else 0.0
        return time_share, memory_share

    def dominant_share(self, tenant: str) -> float:
        return max(self.shares(tenant))

    def key(self, tenant: str) -> float:
        """The dominant share, with this pass's reservations (engine seconds) added to the time counter."""
        counter = self.counter.get(tenant, 0.0) + self.reserved.get(tenant, 0.0)
        if self.engine_s > 0:
            time_share = counter / self.engine_s
        else:  # nothing charged yet: reservations alone order the first pass
            time_share = counter
        memory_share = self.memory.get(tenant, 0.0) / self.pool_block_ns if self.pool_block_ns > 0 else 0.0
        return max(time_share, memory_share)

    def arrive(self, tenant: str) -> None:
        """A new request from ``tenant``; if it was not backlogged, lift its dominant share to the floor."""
        self._register(tenant)
        if self.backlog[tenant] == 0:
            others = [self.dominant_share(t) for t, n in self.backlog.items() if n > 0 and t != tenant]
            floor = min(others) if others else (max(self._share_of(*self._departed)) if self._departed is not None else None)
            if floor is not None and floor > self.dominant_share(tenant):
                self.counter[tenant] = max(self.counter[tenant], floor * self.engine_s)
                self.memory[tenant] = max(self.memory[tenant], floor * self.pool_block_ns)
                self.num_lifts += 1
        self.backlog[tenant] += 1

    def leave(self, tenant: str, n: int = 1) -> None:
        super().leave(tenant, n)
        if self.backlog[tenant] == 0:
            self._departed = (self.counter[tenant], self.memory[tenant])

    def charge(self, tenant: str, cost: float) -> None:
        """Attributed engine seconds (a correction may be negative); the time capacity grows by the same amount."""
        super().charge(tenant, cost)
        self.engine_s += cost

    def charge_memory(self, block_ns: Mapping[str, float], pool_block_ns: float) -> None:
        """One stretch of wall time: each tenant's held block-nanoseconds, and the pool's blocks × the stretch."""
        for tenant, value in block_ns.items():
            self._register(tenant)
            self.memory_served[tenant] += value
            self.memory[tenant] += value / self.weight(tenant)
        self.pool_block_ns += pool_block_ns
