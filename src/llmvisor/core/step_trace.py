"""`StepTrace`, a validated step trace in memory, and the joining of several traces into one.

Columnar numpy arrays with the slices of each step made contiguous and ordered by (run_id, step_id), plus
per-step views (`step_offsets`, `step_latency_s_per_step`, ...) that the features, the model and attribution
use. Built by `llmvisor.core.trace.build_trace`; `llmvisor.core.trace` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from llmvisor.core.trace_schema import METADATA_KEY, SHARING_ARROW_FIELDS, SHARING_COLUMNS, format_version, parse_is_warmup
from llmvisor.errors import TraceError


@dataclass
class StepTrace:
    """A validated step trace, slices grouped by step.

    Attributes
    ----------
    run_id, request_id, tenant : object arrays of str, one entry per slice.
    step_id, num_new_tokens, num_context_tokens : int64 arrays, one entry per slice.
    step_latency_s : float64 array, one entry per slice (equal within a step).
    is_prefill : bool array, one entry per slice.
    extra : optional and unknown columns, kept as given.
    metadata : trace-level facts (noise floor, provenance), carried by Parquet files.
    step_offsets : int64 array of n_steps + 1: the slices of step k are ``step_offsets[k]:step_offsets[k + 1]``.
    """

    run_id: np.ndarray
    step_id: np.ndarray
    step_latency_s: np.ndarray
    request_id: np.ndarray
    tenant: np.ndarray
    num_new_tokens: np.ndarray
    num_context_tokens: np.ndarray
    is_prefill: np.ndarray
    step_offsets: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    # The three members below let scikit-learn treat a trace as X with one sample per step
    # (``_num_samples`` reads ``shape[0]``, ``_safe_indexing`` calls ``trace[indices, ...]``), so model
    # selection (GridSearchCV with GroupKFold) can split a trace by steps.
    @property
    def shape(self) -> tuple[int]:
        """``(n_steps,)``: a trace's samples are its steps."""
        return (self.n_steps,)

    def __len__(self) -> int:
        return self.n_steps

    def __getitem__(self, key) -> StepTrace:
        """The sub-trace of the steps ``key`` selects (integer indices in the given order, a boolean mask or a
        slice); a ``(key, ...)`` tuple, as scikit-learn passes, is the same."""
        if isinstance(key, tuple):
            if len(key) != 2 or key[1] is not Ellipsis:
                raise TypeError("a trace is indexed by steps only: trace[steps] or trace[steps, ...]")
            key = key[0]
        if isinstance(key, slice):
            return self.take_steps(np.arange(self.n_steps)[key])
        index = np.asarray(key)
        if index.dtype == bool:
            return self.select_steps(index)
        if index.ndim != 1 or index.dtype.kind not in "iu":
            raise TypeError(f"a trace is indexed by a 1-d array of step indices or a step mask, got {key!r}")
        return self.take_steps(index)

    def take_steps(self, steps: np.ndarray) -> StepTrace:
        """A trace of the steps at indices ``steps``, in that order (repeats allowed)."""
        steps = np.asarray(steps, dtype=np.intp)
        sizes = self.batch_size_per_step[steps]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        starts = self.step_starts[steps]
        slices = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
        return StepTrace(
            run_id=self.run_id[slices],
            step_id=self.step_id[slices],
            step_latency_s=self.step_latency_s[slices],
            request_id=self.request_id[slices],
            tenant=self.tenant[slices],
            num_new_tokens=self.num_new_tokens[slices],
            num_context_tokens=self.num_context_tokens[slices],
            is_prefill=self.is_prefill[slices],
            step_offsets=offsets,
            extra={name: values[slices] for name, values in self.extra.items()},
            metadata=dict(self.metadata),
            sources=self.sources,
        )

    @property
    def n_slices(self) -> int:
        return int(self.num_new_tokens.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.step_offsets.shape[0] - 1)

    @property
    def step_starts(self) -> np.ndarray:
        return self.step_offsets[:-1]

    @property
    def batch_size_per_step(self) -> np.ndarray:
        return np.diff(self.step_offsets)

    @property
    def slice_step_index(self) -> np.ndarray:
        """For every slice, the index of its step (0..n_steps-1)."""
        return np.repeat(np.arange(self.n_steps), self.batch_size_per_step)

    @property
    def step_latency_s_per_step(self) -> np.ndarray:
        return self.step_latency_s[self.step_starts]

    @property
    def run_id_per_step(self) -> np.ndarray:
        return self.run_id[self.step_starts]

    @property
    def step_id_per_step(self) -> np.ndarray:
        return self.step_id[self.step_starts]

    @property
    def is_prefill_per_step(self) -> np.ndarray:
        """A step is "prefill" if any of its slices is a prefill slice."""
        if self.n_steps == 0:
            return np.zeros(0, dtype=bool)
        return np.logical_or.reduceat(self.is_prefill, self.step_starts)

    @property
    def is_warmup_per_step(self) -> np.ndarray:
        """Steps the recorder marked as warm-up (optional column ``is_warmup`` on any of its rows)."""
        if "is_warmup" not in self.extra or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        values = parse_is_warmup(self.extra["is_warmup"], path=", ".join(self.sources) or "<memory>")
        return np.logical_or.reduceat(values, self.step_starts)

    @property
    def is_drifted_per_step(self) -> np.ndarray:
        """Steps a profile flagged as run while the machine drifted (optional column ``is_drifted``, read as
        ``is_warmup`` is)."""
        if "is_drifted" not in self.extra or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        values = parse_is_warmup(self.extra["is_drifted"], path=", ".join(self.sources) or "<memory>")
        return np.logical_or.reduceat(values, self.step_starts)

    def engine_fingerprint_ids(self) -> list[str]:
        """The distinct engine fingerprint ids of the trace's steps (column ``engine_fingerprint``), in order of
        first appearance; the metadata's fingerprint when the column is absent."""
        if "engine_fingerprint" in self.extra:
            values = [str(v) for v in np.asarray(self.extra["engine_fingerprint"], dtype=object) if v is not None and str(v)]
            return list(dict.fromkeys(values))
        recorded = self.metadata.get("engine_fingerprint")
        return [str(recorded["id"])] if isinstance(recorded, dict) and recorded.get("id") else []

    @property
    def has_sharing_columns(self) -> bool:
        """Whether the trace carries the version-2 sharing columns."""
        return all(name in self.extra for name in SHARING_COLUMNS)

    @property
    def num_shared_context_tokens(self) -> np.ndarray:
        """Per slice, context tokens in KV blocks other slices of its step also read (0 in a v1 trace)."""
        if not self.has_sharing_columns:
            return np.zeros(self.n_slices, dtype=np.int64)
        return np.asarray(self.extra["num_shared_context_tokens"], dtype=np.int64)

    @property
    def effective_context_tokens(self) -> np.ndarray:
        """Per slice, the context with each KV block divided among its readers in the step (the context
        itself in a v1 trace: nothing shared)."""
        if not self.has_sharing_columns:
            return self.num_context_tokens.astype(np.float64)
        return np.asarray(self.extra["effective_context_tokens"], dtype=np.float64)

    @property
    def has_shared_context_per_step(self) -> np.ndarray:
        """Steps where some slice reads context shared with another slice (num_shared_context_tokens > 0)."""
        if not self.has_sharing_columns or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        return np.logical_or.reduceat(self.num_shared_context_tokens > 0, self.step_starts)

    @property
    def run_ids(self) -> list[str]:
        return list(dict.fromkeys(self.run_id_per_step.tolist()))

    @property
    def phase(self) -> np.ndarray:
        return np.where(self.is_prefill, "prefill", "decode").astype(object)

    def select_steps(self, step_mask: np.ndarray) -> StepTrace:
        """A trace holding only the steps where ``step_mask`` is true."""
        step_mask = np.asarray(step_mask, dtype=bool)
        slice_mask = np.repeat(step_mask, self.batch_size_per_step)
        sizes = self.batch_size_per_step[step_mask]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        return StepTrace(
            run_id=self.run_id[slice_mask],
            step_id=self.step_id[slice_mask],
            step_latency_s=self.step_latency_s[slice_mask],
            request_id=self.request_id[slice_mask],
            tenant=self.tenant[slice_mask],
            num_new_tokens=self.num_new_tokens[slice_mask],
            num_context_tokens=self.num_context_tokens[slice_mask],
            is_prefill=self.is_prefill[slice_mask],
            step_offsets=offsets,
            extra={name: values[slice_mask] for name, values in self.extra.items()},
            metadata=dict(self.metadata),
            sources=self.sources,
        )

    def select_runs(self, run_ids: Sequence[str]) -> StepTrace:
        return self.select_steps(np.isin(self.run_id_per_step, list(run_ids)))

    def to_arrow(self) -> pa.Table:
        columns = {
            "run_id": pa.array(self.run_id, pa.string()),
            "step_id": pa.array(self.step_id, pa.int64()),
            "step_latency_s": pa.array(self.step_latency_s, pa.float64()),
            "request_id": pa.array(self.request_id, pa.string()),
            "tenant": pa.array(self.tenant, pa.string()),
            "num_new_tokens": pa.array(self.num_new_tokens, pa.int64()),
            "num_context_tokens": pa.array(self.num_context_tokens, pa.int64()),
            "phase": pa.array(self.phase, pa.string()),
        }
        for name, values in self.extra.items():
            columns[name] = pa.array(values.tolist() if values.dtype == object else values)
        for name, data_type in SHARING_ARROW_FIELDS.items():
            if name in columns:
                columns[name] = columns[name].cast(data_type)
        table = pa.table(columns)
        metadata = {METADATA_KEY: json.dumps({"format_version": format_version(columns), **self.metadata}).encode()}
        return table.replace_schema_metadata(metadata)


class RunIds:
    """The run ids of the traces read so far, each owned by the one trace (file) it came from: the check that
    no run is read twice (the same file given twice, or a renamed copy), shared by `concat_traces` and the
    streaming `iter_traces`."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[int, str]] = {}

    def claim(self, trace: StepTrace, owner: int, source: str) -> None:
        """Record ``trace``'s runs as ``owner``'s (a trace or file index); refuse one another owner holds."""
        for run in trace.run_ids:
            first = self._owners.setdefault(run, (owner, source))
            if first[0] != owner:
                raise TraceError(f"{source}: run {run!r}: run id also used in {first[1]}; run ids must be unique")


def concat_traces(traces: Sequence[StepTrace]) -> StepTrace:
    if len(traces) == 1:
        return traces[0]
    runs = RunIds()
    for k, trace in enumerate(traces):
        runs.claim(trace, k, trace.sources[0] if trace.sources else "<memory>")
    if any(t.has_sharing_columns for t in traces):
        traces = [t if t.has_sharing_columns else _with_sharing_columns(t) for t in traces]
    names = set.intersection(*(set(t.extra) for t in traces)) if traces else set()
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for trace in traces:
        offsets.append(trace.step_offsets[1:] + base)
        base += trace.n_slices
    metadata: dict = {}
    for trace in traces:
        for key, value in trace.metadata.items():
            metadata.setdefault(key, value)
    return StepTrace(
        run_id=np.concatenate([t.run_id for t in traces]),
        step_id=np.concatenate([t.step_id for t in traces]),
        step_latency_s=np.concatenate([t.step_latency_s for t in traces]),
        request_id=np.concatenate([t.request_id for t in traces]),
        tenant=np.concatenate([t.tenant for t in traces]),
        num_new_tokens=np.concatenate([t.num_new_tokens for t in traces]),
        num_context_tokens=np.concatenate([t.num_context_tokens for t in traces]),
        is_prefill=np.concatenate([t.is_prefill for t in traces]),
        step_offsets=np.concatenate(offsets),
        extra={name: np.concatenate([t.extra[name] for t in traces]) for name in names},
        metadata=metadata,
        sources=tuple(s for t in traces for s in t.sources),
    )


def _with_sharing_columns(trace: StepTrace) -> StepTrace:
    """A v1 trace with the sharing columns filled in as "nothing shared", for joining with v2 traces."""
    extra = dict(trace.extra)
    extra["num_shared_context_tokens"] = trace.num_shared_context_tokens
    extra["effective_context_tokens"] = trace.effective_context_tokens
    return dataclasses.replace(trace, extra=extra)
