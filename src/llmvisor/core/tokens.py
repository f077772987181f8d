"""What a usage row's tokens are, for a price per token: a slice's new tokens split into prompt tokens the engine
computed (a prefill slice's) and output tokens (a decode slice's), and the prompt tokens its request found in the
prefix cache. Written once here for per-step ingest (`llmvisor.ledger.steps`) and window aggregates
(`llmvisor.metering.windows`), so both meter the same counts.

- **uncached prompt tokens**: ``num_new_tokens`` of prefill slices (a preempted request's recomputed prompt
  counts again: the engine computed it again).
- **cached prompt tokens**: the optional slice fact ``num_cached_prompt_tokens`` (`CACHED_PROMPT_COLUMN`): on a
  request's first slice, the prompt tokens already in the KV cache when it was first scheduled (vLLM's
  ``num_computed_tokens`` of a newly scheduled request: prefix-cache hits, local or from a KV connector); 0 on its
  other slices. A step without it (any trace-format v1 file that lacks the column) counts 0 cached tokens.
- **output tokens**: ``num_new_tokens`` of decode slices, the generated tokens the engine ran. A request that
  generated n tokens ran n − 1 of them (its first is sampled by its last prefill step; its last is never run), so
  this is one less per request than an OpenAI ``completion_tokens``.
"""

from __future__ import annotations

import numpy as np

CACHED_PROMPT_COLUMN = "num_cached_prompt_tokens"
TOKEN_SPLIT = ("num_uncached_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens")
"""The split's counts, by these names wherever they are kept (ledger rows, window aggregates, charges)."""


def add_counts(a: int | None, b: int | None) -> int | None:
    """A sum where an unknown part (None: a count stored before the split existed) keeps the whole unknown, as
    SQL's NULL + x does in the ledger."""
    return None if a is None or b is None else a + b


def token_split(num_new_tokens, is_prefill, num_cached_prompt_tokens=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slice (uncached prompt, cached prompt, output) tokens (module note); cached None: 0 everywhere."""
    new = np.asarray(num_new_tokens, dtype=np.int64)
    prefill = np.asarray(is_prefill, dtype=bool)
    cached = (np.zeros(new.shape, dtype=np.int64) if num_cached_prompt_tokens is None
              else np.asarray(num_cached_prompt_tokens, dtype=np.int64))
    return np.where(prefill, new, 0), cached, np.where(prefill, 0, new)
