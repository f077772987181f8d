"""Archived steps read as the ledger billed them in window mode: which stored window holds each step, and whether
the edge priced it with the sharing columns. The audit (`llmvisor.service.audit`) checks bills with these and the
window-mode adjustment (`llmvisor.service.adjust`) re-attributes with them, so both read a window's steps alike."""

from __future__ import annotations

import dataclasses

import numpy as np

from llmvisor.core.trace import SHARING_COLUMNS, StepTrace


def match_windows(trace: StepTrace, keys: list, classes: np.ndarray, when_us: np.ndarray, version: np.ndarray,
                  window_rows: list) -> np.ndarray:
    """Per archived step the ledger did not bill per step, the index in ``window_rows`` of the attributed window of
    its run and class that holds its start (-1: none)."""
    out = np.full(trace.n_steps, -1, dtype=np.int64)
    by_run: dict[str, list[int]] = {}
    for i, row in enumerate(window_rows):
        by_run.setdefault(row.run_id, []).append(i)
    starts = {run: np.asarray([window_rows[i].window_start_us for i in idx], dtype=np.int64) for run, idx in by_run.items()}
    for k in np.flatnonzero(version == -2).tolist():
        run = keys[k][0]
        if run not in by_run:
            continue
        j = int(np.searchsorted(starts[run], when_us[k], side="right")) - 1
        if j < 0:
            continue
        i = by_run[run][j]
        row = window_rows[i]
        if when_us[k] < row.window_end_us and not row.pending and row.engine_class == classes[k]:
            out[k] = i
    return out


def priced_with_sharing(trace: StepTrace) -> np.ndarray:
    """Per step, whether its archived slices carry shared context (the edge priced it with the sharing columns);
    steps archived with none shared are priced without them, as a window of them is (`WindowAggregator`)."""
    if trace.n_steps == 0 or not all(name in trace.extra for name in SHARING_COLUMNS):
        return np.zeros(trace.n_steps, dtype=bool)
    shared = np.asarray(trace.extra["num_shared_context_tokens"], dtype=np.float64) > 0
    differs = np.asarray(trace.extra["effective_context_tokens"], dtype=np.float64) != np.asarray(trace.num_context_tokens, dtype=np.float64)
    flags = np.zeros(trace.n_steps, dtype=np.int64)
    np.add.at(flags, trace.slice_step_index, (shared | differs).astype(np.int64))
    return flags > 0


def as_billed(part: StepTrace, with_sharing: bool) -> StepTrace:
    """Steps as the ledger billed them: without the sharing columns where it stored none (a pusher that did not
    send them), so the model prices them as the service did."""
    if with_sharing:
        return part
    return dataclasses.replace(part, extra={k: val for k, val in part.extra.items() if k not in SHARING_COLUMNS})
