"""Split each step's time among the requests that ran in it: the rules, the bills, the online attributor.

The default rule, ``shapley``, is the exact Shapley value of the model's cost game, defined with its
derivation in `llmvisor.core.game` (the price of a step and of any subset of it, in its own segment, with
shared KV blocks split among their readers): φ_i = f_i + b / |B| in closed form, exact over subset loads for
the steps straddling a segment boundary. This module turns those values into bills.

Across steps, the rule bills a request for what the engine did for it in its own steps: a prefix-cache hit
shows as context (c, and ĉ when the cached blocks are shared in the step), so a request reusing another's
cached prompt pays attention over those tokens but not for computing them; the request whose prefill
computed them paid for that in its step. The alternative, amortising the first prefill over the later hits
(charging each hit a part of the prefill that produced the blocks), would need the engine's block
provenance across steps and would change bills already issued whenever a new hit arrives; it is not
done (see docs/attribution.md).

LoRA adapters (a LoRA model, trace format v4): a slice's per-token adapter work is its own; each adapter's per-step
terms (its kernels, its loads) are split equally among the step's slices of that adapter and charged to nobody else
(the Shapley value, derived in `llmvisor.core.game`); so an adapter's load is billed to the tenants whose requests ran
it. The LoRA path a step with any adapter switches on is shared: its set-up by the step's adapter requests, its work
over a base-model request's tokens A/(A+1) by that request and the rest by the A adapter requests. The shares travel
per slice as ``LoraSlices`` (`llmvisor.core.features.lora_slices`).

When the step's measured time T is known, the residual T − T̂ is spread in proportion to the predicted
shares: share_i = φ_i · T / Σφ. With nonnegative coefficients φ_i ≥ 0, so shares are ≥ 0 and sum to T
exactly: every measured second is billed once. Under an unconstrained (OLS) fit a φ_i can be negative; it is
clipped to 0 before scaling, and if every φ_i is 0 the step is split equally (counted: ``n_equal_split``),
so the guarantees hold for any model.

Alternatives, named in every output:
- ``proportional``: share_i = T · f_i⁺ / Σ f⁺ with the step's segment (the intercept follows the own terms).
- ``paper``: the paper's plain reading, share_i = f_i; b and the residual are left unattributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from llmvisor.core.features import LoraSlices, decode_own_s, lora_own_s, lora_slices_of, own_terms_s, prefill_own_s
from llmvisor.core.game import (
    decode_own_total_s,
    decode_prices,
    decode_shapley_into,
    decode_step_price_s,
    segment_of,
    shapley_s,
    step_prices,
    step_shapley_s,
    subset_costs_s,
)
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace
from llmvisor.errors import LlmvisorError

__all__ = [
    "RULES",
    "Attribution",
    "AttributionRule",
    "StepAttributor",
    "aggregate",
    "attribute",
    "attribute_arrays",
    "own_terms_s",
    "parse_rule",
    "step_shapley_s",
    "subset_costs_s",
]


class AttributionRule(StrEnum):
    """How a step's time is split; the values are the names used on the command line and in outputs."""

    SHAPLEY = "shapley"
    PROPORTIONAL = "proportional"
    PAPER = "paper"

    def __str__(self) -> str:
        return self.value


RULES = tuple(rule.value for rule in AttributionRule)
"""The rules' names, in the order outputs list them."""


def parse_rule(rule: str | AttributionRule) -> AttributionRule:
    """The rule named ``rule``; a one-line ``LlmvisorError`` listing the choices otherwise."""
    try:
        return AttributionRule(rule)
    except ValueError:
        raise LlmvisorError(f"unknown attribution rule {rule!r}; choose one of {', '.join(RULES)}") from None


@dataclass
class Attribution:
    """Per-slice shares of a trace under one rule, with the predictions they came from.

    ``n_equal_split`` counts the steps split equally because the rule's basis was 0 for every slice (an
    unconstrained fit predicting ≤ 0): a fallback, reported rather than silent.
    """

    rule: AttributionRule
    share_s: np.ndarray
    own_s: np.ndarray
    predicted_step_s: np.ndarray
    measured_step_s: np.ndarray | None
    n_equal_split: int = 0

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
    rule: str | AttributionRule = AttributionRule.SHAPLEY,
    effective_context_tokens: np.ndarray | None = None,
    *,
    lora: LoraSlices | None = None,
) -> Attribution:
    """Vectorised attribution of many steps given as flat slice arrays and step offsets;
    ``effective_context_tokens`` (trace format v2) defaults to the context: nothing shared; ``lora`` (trace
    format v4, priced by a LoRA model) to every slice running the base model."""
    e = effective_context_tokens
    rule = parse_rule(rule)
    model.check_is_fitted()
    prices = step_prices(model.coef_, model.boundary_, num_new_tokens, num_context_tokens, is_prefill, step_offsets, e, lora=lora)
    own, batch_size, predicted = prices.own_s, prices.batch_size, prices.predicted_s
    starts = step_offsets[:-1]

    n_equal_split = 0
    if rule is AttributionRule.PAPER:
        share = own
    else:
        if rule is AttributionRule.SHAPLEY:
            p = np.asarray(num_new_tokens, dtype=np.float64)
            basis = shapley_s(model.coef_, model.boundary_, p, num_context_tokens, is_prefill, step_offsets, e, prices, lora=lora)
        else:
            basis = own
        basis = np.maximum(basis, 0.0)
        basis_sum = np.add.reduceat(basis, starts) if starts.size else np.zeros(0)
        target = predicted if measured_step_s is None else np.asarray(measured_step_s, dtype=np.float64)
        # Each slice's fraction of its step's basis, then of the target: target / basis_sum first would overflow
        # when a step's basis is subnormal (a model whose only nonzero coefficient is 5e-324 prices one at that).
        fraction = basis / np.repeat(np.where(basis_sum > 0, basis_sum, 1.0), batch_size)
        share = fraction * np.repeat(target, batch_size)
        empty = basis_sum <= 0
        n_equal_split = int(empty.sum())
        if n_equal_split:
            equal = np.repeat(np.where(empty, target / batch_size, 0.0), batch_size)
            share = np.where(np.repeat(empty, batch_size), equal, share)
    return Attribution(
        rule=rule,
        share_s=share,
        own_s=own,
        predicted_step_s=predicted,
        measured_step_s=None if measured_step_s is None else np.asarray(measured_step_s, dtype=np.float64),
        n_equal_split=n_equal_split,
    )


def attribute(
    model: StepLatencyModel, trace: StepTrace, rule: str | AttributionRule = AttributionRule.SHAPLEY, *, use_measured: bool = True
) -> Attribution:
    """Shares of every slice of ``trace``; with ``use_measured`` the measured step times are split. Shared KV
    (a v2 trace's ``effective_context_tokens``) is split among its readers, a LoRA model's adapter terms among each
    adapter's slices (a v4 trace's LoRA columns)."""
    return attribute_arrays(
        model,
        trace.num_new_tokens,
        trace.num_context_tokens,
        trace.is_prefill,
        trace.step_offsets,
        trace.step_latency_s_per_step if use_measured else None,
        rule,
        trace.effective_context_tokens if trace.has_sharing_columns else None,
        lora=lora_slices_of(trace) if model.is_lora_ else None,
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
    materialising its own terms first. A step straddling a segment boundary takes the exact (slower)
    ``step_shapley_s``. Inputs are float64 arrays of new and context tokens and a bool array of prefill
    flags, one entry per request (and, with shared KV, float64 effective context tokens; with a LoRA model, the
    step's ``LoraSlices``); the returned array is reused by the next call. Same results as ``attribute_arrays`` (tested). ``n_equal_split`` counts the
    steps split equally (see ``Attribution``).
    """

    def __init__(self, model: StepLatencyModel, rule: str | AttributionRule = AttributionRule.SHAPLEY, max_batch_size: int = 4096):
        self.rule = parse_rule(rule)
        model.check_is_fitted()
        self.boundary = model.boundary_
        self._coef_array = np.array(model.coef_, dtype=np.float64)
        self._coef = [tuple(float(v) for v in row) for row in model.coef_]
        self._decode = [decode_prices(row) for row in self._coef]
        self._nonnegative = bool(np.all(model.coef_ >= 0))
        self._lora = model.is_lora_
        self._ones = np.ones(max_batch_size)
        self._out = np.empty(max_batch_size)
        self._work = np.empty(max_batch_size)
        self.n_equal_split = 0

    def _own_terms(self, coef: tuple, p: np.ndarray, c: np.ndarray, is_prefill: np.ndarray, n: int, e=None,
                   lora: LoraSlices | None = None) -> np.ndarray:
        """``own_terms_s`` into the preallocated output (the features' scalar forms, no temporaries for the mask)."""
        own = self._out[:n]
        np.copyto(own, decode_own_s(coef, c, e))
        np.copyto(own, prefill_own_s(coef, p, c, e), where=is_prefill)
        if lora is not None and self._lora:
            own += lora_own_s(coef, p, is_prefill, lora)
        return own

    def predict_step_s(
        self, num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray, effective_context_tokens=None,
        lora: LoraSlices | None = None,
    ) -> float:
        """Predicted step time of a batch, for admission decisions."""
        n = num_new_tokens.shape[0]
        ones = self._ones[:n]
        segment = segment_of(self.boundary, num_new_tokens.dot(ones))
        prices = self._decode[segment]
        e = num_context_tokens if effective_context_tokens is None else effective_context_tokens
        lora = lora if self._lora else None
        if np.count_nonzero(is_prefill) == 0 and lora is None:
            return decode_step_price_s(prices, n, num_context_tokens.dot(ones), e.dot(ones) if prices.effective_context_s else 0.0)
        own = self._own_terms(self._coef[segment], num_new_tokens, num_context_tokens, is_prefill, n, e, lora)
        return prices.intercept_s + float(own.dot(ones))

    def attribute(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        is_prefill: np.ndarray,
        measured_s: float | None = None,
        effective_context_tokens: np.ndarray | None = None,
        lora: LoraSlices | None = None,
    ) -> np.ndarray:
        """Each request's share of the step in seconds (summing to ``measured_s`` when given); shared KV
        (``effective_context_tokens``, trace format v2) is split among its readers, a LoRA model's adapter terms
        (``lora``, the step's ``LoraSlices``, trace format v4) among each adapter's requests."""
        n = num_new_tokens.shape[0]
        lora = lora if self._lora else None
        ones = self._ones[:n]
        segment = segment_of(self.boundary, num_new_tokens.dot(ones))
        prices = self._decode[segment]
        b = prices.intercept_s
        e = num_context_tokens if effective_context_tokens is None else effective_context_tokens
        shapley = self.rule is AttributionRule.SHAPLEY
        if shapley and segment == 1 and num_new_tokens.min() < self.boundary:
            phi = self._straddling_shapley(num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens, lora)
            return self._spread(phi, phi.dot(ones) if measured_s is None else measured_s, n, clip=True)
        if self.rule is not AttributionRule.PAPER and self._nonnegative and lora is None and np.count_nonzero(is_prefill) == 0:
            own_total = decode_own_total_s(prices, n, num_context_tokens.dot(ones), e.dot(ones) if prices.effective_context_s else 0.0)
            basis_total = own_total + b if shapley else own_total
            target = own_total + b if measured_s is None else measured_s
            out = self._out[:n]
            if basis_total <= 0:
                self.n_equal_split += 1
                out.fill(target / n)
                return out
            scale = float(target) / float(basis_total)  # Python floats: an overflow is inf, without numpy's warning
            if math.isfinite(scale):  # else a subnormal basis: the general path divides before it multiplies
                return decode_shapley_into(out, self._work[:n], prices, num_context_tokens, e, scale, with_intercept=shapley)
        own = self._own_terms(self._coef[segment], num_new_tokens, num_context_tokens, is_prefill, n, e, lora)
        if self.rule is AttributionRule.PAPER:
            return own
        target = own.dot(ones) + b if measured_s is None else measured_s
        if shapley:
            own += b / n
        return self._spread(own, target, n, clip=not self._nonnegative)

    def _straddling_shapley(self, p: np.ndarray, c: np.ndarray, is_prefill: np.ndarray, e=None, lora=None) -> np.ndarray:
        phi = step_shapley_s(self._coef_array, self.boundary, p, c, is_prefill, e, lora=lora)
        out = self._out[: p.shape[0]]
        np.copyto(out, phi)
        return out

    def _spread(self, basis: np.ndarray, target: float, n: int, *, clip: bool) -> np.ndarray:
        """Scale ``basis`` (in place; its negative entries set to 0 first when ``clip``) to sum to ``target``."""
        if clip:
            np.maximum(basis, 0.0, out=basis)
        total = basis.dot(self._ones[:n])
        if total > 0:
            basis /= total  # first: target / total overflows for a subnormal total
            basis *= target
        else:
            self.n_equal_split += 1
            basis.fill(target / n)
        return basis
