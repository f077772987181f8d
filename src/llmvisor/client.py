"""Engine-side client: push each step's trace rows to the accounting service without blocking the engine.

`StepPusher.push_step` only appends to a bounded in-memory queue. A background thread sends the queue in
batches (one POST /v1/steps per batch, in the column form), retrying with exponential backoff. When the service stays
unreachable, or the queue is full, steps go to a local JSONL spool file (trace format) instead, which is
replayed when the service answers again, and on the next start. Replays are safe because the service is
idempotent on (run_id, step_id): a step sent twice is acknowledged and counted once.

Steps the service rejects for their content (a 422, or a 409: same step id, different content) cannot be
fixed by retrying; they are moved to ``<spool>.rejected.jsonl``, logged as errors with the count and that
path (again in a summary at close), and counted in the Prometheus counter ``llmvisor_pusher_steps_rejected_total``.

`StepRelay` runs this pusher in a delivery process of its own for the vLLM recorder: vLLM's default
shutdown SIGKILLs the engine-core process right after SIGTERM, so nothing left in that process's memory
survives it; each step is written to a pipe as it ends, and the delivery process (not a child of the engine,
so not in the process tree vLLM kills) writes the trace, pushes, and finishes when the pipe closes.

Example::

    pusher = StepPusher("http://127.0.0.1:8080", api_key, "llmvisor-spool.jsonl")
    for step in engine_loop():
        pusher.push_step(rows_of(step))      # a list of trace-format row dicts
    pusher.close(timeout_s=30)               # send (or spool) what is left

or ``StepPusher.from_env()`` with ``LLMVISOR_SERVICE_URL``, ``LLMVISOR_SERVICE_KEY`` (an admin key) and
optionally ``LLMVISOR_SPOOL`` set.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import logging
import os
import queue
import random
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import prometheus_client

from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.relayed import step_rows
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.core.trace import REQUIRED_COLUMNS, SHARING_COLUMNS, TraceWriter
from llmvisor.errors import LlmvisorError
from llmvisor.metering import DEFAULT_WINDOW_S, WindowAggregate, WindowAggregator, union_ranges
from llmvisor.metering.prometheus import edge_metrics

log = logging.getLogger("llmvisor.pusher")

ENV_URL = "LLMVISOR_SERVICE_URL"
ENV_KEY = "LLMVISOR_SERVICE_KEY"
ENV_SPOOL = "LLMVISOR_SPOOL"
DEFAULT_SPOOL = "llmvisor-spool.jsonl"
ENV_DELIVERY_METRICS_PORT = "LLMVISOR_DELIVERY_METRICS_PORT"

REJECTED_STEPS = prometheus_client.Counter(
    "llmvisor_pusher_steps_rejected", "Steps the accounting service refused for their content (kept in the rejected file)"
)
DELIVERED_STEPS = prometheus_client.Counter("llmvisor_pusher_steps_acknowledged", "Steps the accounting service acknowledged")
PUSHED_STEPS = prometheus_client.Counter("llmvisor_pusher_steps_pushed", "Steps handed to the pusher")
SENT_STEPS = prometheus_client.Counter(
    "llmvisor_pusher_steps_sent", "Steps sent to the service in a POST (once per batch sent: a replayed step counts again)"
)
SPOOLED_STEPS = prometheus_client.Counter("llmvisor_pusher_steps_spooled", "Steps written to the spool file (service away or queue full)")
REPLAYED_STEPS = prometheus_client.Counter("llmvisor_pusher_steps_replayed", "Spooled steps sent again and acknowledged")
DROPPED_STEPS = prometheus_client.Counter(
    "llmvisor_pusher_steps_dropped",
    "Steps lost: the spool could not be written and the steps held in memory reached their bound (they show as gaps)",
)
HELD_STEPS = prometheus_client.Gauge(
    "llmvisor_pusher_steps_held", "Steps kept in memory because the spool file could not be written (bounded)"
)
OUTAGE_LOG_INTERVAL_S = 30.0
DEFAULT_MAX_HELD_STEPS = 50_000


@dataclass
class PusherStats:
    """What became of the steps pushed so far (a step can be spooled and later acknowledged); ``held`` counts
    steps kept in memory because the spool file could not be written, ``dropped`` those lost because that
    memory was full too (or, at close, the spool still refused them)."""

    pushed: int = 0
    sent: int = 0
    acknowledged: int = 0
    duplicate: int = 0
    spooled: int = 0
    replayed: int = 0
    rejected: int = 0
    held: int = 0
    dropped: int = 0
    failed_posts: int = 0
    last_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


def service_url_from_env() -> str | None:
    """``LLMVISOR_SERVICE_URL``, or None; a URL without ``LLMVISOR_SERVICE_KEY`` is an error."""
    url = os.environ.get(ENV_URL)
    if url and not os.environ.get(ENV_KEY):
        raise ValueError(f"{ENV_URL} is set but {ENV_KEY} (an admin API key) is not")
    return url or None


class _Unavailable(Exception):
    """The service could not take a batch now (down, busy, or refusing the key); keep the steps."""


class _Step(list):
    """One step's rows, numbered in push order (``seq``; None for a step read back from the spool)."""

    __slots__ = ("seq",)


class StepPusher:
    """Send step rows to the service in the background; spool to a file when it cannot be reached.

    Parameters
    ----------
    url : service base URL, e.g. ``http://127.0.0.1:8080``.
    api_key : an admin key (ingest needs one).
    spool_path : JSONL file for steps not yet acknowledged; ``<spool>.replaying`` and
        ``<spool>.rejected.jsonl`` sit beside it.
    max_queue_steps : steps held in memory; beyond that `push_step` appends to the spool file directly.
    max_batch_steps : steps per POST.
    flush_interval_s : longest a step waits in the queue for a batch to fill.
    max_attempts : POSTs of one batch (with backoff between) before it is spooled.
    retry_interval_s : how long to wait, once spooling, before trying the service again.
    max_held_steps : steps kept in memory while the spool file cannot be written (a full disk, a read-only
        directory); beyond that, steps are dropped, counted and logged.

    While the service is away the log says so once, then every 30 s with the steps spooled so far, and
    ``service back`` with the outage's length and count when it answers again, then how many spooled steps
    were replayed.
    """

    def __init__(
        self,
        url: str,
        api_key: str,
        spool_path: str | os.PathLike = DEFAULT_SPOOL,
        *,
        max_queue_steps: int = 10_000,
        max_batch_steps: int = 500,
        flush_interval_s: float = 0.2,
        request_timeout_s: float = 10.0,
        max_attempts: int = 4,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        retry_interval_s: float = 2.0,
        max_held_steps: int = DEFAULT_MAX_HELD_STEPS,
    ):
        self.url = url.rstrip("/")
        self.spool_path = Path(spool_path)
        self.replay_path = Path(f"{spool_path}.replaying")
        self.rejected_path = Path(f"{spool_path}.rejected.jsonl")
        self.max_batch_steps = max_batch_steps
        self.flush_interval_s = flush_interval_s
        self.max_attempts = max_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.retry_interval_s = retry_interval_s
        self.max_held_steps = max_held_steps
        self.stats = PusherStats()
        self._held: list[_Step] = []
        self._held_lock = threading.Lock()
        self._last_held_log_s = -1e9
        self._next_respool_s = 0.0
        self._next_seq = 0
        self._unsettled: set[int] = set()
        self._unsettled_heap: list[int] = []
        self._outage_since_s: float | None = None
        self._outage_spooled = 0
        self._last_outage_log_s = 0.0
        self._queue: queue.Queue[list[dict]] = queue.Queue(maxsize=max_queue_steps)
        self._spool_lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._next_try_s = 0.0
        self._client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            timeout=request_timeout_s,
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llmvisor-pusher", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, **kwargs) -> StepPusher | None:
        """A pusher configured from ``LLMVISOR_SERVICE_URL`` / ``_KEY`` / ``LLMVISOR_SPOOL``, or None if no URL."""
        url = service_url_from_env()
        if not url:
            return None
        return cls(url, os.environ[ENV_KEY], os.environ.get(ENV_SPOOL, DEFAULT_SPOOL), **kwargs)

    # -----------------------------------------------------------------------------------------------------
    # Engine side

    def push_step(self, rows: Sequence[dict]) -> None:
        """Hand over one step's rows; returns at once (at worst after a local file append when the queue is full)."""
        if self._closed:
            raise RuntimeError("push_step after close()")
        step = _Step(dict(row) for row in rows)  # the caller may reuse its dicts for the next step
        if not step:
            raise ValueError("a step has at least one row")
        self.stats.add(pushed=1)
        PUSHED_STEPS.inc()
        with self._count_lock:
            self._outstanding += 1
            step.seq = self._next_seq
            self._next_seq += 1
            self._unsettled.add(step.seq)
            heapq.heappush(self._unsettled_heap, step.seq)
        try:
            self._queue.put_nowait(step)
        except queue.Full:
            with self._count_lock:
                self._outstanding -= 1
            self._spool([step])

    def settled_steps(self) -> int:
        """How many of the first steps pushed are all settled: acknowledged, rejected, spooled to the file or
        dropped (not: queued, being sent, or held in memory). A relay may forget a step once it is settled."""
        with self._count_lock:
            heap = self._unsettled_heap
            while heap and heap[0] not in self._unsettled:
                heapq.heappop(heap)
            return heap[0] if heap else self._next_seq

    def _settle(self, steps: Sequence[list]) -> None:
        with self._count_lock:
            for step in steps:
                seq = getattr(step, "seq", None)
                if seq is not None:
                    self._unsettled.discard(seq)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every step pushed so far is acknowledged or rejected (the spool replayed too);
        False if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._next_try_s = 0.0
        while time.monotonic() < deadline:
            if self._outstanding == 0 and not self._held and not self.spool_path.exists() and not self.replay_path.exists():
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued, and replay the spool, for up to ``timeout_s``; spool whatever is left.

        If the service does not answer, the rest goes straight to the spool (for the next start to
        replay) rather than holding up shutdown. Returns True if nothing was left unacknowledged.
        """
        if not self._closed:
            self._closed = True
            self._deadline = time.monotonic() + timeout_s
            self._next_try_s = 0.0
            self._stop.set()
            self._thread.join(timeout_s + 5.0)
            self._client.close()
            self._release_held_at_close()
            if self.stats.rejected:
                log.error(
                    "llmvisor: the service rejected %d of %d step(s) pushed; they are NOT billed and kept in %s",
                    self.stats.rejected, self.stats.pushed, self.rejected_path,
                )
        return self.pending_steps() == 0

    def spooled_step_ids(self, run_id: str) -> list[int]:
        """Ids of the steps of ``run_id`` in the spool files (to be replayed as they are), read while no replay
        moves them."""
        with self._spool_lock:
            steps = [step for path in (self.replay_path, self.spool_path) for step in _read_spool(path)[0]]
        ids = (step[0].get("step_id") for step in steps if step and step[0].get("run_id") == run_id)
        return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]

    def pending_steps(self) -> int:
        """Steps not yet acknowledged: queued or being sent, or in the spool files."""
        return self._outstanding + len(self._held) + sum(
            len(_read_spool(p)[0]) for p in (self.replay_path, self.spool_path) if p.exists()
        )

    def __enter__(self) -> StepPusher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------------------
    # Background thread

    def _take_batch(self, wait_s: float) -> list[list[dict]]:
        batch: list[list[dict]] = []
        try:
            batch.append(self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait())
        except queue.Empty:
            return batch
        while len(batch) < self.max_batch_steps:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _paused(self) -> bool:
        """The service failed recently (wait before trying again) or close() ran out of time."""
        now = time.monotonic()
        return now < self._next_try_s or (self._deadline is not None and now >= self._deadline)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            batch = self._take_batch(0 if stopping else self.flush_interval_s)
            if batch:
                if self._paused():
                    self._spool(batch)
                else:
                    self._send_or_spool(batch)
                with self._count_lock:
                    self._outstanding -= len(batch)
            if not self._paused():
                self._replay()
            if self._held:
                self._retry_held()
            if stopping and self._queue.empty():
                if self._paused() or not (self._held or self.spool_path.exists() or self.replay_path.exists()):
                    return

    def _retry_held(self) -> None:
        """Steps held in memory (the spool refused them): to the service when it answers, else to the spool
        again once per retry interval (the disk may have room again)."""
        if not self._paused():
            with self._held_lock:
                batch, self._held[: self.max_batch_steps] = self._held[: self.max_batch_steps], []
            HELD_STEPS.set(len(self._held))
            self._send_or_spool(batch)
        elif time.monotonic() >= self._next_respool_s:
            self._next_respool_s = time.monotonic() + self.retry_interval_s
            with self._held_lock:
                batch, self._held = self._held, []
            HELD_STEPS.set(0)
            self._spool(batch)

    def _release_held_at_close(self) -> None:
        """At close, steps still held go to the spool if it takes them now; otherwise they are lost: dropped,
        counted and logged."""
        with self._held_lock:
            held, self._held = self._held, []
        HELD_STEPS.set(0)
        if not held:
            return
        try:
            self._write_spool(held)
        except (OSError, TypeError, ValueError) as error:
            self._drop(held, f"the spool {self.spool_path} still cannot be written at close ({error})")
            return
        self._spooled(held)

    def _outage(self, error: Exception) -> None:
        """Log the service's outage once when it starts, then every `OUTAGE_LOG_INTERVAL_S` with true counts."""
        now = time.monotonic()
        if self._outage_since_s is None:
            self._outage_since_s, self._outage_spooled, self._last_outage_log_s = now, 0, now
            log.warning(
                "llmvisor service unavailable (%s); spooling steps to %s and retrying every %g s",
                error, self.spool_path, self.retry_interval_s,
            )
        elif now - self._last_outage_log_s >= OUTAGE_LOG_INTERVAL_S:
            self._last_outage_log_s = now
            log.warning(
                "llmvisor service still unavailable after %.0f s (%s); spooled %d steps so far in this outage "
                "(%d held in memory, %d dropped in all)",
                now - self._outage_since_s, error, self._outage_spooled, len(self._held), self.stats.dropped,
            )

    def _service_back(self) -> None:
        if self._outage_since_s is not None:
            log.warning(
                "llmvisor service back after %.0f s; spooled %d steps meanwhile, replaying them now",
                time.monotonic() - self._outage_since_s, self._outage_spooled,
            )
            self._outage_since_s = None

    def _send_or_spool(self, batch: list[list[dict]]) -> None:
        try:
            self._deliver(batch)
        except _Unavailable as error:
            self.stats.last_error = str(error)
            self._outage(error)
            self._next_try_s = time.monotonic() + self.retry_interval_s
            self._spool(batch)
        except Exception as error:  # an answer we do not understand: keep the steps, keep the thread alive
            log.exception("llmvisor pusher: unexpected answer; spooling %d steps to %s", len(batch), self.spool_path)
            self.stats.last_error = repr(error)
            self._next_try_s = time.monotonic() + self.retry_interval_s
            self._spool(batch)

    def _post(self, batch: list[list[dict]]) -> httpx.Response:
        """One POST with retries on transport errors and 5xx/429; raises `_Unavailable` when they run out."""
        body = columns_body(batch)
        self.stats.add(sent=len(batch))
        SENT_STEPS.inc(len(batch))
        delay_s = self.backoff_initial_s
        for attempt in range(self.max_attempts):
            try:
                response = self._client.post("/v1/steps", content=body)
                if response.status_code < 500 and response.status_code != 429:
                    return response
                reason = f"HTTP {response.status_code}"
            except httpx.HTTPError as error:
                reason = f"{type(error).__name__}: {error}"
            self.stats.add(failed_posts=1)
            if attempt == self.max_attempts - 1 or self._out_of_time():
                break
            time.sleep(min(delay_s * (0.5 + random.random()), self.backoff_max_s))
            delay_s = min(delay_s * 2, self.backoff_max_s)
        raise _Unavailable(reason)

    def _deliver(self, batch: list[list[dict]]) -> None:
        """Send a batch until every step is acknowledged or rejected; `_Unavailable` if the service is not there."""
        response = self._post(batch)
        status = response.status_code
        if status == 200:
            result = response.json()
            self.stats.add(acknowledged=result["steps_received"], duplicate=result["steps_duplicate"])
            DELIVERED_STEPS.inc(result["steps_received"])
            self._settle(batch)
            self._service_back()
            return
        if status in (401, 403):
            raise _Unavailable(f"HTTP {status}: {_detail(response)}")
        if status == 409 and "duplicate_of" in (refusal := response.json()):
            # the run repeats another under a new run id: the service refuses every step of it, so halving would not help
            bad = [step for step in batch if _step_key(step)[0] == refusal.get("run_id")] or batch
            self._reject(bad, _detail(response))
            keep = [step for step in batch if _step_key(step)[0] != refusal.get("run_id")]
            if keep and len(bad) < len(batch):
                self._deliver(keep)
            return
        if status == 409:
            conflicting = {(c["run_id"], c["step_id"]) for c in response.json().get("conflicting_steps", [])}
            keep = [step for step in batch if _step_key(step) not in conflicting]
            bad = [step for step in batch if _step_key(step) in conflicting]
            if bad and len(keep) < len(batch):
                self._reject(bad, _detail(response))
                if keep:
                    self._deliver(keep)
                return
        if len(batch) > 1 and status in (400, 409, 413, 422):
            # Find the steps the service refuses by halving; the others go through.
            middle = len(batch) // 2
            self._deliver(batch[:middle])
            self._deliver(batch[middle:])
            return
        self._reject(batch, f"HTTP {status}: {_detail(response)}")

    def _reject(self, steps: list[list[dict]], reason: str) -> None:
        self.stats.last_error = reason
        try:
            with self._spool_lock:
                writer = TraceWriter(self.rejected_path, flush_every_steps=len(steps))
                for step in steps:
                    writer.write_step(step)
                writer.close()
            log.error("llmvisor service rejected %d step(s): %s; kept in %s", len(steps), reason, self.rejected_path)
        except (OSError, TypeError, ValueError) as error:
            log.error("llmvisor service rejected %d step(s): %s; they cannot be kept in %s either (%s)",
                      len(steps), reason, self.rejected_path, error)
        self.stats.add(rejected=len(steps))
        REJECTED_STEPS.inc(len(steps))
        self._settle(steps)

    def _write_spool(self, steps: list[list[dict]]) -> None:
        with self._spool_lock:
            writer = TraceWriter(self.spool_path, flush_every_steps=len(steps))
            for step in steps:
                writer.write_step(step)
            writer.close()

    def _spooled(self, steps: list[list[dict]]) -> None:
        self.stats.add(spooled=len(steps))
        SPOOLED_STEPS.inc(len(steps))
        self._outage_spooled += len(steps)
        self._settle(steps)

    def _spool(self, steps: list[list[dict]]) -> None:
        if not steps:
            return
        try:
            self._write_spool(steps)
        except OSError as error:
            # A full disk or a read-only directory: neither the engine loop nor this thread may die of it, and
            # the steps are not lost yet: held in memory (bounded) until the service or the spool takes them.
            self._hold(steps, error)
            return
        except (TypeError, ValueError) as error:  # a row that cannot be written as JSON: no retry helps
            self._drop(steps, f"a row cannot be written as JSON ({error})")
            return
        self._spooled(steps)

    def _hold(self, steps: list[list[dict]], error: OSError) -> None:
        with self._held_lock:
            room = max(self.max_held_steps - len(self._held), 0)
            kept, lost = steps[:room], steps[room:]
            self._held.extend(kept)
            n_held = len(self._held)
        HELD_STEPS.set(n_held)
        self.stats.add(held=len(kept))
        now = time.monotonic()
        if kept and now - self._last_held_log_s >= OUTAGE_LOG_INTERVAL_S:
            self._last_held_log_s = now
            log.error(
                "llmvisor pusher: cannot spool %d step(s) to %s (%s); keeping them in memory (%d held, at most %d) "
                "until the service or the spool takes them",
                len(kept), self.spool_path, error, n_held, self.max_held_steps,
            )
        if lost:
            self._drop(lost, f"cannot spool to {self.spool_path} ({error}) and {self.max_held_steps} steps are held in memory already")

    def _drop(self, steps: list[list[dict]], reason: str) -> None:
        self.stats.add(dropped=len(steps))
        DROPPED_STEPS.inc(len(steps))
        self._settle(steps)
        log.error(
            "llmvisor pusher: dropped %d step(s): %s; %d dropped in all: they are lost, not billed, and show as gaps "
            "of their runs in the ledger (GET /v1/runs/{run}/gaps)",
            len(steps), reason, self.stats.dropped,
        )

    def _replay(self) -> None:
        """Send the spooled steps: the file is first renamed, so new spooling goes to a fresh file; it is
        removed only once every step in it was acknowledged (a crash before that replays it again, safely)."""
        with self._spool_lock:
            if not self.replay_path.exists():
                if not self.spool_path.exists():
                    return
                os.replace(self.spool_path, self.replay_path)
        steps, unreadable = _read_spool(self.replay_path)
        if unreadable:
            log.error("llmvisor spool %s: %d unreadable line(s) skipped (a torn write?)", self.replay_path, unreadable)
        acknowledged, duplicate = self.stats.acknowledged, self.stats.duplicate
        try:
            for i in range(0, len(steps), self.max_batch_steps):
                if self._out_of_time():
                    return
                self._deliver(steps[i : i + self.max_batch_steps])
        except Exception as error:  # _Unavailable, or an answer we do not understand: the file stays, retry later
            if not isinstance(error, _Unavailable):
                log.exception("llmvisor pusher: unexpected answer while replaying %s", self.replay_path)
            self.stats.last_error = str(error)
            self._next_try_s = time.monotonic() + self.retry_interval_s
            return
        self.replay_path.unlink()
        self.stats.add(replayed=len(steps))
        REPLAYED_STEPS.inc(len(steps))
        log.warning(
            "llmvisor: replayed %d steps from the spool (%d new to the service, %d it had already)",
            len(steps), self.stats.acknowledged - acknowledged - (self.stats.duplicate - duplicate), self.stats.duplicate - duplicate,
        )


PUSHED_OPTIONAL_COLUMNS = ("timestamp_s", *SHARING_COLUMNS, CACHED_PROMPT_COLUMN, FINGERPRINT_COLUMN)
"""Optional trace columns the service reads (`llmvisor.service.ingest`), sent when the rows carry them."""


def columns_body(steps: list[list[dict]]) -> bytes:
    """A POST /v1/steps body in the column form (several times cheaper to validate than one object per row).

    Only the columns the service reads are sent: those it stores, the shared-KV columns it prices with, the
    prefix-cache hits it meters (`PUSHED_OPTIONAL_COLUMNS`) and the engine fingerprint id (checked against the
    service's model, not stored, not part of a step's idempotency key); a row missing a stored column is sent as
    null, which the service reports by row like any other bad value."""
    rows = [row for step in steps for row in step]
    names = [*REQUIRED_COLUMNS, *(name for name in PUSHED_OPTIONAL_COLUMNS if any(name in row for row in rows))]
    # One json.dumps per column rather than one for the body: each C call holds the GIL, and this runs in a
    # thread of the engine's process, whose step times are being measured.
    parts = [f"{json.dumps(name)}:{json.dumps([row.get(name) for row in rows])}" for name in names]
    return ('{"columns":{' + ",".join(parts) + "}}").encode()


def _step_key(step: list[dict]) -> tuple:
    return (step[0].get("run_id"), step[0].get("step_id"))


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail"))
    except (ValueError, AttributeError):
        return response.text[:500]


def _read_spool(path: Path) -> tuple[list[list[dict]], int]:
    """Steps of a spool file, from consecutive rows of one (run_id, step_id); a step spooled twice in a
    row starts a new group at the repeated request. Returns (steps, unreadable lines)."""
    steps: list[list[dict]] = []
    unreadable = 0
    current_key = None
    current_requests: set = set()
    try:
        handle = open(path, encoding="utf-8")
    except FileNotFoundError:
        return [], 0
    with handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            if not isinstance(row, dict):
                unreadable += 1
                continue
            key = (row.get("run_id"), row.get("step_id"))
            request = row.get("request_id")
            if key != current_key or request in current_requests:
                steps.append([])
                current_key, current_requests = key, set()
            steps[-1].append(row)
            current_requests.add(request if isinstance(request, (str, int, float)) or request is None else repr(request))
    return steps, unreadable


# ---------------------------------------------------------------------------------------------------------
# Delivery out of the engine's process

RELAY_PIPE_BYTES = 1 << 20
DELIVERY_CLOSE_TIMEOUT_S = 30.0


class StepDelivery:
    """Relayed steps to the trace file and the service: the delivery process's work (also the relay's
    fallback in the engine's own process if delivery processes keep dying).

    ``trace_from``: steps with a lower id are in the trace already (a delivery process that replaces one that
    died is sent again what its predecessor had not made safe, some of it written to the trace)."""

    def __init__(self, header: dict, pusher: StepPusher | None, *, trace_from: int | None = None,
                 windows: WindowDelivery | None = None):
        self.header = header
        self.windows = windows
        metadata = {"engine_fingerprint": header["engine_fingerprint"]} if header.get("engine_fingerprint") else None
        self.writer = (
            TraceWriter(header["trace_path"], flush_every_steps=1 << 62, metadata=metadata) if header.get("trace_path") else None
        )
        self.pusher = pusher
        self.trace_from = trace_from
        self.num_steps = 0
        self.next_step_id: int | None = None
        self._pushed_ids: deque[int] = deque()
        self._settled_offset = 0
        self.archive = _archive_from_env(metadata)
        self.end: dict | None = None
        """The end-of-run record the engine sent at a clean shutdown (`StepRelay.close`); None: not (yet)."""

    def add(self, step: list) -> None:
        step_id = step[0]
        if self.archive is not None:
            self.archive.add_relayed(self.header, step)  # kept as columns: no row dicts for it
        to_trace = self.writer is not None and (self.trace_from is None or step_id >= self.trace_from)
        rows = step_rows(self.header, step) if to_trace or self.pusher is not None else None
        if to_trace:
            self.writer.write_step(rows)
        if self.pusher is not None:
            self.pusher.push_step(rows)
            self._pushed_ids.append(step_id)
        if self.windows is not None:
            self.windows.add(step)
        self.num_steps += 1
        self.next_step_id = step_id + 1

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        if self.archive is not None:
            self.archive.rotate()
        if self.windows is not None:
            self.windows.tick()

    def safe_from(self) -> tuple[int, ...] | None:
        """(first step id not yet flushed to the trace, first step id the pusher has not settled): every step
        before both is safe from this process's death; in window mode a third number, the start (µs) of the
        window that step is in (a replacement delivery process starts no window before it). None before the
        first step. Call after `flush`."""
        if self.next_step_id is None:
            return None
        push_next = self.next_step_id
        if self.pusher is not None:
            settled = self.pusher.settled_steps()
            while self._settled_offset < settled and self._pushed_ids:
                self._pushed_ids.popleft()
                self._settled_offset += 1
            if self._pushed_ids:
                push_next = self._pushed_ids[0]
        if self.windows is not None:
            push_next, floor_us = self.windows.push_next(self.next_step_id)
            return self.next_step_id, push_next, floor_us
        return self.next_step_id, push_next

    def end_run(self, record: dict) -> None:
        """Keep the end-of-run record (last step id, steps recorded) to send once the steps are sent (`close`)."""
        self.end = {"last_step_id": int(record["last_step_id"]), "num_steps": int(record["num_steps"])}

    def close(self, timeout_s: float = DELIVERY_CLOSE_TIMEOUT_S) -> bool:
        """Write the trace's last steps and send (or spool) the pusher's, then the end-of-run record if the engine
        sent one; True if the service has them all."""
        if self.writer is not None:
            self.writer.close()
        if self.archive is not None:
            self.archive.close()
        if self.windows is not None:
            complete = self.windows.close(timeout_s)
        else:
            complete = self.pusher.close(timeout_s) if self.pusher is not None else True
        if self.end is not None and (self.pusher is not None or self.windows is not None):
            send_run_end(self.header["columns"]["run_id"], **self.end)
        return complete

    @classmethod
    def from_env(cls, header: dict, *, trace_from: int | None = None) -> StepDelivery:
        """Every step to the service (default, ``LLMVISOR_STORE_STEPS=1``), or window aggregates with
        ``LLMVISOR_STORE_STEPS=0`` (and per step the windows of a class without a model); neither without
        ``LLMVISOR_SERVICE_URL``."""
        if store_steps_from_env():
            return cls(header, StepPusher.from_env(), trace_from=trace_from)
        pusher = WindowPusher.from_env()
        windows = None if pusher is None else WindowDelivery(header, pusher, window_s=window_s_from_env(), step_pusher=StepPusher.from_env())
        return cls(header, None, trace_from=trace_from, windows=windows)


RUN_END_PATH = "/v1/runs/{run_id}/end"
RUN_END_ATTEMPTS = 4


def send_run_end(run_id: str, last_step_id: int, num_steps: int, *, url: str | None = None, api_key: str | None = None,
                 timeout_s: float = 10.0, backoff_s: float = 0.5) -> bool:
    """POST the end-of-run record (``LLMVISOR_SERVICE_URL`` / ``_KEY`` unless given), so the service counts the steps
    after the last one it stored, up to ``last_step_id``, as missing (a lost tail). Retried a few times while the
    service is away or busy; if it stays away the run stays open there (logged), its stored steps unaffected."""
    url = url or service_url_from_env()
    if not url:
        return False
    key = api_key if api_key is not None else os.environ.get(ENV_KEY, "")
    path = RUN_END_PATH.format(run_id=urllib.parse.quote(run_id, safe=""))
    reason = ""
    with httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s) as client:
        for attempt in range(RUN_END_ATTEMPTS):
            try:
                response = client.post(path, json={"last_step_id": last_step_id, "num_steps": num_steps})
            except httpx.HTTPError as problem:
                reason = f"{type(problem).__name__}: {problem}"
            else:
                if response.status_code == 200:
                    log.info("llmvisor: sent the end-of-run record of run %s (last step %d, %d steps; %d missing at the service)",
                             run_id, last_step_id, num_steps, response.json().get("num_missing", 0))
                    return True
                reason = f"HTTP {response.status_code}: {_detail(response)}"
                if response.status_code < 500 and response.status_code != 429:
                    break
            if attempt < RUN_END_ATTEMPTS - 1:
                time.sleep(backoff_s * 2**attempt)
    log.error("llmvisor: the service did not take the end-of-run record of run %s (%s); the run stays open there "
              "(a lost tail would not show as a gap)", run_id, reason)
    return False


def _archive_from_env(metadata: dict | None):
    """The raw-step archive (``LLMVISOR_ARCHIVE_URL``, see llmvisor.archive), or None when not configured."""
    if not os.environ.get("LLMVISOR_ARCHIVE_URL"):
        return None
    from llmvisor.archive import ArchiveWriter

    return ArchiveWriter.from_env(metadata)


RELAY_RETAIN_BYTES = 256 << 20
"""Encoded steps the engine process keeps until the delivery process reports them safe (about 150,000 steps of
16 slices): what a delivery process that dies takes with it is sent again to the next one."""
RELAY_WRITE_CHUNK_BYTES = 256 << 10
RELAY_WATCH_INTERVAL_S = 0.1
DELIVERY_REPORT_INTERVAL_S = 0.1
RELAY_CLOSE_TIMEOUT_S = 60.0
MAX_DELIVERY_RESTARTS = 5
DELIVERY_RESTART_WINDOW_S = 60.0
_DELIVERY_COMMAND = 'exec 3<&0; "$0" -m llmvisor.client --ack-fd "$1" <&3 3<&- >&2 & echo $!'


@dataclass
class RelayCounts:
    """What the engine side of the relay did with the steps handed to it (logged at close)."""

    relayed: int = 0
    restarts: int = 0
    """Delivery processes started because the previous one died."""
    resent: int = 0
    """Steps sent again to a new delivery process (not yet safe when the previous one died)."""
    unprotected: int = 0
    """Steps forgotten before the delivery process had them safe, to stay within `RELAY_RETAIN_BYTES`."""
    lost: int = 0
    """Steps dropped here: the pipe took nothing while `RELAY_RETAIN_BYTES` of steps waited (they are gaps)."""


class StepRelay:
    """Engine side of the delivery process: ``send`` writes one encoded step to a pipe and returns.

    The delivery process is started through ``/bin/sh`` in the background, so its parent exits at once and it
    is not in the engine process's tree, which vLLM SIGKILLs at shutdown; it has its own session, so a
    Ctrl-C to the server's process group does not reach it. It ignores SIGINT and SIGTERM and ends when the
    pipe closes (the engine exited or was killed), after writing and pushing every whole step it received.

    Nothing is lost on the way:

    - the pipe is non-blocking; if the delivery process falls behind, steps wait in this process's memory and
      a watcher thread writes them as soon as the pipe has room (also while the engine is idle, so a SIGKILL
      of an idle engine finds them in the pipe, which the delivery process still reads to its end);
    - the delivery process reports back, on a second pipe, up to which step everything is safe (flushed to the
      trace and acknowledged by the service, spooled to its file or rejected); this process keeps each step's
      bytes until then (at most `RELAY_RETAIN_BYTES`). If the delivery process dies (the report pipe closes),
      the watcher starts a new one and sends it every step not yet reported safe, whole; the service is
      idempotent on (run_id, step_id), so a step sent twice is stored once. After `MAX_DELIVERY_RESTARTS`
      deaths within `DELIVERY_RESTART_WINDOW_S`, this process delivers by itself.
    """

    def __init__(self, header: dict, *, max_retained_bytes: int = RELAY_RETAIN_BYTES):
        self.header = header
        self.max_retained_bytes = max_retained_bytes
        self.counts = RelayCounts()
        self._lock = threading.RLock()
        self._retained: deque[tuple[int, bytes]] = deque()
        self._retained_bytes = 0
        self._written = 0
        self._partial = 0
        self._trace_next: int | None = None
        self._windows_resume: dict = {}  # window mode: where a replacement delivery process resumes the windows
        self._ack_buffer = b""
        self._dead = False
        self._fd = -1
        self._ack_fd = -1
        self._fallback: StepDelivery | None = None
        self._restarts: deque[float] = deque()
        self._last_loss_log_s = -1e9
        self._last_step_id = -1
        self._start_delivery(None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmvisor-relay", daemon=True)
        self._thread.start()

    def _start_delivery(self, resume: dict | None) -> None:
        read_fd, write_fd = os.pipe()
        ack_read, ack_write = os.pipe()
        try:
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, RELAY_PIPE_BYTES)
        except OSError:
            pass  # the system's limit is lower; the default pipe size still works
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            launcher = subprocess.Popen(
                # a background job's stdin is /dev/null unless redirected: the pipe goes through fd 3
                ["/bin/sh", "-c", _DELIVERY_COMMAND, sys.executable, str(ack_write)],
                stdin=read_fd,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,
                pass_fds=(ack_write,),
            )
            output, _ = launcher.communicate()
        finally:
            os.close(read_fd)
            os.close(ack_write)
        self.pid = int(output.strip())
        header = dict(self.header, resume=resume) if resume else self.header
        data = json.dumps(header).encode() + b"\n"
        while data:
            data = data[os.write(write_fd, data) :]
        os.set_blocking(write_fd, False)
        os.set_blocking(ack_read, False)
        self._fd, self._ack_fd, self._dead, self._ack_buffer = write_fd, ack_read, False, b""

    def send(self, step: list) -> None:
        """Hand over one step ``[step_id, timestamp_s, step_latency_s, slices]``."""
        data = json.dumps(step).encode() + b"\n"
        with self._lock:
            self.counts.relayed += 1
            self._last_step_id = step[0]
            if self._fallback is not None:
                self._fallback.add(step)
                return
            self._retain(step[0], data)
            self._write_some()
            if self._dead:
                self._replace_delivery()

    def _retain(self, step_id: int, data: bytes) -> None:
        self._retained.append((step_id, data))
        self._retained_bytes += len(data)
        while self._retained_bytes > self.max_retained_bytes and self._written > 0:
            self._forget_first()
            self.counts.unprotected += 1
        if self._retained_bytes > self.max_retained_bytes and self._written < len(self._retained) - 1:
            self._retained.pop()
            self._retained_bytes -= len(data)
            self.counts.lost += 1
            now = time.monotonic()
            if now - self._last_loss_log_s >= OUTAGE_LOG_INTERVAL_S:
                self._last_loss_log_s = now
                log.error(
                    "llmvisor: the delivery process (pid %d) takes no steps and %d bytes of them wait in the engine; "
                    "dropped step %d (%d dropped so far): they show as gaps of run %s",
                    self.pid, self._retained_bytes, step_id, self.counts.lost, self.header["columns"]["run_id"],
                )

    def _forget_first(self) -> None:
        _step_id, data = self._retained.popleft()
        self._retained_bytes -= len(data)
        self._written -= 1

    def _write_some(self) -> None:
        """Write waiting steps to the pipe until it is full (non-blocking); marks the delivery process dead if
        the pipe is broken."""
        while self._written < len(self._retained) and not self._dead:
            parts, size, offset = [], 0, self._partial
            for k in range(self._written, len(self._retained)):
                data = self._retained[k][1]
                parts.append(data[offset:] if offset else data)
                size += len(data) - offset
                offset = 0
                if size >= RELAY_WRITE_CHUNK_BYTES:
                    break
            try:
                n = os.write(self._fd, b"".join(parts))
            except BlockingIOError:
                return
            except (BrokenPipeError, OSError):
                self._dead = True
                return
            while n > 0:
                remaining = len(self._retained[self._written][1]) - self._partial
                if n >= remaining:
                    n -= remaining
                    self._written += 1
                    self._partial = 0
                else:
                    self._partial += n
                    n = 0

    def _read_reports(self) -> None:
        """Forget the steps the delivery process reports safe; an end of the report pipe means it died."""
        while True:
            try:
                chunk = os.read(self._ack_fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._dead = True
                break
            self._ack_buffer += chunk
        *lines, self._ack_buffer = self._ack_buffer.split(b"\n")
        if not lines:
            return
        trace_next, push_next, *window = (int(x) for x in lines[-1].split())
        self._trace_next = trace_next
        self._windows_resume = {"push_next": push_next, "window_floor_us": window[0]} if window else {}
        safe_before = min(trace_next, push_next)
        while self._retained and self._written > 0 and self._retained[0][0] < safe_before:
            self._forget_first()

    def _watch(self) -> None:
        """The watcher thread: write what waits when the pipe has room, read the reports, replace a dead
        delivery process, whether or not the engine sends steps."""
        while not self._stop.is_set():
            with self._lock:
                if self._fallback is not None:
                    return
                fd, ack_fd, waiting = self._fd, self._ack_fd, self._written < len(self._retained)
            try:
                select.select([ack_fd], [fd] if waiting else [], [], RELAY_WATCH_INTERVAL_S)
            except (OSError, ValueError):  # replaced or closed meanwhile
                time.sleep(RELAY_WATCH_INTERVAL_S)
            with self._lock:
                if self._stop.is_set() or self._fallback is not None or self._fd < 0:
                    return
                self._read_reports()
                self._write_some()
                if self._dead:
                    self._replace_delivery()

    def _replace_delivery(self) -> None:
        """The delivery process is gone: start another and send it every step not reported safe."""
        old_pid = self.pid
        for fd in (self._fd, self._ack_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd = self._ack_fd = -1
        now = time.monotonic()
        self._restarts.append(now)
        while self._restarts and now - self._restarts[0] > DELIVERY_RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > MAX_DELIVERY_RESTARTS:
            self._take_over(f"{len(self._restarts)} delivery processes died within {DELIVERY_RESTART_WINDOW_S:g} s")
            return
        try:
            self._start_delivery({"trace_next": self._trace_next, **self._windows_resume})
        except (OSError, ValueError) as error:
            self._take_over(f"a new delivery process could not be started ({error})")
            return
        self.counts.restarts += 1
        self.counts.resent += len(self._retained)
        self._written = self._partial = 0
        log.error(
            "llmvisor: the delivery process (pid %d) of run %s died with %d steps not yet safe; started delivery "
            "process %d and sent them to it again (%d restarts, %d steps re-sent so far)",
            old_pid, self.header["columns"]["run_id"], len(self._retained), self.pid, self.counts.restarts, self.counts.resent,
        )
        self._write_some()

    def _take_over(self, reason: str) -> None:
        """Deliver from this process from now on, starting with every step not reported safe."""
        log.error(
            "llmvisor: %s; delivering the steps of run %s from the engine process from now on (%d waiting)",
            reason, self.header["columns"]["run_id"], len(self._retained),
        )
        header = dict(self.header, resume={"trace_next": self._trace_next, **self._windows_resume})
        self._fallback = StepDelivery.from_env(header, trace_from=self._trace_next)
        for _step_id, data in self._retained:
            item = json.loads(data)
            if isinstance(item, dict):  # the end-of-run record (`close`)
                self._fallback.end_run(item["end"])
            else:
                self._fallback.add(item)
        self.counts.resent += len(self._retained)
        self._retained.clear()
        self._retained_bytes = self._written = self._partial = 0

    def flush(self, timeout_s: float = RELAY_CLOSE_TIMEOUT_S) -> bool:
        """Write whatever waits in this process to the pipe, waiting up to ``timeout_s`` for room; False if
        some steps still wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._fallback is not None:
                    self._fallback.flush()
                    return True
                self._write_some()
                if self._dead:
                    self._replace_delivery()
                    continue
                if self._written == len(self._retained) or time.monotonic() >= deadline:
                    return self._written == len(self._retained)
                fd = self._fd
            try:
                select.select([], [fd], [], min(0.1, max(deadline - time.monotonic(), 0.0)))
            except (OSError, ValueError):
                pass

    def end_record(self) -> dict:
        """The end-of-run record of a clean shutdown: the last step id relayed and how many steps were (the recorder
        numbers them from 0, so steps lost on the way, in the engine or after it, show as a gap up to that id)."""
        return {"last_step_id": self._last_step_id, "num_steps": self.counts.relayed}

    def close(self) -> None:
        """Send the rest, then the end-of-run record, and close the pipe; the delivery process then finishes on its
        own. The record goes last, as a line of its own, kept like a step until the pipe closes (a replacement
        delivery process gets it again); a pipe that closes without it (the engine was killed) leaves the run open."""
        if self._stop.is_set():
            return
        with self._lock:
            if self._fallback is not None:
                self._fallback.end_run(self.end_record())
            else:
                end = json.dumps({"end": self.end_record()}).encode() + b"\n"
                self._retained.append((self._last_step_id + 1, end))  # never reported safe: step ids stay below it
                self._retained_bytes += len(end)
        complete = self.flush()
        self._stop.set()
        self._thread.join(5.0)
        with self._lock:
            if not complete:
                unsent = sum(1 for _id, data in list(self._retained)[self._written :] if not data.startswith(b'{"end"'))
                self.counts.lost += unsent
                log.error(
                    "llmvisor: the delivery process (pid %d) took no steps for %g s; %d steps of run %s that wait in "
                    "the engine are lost (gaps)", self.pid, RELAY_CLOSE_TIMEOUT_S, unsent, self.header["columns"]["run_id"],
                )
            for fd in (self._fd, self._ack_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._ack_fd = -1
            if self._fallback is not None:
                self._fallback.close()
            counts = self.counts
            level = logging.ERROR if counts.lost or counts.unprotected else logging.INFO
            log.log(
                level,
                "llmvisor: relayed %d steps of run %s (%d delivery process restarts, %d steps re-sent, %d left "
                "unprotected by the memory bound, %d lost in the engine)",
                counts.relayed, self.header["columns"]["run_id"], counts.restarts, counts.resent, counts.unprotected, counts.lost,
            )


def process_running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_for_delivery(pid: int, timeout_s: float = DELIVERY_CLOSE_TIMEOUT_S + 10.0) -> bool:
    """Wait until the delivery process ``pid`` has finished; False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while process_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def deliver(read_fd: int = 0, ack_fd: int | None = None) -> int:
    """The delivery process: read the relay's header and steps from ``read_fd`` until it closes, reporting on
    ``ack_fd`` (``"<trace_next> <push_next>[ <window_floor_us>]"`` lines, `StepDelivery.safe_from`) what is safe so far."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"(llmvisor-delivery pid={os.getpid()}) %(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    port = os.environ.get(ENV_DELIVERY_METRICS_PORT)
    if port:
        try:
            prometheus_client.start_http_server(int(port), addr="127.0.0.1")
        except OSError as error:  # a replacement delivery process finds the port still taken
            log.warning("llmvisor: cannot serve delivery metrics on port %s (%s)", port, error)
    if ack_fd is not None:
        os.set_blocking(ack_fd, False)
    buffer = bytearray()
    delivery: StepDelivery | None = None
    torn = 0
    reported = None
    reported_at_s = 0.0
    while True:
        ready, _, _ = select.select([read_fd], [], [], 0.2)
        chunk = os.read(read_fd, 1 << 20) if ready else None
        if chunk == b"":
            torn = 1 if buffer.strip() else 0
            break
        if chunk:
            buffer += chunk
            *lines, rest = bytes(buffer).split(b"\n")
            buffer = bytearray(rest)
            for line in lines:
                if delivery is None:
                    header = json.loads(line)
                    resume = header.get("resume") or {}
                    delivery = StepDelivery.from_env(header, trace_from=resume.get("trace_next"))
                    log.info("llmvisor: delivering steps of run %s%s", header["columns"]["run_id"],
                             " (replacing a delivery process that died)" if header.get("resume") else "")
                else:
                    item = json.loads(line)
                    if isinstance(item, dict):  # the end-of-run record, after the last step
                        delivery.end_run(item["end"])
                    else:
                        delivery.add(item)
        if delivery is not None:
            delivery.flush()
            # at most every DELIVERY_REPORT_INTERVAL_S: each report wakes a thread of the engine's process
            due = ack_fd is not None and time.monotonic() - reported_at_s >= DELIVERY_REPORT_INTERVAL_S
            safe = delivery.safe_from() if due else None
            if safe is not None and safe != reported:
                try:
                    os.write(ack_fd, (" ".join(map(str, safe)) + "\n").encode())
                    reported, reported_at_s = safe, time.monotonic()
                except (BlockingIOError, BrokenPipeError):
                    pass
    if delivery is None:
        return 0
    if delivery.end is None and delivery.next_step_id is not None:
        # The pipe closed without the engine's record: vLLM's default shutdown kills the engine core before the
        # recorder's shutdown runs (as does a crash). What is known then is the last step received here: steps
        # lost after this process had them (dropped, rejected) still show as a lost tail.
        delivery.end_run({"last_step_id": delivery.next_step_id - 1, "num_steps": delivery.next_step_id})
    complete = delivery.close()
    pusher = delivery.pusher if delivery.windows is None else delivery.windows.pusher
    stats = pusher.stats if pusher is not None else None
    if delivery.windows is not None:
        windows = delivery.windows
        per_step = windows.step_pusher.stats if windows.step_pusher is not None else None
        log.info(
            "llmvisor: run %s metered in %d windows of engine class %s (model version %s, %s)%s; aggregation %.2f µs per step",
            delivery.header["columns"]["run_id"], windows.windows_sent, windows.engine_class, windows.models.version,
            windows.models.role or "none", "" if per_step is None else
            f", {windows.steps_sent_per_step} steps per step while the class had no model (service: {per_step.acknowledged} "
            f"acknowledged, {per_step.spooled} spooled, {per_step.replayed} replayed, {per_step.rejected} rejected)",
            1e6 * windows.aggregation_s / max(delivery.num_steps, 1),
        )
    log.info(
        "llmvisor: the engine closed the step relay; delivered %d steps of run %s%s%s%s",
        delivery.num_steps,
        delivery.header["columns"]["run_id"],
        f" (service: {stats.acknowledged} acknowledged, {stats.spooled} spooled, {stats.replayed} replayed, "
        f"{stats.rejected} rejected, {stats.dropped} dropped)" if stats is not None else "",
        "" if complete else f"; some are not acknowledged yet and stay in the spool {pusher.spool_path}",
        f"; {torn} torn step at the end skipped" if torn else "",
    )
    return 0


def _main(argv: list[str]) -> int:
    ack_fd = int(argv[argv.index("--ack-fd") + 1]) if "--ack-fd" in argv else None
    return deliver(0, ack_fd)



# ---------------------------------------------------------------------------------------------------------
# Window aggregates (issue #22): with ``LLMVISOR_STORE_STEPS=0`` the delivery process attributes the steps with the
# model that bills its class (the class's active version, else the service's `serve --model` or `--fallback-model`
# where those bill it: `ActiveModelCache`) and sends one aggregate per window (`llmvisor.metering`) instead of every
# step. A window closed while the class has no model goes per step, so the service stores those steps pending
# (measured time kept, shown in totals and gaps) and attributes them, exactly, when a model is activated.

ENV_STORE_STEPS = "LLMVISOR_STORE_STEPS"
ENV_WINDOW_S = "LLMVISOR_WINDOW_S"
MODEL_REFRESH_INTERVAL_S = 5.0
WINDOWS_PATH = "/v1/windows"
HELD_PATH = "/v1/windows/held"
MAX_STEPS_WAITING_FOR_HELD = 20_000
"""Steps a replacement delivery process keeps while the service cannot say what it holds of the run; beyond
that it resumes from its predecessor's last report and the spool alone."""


def store_steps_from_env() -> bool:
    """Every step to the service (``LLMVISOR_STORE_STEPS=1``, the default); ``0``: window aggregates."""
    value = os.environ.get(ENV_STORE_STEPS, "1").strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", ""):
        raise ValueError(f"{ENV_STORE_STEPS}={value!r}: give 1 or 0")
    return value in ("1", "true", "yes")


def window_s_from_env() -> float:
    raw = os.environ.get(ENV_WINDOW_S, str(DEFAULT_WINDOW_S))
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{ENV_WINDOW_S}={raw!r}: give a positive number of seconds")
    return value


class ActiveModelCache:
    """The model that bills one engine class, from the service's registry (``GET /v1/models/{class}/active``: its
    active version, else the service's ``--model`` or ``--fallback-model`` where those bill it), cached: asked at
    most every ``refresh_interval_s``, the model read again only when the version changes. While the service
    cannot be asked, the cached model stays in use; with none (the class has no model, or the service was never
    reached), the steps are sent per step and the service attributes them or stores them pending."""

    def __init__(self, client: httpx.Client, engine_class: str, *, refresh_interval_s: float = MODEL_REFRESH_INTERVAL_S):
        self.client, self.engine_class, self.refresh_interval_s = client, engine_class, refresh_interval_s
        self.version: int | None = None
        self.role: str | None = None
        self.model: StepLatencyModel | None = None
        self._checked_s = -1e18

    def __call__(self) -> tuple[StepLatencyModel, int] | None:
        now = time.monotonic()
        if now - self._checked_s >= self.refresh_interval_s:
            self._checked_s = now
            self._refresh()
        return None if self.model is None else (self.model, self.version)

    def _refresh(self) -> None:
        if not self.engine_class:
            return  # steps without a fingerprint: per step, the service bills them with its --model
        try:
            answer = self.client.get(f"/v1/models/{urllib.parse.quote(self.engine_class, safe='')}/active")
            if answer.status_code == 404:
                if self.model is not None:
                    log.warning("llmvisor: engine class %s has no model any more; its steps go per step", self.engine_class)
                self.model = self.version = self.role = None
                return
            if answer.status_code != 200:
                return
            data = answer.json()
            version, role = int(data["version"]), str(data.get("role", "active"))
            if version == self.version and self.model is not None:
                return
            self.model, self.version, self.role = StepLatencyModel.from_dict(data["model"], source="/v1/models"), version, role
            log.info("llmvisor: attributing engine class %s at the edge with model version %d (%s)", self.engine_class, version, role)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, LlmvisorError) as problem:
            log.warning("llmvisor: cannot read the model of engine class %s (%s); keeping version %s",
                        self.engine_class, problem, self.version)


class WindowPusher:
    """Send window aggregates to ``POST /v1/windows`` in the background; spool them to ``<spool>.windows.jsonl``
    while the service cannot take them, replayed when it answers (ingest is idempotent per window). A window the
    service refuses for its content (409, 413, 422) goes to ``<spool>.windows.rejected.jsonl``, logged and
    counted. A POST carries at most ``max_batch_windows`` windows and, beyond its first, ``max_batch_bytes``
    (a window lists every request of its steps: a busy engine's can take hundreds of kilobytes)."""

    def __init__(self, url: str, api_key: str, spool_path: str | os.PathLike = DEFAULT_SPOOL, *, max_batch_windows: int = 200,
                 max_batch_bytes: int = 4 << 20, flush_interval_s: float = 0.1, request_timeout_s: float = 10.0,
                 retry_interval_s: float = 2.0):
        self.client = httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"}, timeout=request_timeout_s)
        self.spool_path = Path(f"{spool_path}.windows.jsonl")
        self.replay_path = Path(f"{spool_path}.windows.replaying")
        self.rejected_path = Path(f"{spool_path}.windows.rejected.jsonl")
        self.max_batch_windows, self.max_batch_bytes = max_batch_windows, max_batch_bytes
        self.flush_interval_s, self.retry_interval_s = flush_interval_s, retry_interval_s
        self.stats = PusherStats()
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, str]] = deque()  # (seq, the window's JSON)
        self._next_seq = 0
        self._unsettled: set[int] = set()
        self._next_try_s = 0.0
        self._spool_lock = threading.Lock()  # the spool files are read whole (`spooled_windows`) between renames
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="llmvisor-window-pusher", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> WindowPusher | None:
        url = service_url_from_env()
        return cls(url, os.environ[ENV_KEY], os.environ.get(ENV_SPOOL, DEFAULT_SPOOL)) if url else None

    def push(self, window: WindowAggregate) -> int:
        text = json.dumps(window.to_json())
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._unsettled.add(seq)
            self._queue.append((seq, text))
        self.stats.add(pushed=1)
        return seq

    def settled_windows(self) -> int:
        """How many of the first windows pushed are settled (acknowledged, spooled or rejected)."""
        with self._lock:
            return min(self._unsettled) if self._unsettled else self._next_seq

    def _settle(self, batch: list[tuple[int, str]]) -> None:
        with self._lock:
            self._unsettled.difference_update(seq for seq, _ in batch)

    def _batches(self, windows: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
        out: list[list[tuple[int, str]]] = []
        size = 0
        for item in windows:
            if not out or len(out[-1]) >= self.max_batch_windows or size + len(item[1]) > self.max_batch_bytes:
                out.append([])
                size = 0
            out[-1].append(item)
            size += len(item[1]) + 1
        return out

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            with self._lock:
                taken = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch_windows))]
            for batch in self._batches(taken):
                self._send_or_spool(batch)
            if time.monotonic() >= self._next_try_s and not self._out_of_time():
                self._replay()
            if stopping and not self._queue:
                return
            if not taken:
                time.sleep(self.flush_interval_s)

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _send_or_spool(self, batch: list[tuple[int, str]]) -> None:
        if time.monotonic() < self._next_try_s or self._out_of_time() or not self._deliver(batch):
            self._write(self.spool_path, [w for _, w in batch])
            self.stats.add(spooled=len(batch))
        self._settle(batch)

    def _deliver(self, batch: list[tuple[int, str]]) -> bool:
        """POST the batch; False when the service cannot take it now (spool it). Refused windows are rejected."""
        body = ('{"windows":[' + ",".join(w for _, w in batch) + "]}").encode()
        delay_s = 0.1
        for attempt in range(4):
            try:
                response = self.client.post(WINDOWS_PATH, content=body, headers={"Content-Type": "application/json"})
                if response.status_code < 500 and response.status_code not in (401, 403, 429):
                    break
                reason = f"HTTP {response.status_code}"
            except httpx.HTTPError as problem:
                reason = f"{type(problem).__name__}: {problem}"
            self.stats.add(failed_posts=1)
            if attempt == 3 or self._out_of_time():
                self.stats.last_error = reason
                self._next_try_s = time.monotonic() + self.retry_interval_s
                return False
            time.sleep(delay_s * (0.5 + random.random()))
            delay_s *= 2
        if response.status_code == 200:
            result = response.json()
            self.stats.add(acknowledged=result["windows_inserted"], duplicate=result["windows_duplicate"])
            return True
        if response.status_code == 409 and len(batch) > 1 and "duplicate_of" in (refusal := response.json()):
            # every window of a run refused as a re-send of another run is refused: keep them at once, send the rest
            mine = [json.loads(w).get("run_id") == refusal.get("run_id") for _, w in batch]
            if any(mine) and not all(mine):
                kept = [item for item, m in zip(batch, mine) if m]
                rest = [item for item, m in zip(batch, mine) if not m]
                return self._deliver(kept) and self._deliver(rest)
        if len(batch) > 1 and not (response.status_code == 409 and "duplicate_of" in response.json()):
            # find the refused windows by halving; the others go through
            middle = len(batch) // 2
            return self._deliver(batch[:middle]) and self._deliver(batch[middle:])
        self._write(self.rejected_path, [w for _, w in batch])
        self.stats.add(rejected=len(batch))
        self.stats.last_error = _detail(response)
        first = json.loads(batch[0][1])
        log.error("llmvisor service rejected window %s of run %s: HTTP %d %s; kept in %s", first.get("window_start_us"),
                  first.get("run_id"), response.status_code, _detail(response), self.rejected_path)
        return True

    def _write(self, path: Path, windows: list[str]) -> None:
        with self._spool_lock, open(path, "a", encoding="utf-8") as handle:
            handle.write("".join(w + "\n" for w in windows))
            handle.flush()
            os.fsync(handle.fileno())

    def _replay(self) -> None:
        """Send the spooled windows again as they were written (byte for byte: a window the service has is a
        duplicate); the file is renamed first and removed once the service has them all."""
        with self._spool_lock:
            if not self.replay_path.exists():
                if not self.spool_path.exists():
                    return
                os.replace(self.spool_path, self.replay_path)
        windows = []
        for line in self.replay_path.read_text(encoding="utf-8").splitlines():
            try:
                json.loads(line)
            except ValueError:
                log.error("llmvisor window spool %s: an unreadable line skipped (a torn write?)", self.replay_path)
                continue
            windows.append((-1, line))
        for batch in self._batches(windows):
            if not self._deliver(batch):
                return
        self.replay_path.unlink()
        self.stats.add(replayed=len(windows))
        log.warning("llmvisor: replayed %d windows from the spool", len(windows))

    def spooled_windows(self, run_id: str) -> list[dict]:
        """The windows of ``run_id`` in the spool files (each is replayed as it is, never rebuilt), read while
        no replay moves them; a torn line is skipped."""
        out = []
        with self._spool_lock:
            for path in (self.replay_path, self.spool_path):
                try:
                    lines = path.read_text(encoding="utf-8").splitlines()
                except FileNotFoundError:
                    continue
                for line in lines:
                    try:
                        window = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(window, dict) and window.get("run_id") == run_id:
                        out.append(window)
        return out

    def ask_held(self, run_id: str, from_step_id: int) -> dict:
        """``GET /v1/windows/held``: what the service holds of ``run_id`` from step ``from_step_id`` on (its step
        ranges, its last window's end); an `httpx.HTTPError` when it cannot say."""
        response = self.client.get(HELD_PATH, params={"run_id": run_id, "from_step_id": from_step_id})
        response.raise_for_status()
        return response.json()

    def pending_windows(self) -> int:
        spooled = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (self.spool_path, self.replay_path) if p.exists())
        return len(self._queue) + spooled

    def close(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued and replay the spool for up to ``timeout_s``; True if the service has every window."""
        self._deadline = time.monotonic() + timeout_s
        self._next_try_s = 0.0
        self._stop.set()
        self._thread.join(timeout_s + 5.0)
        self.client.close()
        return self.pending_windows() == 0


class WindowDelivery:
    """The delivery process's window mode: steps into a `WindowAggregator`, closed windows to a `WindowPusher`;
    a window closed while its class has no model at the edge goes per step to ``step_pusher`` (the service then
    attributes those steps with the model it picks, or stores them pending until a model is activated; see
    `ActiveModelCache`). ``push_next`` reports the first step the service does not have (acknowledged or
    spooled) yet, whichever way it went.

    A delivery process that replaces one that died (the header has ``resume``) is sent again every step its
    predecessor had not reported safe, some of them in windows the service stored or the spool holds since
    (reports lag, and a window closed by the clock would be rebuilt with other steps: a 409). So before it
    aggregates, it reads the spool files' windows and steps of the run, then asks the service what it holds
    (``GET /v1/windows/held``; in that order, so a spooled window replayed meanwhile is in the service's answer):
    those steps are skipped, and its first window starts at or after the last window held ends
    (`WindowAggregator.resume_after`). A spooled window is replayed as written, never rebuilt. While the service
    cannot answer, the steps wait (at most `MAX_STEPS_WAITING_FOR_HELD`, then, or at close, it resumes from the
    report and the spool alone and logs it)."""

    def __init__(self, header: dict, pusher: WindowPusher, *, window_s: float, step_pusher: StepPusher | None = None):
        columns = header["columns"]
        resume = header.get("resume") or {}  # a delivery process that died sent the windows before these
        fingerprint = header.get("engine_fingerprint") or {}
        self.header = header
        self.engine_class = str(columns.get(FINGERPRINT_COLUMN) or fingerprint.get("id") or "")
        self.models = ActiveModelCache(pusher.client, self.engine_class)
        # Each window is counted on this process's metrics as it closes (llmvisor.metering.prometheus: they reach
        # vLLM's /metrics through PROMETHEUS_MULTIPROC_DIR).
        self.aggregator = WindowAggregator(columns["run_id"], self.engine_class, self.models, window_s=window_s,
                                           unattributed_steps=step_pusher is not None, first_step_id=resume.get("push_next"),
                                           floor_us=resume.get("window_floor_us") or 0, on_close=edge_metrics().record_window)
        self.pusher = pusher
        self.step_pusher = step_pusher
        # what was pushed, oldest first, until settled: (0 window | 1 per step, the count of its pusher's first
        # pushes that must be settled for it to be, its first step id, its window's start)
        self._pushed: deque[tuple[int, int, int, int]] = deque()
        self._steps_pushed = 0
        self.windows_sent = 0
        self.steps_sent_per_step = 0
        self.aggregation_s = 0.0
        self._resume_from = int(resume.get("push_next") or 0)
        self._held_known = header.get("resume") is None  # a first delivery process: its run has nothing stored
        self._waiting: list[list] = []  # steps received before the service said what it holds
        self._next_ask_s = 0.0
        self._asked = 0
        if not self._held_known:
            self._resume_after_held()

    def add(self, step: list) -> None:
        if not self._held_known:
            self._waiting.append(step)
            if len(self._waiting) >= MAX_STEPS_WAITING_FOR_HELD:
                self._resume_after_held(final=True)
            return
        started = time.perf_counter()
        closed = self.aggregator.add(step[0], step[1], step[2], step[3])
        self.aggregation_s += time.perf_counter() - started
        self._push(closed)

    def tick(self) -> None:
        """Close a window the clock has passed (an idle engine sends no step that would)."""
        if not self._held_known:
            if time.monotonic() < self._next_ask_s:
                return
            self._resume_after_held()
            if not self._held_known:
                return
        self._push(self.aggregator.close_due(time.time()))

    def _resume_after_held(self, *, final: bool = False) -> None:
        """Resume after what the spool and the service hold of the run (see the class); with ``final``, from
        the predecessor's report and the spool alone if the service cannot say."""
        run_id = self.aggregator.run_id
        held: list = []
        floor_us = 0
        for window in self.pusher.spooled_windows(run_id):  # the spool first: see the class
            try:
                held += union_ranges(window.get("step_ranges") or [])
                floor_us = max(floor_us, int(window.get("window_end_us") or 0))
            except (LlmvisorError, TypeError, ValueError):
                continue  # not a window this llmvisor wrote: the service refuses it on replay, and says so
        if self.step_pusher is not None:
            held += [[i, i] for i in self.step_pusher.spooled_step_ids(run_id)]
        self._asked += 1
        try:
            answer = self.pusher.ask_held(run_id, self._resume_from)
            service_ranges, last_end = answer["step_ranges"], answer["last_window_end_us"]
            self.aggregator.resume_after([*held, *service_ranges], max(floor_us, int(last_end or 0)))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, LlmvisorError) as problem:
            if not final:
                if self._asked == 1:
                    log.warning("llmvisor: cannot ask the service what it holds of run %s (%s); its steps wait until it "
                                "answers (at most %d)", run_id, problem, MAX_STEPS_WAITING_FOR_HELD)
                self._next_ask_s = time.monotonic() + self.pusher.retry_interval_s
                return
            log.error("llmvisor: the service cannot say what it holds of run %s (%s); resuming from the dead delivery "
                      "process's last report and the spool alone: a window it sent after that report may be refused (409)",
                      run_id, problem)
            self.aggregator.resume_after(held, floor_us)
            service_ranges, last_end = [], None
        self._held_known = True
        log.info("llmvisor: run %s resumes after what the service and the spool hold: %d step ranges from step %d on "
                 "skipped, windows from %d µs on", run_id, len(union_ranges([*held, *service_ranges])), self._resume_from,
                 self.aggregator.closed_until_us)
        waiting, self._waiting = self._waiting, []
        for step in waiting:
            self.add(step)

    def _push(self, closed: list) -> None:
        for window in closed:
            if isinstance(window, WindowAggregate):
                self._pushed.append((0, self.pusher.push(window) + 1, window.step_ranges[0][0], window.window_start_us))
                self.windows_sent += 1
                continue
            for step in window.steps:
                self.step_pusher.push_step(step_rows(self.header, step))
            self._steps_pushed += len(window.steps)
            self._pushed.append((1, self._steps_pushed, window.steps[0][0], window.window_start_us))
            self.steps_sent_per_step += len(window.steps)

    def push_next(self, next_step_id: int) -> tuple[int, int]:
        """(the first step the service does not have yet, the start of its window): a replacement delivery
        process resumes there (`WindowAggregator`'s ``first_step_id`` and ``floor_us``)."""
        if not self._held_known:  # nothing sent yet
            return (self._waiting[0][0] if self._waiting else next_step_id), self.aggregator.closed_until_us
        settled = (self.pusher.settled_windows(), self.step_pusher.settled_steps() if self.step_pusher is not None else 0)
        while self._pushed and settled[self._pushed[0][0]] >= self._pushed[0][1]:
            self._pushed.popleft()
        if self._pushed:
            return self._pushed[0][2], self._pushed[0][3]
        first_open = self.aggregator.first_open_step_id()
        if first_open is None:
            return next_step_id, self.aggregator.closed_until_us
        return first_open, self.aggregator.open_window_start_us

    def close(self, timeout_s: float) -> bool:
        if not self._held_known:
            self._resume_after_held(final=True)
        started = time.perf_counter()
        self._push(self.aggregator.close())
        self.aggregation_s += time.perf_counter() - started
        deadline = time.monotonic() + timeout_s
        complete = self.pusher.close(timeout_s)
        if self.step_pusher is not None:
            complete = self.step_pusher.close(max(deadline - time.monotonic(), 1.0)) and complete
        return complete


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
