"""Every command (but the server) has --json, and its JSON says what the text says."""

from __future__ import annotations

import json
import os

import typer

from _processes import cli_process
from llmvisor.cli.main import app
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import write_trace

WITHOUT_JSON = {"serve"}


def run_cli(*args):
    completed = cli_process(*args, timeout_s=120, env={**os.environ, "COLUMNS": "200"})
    assert completed.returncode == 0, completed.stderr
    return completed


def leaf_commands(command, path: tuple[str, ...] = ()):
    if hasattr(command, "list_commands"):
        context = typer.Context(command)
        for name in command.list_commands(context):
            yield from leaf_commands(command.get_command(context, name), (*path, name))
    else:
        yield " ".join(path), command


def test_every_command_but_serve_has_a_json_option():
    commands = dict(leaf_commands(typer.main.get_command(app)))
    assert {"fit", "eval", "profile", "validate", "experiment fairness", "experiment fleet", "keys create", "ledger migrate"} <= set(commands)
    lacking = [name for name, command in commands.items() if name not in WITHOUT_JSON and not any("--json" in p.opts for p in command.params)]
    assert lacking == []


def test_fit_json_is_the_saved_model(tmp_path):
    write_trace(synthetic_trace(600, noise=0.02, run_id="train", seed=1), tmp_path / "train.parquet")
    completed = run_cli("fit", tmp_path / "train.parquet", "-o", tmp_path / "model.json", "--json")
    printed = json.loads(completed.stdout)
    saved = json.loads((tmp_path / "model.json").read_text())
    assert printed["output"] == str(tmp_path / "model.json")
    assert printed["model"]["segments"] == saved["segments"]
    assert printed["boundary_new_tokens"] == saved["boundary_new_tokens"]


def test_keys_json_round_trip(tmp_path):
    db = f"sqlite:///{tmp_path}/ledger.db"
    created = json.loads(run_cli("keys", "create", "--tenant", "acme", "--db", db, "--json").stdout)
    assert created["tenant"] == "acme" and created["admin"] is False and created["key"].startswith(f"lvk_{created['key_id']}_")
    listed = json.loads(run_cli("keys", "list", "--db", db, "--json").stdout)
    assert [(k["key_id"], k["tenant"], k["revoked"]) for k in listed] == [(created["key_id"], "acme", False)]
    assert json.loads(run_cli("keys", "revoke", created["key_id"], "--db", db, "--json").stdout) == {"revoked": created["key_id"]}
    listed = json.loads(run_cli("keys", "list", "--db", db, "--json").stdout)
    assert listed[0]["revoked"] is True and listed[0]["revoked_utc"] is not None
