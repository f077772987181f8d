"""The engines of ``llmvisor load --engines N --mode aggregate``: window aggregates made at the edge.

Each simulated engine runs B request slots at a fixed step rate. A slot's requests take their prompt and output
lengths from a shipped request-length mix (Azure conversation by default): one prefill step of the prompt, then
one decode step per further output token, then the next request; slot 0 holds one request for the whole run
(the staleness probe counts its steps). Every step goes through the engine-side code a delivery process runs:
the real `llmvisor.metering.WindowAggregator` (attributed with a model version registered in the ledger, closing a
window when a step of the next one arrives, the last one at the run's end) and the real
`llmvisor.archive.ArchiveWriter`, fed the relayed steps as `StepDelivery` feeds it.

That code costs far more CPU per step than this machine has for a thousand engines in real time, so the engines
are built before the timed run (`build_engine`, in worker processes), and the run replays each window's POST at
the moment its engine would close it, on the run's clock (`EdgeEngine.close_s` is relative to the run's start).
The engine-side CPU per step (aggregation, archive write) is measured while building, with the same code, and
reported beside the service's. The windows and archive rows are dated on the build's clock (``base_s``), so an
audit of the run reads the archive and ledger in that period.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from llmvisor import shipped
from llmvisor.archive import ArchiveWriter
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.workloads import read_workload_csv
from llmvisor.metering import WindowAggregator

ENGINE_CLASS = "f1ee7000000000aa"
"""The engine class (fingerprint id) of the simulated engines; load registers a model version for it."""
LONG_REQUEST = "long"
DEFAULT_WORKLOAD = "azure-2023-conv.csv"
MAX_CONTEXT_TOKENS = 16_384
"""Prompts longer than this are cut to it (an engine's context limit)."""


@dataclass(frozen=True)
class EdgeSpec:
    """One simulated engine: its index, steps and where its archive goes."""

    index: int
    tag: str
    steps_per_s: float
    batch_size: int
    n_tenants: int
    window_s: float
    duration_s: float
    base_s: float
    """The build clock's time of the run's start: steps are dated ``base_s + offset_s + k / steps_per_s``."""
    archive_url: str | None
    offset_s: float = 0.0


@dataclass
class EdgeWindow:
    close_s: float
    """When the engine closes it, in seconds from the run's start: the end of the step that closes it."""
    body: bytes
    """The window's JSON (`WindowAggregate.to_json`)."""
    num_steps: int
    last_step_id: int


@dataclass
class EdgeEngine:
    run_id: str
    start_s: float
    """Its first step's start, in seconds from the run's start."""
    steps_per_s: float
    num_steps: int
    windows: list[EdgeWindow]
    aggregate_cpu_s: float
    archive_cpu_s: float
    archive_bytes: int
    archive_files: int
    finished_requests: int
    distinct_tenants_per_window: float
    aggregate_requests_per_window: float = field(default=0.0)

    def ended_by(self, since_start_s: float) -> int:
        """Steps ended ``since_start_s`` seconds after the run's start."""
        return min(self.num_steps, max(0, int((since_start_s - self.start_s) * self.steps_per_s)))

    def step_end_s(self, step: int) -> float:
        return self.start_s + (step + 1) / self.steps_per_s


_MODEL: tuple[StepLatencyModel, int] | None = None
_WORKLOAD: np.ndarray | None = None


def _init_worker(model_dict: dict, version: int, workload_path: str) -> None:
    global _MODEL, _WORKLOAD
    _MODEL = (StepLatencyModel.from_dict(model_dict), version)
    rows = read_workload_csv(workload_path)
    _WORKLOAD = np.asarray([(min(r.prompt_len, MAX_CONTEXT_TOKENS), r.output_len) for r in rows], dtype=np.int64)


def run_id_of(tag: str, index: int) -> str:
    return f"fleet-{tag}-{index:05d}"


def build_engine(spec: EdgeSpec) -> EdgeEngine:
    """Run one engine's steps through the aggregator and the archive writer (module docstring)."""
    assert _MODEL is not None and _WORKLOAD is not None, "call _init_worker first"
    rng = np.random.default_rng([spec.index, 22])
    run_id = run_id_of(spec.tag, spec.index)
    b, rate = spec.batch_size, spec.steps_per_s
    n_steps = max(0, int((spec.duration_s - spec.offset_s) * rate))
    header = {"columns": {"run_id": run_id, FINGERPRINT_COLUMN: ENGINE_CLASS}, "warmup_steps": 0}
    aggregator = WindowAggregator(run_id, ENGINE_CLASS, lambda: _MODEL, window_s=spec.window_s)
    archive = (ArchiveWriter(spec.archive_url, metadata={"engine_fingerprint": {"id": ENGINE_CLASS}}, clock=lambda: spec.base_s)
               if spec.archive_url else None)
    # slot state: request id, tenant, decode steps left, context tokens, prompt tokens of a prefill still to run
    requests = [""] * b
    tenants = [""] * b
    left = [0] * b
    context = [0] * b
    prefill = [0] * b
    serial = [0] * b
    finished = 0
    long_tenant = f"tenant-{spec.index % spec.n_tenants}"
    requests[0], tenants[0], context[0], left[0] = LONG_REQUEST, long_tenant, 512, 1 << 62
    windows: list[EdgeWindow] = []
    aggregate_cpu = archive_cpu = 0.0
    tenants_seen = requests_seen = 0

    def keep(closed, close_s: float) -> None:
        nonlocal tenants_seen, requests_seen
        for w in closed:
            tenants_seen += len({q.tenant for q in w.requests})
            requests_seen += len(w.requests)
            windows.append(EdgeWindow(close_s, json.dumps(w.to_json(), separators=(",", ":")).encode(), w.num_steps, w.step_ranges[-1][1]))

    for k in range(n_steps):
        slices = []
        prefill_tokens = 0
        for s in range(b):
            if left[s] <= 0 and prefill[s] == 0:
                if requests[s] and s:
                    finished += 1
                prompt, output = _WORKLOAD[int(rng.integers(len(_WORKLOAD)))]
                serial[s] += 1
                requests[s] = f"{run_id}-r{s}-{serial[s]}"
                tenants[s] = f"tenant-{int(rng.integers(spec.n_tenants))}"
                prefill[s], left[s], context[s] = int(prompt), int(output) - 1, 0
            if prefill[s]:
                new, is_prefill = prefill[s], True
                prefill_tokens += new
                context[s] += new
                prefill[s] = 0
            else:
                new, is_prefill = 1, False
                context[s] += 1
                left[s] -= 1
            slices.append([requests[s], tenants[s], new, context[s], is_prefill, 0, None])
        latency_s = round(0.012 + 1.5e-7 * sum(context) / b + 2e-7 * prefill_tokens, 6)
        timestamp_s = round(spec.base_s + spec.offset_s + k / rate, 6)
        step = [k, timestamp_s, latency_s, slices]
        end_s = spec.offset_s + (k + 1) / rate
        started = time.process_time()
        closed = aggregator.add(*step)
        aggregate_cpu += time.process_time() - started
        keep(closed, end_s)
        if archive is not None:
            started = time.process_time()
            archive.add_relayed(header, step)
            archive_cpu += time.process_time() - started
    started = time.process_time()
    closed = aggregator.close()
    aggregate_cpu += time.process_time() - started
    keep(closed, spec.duration_s)
    archive_bytes = archive_files = 0
    if archive is not None:
        started = time.process_time()
        if not archive.close():
            raise RuntimeError(f"{run_id}: the archive {spec.archive_url} did not take every step")
        archive_cpu += time.process_time() - started
        archive_bytes, archive_files = archive.stats.bytes_written, archive.stats.files_written
    return EdgeEngine(
        run_id=run_id, start_s=spec.offset_s, steps_per_s=rate, num_steps=n_steps, windows=windows,
        aggregate_cpu_s=aggregate_cpu, archive_cpu_s=archive_cpu, archive_bytes=archive_bytes, archive_files=archive_files,
        finished_requests=finished, distinct_tenants_per_window=tenants_seen / max(1, len(windows)),
        aggregate_requests_per_window=requests_seen / max(1, len(windows)),
    )


def build_engines(specs: list[EdgeSpec], model: StepLatencyModel, version: int, *, workers: int | None = None,
                  workload_path: str | None = None) -> list[EdgeEngine]:
    """`build_engine` for each spec, in ``workers`` processes (default: the machine's CPUs, at most 8)."""
    workload = workload_path or str(shipped.workloads_dir() / DEFAULT_WORKLOAD)
    workers = workers or min(8, os.cpu_count() or 1)
    if workers <= 1 or len(specs) <= 2:
        _init_worker(model.to_dict(), version, workload)
        return [build_engine(spec) for spec in specs]
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(model.to_dict(), version, workload)) as pool:
        return list(pool.map(build_engine, specs, chunksize=max(1, len(specs) // (4 * workers))))
