"""The model's cost game, written once: the price of a step, of any subset of a step, its Shapley value, and
VTC's token prices.

Every caller that prices work uses this module: attribution (`llmvisor.core.attribution` turns the game's
values into bills), validation (the model's game of a measured batch), the fair scheduler (its per-step
charges and its admission predictions), the token-count baseline, the demo and the fairness experiment.
It is a module of its own, rather than part of ``attribution``, because most of those callers need prices
and not bills: they import the game without the rules, the trace grouping or pyarrow. The one formula of a
slice's own term stays `llmvisor.core.features.own_terms_s` (and its scalar forms ``prefill_own_s`` and
``decode_own_s``); the game adds the intercept, the segments and the sharing to it. The online attributor's
closed forms (``decode_*``) live here too, as scalar helpers on unpacked coefficients, so the scheduler loop
stays fast without a formula of its own.

**The step.** The model prices a step as T̂ = b_s + Σ_i f_i^s: a shared intercept b and one own term f_i per
slice, with the coefficients of the step's segment s (``segments_of``: segment 1 when the step's load, its
total new tokens, is at or over the boundary).

**Subsets.** The game is

    v(S) = the model's predicted time of a step running the slices S alone
         = b_s(S) + Σ_{i∈S} f_i^s(S),   s(S) = the segment of S's own load (Σ_{i∈S} p_i vs the boundary),

the same game the validation study measures (each subset run alone on the engine). With one segment, or when
every subset falls in the step's segment, its Shapley value is φ_i = f_i + b / |B|: the additive part goes to
its owner and b, paid once by whichever request comes first, is each request's with probability 1/|B|. When a
step straddles the boundary (its load is over it, some of its subsets' are under it), φ adds each slice's
expected marginal effect of crossing the boundary, computed exactly over subset loads (``step_shapley_s``).

**Shared KV blocks** (prefix caching, trace format v2). The model prices context in two parts: per request
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
structure to check it (tests compare with brute-force Shapley over all subsets). ``SubsetGame`` prices one
subset at a time for batches too large to enumerate, with one shared prefix read once by its readers.

With two segments each subset is priced in its own segment, v(S) = b_s(S) + Σ f'^s(S) + e_s(S)·D(S), D(S) the
distinct context tokens S reads. Writing e_s(S) = e₀ + [L(S) ≥ B]·Δe, the e₀·D part is the block games
above, and the boundary-crossing part [L(S) ≥ B]·(Δb + ΣΔf' + Δe·D(S)) is what ``step_shapley_s`` values
exactly when Δe = 0 (in particular when e is not identified and so 0 in both segments); when the segments'
e differ, D(S) in the crossing part is taken at the full step's split (Σ_{i∈S} ĉ_i), an approximation only in
steps that both share KV and straddle the boundary.

**LoRA adapters** (trace format v4, a LoRA model: `llmvisor.core.features`). A slice run with an adapter adds its
per-token work (l1·p + l2·r·p prefill, l3 + l4·r decode) to its own term: additive, so its owner's. The per-step
terms are games of the "any reader present" kind: a subset S running alone launches adapter a's kernels iff one of
its members runs a, and loads a (into a slot, or from disk) iff a was loaded for the step and one of its members
runs a (the subset, run alone from the same residency, needs the same load). So

    v(S) = b + Σ_{i∈S} f''_i + Σ_a [S ∩ R_a ≠ ∅]·(l5 + l6·[a slot-loaded] + l7·[a disk-loaded])

(f''_i the own term without these parts, R_a the step's slices running a). By the argument for blocks, a's fixed
price goes in equal parts to R_a and to nobody else: each slice of a gets (l5 + l6·[..] + l7·[..]) / |R_a|, which is
its own term's LoRA part at ``LoraSlices``' shares (1/|R_a|). Base-model slices pay none of it, other adapters'
slices none of a's. So φ_i = f_i + b/|B| still, with f_i the own term at the step's shares; ``subset_costs_s`` with
``lora_name`` prices v on the adapter structure to check it. With two segments it is exact when the segments'
l5, l6, l7 are equal (as for e); otherwise the crossing part takes the shares at the full step's split.

The LoRA path (l8, l9) is on for S iff S holds a slice running an adapter (A_S > 0): v adds
[A_S > 0]·(l8 + l9·Σ_{b∈S base} p_b). For l8 the adapter slices are symmetric and every base slice is a null
player: 1/A each. For l9, a base slice b adds l9·p_b exactly when an adapter slice comes before it in the order,
probability A/(A+1) (b and the A adapter slices in random order); an adapter slice j adds l9·Σ_b p_b over the
base slices before it when it is the first adapter slice, and b is before the first adapter and that one is j with
probability 1/(A+1)·1/A. So φ_b gets l9·p_b·A/(A+1) and φ_j gets l9·P_base/(A(A+1)) (``lora_path_shares``; they add up
to l9·P_base). A base-model request pays for its own tokens' trip through the LoRA kernels, in part.

**Token prices.** VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24) prices service in
tokens, prompt tokens ×1 and output tokens ×2 (``TokenPrices``, ``VTC_TOKEN_PRICES``): the token-count
baseline, the validation's ``token_count`` shares, the fair scheduler's ``tokens`` cost and the demo's and
experiment's token service all read them here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy.special import gammaln

from llmvisor.core.features import Coef, LoraSlices, lora_path_shares, own_terms_s, prefill_own_s
from llmvisor.errors import LlmvisorError

__all__ = [
    "VTC_TOKEN_PRICES",
    "DecodePrices",
    "StepPrices",
    "SubsetGame",
    "TokenPrices",
    "decode_own_total_s",
    "decode_prices",
    "decode_shapley_into",
    "decode_step_price_s",
    "segment_of",
    "segments_of",
    "shapley_s",
    "prefill_chunk_price_s",
    "shared_prefix_effective_context",
    "step_price_s",
    "step_prices",
    "step_shapley_s",
    "straddling_steps",
    "subset_costs_s",
]


# ---------------------------------------------------------------------------------------------------------
# Segments and the price of a step


def segments_of(boundary: float | None, load) -> np.ndarray:
    """The segment of each step of load ``load`` (total new tokens): 1 at or over ``boundary``, else 0."""
    if boundary is None:
        return np.zeros(np.shape(load), dtype=np.intp)
    return (np.asarray(load) >= boundary).astype(np.intp)


def segment_of(boundary: float | None, load: float) -> int:
    """``segments_of`` for one step (a float comparison, for the scheduler loop)."""
    return 0 if boundary is None or load < boundary else 1


@dataclass
class StepPrices:
    """Many steps priced: each slice's own term and each step's intercept, in the step's segment."""

    own_s: np.ndarray
    intercept_s: np.ndarray
    load: np.ndarray
    batch_size: np.ndarray

    @property
    def predicted_s(self) -> np.ndarray:
        """T̂ per step: its intercept plus its slices' own terms."""
        starts = np.cumsum(self.batch_size) - self.batch_size
        own_sum = np.add.reduceat(self.own_s, starts) if starts.size else np.zeros(0)
        return own_sum + self.intercept_s


def step_prices(coef: np.ndarray, boundary: float | None, num_new_tokens, num_context_tokens, is_prefill, step_offsets,
                effective_context_tokens=None, *, lora: LoraSlices | None = None) -> StepPrices:
    """The price of every step of flat slice arrays cut by ``step_offsets`` (``coef``: the model's
    (n_segments, N_FEATURES) array); ``effective_context_tokens`` (ĉ) defaults to the context, ``lora`` (for a LoRA
    model's coefficients) to every slice running the base model."""
    step_offsets = np.asarray(step_offsets)
    starts = step_offsets[:-1]
    batch_size = np.diff(step_offsets)
    if batch_size.size and batch_size.min() < 1:
        raise LlmvisorError("every step needs at least one slice")
    p = np.asarray(num_new_tokens, dtype=np.float64)
    load = np.add.reduceat(p, starts) if starts.size else np.zeros(0)
    e = effective_context_tokens
    segment_step = segments_of(boundary, load)
    if boundary is None:
        own = own_terms_s(coef[0], p, num_context_tokens, is_prefill, e, lora)
    else:
        own = np.where(
            np.repeat(segment_step, batch_size) == 0,
            own_terms_s(coef[0], p, num_context_tokens, is_prefill, e, lora),
            own_terms_s(coef[1], p, num_context_tokens, is_prefill, e, lora),
        )
    return StepPrices(own_s=own, intercept_s=np.asarray(coef)[segment_step, Coef.B], load=load, batch_size=batch_size)


def step_price_s(coef: np.ndarray, boundary: float | None, num_new_tokens, num_context_tokens, is_prefill,
                 effective_context_tokens=None, *, lora: LoraSlices | None = None) -> float:
    """T̂ of one step: b_s + Σ f_i^s in the segment of its load."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    row = coef[segment_of(boundary, float(p.sum()))]
    return float(row[Coef.B] + own_terms_s(row, p, num_context_tokens, is_prefill, effective_context_tokens, lora).sum())


def prefill_chunk_price_s(coef, boundary: float | None, step_load: float, num_new_tokens: float, num_context_tokens: float) -> float:
    """Own term of a prefill chunk of p tokens over c cached ones in a step of load ``step_load`` (its
    segment's coefficients; ``coef`` rows may be tuples of floats): the time it adds to that step (admission)."""
    return prefill_own_s(coef[segment_of(boundary, step_load)], num_new_tokens, num_context_tokens)


class DecodePrices(NamedTuple):
    """One segment's coefficients of a decode-only step, unpacked as floats: b, d2, d4 and e."""

    intercept_s: float
    context_s: float
    request_s: float
    effective_context_s: float


def decode_prices(coef_row) -> DecodePrices:
    return DecodePrices(float(coef_row[Coef.B]), float(coef_row[Coef.D2]), float(coef_row[Coef.D4]), float(coef_row[Coef.E]))


def decode_own_total_s(prices: DecodePrices, n: int, sum_context_tokens: float, sum_effective_context_tokens: float) -> float:
    """Σ of n decode slices' own terms, d2·Σc + d4·n + e·Σĉ, from the sums (closed form of ``own_terms_s``)."""
    own = prices.context_s * sum_context_tokens + prices.request_s * n
    return own + prices.effective_context_s * sum_effective_context_tokens if prices.effective_context_s else own


def decode_step_price_s(prices: DecodePrices, n: int, sum_context_tokens: float, sum_effective_context_tokens: float) -> float:
    """T̂ of a decode-only step of n slices: b + d2·Σc + d4·n + e·Σĉ."""
    return prices.intercept_s + decode_own_total_s(prices, n, sum_context_tokens, sum_effective_context_tokens)


def decode_shapley_into(out: np.ndarray, work: np.ndarray, prices: DecodePrices, context, effective_context, scale: float,
                        *, with_intercept: bool) -> np.ndarray:
    """``scale`` times each decode slice's own term, plus b/n each ``with_intercept`` (its Shapley value,
    the closed form), written into ``out`` (``work``: scratch of the same size)."""
    n = out.shape[0]
    np.multiply(context, prices.context_s * scale, out=out)
    if prices.effective_context_s:
        np.multiply(effective_context, prices.effective_context_s * scale, out=work)
        out += work
    out += ((prices.request_s + prices.intercept_s / n) if with_intercept else prices.request_s) * scale
    return out


# ---------------------------------------------------------------------------------------------------------
# Subsets


def subset_costs_s(model, num_new_tokens, num_context_tokens, is_prefill, shared_blocks=None, *, lora_name=None, lora_rank=None,
                   lora_loads=(), lora_disk_loads=()) -> np.ndarray:
    """v(S) for every subset S of one batch (index = bit mask, bit i = slice i; v(∅) = 0): the model's
    predicted time of a step running S alone, in S's own segment. Exponential in the batch size: for
    validation and tests on small batches.

    ``shared_blocks`` lists the step's KV blocks read by several slices as ``(tokens, reader indices)``; a
    slice's context not in a listed block is its own. S's effective contexts are then recomputed from the
    blocks S reads, each divided among S's readers of it (module docstring). None: nothing shared.

    ``lora_name`` (per slice, empty for the base model), ``lora_rank`` and the names of the adapters loaded for the
    step (``lora_loads``, ``lora_disk_loads``), for a LoRA model: S's shares of each adapter's per-step terms are
    recomputed among S's slices of that adapter (module docstring). None: every slice runs the base model."""
    model.check_is_fitted()
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    n = p.size
    if n > 20:
        raise LlmvisorError(f"subset_costs_s enumerates 2^n subsets; a batch of {n} slices is too large")
    masks = np.arange(1 << n)
    members = ((masks[:, None] >> np.arange(n)) & 1).astype(np.float64)
    if lora_name is not None:
        lora = _subset_lora_shares(members, p, lora_name, lora_rank, lora_loads, lora_disk_loads)
        effective = c if not shared_blocks else _subset_effective_context(members, c, shared_blocks)
        own = np.stack([(members * own_terms_s(row, p, c, is_prefill, effective, lora)).sum(axis=1) for row in model.coef_], axis=1)
        return _priced_subsets(model, own, members @ p)
    if not shared_blocks:
        own = members @ np.stack([own_terms_s(row, p, c, is_prefill) for row in model.coef_]).T
        return _priced_subsets(model, own, members @ p)
    effective = _subset_effective_context(members, c, shared_blocks)
    own = np.stack([(members * own_terms_s(row, p, c, is_prefill, effective)).sum(axis=1) for row in model.coef_], axis=1)
    return _priced_subsets(model, own, members @ p)


def _subset_effective_context(members: np.ndarray, c: np.ndarray, shared_blocks) -> np.ndarray:
    """Per subset (rows of ``members``) and slice, the effective context when the subset runs alone."""
    effective = np.broadcast_to(c, members.shape).copy()
    for tokens, readers in shared_blocks or ():
        readers = np.unique(np.asarray(readers, dtype=np.intp))
        reading = members[:, readers]
        count = reading.sum(axis=1, keepdims=True)
        effective[:, readers] -= tokens - np.divide(tokens, count, out=np.zeros_like(count), where=count > 0)
    if np.any(effective < -1e-9 * np.maximum(c, 1)):
        raise LlmvisorError("shared_blocks: a slice's blocks hold more tokens than its context")
    return effective


def _subset_lora_shares(members: np.ndarray, p: np.ndarray, lora_name, lora_rank, lora_loads, lora_disk_loads) -> LoraSlices:
    """Per subset (rows of ``members``) and slice, its ``LoraSlices`` when the subset runs alone: each adapter's
    per-step terms divided among the subset's slices of that adapter, the LoRA path's among the subset's slices (on
    iff one of them runs an adapter; any split adding up would do, for v(S) is their sum)."""
    names = np.asarray(lora_name, dtype=object)
    adapter = names != ""
    step_share, base_share = lora_path_shares(adapter, p, (members @ adapter.astype(np.float64))[:, None],
                                              (members @ np.where(adapter, 0.0, p))[:, None])
    step_share, base_share = members * step_share, members * base_share
    share = np.zeros(members.shape)
    for adapter in set(names.tolist()) - {""}:
        runs = names == adapter
        count = members[:, runs].sum(axis=1, keepdims=True)
        share[:, runs] = np.divide(1.0, count, out=np.zeros_like(count), where=count > 0)
    slot = np.where(np.isin(names, list(lora_loads)), share, 0.0)
    disk = np.where(np.isin(names, list(lora_disk_loads)), share, 0.0)
    return LoraSlices(np.asarray(lora_rank, dtype=np.float64), share, slot, disk, step_share, base_share)


def _priced_subsets(model, own_by_segment: np.ndarray, load: np.ndarray) -> np.ndarray:
    """v(S) from each subset's summed own terms under every segment's coefficients and its load."""
    costs = (own_by_segment + model.coef_[:, Coef.B])[np.arange(load.size), segments_of(model.boundary_, load)]
    costs[0] = 0.0
    return costs


def shared_prefix_effective_context(context, shared_context) -> np.ndarray:
    """Each request's effective context in a step where every request with a nonzero ``shared_context`` reads
    one shared prefix: its shared tokens divided among those readers, the rest its own."""
    shared = np.asarray(shared_context, dtype=np.float64)
    readers = int((shared > 0).sum())
    return np.asarray(context, dtype=np.float64) - (shared - shared / readers if readers > 1 else 0.0)


class SubsetGame:
    """v(S) of one batch read by bit mask (a subset priced alone, in its own segment), one subset at a time:
    for batches too large for ``subset_costs_s``.

    ``shared_context`` (tokens of each request's context in the blocks of one prefix that every request with a
    nonzero entry holds): a subset with k of those readers reads the prefix once, each reader's effective context
    being c − s + s/k (the game on the block structure, module docstring)."""

    def __init__(self, model, num_new_tokens, num_context_tokens, is_prefill, shared_context=None):
        model.check_is_fitted()
        self.model, self.new = model, np.asarray(num_new_tokens, dtype=np.float64)
        self.own = np.stack([own_terms_s(row, self.new, num_context_tokens, is_prefill) for row in model.coef_])
        self.shared = np.zeros(self.new.size) if shared_context is None else np.asarray(shared_context, dtype=np.float64)

    def __getitem__(self, mask: int) -> float:
        mask = int(mask)
        chosen = np.array([i for i in range(self.new.size) if mask >> i & 1], dtype=np.intp)  # masks can exceed 64 bits
        if chosen.size == 0:
            return 0.0
        segment = segment_of(self.model.boundary_, float(self.new[chosen].sum()))
        row = self.model.coef_[segment]
        cost = float(row[Coef.B] + self.own[segment, chosen].sum())
        shared = self.shared[chosen]
        readers = int((shared > 0).sum())
        if readers > 1:
            cost += float(row[Coef.E] * (shared / readers - shared).sum())
        return cost


# ---------------------------------------------------------------------------------------------------------
# The Shapley value


def _log_factorials(n: int) -> np.ndarray:
    """log m! for m = 0..n (``gammaln(m + 1)``), looked up by `_log_binomial` instead of evaluated per cell: the
    same values (the same function at the same points), at a fraction of the cost in a straddling step."""
    return gammaln(np.arange(n + 1, dtype=np.float64) + 1.0)


def _log_binomial(log_factorial: np.ndarray, n, k):
    return log_factorial[n] - log_factorial[k] - log_factorial[np.asarray(n) - np.asarray(k)]


def _pivot_sums(sizes, loads, means, own: int, cap: int, pivotal_from: int,
                log_factorial: np.ndarray) -> tuple[float, float, float, float]:
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
        weight = np.exp(_log_binomial(log_factorial, merged, k[:, None]) + _log_binomial(log_factorial, m, c)
                        - _log_binomial(log_factorial, merged + m, k[:, None] + c))
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
    coef: np.ndarray, boundary: float | None, num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens=None,
    *, lora: LoraSlices | None = None,
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
    segments = [own_terms_s(row, p, num_context_tokens, is_prefill, effective_context_tokens, lora) for row in coef]
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
    log_factorial = _log_factorials(n)
    for g in range(loads.size):
        available = sizes.copy()
        available[g] -= 1
        pivotal_from = max(cap - int(loads[g]), 0)
        sums = _pivot_sums(available, loads, means, g, cap, pivotal_from, log_factorial)
        crosses, pivotal, pivotal_other, pivotal_own = (value / n for value in sums)
        members = np.flatnonzero(group == g)
        own_mean = (totals[g] - delta_f[members]) / max(available[g], 1)
        phi[members] += delta_f[members] * crosses + delta_b * pivotal + pivotal_other + own_mean * pivotal_own
    return phi


def straddling_steps(boundary: float | None, num_new_tokens, step_offsets, load) -> np.ndarray:
    """Steps whose load is over the boundary while some of their slices' is under it (closed form fails)."""
    starts = np.asarray(step_offsets)[:-1]
    if boundary is None or starts.size == 0:
        return np.zeros(starts.size, dtype=bool)
    return (load >= boundary) & (np.minimum.reduceat(np.asarray(num_new_tokens, dtype=np.float64), starts) < boundary)


def shapley_s(coef: np.ndarray, boundary: float | None, num_new_tokens, num_context_tokens, is_prefill, step_offsets,
              effective_context_tokens=None, prices: StepPrices | None = None, *, lora: LoraSlices | None = None) -> np.ndarray:
    """Every slice's Shapley value of its step's game: f_i + b/|B| in closed form, ``step_shapley_s`` for the
    steps straddling the boundary. ``prices``: the steps' ``step_prices`` when already computed (with ``lora``)."""
    if prices is None:
        prices = step_prices(coef, boundary, num_new_tokens, num_context_tokens, is_prefill, step_offsets, effective_context_tokens,
                             lora=lora)
    phi = prices.own_s + np.repeat(prices.intercept_s / prices.batch_size, prices.batch_size)
    e = effective_context_tokens
    for k in np.flatnonzero(straddling_steps(boundary, num_new_tokens, step_offsets, prices.load)):
        s = slice(step_offsets[k], step_offsets[k + 1])
        phi[s] = step_shapley_s(coef, boundary, num_new_tokens[s], num_context_tokens[s], is_prefill[s], None if e is None else e[s],
                                lora=None if lora is None else lora.take(s))
    return phi


# ---------------------------------------------------------------------------------------------------------
# VTC's token prices


@dataclass(frozen=True)
class TokenPrices:
    """VTC's cost of service in tokens: ``prompt`` per prompt token computed, ``output`` per output token
    (VTC's defaults ×1 and ×2; the fair scheduler's are configurable)."""

    prompt: float = 1.0
    output: float = 2.0

    def cost(self, prompt_tokens, output_tokens):
        """prompt·prompt_tokens + output·output_tokens (scalars or arrays)."""
        return prompt_tokens * self.prompt + output_tokens * self.output

    def slice_costs(self, num_new_tokens, is_prefill, samples_token=None) -> np.ndarray:
        """Per slice, as the engine runs it: a prefill chunk pays its tokens as prompt tokens, plus one output
        token when it samples one (``samples_token``; None: not counted); a decode slice pays its tokens as
        output tokens."""
        p = np.asarray(num_new_tokens, dtype=np.float64)
        prefill = np.asarray(is_prefill, dtype=bool)
        sampled = np.zeros(p.shape, dtype=bool) if samples_token is None else np.asarray(samples_token, dtype=bool)
        return self.cost(np.where(prefill, p, 0.0), np.where(prefill, sampled, p))

    def step_costs(self, num_new_tokens, is_prefill, step_starts) -> np.ndarray:
        """Each step's token cost: the sum of its slices' ``slice_costs``."""
        costs = self.slice_costs(num_new_tokens, is_prefill)
        return np.add.reduceat(costs, step_starts) if len(step_starts) else np.zeros(0)

    def step_fractions(self, num_new_tokens, is_prefill) -> np.ndarray:
        """One step split by token cost (an equal split when it costs nothing). Within a pure decode step every
        request runs one token, so this is an equal split; within a pure prefill step it is a split by new
        tokens; it differs from both only in a mixed step."""
        costs = self.slice_costs(num_new_tokens, is_prefill)
        return costs / costs.sum() if costs.sum() > 0 else np.full(costs.size, 1.0 / costs.size)


VTC_TOKEN_PRICES = TokenPrices()
"""VTC's published prices: prompt ×1, output ×2."""
