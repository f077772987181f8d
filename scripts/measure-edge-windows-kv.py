"""What KV memory-time adds to window mode, in bytes per step (issue #37: at most 10): the same recorder-shaped steps
as `scripts/measure-edge-windows.py` (50 steps/s, batches of B slices, a request finishing now and then), metered
by the recorder's `KvMeter` (each request holds its context's 16-token blocks, every 8th request's first 4 blocks
shared with the request before it), aggregated into 1 s windows with and without the KV figures. Reports, per step:
the window JSON the delivery process sends (`WindowAggregate.to_json`, as `WindowPusher` encodes it: `window_line`);
the bodies on the wire as the pusher sends them, gzip'd by its own `gzip_body` (request headers not counted), live
(each window in its own POST: one closes a second and the pusher sends what is queued every 0.1 s) and replayed
from its spool after an outage (its own `window_batches`: up to 200 windows a POST); and the ledger columns window
mode stores for it (schema 9: ``kv_block_ns`` and ``kv_block_bytes``, 8 bytes each, on each tenant row of
``tenant_seconds``; the windows table stores no KV). Bytes, not time: the figures do not depend on the machine.
Writes a JSON figure file.

    python scripts/measure-edge-windows-kv.py [-o docs/results/edge-windows-kv.json] [--steps 6000]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
from pathlib import Path

from llmvisor import shipped
from llmvisor.client.push import GZIP_LEVEL, gzip_body
from llmvisor.client.windows import WindowPusher, window_batches, window_line, windows_body
from llmvisor.core.kv_memory import KvMeter
from llmvisor.core.model import StepLatencyModel
from llmvisor.metering import WindowAggregator

HERE = Path(__file__).resolve().parent
BLOCK_TOKENS = 16
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * BLOCK_TOKENS  # an 8B-class model's block: K and V, 32 layers, 8 KV heads, 128, bf16
POOL_BLOCKS = 40_000
KV_COLUMN_BYTES = 16  # kv_block_ns and kv_block_bytes, BIGINT each
GOAL_BYTES_PER_STEP = 10  # issue #37: at most 10 extra bytes per step in the edge windows
PUSHER_DEFAULTS = {name: p.default for name, p in inspect.signature(WindowPusher).parameters.items()}


def relayed_steps(n_steps: int, batch_size: int, seed: int) -> list[list]:
    spec = importlib.util.spec_from_file_location("measure_archive", HERE / "measure-archive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.relayed_steps(n_steps, batch_size, seed)


def metered(steps: list[list]) -> list[list]:
    """The steps with trace format 3's figures, as the recorder relays them."""
    meter = KvMeter(POOL_BLOCKS, 0)
    out = []
    for step_id, timestamp_s, latency_s, slices in steps:
        holders = {}
        for index, s in enumerate(slices):
            blocks = math.ceil((s[3] + s[2]) / BLOCK_TOKENS)
            shared = min(4, blocks) if index % 8 == 1 else 0
            holders[s[0]] = blocks - shared / 2
            if shared:
                holders[slices[index - 1][0]] -= min(shared, holders[slices[index - 1][0]]) / 2
        held = round(sum(holders.values()))
        holders = {r: v * held / sum(holders.values()) for r, v in holders.items()}
        now_ns = round(timestamp_s * 1e9)
        meter.observe(now_ns, holders, held, 0)
        meter.advance(now_ns + round(latency_s * 1e9))
        block_ns, kv = meter.drain([s[0] for s in slices])
        out.append([step_id, timestamp_s, latency_s, [[*s, 0, ns] for s, ns in zip(slices, block_ns)],
                    [kv.interval_ns, kv.idle_cached_block_ns, kv.free_block_ns, kv.carried_in_block_ns, kv.carried_out_block_ns]])
    return out


def windows_of(steps: list[list], model: StepLatencyModel, *, kv: bool) -> list:
    """The steps aggregated into windows, with or without their KV figures."""
    run = {"kv_pool_blocks": POOL_BLOCKS, "kv_block_bytes": BLOCK_BYTES} if kv else {}
    aggregator = WindowAggregator("engine-0-3f2a9c", "5d41402abc4b2a76", lambda: (model, 1), **run)
    windows = []
    for step in steps:
        windows += aggregator.add(*step[:4], step[4] if kv else None)
    windows += aggregator.close()
    assert all((w.kv is not None) == kv for w in windows)
    return windows


def sent_bytes(windows: list) -> dict:
    """Bytes of the windows' JSON, and of the bodies the pusher POSTs for them, gzip'd, live and replayed."""
    lines = [window_line(w) for w in windows]
    replayed = window_batches(lines, max_windows=PUSHER_DEFAULTS["max_batch_windows"], max_bytes=PUSHER_DEFAULTS["max_batch_bytes"])
    return {
        "json": sum(len(line) for line in lines),
        "gzip_live": sum(len(gzip_body(windows_body([line]))) for line in lines),
        "gzip_replayed": sum(len(gzip_body(windows_body([lines[i] for i in batch]))) for batch in replayed),
        "replay_posts": len(replayed),
    }


def per_step(n_bytes: float, n_steps: int) -> float:
    return round(n_bytes / n_steps, 1)


def measure(n_steps: int, batch_size: int, model: StepLatencyModel) -> dict:
    steps = metered(relayed_steps(n_steps, batch_size, seed=batch_size))
    plain_windows = windows_of(steps, model, kv=False)
    plain, with_kv = sent_bytes(plain_windows), sent_bytes(windows_of(steps, model, kv=True))
    tenant_rows = sum(len(w.tenant_totals()) for w in plain_windows)
    out = {"batch_size": batch_size, "steps": n_steps, "windows": len(plain_windows), "replay_posts": plain["replay_posts"]}
    for key, name in (("json", "window_json"), ("gzip_live", "gzip_live"), ("gzip_replayed", "gzip_replayed")):
        out[f"{name}_bytes_per_step"] = per_step(plain[key], n_steps)
        out[f"{name}_bytes_per_step_with_kv"] = per_step(with_kv[key], n_steps)
        out[f"kv_{name}_bytes_per_step"] = per_step(with_kv[key] - plain[key], n_steps)
    out["tenant_rows_per_step"] = round(tenant_rows / n_steps, 2)
    out["kv_ledger_bytes_per_step"] = per_step(KV_COLUMN_BYTES * tenant_rows, n_steps)
    return out


def verdicts(runs: list[dict]) -> dict:
    """Met (every batch size within the goal) or not, for each way of counting the extra bytes."""
    keys = {"stored": "kv_ledger_bytes_per_step", "sent_json": "kv_window_json_bytes_per_step",
            "sent_gzip_live": "kv_gzip_live_bytes_per_step", "sent_gzip_replayed": "kv_gzip_replayed_bytes_per_step"}
    return {name: all(run[key] <= GOAL_BYTES_PER_STEP for run in runs) for name, key in keys.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="docs/results/edge-windows-kv.json")
    parser.add_argument("--steps", type=int, default=6000)
    args = parser.parse_args()
    model = StepLatencyModel.from_json(shipped.latency_model_path())
    runs = [measure(args.steps, batch_size, model) for batch_size in (8, 32)]
    result = {"settings": {"steps_per_s": 50.0, "window_s": 1.0, "block_tokens": BLOCK_TOKENS, "block_bytes": BLOCK_BYTES,
                           "gzip_level": GZIP_LEVEL, "max_batch_windows": PUSHER_DEFAULTS["max_batch_windows"],
                           "goal_bytes_per_step": GOAL_BYTES_PER_STEP, "command": "python scripts/measure-edge-windows-kv.py"},
              "runs": runs, "met": verdicts(runs)}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for run in runs:
        print(f"B = {run['batch_size']}: window JSON {run['window_json_bytes_per_step']} -> {run['window_json_bytes_per_step_with_kv']} "
              f"bytes/step (+{run['kv_window_json_bytes_per_step']}); gzip'd live {run['gzip_live_bytes_per_step']} -> "
              f"{run['gzip_live_bytes_per_step_with_kv']} (+{run['kv_gzip_live_bytes_per_step']}), replayed "
              f"{run['gzip_replayed_bytes_per_step']} -> {run['gzip_replayed_bytes_per_step_with_kv']} "
              f"(+{run['kv_gzip_replayed_bytes_per_step']}); ledger +{run['kv_ledger_bytes_per_step']} bytes/step "
              f"({run['tenant_rows_per_step']} tenant rows per step)")
    print("within 10 bytes per step:", ", ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in result["met"].items()))


if __name__ == "__main__":
    main()
