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

