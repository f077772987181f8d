"""A relayed step as trace rows, or many of them as trace columns: one definition of the mapping.

The recorder hands each step to its delivery process in a compact form, ``[step_id, timestamp_s,
step_latency_s, slices]``, each slice ``[request_id, tenant, num_new_tokens, num_context_tokens, is_prefill,
num_shared_context_tokens, effective_context_tokens]``, optionally followed by ``num_cached_prompt_tokens`` and
then ``kv_block_ns``; a metered step (trace format 3) has a fifth element, its `KV_STEP_COLUMNS` values in order.
A sixth element, when present, holds further columns by name (`NAMED_INDEX`: ``{"slice": {column: [a value per
slice]}, "step": {column: value}}``; the fifth is then None for a step that is not metered): trace format 4's LoRA
columns travel so, and a later column can without another positional field. A header holds what every row shares (``columns``: run id, engine fingerprint, the KV pool's size and block
bytes...; ``warmup_steps``).

The trace file and the pusher take one row dict per slice (`step_rows`). The archive takes thousands of steps at
a time as an Arrow table, and building a dict per slice for it cost more than the rest of its work: `StepColumns`
keeps the slices as columns instead, and gives the same columns, in the same order, with the same values, as the
rows of those steps would (`tests/test_relayed.py` checks it on generated steps).
"""

from __future__ import annotations

from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.core.trace_schema import KV_SLICE_COLUMN, KV_STEP_COLUMNS

SLICE_FIELDS = ("request_id", "tenant", "num_new_tokens", "num_context_tokens", "is_prefill",
                "num_shared_context_tokens", "effective_context_tokens")
"""A relayed slice's first seven fields, in order; an eighth, when present, is ``num_cached_prompt_tokens``, a ninth
``kv_block_ns``."""


NAMED_INDEX = 5
"""Where a relayed step holds its named columns (module docstring)."""

_NO_CACHED = object()


def phase_of(is_prefill) -> str:
    return "prefill" if is_prefill else "decode"


def named_columns(step: list) -> tuple[dict, dict]:
    """(per-slice columns, per-step columns) of a relayed step's named element; empty without one. A per-slice column
    must have a value for every slice."""
    named = step[NAMED_INDEX] if len(step) > NAMED_INDEX else None
    if not named:
        return {}, {}
    per_slice, per_step = named.get("slice") or {}, named.get("step") or {}
    for name, values in per_slice.items():
        if len(values) != len(step[3]):
            raise ValueError(f"step {step[0]}: column {name} has {len(values)} values for {len(step[3])} slices")
    return per_slice, per_step


def step_rows(header: dict, step: list) -> list[dict]:
    """Trace rows of one relayed step (module docstring); ``num_cached_prompt_tokens`` is written when every
    slice of the step has it."""
    step_id, timestamp_s, latency_s, slices, *kv = step
    kv = kv[:1] if kv and kv[0] is not None else []
    constant = header["columns"]
    is_warmup = step_id < header["warmup_steps"]
    rows = [
        {
            "step_id": step_id,
            "step_latency_s": latency_s,
            "request_id": request_id,
            "tenant": str(tenant),
            "num_new_tokens": num_new,
            "num_context_tokens": num_context,
            "num_shared_context_tokens": num_shared,
            "effective_context_tokens": num_effective,
            "phase": phase_of(is_prefill),
            "timestamp_s": timestamp_s,
            **constant,
            "is_warmup": is_warmup,
        }
        for request_id, tenant, num_new, num_context, is_prefill, num_shared, num_effective, *_ in slices
    ]
    if slices and all(len(s) > 7 for s in slices):
        for row, s in zip(rows, slices):
            row[CACHED_PROMPT_COLUMN] = s[7]
    if kv and slices and all(len(s) > 8 for s in slices):
        per_step = dict(zip(KV_STEP_COLUMNS, kv[0]))
        for row, s in zip(rows, slices):
            row[KV_SLICE_COLUMN] = s[8]
            row.update(per_step)
    per_slice, per_step = named_columns(step)
    for name, values in per_slice.items():
        for row, value in zip(rows, values):
            row[name] = value
    if per_step and rows:
        for row in rows:
            row.update(per_step)
    return rows


class StepColumns:
    """Relayed steps of one header kept as columns: `columns` is what the rows of the same steps (`step_rows`)
    hold, column by column, missing values None (as a column the rows of only some steps have)."""

    def __init__(self, header: dict):
        self.header = header
        self.num_steps = 0
        self.num_rows = 0
        self._step_id: list = []
        self._latency_s: list = []
        self._timestamp_s: list = []
        self._is_warmup: list = []
        self._fields: list[list] = [[] for _ in SLICE_FIELDS]
        self._cached: list = []
        self._any_cached = False
        self._kv: list[list] = [[] for _ in range(1 + len(KV_STEP_COLUMNS))]
        self._any_kv = False
        self._named: dict[str, list] = {}
        self._order: list[str] = []  # the optional columns in order of first appearance, as in the rows

    def add(self, step: list) -> None:
        """One relayed step; a step without slices has no rows (as in `step_rows`) and is not counted."""
        step_id, timestamp_s, latency_s, slices, *kv = step
        kv = kv[:1] if kv and kv[0] is not None else []
        n = len(slices)
        if not n:
            return
        if min(map(len, slices)) < len(SLICE_FIELDS):
            raise ValueError(f"step {step_id}: a slice has fewer than {len(SLICE_FIELDS)} fields")
        per_slice, per_step = named_columns(step)
        for column, values in zip(self._fields, zip(*slices)):
            column.extend(values)
        self._step_id.extend([step_id] * n)
        self._latency_s.extend([latency_s] * n)
        self._timestamp_s.extend([timestamp_s] * n)
        self._is_warmup.extend([step_id < self.header["warmup_steps"]] * n)
        if all(len(s) > 7 for s in slices):
            self._cached.extend([s[7] for s in slices])
            if not self._any_cached:
                self._order.append(CACHED_PROMPT_COLUMN)
            self._any_cached = True
        else:
            self._cached.extend([_NO_CACHED] * n)
        if kv and all(len(s) > 8 for s in slices):
            self._kv[0].extend([s[8] for s in slices])
            for column, value in zip(self._kv[1:], kv[0]):
                column.extend([value] * n)
            if not self._any_kv:
                self._order.append(KV_SLICE_COLUMN)
            self._any_kv = True
        else:
            for column in self._kv:
                column.extend([None] * n)
        for name in (*per_slice, *per_step):
            if name not in self._named:  # rows of the steps before had none
                self._named[name] = [None] * self.num_rows
                self._order.append(name)
        for name, column in self._named.items():
            if name in per_slice:
                column.extend(per_slice[name])
            else:
                column.extend([per_step[name]] * n if name in per_step else [None] * n)
        self.num_steps += 1
        self.num_rows += n

    def columns(self) -> dict[str, list]:
        """Column name → values, in the order of `step_rows`' keys (a header column named like a computed one
        takes its place and values, as in the rows); none without rows."""
        if not self.num_rows:
            return {}
        request_id, tenant, num_new, num_context, is_prefill, num_shared, num_effective = self._fields
        out = {
            "step_id": self._step_id,
            "step_latency_s": self._latency_s,
            "request_id": request_id,
            "tenant": [str(t) for t in tenant],
            "num_new_tokens": num_new,
            "num_context_tokens": num_context,
            "num_shared_context_tokens": num_shared,
            "effective_context_tokens": num_effective,
            "phase": [phase_of(p) for p in is_prefill],
            "timestamp_s": self._timestamp_s,
        }
        out.update({name: [value] * self.num_rows for name, value in self.header["columns"].items()})
        out["is_warmup"] = self._is_warmup
        for name in self._order:  # a header column of the same name keeps its place, as in the rows
            if name == CACHED_PROMPT_COLUMN:  # rows of a step without it keep the header's value, if any
                absent = self.header["columns"].get(CACHED_PROMPT_COLUMN)
                out[CACHED_PROMPT_COLUMN] = [absent if c is _NO_CACHED else c for c in self._cached]
            elif name == KV_SLICE_COLUMN:
                out.update(zip((KV_SLICE_COLUMN, *KV_STEP_COLUMNS), self._kv))
            else:
                out[name] = self._named[name]
        return out
