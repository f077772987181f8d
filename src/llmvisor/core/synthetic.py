"""Traces generated from known coefficients: for recovery tests and for benchmarks at sizes no real run has.

Never used to judge accuracy; real traces recorded from vLLM are (see ``llmvisor.data``).
"""

from __future__ import annotations

import numpy as np

from llmvisor.core.features import FEATURE_NAMES, slice_feature_matrix
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
}


def synthetic_trace(
    n_steps: int,
    *,
    coef_s: dict | None = None,
    max_batch_size: int = 64,
    min_batch_size: int = 1,
    max_new_tokens: int = 512,
    max_context_tokens: int = 4096,
    prefill_fraction: float = 0.3,
    noise: float = 0.0,
    run_id: str = "synthetic",
    n_tenants: int = 4,
    seed: int = 0,
) -> StepTrace:
    """Steps of random composition (decode-only, prefill-only and mixed) timed by a known linear model.

    ``noise`` is the standard deviation of multiplicative log-normal noise on each step's time.
    """
    rng = np.random.default_rng(seed)
    coef = np.array([(coef_s or DEFAULT_COEF_S)[name] for name in FEATURE_NAMES])
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
    x = slice_feature_matrix(new_tokens, context, is_prefill)
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
    )
