"""Runs that no one would otherwise see (issue #36 item 5), over real databases and a real service: a run re-sent
under a new run id is refused on both ingest paths, naming the run it repeats, with the ledger unchanged; the
end-of-run record makes a lost tail a gap (gaps query and gauge, under the new name and the deprecated one); a
schema-7 ledger is upgraded in place with its data intact. On the code before this change the duplicate is stored
(billed twice), POST /v1/runs/{run_id}/end does not exist and a lost tail shows no gap."""

from __future__ import annotations

import copy
import logging
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import inspect, select, text

from _relay_engine import relay_header, relay_step
from _service_fixtures import admin, bearer, class_model, db_url, make_steps, model_path  # noqa: F401
from llmvisor.client import StepDelivery
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import SCHEMA_8_TABLES, SCHEMA_VERSION, ledger_info
from llmvisor.service.app import create_app
from llmvisor.service.process import free_loopback_port
from test_delivery_loss import fast_pusher, unwritable_directory
from test_service_client import ThreadServer
from test_windows_service import CLASS_W, steps_of, windows_of


@pytest.fixture
def client(model_path, db_url, admin):  # noqa: F811
    with TestClient(create_app(model_path, db_url)) as test_client:
        added = test_client.post("/v1/models", headers=bearer(admin),
                                 json={"model": class_model(CLASS_W).to_dict(), "engine_class": CLASS_W, "activate": True})
        assert added.status_code == 201, added.text
        yield test_client


def renamed(groups, run_id):
    out = copy.deepcopy(groups)
    for group in out:
        for row in group:
            row["run_id"] = run_id
    return out


def totals(client, admin):
    return client.get("/v1/usage/totals", headers=bearer(admin)).json()


def missing_samples(text_: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["run"]): s.value for family in text_string_to_metric_families(text_)
            for s in family.samples if s.name in ("llmvisor_steps_missing", "llmvisor_steps_missing_total")}


def test_a_run_resent_under_a_new_run_id_is_refused_on_the_steps_path(client, admin):
    original = make_steps("run-a", 30, seed=7)
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": original}).status_code == 200
    before = totals(client, admin)
    copy_b = renamed(original, "run-b")
    refused = client.post("/v1/steps", headers=bearer(admin), json={"steps": copy_b})
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert (body["run_id"], body["duplicate_of"]) == ("run-b", "run-a")
    assert "run 'run-b' repeats run 'run-a'" in body["detail"] and "nothing of the batch is stored" in body["detail"]
    # the rest of the refused run, sent later without its step 0, is refused too; the ledger is unchanged
    later = client.post("/v1/steps", headers=bearer(admin), json={"steps": copy_b[10:]})
    assert later.status_code == 409 and later.json()["duplicate_of"] == "run-a", later.text
    assert totals(client, admin) == before
    # the original re-sent under its own id is an idempotent duplicate; a run of other content is stored
    again = client.post("/v1/steps", headers=bearer(admin), json={"steps": original}).json()
    assert again["steps_duplicate"] == 30
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": make_steps("run-c", 30, seed=8)}).status_code == 200
    metrics = client.get("/metrics", headers=bearer(admin)).text
    assert 'llmvisor_ingest_errors_total{reason="duplicate_run"} 2.0' in metrics


def test_steps_without_timestamps_are_not_fingerprinted(client, admin):
    """Dated on arrival, two runs doing the same work are identical: the rule cannot tell them from a re-send."""
    plain = make_steps("run-p", 5, seed=9)
    for group in plain:
        for row in group:
            del row["timestamp_s"]
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": plain}).status_code == 200
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": renamed(plain, "run-q")}).status_code == 200


def test_a_run_resent_under_a_new_run_id_is_refused_on_the_windows_path(client, admin):
    windows = windows_of(client, admin, "run-w", steps_of("run-w"))
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).status_code == 200
    before = totals(client, admin)
    copy_x = [dict(w, run_id="run-x") for w in windows]
    refused = client.post("/v1/windows", headers=bearer(admin), json={"windows": copy_x})
    assert refused.status_code == 409, refused.text
    assert refused.json()["duplicate_of"] == "run-w" and "first window" in refused.json()["detail"]
    later = client.post("/v1/windows", headers=bearer(admin), json={"windows": copy_x[1:]})
    assert later.status_code == 409 and later.json()["duplicate_of"] == "run-w", later.text
    assert totals(client, admin) == before
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).json()["windows_duplicate"] == len(windows)


def test_an_end_record_shows_a_lost_tail_as_a_gap(client, admin):
    steps = make_steps("run-t", 20, seed=11)
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": steps}).status_code == 200
    gaps = client.get("/v1/runs/run-t/gaps", headers=bearer(admin)).json()
    assert (gaps["state"], gaps["num_missing"], gaps["recorded_last_step_id"]) == ("open", 0, None)
    # the recorder recorded 30 steps; the last 10 never arrived
    ended = client.post("/v1/runs/run-t/end", headers=bearer(admin), json={"last_step_id": 29, "num_steps": 30})
    assert ended.status_code == 200, ended.text
    assert (ended.json()["stored"], ended.json()["num_missing"]) == (True, 10)
    gaps = client.get("/v1/runs/run-t/gaps", headers=bearer(admin)).json()
    assert (gaps["state"], gaps["num_missing"], gaps["recorded_num_steps"]) == ("ended", 10, 30)
    assert (gaps["gaps"][0]["first_step_id"], gaps["gaps"][0]["last_step_id"]) == (20, 29)
    samples = missing_samples(client.get("/metrics", headers=bearer(admin)).text)
    assert samples[("llmvisor_steps_missing", "run-t")] == samples[("llmvisor_steps_missing_total", "run-t")] == 10
    # an identical re-send changes nothing; other values, or an unknown field, are refused
    assert client.post("/v1/runs/run-t/end", headers=bearer(admin), json={"last_step_id": 29, "num_steps": 30}).json()["stored"] is False
    conflict = client.post("/v1/runs/run-t/end", headers=bearer(admin), json={"last_step_id": 31, "num_steps": 32})
    assert conflict.status_code == 409 and "a run ends once" in conflict.json()["detail"]
    unknown = client.post("/v1/runs/run-t/end", headers=bearer(admin), json={"last_step_id": 29, "num_step": 30})
    assert unknown.status_code == 422 and "num_step" in unknown.text, unknown.text
    impossible = client.post("/v1/runs/run-u/end", headers=bearer(admin), json={"last_step_id": 3, "num_steps": 9})
    assert impossible.status_code == 422 and "num_steps" in impossible.text
    # the late steps arrive (a spool replayed): the gap fills
    late = renamed(make_steps("run-t", 30, seed=11)[20:], "run-t")
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": late}).status_code == 200
    assert client.get("/v1/runs/run-t/gaps", headers=bearer(admin)).json()["num_missing"] == 0
    # the periodic check lists a run with an end record and no step at all
    assert client.post("/v1/runs/run-v/end", headers=bearer(admin), json={"last_step_id": 4, "num_steps": 5}).status_code == 200
    assert client.get("/v1/runs/run-v/gaps", headers=bearer(admin)).json()["num_missing"] == 5
    ledger = client.app.state.ledger
    assert {g.run_id: g.num_missing for g in ledger.runs_with_gaps()} == {"run-v": 5}


def test_the_delivery_sends_the_end_record_so_dropped_last_steps_show_as_a_gap(model_path, tmp_path, monkeypatch):  # noqa: F811
    """The real delivery path (StepDelivery and its StepPusher, a real service on a loopback port): the service is
    away, the pusher can neither spool nor hold more than 200 steps, so steps 200-299, the run's last, are dropped;
    at close the end record arrives and they are a gap, in the gaps query and the gauge."""
    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    key = ledger.create_key(is_admin=True)
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("LLMVISOR_SERVICE_URL", url)
    monkeypatch.setenv("LLMVISOR_SERVICE_KEY", key)
    server = ThreadServer(model_path, db, port)
    pusher = fast_pusher(url, key, unwritable_directory(tmp_path) / "spool.jsonl", max_held_steps=200)
    delivery = StepDelivery(relay_header("tail-lost"), pusher)
    try:
        for step_id in range(300):
            delivery.add(relay_step(step_id))
        deadline = time.monotonic() + 20
        while pusher.stats.dropped < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.stats.dropped == 100
        server.start()
        delivery.end_run({"last_step_id": 299, "num_steps": 300})
        delivery.close(timeout_s=30)
        gaps = ledger.run_gaps("tail-lost")
        assert (gaps.num_received, gaps.num_missing, gaps.ended) == (200, 100, True)
        assert [(g.first_step_id, g.last_step_id) for g in gaps.gaps] == [(200, 299)]
        import httpx

        metrics = httpx.get(f"{url}/metrics", headers=bearer(key), timeout=10).text
        assert 'llmvisor_steps_missing{engine_class="",run="tail-lost"} 100.0' in metrics
    finally:
        server.stop()
        ledger.close()


def test_a_schema_7_ledger_is_upgraded_in_place_with_its_data_intact(db_url, model_path, caplog):  # noqa: F811
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    with TestClient(create_app(model_path, db_url)) as client:
        assert client.post("/v1/steps", headers=bearer(key), json={"steps": make_steps("run-7", 12, seed=13)}).status_code == 200
    before = ledger.totals()
    with ledger.write_transaction() as conn:  # back to schema 7: its tables and version, schema 8's tables gone
        for table in reversed(SCHEMA_8_TABLES):
            conn.execute(text(f"DROP TABLE {table.name}"))
        conn.execute(ledger_info.update().where(ledger_info.c.name == "schema_version").values(value="7"))
    ledger.close()
    upgraded = Ledger(db_url)
    with upgraded.read_transaction() as conn:
        version = conn.execute(select(ledger_info.c.value).where(ledger_info.c.name == "schema_version")).scalar()
        names = set(inspect(conn).get_table_names())
    assert version == str(SCHEMA_VERSION) == "10"
    assert {t.name for t in SCHEMA_8_TABLES} <= names
    assert upgraded.totals() == before and upgraded.authenticate(key) is not None
    assert upgraded.run_gaps("run-7").num_received == 12
    upgraded.close()
    with caplog.at_level(logging.WARNING):
        Ledger(db_url).close()  # opening an upgraded ledger again changes nothing
