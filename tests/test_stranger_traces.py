"""Any valid trace a stranger could have: every core command succeeds on it or refuses it in one line.

Generated traces (`_trace_strategies`) run through the command line in process (typer's test runner):
`fit`, `eval` (train and test split by run, so held-out stays held out), `attribute` and
`calibrate --from-trace`. Each exits 0, or exits 2 with exactly one line on stderr naming the reason;
never a traceback or another exit code. Where a command succeeds, its figures must account for the trace.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import typer
import typer.main
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

from _trace_strategies import TraceChoices, build_generated_trace, stranger_traces
from llmvisor.cli.main import app
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S

RUNNER = CliRunner()


def invoke(*args) -> tuple[int, str, str]:
    """Run one command in process: (exit code, stdout, stderr); any exception but a clean exit fails the test
    with its traceback, and a refusal must be one line on stderr."""
    result = RUNNER.invoke(app, [str(a) for a in args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"llmvisor {' '.join(map(str, args))} raised {result.exception!r}") from result.exception
    assert result.exit_code in (0, 2), f"llmvisor {' '.join(map(str, args))}: exit {result.exit_code}\n{result.stderr}"
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"llmvisor {' '.join(map(str, args))}: {result.stderr!r}"
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def one_segment_model(tmp_path_factory) -> Path:
    """A model for attributing traces `fit` refused: the synthetic engine's coefficients, one segment."""
    path = tmp_path_factory.mktemp("model") / "model.json"
    StepLatencyModel.from_coefficients([DEFAULT_COEF_S]).to_json(path)
    return path


def bootstrap_option() -> str:
    """The option of `eval` that sets the bootstrap resamples, as this version spells it."""
    command = typer.main.get_command(app).get_command(typer.Context(typer.main.get_command(app)), "eval")
    names = [name for param in command.params for name in param.opts if "bootstrap" in name]
    return next((name for name in names if name.startswith("--n-")), names[0])


PROPERTY_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@settings(max_examples=200, **PROPERTY_SETTINGS)
@given(generated=stranger_traces())
def test_fit_attribute_and_calibrate_take_any_valid_trace_or_refuse_it_in_one_line(generated, one_segment_model):
    """fit, attribute (with the fitted model, or a given one where fit refused) and calibrate --from-trace."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        files = generated.write_files(folder, "trace")
        model = folder / "model.json"
        code, out, _ = invoke("fit", *files, "-o", model, "--json")
        if code == 0:
            fitted = json.loads(out)["model"]
            assert json.loads(model.read_text())["segments"] == fitted["segments"]
            search = fitted["fit_info"]["boundary_search"]
            assert search["chosen"] in search["candidates"] or "reason" in search
            assert fitted["fit_info"]["n_steps_total"] == generated.trace.n_steps
        code, out, _ = invoke("attribute", *files, "--model", model if code == 0 else one_segment_model, "--json")
        if code == 0:
            result = json.loads(out)
            assert result["n_steps"] == generated.trace.n_steps
            assert result["total_measured_s"] == pytest.approx(generated.measured_s, rel=1e-9)
            assert result["total_attributed_s"] == pytest.approx(generated.measured_s, rel=1e-9)
        invoke("calibrate", *(word for path in files for word in ("--from-trace", path)), "-o", folder / "calibrated.json", "--json")


@settings(max_examples=40, **PROPERTY_SETTINGS)
@given(generated=stranger_traces(max_long_run=600))
def test_eval_on_held_out_runs_of_any_valid_trace_succeeds_or_refuses_in_one_line(generated):
    """eval --train (the first half of the runs) --test (the others); a trace of one run cannot be held out from
    itself, so eval on it twice must be refused in one line. Fewer examples: eval fits four models."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        runs = generated.run_ids
        if len(runs) >= 2:
            train = generated.write_files(folder, "train", runs[: len(runs) // 2])
            test = generated.write_files(folder, "test", runs[len(runs) // 2 :])
        else:
            train = test = generated.write_files(folder, "trace")
        code, out, _ = invoke("eval", "--train", *train, "--test", *test, bootstrap_option(), 20, "--json")
        if len(runs) < 2:
            assert code == 2
        elif code == 0:
            assert set(json.loads(out)["test_runs"]) == set(runs[len(runs) // 2 :])


def two_runs(lengths=(300, 472), **changes) -> TraceChoices:
    choices = dict(
        run_lengths=lengths, max_batch_size=8, phases="any", token_scale="normal", latency="engine", sharing=False,
        episodes=None, warmup="none", drifted=False, optional_columns=False, first_step_id=0, step_stride=1, n_tenants=3,
        names=("run-a", "run-b", "t0", "t1", "t2", "t3", "t4", "t5"), suffix=".jsonl", shuffled=False, seed=7,
    )
    return TraceChoices(**{**choices, **changes})


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_fit_on_two_runs_of_300_and_472_steps_succeeds(tmp_path, suffix):
    """The generated trace of the issue: the old folds put both runs in fold 0 and `fit` ended in
    ValueError: min() arg is an empty sequence."""
    generated = build_generated_trace(two_runs(suffix=suffix))
    assert [np.sum(generated.trace.run_id_per_step == run) for run in generated.run_ids] == [300, 472]
    path = generated.write(tmp_path / "trace")
    code, out, _ = invoke("fit", path, "-o", tmp_path / "model.json", "--json")
    assert code == 0
    search = json.loads(out)["model"]["fit_info"]["boundary_search"]
    assert search["fold_grouping"] == "run" and search["n_folds"] == 2
    code, _, _ = invoke("eval", "--train", generated.write(tmp_path / "a", ["run-a"]), "--test", generated.write(tmp_path / "b", ["run-b"]),
                        bootstrap_option(), 20, "--json")
    assert code == 0


def test_fit_states_why_the_boundary_is_none_when_nothing_can_be_scored(tmp_path):
    """A run of identical decode steps is one time-block group (a single run's folds are time blocks, identical
    compositions joined): no fold to score on, so the boundary is none and `fit` says why."""
    generated = build_generated_trace(two_runs(lengths=(80,), max_batch_size=1, phases="decode", token_scale="tiny", seed=1))
    generated.trace.num_context_tokens[:] = 3
    path = generated.write(tmp_path / "trace")
    code, _, err = invoke("fit", path, "-o", tmp_path / "model.json")
    assert code == 0
    assert "boundary: none (no boundary could be cross-validated: the 80 training step(s) form 1 time-block group(s)" in err
    assert "reason" in json.loads((tmp_path / "model.json").read_text())["fit_info"]["boundary_search"]
