"""Measure window mode's cost at the edge: attributing and aggregating each step, per step and against step time.

The steps are the archive measurement's recorder-shaped steps (`scripts/measure-archive.py`: 50 steps/s, batches of
B slices, step times uniform in 10–50 ms), fed to the delivery process's `WindowAggregator` with the shipped model
into 1 s windows; each closed window is encoded as the `WindowPusher` sends it, and every step goes to the raw-step
archive (`ArchiveWriter.add_relayed`, 60 s zstd Parquet files on a local directory), as a delivery process in window
mode does. CPU is the process time of all of it (`add`, the attribution and integer rounding when a window closes,
the JSON encoding; the archive's buffering, compressing and writing), divided by the steps, and set against their
mean measured step time; the aggregation's and the archive's parts are reported too. Best of 3 runs. This runs in
the delivery process, not in the engine's step loop. Writes a JSON figure file.

    python scripts/measure-edge-windows.py [-o docs/results/edge-windows.json] [--steps 30000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.archive import ArchiveWriter
from llmvisor.core.model import StepLatencyModel
from llmvisor.metering import WindowAggregator

HERE = Path(__file__).resolve().parent


def relayed_steps(n_steps: int, batch_size: int, seed: int) -> list[list]:
    spec = importlib.util.spec_from_file_location("measure_archive", HERE / "measure-archive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.relayed_steps(n_steps, batch_size, seed)


def _once(steps: list[list], window_s: float, model: StepLatencyModel, directory: str) -> tuple[float, float, int, int]:
    header = {"columns": {"run_id": "engine-0-3f2a9c", "engine_fingerprint": "5d41402abc4b2a76"}, "warmup_steps": 0}
    aggregator = WindowAggregator("engine-0-3f2a9c", "5d41402abc4b2a76", lambda: (model, 1), window_s=window_s)
    archive = ArchiveWriter(directory, metadata={"engine_fingerprint": {"id": "5d41402abc4b2a76"}})
    encoded_bytes, windows = 0, 0
    aggregate_s = archive_s = 0.0
    for step in steps:
        started = time.process_time()
        for window in aggregator.add(*step):
            encoded_bytes += len(json.dumps(window.to_json()))
            windows += 1
        middle = time.process_time()
        archive.add_relayed(header, step)
        archive_s += time.process_time() - middle
        aggregate_s += middle - started
    started = time.process_time()
    for window in aggregator.close():
        encoded_bytes += len(json.dumps(window.to_json()))
        windows += 1
    middle = time.process_time()
    assert archive.close()
    archive_s += time.process_time() - middle
    aggregate_s += middle - started
    return aggregate_s, archive_s, windows, encoded_bytes


def measure(n_steps: int, batch_size: int, window_s: float, model: StepLatencyModel, rounds: int = 3) -> dict:
    steps = relayed_steps(n_steps, batch_size, seed=batch_size)
    runs = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as directory:
            runs.append(_once(steps, window_s, model, directory))
    aggregate_s, archive_s, windows, encoded_bytes = min(runs, key=lambda r: r[0] + r[1])
    step_s = float(np.mean([s[2] for s in steps]))
    per_step_s = (aggregate_s + archive_s) / n_steps
    return {
        "batch_size": batch_size, "steps": n_steps, "windows": windows, "window_bytes": round(encoded_bytes / windows),
        "edge_cpu_us_per_step": round(per_step_s * 1e6, 1),
        "aggregation_us_per_step": round(aggregate_s / n_steps * 1e6, 1), "archive_us_per_step": round(archive_s / n_steps * 1e6, 1),
        "mean_step_ms": round(step_s * 1e3, 1), "fraction_of_step_time_percent": round(100 * per_step_s / step_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="docs/results/edge-windows.json")
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--window-s", type=float, default=1.0)
    args = parser.parse_args()
    model = StepLatencyModel.from_json(shipped.latency_model_path())
    runs = [measure(args.steps, batch_size, args.window_s, model) for batch_size in (8, 32)]
    result = {
        "settings": {"steps_per_s": 50.0, "window_s": args.window_s, "archive_window_s": 60.0, "cpu": "best of 3 runs", "python": platform.python_version(), "machine": platform.machine()},
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for run in runs:
        print(f"B = {run['batch_size']}: {run['edge_cpu_us_per_step']} µs/step of edge CPU ({run['aggregation_us_per_step']} aggregation, "
              f"{run['archive_us_per_step']} archive), {run['fraction_of_step_time_percent']}% of "
              f"a {run['mean_step_ms']} ms step; {run['windows']} windows of {run['window_bytes']} bytes")


if __name__ == "__main__":
    main()
