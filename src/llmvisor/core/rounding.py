"""Seconds to integer nanoseconds that add up exactly: one rounding rule for the ledger's per-step ingest and
the edge's window aggregates (`llmvisor.metering`), so both store the same nanoseconds for the same step."""

from __future__ import annotations

import numpy as np

__all__ = ["apportion_ns"]


def apportion_ns(share_s: np.ndarray, step_offsets: np.ndarray, measured_ns: np.ndarray) -> np.ndarray:
    """Integer nanoseconds per slice, ≥ 0, summing exactly to each step's ``measured_ns``.

    Cumulative rounding: slice i of a step gets round(T·C_i/C) − round(T·C_{i−1}/C), C_i the running sum of
    the shares. It is never more than 1 ns from the share and sums to T by construction.
    """
    sizes = np.diff(step_offsets)
    starts = step_offsets[:-1]
    ends = step_offsets[1:] - 1
    share_s = np.asarray(share_s, dtype=np.float64)
    # Running sums per step, not one over the batch minus an offset: a tiny share after a large step would
    # vanish in the subtraction. All steps at once in a zero-padded (steps x largest batch) matrix, unless
    # the batch sizes are too uneven for that to be cheap.
    step_of_slice = np.repeat(np.arange(sizes.size), sizes)
    position = np.arange(share_s.size) - starts[step_of_slice]
    width = int(sizes.max()) if sizes.size else 0
    if sizes.size * width <= 4 * share_s.size + 1024:
        padded = np.zeros((sizes.size, width))
        padded[step_of_slice, position] = share_s
        local = np.cumsum(padded, axis=1)[step_of_slice, position]
    else:
        local = np.empty_like(share_s)
        for start, stop in zip(starts.tolist(), step_offsets[1:].tolist()):
            np.cumsum(share_s[start:stop], out=local[start:stop])
    total = local[ends]
    position = position + 1
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(
            np.repeat(total > 0, sizes), local / np.repeat(total, sizes), position / np.repeat(sizes, sizes)
        )
    cumulative_ns = np.rint(np.clip(fraction, 0.0, 1.0) * np.repeat(measured_ns, sizes)).astype(np.int64)
    cumulative_ns[ends] = measured_ns
    previous = np.concatenate(([0], cumulative_ns[:-1]))
    previous[starts] = 0
    return cumulative_ns - previous
