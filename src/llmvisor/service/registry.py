"""Fitted models per engine class (engine fingerprint id), versioned in the ledger, and the attribution of
steps stored pending until their class has a model.

Which model attributes a step (`ModelRegistry.choose`), so that no step is billed by another engine's model
unless the operator says so:

1. the active registry version of its class;
2. the service's model (``serve --model``, default the shipped one) for the class it was fitted on (the
   fingerprint id in its file), and for steps that carry no fingerprint (nothing to compare; counted in
   ``llmvisor_fingerprint_unknown_steps_total``);
3. the fallback model (``serve --fallback-model``) for every other class, only if the operator named one,
   with a warning in the log once per class;
4. otherwise the step is stored pending (measured time kept, no shares, counted and on the dashboard) and
   attributed, once, when a version of its class is activated.

Bills already written are never rewritten: activation attributes only pending steps.

Engines that attribute at the edge (window aggregates, `llmvisor.metering`) ask `ModelRegistry.edge_model` for
the model this order picks for their class (``GET /v1/models/{class}/active``), so a window is billed with the
model per-step ingest would use. A window names the registry version that attributed it; for the service's
``--model`` and ``--fallback-model`` that is a version of the class stored on the first such request (not
activated, its source naming the role), so every window's model can be read back and audited.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.ingest import ModelChoice, attribute_stored
from llmvisor.service.metrics import ServiceMetrics

log = logging.getLogger("llmvisor.service")

DEFAULT_REFRESH_S = 5.0
"""How often a service process re-reads the active versions (another process or the CLI may activate one)."""
PENDING_CHUNK_STEPS = 5000


class RegistryError(LlmvisorError):
    """A model that cannot be registered or activated as asked."""


@dataclass(frozen=True)
class EdgeModel:
    """The model an engine attributes its class's steps with at the edge: registry ``version`` (stored),
    ``role`` ``"active"`` (the class's active version), ``"default"`` (``serve --model``) or ``"fallback"``
    (``serve --fallback-model``), and the model's JSON."""

    engine_class: str
    version: int
    role: str
    model_json: str


EDGE_ROLE_SOURCES = {
    "default": "llmvisor serve --model, billing this class while it has no active version (stored for edge attribution)",
    "fallback": "llmvisor serve --fallback-model, billing this class while it has no model of its own (stored for edge attribution)",
}


@dataclass(frozen=True)
class PendingResult:
    engine_class: str
    version: int
    steps_attributed: int
    attributed_ns: int


def model_class(model: StepLatencyModel, engine_class: str | None, *, source: str) -> str:
    """The class a model is registered under: ``engine_class`` if given, else the fingerprint id it was fitted
    on; a model fitted on another fingerprint than the class named is refused."""
    fingerprint = getattr(model, "engine_fingerprint_", None)
    fitted_on = fingerprint.get("id") if isinstance(fingerprint, dict) else None
    if engine_class is None:
        if fitted_on is None:
            raise RegistryError(f"{source}: the model records no engine fingerprint; name its class with --class FINGERPRINT_ID")
        return fitted_on
    if not engine_class:
        raise RegistryError("the engine class (a fingerprint id) must not be empty")
    if fitted_on is not None and fitted_on != engine_class:
        raise RegistryError(f"{source}: the model was fitted on engine fingerprint {fitted_on}, not {engine_class}")
    return engine_class


def load_version(ledger: Ledger, engine_class: str, version: int) -> StepLatencyModel:
    text = ledger.model_json(engine_class, version)
    if text is None:
        raise RegistryError(f"no model version {version} of engine class {engine_class!r} is stored (see `llmvisor models list`)")
    return StepLatencyModel.from_dict(json.loads(text), source=f"model {engine_class} v{version}")


def attribute_pending(
    ledger: Ledger, engine_class: str, model: StepLatencyModel, version: int, *, metrics: ServiceMetrics | None = None
) -> PendingResult:
    """Attribute every pending step of a class with ``model`` (version ``version``), a chunk per transaction."""
    n_steps = 0
    attributed_ns = 0
    while True:
        stored = ledger.stored_steps(engine_class, pending_only=True, newest=PENDING_CHUNK_STEPS)
        if not stored.keys:
            break
        prepared = attribute_stored(model, version, stored, engine_class)
        outcome = ledger.resolve_pending(engine_class, version, prepared.records)
        resolved = np.asarray(outcome.inserted, dtype=bool)
        slices = np.repeat(resolved, np.diff(prepared.records.step_offsets))
        n_steps += int(resolved.sum())
        attributed_ns += int(prepared.records.attributed_ns[slices].sum())
        if metrics is not None:
            metrics.record_attributed_pending(prepared, resolved, engine_class)
    return PendingResult(engine_class, version, n_steps, attributed_ns)


def activate(ledger: Ledger, engine_class: str, version: int, *, metrics: ServiceMetrics | None = None) -> PendingResult:
    """Make a stored version the one attributing its class, then attribute the class's pending steps."""
    model = load_version(ledger, engine_class, version)
    ledger.activate_model(engine_class, version)
    return attribute_pending(ledger, engine_class, model, version, metrics=metrics)


def fitted_class(model: StepLatencyModel | None) -> str | None:
    """The engine class (fingerprint id) a model file says it was fitted on; None if it records none."""
    fingerprint = getattr(model, "engine_fingerprint_", None)
    return str(fingerprint["id"]) if isinstance(fingerprint, dict) and fingerprint.get("id") else None


class ModelRegistry:
    """The models one service process attributes with: the active registry versions (re-read every
    ``refresh_s``), the service's model for its own class and for steps without a fingerprint, and the
    fallback model, if one is named, for other classes without a model (else their steps are held pending)."""

    def __init__(
        self,
        ledger: Ledger,
        default_model: StepLatencyModel,
        *,
        fallback_model: StepLatencyModel | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        metrics: ServiceMetrics | None = None,
    ):
        self.ledger = ledger
        self.default = ModelChoice(default_model)
        self.default_class = fitted_class(default_model)
        self.fallback = ModelChoice(fallback_model) if fallback_model is not None else None
        self.refresh_s = refresh_s
        self.metrics = metrics
        self._active: dict[str, ModelChoice] = {}
        self._loaded: dict[tuple[str, int], StepLatencyModel] = {}
        self._refreshed_at = -float("inf")
        self._lock = threading.Lock()
        self._fallback_warned: set[str] = set()
        self._edge_versions: dict[tuple[str, str], int] = {}

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the active versions; attribute pending steps of classes that have one (activated elsewhere,
        or steps stored pending by a process that had not yet seen the activation)."""
        with self._lock:
            if not force and time.monotonic() - self._refreshed_at < self.refresh_s:
                return
            self._refreshed_at = time.monotonic()
            active = {}
            for engine_class, version in self.ledger.active_versions().items():
                if (engine_class, version) not in self._loaded:
                    self._loaded[(engine_class, version)] = load_version(self.ledger, engine_class, version)
                active[engine_class] = ModelChoice(self._loaded[(engine_class, version)], version)
                previous = self._active.get(engine_class)
                if self.metrics is not None and previous is not None and previous.version != version:
                    self.metrics.class_drift.reset(engine_class)  # residuals of the version replaced
            self._active = active
        for engine_class, choice in active.items():
            if self.ledger.has_pending(engine_class):
                attribute_pending(self.ledger, engine_class, choice.model, choice.version, metrics=self.metrics)

    def choose(self, engine_class: str) -> ModelChoice:
        """The model of a class's steps (the module docstring's order); ``ModelChoice(None)``: store pending."""
        choice = self._active.get(engine_class)
        if choice is not None:
            return choice
        if not engine_class or engine_class == self.default_class:
            return self.default
        if self.fallback is not None:
            if engine_class not in self._fallback_warned:
                self._fallback_warned.add(engine_class)
                log.warning(
                    "llmvisor: engine class %s has no model; its steps are billed with the fallback model (fitted on %s), "
                    "a model of another engine: register one of this engine (llmvisor calibrate; llmvisor models add FILE "
                    "--activate)", engine_class, fitted_class(self.fallback.model) or "no recorded fingerprint",
                )
            return self.fallback
        return ModelChoice(None)

    def edge_model(self, engine_class: str) -> EdgeModel | None:
        """The model `choose` picks for ``engine_class``, with a stored version, for attribution at the edge;
        None where its steps would be stored pending (the engine then sends them per step)."""
        self.refresh()
        choice = self.choose(engine_class)
        if choice.pending:
            return None
        if choice.version is not None:
            text = self.ledger.model_json(engine_class, choice.version)
            if text is not None:
                return EdgeModel(engine_class, choice.version, "active", text)
        role = "fallback" if self.fallback is not None and choice is self.fallback else "default"
        text = json.dumps(choice.model.to_dict(), sort_keys=True)
        return EdgeModel(engine_class, self._edge_version(engine_class, role, text), role, text)

    def _edge_version(self, engine_class: str, role: str, text: str) -> int:
        """The stored version of this class holding ``text`` (stored now, not activated, if none does)."""
        with self._lock:
            version = self._edge_versions.get((engine_class, role))
            if version is not None:
                return version
            for item in self.ledger.list_models(engine_class):
                if self.ledger.model_json(engine_class, item.version) == text:
                    version = item.version
                    break
            else:
                version = self.ledger.add_model(engine_class, text, EDGE_ROLE_SOURCES[role])
                log.info("llmvisor: stored the %s model as version %d of engine class %s, for attribution at the edge",
                         role, version, engine_class)
            self._edge_versions[(engine_class, role)] = version
            return version

    def model_for(self, engine_class: str) -> StepLatencyModel | None:
        return self.choose(engine_class).model

    def activate(self, engine_class: str, version: int) -> PendingResult:
        result = activate(self.ledger, engine_class, version, metrics=self.metrics)
        self.refresh(force=True)
        return result

    def billing_summary(self) -> list[str]:
        """What this process bills with, one line each (``serve`` prints them at start)."""
        self.refresh(force=True)
        lines = [f"registry: engine class {c} bills with its active version v{choice.version}" for c, choice in sorted(self._active.items())]
        if self.default_class is not None:
            lines.append(f"--model: bills engine class {self.default_class} (the class it was fitted on) while the registry has "
                         "no active version of it, and steps that carry no engine fingerprint")
            if "fingerprint_format" not in self.default.model.engine_fingerprint_:
                lines.append(f"  {self.default_class} is a format-1 fingerprint (no CPU ISA flags or GEMM backend recorded): no "
                             "engine recording today has this class; calibrate a model of yours (llmvisor calibrate)")
        else:
            lines.append("--model: records no engine fingerprint; bills only steps that carry none")
        if self.fallback is not None:
            lines.append(f"--fallback-model (fitted on {fitted_class(self.fallback.model) or 'no recorded fingerprint'}): bills "
                         "steps of every other engine class without a model, a warning in the log once per class")
        else:
            lines.append("steps of any other engine class are stored pending (measured time kept, no bill) until a model "
                         "of their class is activated: llmvisor models add FILE --activate")
        pending = self.ledger.pending_classes()
        if pending:
            lines.append("pending now: " + ", ".join(f"{c or '(no fingerprint)'} {n} steps" for c, n in sorted(pending.items())))
        return lines
