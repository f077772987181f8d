"""Trace format 3 runs made by the meter (`KvMeter`), as the recorder makes them: a pool of KV blocks, requests of
several tenants holding random blocks (some shared, so split among their readers), some skipped by a step (their
block-ns carried to their next slice), the pool observed before and after each step. The rows are the recorder's
(`llmvisor.core.relayed.step_rows`), so every KV column is the meter's, never written out by hand."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from llmvisor.core.kv_memory import KvMeter, snapshot
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace_schema import KV_COLUMNS


def metered_run(seed: int, *, run_id: str, t0_s: float, tenants=("kv-a", "kv-b", "kv-c"), n_steps: int = 30,
                pool: int = 48, block_bytes: int = 2 * 4 * 8 * 64 * 2 * 16, n_requests: int = 7,
                engine_fingerprint: str | None = None) -> list[list[dict]]:
    """One run's steps, each a list of trace rows (format 3), timestamps from ``t0_s`` on."""
    rng = np.random.default_rng(seed)
    columns = {"run_id": run_id, "kv_pool_blocks": pool, "kv_block_bytes": block_bytes}
    if engine_fingerprint is not None:
        columns["engine_fingerprint"] = engine_fingerprint
    header = {"columns": columns, "warmup_steps": 0}
    names = [f"{run_id}-req-{i}" for i in range(n_requests)]
    tenant_of = {name: tenants[i % len(tenants)] for i, name in enumerate(names)}
    context = {name: int(rng.integers(16, 600)) for name in names}
    meter = KvMeter(pool, 0)
    now_ns = 0
    steps = []
    for step_id in range(n_steps):
        holding = sorted(rng.choice(names, size=int(rng.integers(1, min(5, n_requests) + 1)), replace=False).tolist())
        holders = {name: rng.choice(pool, size=int(rng.integers(1, 6)), replace=False).tolist() for name in holding}
        held = {b for ids in holders.values() for b in ids}
        pool_now = snapshot(holders, pool_blocks=pool, idle_cached_blocks=int(rng.integers(0, pool - len(held) + 1)))
        effective = {h: float(e) for h, e in zip(pool_now.holders, pool_now.effective_blocks)}
        now_ns += int(rng.integers(1_000_000, 40_000_000))  # waiting between steps
        meter.observe(now_ns, effective, pool_now.held_blocks, pool_now.idle_cached_blocks)
        latency_s = float(rng.integers(5, 40)) / 1000
        start_s = t0_s + now_ns / 1e9
        now_ns += int(latency_s * 1e9)
        meter.observe(now_ns, effective, pool_now.held_blocks, pool_now.idle_cached_blocks)
        ran = sorted(rng.choice(holding, size=int(rng.integers(1, len(holding) + 1)), replace=False).tolist())
        block_ns, kv = meter.drain(ran)
        for name in ran:
            context[name] += 1
        slices = [(name, tenant_of[name], 1, context[name], False, 0, float(context[name]), 0, ns)
                  for name, ns in zip(ran, block_ns)]
        steps.append(step_rows(header, [step_id, start_s, latency_s, slices,
                                        [kv.interval_ns, kv.idle_cached_block_ns, kv.free_block_ns, kv.carried_in_block_ns,
                                         kv.carried_out_block_ns]]))
    return steps


def kv_per_tenant(steps: list[list[dict]]) -> tuple[dict[str, int], dict[str, int]]:
    """Σ kv_block_ns and Σ kv_block_ns × kv_block_bytes per tenant over the rows: what the ledger must hold."""
    block_ns: dict[str, int] = defaultdict(int)
    byte_ns: dict[str, int] = defaultdict(int)
    for step in steps:
        for row in step:
            block_ns[row["tenant"]] += row["kv_block_ns"]
            byte_ns[row["tenant"]] += row["kv_block_ns"] * row["kv_block_bytes"]
    return dict(block_ns), dict(byte_ns)


def without_kv(steps: list[list[dict]]) -> list[list[dict]]:
    """The same steps as a format-2 trace: no KV columns (billed for time only)."""
    return [[{k: v for k, v in row.items() if k not in KV_COLUMNS} for row in step] for step in steps]


def as_columns(steps: list[list[dict]]) -> dict:
    """A POST /v1/steps body in the column form."""
    rows = [row for step in steps for row in step]
    return {"columns": {name: [row[name] for row in rows] for name in rows[0]}}
