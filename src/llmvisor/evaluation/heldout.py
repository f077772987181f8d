"""Held-out evaluation of step-latency models: fit on some runs, judge on other runs, never on the same steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from sklearn.metrics import r2_score

from llmvisor.core.features import has_lora_columns
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import bootstrap_quantile_ci
from llmvisor.core.trace import StepTrace
from llmvisor.errors import LlmvisorError
from llmvisor.evaluation.baselines import (
    AdapterBlindModel,
    PaperOLSBaseline,
    RandomForestBaseline,
    StepLatencyPredictor,
    TokenCountBaseline,
    step_phases,
)
from llmvisor.profile.stats import noise_floor

MODEL_FACTORIES: dict[str, Callable[..., StepLatencyPredictor]] = {
    "llmvisor": StepLatencyModel,
    "paper_ols": PaperOLSBaseline,
    "token_count": TokenCountBaseline,
    "random_forest": RandomForestBaseline,
}
LORA_MODEL_FACTORIES: dict[str, Callable[..., StepLatencyPredictor]] = {"adapter_blind": AdapterBlindModel}
"""Models judged beside `MODEL_FACTORIES` when the training trace has the LoRA columns (or when asked by name)."""
PHASES = ("prefill", "decode", "all")
QUANTILES = (50, 90, 99)
SIGNED_QUANTILES = (10, 50, 90)


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
    each step) keeps bootstrap blocks within runs; see `llmvisor.core.stats.bootstrap_quantile_ci`.
    """
    n = measured_s.shape[0]
    out: dict = {"n_steps": int(n)}
    if n == 0:
        return out
    errors = relative_errors(predicted_s, measured_s)
    signed = signed_errors(predicted_s, measured_s)
    out["r2"] = float(r2_score(measured_s, predicted_s)) if n >= 2 else None
    absolute_ci = bootstrap_quantile_ci(errors, QUANTILES, n_resamples=n_bootstrap, seed=seed, groups=groups)
    signed_ci = bootstrap_quantile_ci(signed, (50,), n_resamples=n_bootstrap, seed=seed, groups=groups)
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
    model_names: tuple[str, ...] | None = None,
    llmvisor_params: dict | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> dict:
    """Fit every model on ``train`` and report its errors on the steady steps of ``test``, per phase.

    The baselines are fitted on the very steps llmvisor's fit used (warm-up and outliers removed by its
    stated rules), so the comparison is between model forms, not between cleaned and raw data.

    Returns ``{"models": {name: {phase: metrics}}, "improvement": {phase: {"p90", "p99"}}, ...}`` where
    improvement is token_count's error divided by llmvisor's at that percentile; ``"noise_floor"`` is the one
    floor (`llmvisor.profile.stats.noise_floor`) computed from the traces themselves, on the test runs (the runs
    being judged; None when they repeat no step composition) and on the training runs; ``"by_sharing"`` holds the
    same metrics for the steps with shared KV context and those without (``{"shared": {name: {phase: metrics}},
    "unique": {...}}``).

    With the LoRA columns (trace format 4) in the training trace, ``model_names`` (None: every model) also takes
    ``adapter_blind`` (`AdapterBlindModel`, llmvisor's model without the LoRA terms, with llmvisor's parameters and
    its own cleaning rules); with them in the test trace, ``"by_lora"`` holds the metrics of the steps that ran an
    adapter (``"adapter"``) and of those that ran only the base model (``"base"``).
    """
    check_held_out(train, test)
    factories = {**MODEL_FACTORIES, **LORA_MODEL_FACTORIES}
    if model_names is None:
        model_names = tuple(MODEL_FACTORIES) + (tuple(LORA_MODEL_FACTORIES) if has_lora_columns(train) else ())
    unknown = [name for name in model_names if name not in factories]
    if unknown:
        raise LlmvisorError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(factories)}")
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
            "method": "non-overlapping block bootstrap within runs, percentile intervals, bounded memory (see llmvisor.core.stats.bootstrap_quantile_ci)",
            "n_resamples": n_bootstrap,
            "seed": seed,
        },
        "signed_error": "(predicted - measured) / measured; negative: the model predicts steps faster than they ran",
        "models": {},
        "by_run": {},
        "by_sharing": {},
        "by_lora": {},
        "fitted": {},
        "predictions": {},
    }
    baseline_train = train
    if "llmvisor" in model_names:
        model_names = ("llmvisor", *(name for name in model_names if name != "llmvisor"))
    for name in model_names:
        factory = factories[name]
        if name == "llmvisor":
            model = factory(**(llmvisor_params or {})).fit(train)
            baseline_train = train.select_steps(model.train_step_mask_)
        elif name in LORA_MODEL_FACTORIES:
            model = factory(**(llmvisor_params or {})).fit(train)
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
        for group, in_group in lora_groups(test).items():
            result["by_lora"].setdefault(group, {})[name] = {
                phase: error_summary(predicted[mask & in_group], measured[mask & in_group], n_bootstrap=n_bootstrap, seed=seed, groups=runs[mask & in_group])
                for phase, mask in masks.items()
            }
        for run in test.run_ids:
            in_run = runs == run
            result["by_run"].setdefault(run, {})[name] = {
                phase: error_summary(predicted[mask & in_run], measured[mask & in_run], n_bootstrap=n_bootstrap, seed=seed, groups=runs[mask & in_run])
                for phase, mask in masks.items()
            }
    if "llmvisor" in model_names and "token_count" in model_names:
        result["improvement"] = improvement(result["models"], "token_count")
    result["noise_floor"] = {
        "train": noise_floor(train, n_resamples=n_bootstrap, seed=seed),
        "test": noise_floor(test, n_resamples=n_bootstrap, seed=seed),
    }
    return result


def sharing_groups(test: StepTrace) -> dict[str, np.ndarray]:
    """Step masks of the test steps with shared context (some slice has num_shared_context_tokens > 0, trace
    format v2) and without it ("unique"; every step of a v1 trace), so errors on prefix-shared steps show apart."""
    shared = test.has_shared_context_per_step
    return {"shared": shared, "unique": ~shared}


def lora_groups(test: StepTrace) -> dict[str, np.ndarray]:
    """Step masks of the test steps that ran a LoRA adapter (some slice has a ``lora_name``, trace format 4) and of
    those that ran only the base model; none for a trace without the LoRA columns."""
    if not has_lora_columns(test) or test.n_steps == 0:
        return {}
    runs_adapter = np.add.reduceat((np.asarray(test.extra["lora_name"]) != "").astype(np.int64), test.step_starts) > 0
    return {"adapter": runs_adapter, "base": ~runs_adapter}


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
