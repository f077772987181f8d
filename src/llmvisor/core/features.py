"""Per-slice and per-step features of the step-latency model.

A slice (one request in one step) contributes its own terms; a step adds one shared intercept. Prefill
and decode slices have separate coefficients, so a mixed (chunked-prefill) step is the sum of its slices.

Prefill slice: p, c, p², p·c and 1 (the per-request batch term). p·c is the attention work of a prefill
chunk over the context already cached, the term chunked prefill adds; it is zero for whole prompts.
Decode slice: c and 1. For a decode p = p² = 1, so the paper's p and p² terms cannot be told apart from
the per-request term; they are merged into it (``decode_requests``) instead of fitted as collinear columns.
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
)
N_FEATURES = len(FEATURE_NAMES)


class Coef(IntEnum):
    """Position of each coefficient in a coefficient row, named as in the model formula (README, paper):

    T = b + Σ_prefill (a1·p + a2·c + a3·p² + a5·p·c + a4) + Σ_decode (d2·c + d4)

    The order is ``FEATURE_NAMES``' (the model file's), so a4 sits after a5; d1 and d3 (decode p and p²)
    are merged into d4, since for a decode p = p² = 1.
    """

    B = 0
    A1 = 1
    A2 = 2
    A3 = 3
    A5 = 4
    A4 = 5
    D2 = 6
    D4 = 7


COEF_FEATURE = {coef: FEATURE_NAMES[coef] for coef in Coef}
"""Each formula coefficient's feature name (b: intercept, a1: prefill_new_tokens, ..., d4: decode_requests)."""


def prefill_own_s(coef, p, c):
    """A prefill slice's own seconds: a1·p + a2·c + a3·p² + a5·p·c + a4 (scalars or arrays)."""
    return p * (coef[Coef.A1] + coef[Coef.A3] * p + coef[Coef.A5] * c) + coef[Coef.A2] * c + coef[Coef.A4]


def decode_own_s(coef, c):
    """A decode slice's own seconds: d2·c + d4 (scalars or arrays)."""
    return coef[Coef.D2] * c + coef[Coef.D4]


def own_terms_s(coef, num_new_tokens, num_context_tokens, is_prefill) -> np.ndarray:
    """Each slice's own predicted seconds under one coefficient row (vectorised over slices); the one
    definition of a slice's term, used by the fit's features, attribution, admission and validation."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    return np.where(is_prefill, prefill_own_s(coef, p, c), decode_own_s(coef, c))


def slice_feature_matrix(num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray) -> np.ndarray:
    """The (n_slices, N_FEATURES) matrix of each slice's own features; column b (intercept) is zero.
    ``x @ coef`` is ``own_terms_s(coef, ...)`` (tested)."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
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
    x = slice_feature_matrix(trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill)
    steps = np.add.reduceat(x, trace.step_starts, axis=0) if trace.n_steps else np.zeros((0, N_FEATURES))
    steps[:, Coef.B] = 1.0
    return steps


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
