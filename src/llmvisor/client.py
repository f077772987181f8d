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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import prometheus_client

from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.trace import REQUIRED_COLUMNS, TraceWriter

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


@dataclass
class PusherStats:
    """What became of the steps pushed so far (a step can be spooled and later acknowledged); ``dropped``
    counts steps lost because the queue was full and the spool file could not be written."""

    pushed: int = 0
    acknowledged: int = 0
    duplicate: int = 0
    spooled: int = 0
    replayed: int = 0
    rejected: int = 0
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
        self.stats = PusherStats()
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
        rows = [dict(row) for row in rows]  # the caller may reuse its dicts for the next step
        if not rows:
            raise ValueError("a step has at least one row")
        self.stats.add(pushed=1)
        with self._count_lock:
            self._outstanding += 1
        try:
            self._queue.put_nowait(rows)
        except queue.Full:
            with self._count_lock:
                self._outstanding -= 1
            self._spool([rows])

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every step pushed so far is acknowledged or rejected (the spool replayed too);
        False if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._next_try_s = 0.0
        while time.monotonic() < deadline:
            if self._outstanding == 0 and not self.spool_path.exists() and not self.replay_path.exists():
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
            if self.stats.rejected:
                log.error(
                    "llmvisor: the service rejected %d of %d step(s) pushed; they are NOT billed and kept in %s",
                    self.stats.rejected, self.stats.pushed, self.rejected_path,
                )
        return self.pending_steps() == 0

    def pending_steps(self) -> int:
        """Steps not yet acknowledged: queued or being sent, or in the spool files."""
        return self._outstanding + sum(len(_read_spool(p)[0]) for p in (self.replay_path, self.spool_path) if p.exists())

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
            if stopping and self._queue.empty():
                if self._paused() or not (self.spool_path.exists() or self.replay_path.exists()):
                    return

    def _send_or_spool(self, batch: list[list[dict]]) -> None:
        try:
            self._deliver(batch)
        except _Unavailable as error:
            self.stats.last_error = str(error)
            log.warning("llmvisor service unavailable (%s); spooling %d steps to %s", error, len(batch), self.spool_path)
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
            return
        if status in (401, 403):
            raise _Unavailable(f"HTTP {status}: {_detail(response)}")
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
        log.error("llmvisor service rejected %d step(s): %s; kept in %s", len(steps), reason, self.rejected_path)
        self.stats.last_error = reason
        with self._spool_lock:
            writer = TraceWriter(self.rejected_path, flush_every_steps=len(steps))
            for step in steps:
                writer.write_step(step)
            writer.close()
        self.stats.add(rejected=len(steps))
        REJECTED_STEPS.inc(len(steps))

    def _spool(self, steps: list[list[dict]]) -> None:
        try:
            with self._spool_lock:
                writer = TraceWriter(self.spool_path, flush_every_steps=len(steps))
                for step in steps:
                    writer.write_step(step)
                writer.close()
        except (OSError, TypeError, ValueError) as error:
            # Neither the engine loop nor this thread may die because the disk is full or a row cannot be
            # written as JSON; the loss is counted and logged.
            log.error("llmvisor pusher: cannot spool %d step(s) to %s (%s); dropped", len(steps), self.spool_path, error)
            self.stats.add(dropped=len(steps))
            return
        self.stats.add(spooled=len(steps))

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


def columns_body(steps: list[list[dict]]) -> bytes:
    """A POST /v1/steps body in the column form (several times cheaper to validate than one object per row).

    Only the columns the service stores are sent, and the engine fingerprint id (checked against the service's
    model, not stored, not part of a step's idempotency key); a row missing a stored column is sent as null,
    which the service reports by row like any other bad value."""
    rows = [row for step in steps for row in step]
    names = [*REQUIRED_COLUMNS, *(name for name in ("timestamp_s", FINGERPRINT_COLUMN) if any(name in row for row in rows))]
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


def step_rows(header: dict, step: list) -> list[dict]:
    """Trace rows of one relayed step ``[step_id, timestamp_s, step_latency_s, slices]``; each slice is
    ``[request_id, tenant, num_new_tokens, num_context_tokens, is_prefill, num_shared_context_tokens,
    effective_context_tokens]``, the header holds the rest."""
    step_id, timestamp_s, latency_s, slices = step
    constant = header["columns"]
    is_warmup = step_id < header["warmup_steps"]
    return [
        {
            "step_id": step_id,
            "step_latency_s": latency_s,
            "request_id": request_id,
            "tenant": str(tenant),
            "num_new_tokens": num_new,
            "num_context_tokens": num_context,
            "num_shared_context_tokens": num_shared,
            "effective_context_tokens": num_effective,
            "phase": "prefill" if is_prefill else "decode",
            "timestamp_s": timestamp_s,
            **constant,
            "is_warmup": is_warmup,
        }
        for request_id, tenant, num_new, num_context, is_prefill, num_shared, num_effective in slices
    ]


class StepDelivery:
    """Relayed steps to the trace file and the service: the delivery process's work (also the relay's
    fallback in the engine's own process if the delivery process is gone)."""

    def __init__(self, header: dict, pusher: StepPusher | None):
        self.header = header
        metadata = {"engine_fingerprint": header["engine_fingerprint"]} if header.get("engine_fingerprint") else None
        self.writer = (
            TraceWriter(header["trace_path"], flush_every_steps=1 << 62, metadata=metadata) if header.get("trace_path") else None
        )
        self.pusher = pusher
        self.num_steps = 0

    def add(self, step: list) -> None:
        rows = step_rows(self.header, step)
        if self.writer is not None:
            self.writer.write_step(rows)
        if self.pusher is not None:
            self.pusher.push_step(rows)
        self.num_steps += 1

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, timeout_s: float = DELIVERY_CLOSE_TIMEOUT_S) -> bool:
        """Write the trace's last steps and send (or spool) the pusher's; True if the service has them all."""
        if self.writer is not None:
            self.writer.close()
        return self.pusher.close(timeout_s) if self.pusher is not None else True


class StepRelay:
    """Engine side of the delivery process: ``send`` writes one encoded step to a pipe and returns.

    The delivery process is started through ``/bin/sh`` in the background, so its parent exits at once and it
    is not in the engine process's tree, which vLLM SIGKILLs at shutdown; it has its own session, so a
    Ctrl-C to the server's process group does not reach it. It ignores SIGINT and SIGTERM and ends when the
    pipe closes (the engine exited or was killed), after writing and pushing every whole step it received.
    The pipe is non-blocking: if the delivery process falls behind, steps wait in this process's memory
    and go out with the next ``send`` (or ``close``) rather than blocking the engine loop.
    """

    def __init__(self, header: dict):
        self.header = header
        read_fd, self._fd = os.pipe()
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, RELAY_PIPE_BYTES)
        except OSError:
            pass  # the system's limit is lower; the default pipe size still works
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        launcher = subprocess.Popen(
            # a background job's stdin is /dev/null unless redirected: the pipe goes through fd 3
            ["/bin/sh", "-c", 'exec 3<&0; "$0" -m llmvisor.client <&3 3<&- >&2 & echo $!', sys.executable],
            stdin=read_fd,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        output, _ = launcher.communicate()
        os.close(read_fd)
        self.pid = int(output.strip())
        self._pending = bytearray()
        self._fallback: StepDelivery | None = None
        self._send_now(json.dumps(header).encode() + b"\n", block=True)
        os.set_blocking(self._fd, False)

    def send(self, step: list) -> None:
        """Hand over one step ``[step_id, timestamp_s, step_latency_s, slices]``."""
        if self._fallback is not None:
            self._fallback.add(step)
            return
        self._send_now(json.dumps(step).encode() + b"\n", block=False)

    def _send_now(self, data: bytes, *, block: bool) -> None:
        self._pending += data
        try:
            while self._pending:
                written = os.write(self._fd, self._pending)
                del self._pending[:written]
        except BlockingIOError:
            if block:
                raise
        except BrokenPipeError:
            self._take_over()

    def _take_over(self) -> None:
        """The delivery process is gone: deliver from this process from now on (the steps still in the pipe
        when it died are lost; this is logged)."""
        log.error(
            "llmvisor: the delivery process (pid %d) exited early; delivering from the engine process from now on",
            self.pid,
        )
        self._fallback = StepDelivery(self.header, StepPusher.from_env())
        for line in bytes(self._pending).splitlines():
            try:
                step = json.loads(line)
            except ValueError:
                continue  # the rest of a line partly written to the pipe
            if isinstance(step, list):
                self._fallback.add(step)
        self._pending.clear()

    def flush(self) -> None:
        """Write whatever waits in this process to the pipe (blocking)."""
        if self._fallback is not None:
            self._fallback.flush()
        elif self._pending:
            os.set_blocking(self._fd, True)
            self._send_now(b"", block=True)
            os.set_blocking(self._fd, False)

    def close(self) -> None:
        """Send the rest and close the pipe; the delivery process then finishes on its own."""
        if self._fd < 0:
            return
        self.flush()
        os.close(self._fd)
        self._fd = -1
        if self._fallback is not None:
            self._fallback.close()


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


def deliver(read_fd: int = 0) -> int:
    """The delivery process: read the relay's header and steps from ``read_fd`` until it closes."""
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
        prometheus_client.start_http_server(int(port), addr="127.0.0.1")
    buffer = bytearray()
    delivery: StepDelivery | None = None
    torn = 0
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
                    delivery = StepDelivery(header, StepPusher.from_env())
                    log.info("llmvisor: delivering steps of run %s", header["columns"]["run_id"])
                else:
                    delivery.add(json.loads(line))
        if delivery is not None:
            delivery.flush()
    if delivery is None:
        return 0
    complete = delivery.close()
    log.info(
        "llmvisor: the engine closed the step relay; delivered %d steps of run %s%s%s",
        delivery.num_steps,
        delivery.header["columns"]["run_id"],
        "" if complete else f"; some are not acknowledged yet and stay in the spool {delivery.pusher.spool_path}",
        f"; {torn} torn step at the end skipped" if torn else "",
    )
    return 0


if __name__ == "__main__":
    sys.exit(deliver())
