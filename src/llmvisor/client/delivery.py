"""The delivery process: what the vLLM recorder's `llmvisor.client.relay.StepRelay` relays its steps to
(``python -m llmvisor.client --ack-fd N``). It writes the trace, sends the steps (`StepPusher`) or their window
aggregates (`llmvisor.client.windows`) to the service, reports back to the relay what is safe, and at the end sends
the end-of-run record (`send_run_end`)."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import time
import urllib.parse
from collections import deque

import httpx
import prometheus_client

from llmvisor.client.push import ENV_KEY, MAX_RETRY_WAIT_S, StepPusher, response_detail, service_url_from_env
from llmvisor.client.windows import WindowDelivery, WindowPusher, store_steps_from_env, window_s_from_env
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import TraceWriter
from llmvisor.retry import RetryableAnswer, check_answer, failure_reason, retry_policy

log = logging.getLogger("llmvisor.pusher")

ENV_DELIVERY_METRICS_PORT = "LLMVISOR_DELIVERY_METRICS_PORT"
DELIVERY_CLOSE_TIMEOUT_S = 30.0
DELIVERY_REPORT_INTERVAL_S = 0.1


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
        self.archive = archive_from_env(metadata)
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
    service is away or busy (`llmvisor.retry`); if it stays away the run stays open there (logged), its stored steps unaffected."""
    url = url or service_url_from_env()
    if not url:
        return False
    key = api_key if api_key is not None else os.environ.get(ENV_KEY, "")
    path = RUN_END_PATH.format(run_id=urllib.parse.quote(run_id, safe=""))
    policy = retry_policy(RUN_END_ATTEMPTS, backoff_s, MAX_RETRY_WAIT_S)
    with httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s) as client:
        try:
            response = policy(lambda: check_answer(client.post(path, json={"last_step_id": last_step_id, "num_steps": num_steps})))
        except RetryableAnswer as error:
            reason = f"{error.detail}: {response_detail(error.response)}"
        except httpx.HTTPError as error:
            reason = failure_reason(error)
        else:
            if response.status_code == 200:
                log.info("llmvisor: sent the end-of-run record of run %s (last step %d, %d steps; %d missing at the service)",
                         run_id, last_step_id, num_steps, response.json().get("num_missing", 0))
                return True
            reason = f"HTTP {response.status_code}: {response_detail(response)}"
    log.error("llmvisor: the service did not take the end-of-run record of run %s (%s); the run stays open there "
              "(a lost tail would not show as a gap)", run_id, reason)
    return False


def archive_from_env(metadata: dict | None):
    """The raw-step archive (``LLMVISOR_ARCHIVE_URL``, see llmvisor.archive), or None when not configured."""
    if not os.environ.get("LLMVISOR_ARCHIVE_URL"):
        return None
    from llmvisor.archive import ArchiveWriter

    return ArchiveWriter.from_env(metadata)

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


def main(argv: list[str]) -> int:
    """``python -m llmvisor.client [--ack-fd N]``: the delivery process, reading the relay's pipe on stdin."""
    ack_fd = int(argv[argv.index("--ack-fd") + 1]) if "--ack-fd" in argv else None
    return deliver(0, ack_fd)

