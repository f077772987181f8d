"""Measure the raw-step archive: Parquet (zstd) bytes per step and the writer's CPU per step.

Steps are relayed as the vLLM recorder relays them (`llmvisor.core.relayed`: the recorder's constant columns,
fingerprint, timestamps, sharing columns) at 50 steps/s per engine, batches of B slices (one prefill chunk, the rest
decodes, context growing as a conversation does), into 60 s windows on a local directory; CPU is the process time
of ``add_relayed`` and ``close`` (keeping the slices as columns, building the Arrow table, compressing, writing,
renaming), what the delivery process does. Beside it, in the same run and alternating with it, the earlier path:
the steps' trace rows (`step_rows`, a dict per slice) and ``add_step``; both must write the same files. Writes a JSON
figure file.

    python scripts/measure-archive.py [-o docs/results/archive.json] [--steps 30000]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from llmvisor.archive import ArchiveWriter, read_archive
from llmvisor.core.relayed import step_rows

STEPS_PER_S = 50.0


def relayed_steps(n_steps: int, batch_size: int, seed: int) -> list[list]:
    """Relay-form steps ``[step_id, timestamp_s, step_latency_s, slices]`` of a busy engine (module docstring)."""
    rng = np.random.default_rng(seed)
    t0_s = 1_750_000_020.0
    context = rng.integers(100, 4000, size=batch_size)
    requests = np.arange(batch_size)
    next_request = batch_size
    steps = []
    for step_id in range(n_steps):
        done = rng.random(batch_size) < 0.01  # a request finishes now and then; a new one takes its slot
        for slot in np.flatnonzero(done):
            requests[slot], context[slot] = next_request, 0
            next_request += 1
        slices = []
        for slot in range(batch_size):
            prefill = context[slot] == 0
            new = int(rng.integers(64, 512)) if prefill else 1
            slices.append([f"chatcmpl-{requests[slot]:08d}", f"tenant-{requests[slot] % 20}", new, int(context[slot]), bool(prefill),
                           0, float(context[slot])])
            context[slot] += new
        steps.append([step_id, t0_s + step_id / STEPS_PER_S, float(rng.uniform(0.01, 0.05)), slices])
    return steps


def _write(steps: list[list], header: dict, window_s: float, *, relayed: bool) -> tuple[float, dict[str, bytes], int]:
    """One path's CPU seconds, the files it wrote (relative name → bytes) and its file count."""
    with tempfile.TemporaryDirectory() as directory:
        writer = ArchiveWriter(directory, window_s=window_s, metadata={"engine_fingerprint": {"id": "5d41402abc4b2a76"}})
        cpu_s = time.process_time()
        if relayed:
            for step in steps:
                writer.add_relayed(header, step)
        else:
            for step in steps:
                writer.add_step(step_rows(header, step))
        assert writer.close()
        cpu_s = time.process_time() - cpu_s
        files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(Path(directory).rglob("*.parquet"))}
        assert read_archive(directory).n_steps == len(steps)
    return cpu_s, files, writer.stats.files_written


def measure(n_steps: int, batch_size: int, window_s: float, rounds: int = 3) -> dict:
    header = {
        "columns": {"run_id": "engine-0-3f2a9c", "engine": "vllm", "engine_version": "0.11.0", "model": "llama-3.1-8b",
                    "hardware": "NVIDIA H100 80GB HBM3", "tensor_parallel_size": 1, "engine_fingerprint": "5d41402abc4b2a76"},
        "warmup_steps": 20,
    }
    steps = relayed_steps(n_steps, batch_size, seed=batch_size)
    cpu = {True: [], False: []}
    for _ in range(rounds):  # alternating, best of each: the machine is shared
        for relayed in (True, False):
            cpu_s, files, n_files = _write(steps, header, window_s, relayed=relayed)
            cpu[relayed].append(cpu_s)
            if relayed:
                written = files
            elif files != written:
                raise SystemExit(f"B = {batch_size}: the relayed path and the rows path wrote different files")
    on_disk = sum(len(data) for data in written.values())
    return {
        "batch_size": batch_size, "steps": n_steps, "window_s": window_s, "files": n_files,
        "archive_bytes_per_step": round(on_disk / n_steps, 1), "archive_bytes_per_slice": round(on_disk / n_steps / batch_size, 2),
        "writer_cpu_us_per_step": round(min(cpu[True]) / n_steps * 1e6, 1),
        "rows_path_cpu_us_per_step": round(min(cpu[False]) / n_steps * 1e6, 1),
        "same_files": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="docs/results/archive.json")
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--window-s", type=float, default=60.0)
    args = parser.parse_args()
    runs = [measure(args.steps, batch_size, args.window_s) for batch_size in (8, 32)]
    result = {
        "settings": {"steps_per_s": STEPS_PER_S, "window_s": args.window_s, "compression": "zstd", "cpu": "best of 3 alternating runs per path",
                     "python": platform.python_version(), "machine": platform.machine()},
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for run in runs:
        print(f"B = {run['batch_size']}: {run['archive_bytes_per_step']} bytes/step ({run['archive_bytes_per_slice']} per slice), "
              f"writer CPU {run['writer_cpu_us_per_step']} µs/step (rows path {run['rows_path_cpu_us_per_step']}), {run['files']} files")


if __name__ == "__main__":
    main()
