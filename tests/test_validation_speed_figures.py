"""docs/validation.md's measuring-speed figures come from docs/results/validation-speed.json, which
`python scripts/measure-validation-speed.py` wrote, and its words (the ratio, the goal's verdict, the equivalence
check) are true of that file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "docs" / "results" / "validation-speed.json"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def speed_doc_figures(result: dict) -> list[str]:
    """The sentences docs/validation.md quotes, built from the result."""
    runs, ratio = result["runs"], result["ratio_warm_over_cold"]
    loads = [x for r in runs for x in r["load_average_1min_min_max"]]
    plan, tokens = result["plan"], result["preparation_prefill_tokens"]
    goal = result["warm_over_previous"] >= 3

    def equivalence(eq: dict) -> str:
        wc, floor = eq["warm_vs_cold"], eq["noise_floor"]
        return (f"warm against cold |difference| p50 {pct(wc['abs_p50'])} / p90 {pct(wc['abs_p90'])}, median {100 * wc['median']:+.1f}% "
                f"[{100 * wc['median_ci95'][0]:+.1f}%, {100 * wc['median_ci95'][1]:+.1f}%], two measurements by one method "
                f"p50 {pct(floor['abs_p50'])} / p90 {pct(floor['abs_p90'])}: "
                + ("within that noise floor" if eq["within_noise_floor"] else "outside that noise floor") + "; " + shift(wc))

    def shift(wc: dict) -> str:
        lo, hi = wc["median_ci95"]
        if lo <= 0 <= hi:
            return "no shift between the methods (the median's interval holds 0)"
        return f"warm {'below' if hi < 0 else 'above'} cold by {abs(100 * wc['median']):.1f}% at the median"

    return [
        f"{plan['batches']} batches ({', '.join(map(str, plan['batch_sizes']))} requests), {plan['steps_per_method_and_repeat']} "
        f"coalition steps per method and repeat, {result['repeats']} repeats",
        f"{result['steps_spent']['cold'] + result['steps_spent']['warm']:,} measured steps spent",
        f"cold {result['steps_per_s']['cold']:.2f} steps/s, warm {result['steps_per_s']['warm']:.2f} steps/s (medians over repeats)",
        f"warm ÷ cold {ratio['median']:.2f}× (per repeat {', '.join(f'{x:.2f}' for x in ratio['per_repeat'])}×)",
        f"preparing contexts computed {tokens['cold']:,} prefill tokens cold and {tokens['warm']:,} warm",
        f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on 2 cores",
        f"warm's {result['steps_per_s']['warm']:.2f} steps/s is {result['warm_over_previous']:.2f}× the shipped journal's "
        f"{result['previous_steps_per_s']:g}: " + ("the goal of 3× is met" if goal else "the goal of 3× is not met here"),
        "relative to its batch-round's median, " + equivalence(result["equivalence"]["relative_to_chunk"]),
        "raw step times, " + equivalence(result["equivalence"]["raw"]),
    ]


def not_in_the_doc(figures: list[str]) -> list[str]:
    """The figures docs/validation.md does not state word for word (whitespace folded)."""
    doc = " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())
    return [f for f in figures if f not in doc]


def test_the_speed_result_is_consistent():
    result = json.loads(RESULT.read_text(encoding="utf-8"))
    assert result["command"] == "python scripts/measure-validation-speed.py"
    # the documented command, without flags, reproduces the plan: it is the script's defaults
    script = (REPO / "scripts" / "measure-validation-speed.py").read_text(encoding="utf-8")
    for flag, value in (("--repeats", result["repeats"]), ("--batches", result["plan"]["batches"]),
                        ("--coalitions-per-request", result["plan"]["coalitions_per_request"])):
        assert f'"{flag}", type={type(value).__name__}, default={value!r}' in script, flag
    runs = result["runs"]
    for rep in range(result["repeats"]):
        by = {r["method"]: r for r in runs if r["repeat"] == rep}
        assert by["warm"]["measured_steps"] == by["cold"]["measured_steps"] == result["plan"]["steps_per_method_and_repeat"]
        assert result["ratio_warm_over_cold"]["per_repeat"][rep] == by["warm"]["steps_per_s"] / by["cold"]["steps_per_s"]
        assert by["warm"]["context_growth_tokens"]["max"] == 0 < by["cold"]["context_growth_tokens"]["max"]
        assert by["warm"]["preparations"] == result["plan"]["batches"] < by["cold"]["preparations"]
        assert 0 < by["warm"]["prefill_tokens_outside_measured_steps"] < by["cold"]["prefill_tokens_outside_measured_steps"]
    for method in ("cold", "warm"):
        mine = [r["steps_per_s"] for r in runs if r["method"] == method]
        assert result["steps_per_s"][method] == float(np.median(mine))
        assert result["steps_spent"][method] == sum(r["measured_steps"] for r in runs if r["method"] == method)
    ratio = result["ratio_warm_over_cold"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert result["warm_over_previous"] == result["steps_per_s"]["warm"] / result["previous_steps_per_s"]


def test_the_validation_doc_quotes_the_speed_result():
    assert not_in_the_doc(speed_doc_figures(json.loads(RESULT.read_text(encoding="utf-8")))) == []


def test_the_words_around_the_equivalence_figures_hold():
    """The doc says one step's time moves by about a fifth between two measurements, that relative to the batch-round's
    median the methods do not differ (the median's interval holds 0), and gives cold's mean growth."""
    result = json.loads(RESULT.read_text(encoding="utf-8"))
    for view in ("relative_to_chunk", "raw"):
        assert 0.15 <= result["equivalence"][view]["noise_floor"]["abs_p50"] <= 0.25
    lo, hi = result["equivalence"]["relative_to_chunk"]["warm_vs_cold"]["median_ci95"]
    assert lo <= 0 <= hi
    assert not_in_the_doc(["moves by about a fifth between two measurements", "and there the methods do not differ"]) == []
    growth = np.mean([r["context_growth_tokens"]["mean"] for r in result["runs"] if r["method"] == "cold"])
    assert not_in_the_doc([f"Cold's contexts were {growth:.1f} tokens longer on average"]) == []


def test_the_bound_the_doc_draws_from_the_shipped_journal():
    """The quiet-machine bound on what warm measuring can gain, from the shipped coalitions result's measuring cost."""
    cost = json.loads((REPO / "src" / "llmvisor" / "data" / "validation-coalitions.json").read_text(encoding="utf-8"))["summary"]["measurement_cost"]
    prepare_s, wall_s = cost["rounds"]["prepare_s"], cost["wall_s"]
    per_step_s = cost["n_steps_measured"] / cost["step_time_s"]
    previous = json.loads(RESULT.read_text(encoding="utf-8"))["previous_steps_per_s"]
    assert round(cost["steps_per_wall_s"], 1) == previous
    assert not_in_the_doc([
        f"its batch-rounds spent {prepare_s:,.0f} s of the {wall_s:,.0f} s wall preparing contexts",
        f"at most {wall_s / (wall_s - prepare_s):.2f}× its {previous:g} steps/s",
        f"ran at {per_step_s:.0f} steps per second of step time, {per_step_s / previous:.1f}×",
        f"the guard's canaries ({cost['canary_time_s']:.0f} s of that wall)",
    ]) == []


def test_the_script_records_its_arguments():
    """A result made with flags names them; the shipped one, made without, names the bare command (its plan is the
    defaults, checked above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure_validation_speed", REPO / "scripts" / "measure-validation-speed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.command_line([]) == "python scripts/measure-validation-speed.py"
    assert script.command_line(["--repeats", "3", "-o", "out dir/x.json"]) == \
        "python scripts/measure-validation-speed.py --repeats 3 -o 'out dir/x.json'"
