"""The service's commands: keys create/list/revoke, and the bounded load command (its figure is printed, not asserted)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from _processes import cli_process, run_process
from _service_fixtures import model_path  # noqa: F401
from llmvisor.cli.load import load
from llmvisor.cli.serve import keys_create
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.load import check_loopback


def run_service_command(*args):
    """``llmvisor ARGS`` as its own process (`cli_process`); `load` starts a service of its own: in the helper's process
    group (`run_process`), so a timeout leaves none behind."""
    if args[0] == "load":
        return run_process([sys.executable, "-m", "llmvisor.cli", *args], timeout_s=120)
    return cli_process(*args, timeout_s=120)


def test_keys_commands_print_the_key_once_and_store_only_its_hash(tmp_path):
    db = f"sqlite:///{tmp_path}/ledger.db"
    created = run_service_command("keys", "create", "--tenant", "acme", "--db", db)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert re.fullmatch(r"lvk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}", key)
    ledger = Ledger(db)
    assert ledger.authenticate(key).tenant == "acme"
    listed = run_service_command("keys", "list", "--db", db)
    assert "tenant=acme" in listed.stdout and key.split("_", 2)[2] not in listed.stdout
    key_id = key.split("_")[1]
    revoked = run_service_command("keys", "revoke", key_id, "--db", db)
    assert revoked.returncode == 0 and f"revoked {key_id}" in revoked.stdout, revoked.stdout + revoked.stderr
    assert ledger.authenticate(key) is None
    ledger.close()
    # Only once no connection is open: closing any descriptor of the file would drop SQLite's locks.
    assert key.split("_", 2)[2].encode() not in b"".join(p.read_bytes() for p in tmp_path.glob("ledger.db*"))
    neither = run_service_command("keys", "create", "--db", db)
    assert neither.returncode == 2 and "--tenant" in neither.stderr and "Traceback" not in neither.stderr


def test_keys_create_function(tmp_path, capsys):
    keys_create(tenant=None, db=f"sqlite:///{tmp_path}/x.db", admin=True)
    assert capsys.readouterr().out.startswith("lvk_")
    with pytest.raises(LlmvisorError):
        keys_create(tenant="t", db=f"sqlite:///{tmp_path}/x.db", admin=True)


def test_load_command_runs_bounded_and_reconciles(model_path, capsys):
    for body in ("parquet", "columns", "rows"):
        load(db=["sqlite"], url=None, api_key=None, model=model_path, steps=1500, batch_size=8, steps_per_request=500,
             concurrency=2, step_interval_ms=20.0, max_seconds=60, body=body, json_output=False)
        line = capsys.readouterr().out.strip()
        assert re.search(r"^sqlite .*: 1,500 steps \(B=8\) in [\d.]+ s = [\d,]+ steps/s", line), line
        assert f"in the {body} form" in line and "0 failed POSTs; totals reconcile" in line


def test_load_json_prints_the_measured_figures(model_path, capsys):
    load(db=["sqlite", "sqlite"], url=None, api_key=None, model=model_path, steps=1000, batch_size=4, steps_per_request=250,
         concurrency=1, step_interval_ms=20.0, max_seconds=60, body="columns", json_output=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["settings"] == {"batch_size": 4, "steps_per_request": 250, "concurrency": 1, "body": "columns", "step_interval_ms": 20.0}
    assert len(printed["targets"]) == 2
    for target in printed["targets"]:
        assert target["target"].startswith("sqlite (sqlite:///")
        assert target["steps"] == 1000 and target["slices"] == 4000 and target["requests"] == 4 and target["failed_posts"] == 0
        assert target["reconciled"] is True
        assert target["steps_per_s"] == pytest.approx(target["steps"] / target["elapsed_s"])


def test_load_json_from_the_command_line_is_only_json(model_path):
    done = run_service_command("load", "--model", str(model_path), "--steps", "200", "--batch-size", "2",
                               "--steps-per-request", "100", "--concurrency", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["targets"][0]["steps"] == 200


def test_load_only_targets_loopback():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://192.168.1.1"):
        with pytest.raises(LlmvisorError, match="loopback"):
            check_loopback(url)
