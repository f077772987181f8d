"""Calibration to the served engine, engine-free: where the served engine's fingerprint is read from, when a
live trace covers enough of the engine's envelope to fit on, and how far a model's predictions are from a run.

Coverage rule for fitting on live steps (`live_coverage`): after dropping warm-up and drifted steps, at
least ``MIN_STEPS`` steps, of which ``MIN_PREFILL_STEPS`` run a prefill slice and ``MIN_DECODE_STEPS`` are
decode-only, the decode-only steps spanning ``MIN_DECODE_BATCH_SIZES`` distinct batch sizes (so the
per-request decode term is separable from the step's fixed cost), all from one engine fingerprint. Below
that, the fit would extrapolate from a corner of the envelope; profile instead (``llmvisor calibrate
--fingerprint``), which sweeps it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from llmvisor.core.fingerprint import METADATA_KEY, EngineFingerprint, fingerprint_sidecar
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import quantile_summary
from llmvisor.core.trace import StepTrace, read_trace
from llmvisor.errors import LlmvisorError

MIN_STEPS = 200
MIN_PREFILL_STEPS = 20
MIN_DECODE_STEPS = 50
MIN_DECODE_BATCH_SIZES = 4
def read_fingerprint(path: str | os.PathLike) -> EngineFingerprint:
    """The engine fingerprint in a JSON record, in a Parquet trace's metadata, or beside a JSONL/CSV trace."""
    path = Path(path)
    if not path.exists():
        raise LlmvisorError(f"{path}: no such file (expected a fingerprint record or a recorded trace)")
    if path.suffix.lower() == ".parquet":
        recorded = read_trace(path).metadata.get(METADATA_KEY)
        if not recorded:
            raise LlmvisorError(f"{path}: the trace metadata holds no engine_fingerprint (recorded before fingerprints?)")
        return EngineFingerprint.from_dict(recorded, source=str(path))
    if path.suffix.lower() in (".jsonl", ".csv"):
        sidecar = fingerprint_sidecar(path)
        if not sidecar.exists():
            raise LlmvisorError(f"{path}: no fingerprint record {sidecar.name} beside it (the recorder writes one at engine start)")
        path = sidecar
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LlmvisorError(f"{path}: not a JSON fingerprint record ({error})") from None
    if isinstance(data, dict) and isinstance(data.get(METADATA_KEY), dict):
        data = data[METADATA_KEY]
    return EngineFingerprint.from_dict(data, source=str(path))


def live_coverage(trace: StepTrace) -> dict:
    """What a live trace covers, and ``missing``: the coverage rule's unmet conditions (empty: fit on it)."""
    keep = ~trace.is_warmup_per_step & ~trace.is_drifted_per_step
    prefill = trace.is_prefill_per_step & keep
    decode_only = ~trace.is_prefill_per_step & keep
    sizes = trace.batch_size_per_step[decode_only]
    fingerprints = trace.engine_fingerprint_ids()
    covered = {
        "n_steps": int(keep.sum()),
        "n_prefill_steps": int(prefill.sum()),
        "n_decode_steps": int(decode_only.sum()),
        "decode_batch_sizes": sorted({int(s) for s in sizes}),
        "engine_fingerprints": fingerprints,
    }
    missing = []
    if covered["n_steps"] < MIN_STEPS:
        missing.append(f"{covered['n_steps']} steps (need {MIN_STEPS})")
    if covered["n_prefill_steps"] < MIN_PREFILL_STEPS:
        missing.append(f"{covered['n_prefill_steps']} steps with prefill (need {MIN_PREFILL_STEPS})")
    if covered["n_decode_steps"] < MIN_DECODE_STEPS:
        missing.append(f"{covered['n_decode_steps']} decode-only steps (need {MIN_DECODE_STEPS})")
    if len(covered["decode_batch_sizes"]) < MIN_DECODE_BATCH_SIZES:
        missing.append(f"{len(covered['decode_batch_sizes'])} decode batch sizes (need {MIN_DECODE_BATCH_SIZES})")
    if len(fingerprints) > 1:
        missing.append(f"steps of {len(fingerprints)} engine fingerprints (need one: {', '.join(fingerprints)})")
    covered["missing"] = missing
    covered["rule"] = (
        f"non-warm-up, non-drifted steps: >= {MIN_STEPS}, >= {MIN_PREFILL_STEPS} with prefill, >= {MIN_DECODE_STEPS} "
        f"decode-only over >= {MIN_DECODE_BATCH_SIZES} batch sizes, one engine fingerprint"
    )
    return covered


def residual_quantiles(model: StepLatencyModel, trace: StepTrace) -> dict:
    """Relative residuals (measured − predicted) / measured of a run's non-warm-up steps: signed p10/p50/p90
    and |·| p50/p90, as the service's ``llmvisor_run_relative_residual`` reports them live."""
    keep = ~trace.is_warmup_per_step
    measured = trace.step_latency_s_per_step[keep]
    predicted = model.predict(trace)[keep]
    relative = (measured - predicted) / measured
    if relative.size == 0:
        raise LlmvisorError(f"{', '.join(trace.sources)}: no steps after warm-up to evaluate on")
    signed = quantile_summary(relative, (10, 50, 90))
    absolute = quantile_summary(np.abs(relative), (50, 90))
    return {
        "n_steps": signed["n"],
        **{f"relative_residual_{key}": signed[key] for key in ("p10", "p50", "p90")},
        **{f"abs_relative_residual_{key}": absolute[key] for key in ("p50", "p90")},
    }
