"""Window mode bills with the model the service would use, on a real `llmvisor serve`: a class without an active
version is attributed at the edge with the service's `--model` (the class it was fitted on) or `--fallback-model`,
each a stored version of the class that every window names; a class with no model at all goes per step, is stored
pending (measured time kept, shown in totals, no gap) and attributed exactly when a model is activated, and the
same run then switches to windows. Every figure is compared with per-step ingest of the same steps."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sqlalchemy import create_engine, select

from _service_fixtures import T0_S, class_model, make_steps
from llmvisor.client import StepPusher, WindowDelivery, WindowPusher
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.relayed import step_rows
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import windows as windows_table
from llmvisor.metering import WindowAggregator
from llmvisor.service.process import ServerProcess

CLASS_A = "aaaaaaaaaaaaaaaa"  # the class the service's --model was fitted on
CLASS_B = "bbbbbbbbbbbbbbbb"  # a class with no model of its own
N_STEPS = 40


def header(run_id: str, engine_class: str) -> dict:
    return {"columns": {"run_id": run_id, "engine": "vllm", "engine_version": "test", "model": "m", "hardware": "h",
                        "tensor_parallel_size": 1, FINGERPRINT_COLUMN: engine_class},
            "warmup_steps": 0, "trace_path": None, "engine_fingerprint": None}


def relayed(run_id: str, *, first_step: int = 0, n_steps: int = N_STEPS, later_s: float = 0.0) -> list[list]:
    """Relayed steps (as the recorder sends them to the delivery process), 0.27 s apart: several 1 s windows.
    ``later_s``: the same work that much later (a second run of it in one ledger, not a re-send of the first)."""
    groups = make_steps(run_id, n_steps, first_step=first_step, step_interval_s=0.27, seed=3, start_s=T0_S + later_s)
    return [[g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"],
             [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, float(r["num_context_tokens"])] for r in g]]
            for g in groups]


def measured(steps: list[list]) -> int:
    return sum(int(round(s[2] * 1e9)) for s in steps)


class Service:
    def __init__(self, tmp_path, *, fallback: bool):
        default = class_model(CLASS_A, seed=1)
        default.to_json(tmp_path / "default.json")
        class_model("ffffffffffffffff", seed=2).to_json(tmp_path / "fallback.json")
        self.db_url = f"sqlite:///{tmp_path}/ledger.db"
        ledger = Ledger(self.db_url)
        self.key = ledger.create_key(is_admin=True)
        ledger.close()
        extra = ("--fallback-model", str(tmp_path / "fallback.json")) if fallback else ()
        self.log_path = tmp_path / "service.log"
        self.server = ServerProcess(tmp_path / "default.json", self.db_url, log_path=self.log_path, extra_args=extra).start()
        self.url, self.tmp_path = self.server.url, tmp_path
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=30)

    def deliver(self, run_id: str, engine_class: str, steps: list[list], *, between=None) -> WindowDelivery:
        """The delivery process's window mode, steps in, closed; ``between(delivery)`` runs half way."""
        spool = self.tmp_path / f"{run_id}.spool.jsonl"
        delivery = WindowDelivery(header(run_id, engine_class), WindowPusher(self.url, self.key, spool), window_s=1.0,
                                  step_pusher=StepPusher(self.url, self.key, spool))
        delivery.models.refresh_interval_s = 0.0  # ask at every window close
        for k, step in enumerate(steps):
            if between is not None and k == len(steps) // 2:
                between(delivery)
            delivery.add(step)
        assert delivery.close(30)
        return delivery

    def per_step(self, run_id: str, engine_class: str, steps: list[list]) -> None:
        """The same steps through per-step ingest, the service choosing the model."""
        body = {"steps": [step_rows(header(run_id, engine_class), step) for step in steps]}
        answer = self.http.post("/v1/steps", json=body)
        assert answer.status_code == 200, answer.text

    def requests(self, run_id: str) -> dict[tuple[str, str], tuple[int, int]]:
        rows = self.http.get("/v1/usage/requests", params={"run_id": run_id, "limit": 10_000}).json()["requests"]
        return {(r["request_id"], r["tenant"]): (r["attributed_ns"], r["num_new_tokens"]) for r in rows}

    def window_versions(self, run_id: str) -> list[tuple[int | None, bool]]:
        engine = create_engine(self.db_url)
        with engine.connect() as conn:
            rows = conn.execute(select(windows_table.c.model_version, windows_table.c.pending).where(windows_table.c.run_id == run_id)).all()
        engine.dispose()
        return sorted(set((r[0], bool(r[1])) for r in rows), key=str)

    def close(self):
        self.http.close()
        self.server.stop()


@pytest.fixture
def service(tmp_path):
    s = Service(tmp_path, fallback=True)
    yield s
    s.close()


@pytest.fixture
def bare_service(tmp_path):
    s = Service(tmp_path, fallback=False)
    yield s
    s.close()


def test_the_registry_answers_the_default_and_fallback_models_with_a_stored_version(service):
    default = service.http.get(f"/v1/models/{CLASS_A}/active").json()
    fallback = service.http.get(f"/v1/models/{CLASS_B}/active").json()
    assert (default["role"], default["active"], fallback["role"], fallback["active"]) == ("default", False, "fallback", False)
    assert default["model"] == json.loads((service.tmp_path / "default.json").read_text())
    assert fallback["model"] == json.loads((service.tmp_path / "fallback.json").read_text())
    listed = {(m["engine_class"], m["version"]): m for m in service.http.get("/v1/models").json()}
    assert not listed[(CLASS_A, default["version"])]["active"] and "--model" in listed[(CLASS_A, default["version"])]["source"]
    assert "--fallback-model" in listed[(CLASS_B, fallback["version"])]["source"]
    # asked again: the same stored version, none added
    assert service.http.get(f"/v1/models/{CLASS_B}/active").json()["version"] == fallback["version"]
    assert len(service.http.get("/v1/models").json()) == 2
    added = service.http.post("/v1/models", json={"model": class_model(CLASS_B, seed=4).to_dict(), "engine_class": CLASS_B, "activate": True})
    active = service.http.get(f"/v1/models/{CLASS_B}/active").json()
    assert (active["role"], active["active"], active["version"]) == ("active", True, added.json()["version"])


@pytest.mark.parametrize("engine_class, role", [(CLASS_A, "default"), (CLASS_B, "fallback")])
def test_windows_bill_with_the_default_or_fallback_model_as_per_step_ingest_does(service, engine_class, role):
    steps = relayed("w")
    delivery = service.deliver("w", engine_class, steps)
    service.per_step("s", engine_class, relayed("s"))
    assert delivery.models.role == role and delivery.steps_sent_per_step == 0 and delivery.windows_sent >= 10
    version = delivery.models.version
    assert service.window_versions("w") == [(version, False)]  # every window names the stored version that attributed it
    billed = service.requests("w")
    assert billed == service.requests("s") and sum(ns for ns, _ in billed.values()) == measured(steps)
    if role == "fallback":
        assert "its steps are billed with the fallback model" in service.log_path.read_text()


def test_a_class_without_a_model_is_pending_per_step_then_attributed_exactly_and_switches_to_windows(bare_service):
    service = bare_service
    assert service.http.get(f"/v1/models/{CLASS_B}/active").status_code == 404
    model = class_model(CLASS_B, seed=4)
    added = {}

    def held_then_activate(delivery):
        """Half way: every step so far is stored pending, measured time kept and shown; then a model is activated."""
        delivery.step_pusher.flush(30)
        totals = service.http.get("/v1/usage/totals").json()
        sent = delivery.steps_sent_per_step
        assert sent > 0 and delivery.windows_sent == 0
        assert (totals["pending_steps"], totals["pending_measured_ns"], totals["attributed_ns"]) == (sent, measured(steps[:sent]), 0)
        gaps = service.http.get("/v1/runs/mixed/gaps").json()
        assert gaps["num_missing"] == 0 and gaps["num_received"] == sent
        answer = service.http.post("/v1/models", json={"model": model.to_dict(), "engine_class": CLASS_B, "activate": True})
        added.update(answer.json())

    steps = relayed("mixed")
    delivery = service.deliver("mixed", CLASS_B, steps, between=held_then_activate)
    assert delivery.steps_sent_per_step > 0 and delivery.windows_sent > 0 and delivery.models.role == "active"
    assert service.window_versions("mixed") == [(added["version"], False)]
    totals = service.http.get("/v1/usage/totals").json()
    assert totals["pending_steps"] == 0 and totals["num_steps"] == N_STEPS
    assert totals["attributed_ns"] == totals["measured_ns"] == measured(steps)  # to the nanosecond
    gaps = service.http.get("/v1/runs/mixed/gaps").json()
    assert gaps["num_missing"] == 0 and gaps["num_received"] == N_STEPS
    # what per-step ingest bills for the same steps with the activated model, request by request
    service.per_step("check", CLASS_B, relayed("check", later_s=1000.0))
    assert service.requests("mixed") == service.requests("check")


def test_windows_spooled_through_an_outage_are_replayed_and_an_identical_resend_is_a_duplicate(tmp_path):
    """The service is SIGKILLed mid-run: the pusher spools the windows it cannot send, replays them when the service
    is back, and a re-send of every window (a delivery process that replaced one that died) is counted as duplicates;
    the ledger holds each step once, nothing lost or doubled."""
    service = Service(tmp_path, fallback=False)
    try:
        model = class_model(CLASS_B, seed=4)
        version = service.http.post("/v1/models", json={"model": model.to_dict(), "engine_class": CLASS_B, "activate": True}).json()["version"]
        aggregator = WindowAggregator("outage", CLASS_B, lambda: (model, version))
        windows = []
        for step in relayed("outage", n_steps=90):
            windows += aggregator.add(*step)
        windows += aggregator.close()
        third = len(windows) // 3
        pusher = WindowPusher(service.url, service.key, tmp_path / "spool.jsonl", flush_interval_s=0.02, retry_interval_s=0.2)
        for w in windows[:third]:
            pusher.push(w)
        deadline = time.monotonic() + 60
        while pusher.stats.acknowledged < third and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pusher.stats.acknowledged == third
        service.server.kill()
        for w in windows[third : 2 * third]:
            pusher.push(w)
        while pusher.stats.spooled < third and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pusher.stats.spooled == third and pusher.pending_windows() == third
        service.server.start()
        for w in windows[2 * third :]:
            pusher.push(w)
        assert pusher.close(60)
        stats = pusher.stats
        assert (stats.acknowledged, stats.replayed, stats.duplicate, stats.rejected) == (len(windows), third, 0, 0)
        again = WindowPusher(service.url, service.key, tmp_path / "again.jsonl", flush_interval_s=0.02)
        for w in windows:
            again.push(w)
        assert again.close(60)
        assert (again.stats.acknowledged, again.stats.duplicate, again.stats.rejected) == (0, len(windows), 0)
        totals = service.http.get("/v1/usage/totals").json()
        steps = relayed("outage", n_steps=90)
        assert totals["num_steps"] == 90 and totals["attributed_ns"] == totals["measured_ns"] == measured(steps)
        service.per_step("check", CLASS_B, steps)
        assert service.requests("outage") == service.requests("check")
        assert not (tmp_path / "spool.jsonl.windows.jsonl").exists() and not (tmp_path / "spool.jsonl.windows.replaying").exists()
    finally:
        service.close()


def test_the_recorder_doc_quotes_the_edge_cost_figures_and_their_bar():
    """docs/recorder.md quotes docs/results/edge-windows.json (scripts/measure-edge-windows.py) as it is, and says
    'at or under' the issue's 1% bar only if the shipped figures are."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = json.loads((repo / "docs" / "results" / "edge-windows.json").read_text(encoding="utf-8"))
    doc = " ".join((repo / "docs" / "recorder.md").read_text(encoding="utf-8").split())
    b8, b32 = result["runs"]
    assert (b8["batch_size"], b32["batch_size"]) == (8, 32)
    quoted = (f"{b8['edge_cpu_us_per_step']} µs of the delivery process's CPU per step at B = 8 ({b8['fraction_of_step_time_percent']}% of step "
              f"time) and {b32['edge_cpu_us_per_step']} µs at B = 32 ({b32['fraction_of_step_time_percent']}%)")
    assert quoted in doc
    split = (f"is {b8['aggregation_us_per_step']} / {b32['aggregation_us_per_step']} µs and the archive "
             f"{b8['archive_us_per_step']} / {b32['archive_us_per_step']} µs")
    assert split in doc
    worst = max(b8["fraction_of_step_time_percent"], b32["fraction_of_step_time_percent"])
    assert ("at or under the issue's 1% bar" in doc) == (worst <= 1.0)
