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

LoRA adapters (trace format v4), only in a model fitted on a trace with the LoRA columns (``FEATURE_NAMES_LORA``):
per token, a slice run with an adapter of rank r adds l1·p + l2·r·p (prefill) or l3 + l4·r (decode, p = 1): the
adapter's low-rank matmuls over its tokens. Two forms, because vLLM pads every adapter in its slots to
``--max-lora-rank``, so the work may follow the tokens run with any adapter (l1, l3) rather than the adapter's own
rank (l2, l4); the fit chooses between them by held-out error (``StepLatencyModel(lora_work=...)``). Per step, each
distinct adapter adds l5 (its own kernel launches), each adapter loaded into a LoRA slot for the step l6, and each of
those read from its files l7 (on top of l6). The per-step terms are spread over the slices as ĉ spreads a shared
block: a slice of adapter a holds 1/n_a of a's count, n_a the step's slices running a (``LoraSlices``), so a step's
slices sum to its distinct adapters and loads, and each slice's term is its Shapley share (`llmvisor.core.game`).
One l5, l6, l7 for both phases, for the reason e has one.

A step that runs any adapter also switches vLLM's LoRA path on for the whole batch: its per-step set-up, l8
(``lora_steps``), and its kernels over every token of the step, base-model tokens included (measured: a base-model
request batched with adapters costs more than one batched with base-model requests, `llmvisor.validation.lora`),
l9 per base-model token (``lora_base_tokens``; an adapter's own tokens are priced by l1-l4). Both are games of the
"any adapter present" kind, and their Shapley shares (`llmvisor.core.game`, ``lora_path_shares``) spread them over
the slices: with A the step's slices running an adapter and P_base its base-model tokens, an adapter slice holds
1/A of the step and P_base/(A(A+1)) base tokens, a base-model slice of p tokens p·A/(A+1) of them: it pays for its
own tokens' trip through the LoRA kernels, less the part the adapter requests share by being the reason for it.
One l8, l9 for both phases. Without the LoRA columns the LoRA features are 0.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np

from llmvisor.core.lora_trace import decode_adapters
from llmvisor.core.trace import StepTrace
from llmvisor.core.trace_schema import LORA_COLUMNS
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
"""The features of a model without LoRA terms (model file format version 2); its coefficient rows have this length."""
LORA_FEATURE_NAMES = (
    "prefill_lora_tokens",
    "prefill_lora_rank_x_tokens",
    "decode_lora_tokens",
    "decode_lora_rank_x_tokens",
    "lora_adapters",
    "lora_slot_loads",
    "lora_disk_loads",
    "lora_steps",
    "lora_base_tokens",
)
"""The LoRA features (module docstring), after ``FEATURE_NAMES`` in a LoRA model's rows (model file version 4)."""
FEATURE_NAMES_LORA = FEATURE_NAMES + LORA_FEATURE_NAMES
N_FEATURES_LORA = len(FEATURE_NAMES_LORA)
FEATURE_NAMES_LORA_V3 = FEATURE_NAMES_LORA[:-2]
"""The features of LoRA model files of format version 3 (before ``lora_steps`` and ``lora_base_tokens``)."""


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


class LoraCoef(IntEnum):
    """Position of each LoRA coefficient in a LoRA model's coefficient row (after ``Coef``'s), as in the formula

    T = ... + Σ_prefill (l1·p·[adapter] + l2·r·p) + Σ_decode (l3·[adapter] + l4·r) + l5·adapters + l6·slot loads
        + l7·disk loads + l8·[any adapter] + l9·base tokens·[any adapter]

    with r the slice's adapter rank (0 for the base model) and the last five counted per step (module docstring).
    """

    L1 = 9
    L2 = 10
    L3 = 11
    L4 = 12
    L5 = 13
    L6 = 14
    L7 = 15
    L8 = 16
    L9 = 17


LORA_WORK_FORMS = {
    "tokens": (LoraCoef.L1, LoraCoef.L3),
    "rank_tokens": (LoraCoef.L2, LoraCoef.L4),
    "both": (LoraCoef.L1, LoraCoef.L2, LoraCoef.L3, LoraCoef.L4),
}
"""The per-token LoRA work forms a fit can choose among: the tokens run with an adapter (work padded to the engine's
maximum rank), rank × tokens (work of the adapter's own rank), or both; the per-token features of the others are
held at 0."""


class LoraSlices(NamedTuple):
    """What the LoRA terms need of each slice, float64 arrays of one entry per slice: ``rank`` (its adapter's rank,
    0 for the base model) and its shares of its step's per-adapter counts, each 1/n_a for a slice of adapter a (n_a
    the step's slices running a) and 0 otherwise: ``adapter_share`` always, ``slot_load_share`` when a was loaded
    into a slot for the step, ``disk_load_share`` when it was read from its files for it. Summed over a step they
    are its distinct adapters, slot loads and disk loads. ``lora_step_share`` and ``base_token_share`` are its
    shares of the LoRA path's per-step terms (``lora_path_shares``); summed over a step, 1 if it runs an adapter
    and its base-model tokens if so."""

    rank: np.ndarray
    adapter_share: np.ndarray
    slot_load_share: np.ndarray
    disk_load_share: np.ndarray
    lora_step_share: np.ndarray
    base_token_share: np.ndarray

    def take(self, index) -> LoraSlices:
        """The entries of the slices ``index`` selects (a slice or an index array), shares unchanged."""
        return LoraSlices(*(np.asarray(values)[index] for values in self))


def lora_path_shares(adapter, num_new_tokens, n_adapter_slices, base_tokens) -> tuple[np.ndarray, np.ndarray]:
    """Each slice's shares of its step's LoRA-path terms (module docstring), the Shapley value of the games
    l8·[any adapter] and l9·Σ base tokens·[any adapter]: ``lora_step_share`` 1/A for a slice running an adapter,
    ``base_token_share`` P_base/(A(A+1)) for it and p·A/(A+1) for a base-model slice of p tokens; all 0 in a step
    without adapters. Per slice: ``adapter`` (bool), its ``num_new_tokens``, and its step's (or coalition's) A
    (``n_adapter_slices``) and P_base (``base_tokens``); arrays broadcast, so rows may be coalitions."""
    adapter = np.asarray(adapter, dtype=bool)
    p = np.asarray(num_new_tokens, dtype=np.float64)
    a = np.asarray(n_adapter_slices, dtype=np.float64)
    on = a > 0
    safe = np.where(on, a, 1.0)
    step_share = np.where(adapter & on, 1.0 / safe, 0.0)
    base_share = np.where(on, np.where(adapter, np.asarray(base_tokens, dtype=np.float64) / (safe * (safe + 1.0)), p * safe / (safe + 1.0)), 0.0)
    return step_share, base_share


def lora_slices(lora_name, lora_rank, step_offsets, step_lora_loads, step_lora_disk_loads, *, num_new_tokens) -> LoraSlices:
    """``LoraSlices`` of flat slice arrays cut by ``step_offsets``: ``lora_name`` (empty for the base model),
    ``lora_rank`` and ``num_new_tokens`` per slice, ``step_lora_loads`` and ``step_lora_disk_loads`` per step
    (collections of names)."""
    names = np.asarray(lora_name, dtype=object).reshape(-1)
    rank = np.asarray(lora_rank, dtype=np.float64).reshape(-1)
    p = np.asarray(num_new_tokens, dtype=np.float64).reshape(-1)
    offsets = np.asarray(step_offsets, dtype=np.int64)
    n_steps = offsets.size - 1
    step = np.repeat(np.arange(n_steps), np.diff(offsets))
    adapter = names != ""
    n_adapter = np.bincount(step, weights=adapter.astype(np.float64), minlength=n_steps)[step] if n_steps else np.zeros(0)
    base = np.bincount(step, weights=np.where(adapter, 0.0, p), minlength=n_steps)[step] if n_steps else np.zeros(0)
    step_share, base_share = lora_path_shares(adapter, p, n_adapter, base)
    share = np.zeros(names.size)
    slot = np.zeros(names.size)
    disk = np.zeros(names.size)
    if adapter.any():
        distinct, code = np.unique(names.astype(str), return_inverse=True)
        code = code.reshape(-1)
        _, pair, count = np.unique(step * distinct.size + code, return_inverse=True, return_counts=True)
        share = np.where(adapter, 1.0 / count[pair.reshape(-1)], 0.0)
        for out, per_step in ((slot, step_lora_loads), (disk, step_lora_disk_loads)):
            for k, loaded in enumerate(per_step):
                if loaded:
                    rows = np.arange(offsets[k], offsets[k + 1])
                    rows = rows[np.isin(names[rows], list(loaded))]
                    out[rows] = share[rows]
    return LoraSlices(rank, share, slot, disk, step_share, base_share)


def has_lora_columns(trace: StepTrace) -> bool:
    """Whether the trace carries the version-4 LoRA adapter columns."""
    return all(name in trace.extra for name in LORA_COLUMNS)


def lora_slices_of(trace: StepTrace) -> LoraSlices | None:
    """The trace's ``LoraSlices``; None for a trace without the LoRA columns (every slice ran the base model)."""
    if not has_lora_columns(trace):
        return None
    starts = trace.step_starts
    per_step = {}
    for column in ("step_lora_loads", "step_lora_disk_loads"):
        texts = np.asarray(trace.extra[column], dtype=object)[starts]
        decoded = {text: decode_adapters(text) for text in set(texts.tolist())}
        per_step[column] = [decoded[text] for text in texts.tolist()]
    return lora_slices(trace.extra["lora_name"], trace.extra["lora_rank"], trace.step_offsets,
                       per_step["step_lora_loads"], per_step["step_lora_disk_loads"], num_new_tokens=trace.num_new_tokens)


def is_lora_row(coef) -> bool:
    """Whether a coefficient row holds the LoRA coefficients (a LoRA model's)."""
    return len(coef) > N_FEATURES


def lora_own_s(coef, num_new_tokens, is_prefill, lora: LoraSlices | None):
    """Each slice's LoRA part of its own term (module docstring): l1·p + l2·r·p (prefill with an adapter),
    l3 + l4·r (decode with an adapter), plus l5, l6, l7 times its shares of the step's adapters and loads and l8, l9
    times its shares of the LoRA path; 0 when ``coef`` has no LoRA coefficients or there is no ``lora``."""
    if lora is None or not is_lora_row(coef):
        return 0.0
    p = np.asarray(num_new_tokens, dtype=np.float64)
    r = lora.rank
    adapter = r > 0
    per_token = np.where(is_prefill, p * (coef[LoraCoef.L1] * adapter + coef[LoraCoef.L2] * r), coef[LoraCoef.L3] * adapter + coef[LoraCoef.L4] * r)
    return (per_token + coef[LoraCoef.L5] * lora.adapter_share + coef[LoraCoef.L6] * lora.slot_load_share
            + coef[LoraCoef.L7] * lora.disk_load_share + coef[LoraCoef.L8] * lora.lora_step_share
            + coef[LoraCoef.L9] * lora.base_token_share)


def prefill_own_s(coef, p, c, e=None):
    """A prefill slice's own seconds: a1·p + a2·c + a3·p² + a5·p·c + a4 + e·ĉ (scalars or arrays; ĉ = ``e``,
    the effective context, is c when not given)."""
    own = p * (coef[Coef.A1] + coef[Coef.A3] * p + coef[Coef.A5] * c) + coef[Coef.A2] * c + coef[Coef.A4]
    return own + coef[Coef.E] * (c if e is None else e) if coef[Coef.E] else own


def decode_own_s(coef, c, e=None):
    """A decode slice's own seconds: d2·c + d4 + e·ĉ (scalars or arrays; ĉ = ``e`` is c when not given)."""
    own = coef[Coef.D2] * c + coef[Coef.D4]
    return own + coef[Coef.E] * (c if e is None else e) if coef[Coef.E] else own


def own_terms_s(coef, num_new_tokens, num_context_tokens, is_prefill, effective_context_tokens=None,
                lora: LoraSlices | None = None) -> np.ndarray:
    """Each slice's own predicted seconds under one coefficient row (vectorised over slices); the one
    definition of a slice's term, used by the fit's features, attribution, admission and validation.
    ``effective_context_tokens`` (ĉ) defaults to the context: nothing shared; ``lora`` (a LoRA model's row) to
    every slice running the base model."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    e = c if effective_context_tokens is None else np.asarray(effective_context_tokens, dtype=np.float64)
    own = np.where(is_prefill, prefill_own_s(coef, p, c, e), decode_own_s(coef, c, e))
    return own + lora_own_s(coef, p, is_prefill, lora) if lora is not None and is_lora_row(coef) else own


def slice_feature_matrix(
    num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, is_prefill: np.ndarray, effective_context_tokens: np.ndarray | None = None,
    lora: LoraSlices | None = None, *, with_lora: bool | None = None,
) -> np.ndarray:
    """The (n_slices, N_FEATURES) matrix of each slice's own features; column b (intercept) is zero.
    With ``lora`` (or ``with_lora``) the (n_slices, N_FEATURES_LORA) matrix, the LoRA columns 0 without ``lora``.
    ``x @ coef`` is ``own_terms_s(coef, ...)`` (tested)."""
    p = np.asarray(num_new_tokens, dtype=np.float64)
    c = np.asarray(num_context_tokens, dtype=np.float64)
    e = c if effective_context_tokens is None else np.asarray(effective_context_tokens, dtype=np.float64)
    prefill = np.asarray(is_prefill, dtype=bool)
    decode = ~prefill
    with_lora = lora is not None if with_lora is None else with_lora
    x = np.zeros((p.shape[0], N_FEATURES_LORA if with_lora else N_FEATURES))
    x[:, Coef.A1] = np.where(prefill, p, 0.0)
    x[:, Coef.A2] = np.where(prefill, c, 0.0)
    x[:, Coef.A3] = np.where(prefill, p * p, 0.0)
    x[:, Coef.A5] = np.where(prefill, p * c, 0.0)
    x[:, Coef.A4] = prefill
    x[:, Coef.D2] = np.where(decode, c, 0.0)
    x[:, Coef.D4] = decode
    x[:, Coef.E] = e
    if with_lora and lora is not None:
        adapter = lora.rank > 0
        x[:, LoraCoef.L1] = np.where(prefill & adapter, p, 0.0)
        x[:, LoraCoef.L2] = np.where(prefill, lora.rank * p, 0.0)
        x[:, LoraCoef.L3] = decode & adapter
        x[:, LoraCoef.L4] = np.where(decode, lora.rank, 0.0)
        x[:, LoraCoef.L5] = lora.adapter_share
        x[:, LoraCoef.L6] = lora.slot_load_share
        x[:, LoraCoef.L7] = lora.disk_load_share
        x[:, LoraCoef.L8] = lora.lora_step_share
        x[:, LoraCoef.L9] = lora.base_token_share
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


def step_feature_matrix(trace: StepTrace, *, with_lora: bool | None = None) -> np.ndarray:
    """The (n_steps, N_FEATURES) design matrix: per-step sums of slice features plus the intercept; with the LoRA
    columns (n_steps, N_FEATURES_LORA) when ``with_lora`` (default: when the trace has them; 0 in a trace without)."""
    check_decode_slices(trace)
    with_lora = has_lora_columns(trace) if with_lora is None else with_lora
    lora = lora_slices_of(trace) if with_lora else None
    x = slice_feature_matrix(trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.effective_context_tokens,
                             lora, with_lora=with_lora)
    steps = np.add.reduceat(x, trace.step_starts, axis=0) if trace.n_steps else np.zeros((0, x.shape[1]))
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
    x = step_feature_matrix(trace, with_lora=False)
    load = step_new_tokens(trace)
    context_max = (
        np.maximum.reduceat(trace.num_context_tokens.astype(np.float64), trace.step_starts)
        if trace.n_steps
        else np.zeros(0)
    )
    names = list(FEATURE_NAMES[1:]) + ["new_tokens", "max_context_tokens"]
    return np.column_stack([x[:, 1:], load, context_max]), names
