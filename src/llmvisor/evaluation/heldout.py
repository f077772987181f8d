"""Held-out evaluation of step-latency models: fit on some runs, judge on other runs, never on the same steps."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from sklearn.metrics import r2_score

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace
from llmvisor.errors import LlmvisorError
from llmvisor.evaluation.baselines import (
    PaperOLSBaseline,
    RandomForestBaseline,
    StepLatencyPredictor,
    TokenCountBaseline,
    step_phases,
)

MODEL_FACTORIES: dict[str, Callable[..., StepLatencyPredictor]] = {
    "llmvisor": StepLatencyModel,
    "paper_ols": PaperOLSBaseline,
    "token_count": TokenCountBaseline,
    "random_forest": RandomForestBaseline,
}
PHASES = ("prefill", "decode", "all")
QUANTILES = (50, 90, 99)
SIGNED_QUANTILES = (10, 50, 90)
MAX_BOOTSTRAP_BLOCKS = 2048
BOOTSTRAP_BINS = 2048
RESAMPLE_CHUNK = 100
STEP_CHUNK = 1 << 18
EDGE_SAMPLE = 1 << 20


def check_held_out(train: StepTrace, test: StepTrace) -> None:
    """Held-out means held out: no run may be in both the training and the test data."""
    shared = sorted(set(train.run_ids) & set(test.run_ids))
    if shared:
        raise LlmvisorError(
            f"run(s) {', '.join(map(repr, shared))} are in both the training and the test traces; "
            "held-out evaluation splits by run"
        )


def steady_steps(trace: StepTrace) -> np.ndarray:
    """Steps that count in evaluation: all but those the recorder marked as warm-up."""
    return ~trace.is_warmup_per_step


def relative_errors(predicted_s: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    return np.abs(predicted_s - measured_s) / measured_s


def signed_errors(predicted_s: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    """(predicted − measured) / measured: negative where the model predicts a step faster than it ran."""
    return (predicted_s - measured_s) / measured_s


def _block_ids(start: int, stop: int, block_steps: int, segment_starts: np.ndarray, segment_first_block: np.ndarray) -> np.ndarray:
    index = np.arange(start, stop)
    segment = np.searchsorted(segment_starts, index, side="right") - 1
    return segment_first_block[segment] + (index - segment_starts[segment]) // block_steps


def _segment_starts(groups: np.ndarray | None, n: int) -> np.ndarray:
    """First index of every stretch of equal ``groups`` labels (a run), found chunk by chunk."""
    if groups is None:
        return np.zeros(1, dtype=np.int64)
    starts = [np.zeros(1, dtype=np.int64)]
    for start in range(0, n - 1, STEP_CHUNK):
        stop = min(n, start + STEP_CHUNK + 1)
        changed = groups[start + 1 : stop] != groups[start : stop - 1]
        starts.append(start + 1 + np.flatnonzero(changed))
    return np.concatenate(starts)


def block_bootstrap_quantile_ci(
    values: np.ndarray,
    percentiles: tuple[float, ...],
    *,
    n_resamples: int = 1000,
    seed: int = 0,
    groups: np.ndarray | None = None,
    block_steps: int | None = None,
    confidence: float = 0.95,
    max_blocks: int = MAX_BOOTSTRAP_BLOCKS,
    n_bins: int = BOOTSTRAP_BINS,
) -> dict:
    """Percentile-method intervals of ``values``' percentiles by a block bootstrap, in memory that does not grow with n.

    Neighbouring steps are alike (same requests, same machine state), so resampling steps one by one
    understates the spread. Steps are cut, in their given order, into contiguous blocks that never straddle a
    change of ``groups`` (the run): ``block_steps`` each, by default ``max(ceil(n^(1/3)), ceil(n / max_blocks))``.
    A resample draws as many blocks as there are, with replacement (Carlstein's non-overlapping block
    bootstrap). ``scipy.stats.bootstrap`` resamples single observations only, hence this.

    Each block is summarised by a histogram over ``n_bins`` bins whose edges are quantiles of (a strided sample
    of at most ``EDGE_SAMPLE`` of) the values, so each bin holds about n / n_bins of them; a resample's
    histogram is its block counts times those histograms, computed ``RESAMPLE_CHUNK`` resamples at a time,
    and the steps are read ``STEP_CHUNK`` at a time. Beyond the input, peak memory is about
    8·(blocks·bins + RESAMPLE_CHUNK·(blocks + 2·bins) + 4·STEP_CHUNK + EDGE_SAMPLE) bytes, blocks ≤
    max_blocks + number of runs: about 60 MiB at the defaults whatever n is, where resampling steps takes
    8·n·n_resamples bytes (80 GB at 10 M steps). A resampled percentile is read off its histogram by linear
    interpolation inside the bin it falls in, so it is exact to within one bin (about 1/n_bins of the
    probability mass). Deterministic for a given ``seed``.

    Returns ``{"ci": {percentile: [low, high]}, "block_steps": int, "n_blocks": int}``.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    if n == 0 or n_resamples <= 0:
        return {"ci": {}, "block_steps": 0, "n_blocks": 0}
    if block_steps is None:
        block_steps = max(math.ceil(n ** (1 / 3)), math.ceil(n / max_blocks))
    block_steps = max(1, int(block_steps))
    segment_starts = _segment_starts(None if groups is None else np.asarray(groups), n)
    segment_lengths = np.diff(np.append(segment_starts, n))
    blocks_per_segment = -(-segment_lengths // block_steps)
    segment_first_block = np.concatenate([[0], np.cumsum(blocks_per_segment)[:-1]])
    n_blocks = int(blocks_per_segment.sum())

    sample = values[np.linspace(0, n - 1, min(n, EDGE_SAMPLE)).astype(np.int64)]
    edges = np.unique(np.quantile(sample, np.linspace(0, 1, n_bins + 1)))
    edges[0], edges[-1] = min(edges[0], values.min()), max(edges[-1], values.max())
    if edges.size == 1:
        edges = np.array([edges[0], edges[0]])
    n_edges_bins = edges.size - 1
    histograms = np.zeros(n_blocks * n_edges_bins, dtype=np.float64)
    for start in range(0, n, STEP_CHUNK):
        stop = min(n, start + STEP_CHUNK)
        bins = np.clip(np.searchsorted(edges, values[start:stop], side="right") - 1, 0, n_edges_bins - 1)
        blocks = _block_ids(start, stop, block_steps, segment_starts, segment_first_block)
        first, last = int(blocks[0]), int(blocks[-1]) + 1
        span = (last - first) * n_edges_bins
        histograms[first * n_edges_bins : last * n_edges_bins] += np.bincount((blocks - first) * n_edges_bins + bins, minlength=span)
    histograms = histograms.reshape(n_blocks, n_edges_bins)

    rng = np.random.default_rng(seed)
    levels = np.asarray(percentiles, dtype=np.float64) / 100
    resampled = np.empty((n_resamples, levels.size))
    uniform = np.full(n_blocks, 1 / n_blocks)
    for start in range(0, n_resamples, RESAMPLE_CHUNK):
        stop = min(n_resamples, start + RESAMPLE_CHUNK)
        counts = rng.multinomial(n_blocks, uniform, size=stop - start).astype(np.float64)
        hist = counts @ histograms
        cumulative = np.cumsum(hist, axis=1)
        for k, level in enumerate(levels):
            target = level * cumulative[:, -1]
            b = np.minimum((cumulative < target[:, None]).sum(axis=1), n_edges_bins - 1)
            rows = np.arange(stop - start)
            below = cumulative[rows, b] - hist[rows, b]
            inside = np.divide(target - below, hist[rows, b], out=np.zeros(stop - start), where=hist[rows, b] > 0)
            resampled[start:stop, k] = edges[b] + np.clip(inside, 0, 1) * (edges[b + 1] - edges[b])
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail], axis=0)
    return {
        "ci": {q: [float(lo), float(hi)] for q, lo, hi in zip(percentiles, low, high)},
        "block_steps": block_steps,
        "n_blocks": n_blocks,
    }


def error_summary(
    predicted_s: np.ndarray,
    measured_s: np.ndarray,
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
    groups: np.ndarray | None = None,
) -> dict:
    """n_steps, R², relative-error percentiles and signed-error percentiles, with block-bootstrap 95% intervals.

    Signed errors (predicted − measured) / measured show bias that absolute errors hide; the
    ``underprediction_factor_p90`` (90th percentile of measured / predicted) is the factor that covers nine
    in ten steps' measured time, what SLO admission can multiply its predictions by. ``groups`` (the run of
    each step) keeps bootstrap blocks within runs; see ``block_bootstrap_quantile_ci``.
    """
    n = measured_s.shape[0]
    out: dict = {"n_steps": int(n)}
    if n == 0:
        return out
    errors = relative_errors(predicted_s, measured_s)
    signed = signed_errors(predicted_s, measured_s)
    out["r2"] = float(r2_score(measured_s, predicted_s)) if n >= 2 else None
    absolute_ci = block_bootstrap_quantile_ci(errors, QUANTILES, n_resamples=n_bootstrap, seed=seed, groups=groups)
    signed_ci = block_bootstrap_quantile_ci(signed, (50,), n_resamples=n_bootstrap, seed=seed, groups=groups)
    point = np.percentile(errors, QUANTILES)
    for q, value in zip(QUANTILES, point):
        out[f"rel_err_p{q}"] = float(value)
        if q in absolute_ci["ci"]:
            out[f"rel_err_p{q}_ci95"] = absolute_ci["ci"][q]
    for q, value in zip(SIGNED_QUANTILES, np.percentile(signed, SIGNED_QUANTILES)):
        out[f"signed_err_p{q}"] = float(value)
    if 50 in signed_ci["ci"]:
        out["signed_err_p50_ci95"] = signed_ci["ci"][50]
    out["underprediction_factor_p90"] = float(np.percentile(measured_s / np.maximum(predicted_s, 1e-12), 90))
    if absolute_ci["n_blocks"]:
        out["bootstrap_block_steps"] = absolute_ci["block_steps"]
        out["bootstrap_n_blocks"] = absolute_ci["n_blocks"]
    out["mean_measured_s"] = float(measured_s.mean())
    return out


def evaluate(
    train: StepTrace,
    test: StepTrace,
    *,
    model_names: tuple[str, ...] = tuple(MODEL_FACTORIES),
    llmvisor_params: dict | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> dict:
    """Fit every model on ``train`` and report its errors on the steady steps of ``test``, per phase.

    The baselines are fitted on the very steps llmvisor's fit used (warm-up and outliers removed by its
    stated rules), so the comparison is between model forms, not between cleaned and raw data.

    Returns ``{"models": {name: {phase: metrics}}, "improvement": {phase: {"p90", "p99"}}, ...}`` where
    improvement is token_count's error divided by llmvisor's at that percentile; ``"by_sharing"`` holds the
    same metrics for the steps with shared KV context and those without (``{"shared": {name: {phase: metrics}},
    "unique": {...}}``).
    """
    check_held_out(train, test)
    unknown = [name for name in model_names if name not in MODEL_FACTORIES]
    if unknown:
        raise LlmvisorError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_FACTORIES)}")
    steady = steady_steps(test)
    measured = test.step_latency_s_per_step
    is_prefill = test.is_prefill_per_step
    masks = {"prefill": steady & is_prefill, "decode": steady & ~is_prefill, "all": steady}
    runs = test.run_id_per_step
    result: dict = {
        "train_runs": train.run_ids,
        "test_runs": test.run_ids,
        "n_train_steps": train.n_steps,
        "baseline_training": "the training steps llmvisor's fit used (warm-up and outlier steps removed by its stated rules)",
        "n_test_steps": test.n_steps,
        "n_test_warmup_excluded": int((~steady).sum()),
        "bootstrap": {
            "method": "non-overlapping block bootstrap within runs, percentile intervals, bounded memory (see block_bootstrap_quantile_ci)",
            "n_resamples": n_bootstrap,
            "seed": seed,
        },
        "signed_error": "(predicted - measured) / measured; negative: the model predicts steps faster than they ran",
        "models": {},
        "by_run": {},
        "by_sharing": {},
        "fitted": {},
        "predictions": {},
    }
    baseline_train = train
    if "llmvisor" in model_names:
        model_names = ("llmvisor", *(name for name in model_names if name != "llmvisor"))
    for name in model_names:
        factory = MODEL_FACTORIES[name]
        if name == "llmvisor":
            model = factory(**(llmvisor_params or {})).fit(train)
            baseline_train = train.select_steps(model.train_step_mask_)
        else:
            model = factory().fit(baseline_train)
        fitted_on = baseline_train
        predicted = model.predict(test)
        result["fitted"][name] = model
        result["predictions"][name] = predicted
        result["models"][name] = {
            phase: error_summary(predicted[mask], measured[mask], n_bootstrap=n_bootstrap, seed=seed, groups=runs[mask])
            for phase, mask in masks.items()
        }
        unseen = unseen_phase_steps(fitted_on, test)
        for phase, mask in masks.items():
            result["models"][name][phase]["n_unseen_phase_fallback"] = int((unseen & mask).sum())
        for group, in_group in sharing_groups(test).items():
            result["by_sharing"].setdefault(group, {})[name] = {
                phase: error_summary(predicted[mask & in_group], measured[mask & in_group], n_bootstrap=n_bootstrap, seed=seed, groups=runs[mask & in_group])
                for phase, mask in masks.items()
            }
        for run in test.run_ids:
            in_run = runs == run
            result["by_run"].setdefault(run, {})[name] = {
                phase: error_summary(predicted[mask & in_run], measured[mask & in_run], n_bootstrap=0)
                for phase, mask in masks.items()
            }
    if "llmvisor" in model_names and "token_count" in model_names:
        result["improvement"] = improvement(result["models"], "token_count")
    result["noise_floor"] = {
        "train": train.metadata.get("noise_floor"),
        "test": test.metadata.get("noise_floor"),
    }
    return result


def sharing_groups(test: StepTrace) -> dict[str, np.ndarray]:
    """Step masks of the test steps with shared context (some slice has num_shared_context_tokens > 0, trace
    format v2) and without it ("unique"; every step of a v1 trace), so errors on prefix-shared steps show apart."""
    shared = test.has_shared_context_per_step
    return {"shared": shared, "unique": ~shared}


def unseen_phase_steps(fitted_on: StepTrace, test: StepTrace) -> np.ndarray:
    """Test steps of a phase (prefill / decode-only) that the training steps never held: every model predicts
    them from what it learnt on the other phase, so they are counted (``n_unseen_phase_fallback``), not hidden."""
    seen = set(step_phases(fitted_on).tolist())
    return ~np.isin(step_phases(test), list(seen))


def improvement(models: dict, baseline: str) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        ours, theirs = models["llmvisor"][phase], models[baseline][phase]
        out[phase] = {
            f"p{q}": (theirs[f"rel_err_p{q}"] / ours[f"rel_err_p{q}"]) if ours.get(f"rel_err_p{q}") else None
            for q in (90, 99)
        }
    return out


def to_json_ready(result: dict) -> dict:
    """The evaluation result without fitted objects and raw predictions (what ``--json`` prints)."""
    return {k: v for k, v in result.items() if k not in ("fitted", "predictions")}
