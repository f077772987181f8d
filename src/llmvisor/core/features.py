"""Per-slice and per-step features of the step-latency model.

A slice (one request in one step) contributes its own terms; a step adds one shared intercept. Prefill
and decode slices have separate coefficients, so a mixed (chunked-prefill) step is the sum of its slices.

Prefill slice: p, c, p², p·c and 1 (the per-request batch term). p·c is the attention work of a prefill
chunk over the context already cached, the term chunked prefill adds; it is zero for whole prompts.
Decode slice: c and 1. For a decode p = p² = 1, so the paper's p and p² terms cannot be told apart from
the per-request term; they are merged into it (``decode_requests``) instead of fitted as collinear columns.

Every slice, either phase: ĉ, its effective context (trace format v2, ``effective_context_tokens``): its
context tokens with each KV block divided by the number of the step's slices reading it. The context terms
above (a2·c, a5·p·c, d2·c) price reading one's own copy of the context, per request; e·ĉ prices the KV
blocks read once per step, however many slices read them (prefix caching). Summed over a step, Σĉ is the
number of distinct context tokens the step reads. Without sharing ĉ = c and e cannot be told apart from a2 and
d2; the model then holds e at 0 (``StepLatencyModel.identified_``). One e for both phases, because a block
shared by a prefill and a decode slice is one block read: a phase-specific price would make the split of a
shared block depend on its readers' phases (and not be the Shapley value of any "block read once" game).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from llmvisor.core.trace import StepTrace
from llmvisor.errors import LlmvisorError, plain

FEATURE_NAMES = (
    "intercept",
    "prefill_new_tokens",
    "prefill_context_tokens",
    "prefill_new_tokens_squared",
    "prefill_new_x_context_tokens",
    "prefill_requests",
    "decode_context_tokens",
    "decode_requests",
    "effective_context_tokens",
)
FEATURE_NAMES_V1 = FEATURE_NAMES[:8]
"""The features of model files of format version 1 (before ``effective_context_tokens``)."""
N_FEATURES = len(FEATURE_NAMES)


class Coef(IntEnum):
    """Position of each coefficient in a coefficient row, named as in the model formula (README, paper):

    T = b + Σ_prefill (a1·p + a2·c + a3·p² + a5·p·c + a4) + Σ_decode (d2·c + d4) + Σ_all e·ĉ

    The order is ``FEATURE_NAMES``' (the model file's), so a4 sits after a5; d1 and d3 (decode p and p²)
    are merged into d4, since for a decode p = p² = 1. ĉ is a slice's effective context (module docstring).
    """

    B = 0
    A1 = 1
    A2 = 2
    A3 = 3
    A5 = 4
    A4 = 5
    D2 = 6
    D4 = 7
    E = 8


COEF_FEATURE = {coef: FEATURE_NAMES[coef] for coef in Coef}
"""Each formula coefficient's feature name (b: intercept, a1: prefill_new_tokens, ..., d4: decode_requests)."""


def prefill_own_s(coef, p, c, e=None):
    """A prefill slice's own seconds: a1·p + a2·c + a3·p² + a5·p·c + a4 + e·ĉ (scalars or arrays; ĉ = ``e``,
    the effective context, is c when not given)."""
    own = p * (coef[Coef.A1] + coef[Coef.A3] * p + coef[Coef.A5] * c) + coef[Coef.A2] * c + coef[Coef.A4]
    return own + coef[Coef.E] * (c if e is None else e) if coef[Coef.E] else own


def decode_own_s(coef, c, e=None):
    """A decode slice's own seconds: d2·c + d4 + e·ĉ (scalars or arrays; ĉ = ``e`` is c when not given)."""
    own = coef[Coef.D2] * c + coef[Coef.D4]
    return own + coef[Coef.E] * (c if e is None else e) if coef[Coef.E] else own


def own_terms_s(coef, num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens=None) -> np.ndarray:
    """Each slice's own predicted seconds under one coefficient row (vectorised over slices); the one
    definition of a slice's term, used by the fit's features, attribution, admission and validation.
    ``effective_context_tokens`` (ĉ) defaults to the context: nothing shared."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    e = c if effective_context_tokens is None else np.asarray(effective_context_tokens, dtype=np.float64)
    return np.where(is_prefill, prefill_own_s(coef, p, c, e), decode_own_s(coef, c, e))


def slice_feature_matrix(
    num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray, effective_context_tokens: np.ndarray | None = None
) -> np.ndarray:
    """The (n_slices, N_FEATURES) matrix of each slice's own features; column b (intercept) is zero.
    ``x @ coef`` is ``own_terms_s(coef, ...)`` (tested)."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    e = c if effective_context_tokens is None else np.asarray(effective_context_tokens, dtype=np.float64)
    prefill = np.asarray(is_prefill, dtype=bool)
    decode = ~prefill
    x = np.zeros((p.shape[0], N_FEATURES))
    x[:, Coef.A1] = np.where(prefill, p, 0.0)
    x[:, Coef.A2] = np.where(prefill, c, 0.0)
    x[:, Coef.A3] = np.where(prefill, p * p, 0.0)
    x[:, Coef.A5] = np.where(prefill, p * c, 0.0)
    x[:, Coef.A4] = prefill
    x[:, Coef.D2] = np.where(decode, c, 0.0)
    x[:, Coef.D4] = decode
    x[:, Coef.E] = e
    return x


def check_decode_slices(trace: StepTrace) -> None:
    """The model prices a decode slice as one token; refuse traces that declare speculative decoding."""
    bad = ~trace.is_prefill & (trace.num_new_tokens != 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise LlmvisorError(
            f"{', '.join(trace.sources) or '<memory>'}: step {trace.step_id[i]} of run {plain(trace.run_id[i])!r}: "
            "decode slices with more than one new token (speculative decoding) are not modelled"
        )


def step_feature_matrix(trace: StepTrace) -> np.ndarray:
    """The (n_steps, N_FEATURES) design matrix: per-step sums of slice features plus the intercept."""
    check_decode_slices(trace)
    x = slice_feature_matrix(trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.effective_context_tokens)
    steps = np.add.reduceat(x, trace.step_starts, axis=0) if trace.n_steps else np.zeros((0, N_FEATURES))
    steps[:, Coef.B] = 1.0
    return steps


def shared_context_saving_per_step(x: np.ndarray) -> np.ndarray:
    """Per step of a design matrix, Σ(c − ĉ): the context tokens the step did not read per request because
    slices shared KV blocks. Zero on every step (a v1 trace) means ``effective_context_tokens`` is the sum of
    the per-request context columns and cannot be identified apart from them."""
    return x[:, Coef.A2] + x[:, Coef.D2] - x[:, Coef.E]


def step_new_tokens(trace: StepTrace) -> np.ndarray:
    """The step's load (total new tokens), the quantity a segment boundary is placed on."""
    if trace.n_steps == 0:
        return np.zeros(0)
    return np.add.reduceat(trace.num_new_tokens.astype(np.float64), trace.step_starts)


def summary_step_features(trace: StepTrace) -> tuple[np.ndarray, list[str]]:
    """Step-level features for the feature-based baselines (random forest): what a step holds, per phase."""
    x = step_feature_matrix(trace)
    load = step_new_tokens(trace)
    context_max = (
        np.maximum.reduceat(trace.num_context_tokens.astype(np.float64), trace.step_starts)
        if trace.n_steps
        else np.zeros(0)
    )
    names = list(FEATURE_NAMES[1:]) + ["new_tokens", "max_context_tokens"]
    return np.column_stack([x[:, 1:], load, context_max]), names
