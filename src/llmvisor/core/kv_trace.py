"""The reader's checks of the version-3 KV memory columns (`llmvisor.core.trace_schema.KV_COLUMNS`): all or none,
no negative value, step and run columns the same on every row of their step or run, and per step the pool adding
up, Σ kv_block_ns − carried in + carried out + idle + free = kv_pool_blocks × kv_interval_ns, exactly (the meter's
only rounding, the equal split among a block's readers, is inside kv_block_ns and sums exactly). A trace that holds
more than its pool, or whose shares do not add up, is refused here, naming the step."""

from __future__ import annotations

import numpy as np

from llmvisor.core.trace_schema import (
    KV_COLUMNS,
    KV_RUN_COLUMNS,
    KV_SLICE_COLUMN,
    KV_STEP_COLUMNS,
    columns_together,
    first_disagreement,
    rejection,
    step_place,
)
from llmvisor.errors import plain


def kv_columns_present(path: str, names) -> bool:
    """Whether the KV memory columns are there; some without the others is refused."""
    return columns_together(path, names, KV_COLUMNS, "KV memory", 3)


def check_kv_columns(columns: dict, *, path: str, order: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
                     row_numbers: np.ndarray, run_id: np.ndarray, step_id: np.ndarray) -> None:
    """Refuse KV columns that break the contract (module docstring). ``order`` sorts the rows by (run, step);
    ``starts``/``offsets`` are the sorted steps' first rows; ``run_id``/``step_id`` are in file order."""
    values = {name: np.asarray(columns[name], dtype=np.int64) for name in KV_COLUMNS}
    for name, column in values.items():
        bad = column < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise rejection(path, f"row {row_numbers[i]}", f"{name}: must be >= 0 (got {int(column[i])})")
    bad = values["kv_block_bytes"] == 0
    if bad.any():
        i = int(np.argmax(bad))
        raise rejection(path, f"row {row_numbers[i]}", "kv_block_bytes: must be >= 1 (got 0)")
    if not order.size:
        return

    def where(k: int) -> str:
        first = order[starts[k]]
        return step_place(step_id[first], run_id[first], row_numbers[order[offsets[k]:offsets[k + 1]]])

    for name in KV_STEP_COLUMNS:
        found = first_disagreement(values[name][order], starts)
        if found is not None:
            k, low, high = found
            raise rejection(path, where(k), f"rows disagree on {name} ({int(low)} vs {int(high)})")
    sorted_run = run_id[order]
    run_start = np.ones(order.size, dtype=bool)
    run_start[1:] = sorted_run[1:] != sorted_run[:-1]
    run_starts = np.flatnonzero(run_start)
    for name in KV_RUN_COLUMNS:
        found = first_disagreement(values[name][order], run_starts)
        if found is not None:
            k, low, high = found
            raise rejection(path, f"run {plain(sorted_run[run_starts[k]])!r}", f"rows disagree on {name} ({int(low)} vs {int(high)})")

    per_step = {name: values[name][order][starts] for name in (*KV_STEP_COLUMNS, *KV_RUN_COLUMNS)}
    slices = values[KV_SLICE_COLUMN][order]
    biggest = max(int(slices.max()), *(int(v.max()) for v in per_step.values()))
    pool_ns_max = int(per_step["kv_pool_blocks"].max()) * int(per_step["kv_interval_ns"].max())
    if max(biggest * int(np.diff(offsets).max() + 4), pool_ns_max) < 2**62:  # no 64-bit wrap: vectorised
        held = np.add.reduceat(slices, starts)
        pool_ns = per_step["kv_pool_blocks"] * per_step["kv_interval_ns"]
    else:  # Python integers
        held = np.add.reduceat(slices.astype(object), starts)
        pool_ns = per_step["kv_pool_blocks"].astype(object) * per_step["kv_interval_ns"].astype(object)
    carried_in, carried_out = per_step["kv_carried_in_block_ns"], per_step["kv_carried_out_block_ns"]
    total = held - carried_in + carried_out + per_step["kv_idle_block_ns"] + per_step["kv_free_block_ns"]
    over = np.flatnonzero(carried_in > held)
    if over.size:
        k = int(over[0])
        raise rejection(path, where(k), f"kv_carried_in_block_ns ({int(carried_in[k])}) is more than the step's slices "
                                        f"hold (Σ kv_block_ns = {int(held[k])})")
    wrong = np.flatnonzero(total != pool_ns)
    if wrong.size:
        k = int(wrong[0])
        raise rejection(
            path, where(k),
            f"KV memory does not add up: Σ kv_block_ns {int(held[k])} − carried in {int(carried_in[k])} + carried out "
            f"{int(carried_out[k])} + idle {int(per_step['kv_idle_block_ns'][k])} + free "
            f"{int(per_step['kv_free_block_ns'][k])} = {int(total[k])} block-ns, but the pool over the interval is "
            f"kv_pool_blocks × kv_interval_ns = {int(pool_ns[k])}")
