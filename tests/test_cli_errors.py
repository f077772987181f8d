"""The command line's error contract at the edges: bad input is one line on stderr and exit 2, never a
traceback, nothing half-written; help is readable at 80 columns; renamed options keep working with a warning."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

import llmvisor
from llmvisor import shipped
from llmvisor.cli import params
from llmvisor.cli.main import app
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import write_trace
from llmvisor.errors import LlmvisorError

SERVICE = all(map(__import__("llmvisor.extras", fromlist=["is_importable"]).is_importable, ("fastapi", "uvicorn", "sqlalchemy")))


def invoke(*args, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1", **(env or {})})


def one_line_error(result, *fragments: str) -> str:
    """The one error line of a failed run (exit 2, nothing on stdout), checked to hold ``fragments``."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-errors")
    write_trace(synthetic_trace(300, noise=0.02, run_id="r1", seed=1), folder / "good.csv")
    write_trace(synthetic_trace(200, noise=0.02, run_id="r2", seed=2), folder / "other.csv")
    shutil.copy(folder / "good.csv", folder / "renamed.csv")
    lines = (folder / "good.csv").read_text().splitlines()
    (folder / "header.csv").write_text(lines[0] + "\n")
    (folder / "empty.jsonl").write_text("")
    (folder / "a-folder").mkdir()
    assert invoke("fit", folder / "good.csv", "-o", folder / "model.json").exit_code == 0
    return folder


def test_attribute_refuses_a_file_given_twice_or_a_renamed_copy(files):
    one_line_error(invoke("attribute", files / "good.csv", files / "good.csv", "--model", files / "model.json"), "run 'r1'", "unique")
    one_line_error(invoke("attribute", files / "good.csv", files / "renamed.csv", "--model", files / "model.json"), "renamed.csv", "good.csv")
    both = invoke("attribute", files / "good.csv", files / "other.csv", "--model", files / "model.json", "--json")
    assert both.exit_code == 0, both.output
    assert json.loads(both.stdout)["n_steps"] == 500


def test_attribute_a_a_is_one_line_in_a_real_process(files):
    done = subprocess.run([sys.executable, "-m", "llmvisor.cli", "attribute", str(files / "good.csv"), str(files / "good.csv"),
                           "--model", str(files / "model.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_a_model_path_that_is_a_folder_or_not_a_model(files):
    one_line_error(invoke("attribute", files / "good.csv", "--model", files / "a-folder"), "--model", "a-folder", "directory")
    one_line_error(invoke("attribute", files / "good.csv", "--model", files / "good.csv"), "good.csv", "not valid JSON")
    (files / "not-a-model.json").write_text('{"format": "something else"}')
    one_line_error(invoke("attribute", files / "good.csv", "--model", files / "not-a-model.json"), "not an llmvisor model file")
    with pytest.raises(LlmvisorError, match="is a folder, not a model file"):
        StepLatencyModel.from_json(files / "a-folder")


def test_fit_output_in_a_missing_folder_or_on_a_folder(files, tmp_path):
    one_line_error(invoke("fit", files / "good.csv", "-o", tmp_path / "missing" / "m.json"), "missing", "no such folder")
    assert not (tmp_path / "missing").exists()
    target = tmp_path / "out"
    target.mkdir()
    one_line_error(invoke("fit", files / "good.csv", "-o", target), "--output", "directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary file may be left beside the target"


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    model = StepLatencyModel().fit(synthetic_trace(300, seed=3))
    (tmp_path / "model.json").mkdir()
    with pytest.raises(OSError):
        model.to_json(tmp_path / "model.json")
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]


def test_the_output_check_runs_before_the_work():
    with pytest.raises(LlmvisorError, match="no such folder"):
        params.check_output_file(Path("/nonexistent-folder/x.json"))
    with pytest.raises(LlmvisorError, match="is a file; give a folder"):
        params.check_output_folder(Path(__file__))
    with pytest.raises(LlmvisorError, match="the folder cannot be created"):
        params.check_output_folder(Path(__file__) / "out")


def test_the_output_folder_check_creates_nothing(tmp_path):
    """A command refused after the check (a bad later option) leaves no folder behind."""
    assert params.check_output_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["empty.jsonl", "header.csv"])
def test_eval_on_an_empty_test_trace_names_the_file(files, name):
    one_line_error(invoke("eval", "--train", files / "good.csv", "--test", files / name, "--bootstrap", "0"), name, "no steps")


@pytest.mark.parametrize("name", ["empty.jsonl", "header.csv"])
def test_attribute_refuses_an_empty_trace_as_fit_does(files, name):
    one_line_error(invoke("attribute", files / name, "--model", files / "model.json"), name, "no steps")
    one_line_error(invoke("fit", files / name, "-o", files / "never.json"), name, "no steps")


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("attribute", "{good}", "--model", "{model}", "--top", "-3"), "--top"),
        (("attribute", "{good}", "--model", "{model}", "--top", "0"), "--top"),
        (("eval", "--train", "{good}", "--test", "{other}", "--bootstrap", "-5"), "--bootstrap"),
        (("demo", "--bootstrap", "-1"), "--bootstrap"),
        (("validate", "-o", "{out}", "--repeat", "0"), "--repeat"),
        (("validate", "-o", "{out}", "--max-batch", "9"), "--max-batch"),
        (("profile", "-o", "{out}", "--points", "-1"), "--points"),
        (("profile", "-o", "{out}", "--max-num-seqs", "0"), "--max-num-seqs"),
        (("calibrate", "-o", "{out}", "--from-trace", "{good}", "--points", "0"), "--points"),
        (("experiment", "fairness", "--tenants", "1"), "--tenants"),
    ],
)
def test_counts_below_their_floor_are_refused(files, tmp_path, args, option):
    values = {"good": files / "good.csv", "other": files / "other.csv", "model": files / "model.json", "out": tmp_path / "out.json"}
    one_line_error(invoke(*(a.format(**values) for a in args)), f"'{option}'")
    assert not any(tmp_path.iterdir())


def leaf_commands(command, path=()):
    if hasattr(command, "list_commands"):
        context = typer.Context(command)
        for name in command.list_commands(context):
            yield from leaf_commands(command.get_command(context, name), (*path, name))
    else:
        yield path, command


COMMANDS = list(leaf_commands(typer.main.get_command(app)))


def test_every_count_option_has_a_floor():
    unbounded = [
        (" ".join(path), param.name)
        for path, command in COMMANDS
        for param in command.params
        if param.param_type_name == "option" and getattr(param.type_descriptor, "annotation", None) in (int, int | None) and param.min is None
    ]
    assert unbounded == []


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=" ".join)
def test_help_is_readable_at_80_columns(path):
    result = invoke(*path, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert not re.search(r"<(bool|int|float|str|path|file|dir|list\[)", text), text
    assert max(map(len, text.splitlines())) <= 80
    command = dict(COMMANDS)[path]
    for param in command.params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (path, name)


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"llmvisor {llmvisor.__version__}"


def test_model_means_the_latency_model_everywhere_and_old_spellings_warn(files, tmp_path):
    commands = dict(COMMANDS)
    for path in (("attribute",), ("validate",), ("serve",), ("load",), ("experiment", "fairness"), ("experiment", "fleet")):
        (model,) = [p for p in commands[path].params if "--model" in p.opts]
        assert "--engine-model" not in model.opts and "atency model" in model.help, path
    warnings = []
    assert params.rename_deprecated(commands[("profile",)], ["--model", "weights", "--", "--model"], warnings.append) == [
        "--engine-model", "weights", "--", "--model"]
    assert params.rename_deprecated(commands[("validate",)], ["--model", "m.json", "--latency-model=m.json", "--n-bootstrap", "5"],
                                    warnings.append) == ["--model", "m.json", "--model=m.json", "--bootstrap", "5"]
    assert warnings == ["--model is deprecated; use --engine-model", "--latency-model is deprecated; use --model",
                        "--n-bootstrap is deprecated; use --bootstrap"]
    result = invoke("demo", "--output-dir", files / "good.csv")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and lines[0] == "warning: --output-dir is deprecated; use --output", result.stderr
    assert len(lines) == 2 and "'--output'" in lines[1] and "is a file" in lines[1]


def test_validate_prints_its_goals_in_words_not_a_dict():
    from llmvisor.cli.validate import print_summary

    out = io.StringIO()
    print_summary(Console(file=out, width=200), json.loads(shipped.result_path("validation.json").read_text()))
    text = out.getvalue()
    assert "{'" not in text and "': " not in text, text
    assert re.search(r"decode goals of shapley: p50 ≤ 5% of the step (met|not met); p90 ≤ 10% (met|not met)", text), text


def test_fairness_prints_its_goals_in_words_not_a_dict():
    from llmvisor.cli.experiment import print_summary

    out = io.StringIO()
    print_summary(Console(file=out, width=250), json.loads(shipped.result_path("fairness.json").read_text()))
    text = out.getvalue()
    assert "{'" not in text, text
    assert "attributed vtc within max min: yes" in text


@pytest.mark.skipif(not SERVICE, reason="needs the [service] extra")
def test_serve_on_a_busy_port_is_one_line_and_creates_no_ledger(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ledger = tmp_path / "ledger.db"
        done = subprocess.run(
            [sys.executable, "-m", "llmvisor.cli", "serve", "--port", str(port), "--db", f"sqlite:///{ledger}"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"},
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and f"--port {port}" in done.stderr, done.stderr
    assert "startup complete" not in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir()), "a refused start must not create a ledger"


def test_admission_refuses_an_eval_result_without_the_held_out_factor_in_one_line(tmp_path):
    bad = tmp_path / "eval.json"
    bad.write_text(json.dumps({"evaluation": {"models": {}}}))
    one_line_error(invoke("experiment", "admission", "-o", tmp_path / "out", "--held-out-eval", bad), "eval.json", "underprediction_factor_p90")
    one_line_error(invoke("experiment", "admission", "-o", tmp_path / "out", "--held-out-eval", tmp_path / "missing.json"), "missing.json")
    one_line_error(invoke("experiment", "admission", "-o", tmp_path / "out", "--seeds", "0,x"), "--seeds")
    # --like repeats the fairness run's engine settings, its dtype included (a run before --dtype ran vLLM's auto)
    like = json.loads(shipped.result_path("fairness.json").read_text())
    like["setup"]["engine"]["dtype"] = "fp8"
    (tmp_path / "like.json").write_text(json.dumps(like))
    one_line_error(invoke("experiment", "admission", "-o", tmp_path / "out", "--like", tmp_path / "like.json"), "--dtype", "'fp8'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--plan", "lora", "--lora-ranks", "8,x"), "--lora-ranks: expected ranks like '8,16,64'"),
        (("--plan", "lora", "--lora-ranks", "8,0"), "--lora-ranks: each rank must be 1..512"),
        (("--plan", "lora", "--lora-modules", "q_proj,lm_head"), "LoRA target modules must be some of"),
        (("--max-loras", "2", "--max-lora-rank", "24"), "--max-lora-rank: vLLM takes one of 1, 8, 16"),
    ],
)
def test_the_lora_options_are_checked_before_an_engine_starts(tmp_path, args, fragment):
    one_line_error(invoke("profile", "-o", tmp_path / "out.parquet", *args), fragment)
    assert not (tmp_path / "out.parquet").exists()
