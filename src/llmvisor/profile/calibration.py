"""Calibration to the served engine, engine-free: where the served engine's fingerprint is read from, when a
live trace covers enough of the engine's envelope to fit on, and how far a model's predictions are from a run.

Coverage rule for fitting on live steps (`live_coverage`): after dropping warm-up and drifted steps, at
least ``MIN_STEPS`` steps, of which ``MIN_PREFILL_STEPS`` run a prefill slice and ``MIN_DECODE_STEPS`` are
decode-only, the decode-only steps spanning ``MIN_DECODE_BATCH_SIZES`` distinct batch sizes (so the
per-request decode term is separable from the step's fixed cost), all from one engine fingerprint. Below
that, the fit would extrapolate from a corner of the envelope; profile instead (``llmvisor calibrate
--fingerprint``), which sweeps it.

Fit rule (`fit_usable`, both ways, after the fit's own rules have dropped warm-up, drifted and outlier
steps): the fit must keep at least ``MIN_FIT_STEPS`` steps, ``MIN_PREFILL_STEPS`` with prefill and
``MIN_DECODE_STEPS`` decode-only over ``MIN_DECODE_BATCH_SIZES`` batch sizes (per phase), and every step
kind the trace covers (`STEP_KINDS`: at least ``MIN_KIND_STEPS`` non-warm-up steps of it) must keep
``MIN_KIND_STEPS`` of them, or half (per covered shape; a few outliers of a rare kind are no reason to refuse). A profile whose canaries flag most of it as drifted (the machine was
busy) fails it: ``calibrate`` then refuses rather than write a model fitted on a handful of steps.
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
MIN_FIT_STEPS = 100
MIN_KIND_STEPS = 10
STEP_KINDS = ("pure prefill", "mixed", "decode-only")


def shortfalls(*checks: tuple[int, int, str]) -> list[str]:
    """``"12 steps (need 100)"`` for each (have, need, what) with have < need: the coverage and fit rules' reasons."""
    return [f"{have} {what} (need {need})" for have, need, what in checks if have < need]

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
    missing = shortfalls(
        (covered["n_steps"], MIN_STEPS, "steps"),
        (covered["n_prefill_steps"], MIN_PREFILL_STEPS, "steps with prefill"),
        (covered["n_decode_steps"], MIN_DECODE_STEPS, "decode-only steps"),
        (len(covered["decode_batch_sizes"]), MIN_DECODE_BATCH_SIZES, "decode batch sizes"),
    )
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


def step_kinds(trace: StepTrace) -> np.ndarray:
    """Per step, its index in `STEP_KINDS`: prefill slices only, prefill and decode slices, decode only."""
    if trace.n_steps == 0:
        return np.zeros(0, dtype=np.int64)
    has_prefill = trace.is_prefill_per_step
    has_decode = np.logical_or.reduceat(~trace.is_prefill, trace.step_starts)
    return np.where(has_prefill & ~has_decode, 0, np.where(has_prefill, 1, 2))


def fit_usable(model: StepLatencyModel, trace: StepTrace) -> dict:
    """What the fit of ``model`` on ``trace`` kept after its warm-up, drift and outlier rules, per phase and
    per covered step kind, and ``short``: the fit rule's unmet conditions (empty: enough to fit on)."""
    used = np.asarray(model.train_step_mask_, dtype=bool)
    kinds = step_kinds(trace)
    steady = ~trace.is_warmup_per_step
    info = model.fit_info_
    usable = {
        "n_steps_total": int(trace.n_steps),
        "n_steps_used": int(used.sum()),
        "n_warmup_dropped": int(info["n_warmup_dropped"]),
        "n_drifted_dropped": int(info["n_drifted_dropped"]),
        "n_outliers_dropped": int(info["n_outliers_dropped"]),
        "n_prefill_steps_used": int((used & trace.is_prefill_per_step).sum()),
        "n_decode_steps_used": int((used & (kinds == 2)).sum()),
        "decode_batch_sizes_used": len(set(trace.batch_size_per_step[used & (kinds == 2)].tolist())),
        "kinds": {name: {"covered": int((steady & (kinds == k)).sum()), "used": int((used & (kinds == k)).sum())}
                  for k, name in enumerate(STEP_KINDS)},
    }
    short = shortfalls(
        (usable["n_steps_used"], MIN_FIT_STEPS, "steps"),
        (usable["n_prefill_steps_used"], MIN_PREFILL_STEPS, "with prefill"),
        (usable["n_decode_steps_used"], MIN_DECODE_STEPS, "decode-only"),
        (usable["decode_batch_sizes_used"], MIN_DECODE_BATCH_SIZES, "decode batch sizes"),
    )
    for name, counts in usable["kinds"].items():
        if counts["covered"] >= MIN_KIND_STEPS and counts["used"] < min(MIN_KIND_STEPS, counts["covered"] / 2):
            short.append(f"{counts['used']} of {counts['covered']} {name} steps (need {MIN_KIND_STEPS})")
    usable["short"] = short
    usable["rule"] = (
        f"after the warm-up, drift and outlier rules: >= {MIN_FIT_STEPS} steps, >= {MIN_PREFILL_STEPS} with prefill, "
        f">= {MIN_DECODE_STEPS} decode-only over >= {MIN_DECODE_BATCH_SIZES} batch sizes, and of every step kind "
        f"({', '.join(STEP_KINDS)}) the trace has >= {MIN_KIND_STEPS} non-warm-up steps of, >= {MIN_KIND_STEPS} or half of them"
    )
    return usable


def describe_short_fit(usable: dict) -> str:
    """One line: what the fit kept, what it dropped and why, and the conditions it misses."""
    return (
        f"the fit kept {usable['n_steps_used']} of {usable['n_steps_total']} steps ({usable['n_warmup_dropped']} warm-up, "
        f"{usable['n_drifted_dropped']} drifted, {usable['n_outliers_dropped']} outliers dropped): "
        f"{'; '.join(usable['short'])}"
    )
