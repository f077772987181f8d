"""Fair sharing of an LLM engine among tenants: VTC with a pluggable cost, quotas, SLO admission control.

Engine-agnostic; `llmvisor.engines.vllm.fair` plugs it into vLLM's scheduler.

**VTC** (Sheng et al., OSDI'24, "Fairness in Serving Large Language Models") keeps a virtual counter per
tenant, admits the next request from the backlogged tenant (one with requests waiting) whose counter is
lowest, and charges each tenant for the service it receives. A tenant that returns after its queue emptied
has its counter lifted to the lowest counter among the backlogged tenants (or, when none is backlogged, to the
counter of the last tenant whose queue emptied), so idle time is not banked as credit. With weights, a charge
adds ``cost / weight`` to the counter, so backlogged tenants receive service in proportion to their weights.

The cost is pluggable:

- ``tokens``: VTC's own, prompt tokens ×1 and output tokens ×2 (the weights are configurable);
- ``attributed``: engine seconds. Each step's measured time is split among its requests by llmvisor's
  shares (`llmvisor.core.attribution.StepAttributor`, Shapley by default) and charged at every step, prefill
  chunks and decodes alike. Token counts miss what long contexts cost (attention over the context, KV reads
  in decode); attributed seconds include it, so equal counters mean equal engine time.
- ``drf``: Dominant Resource Fairness over attributed engine seconds (charged as ``attributed``) and KV
  memory-time, the block-nanoseconds a tenant's requests hold while they hold blocks, running or not (the engine
  reports each pool reading to `FairShare.observe_memory`). The tenant with the lowest dominant share (the larger
  of its share of engine time and its share of the pool over wall time) is admitted next
  (`llmvisor.fairness.counters.DominantResourceCounter`).

With a LoRA model (issue #38), ``attributed`` and ``drf`` charge adapters as the bill does: a step's ``LoraSlices``
(`charge_step`'s and `charge_scheduled`'s ``lora``) give each request its adapter's own work and an equal part of its
adapter's per-step kernels and loads (`llmvisor.core.attribution`), so a tenant on a rank-64 adapter reaches its
share of the engine sooner than a base-model tenant with the same tokens.

All are charged per step, as the engine runs the work. Within one scheduling pass an admission also reserves
its predicted prefill cost on its tenant's counter, so one pass does not hand every free slot to the tenant that
was lowest when it began; reservations are dropped once the step's charge lands. An engine that schedules a
step before the previous one's output arrives (a batch queue) charges it when scheduled (`FairShare.charge_scheduled`,
the model's predicted shares) and corrects it to the measured cost when it ran (`charge_step`).

**Quotas**: a per-tenant budget of engine seconds over a sliding window (always attributed seconds, whatever
the VTC cost). A tenant whose window holds its budget or more waits. ``work_conserving`` admits it anyway
when no tenant within budget has a request waiting, i.e. when the engine's free capacity would otherwise idle.

**Admission control**: before admitting a request, the model predicts the decode step time of the running
batch with the request added (``decode_step_after_s``) and the extra time its prefill adds to the steps it
shares with those decodes (``prefill_cost_s``). Running decodes pay that prefill once, over the new request's
output, so the predicted time per output token is ``decode_step_after_s + prefill_cost_s / output_tokens``;
that prediction times ``tpot_prediction_factor`` is compared with ``tpot_slo_s``, and above it the request is
deferred. The factor keeps admission from being optimistic where the model predicts low (held-out runs go
slower than the profiling sweep, see ``AdmissionController``). Admission keeps VTC's order: a deferred head request holds the
tenants behind it until running work finishes (no starvation of expensive requests), and a request is never
deferred while nothing runs. Predictions are closed-form (a few float operations).

**Across replicas** (``shared_counters``): the VTC counters are the pool's, kept in Redis by
`llmvisor.fairness.shared_counters` (bounded staleness, local fallback); queues, lifts' floors and quotas are per
replica.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from llmvisor.core.attribution import StepAttributor
from llmvisor.core.features import LoraSlices
from llmvisor.core.game import (
    TokenPrices,
    decode_prices,
    decode_step_price_s,
    prefill_chunk_price_s,
    segment_of,
)
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.config import (
    COSTS,
    DEFAULT_TENANT,
    ENV_CONFIG,
    POLICIES,
    ChargeCost,
    FairnessConfig,
    Quota,
    SchedulingPolicy,
)
from llmvisor.fairness.counters import DominantResourceCounter, VirtualTokenCounter
from llmvisor.fairness.shared_counters import SharedCounters

__all__ = [
    "COSTS", "DEFAULT_TENANT", "ENV_CONFIG", "POLICIES", "AdmissionController", "AdmissionDecision", "ChargeCost",
    "DominantResourceCounter", "FairShare", "FairnessConfig", "Quota", "SchedulingPolicy", "SlidingWindowQuota",
    "StepCharge", "TokenCost", "VirtualTokenCounter", "jain_index", "max_min_ratio", "sum_by_tenant",
]


# --------------------------------------------------------------------------------------------------------
# Quotas


class SlidingWindowQuota:
    """Engine seconds charged in the last ``window_s`` seconds, against a budget."""

    def __init__(self, quota: Quota):
        self.quota = quota
        self._charges: deque[tuple[float, float]] = deque()
        self._sum_s = 0.0

    def add(self, now_s: float, seconds: float) -> None:
        if seconds > 0:
            self._charges.append((now_s, seconds))
            self._sum_s += seconds

    def used_s(self, now_s: float) -> float:
        start = now_s - self.quota.window_s
        charges = self._charges
        while charges and charges[0][0] <= start:
            self._sum_s -= charges.popleft()[1]
        if not charges:
            self._sum_s = 0.0
        return max(self._sum_s, 0.0)

    def over_budget(self, now_s: float) -> bool:
        return self.used_s(now_s) >= self.quota.budget_s


# --------------------------------------------------------------------------------------------------------
# Admission control


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    predicted_tpot_s: float
    """The model's time per output token times the controller's ``prediction_factor``: what meets the SLO."""
    decode_step_before_s: float
    decode_step_after_s: float
    prefill_cost_s: float
    model_tpot_s: float = math.nan
    """The model's own prediction, before the factor."""


class AdmissionController:
    """Predicts what admitting a request does to the running decodes' time per output token.

    Closed-form on the model's coefficients, priced by the cost game (`llmvisor.core.game`): a decode-only step
    of n requests with total context C costs ``b + d2·C + d4·n + e·C`` (coefficients of the segment its load n
    falls in); a prefill chunk of p tokens over c cached ones adds its own prefill terms to the step it runs in.

    Predictions can run low on runs other than the one fitted (the engine's speed drifts between runs; `llmvisor
    eval` reports the held-out median signed error, ``signed_err_p50``, per phase), so the predicted time per
    output token is multiplied by ``prediction_factor`` before it meets the SLO. Given, it is used as is (e.g. ``llmvisor eval``'s
    held-out ``underprediction_factor_p90``). None takes it from the model's fit: ``1 / (1 − r90)``, r90 the
    90th percentile of the fit's |relative error| (``fit_info.train_rel_err_p90``); a step predicted at p
    then ran in at most p / (1 − r90) for at least nine in ten training steps. A model without fit info
    (built from coefficients) gets 1. ``prediction_factor_source`` says which applied.
    """

    def __init__(
        self,
        model: StepLatencyModel,
        tpot_slo_s: float | None,
        max_chunk_tokens: int = 2048,
        prediction_factor: float | None = None,
    ):
        model.check_is_fitted()
        self.tpot_slo_s = tpot_slo_s
        self.prediction_factor, self.prediction_factor_source = self._resolve_factor(model, prediction_factor)
        self.max_chunk_tokens = max(1, int(max_chunk_tokens))
        self.boundary = model.boundary_
        self._coef = [tuple(float(v) for v in row) for row in model.coef_]
        self._decode = [decode_prices(row) for row in self._coef]

    @staticmethod
    def _resolve_factor(model: StepLatencyModel, given: float | None) -> tuple[float, str]:
        if given is not None:
            if not (math.isfinite(given) and given > 0):
                raise LlmvisorError(f"tpot_prediction_factor must be a positive number (got {given!r})")
            return float(given), "configured"
        r90 = getattr(model, "fit_info_", {}).get("train_rel_err_p90")
        if isinstance(r90, (int, float)) and 0 <= r90 < 1:
            return 1 / (1 - r90), f"fit residuals: 1 / (1 - train p90 |relative error| {r90:.4g})"
        return 1.0, "none: the model has no fit residuals"

    def decode_step_s(self, num_decodes: int, sum_context_tokens: float) -> float:
        """A decode step's predicted seconds, every context counted as its own (effective context = context):
        sharing is not known before admission, and assuming none errs on the side of the SLO."""
        if num_decodes <= 0:
            return 0.0
        prices = self._decode[segment_of(self.boundary, num_decodes)]
        return decode_step_price_s(prices, num_decodes, sum_context_tokens, sum_context_tokens)

    def prefill_cost_s(self, num_prompt_tokens: int, num_cached_tokens: int = 0, num_decodes: int = 0) -> float:
        """Own prefill terms of the request's chunks: the time its prefill adds to the steps it runs in."""
        total = 0.0
        context = int(num_cached_tokens)
        remaining = int(num_prompt_tokens) - context
        while remaining > 0:
            p = min(remaining, self.max_chunk_tokens)
            total += prefill_chunk_price_s(self._coef, self.boundary, p + num_decodes, p, context)
            context += p
            remaining -= p
        return total

    def decide(
        self,
        num_running: int,
        sum_context_tokens: float,
        num_prompt_tokens: int,
        num_cached_tokens: int = 0,
        output_tokens: int = 1,
    ) -> AdmissionDecision:
        before = self.decode_step_s(num_running, sum_context_tokens)
        after = self.decode_step_s(num_running + 1, sum_context_tokens + num_prompt_tokens)
        prefill = self.prefill_cost_s(num_prompt_tokens, num_cached_tokens, num_running)
        model_tpot = after + prefill / max(1, int(output_tokens))
        tpot = model_tpot * self.prediction_factor
        admit = self.tpot_slo_s is None or num_running == 0 or tpot <= self.tpot_slo_s
        return AdmissionDecision(admit, tpot, before, after, prefill, model_tpot)


# --------------------------------------------------------------------------------------------------------
# Costs


TokenCost = TokenPrices
"""VTC's cost: prompt tokens ×1 and output tokens ×2 (configurable), counted as the engine runs them
(`llmvisor.core.game.TokenPrices`: a prefill chunk pays its tokens as prompt, plus an output token when it
samples one; a decode pays its token as output)."""


# --------------------------------------------------------------------------------------------------------
# The policy an engine calls


@dataclass
class StepCharge:
    """What one step charged: cost units and attributed seconds per tenant."""

    cost: dict[str, float]
    attributed_s: dict[str, float] | None


class FairShare:
    """VTC, quotas and admission control together: the engine calls it, it holds no engine objects.

    The engine reports queue changes (`arrive`, `requeue`, `leave`), asks which tenant to admit from next
    (`choose`) and charges each step after it ran (`charge_step`). With ``config.shared_counters`` the VTC
    counters are the pool's (`SharedCounters`, started here; `close` stops it); quotas stay per replica.
    """

    def __init__(self, config: FairnessConfig, model: StepLatencyModel | None = None, *, max_chunk_tokens: int = 2048):
        if config.needs_model and model is None:
            model = config.load_model()
        self.config = config
        self.model = model
        config.check()
        self.vtc = (DominantResourceCounter if config.charges_memory else VirtualTokenCounter)(config.weights, config.default_weight)
        self._memory_since_ns: int | None = None
        self._memory_blocks: dict[str, float] = {}
        self._memory_pool_blocks = 0
        self.shared = None
        if config.shared_counters is not None:
            self.shared = self.vtc.shared = SharedCounters(config.shared_counters).start()
        self.tokens = config.token_prices
        self.attributor = StepAttributor(model, rule=config.rule) if model is not None and (config.charges_attributed_time or self._has_quotas) else None
        self.admission = (
            AdmissionController(model, config.tpot_slo_s, max_chunk_tokens, config.tpot_prediction_factor) if model is not None else None
        )
        self.quotas: dict[str, SlidingWindowQuota] = {}
        self.attributed_s: dict[str, float] = {}
        self.num_deferred = 0
        self.num_quota_waits = 0
        self.num_work_conserving = 0

    @property
    def _has_quotas(self) -> bool:
        return bool(self.config.quotas) or self.config.default_quota is not None

    def close(self) -> None:
        """Stop sharing counters (a last flush first); local counters stay as they are."""
        if self.shared is not None:
            self.shared.close()
            self.vtc.shared = None

    # queue events
    def arrive(self, tenant: str) -> None:
        if self.shared is not None:
            self.shared.refresh(self.vtc.counter)
        self.vtc.arrive(tenant)

    def requeue(self, tenant: str, n: int = 1) -> None:
        self.vtc.requeue(tenant, n)

    def leave(self, tenant: str, n: int = 1) -> None:
        self.vtc.leave(tenant, n)

    # quotas
    def quota_of(self, tenant: str) -> SlidingWindowQuota | None:
        state = self.quotas.get(tenant)
        if state is None:
            quota = self.config.quota(tenant)
            if quota is None:
                return None
            state = self.quotas[tenant] = SlidingWindowQuota(quota)
        return state

    def over_budget(self, tenant: str, now_s: float) -> bool:
        state = self.quota_of(tenant) if self._has_quotas else None
        return state is not None and state.over_budget(now_s)

    # decisions
    def choose(self, tenants: Sequence[str], now_s: float, decide=None) -> str | None:
        """The tenant to admit from next among ``tenants`` (those with a request waiting), or None.

        ``decide(tenant)`` returns the `AdmissionDecision` for that tenant's head request (or None when
        admission control is off). Over-budget tenants are passed over; with ``work_conserving`` they are
        chosen when every waiting tenant is over budget. A deferred head request stops admission (VTC order
        is kept; the request is not starved by cheaper ones behind it).
        """
        vtc = self.vtc
        if self._has_quotas:
            within = [t for t in tenants if not self.over_budget(t, now_s)]
            if not within:
                if not tenants:
                    return None
                if not self.config.work_conserving:
                    self.num_quota_waits += 1
                    return None
                self.num_work_conserving += 1
                within = list(tenants)
            tenant = vtc.lowest(within)
        else:
            tenant = vtc.lowest(tenants)
        if tenant is None:
            return None
        if decide is not None:
            decision = decide(tenant)
            if decision is not None and not decision.admit:
                self.num_deferred += 1
                return None
        return tenant

    # charging
    def charge_step(
        self,
        tenants: Sequence[str],
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        is_prefill: np.ndarray,
        samples_token: np.ndarray,
        measured_s: float,
        now_s: float,
        effective_context_tokens: np.ndarray | None = None,
        charged_when_scheduled: Mapping[str, float] | None = None,
        lora: LoraSlices | None = None,
    ) -> StepCharge:
        """Charge one step that ran: each slice's cost to its tenant; quotas get attributed seconds. With
        ``effective_context_tokens`` (prefix caching), each KV block shared in the step is split among its readers;
        with ``lora`` (the step's adapters, a LoRA model), each adapter's terms among its requests (module note).
        With ``charged_when_scheduled`` (`charge_scheduled`'s return), the counters get only the difference
        between the measured cost and what was charged then."""
        shares = None
        if self.attributor is not None:
            shares = self.attributor.attribute(num_new_tokens, num_context_tokens, is_prefill, measured_s, effective_context_tokens, lora)
        costs = shares if self.config.charges_attributed_time else self.tokens.slice_costs(num_new_tokens, is_prefill, samples_token)
        per_tenant = sum_by_tenant(tenants, costs)
        attributed = None
        if shares is not None:
            attributed = sum_by_tenant(tenants, shares)
            for tenant, seconds in attributed.items():
                self.attributed_s[tenant] = self.attributed_s.get(tenant, 0.0) + seconds
                if self._has_quotas:
                    state = self.quota_of(tenant)
                    if state is not None:
                        state.add(now_s, seconds)
        charged = charged_when_scheduled
        for tenant, cost in per_tenant.items():
            correction = cost if charged is None else cost - charged.get(tenant, 0.0)
            if correction or charged is None:
                self.vtc.charge(tenant, correction)
        self._settle_counters()
        return StepCharge(per_tenant, attributed)

    def charge_scheduled(
        self,
        tenants: Sequence[str],
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        is_prefill: np.ndarray,
        samples_token: np.ndarray,
        effective_context_tokens: np.ndarray | None = None,
        lora: LoraSlices | None = None,
    ) -> dict[str, float]:
        """Charge a step to the counters when it is scheduled, before it runs, and return the cost per tenant
        (``lora``: as `charge_step`'s, the loads the engine knows of when it schedules).

        The cost is what `charge_step` will charge, with the model's predicted shares in place of the measured
        time (the token cost is known exactly). Under async scheduling (a batch queue) the next pass is made before
        this step's output arrives; charged here, that pass already sees the step. `charge_step` with
        ``charged_when_scheduled`` then corrects the counters to the measured cost (quotas and ``attributed_s``
        are charged there, measured, only). The pass's reservations are dropped: the step's charge replaces them."""
        if self.config.charges_attributed_time:
            costs = self.attributor.attribute(num_new_tokens, num_context_tokens, is_prefill, None, effective_context_tokens, lora)
        else:
            costs = self.tokens.slice_costs(num_new_tokens, is_prefill, samples_token)
        per_tenant = sum_by_tenant(tenants, costs)
        for tenant, cost in per_tenant.items():
            self.vtc.charge(tenant, cost)
        self._settle_counters()
        return per_tenant

    def observe_memory(self, now_ns: int, blocks_by_tenant: Mapping[str, float], pool_blocks: int) -> None:
        """A reading of the KV pool (``drf``): the time since the previous reading is charged to the tenants that held
        blocks then, each its effective blocks (a block k requests reference is 1/k theirs, as the KV meter counts)
        × that time, and the pool's ``pool_blocks`` × that time is the memory capacity that passed; the reading
        ``blocks_by_tenant`` (each tenant's effective blocks now) holds until the next one. A no-op for VTC."""
        if not self.config.charges_memory:
            return
        since = self._memory_since_ns
        if since is not None and now_ns > since:
            dt = now_ns - since
            self.vtc.charge_memory({t: blocks * dt for t, blocks in self._memory_blocks.items()}, self._memory_pool_blocks * dt)
        if since is None or now_ns > since:
            self._memory_since_ns = int(now_ns)
        self._memory_blocks = dict(blocks_by_tenant)
        self._memory_pool_blocks = int(pool_blocks)

    def _settle_counters(self) -> None:
        """After a charge: the pass's reservations are replaced by it, and a shared pool sees the new counters."""
        self.vtc.clear_reservations()
        if self.shared is not None:
            self.shared.refresh(self.vtc.counter)

    def reservation(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float:
        """Predicted cost of a request's prefill in the configured unit, reserved at admission."""
        tokens = max(0, int(num_prompt_tokens) - int(num_cached_tokens))
        if self.config.cost == "tokens":
            return float(self.tokens.cost(tokens, 1))
        if self.admission is None:
            return 0.0
        return self.admission.prefill_cost_s(num_prompt_tokens, num_cached_tokens)


def sum_by_tenant(tenants: Sequence[str], values: np.ndarray) -> dict[str, float]:
    """Per tenant, the sum of its slices' values, in order of first appearance."""
    totals: dict[str, float] = {}
    for tenant, value in zip(tenants, values.tolist()):
        totals[tenant] = totals.get(tenant, 0.0) + value
    return totals


# --------------------------------------------------------------------------------------------------------
# Fairness metrics


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one tenant gets everything."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return float("nan")
    denominator = x.size * float(np.dot(x, x))
    return float(x.sum() ** 2 / denominator) if denominator > 0 else 1.0


def max_min_ratio(values: Iterable[float]) -> float:
    """Largest over smallest; inf when the smallest is 0 and the largest is not."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return float("nan")
    low, high = float(x.min()), float(x.max())
    if low <= 0:
        return 1.0 if high <= 0 else float("inf")
    return high / low
