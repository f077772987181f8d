"""The fair scheduler's settings: `FairnessConfig` (``LLMVISOR_FAIR_CONFIG``, a JSON or TOML file; ``docs/fairness.md``
documents the format) and the names of its costs and policies. Engine-free; `llmvisor.fairness.policy` re-exports
every name here."""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from llmvisor import shipped
from llmvisor.core.attribution import RULES
from llmvisor.core.game import VTC_TOKEN_PRICES, TokenPrices
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError, plain
from llmvisor.fairness.shared_counters import SharedCountersConfig


class ChargeCost(StrEnum):
    """What a tenant is charged: VTC's token prices, attributed engine seconds, or (``drf``) attributed engine
    seconds and KV memory-time together, the tenant's dominant share of the two ordering admission
    (`llmvisor.fairness.counters.DominantResourceCounter`)."""

    TOKENS = "tokens"
    ATTRIBUTED = "attributed"
    DRF = "drf"


class SchedulingPolicy(StrEnum):
    """How waiting requests are ordered: vLLM's FCFS, VTC charged with tokens or attributed seconds, or DRF over
    attributed seconds and KV memory-time."""

    FCFS = "fcfs"
    TOKENS = "tokens"
    ATTRIBUTED = "attributed"
    DRF = "drf"

    @property
    def label(self) -> str:
        return {"fcfs": "vLLM FCFS", "tokens": "token VTC", "attributed": "attributed VTC", "drf": "DRF"}[self.value]


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
    def charges_attributed_time(self) -> bool:
        """Whether the counters are charged attributed engine seconds (``attributed`` and ``drf``)."""
        return self.cost in (ChargeCost.ATTRIBUTED, ChargeCost.DRF)

    @property
    def charges_memory(self) -> bool:
        """Whether the counters are also charged KV memory-time (``drf``): the engine must meter its KV blocks."""
        return self.cost == ChargeCost.DRF

    @property
    def needs_model(self) -> bool:
        return self.charges_attributed_time or bool(self.quotas) or self.default_quota is not None or self.tpot_slo_s is not None

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
        config.check(source)
        return config

    def check(self, source: str = "<config>") -> None:
        """Settings that do not go together, refused in one line naming the field."""
        if self.cost not in COSTS:
            raise LlmvisorError(f"{source}: cost must be one of {', '.join(COSTS)} (got {self.cost!r})")
        if self.charges_memory and self.shared_counters is not None:
            raise LlmvisorError(
                f"{source}: shared_counters: not supported with cost = \"drf\" (a dominant share needs each replica's "
                "KV pool and engine time; share counters with cost = \"attributed\" or \"tokens\")"
            )

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

