"""The engine side loses no step on the paths that used to lose them, each with a real delivery process and a
real `llmvisor serve`: bytes left in the relay when the pipe was full and the engine then idled and was
SIGKILLed; steps in the pipe when the delivery process died; steps the pusher could not spool (a directory
it cannot write to); and the recorder's flush thread at shutdown. The relay tests run in both delivery modes:
every step, and window aggregates (``LLMVISOR_STORE_STEPS=0``, the engine class's model active in the registry)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from _relay_engine import relay_header, relay_step
from _service_fixtures import class_model, make_steps, model_path  # noqa: F401
from llmvisor.client import StepPusher, WindowDelivery, WindowPusher, process_running, wait_for_delivery
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import TraceWriter
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregate, WindowAggregator
from llmvisor.service.process import ServerProcess, free_loopback_port
from test_service_client import ThreadServer

HERE = Path(__file__).resolve().parent


ENGINE_CLASS = "eeeeeeeeeeeeeeee"


@pytest.fixture(params=["steps", "windows"])
def service(model_path, tmp_path, request):  # noqa: F811
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    if request.param == "windows":
        ledger.add_model(ENGINE_CLASS, json.dumps(class_model(ENGINE_CLASS).to_dict()), "test", activate=True)
    server = ServerProcess(model_path, db_url, log_path=tmp_path / "service.log").start()
    server.mode = request.param
    yield server, ledger, key
    server.stop()
    ledger.close()


class RelayEngine:
    """`tests/_relay_engine.py` in a child process: the engine side of the relay, driven line by line; ``mode``
    "windows": its steps carry an engine class and the delivery process sends window aggregates."""

    def __init__(self, tmp_path: Path, url: str, key: str, run_id: str, mode: str = "steps"):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
            "LLMVISOR_SERVICE_URL": url,
            "LLMVISOR_SERVICE_KEY": key,
            "LLMVISOR_SPOOL": str(tmp_path / "spool.jsonl"),
        }
        if mode == "windows":
            env.update(LLMVISOR_STORE_STEPS="0", LLMVISOR_TEST_ENGINE_CLASS=ENGINE_CLASS)
        self.log_path = tmp_path / f"{run_id}.log"
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "_relay_engine.py"), run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, env=env, text=True,
        )
        self.delivery_pid = int(self.answer("pid")[1])

    def command(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def answer(self, word: str) -> list[str]:
        line = self.process.stdout.readline().split()
        assert line and line[0] == word, f"{line}\n{self.log_path.read_text(errors='replace')[-3000:]}"
        return line

    def ask(self, line: str, word: str) -> list[str]:
        self.command(line)
        return self.answer(word)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        self.kill()
        self.log.close()


def stored_steps(ledger: Ledger) -> int:
    return ledger.totals().num_steps


def wait_for_steps(ledger: Ledger, expected: int, timeout_s: float = 60.0, settle_s: float = 3.0) -> int:
    """Wait until the ledger holds ``expected`` steps, or their count has not moved for ``settle_s``."""
    deadline = time.monotonic() + timeout_s
    count, moved = stored_steps(ledger), time.monotonic()
    while count < expected and time.monotonic() < deadline and time.monotonic() - moved < settle_s:
        time.sleep(0.1)
        now = stored_steps(ledger)
        if now != count:
            count, moved = now, time.monotonic()
    return count


def assert_stored_as_the_mode_says(server, ledger: Ledger, run_id: str, n_steps: int, tmp_path: Path) -> None:
    """Every step once, attributed to the nanosecond; in window mode as windows (no step row), none refused."""
    from sqlalchemy import func, select

    from llmvisor.ledger.schema import steps as steps_table
    from llmvisor.ledger.schema import windows as windows_table

    totals = ledger.totals()
    assert totals.num_steps == n_steps and totals.attributed_ns == totals.measured_ns and totals.pending_steps == 0
    gaps = ledger.run_gaps(run_id)
    assert gaps.num_missing == 0 and gaps.num_received == n_steps
    with ledger._read_engine.connect() as conn:
        step_rows = conn.execute(select(func.count()).select_from(steps_table).where(steps_table.c.run_id == run_id)).scalar()
        window_steps = conn.execute(select(func.coalesce(func.sum(windows_table.c.num_steps), 0)).where(windows_table.c.run_id == run_id)).scalar()
    assert (step_rows, window_steps) == ((0, n_steps) if server.mode == "windows" else (n_steps, 0))
    assert not list(tmp_path.glob("spool.jsonl*rejected*"))


def test_sigkill_of_an_idle_engine_with_steps_waiting_for_a_full_pipe_loses_none(service, tmp_path):
    server, ledger, key = service
    engine = RelayEngine(tmp_path, server.url, key, "idle-kill", server.mode)
    delivery_pid = engine.delivery_pid
    try:
        os.kill(delivery_pid, signal.SIGSTOP)  # the delivery process falls behind: the 1 MiB pipe fills
        assert engine.ask("send 1500", "sent") == ["sent", "1500"]  # about 2.5 MB: the rest waits in the engine
        os.kill(delivery_pid, signal.SIGCONT)
        wait_for_steps(ledger, 1500, settle_s=10.0)  # the engine is idle now: nothing calls send() again (10 s: a busy machine)
        engine.kill()  # as vLLM's shutdown kills the engine core
        assert wait_for_delivery(delivery_pid, timeout_s=60)
        assert stored_steps(ledger) == 1500
        assert_stored_as_the_mode_says(server, ledger, "idle-kill", 1500, tmp_path)
        # killed: no record from the engine; the delivery process sends its own, the last step it received
        end = ledger.run_gaps("idle-kill").end
        assert end is not None and (end.last_step_id, end.num_steps) == (1499, 1500)
    finally:
        if process_running(delivery_pid):
            os.kill(delivery_pid, signal.SIGCONT)
        engine.stop()


def test_steps_in_the_pipe_when_the_delivery_process_dies_are_delivered(service, tmp_path):
    server, ledger, key = service
    engine = RelayEngine(tmp_path, server.url, key, "delivery-death", server.mode)
    first_pid = engine.delivery_pid
    try:
        os.kill(first_pid, signal.SIGSTOP)
        assert engine.ask("send 300", "sent") == ["sent", "300"]  # about 0.5 MB: all of it in the pipe, unread
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_running(first_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        # The engine is idle: it must notice by itself and hand the 300 steps to a new delivery process.
        assert wait_for_steps(ledger, 300, settle_s=5.0) == 300
        assert engine.ask("send 100", "sent") == ["sent", "400"]
        last_pid = int(engine.ask("close", "closed")[1])
        engine.command("exit")
        assert engine.process.wait(30) == 0
        assert wait_for_delivery(last_pid, timeout_s=60)
        assert stored_steps(ledger) == 400
        assert last_pid != first_pid
        assert_stored_as_the_mode_says(server, ledger, "delivery-death", 400, tmp_path)
        end = ledger.run_gaps("delivery-death").end  # the engine's clean close sent the end-of-run record
        assert end is not None and (end.last_step_id, end.num_steps) == (399, 400)
    finally:
        engine.stop()


def test_a_delivery_process_killed_after_it_sent_some_is_replaced_and_nothing_is_sent_twice(service, tmp_path):
    """The replacement is sent every step not reported safe, some of them already stored: per step they are
    duplicates; in windows it asks the service what it holds of the run and skips those steps, starting its
    windows after the last one stored, so no window is sent twice with other content (a 409, refused and lost)
    and no step is counted twice, however the kill falls between reports (every 0.1 s)."""
    server, ledger, key = service
    engine = RelayEngine(tmp_path, server.url, key, "sent-then-killed", server.mode)
    try:
        assert engine.ask("send 250", "sent") == ["sent", "250"]
        wait_for_steps(ledger, 200, settle_s=5.0)
        os.kill(engine.delivery_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_running(engine.delivery_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        while int(engine.ask("pid", "pid")[1]) == engine.delivery_pid and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine replaces it by itself (a death at close is not this test's subject)
        assert engine.ask("send 150", "sent") == ["sent", "400"]
        last_pid = int(engine.ask("close", "closed")[1])
        engine.command("exit")
        assert engine.process.wait(30) == 0
        assert wait_for_delivery(last_pid, timeout_s=60)
        assert stored_steps(ledger) == 400
        assert_stored_as_the_mode_says(server, ledger, "sent-then-killed", 400, tmp_path)
        end = ledger.run_gaps("sent-then-killed").end  # re-sent to the replacement delivery process with the steps
        assert end is not None and (end.last_step_id, end.num_steps) == (399, 400)
    finally:
        engine.stop()


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only one (mode 0555); where the process ignores
    modes (root), a directory of a read-only pseudo file system."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (folder, Path("/sys"), Path("/proc")):
        try:
            (candidate / "llmvisor-probe").open("a").close()
        except OSError:
            return candidate
        (candidate / "llmvisor-probe").unlink()
    pytest.skip("no directory here refuses writes")


def fast_pusher(url, key, spool, **kwargs):
    options = dict(max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05, retry_interval_s=0.2, flush_interval_s=0.02,
                   request_timeout_s=5.0)
    options.update(kwargs)
    return StepPusher(url, key, spool, **options)


@pytest.fixture
def down_service(model_path, tmp_path):  # noqa: F811
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    port = free_loopback_port()
    server = ThreadServer(model_path, db_url, port)
    yield server, ledger, key, f"http://127.0.0.1:{port}"
    server.stop()
    ledger.close()


def test_steps_that_cannot_be_spooled_are_kept_and_delivered_when_the_service_is_back(down_service, tmp_path, caplog):
    server, ledger, key, url = down_service
    spool = unwritable_directory(tmp_path) / "spool.jsonl"
    groups = make_steps("read-only-spool", 150, batch_size=4)
    pusher = fast_pusher(url, key, spool)
    with caplog.at_level(logging.ERROR, "llmvisor.pusher"):
        for group in groups:
            pusher.push_step(group)
        deadline = time.monotonic() + 10
        while pusher.stats.failed_posts < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # a few spooling attempts fail
        assert any("cannot spool" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    server.start()
    assert pusher.close(timeout_s=30), pusher.stats
    assert stored_steps(ledger) == 150
    assert pusher.stats.dropped == 0 and pusher.stats.acknowledged == 150
    assert not spool.exists()


def test_steps_beyond_the_memory_bound_are_dropped_counted_logged_and_shown_as_a_gap(down_service, tmp_path, caplog):
    server, ledger, key, url = down_service
    spool = unwritable_directory(tmp_path) / "spool.jsonl"
    groups = make_steps("bounded", 350, batch_size=4)
    pusher = fast_pusher(url, key, spool, max_held_steps=200)
    with caplog.at_level(logging.ERROR, "llmvisor.pusher"):
        for group in groups[:300]:
            pusher.push_step(group)
        deadline = time.monotonic() + 20
        while pusher.stats.dropped < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.stats.dropped == 100 and pusher.stats.held >= 200
        # logged as dropped (in one message, or several when the pushes reach the bound in pieces on a busy machine)
        assert any("; 100 dropped in all" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    server.start()
    for group in groups[300:]:  # the engine runs on: later steps arrive, so the lost ones are a gap
        pusher.push_step(group)
    assert pusher.close(timeout_s=30) is True
    assert stored_steps(ledger) == 250 and pusher.stats.dropped == 100
    assert all(ledger.step_detail("bounded", step_id) is None for step_id in range(200, 300))
    headers = {"Authorization": f"Bearer {key}"}
    gaps = httpx.get(f"{url}/v1/runs/bounded/gaps", headers=headers, timeout=10).json()
    assert (gaps["num_missing"], gaps["gaps"][0]["first_step_id"], gaps["gaps"][0]["last_step_id"]) == (100, 200, 299)
    metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    assert 'llmvisor_steps_missing{engine_class="",run="bounded"} 100.0' in metrics


def test_an_outage_is_logged_in_true_counts(down_service, tmp_path, caplog):
    """Once when the service goes away, then 'service back' with the steps spooled meanwhile and 'replayed N'
    with the spool's count (not one 'spooling 1 steps' line per failed batch and nothing about the replay)."""
    server, ledger, key, url = down_service
    groups = make_steps("outage", 120, batch_size=3)
    pusher = fast_pusher(url, key, tmp_path / "spool.jsonl")
    with caplog.at_level(logging.INFO, "llmvisor.pusher"):
        for group in groups[:100]:
            pusher.push_step(group)
            time.sleep(0.005)  # several batches, each failing or spooled while the service is away
        deadline = time.monotonic() + 10
        while pusher.stats.spooled < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.start()
        for group in groups[100:]:
            pusher.push_step(group)
        assert pusher.close(timeout_s=30)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("service unavailable" in m for m in messages) == 1, messages
    [back] = [m for m in messages if "service back after" in m]
    assert f"spooled {pusher.stats.spooled} steps meanwhile" in back and pusher.stats.spooled >= 100
    replayed = [m for m in messages if "replayed" in m and "from the spool" in m]
    assert sum(int(m.split("replayed ")[1].split()[0]) for m in replayed) == pusher.stats.replayed == pusher.stats.spooled
    assert stored_steps(ledger) == 120


# ---------------------------------------------------------------------------------------------------------
# The race above, set up exactly: a dead delivery process's windows stored (or spooled) after its last report,
# and a replacement that, resuming from that report alone, would rebuild one of them with other steps.


@pytest.fixture
def window_service(model_path, tmp_path):  # noqa: F811
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    ledger.add_model(ENGINE_CLASS, json.dumps(class_model(ENGINE_CLASS).to_dict()), "test", activate=True)
    port = free_loopback_port()
    server = ThreadServer(model_path, db_url, port)
    yield server, ledger, key, f"http://127.0.0.1:{port}"
    server.stop()
    ledger.close()


def predecessor_windows(ledger: Ledger, run_id: str) -> list[WindowAggregate]:
    """The windows a dead delivery process closed from steps 0-249: 0-99, 100-199, and 200-249 by the clock
    (the steps are dated in the past)."""
    model = StepLatencyModel.from_dict(json.loads(ledger.model_json(ENGINE_CLASS, 1)))
    aggregator = WindowAggregator(run_id, ENGINE_CLASS, lambda: (model, 1))
    windows = [w for k in range(250) for w in aggregator.add(*relay_step(k))] + aggregator.close_due(time.time())
    assert [w.step_ranges for w in windows] == [[[0, 99]], [[100, 199]], [[200, 249]]]
    return windows


def rebuilt_from_the_report(ledger: Ledger, run_id: str, report: dict) -> WindowAggregate:
    """What a replacement resuming from the report alone (before this fix) sent first for steps 200-399
    arriving before its clock closed a window."""
    model = StepLatencyModel.from_dict(json.loads(ledger.model_json(ENGINE_CLASS, 1)))
    aggregator = WindowAggregator(run_id, ENGINE_CLASS, lambda: (model, 1), first_step_id=report["push_next"],
                                  floor_us=report["window_floor_us"])
    return [w for k in range(report["push_next"], 400) for w in aggregator.add(*relay_step(k))][0]


def replacement(url: str, key: str, tmp_path: Path, run_id: str, report: dict) -> WindowDelivery:
    """A replacement delivery process's window mode, as `StepDelivery.from_env` builds it, resuming from ``report``."""
    spool = tmp_path / "spool.jsonl"
    return WindowDelivery(dict(relay_header(run_id, ENGINE_CLASS), resume={"trace_next": 250, **report}),
                          WindowPusher(url, key, spool, retry_interval_s=0.2), window_s=1.0,
                          step_pusher=fast_pusher(url, key, spool))


def stored_windows(ledger: Ledger, run_id: str) -> dict[int, tuple[int, bytes]]:
    from sqlalchemy import select

    from llmvisor.ledger.schema import windows as windows_table

    with ledger._read_engine.connect() as conn:
        rows = conn.execute(select(windows_table.c.window_start_us, windows_table.c.num_steps, windows_table.c.content_sha256)
                            .where(windows_table.c.run_id == run_id)).all()
    return {int(start): (int(n), bytes(digest)) for start, n, digest in rows}


def assert_every_step_once(ledger: Ledger, run_id: str, n_steps: int, delivery: WindowDelivery, tmp_path: Path) -> None:
    totals = ledger.totals()
    assert totals.num_steps == n_steps and totals.attributed_ns == totals.measured_ns and totals.pending_steps == 0
    gaps = ledger.run_gaps(run_id)
    assert gaps.num_missing == 0 and gaps.num_received == n_steps
    assert delivery.pusher.stats.rejected == 0 and delivery.step_pusher.stats.rejected == 0
    assert not list(tmp_path.glob("spool.jsonl*rejected*")) and not list(tmp_path.glob("spool.jsonl*"))


def test_a_replacement_skips_the_steps_of_windows_stored_after_the_last_report(window_service, tmp_path):
    server, ledger, key, url = window_service
    server.start()
    w0, w1, w2 = predecessor_windows(ledger, "stored-after-report")
    ledger.ingest_windows([w0, w1, w2])  # acknowledged after its last report, which said window 200-249 was not
    report = {"push_next": 200, "window_floor_us": w2.window_start_us}
    stale = rebuilt_from_the_report(ledger, "stored-after-report", report)
    assert stale.window_start_us == w2.window_start_us and stale.step_ranges == [[200, 299]]  # rebuilt from the report alone: a 409
    before = stored_windows(ledger, "stored-after-report")

    delivery = replacement(url, key, tmp_path, "stored-after-report", report)
    for k in range(200, 400):  # sent again from the report on, then the engine's later steps, no clock tick between
        delivery.add(relay_step(k))
    assert delivery.close(30)

    after = stored_windows(ledger, "stored-after-report")
    assert {start: after[start] for start in before} == before  # the stored windows untouched
    assert min(set(after) - set(before)) >= w2.window_end_us  # the new ones after the last stored window
    assert sum(n for n, _ in after.values()) == 400 and delivery.aggregator.skipped_held == 50
    assert_every_step_once(ledger, "stored-after-report", 400, delivery, tmp_path)


def test_spooled_windows_and_steps_are_replayed_as_written_not_rebuilt(window_service, tmp_path):
    """The dead process had sent window 0-99, sent 100-199 per step (its class had no model then) and spooled
    them, and spooled window 200-249: the replacement aggregates none of those steps again; the spools go as
    written (the window byte for byte)."""
    server, ledger, key, url = window_service
    w0, w1, w2 = predecessor_windows(ledger, "spooled")
    ledger.ingest_windows([w0])
    spool = tmp_path / "spool.jsonl"
    writer = TraceWriter(spool, flush_every_steps=1000)
    header = relay_header("spooled", ENGINE_CLASS)
    for k in range(100, 200):
        writer.write_step(step_rows(header, relay_step(k)))
    writer.close()
    (tmp_path / "spool.jsonl.windows.jsonl").write_text(json.dumps(w2.to_json()) + "\n")
    report = {"push_next": 100, "window_floor_us": w1.window_start_us}
    server.start()

    delivery = replacement(url, key, tmp_path, "spooled", report)
    for k in range(100, 400):
        delivery.add(relay_step(k))
    assert delivery.close(30)

    after = stored_windows(ledger, "spooled")
    assert after[w2.window_start_us] == (50, w2.content_sha256()) and w1.window_start_us not in after
    assert min(set(after) - {w0.window_start_us, w2.window_start_us}) >= w2.window_end_us
    assert delivery.aggregator.skipped_held == 150 and delivery.pusher.stats.replayed == 1
    assert all(ledger.step_detail("spooled", k) is not None for k in (100, 199))  # per step, as spooled
    assert_every_step_once(ledger, "spooled", 400, delivery, tmp_path)


def test_a_replacement_waits_for_the_service_to_say_what_it_holds(window_service, tmp_path):
    server, ledger, key, url = window_service
    w0, w1, w2 = predecessor_windows(ledger, "asked-later")
    ledger.ingest_windows([w0, w1, w2])
    report = {"push_next": 200, "window_floor_us": w2.window_start_us}
    delivery = replacement(url, key, tmp_path, "asked-later", report)  # the service is away: nothing sent yet
    for k in range(200, 400):
        delivery.add(relay_step(k))
    delivery.tick()
    assert delivery.push_next(400) == (200, w2.window_start_us)  # nothing newer is safe: the relay keeps the steps
    assert delivery.pusher.stats.pushed == 0
    server.start()
    deadline = time.monotonic() + 20
    while delivery.pusher.stats.pushed == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        delivery.tick()
    assert delivery.close(30)
    assert delivery.aggregator.skipped_held == 50
    assert min(set(stored_windows(ledger, "asked-later")) - {w.window_start_us for w in (w0, w1, w2)}) >= w2.window_end_us
    assert_every_step_once(ledger, "asked-later", 400, delivery, tmp_path)
