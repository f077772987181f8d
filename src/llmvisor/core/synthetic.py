"""Traces generated from known coefficients: for recovery tests and for benchmarks at sizes no real run has.

Never used to judge accuracy; real traces recorded from vLLM are (see ``llmvisor.data``).
"""

from __future__ import annotations

import numpy as np

from llmvisor.core.features import FEATURE_NAMES, FEATURE_NAMES_LORA, FEATURE_NAMES_V1, lora_slices, slice_feature_matrix
from llmvisor.core.lora_trace import encode_adapters
from llmvisor.core.trace import StepTrace

DEFAULT_COEF_S = {
    "intercept": 8e-3,
    "prefill_new_tokens": 2.5e-4,
    "prefill_context_tokens": 2e-7,
    "prefill_new_tokens_squared": 4e-8,
    "prefill_new_x_context_tokens": 3e-8,
    "prefill_requests": 4e-4,
    "decode_context_tokens": 1.5e-7,
    "decode_requests": 6e-4,
    "effective_context_tokens": 0.0,
}
"""Coefficients of the synthetic engine; nothing is saved by sharing (``effective_context_tokens`` 0)."""

DEFAULT_LORA_COEF_S = {
    "prefill_lora_tokens": 0.0,
    "prefill_lora_rank_x_tokens": 1.5e-6,
    "decode_lora_tokens": 0.0,
    "decode_lora_rank_x_tokens": 4e-6,
    "lora_adapters": 3e-4,
    "lora_slot_loads": 2e-3,
    "lora_disk_loads": 5e-3,
    "lora_steps": 0.0,
    "lora_base_tokens": 0.0,
}
"""LoRA coefficients of the synthetic engine (work of the adapter's own rank: the ``rank_tokens`` form; no LoRA-path
terms unless ``coef_s`` gives them, so the traces are those written before the terms existed)."""
DEFAULT_LORA_RANKS = {"tenant-0/r8": 8, "tenant-1/r16": 16, "tenant-2/r64": 64, "tenant-3/r8": 8}
"""Adapters of the synthetic engine and their ranks."""

BLOCK_SIZE_TOKENS = 16
"""KV block size of the synthetic engine: shared prefixes are whole blocks, as prefix caching shares them."""


def synthetic_trace(
    n_steps: int,
    *,
    coef_s: dict | None = None,
    max_batch_size: int = 64,
    min_batch_size: int = 1,
    max_new_tokens: int = 512,
    max_context_tokens: int = 4096,
    prefill_fraction: float = 0.3,
    shared_prefix_fraction: float = 0.0,
    noise: float = 0.0,
    run_id: str = "synthetic",
    n_tenants: int = 4,
    seed: int = 0,
    lora_ranks: dict[str, int] | None = None,
    lora_fraction: float = 0.5,
    lora_load_probability: float = 0.2,
) -> StepTrace:
    """Steps of random composition (decode-only, prefill-only and mixed) timed by a known linear model.

    ``noise`` is the standard deviation of multiplicative log-normal noise on each step's time.
    ``shared_prefix_fraction`` > 0 makes a trace of format version 2: that fraction of the steps holding at
    least two slices have a random group of them (two or more) read a common cached prefix of whole KV blocks,
    their contexts being the prefix plus a private part; the step's time prices the prefix's blocks once
    (``effective_context_tokens``). Coefficients missing from ``coef_s`` that a version-1 model lacks are 0.
    ``lora_ranks`` (adapter name: rank) makes a trace of format version 4: each slice runs one of the adapters with
    probability ``lora_fraction``, else the base model; each adapter of a step was loaded into a slot for it with
    probability ``lora_load_probability``, and half of those loads read it from disk. The step's time then adds the
    LoRA terms (``coef_s``'s LoRA coefficients, ``DEFAULT_LORA_COEF_S`` for those missing). Without ``lora_ranks``
    the trace and its random draws are what they were before LoRA.
    """
    rng = np.random.default_rng(seed)
    coef_s = coef_s or DEFAULT_COEF_S
    coef = np.array([coef_s[name] if name in FEATURE_NAMES_V1 else coef_s.get(name, 0.0) for name in FEATURE_NAMES])
    batch = rng.integers(min_batch_size, max_batch_size + 1, size=n_steps)
    offsets = np.concatenate(([0], np.cumsum(batch))).astype(np.int64)
    n = int(offsets[-1])
    step_has_prefill = rng.random(n_steps) < prefill_fraction
    slice_step = np.repeat(np.arange(n_steps), batch)
    first_slice = np.zeros(n, dtype=bool)
    first_slice[offsets[:-1]] = True
    is_prefill = step_has_prefill[slice_step] & (first_slice | (rng.random(n) < 0.05))
    new_tokens = np.where(is_prefill, rng.integers(1, max_new_tokens + 1, size=n), 1)
    context = np.where(
        is_prefill & (rng.random(n) < 0.5), 0, rng.integers(0, max_context_tokens + 1, size=n)
    ).astype(np.int64)
    extra: dict[str, np.ndarray] = {}
    if shared_prefix_fraction > 0:
        context, shared, effective = _shared_prefixes(rng, context, offsets, shared_prefix_fraction, max_context_tokens)
        extra = {"num_shared_context_tokens": shared, "effective_context_tokens": effective}
    effective_context = extra.get("effective_context_tokens")
    lora = None
    if lora_ranks:
        lora, lora_extra = _lora_columns(rng, lora_ranks, lora_fraction, lora_load_probability, offsets, new_tokens)
        extra.update(lora_extra)
        coef = np.array([coef[FEATURE_NAMES.index(name)] if name in FEATURE_NAMES else coef_s.get(name, DEFAULT_LORA_COEF_S[name])
                         for name in FEATURE_NAMES_LORA])
    x = slice_feature_matrix(new_tokens, context, is_prefill, effective_context, lora)
    latency = np.add.reduceat(x @ coef, offsets[:-1]) + coef[0]
    if noise:
        latency = latency * rng.lognormal(0.0, noise, size=n_steps)
    request = np.array([f"r{i}" for i in range(n)], dtype=object)
    tenants = np.array([f"tenant-{i}" for i in range(n_tenants)], dtype=object)
    return StepTrace(
        run_id=np.full(n, run_id, dtype=object),
        step_id=slice_step.astype(np.int64),
        step_latency_s=latency[slice_step],
        request_id=request,
        tenant=tenants[rng.integers(0, n_tenants, size=n)],
        num_new_tokens=new_tokens.astype(np.int64),
        num_context_tokens=context,
        is_prefill=is_prefill,
        step_offsets=offsets,
        extra=extra,
    )


def _shared_prefixes(rng, context, offsets, fraction, max_context_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give a random group of slices in some steps a common prefix; the new contexts and the v2 columns."""
    context = context.copy()
    shared = np.zeros(context.shape[0], dtype=np.int64)
    effective = context.astype(np.float64)
    max_blocks = max(1, max_context_tokens // BLOCK_SIZE_TOKENS)
    for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        size = stop - start
        if size < 2 or rng.random() >= fraction:
            continue
        group = start + rng.choice(size, size=int(rng.integers(2, size + 1)), replace=False)
        prefix = int(rng.integers(1, max_blocks + 1)) * BLOCK_SIZE_TOKENS
        private = rng.integers(0, max(1, max_context_tokens - prefix) + 1, size=group.size)
        context[group] = prefix + private
        shared[group] = prefix
        effective[group] = private + prefix / group.size
    return context, shared, effective


def _lora_columns(rng, ranks: dict[str, int], fraction: float, load_probability: float, offsets, new_tokens):
    """Random adapters per slice and loads per step; their ``LoraSlices`` and the version-4 columns."""
    n = int(offsets[-1])
    adapters = np.array(sorted(ranks), dtype=object)
    name = np.where(rng.random(n) < fraction, adapters[rng.integers(0, adapters.size, size=n)], "").astype(object)
    rank = np.array([ranks.get(a, 0) for a in name.tolist()], dtype=np.int64)
    ran, loads, disk = [], [], []
    for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        step = sorted({a for a in name[start:stop].tolist() if a})
        loaded = [a for a in step if rng.random() < load_probability]
        ran.append(step)
        loads.append(loaded)
        disk.append([a for a in loaded if rng.random() < 0.5])
    batch = np.diff(offsets)
    per_slice = {
        "step_loras": np.repeat(np.array([encode_adapters(s) for s in ran], dtype=object), batch),
        "step_lora_loads": np.repeat(np.array([encode_adapters(s) for s in loads], dtype=object), batch),
        "step_lora_disk_loads": np.repeat(np.array([encode_adapters(s) for s in disk], dtype=object), batch),
    }
    lora = lora_slices(name, rank, offsets, loads, disk, num_new_tokens=new_tokens)
    return lora, {"lora_name": name, "lora_rank": rank, **per_slice}
