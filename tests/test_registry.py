"""The model registry per engine class: add/list/activate (CLI and HTTP, admin only), steps of a class without a
model stored pending and attributed on activation, per-class drift and its alarm, refits held out by time."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient

from _cli import invoke_cli
from _processes import cli_process
from _service_fixtures import T0_S, bearer, class_body, class_model, db_url, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app
from llmvisor.service.metrics import DriftSettings
from llmvisor.service.refit import refit_class

CLASS_A = "aaaaaaaaaaaaaaaa"
CLASS_B = "bbbbbbbbbbbbbbbb"


@pytest.fixture
def admin_and_tenant(db_url):
    ledger = Ledger(db_url)
    keys = ledger.create_key(is_admin=True), ledger.create_key("tenant-0")
    ledger.close()
    return keys


def run_cli(*args):
    """``llmvisor ARGS`` as its own process (`cli_process`), for the refusals; commands checked by their output run in this process
    (`invoke_cli`)."""
    return cli_process(*args, timeout_s=120)


def test_models_commands_add_list_activate_and_refuse_clearly(tmp_path, db_url):
    path = tmp_path / "a.json"
    class_model(CLASS_A).to_json(path)
    added = invoke_cli("models", "add", str(path), "--db", db_url, "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["version"] == 1 and json.loads(added.stdout)["engine_class"] == CLASS_A
    again = invoke_cli("models", "add", str(path), "--db", db_url, "--activate", "--json")
    assert json.loads(again.stdout)["version"] == 2
    listed = json.loads(invoke_cli("models", "list", "--db", db_url, "--json").stdout)["models"]
    assert [(m["engine_class"], m["version"], m["active"]) for m in listed] == [(CLASS_A, 1, False), (CLASS_A, 2, True)]
    activated = invoke_cli("models", "activate", CLASS_A, "1", "--db", db_url)
    assert activated.returncode == 0, activated.stderr
    assert Ledger(db_url).active_versions() == {CLASS_A: 1}

    wrong_class = run_cli("models", "add", str(path), "--class", CLASS_B, "--db", db_url)
    assert wrong_class.returncode == 2 and f"fitted on engine fingerprint {CLASS_A}, not {CLASS_B}" in wrong_class.stderr
    missing = run_cli("models", "activate", CLASS_A, "7", "--db", db_url)
    assert missing.returncode == 2 and "no model version 7" in missing.stderr and "Traceback" not in missing.stderr
    plain = tmp_path / "plain.json"
    model = class_model(CLASS_A)
    model.engine_fingerprint_ = None
    model.to_json(plain)
    unnamed = run_cli("models", "add", str(plain), "--db", db_url)
    assert unnamed.returncode == 2 and "--class" in unnamed.stderr


def test_models_over_http_need_an_admin_key(model_path, db_url, admin_and_tenant):  # noqa: F811
    admin, tenant = (bearer(k) for k in admin_and_tenant)
    body = {"model": class_model(CLASS_A).to_dict(), "activate": True}
    with TestClient(create_app(model_path, db_url)) as client:
        assert client.post("/v1/models", json=body).status_code == 401
        assert client.post("/v1/models", json=body, headers=tenant).status_code == 403
        assert client.get("/v1/models", headers=tenant).status_code == 403
        assert client.post(f"/v1/models/{CLASS_A}/1/activate", headers=tenant).status_code == 403
        assert client.get("/v1/models/drift", headers=tenant).status_code == 403
        created = client.post("/v1/models", json=body, headers=admin)
        assert created.status_code == 201, created.text
        assert created.json() | {"created_at": None} == {"engine_class": CLASS_A, "version": 1, "source": "POST /v1/models",
                                                         "created_at": None, "active": True}
        assert client.post("/v1/models", json={"model": body["model"]}, headers=admin).json()["version"] == 2
        assert [(m["version"], m["active"]) for m in client.get("/v1/models", headers=admin).json()] == [(1, True), (2, False)]
        assert client.post(f"/v1/models/{CLASS_A}/2/activate", headers=admin).status_code == 200
        assert [m["active"] for m in client.get("/v1/models", headers=admin).json()] == [False, True]
        assert client.post(f"/v1/models/{CLASS_A}/9/activate", headers=admin).status_code == 404
        bad = client.post("/v1/models", json={"model": {"format": "nope"}}, headers=admin)
        assert bad.status_code == 422 and "Traceback" not in bad.text


def test_a_class_without_a_model_is_pending_by_default_and_billed_only_by_a_named_fallback(model_path, db_url, admin_and_tenant, caplog):  # noqa: F811
    """The service's model (fitted on no recorded engine here) bills steps without a fingerprint only; steps of a
    class without a model wait, unless a fallback model is named: then it bills them, warning once per class."""
    admin = bearer(admin_and_tenant[0])
    plain = class_body(CLASS_A, 10, run_id="plain", seed=9)
    del plain["columns"]["engine_fingerprint"]
    with TestClient(create_app(model_path, db_url)) as client:
        response = client.post("/v1/steps", json=class_body(CLASS_A, 30, run_id="r", seed=1), headers=admin)
        assert response.status_code == 200 and response.json()["steps_pending"] == 30 and response.json()["attributed_ns"] == 0
        assert client.post("/v1/steps", json=plain, headers=admin).json()["steps_pending"] == 0
        totals = client.get("/v1/usage/totals", headers=admin).json()
        assert totals["pending_steps"] == 30 and totals["num_steps"] == 10 and totals["attributed_ns"] == totals["measured_ns"] > 0
        assert client.get("/v1/steps/r/0", headers=admin).json()["pending"] is True
    with TestClient(create_app(model_path, db_url, fallback_model_path=model_path)) as client, \
            caplog.at_level(logging.WARNING, "llmvisor.service"):
        for k in range(2):
            response = client.post("/v1/steps", json=class_body(CLASS_B, 20, run_id=f"fb{k}", seed=2 + k), headers=admin)
            assert response.json()["steps_pending"] == 0 and response.json()["attributed_ns"] > 0
        assert client.get("/v1/steps/fb0/0", headers=admin).json()["model_version"] is None
        assert client.get("/v1/usage/totals", headers=admin).json()["pending_steps"] == 30  # held steps stay held
    warned = [r.getMessage() for r in caplog.records if "fallback model" in r.getMessage()]
    assert len(warned) == 1 and CLASS_B in warned[0]


def test_the_service_model_bills_the_class_it_was_fitted_on(tmp_path, db_url, admin_and_tenant):  # noqa: F811
    admin = bearer(admin_and_tenant[0])
    own = tmp_path / "a.json"
    class_model(CLASS_A).to_json(own)
    app = create_app(own, db_url)
    summary = app.state.registry.billing_summary()
    assert any(CLASS_A in line and "--model" in line for line in summary)
    assert any("stored pending" in line for line in summary)
    with TestClient(app) as client:
        assert client.post("/v1/steps", json=class_body(CLASS_A, 12, run_id="a", seed=1), headers=admin).json()["steps_pending"] == 0
        assert client.post("/v1/steps", json=class_body(CLASS_B, 7, run_id="b", seed=2), headers=admin).json()["steps_pending"] == 7
    assert "pending now: bbbbbbbbbbbbbbbb 7 steps" in create_app(own, db_url).state.registry.billing_summary()[-1]
    from llmvisor import shipped

    old_format = create_app(shipped.latency_model_path(), db_url).state.registry.billing_summary()
    assert any("is a format-1 fingerprint" in line for line in old_format)


def test_serve_logs_what_it_bills_with_and_the_deprecated_flag_does_nothing(tmp_path, model_path):  # noqa: F811
    from llmvisor.service.process import ServerProcess

    log_path = tmp_path / "serve.log"
    db = f"sqlite:///{tmp_path}/ledger.db"
    with ServerProcess(model_path, db, log_path=log_path, extra_args=("--pending-unknown-classes",)) as server:
        key = Ledger(db).create_key(is_admin=True)
        import httpx

        body = class_body(CLASS_A, 5, run_id="d", seed=1)
        assert httpx.post(f"{server.url}/v1/steps", json=body, headers=bearer(key)).json()["steps_pending"] == 5
    text = log_path.read_text()
    assert "--pending-unknown-classes is deprecated and has no effect" in text
    assert "records no engine fingerprint; bills only steps that carry none" in text
    assert "stored pending" in text and "llmvisor models add FILE --activate" in text


def test_unknown_class_is_pending_then_attributed_on_activation_and_totals_reconcile(model_path, db_url, admin_and_tenant):  # noqa: F811
    admin = bearer(admin_and_tenant[0])
    app = create_app(model_path, db_url, registry_refresh_s=0.0)
    with TestClient(app) as client:
        known = client.post("/v1/models", json={"model": class_model(CLASS_A).to_dict(), "activate": True}, headers=admin)
        assert known.status_code == 201
        client.post("/v1/steps", json=class_body(CLASS_A, 40, run_id="ra", seed=2), headers=admin)
        response = client.post("/v1/steps", json=class_body(CLASS_B, 25, run_id="rb", seed=3), headers=admin)
        assert response.json()["steps_pending"] == 25 and response.json()["attributed_ns"] == 0
        before = client.get("/v1/usage/totals", headers=admin).json()
        billed_a = client.get("/v1/usage/tenants", headers=admin).json()["tenants"]
        assert before["num_steps"] == 40 and before["pending_steps"] == 25
        assert before["attributed_ns"] == before["measured_ns"], "pending steps must not count as attributed"
        assert client.get("/v1/steps/rb/3", headers=admin).json()["pending"] is True
        step_a = client.get("/v1/steps/ra/5", headers=admin).json()
        assert step_a["model_version"] == 1 and step_a["engine_class"] == CLASS_A

        added = client.post("/v1/models", json={"model": class_model(CLASS_B, seed=4).to_dict()}, headers=admin)
        activation = client.post(f"/v1/models/{CLASS_B}/{added.json()['version']}/activate", headers=admin).json()
        assert activation["pending_steps_attributed"] == 25
        after = client.get("/v1/usage/totals", headers=admin).json()
        assert after["pending_steps"] == 0 and after["num_steps"] == 65
        assert after["attributed_ns"] == after["measured_ns"] == before["measured_ns"] + before["pending_measured_ns"]
        assert activation["pending_attributed_ns"] == before["pending_measured_ns"]
        step_b = client.get("/v1/steps/rb/3", headers=admin).json()
        assert step_b["pending"] is False and step_b["model_version"] == 1 and step_b["predicted_s"] > 0
        assert sum(s["attributed_ns"] for s in step_b["slices"]) == step_b["measured_ns"]
        # Bills already written are not rewritten: class A's tenants keep what they had, plus B's shares.
        again = client.post(f"/v1/models/{CLASS_B}/1/activate", headers=admin).json()
        assert again["pending_steps_attributed"] == 0
        run_a = client.get("/v1/usage/requests?run_id=ra&limit=1000", headers=admin).json()["requests"]
        assert sum(r["attributed_ns"] for r in run_a) == sum(t["attributed_ns"] for t in billed_a)
        # A re-send of a step attributed after being pending is still a duplicate.
        resent = client.post("/v1/steps", json=class_body(CLASS_B, 25, run_id="rb", seed=3), headers=admin).json()
        assert resent["steps_duplicate"] == 25


def test_slowed_class_raises_the_drift_alarm_and_a_refit_activates(model_path, db_url, admin_and_tenant, tmp_path):  # noqa: F811
    admin = bearer(admin_and_tenant[0])
    drift = DriftSettings(band=0.10, window_steps=300, min_window_steps=100, alarm_after_steps=200)
    app = create_app(model_path, db_url, drift=drift, registry_refresh_s=0.0)
    with TestClient(app) as client:
        model = class_model(CLASS_A, coef_s=DEFAULT_COEF_S)
        client.post("/v1/models", json={"model": model.to_dict(), "activate": True}, headers=admin)

        def state():
            classes = client.get("/v1/models/drift", headers=admin).json()["classes"]
            return next(c for c in classes if c["engine_class"] == CLASS_A)

        client.post("/v1/steps", json=class_body(CLASS_A, 300, run_id="calm", seed=5), headers=admin)
        calm = state()
        assert calm["window_steps"] == 300 and abs(calm["median_relative_residual"]) < 0.02 and not calm["alarm"]
        t_slow = T0_S + 1000
        for k in range(4):  # 20 % slower: (1.2 - 1) / 1.2 = 0.167 of each measured step
            body = class_body(CLASS_A, 150, run_id=f"slow{k}", seed=10 + k, slowdown=1.2, first_timestamp_s=t_slow + 100 * k)
            assert client.post("/v1/steps", json=body, headers=admin).status_code == 200
        slowed = state()
        assert slowed["median_relative_residual"] == pytest.approx(0.2 / 1.2, abs=0.02)
        assert slowed["alarm"] and slowed["out_of_band_steps"] >= 200
        metrics = client.get("/metrics", headers=admin).text
        assert f'llmvisor_class_drift_alarm{{engine_class="{CLASS_A}"}} 1.0' in metrics
        assert "llmvisor_class_abs_relative_residual{" in metrics

        ledger = Ledger(db_url)
        result = refit_class(ledger, CLASS_A, newest_steps=500, test_fraction=0.2)
        ledger.close()
        assert result.version == 2 and result.active_version == 1 and result.test_steps == 100
        assert result.active_error == pytest.approx(0.2 / 1.2, abs=0.02)
        assert result.new_error < 0.02 and result.activated
        # The window restarts with the new version: the next slowed steps sit inside the band.
        client.post("/v1/steps", json=class_body(CLASS_A, 200, run_id="after", seed=30, slowdown=1.2,
                                                    first_timestamp_s=t_slow + 1000), headers=admin)
        refitted = state()
        assert refitted["active_version"] == 2 and abs(refitted["median_relative_residual"]) < 0.02 and not refitted["alarm"]

    # A refit that is not better is stored, not activated; the CLI prints both errors.
    printed = invoke_cli("refit", "--class", CLASS_A, "--db", db_url, "--newest-steps", "500")
    assert printed.returncode == 0, printed.stderr
    assert "new v3" in printed.stdout and "active v2" in printed.stdout
    activated = "v3 activated" in printed.stdout
    assert activated or "v3 stored, not activated" in printed.stdout
    assert Ledger(db_url).active_versions()[CLASS_A] == (3 if activated else 2)


def test_refit_from_trace_files_holds_out_the_newest_steps(tmp_path, db_url):
    from llmvisor.core.trace import write_trace

    trace = synthetic_trace(400, seed=7, max_batch_size=16)
    path = tmp_path / "t.parquet"
    write_trace(trace, path)
    ledger = Ledger(db_url)
    try:
        first = refit_class(ledger, CLASS_B, traces=[path], test_fraction=0.25)
        assert first.activated and first.active_version is None and (first.train_steps, first.test_steps) == (300, 100)
        with pytest.raises(Exception, match="too few"):
            refit_class(ledger, "cccccccccccccccc")
    finally:
        ledger.close()
    assert np.isfinite(first.new_error)


def test_a_refit_from_the_ledger_fits_the_shared_kv_term_of_attributed_steps(model_path, db_url, admin_and_tenant):  # noqa: F811
    """Steps sent with the sharing columns (format v2) and attributed at once keep them in the ledger, so a refit
    from the ledger finds the shared-KV price the engine has (it used to read them back as unshared)."""
    from llmvisor.core.features import Coef
    from llmvisor.service.ingest import trace_from_stored

    coef_s = dict(DEFAULT_COEF_S, effective_context_tokens=4e-7)
    admin = bearer(admin_and_tenant[0])
    app = create_app(model_path, db_url, fallback_model_path=model_path, registry_refresh_s=0.0)
    bodies = [class_body(CLASS_A, 600, run_id=f"shared-{k}", seed=20 + k, coef_s=coef_s, first_timestamp_s=T0_S + 600 * k,
                         shared_prefix_fraction=0.6) for k in range(3)]
    with TestClient(app) as client:
        for body in bodies:
            response = client.post("/v1/steps", json=body, headers=admin)
            assert response.status_code == 200 and response.json()["steps_pending"] == 0, response.text
    sent = [body["columns"] for body in bodies]
    ledger = Ledger(db_url)
    try:
        stored = trace_from_stored(ledger.stored_steps(CLASS_A), CLASS_A)
        assert stored.has_sharing_columns and stored.n_steps == sum(len(set(c["step_id"])) for c in sent)
        assert int(stored.num_shared_context_tokens.sum()) == sum(sum(c["num_shared_context_tokens"]) for c in sent) > 0
        np.testing.assert_allclose(stored.effective_context_tokens.sum(), sum(sum(c["effective_context_tokens"]) for c in sent))
        result = refit_class(ledger, CLASS_A, test_fraction=0.25)
        model = StepLatencyModel.from_dict(json.loads(ledger.model_json(CLASS_A, result.version)))
    finally:
        ledger.close()
    assert model.identified_[Coef.E]
    assert model.coef_[:, Coef.E] == pytest.approx(4e-7, rel=0.2)


def test_a_model_version_is_known_once_stored_and_an_unknown_one_is_asked_again(db_url):  # noqa: F811
    """`Ledger.has_model_version` (the windows route's check of every window's version) remembers versions it
    found, never ones it did not: a version added later, by this process or another, is then found."""
    asker, writer = Ledger(db_url), Ledger(db_url)
    try:
        assert not asker.has_model_version(CLASS_A, 1)
        version = writer.add_model(CLASS_A, json.dumps(class_model(CLASS_A).to_dict()), "test")
        assert asker.has_model_version(CLASS_A, version) and asker.has_model_version(CLASS_A, version)
        assert not asker.has_model_version(CLASS_A, version + 1) and not asker.has_model_version("bbbbbbbbbbbbbbbb", version)
    finally:
        asker.close()
        writer.close()
