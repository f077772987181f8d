"""A simulated fleet of engines pushing steps into M service processes: ``llmvisor load --engines N``.

Each simulated engine runs steps at a fixed rate and, like an engine's pusher, POSTs every ``flush_interval_s``
the steps that ended since its last POST (in the JSON column form `StepPusher` sends), one POST in flight at a
time: when the service is slow, the next POST carries the steps that piled up meanwhile, so a saturated
service shows as larger batches, later usage and, past a point, steps still waiting when the run ends. Engines
are spread over the processes as a load balancer with long-lived connections would spread them.

Measured per run: accepted steps/s (acknowledged by the service), the POST round trip (ingest latency, p50/p99
and max), staleness (from a step's end until the usage API counts it, sampled by a probe polling
``GET /v1/usage/requests`` for one long-running request of an engine), the CPU seconds the service processes
spent per accepted step, and on PostgreSQL the WAL and table bytes written per step. All on loopback, bounded
in engines and seconds; the load generator shares the machine with what it measures.

``mode="aggregate"``: each engine instead sends one window aggregate per ``window_s`` (`llmvisor.service.fleet_edge`:
built before the run by the real aggregator and archive writer, POSTed to ``/v1/windows`` when the engine would close
it), and the run reports the steps its accepted windows cover, the windows' lateness, the archive's bytes and the
engine-side CPU per step besides the same service figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import quantile_summary
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.config import ENV_REQUEST_TOTALS
from llmvisor.service.fleet_edge import DEFAULT_WORKLOAD, ENGINE_CLASS, EdgeEngine, EdgeSpec, build_engines
from llmvisor.service.process import ServerProcess
from llmvisor.service.routes.windows import HELD_PATH, WINDOWS_PATH

MAX_ENGINES = 5000
MAX_PROCESSES = 16
LONG_REQUEST_SLOT = 0
"""The request in this slot of every engine's batch runs for the whole run: the staleness probe counts its steps."""
STEPS_PER_REQUEST = 200
PROBE_POLL_S = 0.02
PROBE_TIMEOUT_S = 30.0
POST_TIMEOUT_S = 60.0
LEDGER_TABLES = ("steps", "slice_batches", "usage_per_second", "windows", "tenant_seconds", "request_totals", "step_ranges")
MODES = ("steps", "aggregate")
MAX_WINDOWS_PER_POST = 200
"""At most this many windows in one POST, as the engines' `llmvisor.client.windows.WindowPusher` sends (max_batch_windows)."""
LATE_AFTER_CLOSE_S = 1.0
"""A window acknowledged more than this after its engine closed it is late (staleness goal: window + 1 s)."""


@dataclass(frozen=True)
class FleetSettings:
    engines: int
    processes: int
    steps_per_s_per_engine: float = 50.0
    batch_size: int = 8
    flush_interval_s: float = 0.2
    max_batch_steps: int = 500
    duration_s: float = 20.0
    warmup_s: float = 5.0
    """Not measured: the first POSTs of a large fleet all arrive at once."""
    n_tenants: int = 16
    probe_interval_s: float = 0.25
    mode: str = "steps"
    """'steps' (every step POSTed to /v1/steps) or 'aggregate' (one window aggregate per window_s, /v1/windows)."""
    window_s: float | None = None
    request_totals: bool = True
    """Whether the service processes keep a row per request of window aggregates (``LLMVISOR_REQUEST_TOTALS``)."""
    """Aggregate mode's window (default 1 s, as the engines' delivery uses); None in steps mode."""


@dataclass
class FleetResult:
    settings: dict
    database: str
    offered_steps_per_s: float
    accepted_steps_per_s: float
    """Steps acknowledged per second of the measured period (in aggregate mode: covered by acknowledged windows)."""
    steps_covered_per_s: float
    """Steps/s stored by the service: as acknowledged POSTs of steps, or covered by acknowledged windows."""
    steps_acknowledged: int
    steps_unsent_at_end: int
    posts: int
    failed_posts: int
    failed_posts_by_status: dict
    """HTTP status of the failed POSTs ("0": no answer: connection error or no answer within a minute)."""
    mean_steps_per_post: float
    ingest_latency_s: dict
    staleness_s: dict
    staleness_probes_timed_out: int
    service_cpu_s_per_step: float | None
    generator_cpu_s_per_step: float
    postgres_per_step: dict | None
    """Per acknowledged step: WAL bytes, growth of each ledger table in bytes (``table_bytes`` their sum),
    PostgreSQL CPU seconds."""
    reconciled: bool
    measured_s: float = field(default=0.0)
    """Length of the measured period (the run less its warm-up)."""
    load_average_1min: list[float] = field(default_factory=list)
    """The machine's 1-minute load average before and after the run: what else was running."""
    load_average_1min_max: float | None = None
    """The highest 1-minute load average sampled (once a second) during the run."""
    archive_bytes_per_step: float | None = None
    """Aggregate mode: bytes of the raw-step archive's Parquet files per step; None in steps mode (no archive)."""
    aggregate: dict | None = None
    """Aggregate mode only: windows, lateness, coverage, engine-side CPU and the archive (`load_fleet`)."""

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        s = self.settings
        lat, stale = self.ingest_latency_s, self.staleness_s
        covered = (f"covered {self.steps_covered_per_s:,.0f} steps/s in {self.aggregate['accepted_windows_per_s']:,.0f} windows/s "
                   f"({self.aggregate['steps_uncovered_at_end']} steps uncovered, {self.aggregate['steps_late']} late)"
                   if self.aggregate else f"accepted {self.accepted_steps_per_s:,.0f}")
        return (
            f"{s['engines']} engines x {s['steps_per_s_per_engine']:g} steps/s into {s['processes']} processes ({self.database}, "
            f"{s['mode']} mode): offered {self.offered_steps_per_s:,.0f} steps/s, {covered}; "
            f"ingest p50 {1e3 * lat['p50']:.1f} ms, p99 {1e3 * lat['p99']:.1f} ms; "
            f"staleness p50 {stale['p50']:.2f} s, p99 {stale['p99']:.2f} s; "
            f"{self.mean_steps_per_post:.1f} steps per POST, {self.failed_posts} failed POSTs, "
            f"{self.steps_unsent_at_end} steps unsent at the end; "
            + ("totals reconcile" if self.reconciled else "TOTALS DO NOT RECONCILE")
        )


def quantiles(values: list[float]) -> dict:
    return quantile_summary(values, (50, 99), maximum=True, empty=float("nan"))


class SimulatedEngine:
    """One engine's steps as JSON-column fragments, pre-rendered so the generator's cost per step stays small."""

    def __init__(self, index: int, tag: str, settings: FleetSettings, start_s: float, rng: np.random.Generator):
        self.run_id = f"fleet-{tag}-{index:05d}"
        self.rate = settings.steps_per_s_per_engine
        self.start_s = start_s
        self.batch_size = b = settings.batch_size
        self.tenants = ",".join(f'"tenant-{(index + slot) % settings.n_tenants}"' for slot in range(b))
        self.run_ids = ",".join([f'"{self.run_id}"'] * b)
        context = rng.integers(64, 4096, size=(16, b))
        self.context = [",".join(map(str, row)) for row in context]
        self.latency = [f"{0.012 + 2e-7 * float(row.mean()):.6f}" for row in context]
        self.prefill_latency = [f"{0.042 + 2e-7 * float(row.mean()):.6f}" for row in context]
        decode_phase, prefill_phase = ['"decode"'] * b, ['"decode"'] * b
        prefill_phase[-1] = '"prefill"'
        self.phases = (",".join(decode_phase), ",".join(prefill_phase))
        self.new_tokens = (",".join(["1"] * b), ",".join(["1"] * (b - 1) + ["256"]))
        self.sent = 0

    def ended_by(self, now_s: float) -> int:
        """How many of this engine's steps have ended by ``now_s``."""
        return max(0, int((now_s - self.start_s) * self.rate))

    def step_end_s(self, step: int) -> float:
        return self.start_s + (step + 1) / self.rate

    def request_ids(self, step: int) -> str:
        epoch = step // STEPS_PER_REQUEST
        return ",".join('"long"' if slot == LONG_REQUEST_SLOT else f'"r{slot}-{epoch}"' for slot in range(self.batch_size))

    def body(self, first: int, count: int) -> bytes:
        b = self.batch_size
        steps = range(first, first + count)
        columns = {
            "run_id": [self.run_ids] * count,
            "step_id": [",".join([str(k)] * b) for k in steps],
            "step_latency_s": [",".join([(self.prefill_latency if k % 10 == 0 else self.latency)[k % 16]] * b) for k in steps],
            "request_id": [self.request_ids(k) for k in steps],
            "tenant": [self.tenants] * count,
            "num_new_tokens": [self.new_tokens[k % 10 == 0] for k in steps],
            "num_context_tokens": [self.context[k % 16] for k in steps],
            "phase": [self.phases[k % 10 == 0] for k in steps],
            "timestamp_s": [",".join([f"{self.start_s + k / self.rate:.6f}"] * b) for k in steps],
        }
        inner = ",".join(f'"{name}":[{",".join(parts)}]' for name, parts in columns.items())
        return ('{"columns":{' + inner + "}}").encode()


class PushConnection:
    """One engine's keep-alive HTTP/1.1 connection for its POSTs, written by hand over asyncio streams: a
    general client costs more CPU per request than the service spends on a small batch, and the generator
    shares the machine with the processes it measures."""

    def __init__(self, url: str, api_key: str, path: str = "/v1/steps"):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {api_key}\r\n"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> int:
        """The response's status code; the connection is dropped (and reopened next time) on any error."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
            await self.writer.drain()
            status = int((await self.reader.readline()).split()[1])
            length = 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await self.reader.readexactly(length)
            return status
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            await self.close()
            return 0

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def cpu_seconds(pid: int, *, with_reaped_children: bool = False) -> float | None:
    """User + system CPU seconds of a process so far (psutil), None where unavailable."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    seconds = times.user + times.system
    if with_reaped_children:
        seconds += times.children_user + times.children_system
    return seconds


def postgres_cpu_seconds(postmaster_pid: int) -> float | None:
    """CPU seconds of a local PostgreSQL server: the postmaster (with its exited backends) and its live children."""
    total = cpu_seconds(postmaster_pid, with_reaped_children=True)
    if total is None:
        return None
    try:
        children = psutil.Process(postmaster_pid).children()
    except psutil.Error:
        return total
    return total + sum(cpu_seconds(child.pid) or 0.0 for child in children)


def postgres_counters(ledger: Ledger) -> dict | None:
    """WAL position, the ledger tables' sizes (bytes, to turn into bytes per step) and, for a server on this
    machine, its CPU seconds; None unless PostgreSQL allows reading them."""
    if ledger.backend != "postgresql":
        return None
    engine = create_engine(ledger.url)
    try:
        with engine.connect() as conn:
            wal = conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar()
            sizes = {name: conn.execute(text(f"SELECT pg_total_relation_size('{name}')")).scalar() for name in LEDGER_TABLES}
            backend_pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
            try:  # while this backend lives: its parent is the postmaster
                cpu_s = postgres_cpu_seconds(psutil.Process(int(backend_pid)).ppid())
            except psutil.Error:  # not a server on this machine
                cpu_s = None
    except DBAPIError:  # a role without the rights to read WAL positions: the figure is left out
        return None
    finally:
        engine.dispose()
    return {"wal_bytes": int(wal), **{f"{name}_bytes": int(size) for name, size in sizes.items()}, "cpu_s": cpu_s}


async def sample_load(end_s: float, out: list[float]) -> None:
    """The 1-minute load average once a second until ``end_s``."""
    while time.time() < end_s:
        out.append(os.getloadavg()[0])
        await asyncio.sleep(min(1.0, max(0.0, end_s - time.time())))


async def probe_staleness(engines: list, clients: list[httpx.AsyncClient], *, request_id: str | None, start_s: float, end_s: float,
                          interval_s: float, clock_s: float, staleness: list[float], counts: dict,
                          pushed_all: asyncio.Event | None = None) -> None:
    """Every ``interval_s`` from ``start_s`` to ``end_s``, the latest ended step of one engine (its ``request_id``; None:
    of the run): how long until the usage API of another process than the engine's counts it (for a run's step: until
    the run's held ranges, stored with the window's tenant usage, list it), appended to ``staleness``
    (``counts["probe_timeouts"]`` when it never does). Probes overlap, so a slow one does not thin the samples.
    The engines' ``ended_by`` and ``step_end_s`` count seconds from ``clock_s`` (0: wall-clock times).
    ``pushed_all``: set when the engines stopped pushing; a probed step its engine never sent (``engine.sent`` not past
    it: it ended in the last flush interval before the end) then has no staleness and is no timeout
    (``counts["probes_unsent"]``)."""

    async def probe_once(engine, client: httpx.AsyncClient, step: int) -> None:
        params = {"run_id": engine.run_id, "request_id": request_id} if request_id else {"run_id": engine.run_id, "from_step_id": step}
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            if pushed_all is not None and pushed_all.is_set() and engine.sent <= step:
                counts["probes_unsent"] = counts.get("probes_unsent", 0) + 1
                return
            try:
                if request_id:
                    response = await client.get("/v1/usage/requests", params=params)
                    requests = response.json()["requests"] if response.status_code == 200 else []
                    counted = bool(requests) and requests[0]["num_steps"] >= step + 1
                else:  # the run's held step ids: a window is held in the transaction that stores its tenants' usage
                    response = await client.get(HELD_PATH, params=params)
                    ranges = response.json()["step_ranges"] if response.status_code == 200 else []
                    counted = bool(ranges) and ranges[0][0] == step
                if counted:
                    staleness.append(time.time() - (clock_s + engine.step_end_s(step)))
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(PROBE_POLL_S)
        counts["probe_timeouts"] += 1

    probes = []
    next_probe_s = start_s
    while time.time() < end_s:
        await asyncio.sleep(max(0.0, next_probe_s - time.time()))
        now = time.time()
        index = len(probes)
        next_probe_s += interval_s
        engine = engines[index % len(engines)]
        step = engine.ended_by(now - clock_s) - 1
        if step >= 0 and now < end_s:
            client = clients[(index % len(engines) + 1) % len(clients)]
            probes.append(asyncio.create_task(probe_once(engine, client, step)))
    await asyncio.gather(*probes)


async def run_fleet(urls: list[str], api_key: str, settings: FleetSettings) -> dict:
    """Drive the engines against the service processes at ``urls``; the raw figures of one run."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    clients = [httpx.AsyncClient(base_url=url, headers=headers, timeout=60.0) for url in urls]
    rng = np.random.default_rng(0)
    tag = uuid.uuid4().hex[:8]
    warmup = SimulatedEngine(0, f"{tag}w", settings, time.time(), rng)
    for client in clients:  # the first batch a process takes pays its imports and first connections
        response = await client.post("/v1/steps", content=warmup.body(warmup.sent, 10))
        if response.status_code != 200:
            raise LlmvisorError(f"{client.base_url}: warm-up batch answered {response.status_code}: {response.text[:300]}")
        warmup.sent += 10
    warmup_steps = warmup.sent
    t0 = time.time() + 0.5
    engines = [
        SimulatedEngine(e, tag, settings, t0 + float(rng.uniform(0, settings.flush_interval_s)), rng)
        for e in range(settings.engines)
    ]
    window_start_s = t0 + settings.warmup_s
    end_s = t0 + settings.duration_s
    latencies: list[float] = []
    failed_by_status: dict[str, int] = {}
    staleness: list[float] = []
    counts = {"acknowledged": 0, "in_window": 0, "posts": 0, "failed": 0, "failed_steps": 0, "probe_timeouts": 0}

    async def push(engine: SimulatedEngine, url: str) -> None:
        connection = PushConnection(url, api_key)
        next_post_s = engine.start_s + settings.flush_interval_s
        while True:
            now = time.time()
            if now >= end_s:
                await connection.close()
                return
            if now < next_post_s:
                await asyncio.sleep(min(next_post_s, end_s) - now)
                continue
            next_post_s = now + settings.flush_interval_s
            count = min(engine.ended_by(now), engine.sent + settings.max_batch_steps) - engine.sent
            if count <= 0:
                continue
            content = engine.body(engine.sent, count)
            started = time.perf_counter()
            try:
                status = await asyncio.wait_for(connection.post(content), POST_TIMEOUT_S)
            except TimeoutError:
                await connection.close()
                status = 0
            ok = status == 200
            if not ok:
                failed_by_status[str(status)] = failed_by_status.get(str(status), 0) + 1
            done_s = time.time()
            counts["posts"] += 1
            if not ok:
                counts["failed"] += 1
                counts["failed_steps"] += count
                continue
            engine.sent += count
            counts["acknowledged"] += count
            if window_start_s <= done_s < end_s:
                counts["in_window"] += count
                latencies.append(time.perf_counter() - started)

    loads: list[float] = []
    pushed_all = asyncio.Event()

    async def push_all() -> None:
        await asyncio.gather(*(push(engine, urls[e % len(urls)]) for e, engine in enumerate(engines)))
        pushed_all.set()

    try:
        await asyncio.gather(
            probe_staleness(engines, clients, request_id="long", start_s=window_start_s, end_s=end_s, interval_s=settings.probe_interval_s,
                            clock_s=0.0, staleness=staleness, counts=counts, pushed_all=pushed_all),
            sample_load(end_s, loads), push_all())
    finally:
        for client in clients:
            await client.aclose()
    ended_at_end = sum(engine.ended_by(end_s) for engine in engines)
    return {
        "window_s": end_s - window_start_s,
        "warmup_steps": warmup_steps,
        "acknowledged": counts["acknowledged"],
        "in_window": counts["in_window"],
        "posts": counts["posts"],
        "failed": counts["failed"],
        "failed_steps": counts["failed_steps"],
        "failed_by_status": failed_by_status,
        "unsent": ended_at_end - counts["acknowledged"],
        "latencies": latencies,
        "staleness": staleness,
        "probe_timeouts": counts["probe_timeouts"],
        "load_max": max(loads, default=None),
    }


async def run_fleet_windows(urls: list[str], api_key: str, settings: FleetSettings, engines: list[EdgeEngine],
                            warmup: EdgeEngine) -> dict:
    """Replay the built engines' windows against the service processes at ``urls``, each POSTed (one POST in flight
    per engine, carrying every window due) when its engine closes it on the run's clock; the raw figures."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    clients = [httpx.AsyncClient(base_url=url, headers=headers, timeout=60.0) for url in urls]
    for client, window in zip(clients, warmup.windows):  # a process's first POST pays its imports and connections
        response = await client.post(WINDOWS_PATH, content=b'{"windows":[' + window.body + b"]}")
        if response.status_code != 200:
            raise LlmvisorError(f"{client.base_url}: warm-up window answered {response.status_code}: {response.text[:300]}")
    warmup_steps = sum(w.num_steps for w in warmup.windows[: len(clients)])
    t0 = time.time() + 0.5
    window_start_s, end_s = t0 + settings.warmup_s, t0 + settings.duration_s
    drain_end_s = end_s + max(10.0, 2 * (settings.window_s or 1.0))
    latencies: list[float] = []
    failed_by_status: dict[str, int] = {}
    staleness: list[float] = []
    covered = [-1] * len(engines)  # per engine: the last step id covered by an acknowledged window
    counts = {"acknowledged": 0, "windows": 0, "in_window": 0, "windows_in_window": 0, "posts": 0, "failed": 0,
              "failed_steps": 0, "late_windows": 0, "late_steps": 0, "probe_timeouts": 0}

    async def push(e: int, engine: EdgeEngine, url: str) -> None:
        connection = PushConnection(url, api_key, WINDOWS_PATH)
        sent = 0
        while sent < len(engine.windows):
            now = time.time()
            if now >= drain_end_s:
                break
            due_s = t0 + engine.windows[sent].close_s
            if now < due_s:
                await asyncio.sleep(due_s - now)
                continue
            due = [w for w in engine.windows[sent : sent + MAX_WINDOWS_PER_POST] if t0 + w.close_s <= now]
            content = b'{"windows":[' + b",".join(w.body for w in due) + b"]}"
            started = time.perf_counter()
            try:
                status = await asyncio.wait_for(connection.post(content), POST_TIMEOUT_S)
            except TimeoutError:
                await connection.close()
                status = 0
            done_s = time.time()
            counts["posts"] += 1
            n_steps = sum(w.num_steps for w in due)
            if status != 200:
                failed_by_status[str(status)] = failed_by_status.get(str(status), 0) + 1
                counts["failed"] += 1
                counts["failed_steps"] += n_steps
                await asyncio.sleep(0.2)
                continue
            sent += len(due)
            covered[e] = due[-1].last_step_id
            counts["acknowledged"] += n_steps
            counts["windows"] += len(due)
            for w in due:
                if done_s - (t0 + w.close_s) > LATE_AFTER_CLOSE_S:
                    counts["late_windows"] += 1
                    counts["late_steps"] += w.num_steps
            if window_start_s <= done_s < end_s:
                counts["in_window"] += n_steps
                counts["windows_in_window"] += len(due)
                latencies.append(time.perf_counter() - started)
        await connection.close()

    loads: list[float] = []
    try:
        await asyncio.gather(
            probe_staleness(engines, clients, request_id=None, start_s=window_start_s, end_s=end_s,
                            interval_s=settings.probe_interval_s, clock_s=t0, staleness=staleness, counts=counts),
            sample_load(end_s, loads), *(push(e, engine, urls[e % len(urls)]) for e, engine in enumerate(engines)))
    finally:
        for client in clients:
            await client.aclose()
    offered = sum(engine.num_steps for engine in engines)
    return {
        "measured_s": end_s - window_start_s, "warmup_steps": warmup_steps, "offered": offered,
        "acknowledged": counts["acknowledged"], "in_window": counts["in_window"], "windows": counts["windows"],
        "windows_in_window": counts["windows_in_window"], "posts": counts["posts"], "failed": counts["failed"],
        "failed_steps": counts["failed_steps"], "failed_by_status": failed_by_status,
        "uncovered": sum(engine.num_steps - 1 - last for engine, last in zip(engines, covered)),
        "late_windows": counts["late_windows"], "late_steps": counts["late_steps"], "latencies": latencies,
        "staleness": staleness, "probe_timeouts": counts["probe_timeouts"], "load_max": max(loads, default=None),
    }


def load_fleet(db_target: str, settings: FleetSettings, *, model_path: Path | None = None, archive_url: str | None = None,
               workers: int | None = None) -> FleetResult:
    """Start ``settings.processes`` service processes on one ledger ('sqlite' for a temporary file, or the URL
    of a scratch database, where the run's steps are stored) and drive ``settings.engines`` engines into them.
    Aggregate mode: the engines' raw steps go to the archive at ``archive_url`` (default: a temporary directory),
    built in ``workers`` processes."""
    if not 1 <= settings.engines <= MAX_ENGINES:
        raise LlmvisorError(f"--engines {settings.engines}: choose 1 to {MAX_ENGINES}")
    if not 1 <= settings.processes <= MAX_PROCESSES:
        raise LlmvisorError(f"--processes {settings.processes}: choose 1 to {MAX_PROCESSES}")
    if settings.mode not in MODES:
        raise LlmvisorError(f"--mode {settings.mode}: choose one of {', '.join(MODES)}")
    if settings.warmup_s >= settings.duration_s:
        raise LlmvisorError(f"a run of {settings.duration_s:g} s leaves nothing to measure after its {settings.warmup_s:g} s warm-up")
    if settings.mode == "aggregate" and not (settings.window_s and 0.05 <= settings.window_s <= settings.duration_s):
        raise LlmvisorError(f"--window-s {settings.window_s}: choose 0.05 s up to the run's {settings.duration_s:g} s")
    with tempfile.TemporaryDirectory(prefix="llmvisor-fleet-") as scratch:
        if model_path is None:
            model_path = Path(scratch) / "model.json"
            StepLatencyModel().fit(synthetic_trace(2000)).to_json(model_path)
        db_url = f"sqlite:///{scratch}/ledger.db" if db_target == "sqlite" else db_target
        ledger = Ledger(db_url)
        servers = [ServerProcess(model_path, db_url, log_path=Path(scratch) / f"server-{i}.log",
                                 env={ENV_REQUEST_TOTALS: "1" if settings.request_totals else "0"}) for i in range(settings.processes)]
        edge = None
        try:
            key = ledger.create_key(is_admin=True)
            if settings.mode == "aggregate":
                edge = _build_edge(ledger, settings, StepLatencyModel.from_json(model_path), archive_url or f"{scratch}/archive", workers)
            steps_before = ledger.totals().num_steps
            for server in servers:
                server.start()
            pg_before = postgres_counters(ledger)
            cpu_before = [cpu_seconds(server.process.pid) for server in servers]
            generator_before = resource.getrusage(resource.RUSAGE_SELF)
            load_before = os.getloadavg()[0]
            urls = [server.url for server in servers]
            if edge is None:
                raw = asyncio.run(run_fleet(urls, key, settings))
            else:
                raw = asyncio.run(run_fleet_windows(urls, key, settings, edge["engines"], edge["warmup"]))
            generator_after = resource.getrusage(resource.RUSAGE_SELF)
            load_after = os.getloadavg()[0]
            cpu_after = [cpu_seconds(server.process.pid) for server in servers]
            pg_after = postgres_counters(ledger)
            totals = ledger.totals()
        finally:
            for server in servers:
                server.stop()
            ledger.close()
    acknowledged = raw["acknowledged"]
    stored = totals.num_steps - steps_before - raw["warmup_steps"]
    service_cpu = None
    if None not in cpu_before and None not in cpu_after and acknowledged:
        service_cpu = sum(after - before for before, after in zip(cpu_before, cpu_after)) / acknowledged
    generator_cpu = (generator_after.ru_utime + generator_after.ru_stime - generator_before.ru_utime - generator_before.ru_stime)
    postgres_per_step = None
    if pg_before is not None and pg_after is not None and acknowledged:
        postgres_per_step = {
            name: None if pg_before[name] is None or pg_after[name] is None else (pg_after[name] - pg_before[name]) / acknowledged
            for name in pg_before
        }
        postgres_per_step["table_bytes"] = sum(postgres_per_step[f"{name}_bytes"] for name in LEDGER_TABLES)
    measured_s = raw.get("measured_s", raw.get("window_s"))
    common = dict(
        settings=asdict(settings),
        database=ledger.backend,
        offered_steps_per_s=settings.engines * settings.steps_per_s_per_engine,
        accepted_steps_per_s=raw["in_window"] / measured_s,
        steps_covered_per_s=raw["in_window"] / measured_s,
        steps_acknowledged=acknowledged,
        posts=raw["posts"],
        failed_posts=raw["failed"],
        failed_posts_by_status=raw["failed_by_status"],
        mean_steps_per_post=acknowledged / max(1, raw["posts"] - raw["failed"]),
        ingest_latency_s=quantiles(raw["latencies"]),
        staleness_s=quantiles(raw["staleness"]),
        staleness_probes_timed_out=raw["probe_timeouts"],
        service_cpu_s_per_step=service_cpu,
        generator_cpu_s_per_step=generator_cpu / max(1, acknowledged),
        postgres_per_step=postgres_per_step,
        # A POST that failed on the client's side may still have been stored (and not yet re-sent when the run ended).
        reconciled=acknowledged <= stored <= acknowledged + raw["failed_steps"] and totals.attributed_ns == totals.measured_ns,
        measured_s=measured_s,
        load_average_1min=[load_before, load_after],
        load_average_1min_max=raw["load_max"],
    )
    if edge is None:
        return FleetResult(steps_unsent_at_end=raw["unsent"], **common)
    engines: list[EdgeEngine] = edge["engines"]
    offered = raw["offered"]
    aggregate = {
        "accepted_windows_per_s": raw["windows_in_window"] / measured_s,
        "windows_acknowledged": raw["windows"],
        "windows_built": sum(len(engine.windows) for engine in engines),
        "steps_offered": offered,
        "steps_uncovered_at_end": raw["uncovered"],
        "steps_late": raw["late_steps"],
        "windows_late": raw["late_windows"],
        "late_after_close_s": LATE_AFTER_CLOSE_S,
        "requests_per_window": sum(e.aggregate_requests_per_window * len(e.windows) for e in engines) / max(1, sum(len(e.windows) for e in engines)),
        "tenants_per_window": sum(e.distinct_tenants_per_window * len(e.windows) for e in engines) / max(1, sum(len(e.windows) for e in engines)),
        "finished_requests_per_step": sum(e.finished_requests for e in engines) / max(1, offered),
        "window_body_bytes_per_step": sum(len(w.body) for e in engines for w in e.windows) / max(1, offered),
        "engine_cpu_s_per_step": {
            "aggregation": sum(e.aggregate_cpu_s for e in engines) / max(1, offered),
            "archive_write": sum(e.archive_cpu_s for e in engines) / max(1, offered),
            "total": sum(e.aggregate_cpu_s + e.archive_cpu_s for e in engines) / max(1, offered),
        },
        "build_s": edge["build_s"],
        "archive_files": sum(e.archive_files for e in engines),
        "period_s": [edge["base_s"], edge["base_s"] + settings.duration_s],  # the build clock's span of the steps: an audit reads it
        "workload": edge["workload"],
    }
    return FleetResult(
        steps_unsent_at_end=raw["uncovered"], archive_bytes_per_step=sum(e.archive_bytes for e in engines) / max(1, offered),
        aggregate=aggregate, **common,
    )


def _build_edge(ledger: Ledger, settings: FleetSettings, model: StepLatencyModel, archive_url: str, workers: int | None) -> dict:
    """Register the engines' model version and build the engines (`llmvisor.service.fleet_edge`), a warm-up one too."""
    version = ledger.add_model(ENGINE_CLASS, json.dumps(model.to_dict()), source="llmvisor load", activate=True)
    tag = uuid.uuid4().hex[:8]
    rng = np.random.default_rng(0)
    base_s = float(math.ceil(time.time()))
    window_s = float(settings.window_s)
    common = dict(tag=tag, steps_per_s=settings.steps_per_s_per_engine, batch_size=settings.batch_size, n_tenants=settings.n_tenants,
                  window_s=window_s, duration_s=settings.duration_s, base_s=base_s, archive_url=archive_url)
    specs = [EdgeSpec(index=e, offset_s=float(rng.uniform(0, 1 / settings.steps_per_s_per_engine)), **common)
             for e in range(settings.engines)]
    started = time.perf_counter()
    engines = build_engines(specs, model, version, workers=workers)
    build_s = time.perf_counter() - started
    # the warm-up run's windows are dated an hour earlier: not archived, and outside any audit of the run's period
    [warmup] = build_engines([EdgeSpec(index=0, **{**common, "tag": f"{tag}w", "archive_url": None, "base_s": base_s - 3600,
                                                   "duration_s": window_s * (settings.processes + 1)})], model, version, workers=1)
    return {"engines": engines, "warmup": warmup, "build_s": build_s, "base_s": base_s, "workload": DEFAULT_WORKLOAD}
