"""The engine side of delivery out of the engine's process: `StepRelay` writes each step to a pipe as it ends, read
by a delivery process (`llmvisor.client.delivery`) that writes the trace and pushes. vLLM's default shutdown SIGKILLs
the engine-core process right after SIGTERM, so nothing left in that process's memory survives it; the delivery
process is not a child of the engine, so not in the process tree vLLM kills, and finishes when the pipe closes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from llmvisor.client.delivery import DELIVERY_CLOSE_TIMEOUT_S, StepDelivery
from llmvisor.client.push import OUTAGE_LOG_INTERVAL_S

log = logging.getLogger("llmvisor.pusher")

RELAY_PIPE_BYTES = 1 << 20
RELAY_RETAIN_BYTES = 256 << 20
"""Encoded steps the engine process keeps until the delivery process reports them safe (about 150,000 steps of
16 slices): what a delivery process that dies takes with it is sent again to the next one."""
RELAY_WRITE_CHUNK_BYTES = 256 << 10
RELAY_WATCH_INTERVAL_S = 0.1
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
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/
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
    import psutil  # in the [vllm] and [service] extras, the two that run a relay

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_delivery(pid: int, timeout_s: float = DELIVERY_CLOSE_TIMEOUT_S + 10.0) -> bool:
    """Wait until the delivery process ``pid`` has finished; False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while process_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True

