"""scripts/measure-shared-read.py's analysis: the share of a decode context token's price that a second reader of its KV
block saves, fitted on each method's coalition steps, tells an engine that reads a shared block once from one that reads
it once per reader (synthetic engines; the script's engine part is the validate measuring loop)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmvisor.validation.coalitions import coalition_steps_trace
from llmvisor.validation.measurement import Journal, measure_sampled
from llmvisor.validation.plans import Envelope, SampledKind, draw_coalition_batches
from test_validation import mixes
from test_validation_coalitions import GroupedEngine, grouped_sharing_cost

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measure-shared-read.py"


def script():
    spec = importlib.util.spec_from_file_location("measure_shared_read", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_per_reader_cost(slices) -> float:
    """`grouped_sharing_cost`'s engine with every reader reading its whole context: sharing saves nothing."""
    from test_validation_sampled_plan import D6, D7, B

    return B + sum(D7 + D6 * s.num_context_tokens for s in slices)


@pytest.mark.parametrize(("cost", "saving"), [(grouped_sharing_cost, 1.0), (read_per_reader_cost, 0.0)])
def test_the_fitted_saving_tells_a_block_read_once_from_one_read_per_reader(tmp_path, cost, saving):
    plan = draw_coalition_batches(mixes(), Envelope(4096, 2048, 32), n_batches=6, coalitions_per_request=4, sizes=(16,),
                                  kinds=(SampledKind.MIXED_SHARING_DECODE.value,), sharing_layout="pairs", seed=2)
    journal = Journal(tmp_path / "j.jsonl")
    measure_sampled(GroupedEngine(cost, noise=0.01, seed=1), plan, journal, repeat=1, warm_up_steps=0)
    fit = script().saving_with_interval(coalition_steps_trace(plan, journal, {b.index for b in plan}, disturbed=True),
                                        n_bootstrap=20, seed=0)
    assert fit["n_request_sets"] == 6 and fit["shared_read_saving"][0] == pytest.approx(saving, abs=0.1)
    low, high = fit["bootstrap_first_segment_ci95"]
    assert low - 0.05 <= saving <= high + 0.05 and high - low < 0.3
    offsets = script().offsets_fit(plan, journal, {b.index for b in plan}, n_bootstrap=20, seed=0)
    assert offsets["shared_read_saving"] == pytest.approx(saving, abs=0.1) and offsets["n_steps"] == fit["n_steps"]
    assert offsets["ci95"][0] - 0.05 <= saving <= offsets["ci95"][1] + 0.05


def test_the_documented_command_parses(monkeypatch, capsys):
    """`python scripts/measure-shared-read.py`, as docs/validation.md names it, with the options its docstring shows."""
    monkeypatch.setattr("sys.argv", ["measure-shared-read.py", "--batches", "12", "--coalitions-per-request", "8", "--help"])
    with pytest.raises(SystemExit) as stop:
        script().main()
    assert stop.value.code == 0 and "--coalitions-per-request" in capsys.readouterr().out
    assert "python scripts/measure-shared-read.py" in (SCRIPT.parents[1] / "docs" / "validation.md").read_text(encoding="utf-8")
