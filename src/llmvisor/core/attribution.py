"""Split each step's time among the requests that ran in it.

The model prices a step as T̂ = b + Σ_i f_i: a shared intercept b and one own term f_i per slice, with the
coefficients of the step's segment. Read as a cost game v(S) = b·[S ≠ ∅] + Σ_{i∈S} f_i (every subset priced
with the coefficients of the step that actually ran), the Shapley value is

    φ_i = f_i + b / |B|

since the additive part goes to its owner and b, paid once by whichever request comes first, is each
request's with probability 1/|B|. That is the default rule, ``shapley``. When the step's measured time T is
known, the residual T − T̂ is spread in proportion to the predicted shares: share_i = φ_i · T / Σφ. With
nonnegative coefficients φ_i ≥ 0, so shares are ≥ 0 and sum to T exactly: every measured second is billed
once. Under an unconstrained (OLS) fit a φ_i can be negative; it is clipped to 0 before scaling (and if every
φ_i is 0 the step is split equally), so the guarantees hold for any model.

Alternatives, named in every output:
- ``proportional``: share_i = T · f_i⁺ / Σ f⁺ (the intercept follows the own terms; no equal part).
- ``paper``: the paper's plain reading, share_i = f_i; b and the residual are left unattributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from llmvisor.errors import LlmvisorError
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace

RULES = ("shapley", "proportional", "paper")


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise LlmvisorError(f"unknown attribution rule {rule!r}; choose one of {', '.join(RULES)}")


def own_terms_s(coef: np.ndarray, num_new_tokens, num_context_tokens, is_prefill) -> np.ndarray:
    """Each slice's own predicted seconds under one coefficient set (vectorised over slices)."""
    _, k1, k2, k3, k4, k5, d6, d7 = coef
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    prefill = p * (k1 + k3 * p + k4 * c) + k2 * c + k5
    decode = d6 * c + d7
    return np.where(is_prefill, prefill, decode)


@dataclass
class Attribution:
    """Per-slice shares of a trace under one rule, with the predictions they came from."""

    rule: str
    share_s: np.ndarray
    own_s: np.ndarray
    predicted_step_s: np.ndarray
    measured_step_s: np.ndarray | None

    @property
    def total_attributed_s(self) -> float:
        return float(self.share_s.sum())

    @property
    def total_measured_s(self) -> float | None:
        return None if self.measured_step_s is None else float(self.measured_step_s.sum())


def attribute_arrays(
    model: StepLatencyModel,
    num_new_tokens: np.ndarray,
    num_context_tokens: np.ndarray,
    is_prefill: np.ndarray,
    step_offsets: np.ndarray,
    measured_step_s: np.ndarray | None = None,
    rule: str = "shapley",
) -> Attribution:
    """Vectorised attribution of many steps given as flat slice arrays and step offsets."""
    _check_rule(rule)
    model._check_fitted()
    starts = step_offsets[:-1]
    batch_size = np.diff(step_offsets)
    if batch_size.size and batch_size.min() < 1:
        raise LlmvisorError("every step needs at least one slice")
    p = np.asarray(num_new_tokens, dtype=np.float64)
    if model.boundary_ is None:
        own = own_terms_s(model.coef_[0], p, num_context_tokens, is_prefill)
        shared_step = np.full(batch_size.shape, model.coef_[0, 0])
    else:
        load = np.add.reduceat(p, starts) if starts.size else np.zeros(0)
        segment_step = model.segment_of_steps(load)
        segment_slice = np.repeat(segment_step, batch_size)
        own = np.where(
            segment_slice == 0,
            own_terms_s(model.coef_[0], p, num_context_tokens, is_prefill),
            own_terms_s(model.coef_[1], p, num_context_tokens, is_prefill),
        )
        shared_step = model.coef_[segment_step, 0]
    own_sum = np.add.reduceat(own, starts) if starts.size else np.zeros(0)
    predicted = own_sum + shared_step

    if rule == "paper":
        share = own
    else:
        if rule == "shapley":
            basis = own + np.repeat(shared_step / batch_size, batch_size)
        else:
            basis = own
        basis = np.maximum(basis, 0.0)
        basis_sum = np.add.reduceat(basis, starts) if starts.size else np.zeros(0)
        target = predicted if measured_step_s is None else np.asarray(measured_step_s, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(basis_sum > 0, target / basis_sum, 0.0)
        share = basis * np.repeat(scale, batch_size)
        empty = basis_sum <= 0
        if empty.any():
            equal = np.repeat(np.where(empty, target / batch_size, 0.0), batch_size)
            share = np.where(np.repeat(empty, batch_size), equal, share)
    return Attribution(
        rule=rule,
        share_s=share,
        own_s=own,
        predicted_step_s=predicted,
        measured_step_s=None if measured_step_s is None else np.asarray(measured_step_s, dtype=np.float64),
    )


def attribute(model: StepLatencyModel, trace: StepTrace, rule: str = "shapley", *, use_measured: bool = True) -> Attribution:
    """Shares of every slice of ``trace``; with ``use_measured`` the measured step times are split."""
    return attribute_arrays(
        model,
        trace.num_new_tokens,
        trace.num_context_tokens,
        trace.is_prefill,
        trace.step_offsets,
        trace.step_latency_s_per_step if use_measured else None,
        rule,
    )


def aggregate(trace: StepTrace, attribution: Attribution, by: str = "tenant") -> dict[str, float]:
    """Attributed seconds per tenant or per request (request keys are ``run_id/request_id``)."""
    if by == "tenant":
        keys = pa.array(trace.tenant, pa.string())
    elif by == "request":
        keys = pc.binary_join_element_wise(pa.array(trace.run_id, pa.string()), pa.array(trace.request_id, pa.string()), "/")
    else:
        raise LlmvisorError(f"unknown grouping {by!r}; choose tenant or request")
    encoded = pc.dictionary_encode(keys)
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    names = encoded.dictionary.to_pylist()
    totals = np.bincount(codes, weights=attribution.share_s, minlength=len(names))
    return dict(zip(names, totals.tolist()))


class StepAttributor:
    """Attribution of one step at a time, for use inside a scheduler loop.

    Coefficients are unpacked once and work arrays preallocated, so a step costs a handful of numpy calls
    on arrays of the batch's size; a decode-only step (the common case) is priced in closed form without
    materialising its own terms first. Inputs are float64 arrays of new and context tokens and a bool array
    of prefill flags, one entry per request; the returned array is reused by the next call.
    Same results as ``attribute_arrays`` (tested).
    """

    def __init__(self, model: StepLatencyModel, rule: str = "shapley", max_batch_size: int = 4096):
        _check_rule(rule)
        model._check_fitted()
        self.rule = rule
        self.boundary = model.boundary_
        self._coef = [tuple(float(v) for v in row) for row in model.coef_]
        self._nonnegative = bool(np.all(model.coef_ >= 0))
        self._ones = np.ones(max_batch_size)
        self._out = np.empty(max_batch_size)
        self._work = np.empty(max_batch_size)

    def _coefficients(self, p: np.ndarray, ones: np.ndarray) -> tuple:
        if self.boundary is None or p.dot(ones) < self.boundary:
            return self._coef[0]
        return self._coef[1]

    def _own_terms(self, coef: tuple, p: np.ndarray, c: np.ndarray, is_prefill: np.ndarray, n: int) -> np.ndarray:
        _, k1, k2, k3, k4, k5, d6, d7 = coef
        own = self._out[:n]
        np.multiply(c, d6, out=own)
        own += d7
        work = self._work[:n]
        np.multiply(p, k3, out=work)
        work += k1
        work += k4 * c
        work *= p
        work += k2 * c
        work += k5
        np.copyto(own, work, where=is_prefill)
        return own

    def predict_step_s(self, num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray) -> float:
        """Predicted step time of a batch, for admission decisions."""
        n = num_new_tokens.shape[0]
        ones = self._ones[:n]
        coef = self._coefficients(num_new_tokens, ones)
        if np.count_nonzero(is_prefill) == 0:
            return coef[0] + coef[6] * num_context_tokens.dot(ones) + coef[7] * n
        return coef[0] + float(self._own_terms(coef, num_new_tokens, num_context_tokens, is_prefill, n).dot(ones))

    def attribute(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        is_prefill: np.ndarray,
        measured_s: float | None = None,
    ) -> np.ndarray:
        """Each request's share of the step in seconds (summing to ``measured_s`` when given)."""
        n = num_new_tokens.shape[0]
        ones = self._ones[:n]
        coef = self._coefficients(num_new_tokens, ones)
        b, d6, d7 = coef[0], coef[6], coef[7]
        shapley = self.rule == "shapley"
        if self.rule != "paper" and self._nonnegative and np.count_nonzero(is_prefill) == 0:
            own_total = d6 * num_context_tokens.dot(ones) + d7 * n
            basis_total = own_total + b if shapley else own_total
            target = own_total + b if measured_s is None else measured_s
            out = self._out[:n]
            if basis_total <= 0:
                out.fill(target / n)
                return out
            scale = target / basis_total
            np.multiply(num_context_tokens, d6 * scale, out=out)
            out += ((d7 + b / n) if shapley else d7) * scale
            return out
        own = self._own_terms(coef, num_new_tokens, num_context_tokens, is_prefill, n)
        if self.rule == "paper":
            return own
        target = own.dot(ones) + b if measured_s is None else measured_s
        if shapley:
            own += b / n
        if not self._nonnegative:
            np.maximum(own, 0.0, out=own)
        total = own.dot(ones)
        if total > 0:
            own *= target / total
        else:
            own.fill(target / n)
        return own
