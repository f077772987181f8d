"""StepPusher against a real HTTP server: spooling while the service is down, replay, exactly-once totals."""

from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn

from _service_fixtures import bearer, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.client import PUSHED_OPTIONAL_COLUMNS, REJECTED_STEPS, StepPusher, read_spool
from llmvisor.core.trace import REQUIRED_COLUMNS
from llmvisor.ledger import Ledger
from llmvisor.service import ingest
from llmvisor.service.app import create_app
from llmvisor.service.process import ServerProcess, free_loopback_port


class ThreadServer:
    """uvicorn in a thread of the test process: quick to start and stop at a fixed port."""

    def __init__(self, model_path, db_url, port):
        self.model_path, self.db_url, self.port = model_path, db_url, port
        self.server = None
        self.thread = None

    def start(self):
        config = uvicorn.Config(create_app(self.model_path, self.db_url), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def stop(self):
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(10)
            self.server = None


@pytest.fixture
def setup(model_path, tmp_path):
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    port = free_loopback_port()
    server = ThreadServer(model_path, db_url, port)
    yield server, ledger, key, f"http://127.0.0.1:{port}", tmp_path / "spool.jsonl"
    server.stop()
    ledger.close()


def fast_pusher(url, key, spool, **kwargs):
    options = dict(max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05, retry_interval_s=0.2, flush_interval_s=0.02,
                   request_timeout_s=5.0)
    options.update(kwargs)
    return StepPusher(url, key, spool, **options)


def test_service_down_spools_then_replays_exactly_once(setup):
    server, ledger, key, url, spool = setup
    groups = make_steps(n_steps=300, batch_size=6)
    pusher = fast_pusher(url, key, spool)
    started = time.perf_counter()
    for group in groups[:200]:
        pusher.push_step(group)
    assert time.perf_counter() - started < 1.0, "push_step must not wait on the network"
    deadline = time.monotonic() + 10
    while pusher.stats.spooled < 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pusher.stats.spooled == 200 and spool.exists()
    assert ledger.totals().num_steps == 0

    server.start()
    for group in groups[200:]:
        pusher.push_step(group)
    assert pusher.flush(timeout_s=30), pusher.stats
    assert not spool.exists()
    for group in groups[:50]:  # re-sent by a confused client: acknowledged, not counted again
        pusher.push_step(group)
    assert pusher.close(timeout_s=30)
    totals = ledger.totals()
    assert totals.num_steps == 300
    assert totals.measured_ns == totals.attributed_ns == measured_ns(groups)
    assert pusher.stats.duplicate >= 50 and pusher.stats.rejected == 0


def test_full_queue_spools_and_a_later_pusher_replays_the_spool(setup):
    server, ledger, key, url, spool = setup
    groups = make_steps(n_steps=120, batch_size=4)
    first = fast_pusher(url, key, spool, max_queue_steps=5)
    for group in groups:
        first.push_step(group)
    assert first.stats.spooled >= 100
    assert first.close(timeout_s=2) is False, "the service is down: steps stay in the spool"
    assert len(read_spool(spool)[0]) + len(read_spool(first.replay_path)[0]) == 120

    server.start()
    second = fast_pusher(url, key, spool)
    assert second.flush(timeout_s=30)
    assert second.close()
    totals = ledger.totals()
    assert totals.num_steps == 120 and totals.measured_ns == measured_ns(groups)


def test_rejected_steps_go_aside_and_the_rest_of_their_batch_is_stored(setup, caplog):
    server, ledger, key, url, spool = setup
    rejected_before = REJECTED_STEPS._value.get()
    server.start()
    groups = make_steps(n_steps=40, batch_size=4)
    pusher = fast_pusher(url, key, spool, flush_interval_s=0.5)
    pusher.push_step(groups[0])
    assert pusher.flush(timeout_s=10)
    conflicting = json.loads(json.dumps(groups[0]))
    conflicting[0]["num_context_tokens"] += 7
    invalid = json.loads(json.dumps(groups[1]))
    invalid[0]["phase"] = "thinking"
    for group in [conflicting, *groups[2:20], invalid, *groups[20:]]:
        pusher.push_step(group)
    assert pusher.close(timeout_s=30)
    assert pusher.stats.rejected == 2
    rejected = read_spool(pusher.rejected_path)[0]
    assert sorted(step[0]["step_id"] for step in rejected) == [0, 1]
    assert REJECTED_STEPS._value.get() - rejected_before == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("rejected 2 of 41 step(s)" in m and str(pusher.rejected_path) in m for m in errors), errors
    totals = ledger.totals()
    kept = [groups[0], *groups[2:]]
    assert totals.num_steps == 39 and totals.measured_ns == measured_ns(kept)


def test_kill_9_while_pushing_loses_nothing(model_path, tmp_path):
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    server = ServerProcess(model_path, db_url, log_path=tmp_path / "server.log").start()
    groups = make_steps(n_steps=600, batch_size=6)
    pusher = fast_pusher(server.url, key, tmp_path / "spool.jsonl", max_batch_steps=20)
    try:
        for i, group in enumerate(groups):
            pusher.push_step(group)
            if i == 200:
                server.kill()
            if i == 400:
                server.start()
            time.sleep(0.002)
        assert pusher.close(timeout_s=60), pusher.stats
        totals = ledger.totals()
        assert totals.num_steps == 600
        assert totals.measured_ns == totals.attributed_ns == measured_ns(groups)
    finally:
        server.stop()
        ledger.close()


def test_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMVISOR_SERVICE_URL", raising=False)
    assert StepPusher.from_env() is None
    monkeypatch.setenv("LLMVISOR_SERVICE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("LLMVISOR_SERVICE_KEY", raising=False)
    with pytest.raises(ValueError, match="LLMVISOR_SERVICE_KEY"):
        StepPusher.from_env()
    monkeypatch.setenv("LLMVISOR_SERVICE_KEY", "lvk_a_b")
    monkeypatch.setenv("LLMVISOR_SPOOL", str(tmp_path / "s.jsonl"))
    pusher = StepPusher.from_env()
    assert pusher.url == "http://127.0.0.1:9" and str(pusher.spool_path) == str(tmp_path / "s.jsonl")
    assert pusher.close(timeout_s=1)


def test_pushed_steps_carry_the_shared_kv_and_prefix_cache_columns_the_service_reads(setup):
    """The recorder's rows have the sharing columns (priced) and the prefix-cache hits (metered): the pusher sends
    them, so the ledger stores the slices' sharing and meters the cached prompt tokens, as a trace upload would."""
    server, ledger, key, url, spool = setup
    groups = make_steps(n_steps=40, batch_size=6)
    cached_sum = 0
    for group in groups:
        common = min(r["num_context_tokens"] for r in group) if len(group) > 1 else 0  # a prefix all its slices read
        for k, row in enumerate(group):
            row["num_shared_context_tokens"] = common
            row["effective_context_tokens"] = row["num_context_tokens"] - common / len(group) * (len(group) - 1)
            row["num_cached_prompt_tokens"] = row["num_context_tokens"] if k == 0 and row["phase"] == "prefill" else 0
            cached_sum += row["num_cached_prompt_tokens"]
    assert cached_sum > 0
    server.start()
    pusher = fast_pusher(url, key, spool)
    for group in groups:
        pusher.push_step(group)
    assert pusher.close(timeout_s=30), pusher.stats
    assert ledger.totals().num_steps == 40
    assert sum(r.num_cached_prompt_tokens for r in ledger.tenant_usage()) == cached_sum
    stored = ledger.billed_steps("", 0, 4_000_000_000 * 10**6).slices
    shared = dict(zip(zip(stored["run_id"].to_pylist(), stored["step_id"].to_pylist(), stored["request_id"].to_pylist()),
                      stored["num_shared_context_tokens"].to_pylist()))
    assert shared == {(r["run_id"], r["step_id"], r["request_id"]): r["num_shared_context_tokens"] for g in groups for r in g}


def test_the_pusher_sends_every_optional_column_the_service_reads():
    """The two lists are kept apart (the engine's process does not import the service): a column the service starts
    reading must be pushed too, or per-step ingest silently bills without it."""
    read = {*ingest.CHECKED_COLUMNS, *ingest.STORED_OPTIONAL_COLUMNS, *ingest.RUN_COLUMNS, *ingest.TOKEN_COLUMNS}
    assert set(PUSHED_OPTIONAL_COLUMNS) == read - set(REQUIRED_COLUMNS)


def test_the_window_pushers_batches_fit_what_the_service_takes_by_default():
    """The pusher's per-POST bounds and the service's limits are set apart (the engine side does not import the
    service's settings): a default POST of the pusher, or of `llmvisor load`'s simulated engines, must not be a 413."""
    import inspect

    from llmvisor.client import WindowPusher
    from llmvisor.service import config, fleet

    defaults = {name: p.default for name, p in inspect.signature(WindowPusher).parameters.items()}
    assert defaults["max_batch_windows"] <= config.DEFAULT_MAX_STEPS_PER_REQUEST  # the windows route's per-POST cap
    assert defaults["max_batch_bytes"] < config.DEFAULT_MAX_BODY_BYTES
    assert fleet.MAX_WINDOWS_PER_POST == defaults["max_batch_windows"]  # the load test sends as the pusher does
