"""Lost steps counted and shown: the ledger's received step-id ranges per run (merged on insert, safe with
several writers of one run), ``GET /v1/runs/{run}/gaps``, ``llmvisor_steps_missing`` (and its deprecated old name) and the error line
for a gap older than the retry window; every count equal to the steps removed."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from _service_fixtures import bearer, db_url, make_steps, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import step_ranges
from llmvisor.service.app import create_app
from llmvisor.service.ingest import prepare_batch, validate_trace


def _records(model, groups):
    return prepare_batch(model, validate_trace(groups), received_at_us=0).records


def test_concurrent_writers_of_one_run_leave_merged_ranges_and_exact_gaps(db_url, model_path):  # noqa: F811
    """Four writers (own connections) store overlapping, shuffled batches of one run with 37 ids never sent:
    the ranges are merged (one per stretch of received ids) and the gaps are the ids removed, exactly."""
    model = StepLatencyModel.from_json(model_path)
    groups = make_steps("run-c", 600, batch_size=3, seed=5)
    rng = random.Random(1)
    removed = set(rng.sample(range(1, 599), 30)) | set(range(300, 307))
    kept = [g for g in groups if g[0]["step_id"] not in removed]
    batches = [kept[i : i + rng.randint(12, 25)] for i in range(0, len(kept), 12)]  # overlapping: duplicates too
    rng.shuffle(batches)
    ledgers = [Ledger(db_url) for _ in range(4)]
    errors = []

    def writer(k: int) -> None:
        try:
            for batch in batches[k::4]:
                ledgers[k].ingest(_records(model, batch))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    try:
        assert not errors, errors
        gaps = ledgers[0].run_gaps("run-c")
        missing = {s for g in gaps.gaps for s in range(g.first_step_id, g.last_step_id + 1)}
        assert missing == removed and gaps.num_missing == len(removed) == 37
        assert gaps.num_received == 600 - 37 and gaps.last_step_id == 599
        with ledgers[0]._read() as conn:
            ranges = sorted(tuple(r) for r in conn.execute(step_ranges.select().with_only_columns(
                step_ranges.c.first_step_id, step_ranges.c.last_step_id)))
        assert len(ranges) == len(gaps.gaps) + 1, "adjacent ranges left unmerged"
        assert [run.run_id for run in ledgers[0].runs_with_gaps()] == ["run-c"]
        # The lost steps arrive after all (a late replay): the gaps close.
        ledgers[1].ingest(_records(model, [g for g in groups if g[0]["step_id"] in removed]))
        assert ledgers[0].run_gaps("run-c").num_missing == 0 and ledgers[0].runs_with_gaps() == []
    finally:
        for ledger in ledgers:
            ledger.close()


def _missing_samples(text: str) -> dict[tuple[str, str], float]:
    """The gauge's samples; its deprecated old name (kept one release) carries the same ones."""
    def samples(name: str) -> dict[tuple[str, str], float]:
        return {
            (s.labels["run"], s.labels["engine_class"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
        }

    current = samples("llmvisor_steps_missing")
    assert samples("llmvisor_steps_missing_total") == current
    return current


def test_gaps_api_metric_and_alert_count_the_steps_removed(model_path, tmp_path, caplog):  # noqa: F811
    url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(url)
    admin = bearer(ledger.create_key(is_admin=True))
    tenant = bearer(ledger.create_key("tenant-0"))
    ledger.close()
    groups = make_steps("run-g", 100, seed=3)
    removed = list(range(0, 3)) + list(range(40, 52)) + [77]
    sent = [g for g in groups if g[0]["step_id"] not in removed]
    app = create_app(model_path, url, gap_alert_after_s=3600.0)
    with TestClient(app) as client, caplog.at_level(logging.ERROR, "llmvisor.service"):
        for i in range(0, len(sent), 10):
            assert client.post("/v1/steps", json={"steps": sent[i : i + 10]}, headers=admin).status_code == 200
        assert client.post("/v1/steps", json={"steps": make_steps("run-whole", 30)}, headers=admin).status_code == 200
        answer = client.get("/v1/runs/run-g/gaps", headers=admin).json()
        assert answer["num_missing"] == len(removed) == 16 and answer["num_gaps"] == 3
        assert [(g["first_step_id"], g["last_step_id"], g["num_steps"]) for g in answer["gaps"]] == [(0, 2, 3), (40, 51, 12), (77, 77, 1)]
        assert answer["num_received"] == 84 and answer["last_step_id"] == 99
        assert client.get("/v1/runs/run-whole/gaps", headers=admin).json()["num_missing"] == 0
        assert client.get("/v1/runs/nope/gaps", headers=admin).status_code == 404
        assert client.get("/v1/runs/run-g/gaps", headers=tenant).status_code == 403
        assert client.get("/v1/runs/run-g/gaps?limit=2", headers=admin).json()["truncated"] is True
        samples = _missing_samples(client.get("/metrics", headers=admin).text)
        assert samples[("run-g", "")] == 16.0 and samples.get(("run-whole", ""), 0.0) == 0.0
        assert not [r for r in caplog.records if "missing steps" in r.getMessage()], "alerted inside the window"

        # Past the window: the periodic check (here called directly) logs each open gap once, as an error.
        app.state.gaps.alert_after_s = 0.0
        app.state.gaps.refresh()
        app.state.gaps.refresh()
        alerts = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "missing steps" in r.getMessage()]
        assert len(alerts) == 3 and any("run-g" in m and "40..51 (12 steps)" in m for m in alerts), alerts

        # The spool replays the removed steps: the gaps close, the series drops to 0.
        late = [g for g in groups if g[0]["step_id"] in removed]
        assert client.post("/v1/steps", json={"steps": late}, headers=admin).json()["steps_inserted"] == 16
        assert client.get("/v1/runs/run-g/gaps", headers=admin).json()["num_missing"] == 0
        text = client.get("/metrics", headers=admin).text
        assert _missing_samples(text)[("run-g", "")] == 0.0
        assert "llmvisor_runs_missing_steps 0.0" in text


def test_the_periodic_check_alerts_on_a_run_that_stopped_sending(model_path, tmp_path, caplog, monkeypatch):  # noqa: F811
    """No batch of the run arrives after its gap opened: the service's own periodic check finds it past the
    window (both set by environment variables, as `llmvisor serve` reads them) and logs it once."""
    url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(url)
    admin = bearer(ledger.create_key(is_admin=True))
    ledger.close()
    monkeypatch.setenv("LLMVISOR_GAP_ALERT_AFTER_S", "0.3")
    monkeypatch.setenv("LLMVISOR_GAP_CHECK_INTERVAL_S", "0.1")
    groups = make_steps("run-stopped", 20)
    with TestClient(create_app(model_path, url)) as client, caplog.at_level(logging.ERROR, "llmvisor.service"):
        assert client.post("/v1/steps", json={"steps": groups[:5] + groups[9:]}, headers=admin).status_code == 200
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if "missing steps 5..8 (4 steps)" in r.getMessage()]:
            assert time.monotonic() < deadline, "the periodic check did not log the gap"
            time.sleep(0.05)
        time.sleep(0.3)
    assert len([r for r in caplog.records if "run-stopped" in r.getMessage()]) == 1
    monkeypatch.setenv("LLMVISOR_GAP_ALERT_AFTER_S", "soon")
    with pytest.raises(LlmvisorError, match="LLMVISOR_GAP_ALERT_AFTER_S must be a positive number of seconds"):
        create_app(model_path, url)
