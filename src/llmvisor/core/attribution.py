"""Split each step's time among the requests that ran in it.

The model prices a step as T̂ = b + Σ_i f_i: a shared intercept b and one own term f_i per slice, with the
coefficients of the step's segment. The default rule, ``shapley``, is the exact Shapley value of the cost game

    v(S) = the model's predicted time of a step running the slices S alone
         = b_s(S) + Σ_{i∈S} f_i^s(S),   s(S) = the segment of S's own load (Σ_{i∈S} p_i vs the boundary),

the same game the validation study measures (each subset run alone on the engine). With one segment, or when
every subset falls in the step's segment, it is φ_i = f_i + b / |B|: the additive part goes to its owner and b,
paid once by whichever request comes first, is each request's with probability 1/|B|. When a step straddles
the boundary (its load is over it, some of its subsets' are under it), φ adds each slice's expected marginal
effect of crossing the boundary, computed exactly over subset loads (``step_shapley_s``).

Shared KV blocks (prefix caching, trace format v2). The model prices context in two parts: per request
(a2·c, a5·p·c, d2·c: each reader's own attention over its context) and once per step (e·ĉ, ĉ_i the slice's
effective context: Σ over the KV blocks of its context of the block's tokens divided by the number of the
step's slices reading it). The rule splits each shared block's cost equally among the slices reading it in
the step, and this is the Shapley value of the model's cost game with sharing. On the block structure, a
subset S running alone reads each block once if any of its members reads it, so

    v(S) = b + Σ_{i∈S} f'_i + Σ_blocks e·t_β·[S ∩ R_β ≠ ∅]

(f'_i a slice's own term without the e part, t_β the block's tokens, R_β its readers in the step; a block read
by one slice is that slice's exclusive context). The Shapley value is linear in the game, and v is a sum of
games: the intercept game (b for any non-empty S: b/|B| each), additive games (f'_i: to its owner), and one
"any reader present" game per block, w_β(S) = e·t_β·[S ∩ R_β ≠ ∅]. In w_β a non-reader is a null player
(gets 0), the readers are symmetric (get equal amounts) and together they get w_β(B) = e·t_β (efficiency),
so each reader gets e·t_β/|R_β|. Summed over the blocks of slice i: e·Σ_{β∋i} t_β/|R_β| = e·ĉ_i. So φ_i =
f'_i + e·ĉ_i + b/|B| = f_i + b/|B|, f_i the own term evaluated at the full step's ĉ_i: the closed form above
stands with ĉ in place of c, and ``subset_costs_s`` with ``shared_blocks`` computes v on the block
structure to check it (tests compare with brute-force Shapley over all subsets).

With two segments each subset is priced in its own segment, v(S) = b_s(S) + Σ f'^s(S) + e_s(S)·D(S), D(S) the
distinct context tokens S reads. Writing e_s(S) = e₀ + [L(S) ≥ B]·Δe, the e₀·D part is the block games
above, and the boundary-crossing part [L(S) ≥ B]·(Δb + ΣΔf' + Δe·D(S)) is what ``step_shapley_s`` values
exactly when Δe = 0 (in particular when e is not identified and so 0 in both segments); when the segments'
e differ, D(S) in the crossing part is taken at the full step's split (Σ_{i∈S} ĉ_i), an approximation only in
steps that both share KV and straddle the boundary.

Across steps, the rule bills a request for what the engine did for it in its own steps: a prefix-cache hit
shows as context (c, and ĉ when the cached blocks are shared in the step), so a request reusing another's
cached prompt pays attention over those tokens but not for computing them; the request whose prefill
computed them paid for that in its step. The alternative, amortising the first prefill over the later hits
(charging each hit a part of the prefill that produced the blocks), would need the engine's block
provenance across steps and would change bills already issued whenever a new hit arrives; it is not
done (see docs/attribution.md).

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
from scipy.special import gammaln

from llmvisor.core.features import Coef, decode_own_s, own_terms_s, prefill_own_s
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


# ---------------------------------------------------------------------------------------------------------
# The cost game and its exact Shapley value


def subset_costs_s(model: StepLatencyModel, num_new_tokens, num_context_tokens, is_prefill, shared_blocks=None) -> np.ndarray:
    """v(S) for every subset S of one batch (index = bit mask, bit i = slice i; v(∅) = 0): the model's
    predicted time of a step running S alone, in S's own segment. Exponential in the batch size: for
    validation and tests on small batches.

    ``shared_blocks`` lists the step's KV blocks read by several slices as ``(tokens, reader indices)``; a
    slice's context not in a listed block is its own. S's effective contexts are then recomputed from the
    blocks S reads, each divided among S's readers of it (module docstring). None: nothing shared."""
    model.check_is_fitted()
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    n = p.size
    if n > 20:
        raise LlmvisorError(f"subset_costs_s enumerates 2^n subsets; a batch of {n} slices is too large")
    masks = np.arange(1 << n)
    members = ((masks[:, None] >> np.arange(n)) & 1).astype(np.float64)
    if not shared_blocks:
        own = members @ np.stack([own_terms_s(row, p, c, is_prefill) for row in model.coef_]).T
        return _priced_subsets(model, own, members @ p)
    effective = np.broadcast_to(c, members.shape).copy()
    for tokens, readers in shared_blocks or ():
        readers = np.unique(np.asarray(readers, dtype=np.intp))
        reading = members[:, readers]
        count = reading.sum(axis=1, keepdims=True)
        effective[:, readers] -= tokens - np.divide(tokens, count, out=np.zeros_like(count), where=count > 0)
    if np.any(effective < -1e-9 * np.maximum(c, 1)):
        raise LlmvisorError("shared_blocks: a slice's blocks hold more tokens than its context")
    own = np.stack([(members * own_terms_s(row, p, c, is_prefill, effective)).sum(axis=1) for row in model.coef_], axis=1)
    return _priced_subsets(model, own, members @ p)


def _priced_subsets(model: StepLatencyModel, own_by_segment: np.ndarray, load: np.ndarray) -> np.ndarray:
    """v(S) from each subset's summed own terms under every segment's coefficients and its load."""
    costs = (own_by_segment + model.coef_[:, Coef.B])[np.arange(load.size), model.segment_of_steps(load)]
    costs[0] = 0.0
    return costs


def _log_binomial(n, k):
    return gammaln(np.asarray(n) + 1.0) - gammaln(np.asarray(k) + 1.0) - gammaln(np.asarray(n) - np.asarray(k) + 1.0)


def _pivot_sums(sizes, loads, means, own: int, cap: int, pivotal_from: int) -> tuple[float, float, float, float]:
    """Sums over k of four expectations for a uniformly drawn k-subset S of the other players, who come in
    groups (``sizes[g]`` players of load ``loads[g]`` each; ``means[g]`` the mean of Δf over the group):
    Pr(L ≥ pivotal_from), Pr(pivotal_from ≤ L < cap), E[Σ Δf over members outside group ``own``; same window]
    and E[members of group ``own``; same window], L = S's load capped at ``cap``.

    Groups are merged smallest first through the hypergeometric law of how a k-subset splits between the
    players merged so far and the next group; the state is the sparse set of reachable (k, L), small when the
    prefills are few, and the largest group (typically the decodes) is summed over without being stored.
    """
    groups = [g for g in np.argsort(np.asarray(sizes), kind="stable") if sizes[g] > 0]
    k = np.zeros(1, dtype=np.int64)
    load = np.zeros(1, dtype=np.int64)
    prob, other, own_count = np.ones(1), np.zeros(1), np.zeros(1)
    merged = 0
    for index, g in enumerate(groups):
        m = int(sizes[g])
        c = np.arange(m + 1)[None, :]
        weight = np.exp(_log_binomial(merged, k[:, None]) + _log_binomial(m, c) - _log_binomial(merged + m, k[:, None] + c))
        new_load = np.minimum(load[:, None] + c * int(loads[g]), cap)
        new_prob = prob[:, None] * weight
        if g == own:
            new_other = other[:, None] * weight
            new_own = (own_count[:, None] + c * prob[:, None]) * weight
        else:
            new_other = (other[:, None] + c * means[g] * prob[:, None]) * weight
            new_own = own_count[:, None] * weight
        if index == len(groups) - 1:
            prob, other, own_count, load = new_prob.ravel(), new_other.ravel(), new_own.ravel(), new_load.ravel()
            break
        key = ((k[:, None] + c) * (cap + 1) + new_load).ravel()
        unique_key, inverse = np.unique(key, return_inverse=True)
        k, load = unique_key // (cap + 1), unique_key % (cap + 1)
        prob = np.bincount(inverse, new_prob.ravel())
        other = np.bincount(inverse, new_other.ravel())
        own_count = np.bincount(inverse, new_own.ravel())
        merged += m
    crossing = load >= pivotal_from
    window = crossing & (load < cap)
    return float(prob[crossing].sum()), float(prob[window].sum()), float(other[window].sum()), float(own_count[window].sum())


def step_shapley_s(
    coef: np.ndarray, boundary: float | None, num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens=None
) -> np.ndarray:
    """Exact Shapley value of one step's cost game v(S) = b_s(S) + Σ_{i∈S} f_i^s(S) (module docstring); with
    shared KV (``effective_context_tokens``) exact unless the step straddles the boundary and the segments'
    effective-context coefficients differ (module docstring).

    ``coef`` is the model's (n_segments, N_FEATURES) array. Closed form unless the step straddles the
    boundary; then v = g₀ + h with g₀ the memory-bound game (closed form) and h(S) = [L(S) ≥ B]·(Δb + ΣΔf),
    whose value is exact from the distribution of a random coalition's size and load: slices are grouped
    by load (all decodes share load 1), so the cost grows with the distinct loads' subsets, not with 2^n.
    """
    p = np.asarray(num_new_tokens, dtype=np.float64)
    n = p.size
    segments = [own_terms_s(row, p, num_context_tokens, is_prefill, effective_context_tokens) for row in coef]
    if boundary is None or p.sum() < boundary:
        return segments[0] + coef[0, Coef.B] / n
    if p.min() >= boundary:
        return segments[1] + coef[1, Coef.B] / n
    cap = math.ceil(boundary)
    delta_b = coef[1, Coef.B] - coef[0, Coef.B]
    delta_f = segments[1] - segments[0]
    loads, group = np.unique(p, return_inverse=True)
    sizes = np.bincount(group, minlength=loads.size)
    totals = np.bincount(group, weights=delta_f, minlength=loads.size)
    means = totals / sizes
    phi = segments[0] + coef[0, Coef.B] / n
    for g in range(loads.size):
        available = sizes.copy()
        available[g] -= 1
        pivotal_from = max(cap - int(loads[g]), 0)
        sums = _pivot_sums(available, loads, means, g, cap, pivotal_from)
        crosses, pivotal, pivotal_other, pivotal_own = (value / n for value in sums)
        members = np.flatnonzero(group == g)
        own_mean = (totals[g] - delta_f[members]) / max(available[g], 1)
        phi[members] += delta_f[members] * crosses + delta_b * pivotal + pivotal_other + own_mean * pivotal_own
    return phi


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


def _straddling_steps(model: StepLatencyModel, p: np.ndarray, starts: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Steps whose load is over the boundary while some of their slices' is under it (closed form fails)."""
    if model.boundary_ is None or starts.size == 0:
        return np.zeros(starts.size, dtype=bool)
    return (load >= model.boundary_) & (np.minimum.reduceat(p, starts) < model.boundary_)


def attribute_arrays(
    model: StepLatencyModel,
    num_new_tokens: np.ndarray,
    num_context_tokens: np.ndarray,
    is_prefill: np.ndarray,
    step_offsets: np.ndarray,
    measured_step_s: np.ndarray | None = None,
    rule: str | AttributionRule = AttributionRule.SHAPLEY,
    effective_context_tokens: np.ndarray | None = None,
) -> Attribution:
    """Vectorised attribution of many steps given as flat slice arrays and step offsets;
    ``effective_context_tokens`` (trace format v2) defaults to the context: nothing shared."""
    e = effective_context_tokens
    rule = parse_rule(rule)
    model.check_is_fitted()
    starts = step_offsets[:-1]
    batch_size = np.diff(step_offsets)
    if batch_size.size and batch_size.min() < 1:
        raise LlmvisorError("every step needs at least one slice")
    p = np.asarray(num_new_tokens, dtype=np.float64)
    load = np.add.reduceat(p, starts) if starts.size else np.zeros(0)
    if model.boundary_ is None:
        own = own_terms_s(model.coef_[0], p, num_context_tokens, is_prefill, e)
        shared_step = np.full(batch_size.shape, model.coef_[0, Coef.B])
    else:
        segment_step = model.segment_of_steps(load)
        segment_slice = np.repeat(segment_step, batch_size)
        own = np.where(
            segment_slice == 0,
            own_terms_s(model.coef_[0], p, num_context_tokens, is_prefill, e),
            own_terms_s(model.coef_[1], p, num_context_tokens, is_prefill, e),
        )
        shared_step = model.coef_[segment_step, Coef.B]
    own_sum = np.add.reduceat(own, starts) if starts.size else np.zeros(0)
    predicted = own_sum + shared_step

    n_equal_split = 0
    if rule is AttributionRule.PAPER:
        share = own
    else:
        if rule is AttributionRule.SHAPLEY:
            basis = own + np.repeat(shared_step / batch_size, batch_size)
            for k in np.flatnonzero(_straddling_steps(model, p, starts, load)):
                s = slice(step_offsets[k], step_offsets[k + 1])
                basis[s] = step_shapley_s(
                    model.coef_, model.boundary_, p[s], num_context_tokens[s], is_prefill[s], None if e is None else e[s]
                )
        else:
            basis = own
        basis = np.maximum(basis, 0.0)
        basis_sum = np.add.reduceat(basis, starts) if starts.size else np.zeros(0)
        target = predicted if measured_step_s is None else np.asarray(measured_step_s, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(basis_sum > 0, target / basis_sum, 0.0)
        share = basis * np.repeat(scale, batch_size)
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
    (a v2 trace's ``effective_context_tokens``) is split among its readers."""
    return attribute_arrays(
        model,
        trace.num_new_tokens,
        trace.num_context_tokens,
        trace.is_prefill,
        trace.step_offsets,
        trace.step_latency_s_per_step if use_measured else None,
        rule,
        trace.effective_context_tokens if trace.has_sharing_columns else None,
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
    flags, one entry per request (and, with shared KV, float64 effective context tokens); the returned array
    is reused by the next call. Same results as ``attribute_arrays`` (tested). ``n_equal_split`` counts the
    steps split equally (see ``Attribution``).
    """

    def __init__(self, model: StepLatencyModel, rule: str | AttributionRule = AttributionRule.SHAPLEY, max_batch_size: int = 4096):
        self.rule = parse_rule(rule)
        model.check_is_fitted()
        self.boundary = model.boundary_
        self._coef_array = np.array(model.coef_, dtype=np.float64)
        self._coef = [tuple(float(v) for v in row) for row in model.coef_]
        self._decode = [(row[Coef.B], row[Coef.D2], row[Coef.D4], row[Coef.E]) for row in self._coef]
        self._nonnegative = bool(np.all(model.coef_ >= 0))
        self._ones = np.ones(max_batch_size)
        self._out = np.empty(max_batch_size)
        self._work = np.empty(max_batch_size)
        self.n_equal_split = 0

    def _segment(self, p: np.ndarray, ones: np.ndarray) -> int:
        return 0 if self.boundary is None or p.dot(ones) < self.boundary else 1

    def _own_terms(self, coef: tuple, p: np.ndarray, c: np.ndarray, is_prefill: np.ndarray, n: int, e=None) -> np.ndarray:
        own = self._out[:n]
        np.copyto(own, decode_own_s(coef, c, e))
        np.copyto(own, prefill_own_s(coef, p, c, e), where=is_prefill)
        return own

    def predict_step_s(
        self, num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray, effective_context_tokens=None
    ) -> float:
        """Predicted step time of a batch, for admission decisions."""
        n = num_new_tokens.shape[0]
        ones = self._ones[:n]
        segment = self._segment(num_new_tokens, ones)
        coef = self._coef[segment]
        e = num_context_tokens if effective_context_tokens is None else effective_context_tokens
        if np.count_nonzero(is_prefill) == 0:
            b, d2, d4, e_coef = self._decode[segment]
            return b + d2 * num_context_tokens.dot(ones) + d4 * n + (e_coef * e.dot(ones) if e_coef else 0.0)
        return coef[Coef.B] + float(self._own_terms(coef, num_new_tokens, num_context_tokens, is_prefill, n, e).dot(ones))

    def attribute(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        is_prefill: np.ndarray,
        measured_s: float | None = None,
        effective_context_tokens: np.ndarray | None = None,
    ) -> np.ndarray:
        """Each request's share of the step in seconds (summing to ``measured_s`` when given); shared KV
        (``effective_context_tokens``, trace format v2) is split among its readers."""
        n = num_new_tokens.shape[0]
        ones = self._ones[:n]
        segment = 0 if self.boundary is None or num_new_tokens.dot(ones) < self.boundary else 1
        b, d2, d4, e_coef = self._decode[segment]
        e = num_context_tokens if effective_context_tokens is None else effective_context_tokens
        shapley = self.rule is AttributionRule.SHAPLEY
        if shapley and segment == 1 and num_new_tokens.min() < self.boundary:
            phi = self._straddling_shapley(num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens)
            return self._spread(phi, phi.dot(ones) if measured_s is None else measured_s, n, clip=True)
        if self.rule is not AttributionRule.PAPER and self._nonnegative and np.count_nonzero(is_prefill) == 0:
            own_total = d2 * num_context_tokens.dot(ones) + d4 * n
            if e_coef:
                own_total += e_coef * e.dot(ones)
            basis_total = own_total + b if shapley else own_total
            target = own_total + b if measured_s is None else measured_s
            out = self._out[:n]
            if basis_total <= 0:
                self.n_equal_split += 1
                out.fill(target / n)
                return out
            scale = target / basis_total
            np.multiply(num_context_tokens, d2 * scale, out=out)
            if e_coef:
                np.multiply(e, e_coef * scale, out=self._work[:n])
                out += self._work[:n]
            out += ((d4 + b / n) if shapley else d4) * scale
            return out
        own = self._own_terms(self._coef[segment], num_new_tokens, num_context_tokens, is_prefill, n, e)
        if self.rule is AttributionRule.PAPER:
            return own
        target = own.dot(ones) + b if measured_s is None else measured_s
        if shapley:
            own += b / n
        return self._spread(own, target, n, clip=not self._nonnegative)

    def _straddling_shapley(self, p: np.ndarray, c: np.ndarray, is_prefill: np.ndarray, e=None) -> np.ndarray:
        phi = step_shapley_s(self._coef_array, self.boundary, p, c, is_prefill, e)
        out = self._out[: p.shape[0]]
        np.copyto(out, phi)
        return out

    def _spread(self, basis: np.ndarray, target: float, n: int, *, clip: bool) -> np.ndarray:
        """Scale ``basis`` (in place; its negative entries set to 0 first when ``clip``) to sum to ``target``."""
        if clip:
            np.maximum(basis, 0.0, out=basis)
        total = basis.dot(self._ones[:n])
        if total > 0:
            basis *= target / total
        else:
            self.n_equal_split += 1
            basis.fill(target / n)
        return basis
