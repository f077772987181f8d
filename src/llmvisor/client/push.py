"""Push each step's trace rows to the accounting service without blocking the engine.

`StepPusher.push_step` only appends to a bounded in-memory queue. A background thread sends the queue in
batches (one POST /v1/steps per batch, in the column form), retried by `llmvisor.retry`'s policy (jittered
exponential backoff, the service's Retry-After obeyed up to ``backoff_max_s``). When the service stays
unreachable, or the queue is full, steps go to a local JSONL spool file (trace format) instead, which is
replayed when the service answers again, and on the next start. Replays are safe because the service is
idempotent on (run_id, step_id): a step sent twice is acknowledged and counted once.

Bodies go gzip'd (``Content-Encoding: gzip``, `gzip_body`; the service inflates them before it reads them, so
what it stores and each step's content digest are those of the JSON) unless ``compress=False`` or
``LLMVISOR_PUSH_GZIP=0``; a service that cannot read them (`GzipPosts`) gets them plain from then on.

Steps the service rejects for their content (a 422, or a 409: same step id, different content) cannot be
fixed by retrying; they are moved to ``<spool>.rejected.jsonl``, logged as errors with the count and that
path (again in a summary at close), and counted in the Prometheus counter ``llmvisor_pusher_steps_rejected_total``.

Example::

    pusher = StepPusher("http://127.0.0.1:8080", api_key, "llmvisor-spool.jsonl")
    for step in engine_loop():
        pusher.push_step(rows_of(step))      # a list of trace-format row dicts
    pusher.close(timeout_s=30)               # send (or spool) what is left

or ``StepPusher.from_env()`` with ``LLMVISOR_SERVICE_URL``, ``LLMVISOR_SERVICE_KEY`` (an admin key) and
optionally ``LLMVISOR_SPOOL`` and ``LLMVISOR_PUSH_GZIP`` set.
"""

from __future__ import annotations

import gzip
import heapq
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import prometheus_client

from llmvisor.client.spool import append_steps, read_spool, take_for_replay
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.core.trace import REQUIRED_COLUMNS, SHARING_COLUMNS
from llmvisor.core.trace_schema import KV_COLUMNS, LORA_COLUMNS
from llmvisor.retry import RetryableAnswer, check_answer, failure_reason, retry_policy

log = logging.getLogger("llmvisor.pusher")

ENV_URL = "LLMVISOR_SERVICE_URL"
ENV_KEY = "LLMVISOR_SERVICE_KEY"
ENV_SPOOL = "LLMVISOR_SPOOL"
ENV_GZIP = "LLMVISOR_PUSH_GZIP"
DEFAULT_SPOOL = "llmvisor-spool.jsonl"
GZIP_LEVEL = 6
"""zlib's default level: window JSON comes out within a few percent of level 9's size, in less time."""
UNREAD_GZIP_STATUSES = (400, 415, 422)
"""Answers to a gzip body that may mean the service did not inflate it: 415 (it refuses the encoding), or 400 / 422
from a service older than gzip bodies, which read the gzip bytes as JSON."""

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
MAX_RETRY_WAIT_S = 5.0
"""The longest wait between two attempts of one send to the service (the backoff, or the service's Retry-After)."""
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


def env_switch(name: str, default: bool) -> bool:
    """A 1 / 0 environment variable (true / false, yes / no too); unset: ``default``."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().lower() not in ("0", "1", "true", "false", "yes", "no", ""):
        raise ValueError(f"{name}={value.strip().lower()!r}: give 1 or 0")
    return value.strip().lower() in ("1", "true", "yes")


def gzip_from_env() -> bool:
    """Bodies gzip'd (``LLMVISOR_PUSH_GZIP=1``, the default); ``0``: plain JSON."""
    return env_switch(ENV_GZIP, True)


def gzip_body(body: bytes) -> bytes:
    """A POST body as the pushers send it (``Content-Encoding: gzip``): level `GZIP_LEVEL`, no timestamp in the
    header, so one body is always the same bytes."""
    return gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)


class GzipPosts:
    """Whether one pusher's POSTs to its endpoint go gzip'd. On unless turned off, until the service shows it cannot
    read them: a gzip body answered 415, or 400 / 422 (a service older than gzip bodies reads the gzip bytes as JSON)
    where the same body sent plain is not, is sent plain again and every later one plain too (logged once). A 400 /
    422 that the plain body gets too is the body's own fault: gzip stays on."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def refused(self, path: str, gzip_answer: httpx.Response, plain_answer: httpx.Response) -> None:
        if gzip_answer.status_code == 415 or plain_answer.status_code not in UNREAD_GZIP_STATUSES:
            self.enabled = False
            log.warning("llmvisor: the service did not read a gzip body on %s (HTTP %d: %s); sending its bodies plain from now on",
                        path, gzip_answer.status_code, response_detail(gzip_answer))


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
    compress : send the bodies gzip'd (`GzipPosts`; ``LLMVISOR_PUSH_GZIP`` for `from_env`).

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
        backoff_max_s: float = MAX_RETRY_WAIT_S,
        retry_interval_s: float = 2.0,
        max_held_steps: int = DEFAULT_MAX_HELD_STEPS,
        compress: bool = True,
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
        self.gzip_posts = GzipPosts(compress)
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
        """A pusher configured from ``LLMVISOR_SERVICE_URL`` / ``_KEY`` / ``LLMVISOR_SPOOL`` / ``LLMVISOR_PUSH_GZIP``,
        or None if no URL."""
        url = service_url_from_env()
        if not url:
            return None
        return cls(url, os.environ[ENV_KEY], os.environ.get(ENV_SPOOL, DEFAULT_SPOOL), **{"compress": gzip_from_env(), **kwargs})

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
            steps = [step for path in (self.replay_path, self.spool_path) for step in read_spool(path)[0]]
        ids = (step[0].get("step_id") for step in steps if step and step[0].get("run_id") == run_id)
        return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]

    def pending_steps(self) -> int:
        """Steps not yet acknowledged: queued or being sent, or in the spool files."""
        return self._outstanding + len(self._held) + sum(
            len(read_spool(p)[0]) for p in (self.replay_path, self.spool_path) if p.exists()
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
        """One POST, retried by `llmvisor.retry`'s policy (connection errors, 5xx, 429; at most ``max_attempts``, not
        past close's deadline); raises `_Unavailable` when the retries run out."""
        body = columns_body(batch)
        self.stats.add(sent=len(batch))
        SENT_STEPS.inc(len(batch))
        try:
            return post_with_retries(self._client, "/v1/steps", body, self.stats, attempts=self.max_attempts,
                                     wait_s=self.backoff_initial_s, max_wait_s=self.backoff_max_s, give_up=self._out_of_time,
                                     gzip_posts=self.gzip_posts)
        except (RetryableAnswer, httpx.HTTPError) as error:
            raise _Unavailable(failure_reason(error)) from None

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
            raise _Unavailable(f"HTTP {status}: {response_detail(response)}")
        if status == 409 and "duplicate_of" in (refusal := response.json()):
            # the run repeats another under a new run id: the service refuses every step of it, so halving would not help
            bad = [step for step in batch if _step_key(step)[0] == refusal.get("run_id")] or batch
            self._reject(bad, response_detail(response))
            keep = [step for step in batch if _step_key(step)[0] != refusal.get("run_id")]
            if keep and len(bad) < len(batch):
                self._deliver(keep)
            return
        if status == 409:
            conflicting = {(c["run_id"], c["step_id"]) for c in response.json().get("conflicting_steps", [])}
            keep = [step for step in batch if _step_key(step) not in conflicting]
            bad = [step for step in batch if _step_key(step) in conflicting]
            if bad and len(keep) < len(batch):
                self._reject(bad, response_detail(response))
                if keep:
                    self._deliver(keep)
                return
        if len(batch) > 1 and status in (400, 409, 413, 422):
            # Find the steps the service refuses by halving; the others go through.
            middle = len(batch) // 2
            self._deliver(batch[:middle])
            self._deliver(batch[middle:])
            return
        self._reject(batch, f"HTTP {status}: {response_detail(response)}")

    def _reject(self, steps: list[list[dict]], reason: str) -> None:
        self.stats.last_error = reason
        try:
            with self._spool_lock:
                append_steps(self.rejected_path, steps)
            log.error("llmvisor service rejected %d step(s): %s; kept in %s", len(steps), reason, self.rejected_path)
        except (OSError, TypeError, ValueError) as error:
            log.error("llmvisor service rejected %d step(s): %s; they cannot be kept in %s either (%s)",
                      len(steps), reason, self.rejected_path, error)
        self.stats.add(rejected=len(steps))
        REJECTED_STEPS.inc(len(steps))
        self._settle(steps)

    def _write_spool(self, steps: list[list[dict]]) -> None:
        with self._spool_lock:
            append_steps(self.spool_path, steps)

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
            if not take_for_replay(self.spool_path, self.replay_path):
                return
        steps, unreadable = read_spool(self.replay_path)
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


PUSHED_OPTIONAL_COLUMNS = ("timestamp_s", *SHARING_COLUMNS, CACHED_PROMPT_COLUMN, FINGERPRINT_COLUMN, *KV_COLUMNS, *LORA_COLUMNS)
"""Optional trace columns the service reads (`llmvisor.service.ingest`), sent when the rows carry them: the KV
memory columns of format 3 too (the service meters them, issue #37), and format 4's LoRA columns (it prices and
meters adapters, issue #38)."""


def columns_body(steps: list[list[dict]]) -> bytes:
    """A POST /v1/steps body in the column form (several times cheaper to validate than one object per row).

    Only the columns the service reads are sent: those it stores, the shared-KV columns it prices with, the
    prefix-cache hits and KV memory-time it meters (`PUSHED_OPTIONAL_COLUMNS`) and the engine fingerprint id (checked against the
    service's model, not stored, not part of a step's idempotency key); a row missing a stored column is sent as
    null, which the service reports by row like any other bad value."""
    rows = [row for step in steps for row in step]
    names = [*REQUIRED_COLUMNS, *(name for name in PUSHED_OPTIONAL_COLUMNS if any(name in row for row in rows))]
    # One json.dumps per column rather than one for the body: each C call holds the GIL, and this runs in a
    # thread of the engine's process, whose step times are being measured.
    parts = [f"{json.dumps(name)}:{json.dumps([row.get(name) for row in rows])}" for name in names]
    return ('{"columns":{' + ",".join(parts) + "}}").encode()


def post_with_retries(client: httpx.Client, path: str, body: bytes, stats: PusherStats, *, attempts: int, wait_s: float,
                      max_wait_s: float, give_up: Callable[[], bool], headers: dict | None = None,
                      gzip_posts: GzipPosts | None = None) -> httpx.Response:
    """POST ``body`` to the service (gzip'd while ``gzip_posts`` says so, else plain, and plain again when the service
    did not read the gzip one: `GzipPosts`), retried by `llmvisor.retry`'s policy (jittered backoff), counting each
    failed attempt in ``stats.failed_posts``; the answer, or `RetryableAnswer` / `httpx.HTTPError` when the retries run
    out (or ``give_up()``)."""

    def post(content: bytes, extra: dict) -> httpx.Response:
        def attempt() -> httpx.Response:
            try:
                return check_answer(client.post(path, content=content, headers={**(headers or {}), **extra}))
            except (RetryableAnswer, httpx.HTTPError):
                stats.add(failed_posts=1)
                raise

        return retry_policy(attempts, wait_s, max_wait_s, jitter=True, give_up=give_up)(attempt)

    if gzip_posts is None or not gzip_posts.enabled:
        return post(body, {})
    answer = post(gzip_body(body), {"Content-Encoding": "gzip"})
    if answer.status_code not in UNREAD_GZIP_STATUSES:
        return answer
    plain = post(body, {})
    gzip_posts.refused(path, answer, plain)
    return plain


def _step_key(step: list[dict]) -> tuple:
    return (step[0].get("run_id"), step[0].get("step_id"))


def response_detail(response: httpx.Response) -> str:
    """The ``detail`` of the service's answer (its error body), else the start of the text."""
    try:
        return str(response.json().get("detail"))
    except (ValueError, AttributeError):
        return response.text[:500]
