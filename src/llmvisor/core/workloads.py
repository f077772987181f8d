"""Request-length workload CSVs (num_prefill_tokens, num_decode_tokens[, arrived_at]): one reader for all, and the
engine limits (`Envelope`) what is drawn from them must fit.

Profiling replays their rows as requests (`llmvisor.profile.plans`); the validation draws batch lengths
from them (`llmvisor.validation.plans`). The package ships three real mixes (`llmvisor.shipped.workloads_dir`).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass

from llmvisor.errors import LlmvisorError

REQUIRED_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Envelope:
    """The engine limits a profile's episodes or a validation's batches must stay within."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_tokens: int | None = None
    block_size: int | None = None
    """Tokens per KV cache block (None: `DEFAULT_BLOCK_SIZE`); a shared prefix is shared in whole blocks."""


@dataclass(frozen=True)
class WorkloadRow:
    prompt_len: int
    output_len: int
    arrival_s: float | None


def read_workload_csv(path: str | os.PathLike, *, min_output_tokens: int = 1) -> list[WorkloadRow]:
    """Read a request-length CSV (num_prefill_tokens, num_decode_tokens, optional arrived_at).

    Prompts need at least 1 token; outputs at least ``min_output_tokens`` (a replayed request generates at
    least one token, while a length mix may hold requests that produced none).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise LlmvisorError(f"{path}: no such workload file")
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            missing = [name for name in REQUIRED_COLUMNS if name not in columns]
            if missing:
                raise LlmvisorError(f"{path}: header: missing column(s) {', '.join(missing)}")
            has_arrival = "arrived_at" in columns
            rows = []
            for line, record in enumerate(reader, start=2):
                prompt = _token_count(path, line, "num_prefill_tokens", record.get("num_prefill_tokens"), 1)
                output = _token_count(path, line, "num_decode_tokens", record.get("num_decode_tokens"), min_output_tokens)
                arrival = _arrival(path, line, record.get("arrived_at")) if has_arrival else None
                rows.append(WorkloadRow(prompt, output, arrival))
    except UnicodeDecodeError:
        raise LlmvisorError(f"{path}: not a text CSV file") from None
    if not rows:
        raise LlmvisorError(f"{path}: no requests in workload file")
    return rows


def _token_count(path: str, line: int, column: str, text: str | None, minimum: int) -> int:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise LlmvisorError(f"{path}: line {line}: {column}: expected a token count, got {text!r}") from None
    if not math.isfinite(value) or value < minimum or value != int(value):
        raise LlmvisorError(f"{path}: line {line}: {column}: expected a whole number >= {minimum}, got {text!r}")
    return int(value)


def _arrival(path: str, line: int, text: str | None) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise LlmvisorError(f"{path}: line {line}: arrived_at: expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise LlmvisorError(f"{path}: line {line}: arrived_at: expected finite seconds >= 0, got {text!r}")
    return value
