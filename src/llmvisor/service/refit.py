"""Refit an engine class's model from its recent steps and activate it only if it predicts the newest steps
better than the active version.

The steps (from the ledger, or trace files) are split by time: the newest ``test_fraction`` are the test set
and are never used for fitting. Both models are scored on them by the mean of |measured − predicted| /
measured. The new model is always stored as a version; it is activated (and the class's pending steps
attributed with it) only when its error is lower, or when the class has no active version.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace, read_traces
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.ingest import step_fingerprint_ids, trace_from_stored
from llmvisor.service.registry import PendingResult, activate, load_version

DEFAULT_TEST_FRACTION = 0.2
DEFAULT_NEWEST_STEPS = 20_000
MIN_TRAIN_STEPS = 50
MIN_TEST_STEPS = 10


class RefitError(LlmvisorError):
    """A refit that cannot run as asked (too few steps, a bad fraction)."""


@dataclass(frozen=True)
class RefitResult:
    engine_class: str
    version: int
    activated: bool
    train_steps: int
    test_steps: int
    new_error: float
    """Mean |measured − predicted| / measured of the new model on the test (newest) steps."""
    active_version: int | None
    active_error: float | None
    pending: PendingResult | None


def mean_abs_relative_error(model: StepLatencyModel, trace: StepTrace) -> float:
    measured = trace.step_latency_s_per_step
    return float(np.mean(np.abs(measured - model.predict(trace)) / measured))


def split_by_time(trace: StepTrace, timestamps_s: np.ndarray, test_fraction: float) -> tuple[StepTrace, StepTrace]:
    """(train, test): the newest ``test_fraction`` of the steps by start time are the test set."""
    order = np.argsort(timestamps_s, kind="stable")
    n_test = math.ceil(test_fraction * trace.n_steps)
    test = np.zeros(trace.n_steps, dtype=bool)
    test[order[trace.n_steps - n_test :]] = True
    return trace.select_steps(~test), trace.select_steps(test)


def class_steps_from_traces(paths: Sequence[Path], engine_class: str) -> tuple[StepTrace, np.ndarray]:
    """The steps of the class in trace files (all steps of files without fingerprints) and their start times
    (``timestamp_s``, else their order in the files)."""
    return class_steps(read_traces(paths), engine_class)


def class_steps(trace: StepTrace, engine_class: str) -> tuple[StepTrace, np.ndarray]:
    """`class_steps_from_traces` of a trace already read (the raw-step archive's, `llmvisor.archive`)."""
    ids = step_fingerprint_ids(trace)
    if (ids != "").any():
        trace = trace.select_steps(ids == engine_class)
    timestamps = trace.extra.get("timestamp_s")
    if timestamps is not None:
        per_step = np.asarray(timestamps, dtype=object)[trace.step_starts]
        if all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in per_step.tolist()):
            return trace, per_step.astype(np.float64)
    return trace, np.arange(trace.n_steps, dtype=np.float64)


def refit_class(
    ledger: Ledger,
    engine_class: str,
    *,
    traces: Sequence[Path] = (),
    archive_url: str | None = None,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    newest_steps: int = DEFAULT_NEWEST_STEPS,
    model_params: dict | None = None,
) -> RefitResult:
    """Fit a new version of the class from its ``newest_steps`` steps in the ledger (or ``traces``, or the raw-step
    archive at ``archive_url``), compare it held-out with the active version, store it, and activate it if better."""
    if not 0 < test_fraction < 1:
        raise RefitError(f"--test-fraction must be between 0 and 1 (got {test_fraction})")
    if archive_url:
        from llmvisor.archive import read_archive

        trace, timestamps_s = class_steps(read_archive(archive_url), engine_class)
        source = f"refit from the archive {archive_url}"
    elif traces:
        trace, timestamps_s = class_steps_from_traces(traces, engine_class)
        source = f"refit from {len(traces)} trace file(s)"
    else:
        stored = ledger.stored_steps(engine_class, newest=newest_steps)
        trace = trace_from_stored(stored, engine_class)
        when = dict(zip(stored.keys, stored.timestamp_us.tolist()))
        timestamps_s = np.asarray(
            [when[(r, s)] / 1e6 for r, s in zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist())]
        )
        source = "refit from the ledger"
    train, test = split_by_time(trace, timestamps_s, test_fraction) if trace.n_steps else (trace, trace)
    if train.n_steps < MIN_TRAIN_STEPS or test.n_steps < MIN_TEST_STEPS:
        raise RefitError(
            f"engine class {engine_class!r}: {trace.n_steps} steps to refit from, too few for {MIN_TRAIN_STEPS} to fit and "
            f"{MIN_TEST_STEPS} to test ({'the archive' if archive_url else 'trace files' if traces else 'the ledger'})"
        )
    model = StepLatencyModel(**(model_params or {})).fit(train)
    fingerprint = getattr(model, "engine_fingerprint_", None)
    if not (isinstance(fingerprint, dict) and fingerprint.get("id") == engine_class):
        model.engine_fingerprint_ = {"id": engine_class}
    new_error = mean_abs_relative_error(model, test)
    active_version = ledger.active_versions().get(engine_class)
    active_error = None
    if active_version is not None:
        active_error = mean_abs_relative_error(load_version(ledger, engine_class, active_version), test)
    better = active_error is None or new_error < active_error
    summary = (
        f"{source}: {train.n_steps} steps fitted, newest {test.n_steps} held out; error {new_error:.4f}"
        + ("" if active_error is None else f" vs {active_error:.4f} of v{active_version}")
    )
    version = ledger.add_model(engine_class, json.dumps(model.to_dict()), summary)
    pending = activate(ledger, engine_class, version) if better else None
    return RefitResult(
        engine_class=engine_class, version=version, activated=better, train_steps=train.n_steps, test_steps=test.n_steps,
        new_error=new_error, active_version=active_version, active_error=active_error, pending=pending,
    )
