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

Both are charged per step, as the engine runs the work. Within one scheduling pass an admission also reserves
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

import json
import math
import os
import tomllib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from llmvisor import shipped
from llmvisor.core.attribution import RULES, StepAttributor
from llmvisor.core.game import (
    VTC_TOKEN_PRICES,
    TokenPrices,
    decode_prices,
    decode_step_price_s,
    prefill_chunk_price_s,
    segment_of,
)
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError, plain
from llmvisor.fairness.shared_counters import SharedCounters, SharedCountersConfig


class ChargeCost(StrEnum):
    """What a tenant's virtual counter is charged per step: VTC's token prices, or attributed engine seconds."""

    TOKENS = "tokens"
    ATTRIBUTED = "attributed"


class SchedulingPolicy(StrEnum):
    """How waiting requests are ordered: vLLM's FCFS, or VTC charged with one of the `ChargeCost`s."""

    FCFS = "fcfs"
    TOKENS = "tokens"
    ATTRIBUTED = "attributed"

    @property
    def label(self) -> str:
        return {"fcfs": "vLLM FCFS", "tokens": "token VTC", "attributed": "attributed VTC"}[self.value]


COSTS = tuple(ChargeCost)
POLICIES = tuple(SchedulingPolicy)
DEFAULT_TENANT = "default"
ENV_CONFIG = "LLMVISOR_FAIR_CONFIG"


# --------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Quota:
    """At most ``budget_s`` engine seconds in any window of ``window_s`` seconds."""

    budget_s: float
    window_s: float


@dataclass
class FairnessConfig:
    """Settings of the fair scheduler; see ``docs/fairness.md`` for the file format."""

    cost: str = "attributed"
    model: str | None = None
    """Model file (`llmvisor fit`); None: the shipped ``llmvisor/data/model.json``. Needed for the attributed
    cost, quotas and the SLO."""
    rule: str = "shapley"
    weights: dict[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    prompt_token_cost: float = VTC_TOKEN_PRICES.prompt
    output_token_cost: float = VTC_TOKEN_PRICES.output
    quotas: dict[str, Quota] = field(default_factory=dict)
    default_quota: Quota | None = None
    work_conserving: bool = False
    tpot_slo_s: float | None = None
    tpot_prediction_factor: float | None = None
    """Multiplies the predicted time per output token before it is compared with ``tpot_slo_s``. None: from
    the model file's fit residuals (see ``AdmissionController``); `llmvisor eval` reports a held-out value,
    ``models.llmvisor.decode.underprediction_factor_p90``."""
    preempt_most_served: bool = True
    tenant_key: str = "tenant"
    default_tenant: str = DEFAULT_TENANT
    log_size: int = 4096
    """Admissions and preemptions kept for inspection (most recent)."""
    shared_counters: SharedCountersConfig | None = None
    """Keep the VTC counters in Redis, shared by every replica of a pool (`llmvisor.fairness.shared_counters`);
    None: counters local to this engine."""

    @property
    def token_prices(self) -> TokenPrices:
        """The ``tokens`` cost's prices (`llmvisor.core.game.TokenPrices`)."""
        return TokenPrices(self.prompt_token_cost, self.output_token_cost)

    @property
    def needs_model(self) -> bool:
        return self.cost == "attributed" or bool(self.quotas) or self.default_quota is not None or self.tpot_slo_s is not None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def quota(self, tenant: str) -> Quota | None:
        return self.quotas.get(tenant, self.default_quota)

    def as_dict(self) -> dict:
        def quota(q: Quota | None):
            return None if q is None else {"budget_s": q.budget_s, "window_s": q.window_s}

        return {
            "cost": self.cost,
            "model": self.model,
            "rule": self.rule,
            "weights": dict(self.weights),
            "default_weight": self.default_weight,
            "prompt_token_cost": self.prompt_token_cost,
            "output_token_cost": self.output_token_cost,
            "quotas": {t: quota(q) for t, q in self.quotas.items()},
            "default_quota": quota(self.default_quota),
            "work_conserving": self.work_conserving,
            "tpot_slo_s": self.tpot_slo_s,
            "tpot_prediction_factor": self.tpot_prediction_factor,
            "preempt_most_served": self.preempt_most_served,
            "tenant_key": self.tenant_key,
            "default_tenant": self.default_tenant,
            "log_size": self.log_size,
            "shared_counters": None if self.shared_counters is None else self.shared_counters.as_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "<config>") -> FairnessConfig:
        if not isinstance(data, Mapping):
            raise LlmvisorError(f"{source}: fairness config must be an object (a JSON object or a TOML table)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise LlmvisorError(f"{source}: unknown fairness config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = dict(data)
        config = cls()
        if "cost" in values:
            config.cost = str(values["cost"])
        if config.cost not in COSTS:
            raise LlmvisorError(f"{source}: cost must be one of {', '.join(COSTS)} (got {config.cost!r})")
        if values.get("model") is not None:
            config.model = str(values["model"])
        if "rule" in values:
            config.rule = str(values["rule"])
            if config.rule not in RULES:
                raise LlmvisorError(f"{source}: rule must be one of {', '.join(RULES)} (got {config.rule!r})")
        for key in ("default_weight", "prompt_token_cost", "output_token_cost"):
            if key in values:
                setattr(config, key, _number(values[key], key, source, positive=key == "default_weight"))
        if "weights" in values:
            weights = values["weights"]
            if not isinstance(weights, Mapping):
                raise LlmvisorError(f"{source}: weights must map tenant names to positive numbers")
            config.weights = {str(t): _number(w, f"weights.{t}", source, positive=True) for t, w in weights.items()}
        if "quotas" in values:
            quotas = values["quotas"]
            if not isinstance(quotas, Mapping):
                raise LlmvisorError(f"{source}: quotas must map tenant names to {{budget_s, window_s}}")
            config.quotas = {str(t): _quota(q, f"quotas.{t}", source) for t, q in quotas.items()}
        if values.get("default_quota") is not None:
            config.default_quota = _quota(values["default_quota"], "default_quota", source)
        for key in ("work_conserving", "preempt_most_served"):
            if key in values:
                if not isinstance(values[key], bool):
                    raise LlmvisorError(f"{source}: {key} must be true or false (got {values[key]!r})")
                setattr(config, key, values[key])
        if values.get("tpot_slo_s") is not None:
            config.tpot_slo_s = _number(values["tpot_slo_s"], "tpot_slo_s", source, positive=True)
        if values.get("tpot_prediction_factor") is not None:
            config.tpot_prediction_factor = _number(values["tpot_prediction_factor"], "tpot_prediction_factor", source, positive=True)
        for key in ("tenant_key", "default_tenant"):
            if key in values:
                setattr(config, key, str(values[key]))
        if "log_size" in values:
            config.log_size = int(_number(values["log_size"], "log_size", source))
        if values.get("shared_counters") is not None:
            config.shared_counters = SharedCountersConfig.from_value(values["shared_counters"], source)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> FairnessConfig:
        """A JSON file, or TOML when the name ends in ``.toml``."""
        path = str(path)
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
        except OSError as error:
            raise LlmvisorError(f"{path}: cannot read fairness config ({error.strerror})") from None
        try:
            data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as error:
            kind = "TOML" if path.endswith(".toml") else "JSON"
            raise LlmvisorError(f"{path}: fairness config is not valid {kind} ({error})") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FairnessConfig:
        """``LLMVISOR_FAIR_CONFIG``: a file path, or the JSON object itself; unset gives the defaults."""
        environ = os.environ if environ is None else environ
        value = environ.get(ENV_CONFIG, "").strip()
        if not value:
            return cls()
        if value.startswith("{"):
            try:
                return cls.from_dict(json.loads(value), source=ENV_CONFIG)
            except json.JSONDecodeError as error:
                raise LlmvisorError(f"{ENV_CONFIG}: not valid JSON ({error})") from None
        return cls.from_file(value)

    def load_model(self) -> StepLatencyModel | None:
        """The model to charge and predict with, or None when nothing configured needs one."""
        if not self.needs_model:
            return None
        path = self.model or str(shipped.latency_model_path())
        if path is None or not os.path.exists(path):
            missing = f"model file {path!r} does not exist" if path else "llmvisor ships no model.json"
            raise LlmvisorError(
                f"fairness config: the attributed cost, quotas and tpot_slo_s need a model, but {missing}; "
                "set \"model\" to a file written by `llmvisor fit`"
            )
        return StepLatencyModel.from_json(path)


def _number(value, key: str, source: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (positive and value <= 0):
        need = "a positive number" if positive else "a non-negative number"
        raise LlmvisorError(f"{source}: {key} must be {need} (got {plain(value)!r})")
    return float(value)


def _quota(value, key: str, source: str) -> Quota:
    if not isinstance(value, Mapping) or set(value) != {"budget_s", "window_s"}:
        raise LlmvisorError(f"{source}: {key} must be {{\"budget_s\": seconds, \"window_s\": seconds}} (got {value!r})")
    return Quota(_number(value["budget_s"], f"{key}.budget_s", source), _number(value["window_s"], f"{key}.window_s", source, positive=True))


# --------------------------------------------------------------------------------------------------------
# VTC


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
        self.vtc = VirtualTokenCounter(config.weights, config.default_weight)
        self.shared = None
        if config.shared_counters is not None:
            self.shared = self.vtc.shared = SharedCounters(config.shared_counters).start()
        self.tokens = config.token_prices
        self.attributor = StepAttributor(model, rule=config.rule) if model is not None and (config.cost == "attributed" or self._has_quotas) else None
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
    ) -> StepCharge:
        """Charge one step that ran: each slice's cost to its tenant; quotas get attributed seconds. With
        ``effective_context_tokens`` (prefix caching), each KV block shared in the step is split among its readers.
        With ``charged_when_scheduled`` (`charge_scheduled`'s return), the counters get only the difference
        between the measured cost and what was charged then."""
        shares = None
        if self.attributor is not None:
            shares = self.attributor.attribute(num_new_tokens, num_context_tokens, is_prefill, measured_s, effective_context_tokens)
        costs = shares if self.config.cost == "attributed" else self.tokens.slice_costs(num_new_tokens, is_prefill, samples_token)
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
    ) -> dict[str, float]:
        """Charge a step to the counters when it is scheduled, before it runs, and return the cost per tenant.

        The cost is what `charge_step` will charge, with the model's predicted shares in place of the measured
        time (the token cost is known exactly). Under async scheduling (a batch queue) the next pass is made before
        this step's output arrives; charged here, that pass already sees the step. `charge_step` with
        ``charged_when_scheduled`` then corrects the counters to the measured cost (quotas and ``attributed_s``
        are charged there, measured, only). The pass's reservations are dropped: the step's charge replaces them."""
        if self.config.cost == "attributed":
            costs = self.attributor.attribute(num_new_tokens, num_context_tokens, is_prefill, None, effective_context_tokens)
        else:
            costs = self.tokens.slice_costs(num_new_tokens, is_prefill, samples_token)
        per_tenant = sum_by_tenant(tenants, costs)
        for tenant, cost in per_tenant.items():
            self.vtc.charge(tenant, cost)
        self._settle_counters()
        return per_tenant

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
