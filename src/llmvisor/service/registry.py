"""Fitted models per engine class (engine fingerprint id), versioned in the ledger, and the attribution of
steps stored pending until their class has a model.

Which model attributes a step: the active registry version of its class; else, for a step without a
fingerprint or when the service is not told to hold unknown classes, the service's default model (``serve
--model``); else the step is stored pending (measured time kept, no shares) and attributed, once, when a
version of its class is activated. Bills already written are never rewritten: activation attributes only
pending steps.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np

from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.ingest import ModelChoice, attribute_stored
from llmvisor.service.metrics import ServiceMetrics

DEFAULT_REFRESH_S = 5.0
"""How often a service process re-reads the active versions (another process or the CLI may activate one)."""
PENDING_CHUNK_STEPS = 5000


class RegistryError(LlmvisorError):
    """A model that cannot be registered or activated as asked."""


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


class ModelRegistry:
    """The models one service process attributes with: the active registry versions (re-read every
    ``refresh_s``), the default model, and whether steps of classes without a model are held pending."""

    def __init__(
        self,
        ledger: Ledger,
        default_model: StepLatencyModel,
        *,
        pending_unknown_classes: bool = False,
        refresh_s: float = DEFAULT_REFRESH_S,
        metrics: ServiceMetrics | None = None,
    ):
        self.ledger = ledger
        self.default = ModelChoice(default_model)
        self.pending_unknown_classes = pending_unknown_classes
        self.refresh_s = refresh_s
        self.metrics = metrics
        self._active: dict[str, ModelChoice] = {}
        self._loaded: dict[tuple[str, int], StepLatencyModel] = {}
        self._refreshed_at = -float("inf")
        self._lock = threading.Lock()

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
        if not self.pending_unknown_classes:
            return
        for engine_class, choice in active.items():
            if self.ledger.has_pending(engine_class):
                attribute_pending(self.ledger, engine_class, choice.model, choice.version, metrics=self.metrics)

    def choose(self, engine_class: str) -> ModelChoice:
        choice = self._active.get(engine_class)
        if choice is not None:
            return choice
        if engine_class and self.pending_unknown_classes:
            return ModelChoice(None)
        return self.default

    def model_for(self, engine_class: str) -> StepLatencyModel | None:
        return self.choose(engine_class).model

    def activate(self, engine_class: str, version: int) -> PendingResult:
        result = activate(self.ledger, engine_class, version, metrics=self.metrics)
        self.refresh(force=True)
        return result
