"""Baselines llmvisor is compared with, fitted on the same training steps and judged on the same held-out steps.

Every one of them, and ``StepLatencyModel``, is a ``StepLatencyPredictor``: ``fit(trace) -> self`` and
``predict(trace) -> seconds per step``.
"""

from __future__ import annotations

from typing import Protocol, Self, runtime_checkable

import numpy as np
from sklearn.ensemble import RandomForestRegressor
from sklearn.linear_model import LinearRegression

from llmvisor.core.features import summary_step_features
from llmvisor.core.game import VTC_TOKEN_PRICES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace
from llmvisor.core.trace_schema import LORA_COLUMNS
from llmvisor.errors import NotFittedError

PHASE_NAMES = ("prefill", "decode")


@runtime_checkable
class StepLatencyPredictor(Protocol):
    """What held-out evaluation needs of a model: learn from a trace's steps, predict each step's seconds."""

    def fit(self, trace: StepTrace) -> Self: ...

    def predict(self, trace: StepTrace) -> np.ndarray: ...


def step_phases(trace: StepTrace) -> np.ndarray:
    """Each step's phase: "prefill" if it holds any prefill slice, else "decode"."""
    return np.where(trace.is_prefill_per_step, "prefill", "decode")


class _PerPhase:
    """One regressor for prefill steps (any prefill slice) and one for decode-only steps.

    A phase the training steps never held is predicted by the other phase's regressor; ``predict`` counts
    those steps in ``n_unseen_phase_fallback_`` (per phase) so that it is reported, not silent.
    """

    def _design(self, trace: StepTrace) -> np.ndarray:
        raise NotImplementedError

    def _regressor(self):
        return LinearRegression()

    def fit(self, trace: StepTrace) -> Self:
        x = self._design(trace)
        y = trace.step_latency_s_per_step
        prefill = trace.is_prefill_per_step
        self.regressors_ = {}
        for name, mask in (("prefill", prefill), ("decode", ~prefill)):
            if mask.any():
                self.regressors_[name] = self._regressor().fit(x[mask], y[mask])
        return self

    def predict(self, trace: StepTrace) -> np.ndarray:
        if not hasattr(self, "regressors_"):
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet")
        x = self._design(trace)
        prefill = trace.is_prefill_per_step
        out = np.full(trace.n_steps, np.nan)
        self.n_unseen_phase_fallback_ = {}
        for name, mask in (("prefill", prefill), ("decode", ~prefill)):
            regressor = self.regressors_.get(name)
            self.n_unseen_phase_fallback_[name] = 0 if regressor is not None else int(mask.sum())
            if mask.any():
                regressor = regressor or next(iter(self.regressors_.values()))
                out[mask] = regressor.predict(x[mask])
        return out


class TokenCountBaseline(_PerPhase):
    """VTC's cost (prompt tokens ×1, output tokens ×2, counted per step), mapped to seconds by a line per phase.

    A prefill slice's tokens are prompt tokens; a decode slice's token is an output token
    (`llmvisor.core.game.TokenPrices.step_costs`).
    """

    def _design(self, trace: StepTrace) -> np.ndarray:
        return VTC_TOKEN_PRICES.step_costs(trace.num_new_tokens, trace.is_prefill, trace.step_starts)[:, None]


class PaperOLSBaseline(_PerPhase):
    """The paper's model as published: b + a1·Σp + a2·Σc + a3·Σp² + a4·|B| per phase, plain OLS, one segment."""

    def _design(self, trace: StepTrace) -> np.ndarray:
        p = trace.num_new_tokens.astype(np.float64)
        c = trace.num_context_tokens.astype(np.float64)
        if trace.n_steps == 0:
            return np.zeros((0, 4))
        sums = np.add.reduceat(np.column_stack([p, c, p * p]), trace.step_starts, axis=0)
        return np.column_stack([sums, trace.batch_size_per_step.astype(np.float64)])


class RandomForestBaseline:
    """A random forest on what a step holds (per-phase token sums, counts, max context).

    Fitted on log latency, so its errors are relative like the metric it is judged by.
    """

    def __init__(self, *, n_estimators: int = 100, min_samples_leaf: int = 2, random_state: int = 0):
        self.n_estimators = n_estimators
        self.min_samples_leaf = min_samples_leaf
        self.random_state = random_state

    def fit(self, trace: StepTrace) -> Self:
        x, self.feature_names_ = summary_step_features(trace)
        self.forest_ = RandomForestRegressor(
            n_estimators=self.n_estimators,
            min_samples_leaf=self.min_samples_leaf,
            random_state=self.random_state,
            n_jobs=1,
        ).fit(x, np.log(trace.step_latency_s_per_step))
        return self

    def predict(self, trace: StepTrace) -> np.ndarray:
        if not hasattr(self, "forest_"):
            raise NotFittedError("this RandomForestBaseline is not fitted yet")
        x, _ = summary_step_features(trace)
        return np.exp(self.forest_.predict(x))

    def predict_features(self, x: np.ndarray) -> np.ndarray:
        return np.exp(self.forest_.predict(x))



def without_lora_columns(trace: StepTrace) -> StepTrace:
    """The trace as an engine without LoRA columns would have written it (format 3 or lower): same steps and times."""
    return StepTrace(**{**trace.__dict__, "extra": {k: v for k, v in trace.extra.items() if k not in LORA_COLUMNS}})


class AdapterBlindModel:
    """llmvisor's model without its LoRA terms: the same features, hyper-parameters and stated cleaning rules, fitted
    and judged on the trace without the LoRA columns, so adapter work can only land in the token and batch terms.

    It is the model a LoRA engine got before the LoRA terms (issue #38), what the LoRA-aware model must beat."""

    def __init__(self, **params):
        self.params = params

    def fit(self, trace: StepTrace) -> Self:
        self.model_ = StepLatencyModel(**self.params).fit(without_lora_columns(trace))
        return self

    def predict(self, trace: StepTrace) -> np.ndarray:
        if not hasattr(self, "model_"):
            raise NotFittedError("this AdapterBlindModel is not fitted yet")
        return self.model_.predict(without_lora_columns(trace))
