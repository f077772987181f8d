"""Speed figures, each measured in the run that prints it (compare ratios within one run: machines are noisy)."""

from __future__ import annotations

import resource
import time
import tracemalloc

import numpy as np
import scipy.signal

from llmvisor.core.attribution import StepAttributor, attribute
from llmvisor.core.features import summary_step_features
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import bootstrap_quantile_ci
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.evaluation.baselines import RandomForestBaseline
from llmvisor.evaluation.heldout import QUANTILES

BATCH_SIZES = (1, 8, 64, 256)


def _time_calls_us(call, arguments: list[tuple], repeats: int) -> np.ndarray:
    timings = np.empty(len(arguments) * repeats)
    k = 0
    for _ in range(repeats):
        for args in arguments:
            start = time.perf_counter_ns()
            call(*args)
            timings[k] = time.perf_counter_ns() - start
            k += 1
    return timings / 1e3


def run_benchmarks(*, model: StepLatencyModel | None = None, n_fit_steps: int = 100_000, n_offline_slices: int = 5_000_000, progress=None) -> dict:
    """Per-step attribution latency vs a random forest's per-step prediction, offline throughput, fit time.

    Steps are drawn from a synthetic mix (30% of steps hold a prefill chunk, the rest are decode-only), so
    the p50 is a decode-only step as in a serving engine; mixed steps are also reported on their own.
    """
    step = progress or (lambda message: None)
    step("fit on 100k steps")
    fit_trace = synthetic_trace(n_fit_steps, noise=0.05, seed=1)
    StepLatencyModel(segments="auto").fit(synthetic_trace(2_000, noise=0.05, seed=4))  # first-call costs (imports, BLAS start-up)
    start = time.perf_counter()
    fitted = StepLatencyModel(segments="auto").fit(fit_trace)
    fit_s = time.perf_counter() - start
    model = model or fitted

    step("random forest")
    forest = RandomForestBaseline().fit(synthetic_trace(5_000, noise=0.05, seed=2))
    attributor = StepAttributor(model)
    result: dict = {
        "attribute_step_us": {},
        "attribute_step_us_p90": {},
        "attribute_step_us_decode_only": {},
        "attribute_step_us_with_prefill": {},
        "random_forest_step_us": {},
        "speedup_vs_random_forest": {},
    }
    for batch_size in BATCH_SIZES:
        step(f"per-step attribution, B={batch_size}")
        steps = synthetic_trace(400, min_batch_size=batch_size, max_batch_size=batch_size, seed=batch_size)
        arguments, has_prefill = [], []
        for k in range(steps.n_steps):
            s = slice(steps.step_offsets[k], steps.step_offsets[k + 1])
            arguments.append(
                (
                    steps.num_new_tokens[s].astype(np.float64),
                    steps.num_context_tokens[s].astype(np.float64),
                    steps.is_prefill[s].copy(),
                    float(steps.step_latency_s_per_step[k]),
                )
            )
            has_prefill.append(bool(steps.is_prefill[s].any()))
        timings = _time_calls_us(attributor.attribute, arguments, repeats=25).reshape(25, -1)
        has_prefill = np.array(has_prefill)
        key = str(batch_size)
        result["attribute_step_us"][key] = float(np.percentile(timings, 50))
        result["attribute_step_us_p90"][key] = float(np.percentile(timings, 90))
        result["attribute_step_us_decode_only"][key] = float(np.percentile(timings[:, ~has_prefill], 50)) if (~has_prefill).any() else None
        result["attribute_step_us_with_prefill"][key] = float(np.percentile(timings[:, has_prefill], 50)) if has_prefill.any() else None
        features, _ = summary_step_features(steps)
        rows = [(features[k : k + 1],) for k in range(min(40, steps.n_steps))]
        forest_us = float(np.percentile(_time_calls_us(forest.predict_features, rows, repeats=2), 50))
        result["random_forest_step_us"][key] = forest_us
        result["speedup_vs_random_forest"][key] = forest_us / result["attribute_step_us"][key]

    step("offline attribution")
    offline = synthetic_trace(max(1, n_offline_slices // 32), seed=3)
    attribute(model, offline)
    start = time.perf_counter()
    attribute(model, offline)
    offline_s = time.perf_counter() - start
    result["offline_slices_per_s"] = offline.n_slices / offline_s
    result["fit_100k_steps_s"] = fit_s
    result["fit_n_steps"] = fit_trace.n_steps
    result["fit_n_slices"] = fit_trace.n_slices
    result["fit_boundary_new_tokens"] = fitted.boundary_
    return result


def run_bootstrap_benchmark(*, n_steps: int = 10_000_000, n_resamples: int = 1000, seed: int = 0) -> dict:
    """Seconds and peak memory of the block-bootstrap intervals (p50/p90/p99) on ``n_steps`` synthetic errors.

    The errors are |AR(1)| with lag-one correlation 0.9, so neighbours are alike as in a trace. Peak memory is
    what tracemalloc saw allocated during the call beyond the input (numpy reports its buffers to it), so it
    is the bootstrap's own; resampling steps one by one would hold ``8·n_steps·n_resamples`` bytes.
    """
    rng = np.random.default_rng(seed)
    shocks = rng.standard_normal(n_steps)
    errors = np.abs(scipy.signal.lfilter([np.sqrt(1 - 0.9**2)], [1.0, -0.9], shocks)) * 0.05
    del shocks
    runs = np.repeat(np.arange(max(1, n_steps // 1_000_000)), 1_000_000)[:n_steps]
    if runs.size < n_steps:
        runs = np.concatenate([runs, np.full(n_steps - runs.size, runs[-1] if runs.size else 0)])
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.perf_counter()
    result = bootstrap_quantile_ci(errors, QUANTILES, n_resamples=n_resamples, seed=seed, groups=runs)
    seconds = time.perf_counter() - start
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "n_steps": n_steps,
        "n_resamples": n_resamples,
        "n_runs": int(runs[-1]) + 1,
        "block_steps": result["block_steps"],
        "n_blocks": result["n_blocks"],
        "seconds": seconds,
        "peak_traced_mib": peak_bytes / 2**20,
        "input_mib": (errors.nbytes + runs.nbytes) / 2**20,
        "step_resampling_would_hold_mib": 8 * n_steps * n_resamples / 2**20,
        "ci95": {str(q): bounds for q, bounds in result["ci"].items()},
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
