"""Window aggregates (issue #22): with ``LLMVISOR_STORE_STEPS=0`` the delivery process attributes the steps with the
model that bills its class (the class's active version, else the service's `serve --model` or `--fallback-model`
where those bill it: `ActiveModelCache`) and sends one aggregate per window (`llmvisor.metering`, by `WindowPusher`)
instead of every step. A window closed while the class has no model goes per step (`StepPusher`), so the service
stores those steps pending (measured time kept, shown in totals and gaps) and attributes them, exactly, when a model
is activated."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path

import httpx

from llmvisor.client.push import (
    DEFAULT_SPOOL,
    ENV_KEY,
    ENV_SPOOL,
    MAX_RETRY_WAIT_S,
    GzipPosts,
    PusherStats,
    StepPusher,
    env_switch,
    gzip_from_env,
    post_with_retries,
    response_detail,
    service_url_from_env,
)
from llmvisor.client.spool import append_lines, take_for_replay
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.relayed import NAMED_INDEX, step_rows
from llmvisor.errors import LlmvisorError
from llmvisor.metering import DEFAULT_WINDOW_S, WindowAggregate, WindowAggregator, union_ranges
from llmvisor.metering.prometheus import edge_metrics
from llmvisor.retry import RetryableAnswer, failure_reason

log = logging.getLogger("llmvisor.pusher")

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
    return env_switch(ENV_STORE_STEPS, True)


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


def window_line(window: WindowAggregate) -> str:
    """A window as the pusher queues, spools and sends it: its JSON on one line."""
    return json.dumps(window.to_json())


def windows_body(lines: list[str]) -> bytes:
    """One ``POST /v1/windows`` body of the windows' lines (`window_line`), before gzip (`llmvisor.client.push.gzip_body`)."""
    return ('{"windows":[' + ",".join(lines) + "]}").encode()


def window_batches(lines: list[str], *, max_windows: int, max_bytes: int) -> list[list[int]]:
    """The windows of each POST, as indexes into ``lines``: at most ``max_windows`` a POST and, beyond its first,
    ``max_bytes`` of their JSON."""
    out: list[list[int]] = []
    size = 0
    for index, line in enumerate(lines):
        if not out or len(out[-1]) >= max_windows or size + len(line) > max_bytes:
            out.append([])
            size = 0
        out[-1].append(index)
        size += len(line) + 1
    return out


class WindowPusher:
    """Send window aggregates to ``POST /v1/windows`` in the background; spool them to ``<spool>.windows.jsonl``
    while the service cannot take them, replayed when it answers (ingest is idempotent per window). A window the
    service refuses for its content (409, 413, 422) goes to ``<spool>.windows.rejected.jsonl``, logged and
    counted. A POST carries at most ``max_batch_windows`` windows and, beyond its first, ``max_batch_bytes``
    (a window lists every request of its steps: a busy engine's can take hundreds of kilobytes). A POST is tried
    ``max_attempts`` times (`llmvisor.retry`'s policy, as `StepPusher` does) before its windows are spooled; while
    the service refuses the key (401, 403) they are spooled at once, as while it is away. Bodies go gzip'd unless
    ``compress=False`` (``LLMVISOR_PUSH_GZIP=0`` for `from_env`), plain once the service shows it cannot read them
    (`llmvisor.client.push.GzipPosts`); the spool keeps the plain JSON lines."""

    def __init__(self, url: str, api_key: str, spool_path: str | os.PathLike = DEFAULT_SPOOL, *, max_batch_windows: int = 200,
                 max_batch_bytes: int = 4 << 20, flush_interval_s: float = 0.1, request_timeout_s: float = 10.0,
                 retry_interval_s: float = 2.0, max_attempts: int = 4, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = MAX_RETRY_WAIT_S, compress: bool = True):
        self.client = httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"}, timeout=request_timeout_s)
        self.spool_path = Path(f"{spool_path}.windows.jsonl")
        self.replay_path = Path(f"{spool_path}.windows.replaying")
        self.rejected_path = Path(f"{spool_path}.windows.rejected.jsonl")
        self.max_batch_windows, self.max_batch_bytes = max_batch_windows, max_batch_bytes
        self.flush_interval_s, self.retry_interval_s = flush_interval_s, retry_interval_s
        self.max_attempts, self.backoff_initial_s, self.backoff_max_s = max_attempts, backoff_initial_s, backoff_max_s
        self.stats = PusherStats()
        self.gzip_posts = GzipPosts(compress)
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
        return cls(url, os.environ[ENV_KEY], os.environ.get(ENV_SPOOL, DEFAULT_SPOOL), compress=gzip_from_env()) if url else None

    def push(self, window: WindowAggregate) -> int:
        text = window_line(window)
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
        batches = window_batches([w for _, w in windows], max_windows=self.max_batch_windows, max_bytes=self.max_batch_bytes)
        return [[windows[i] for i in batch] for batch in batches]

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
        body = windows_body([w for _, w in batch])
        try:
            response = post_with_retries(self.client, WINDOWS_PATH, body, self.stats, attempts=self.max_attempts,
                                         wait_s=self.backoff_initial_s, max_wait_s=self.backoff_max_s, give_up=self._out_of_time,
                                         headers={"Content-Type": "application/json"}, gzip_posts=self.gzip_posts)
        except (RetryableAnswer, httpx.HTTPError) as error:
            return self._unavailable(failure_reason(error))
        if response.status_code in (401, 403):  # the key is refused: the windows wait in the spool, as in an outage
            self.stats.add(failed_posts=1)
            return self._unavailable(f"HTTP {response.status_code}")
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
        self.stats.last_error = response_detail(response)
        first = json.loads(batch[0][1])
        log.error("llmvisor service rejected window %s of run %s: HTTP %d %s; kept in %s", first.get("window_start_us"),
                  first.get("run_id"), response.status_code, response_detail(response), self.rejected_path)
        return True

    def _unavailable(self, reason: str) -> bool:
        """The service cannot take windows now: spool them, try again after ``retry_interval_s``."""
        self.stats.last_error = reason
        self._next_try_s = time.monotonic() + self.retry_interval_s
        return False

    def _write(self, path: Path, windows: list[str]) -> None:
        with self._spool_lock:
            append_lines(path, windows)

    def _replay(self) -> None:
        """Send the spooled windows again as they were written (byte for byte: a window the service has is a
        duplicate); the file is renamed first and removed once the service has them all."""
        with self._spool_lock:
            if not take_for_replay(self.spool_path, self.replay_path):
                return
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
                                           floor_us=resume.get("window_floor_us") or 0, on_close=edge_metrics().record_window,
                                           kv_pool_blocks=columns.get("kv_pool_blocks"), kv_block_bytes=columns.get("kv_block_bytes"))
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
        closed = self.aggregator.add(step[0], step[1], step[2], step[3], step[4] if len(step) > 4 else None,
                                     step[NAMED_INDEX] if len(step) > NAMED_INDEX else None)
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

