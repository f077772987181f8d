"""Validation: exact Shapley and leave-one-out on games with known answers, the journal, metrics, the real engine."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _tiny_llama import IN_PROCESS_ENGINE_THREADS, write_tiny_llama
from llmvisor import shipped
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.engines.vllm.controlled import ControlledEngine, MeasuredStep, Slice
from llmvisor.errors import LlmvisorError
from llmvisor.validation.analysis import (
    analyse_batch,
    build_result,
    interaction_diagnostics,
    quantiles_with_ci,
)
from llmvisor.validation.game import additive_fit, exact_shapley, leave_one_out
from llmvisor.validation.measurement import (
    InterferenceGuard,
    Journal,
    Measurer,
    measure,
)
from llmvisor.validation.plans import (
    PHASES,
    BatchSpec,
    Envelope,
    LengthMix,
    draw_batches,
    read_length_mixes,
)
from llmvisor.validation.report import (
    REPORT_METHODS,
    error_cdf_figure,
    report_sections,
    share_scatter_figure,
)


def game(n: int, value) -> np.ndarray:
    """Cost of every subset (index = bit mask) from a function of the member list."""
    return np.array([0.0] + [value([i for i in range(n) if mask >> i & 1]) for mask in range(1, 1 << n)])


def brute_force_shapley(cost: np.ndarray, n: int) -> np.ndarray:
    """Shapley values as the average marginal cost over all n! orders (the definition)."""
    phi = np.zeros(n)
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        mask = 0
        for i in order:
            phi[i] += cost[mask | 1 << i] - cost[mask]
            mask |= 1 << i
    return phi / len(orders)


# ----------------------------------------------------------------------------------------------------------
# Games with known answers


def test_additive_game_shapley_is_own_plus_equal_split_of_intercept():
    own = np.array([0.010, 0.003, 0.020, 0.0, 0.007])
    b = 0.012
    cost = game(5, lambda s: b + own[s].sum())
    np.testing.assert_allclose(exact_shapley(cost), own + b / 5, rtol=0, atol=1e-15)
    np.testing.assert_allclose(leave_one_out(cost), own, atol=1e-15)
    assert leave_one_out(cost).sum() - cost[-1] == pytest.approx(-b)
    fit = additive_fit(cost)
    assert fit["intercept_s"] == pytest.approx(b)
    np.testing.assert_allclose(fit["shapley_s"], own + b / 5, atol=1e-12)
    assert fit["rms_residual_fraction"] < 1e-12


def test_max_game_shapley_is_the_airport_split():
    """v(S) = max a_i: each increment of the maximum is split equally among those who need it."""
    a = np.array([4.0, 1.0, 9.0, 1.0])
    cost = game(4, lambda s: a[s].max())
    # sorted: 1, 1, 4, 9 -> first increment 1 split by 4, then 3 split by 2 (requests 0 and 2), then 5 by 1
    expected = np.array([1 / 4 + 3 / 2, 1 / 4, 1 / 4 + 3 / 2 + 5, 1 / 4])
    np.testing.assert_allclose(exact_shapley(cost), expected)
    np.testing.assert_allclose(leave_one_out(cost), [0, 0, 5, 0])
    assert additive_fit(cost)["rms_residual_fraction"] > 0.05


def test_shapley_of_a_batch_wide_padding_game():
    """Padding: every member pays for the longest one, v(S) = |S|·max a_i; brute force agrees."""
    a = np.array([100.0, 10.0, 10.0])
    cost = game(3, lambda s: len(s) * a[s].max())
    phi = exact_shapley(cost)
    np.testing.assert_allclose(phi, brute_force_shapley(cost, 3))
    # Orders: request 0 first adds 100, second 200 − 10, last 300 − 20: (100 + 190 + 280) / 3 = 190.
    np.testing.assert_allclose(phi, [190.0, 55.0, 55.0])  # far above its own 100: it causes the others' padding


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_shapley_axioms_on_random_games(n, seed):
    rng = np.random.default_rng(seed)
    cost = np.concatenate([[0.0], rng.random((1 << n) - 1)])
    phi = exact_shapley(cost)
    assert phi.sum() == pytest.approx(cost[-1])  # efficiency
    np.testing.assert_allclose(phi, brute_force_shapley(cost, n), atol=1e-12)


def test_game_input_is_checked():
    with pytest.raises(ValueError):
        exact_shapley(np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError):
        exact_shapley(np.array([1.0, 1.0]))


# ----------------------------------------------------------------------------------------------------------
# Metrics


def test_quantiles_match_numpy_and_intervals_cover_them():
    rng = np.random.default_rng(1)
    errors = rng.exponential(0.05, 400)
    groups = np.repeat(np.arange(100), 4)
    out = quantiles_with_ci(errors, groups, n_bootstrap=300)
    for q in (50, 90, 99):
        assert out[f"p{q}"] == pytest.approx(np.percentile(errors, q))
        low, high = out[f"p{q}_ci95"]
        assert low <= out[f"p{q}"] <= high
    assert out["n"] == 400


def test_cluster_bootstrap_is_wider_than_independent_when_groups_are_alike():
    """Requests of one batch share its measurements: resampling batches must not pretend they are independent."""
    rng = np.random.default_rng(2)
    per_group = rng.exponential(0.05, 40)
    errors = np.repeat(per_group, 5)
    clustered = quantiles_with_ci(errors, np.repeat(np.arange(40), 5), n_bootstrap=500)
    independent = quantiles_with_ci(errors, np.arange(200), n_bootstrap=500)
    def width(out):
        return out["p50_ci95"][1] - out["p50_ci95"][0]
    assert width(clustered) > 1.5 * width(independent)


# ----------------------------------------------------------------------------------------------------------
# A synthetic engine with a known cost: the journal, resumability, rejection, the analysis


class GameEngine:
    """Measures steps of a known cost function (plus optional multiplicative noise); counts the steps run."""

    def __init__(self, cost_fn, *, noise: float = 0.0, seed: int = 0, fail_every: int = 0, crash_after: int | None = None,
                 slow_steps: range = range(0)):
        self.cost_fn = cost_fn
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.n_steps = 0
        self.n_calls = 0
        self.fail_every = fail_every
        self.crash_after = crash_after
        self.slow_steps = slow_steps

    def _run(self, slices: list[Slice], *, canary: bool = False) -> MeasuredStep:
        self.n_calls += 1
        slow = 3.0 if self.n_calls in self.slow_steps else 1.0  # another process busy on the machine
        if not canary:
            self.n_steps += 1
        if self.crash_after is not None and self.n_steps > self.crash_after:
            raise KeyboardInterrupt("simulated crash")
        t = slow * self.cost_fn(slices) * (1 + self.noise * self.rng.standard_normal())
        if self.fail_every and self.n_steps % self.fail_every == 0:
            return MeasuredStep(t, slices, slices[:-1], 2, "the batch ran as 2 steps")
        return MeasuredStep(t, slices, list(slices), 1)

    def prefill_step(self, lengths):
        return self._run([Slice(p, 0, True) for p in lengths])

    def canary_step(self):
        return self._run([Slice(128, 0, True)], canary=True)

    def prepare_decode(self, contexts, *, max_decode_steps):
        return {"contexts": list(contexts)}

    def decode_step(self, handle, members):
        step = self._run([Slice(1, handle["contexts"][i], False) for i in members])
        for i in members:
            handle["contexts"][i] += 1
        return step

    def release(self, handle):
        pass


B, K1, K3, D6, D7 = 0.010, 2e-5, 1e-9, 1e-6, 5e-4


def additive_cost(slices: list[Slice]) -> float:
    own = sum(K1 * s.num_new_tokens + K3 * s.num_new_tokens**2 if s.is_prefill else D6 * s.num_context_tokens + D7 for s in slices)
    return B + own


def known_model(d6: float = D6) -> StepLatencyModel:
    coef = dict.fromkeys(FEATURE_NAMES, 0.0)
    coef.update(intercept=B, prefill_new_tokens=K1, prefill_new_tokens_squared=K3, decode_context_tokens=d6, decode_requests=D7)
    return StepLatencyModel.from_dict(
        {
            "format": "llmvisor.step_latency_model",
            "format_version": 1,
            "params": {},
            "feature_names": list(FEATURE_NAMES),
            "boundary_new_tokens": None,
            "segments": [{"name": "all", "coef_s": coef}],
        }
    )


ENVELOPE = Envelope(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32)


def mixes() -> list[LengthMix]:
    rng = np.random.default_rng(0)
    return [
        LengthMix(name, rng.lognormal(6.5, 0.9, 2000).astype(int) + 1, rng.lognormal(4.5, 1.0, 2000).astype(int))
        for name in ("conv", "code", "arxiv")
    ]


def test_draw_batches_respects_limits_and_is_deterministic():
    batches, rules = draw_batches(mixes(), ENVELOPE, n_batches=40, max_batch=5, seed=3)
    again, _ = draw_batches(mixes(), ENVELOPE, n_batches=60, max_batch=5, seed=3)
    assert [b.key for b in batches] == [b.key for b in again[:40]]  # extending the run keeps earlier batches
    assert {b.size for b in batches} == {2, 3, 4, 5}
    assert {b.phase for b in batches} == {"prefill", "decode"}
    assert any(b.kind == "adversarial" for b in batches if b.phase == "prefill")
    assert any(b.kind == "adversarial" for b in batches if b.phase == "decode")
    assert any(b.rounds == 2 for b in batches)
    for b in batches:
        if b.phase == "prefill":
            assert sum(b.num_new_tokens) <= 2048 and set(b.num_context_tokens) == {0}
        else:
            assert set(b.num_new_tokens) == {1} and max(b.num_context_tokens) <= 4096 - 256
        if b.kind == "adversarial":
            lengths = b.num_new_tokens if b.phase == "prefill" else b.num_context_tokens
            assert max(lengths) > 5 * sorted(lengths)[-2]
    assert "scale_factors" in rules


def test_bad_arguments_are_user_errors():
    with pytest.raises(LlmvisorError, match="max-batch"):
        draw_batches(mixes(), ENVELOPE, n_batches=4, max_batch=1)
    with pytest.raises(LlmvisorError, match="batches"):
        draw_batches(mixes(), ENVELOPE, n_batches=0, max_batch=3)
    with pytest.raises(LlmvisorError, match="repeat"):
        measure(GameEngine(additive_cost), [], Journal("/nonexistent/j.jsonl"), repeat=0)
    with pytest.raises(LlmvisorError, match="workload file missing"):
        read_length_mixes("/nonexistent")


def test_measure_resumes_from_the_journal(tmp_path):
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=6, max_batch=4, replicate_every=0, seed=1)
    total = sum(((1 << b.size) - 1) * 2 for b in batches)
    path = tmp_path / "j.jsonl"

    crashing = GameEngine(additive_cost, crash_after=25)
    with pytest.raises(KeyboardInterrupt):
        measure(crashing, batches, Journal(path), repeat=2, warm_up_steps=0)
    journal = Journal(path)
    done = sum(len(ms) for ms in journal.measurements.values())
    assert 0 < done <= 25  # whole batch-rounds reach the journal; the one cut short is measured again
    assert done == sum(((1 << b.size) - 1) * 2 for b in batches[: len({k[0] for k in journal.measurements})])
    with open(path, "a") as handle:  # a line cut short by a crash
        handle.write('{"type": "measurement", "batch_ke')

    engine = GameEngine(additive_cost)
    counts = measure(engine, batches, Journal(path), repeat=2, warm_up_steps=0)
    assert engine.n_steps == total - done == counts["measured_now"]
    assert counts["reused"] == done

    idle = GameEngine(additive_cost)
    counts = measure(idle, batches, Journal(path), repeat=2, warm_up_steps=0)
    assert idle.n_steps == 0 and counts["measured_now"] == 0

    more = GameEngine(additive_cost)
    measure(more, batches, Journal(path), repeat=3, warm_up_steps=0)
    assert more.n_steps == total // 2  # one more repeat of every subset, nothing else
    journal = Journal(path)
    for _key, ms in journal.measurements.items():
        assert sorted(m.repeat for m in ms) == [0, 1, 2]


def test_interference_guard_discards_and_redoes_a_slowed_batch_round(tmp_path):
    """Steps slowed 3× by another process (canaries too) are thrown away and measured again once quiet."""
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=4, max_batch=3, replicate_every=0, seed=2)
    path = tmp_path / "j.jsonl"
    engine = GameEngine(additive_cost, slow_steps=range(20, 30))
    sleeps = []
    progress = []
    counts = measure(engine, batches, Journal(path), repeat=2, warm_up_steps=0, guard=InterferenceGuard(every=4),
                       sleep=sleeps.append, on_step=progress.append)
    assert counts["discarded_batch_rounds"] >= 1 and counts["flagged_batch_rounds"] == 0
    assert sum(progress) == counts["measured_now"] == sum(((1 << b.size) - 1) * 2 for b in batches)
    journal = Journal(path)
    assert len(journal.interference) == counts["discarded_batch_rounds"]
    for b in batches:  # what was kept is the engine's own cost, never the slowed one
        for subset in range(1, 1 << b.size):
            members = [i for i in range(b.size) if subset >> i & 1]
            expected = additive_cost([Slice(b.num_new_tokens[i], b.num_context_tokens[i], b.phase == "prefill") for i in members])
            for m in journal.get(b, 0, subset):
                assert not m.interference
                if b.phase == "prefill":
                    assert m.step_latency_s == pytest.approx(expected)
    result = build_result(batches, journal, known_model(), repeat=2, n_bootstrap=10)
    assert result["interference"]["n_batch_rounds_discarded"] == counts["discarded_batch_rounds"]
    assert "at most 4 redos" in result["interference"]["rule"]  # no run recorded: the default guard
    # the rule stated is the one the last measuring run used, not the default
    runs = {"measurement_runs": [{"guard_max_redos": 4, "guard_max_wait_s": 600.0}, {"guard_max_redos": 2, "guard_max_wait_s": 60.0}]}
    stated = build_result(batches, journal, known_model(), repeat=2, n_bootstrap=10, settings=runs)["interference"]["rule"]
    assert "at most 2 redos" in stated and "at most 4" not in stated
    assert "after every 8 subset steps" in stated and "opens the next" not in stated  # recorded before spacing and carry were
    runs["measurement_runs"].append({"guard_max_redos": 2, "guard_max_wait_s": 60.0, "guard_carry_s": 0.5, "guard_every": 16})
    stated = build_result(batches, journal, known_model(), repeat=2, n_bootstrap=10, settings=runs)["interference"]["rule"]
    assert "after every 16 subset steps" in stated and "opens the next when that begins within 0.5 s" in stated


class SlowCanaryEngine(GameEngine):
    """A GameEngine whose ``slow``-th canary (1-based, calibration included) runs 3× slower."""

    def __init__(self, *args, slow: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow, self.n_canaries = slow, 0

    def canary_step(self):
        self.n_canaries += 1
        step = super().canary_step()
        return MeasuredStep(step.step_latency_s * (3.0 if self.n_canaries == self.slow else 1.0), step.intended, step.recorded, 1)


def test_a_batch_round_opens_with_the_canary_that_closed_the_round_before(tmp_path):
    """Back to back, the canary closing one batch-round opens the next (one canary fewer per round), and judges it: a
    slow closing canary flags both rounds it borders. Begun later than ``carry_s`` after it, a round runs its own."""
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=4, max_batch=3, replicate_every=0, seed=2)
    n_rounds = sum(b.rounds for b in batches)

    def run(carry_s: float, slow: int = 0):
        engine = SlowCanaryEngine(additive_cost, slow=slow)
        guard = InterferenceGuard(every=1000, calibration=3, max_redos=0, carry_s=carry_s)
        counts = measure(engine, batches, Journal(tmp_path / f"j{carry_s}-{slow}.jsonl"), repeat=1, warm_up_steps=0, guard=guard)
        return engine.n_canaries, counts

    carried, counts = run(60.0)
    fresh, _ = run(-1.0)
    assert n_rounds >= 3 and carried == 3 + 1 + n_rounds and fresh == 3 + 2 * n_rounds
    assert counts["flagged_batch_rounds"] == 0
    # canary 5 closes the first batch-round (3 calibrate, 4 opens it): carried, it flags the second round too
    assert run(60.0, slow=5)[1]["flagged_batch_rounds"] == 2
    assert run(-1.0, slow=5)[1]["flagged_batch_rounds"] == 1


class HoldingEngine(GameEngine):
    """A GameEngine that says its decode steps leave a held batch as prepared (as warm measuring does)."""

    holds_contexts = True


def test_a_held_batch_warms_up_once_per_preparation(tmp_path):
    """The warm-up step runs where a batch-round prepared its batch (or runs prefill steps), not where it goes on with
    the batch the round before held and just ran."""
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=6, max_batch=3, replicate_every=1, seed=2)
    decode_rounds = sum(b.rounds for b in batches if b.phase == "decode")
    prefill_rounds = sum(b.rounds for b in batches if b.phase == "prefill")
    engine = HoldingEngine(additive_cost)
    counts = measure(engine, batches, Journal(tmp_path / "j.jsonl"), repeat=1, warm_up_steps=1)
    assert counts["preparations"] < decode_rounds and prefill_rounds > 0
    assert engine.n_steps == counts["measured_now"] + counts["preparations"] + prefill_rounds
    plain = GameEngine(additive_cost)  # prepares every round: warms up every round
    measure(plain, batches, Journal(tmp_path / "k.jsonl"), repeat=1, warm_up_steps=1)
    assert plain.n_steps == counts["measured_now"] + decode_rounds + prefill_rounds


def test_steps_that_did_not_run_as_intended_are_rejected_and_redone(tmp_path):
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=2, max_batch=3, replicate_every=0)
    journal = Journal(tmp_path / "j.jsonl")
    engine = GameEngine(additive_cost, fail_every=4)
    counts = measure(engine, batches, journal, repeat=1, warm_up_steps=0)
    assert counts["rejected_now"] > 0
    assert counts["measured_now"] == sum((1 << b.size) - 1 for b in batches)
    assert Journal(tmp_path / "j.jsonl").n_rejected == counts["rejected_now"]
    with pytest.raises(LlmvisorError, match="did not run as the intended step"):
        measure(GameEngine(additive_cost, fail_every=1), batches, Journal(tmp_path / "k.jsonl"), repeat=1, warm_up_steps=0)


def test_a_correct_additive_model_matches_measured_shapley_exactly(tmp_path):
    """An additive engine priced exactly by the model: the shapley rule's shares equal the measured Shapley values.

    (Decode cost is made independent of context here, since contexts grow while a batch is measured.)
    """
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=12, max_batch=5, replicate_every=2)
    journal = Journal(tmp_path / "j.jsonl")
    measure(GameEngine(lambda s: additive_cost(s) if s[0].is_prefill else B + D7 * len(s)), batches, journal, repeat=3)
    result = build_result(batches, journal, known_model(d6=0.0), repeat=3, n_bootstrap=50)
    summary = result["summary"]
    for phase in PHASES:
        shapley = summary["errors"][phase]["shapley"]
        assert shapley["shapley"]["p99"] < 1e-9
        assert shapley["shapley_predicted"]["p99"] < 1e-9
        assert shapley["model_exact_shapley"]["p99"] < 1e-9
        assert summary["noise_floor"]["shapley"][phase]["p99"] < 1e-12
        assert summary["loo_sum_gap_fraction"][phase]["p90"] < 0  # LOO misses the shared intercept
    # Token-count shares ignore the intercept's equal split; they must be measurably worse for prefill.
    assert summary["errors"]["prefill"]["shapley"]["token_count"]["p90"] > 0.01
    # The same, per request and per class: exact rules have no relative error and no bias in any class; token
    # counts over-bill long prompts and under-bill short ones (the intercept is split equally, not by tokens).
    for phase in PHASES:
        per_request = summary["per_request_error"][phase]["shapley"]
        assert per_request["p99"] < 1e-9 and per_request["n"] + per_request["n_below_floor"] == summary["n_requests"][phase]
        for name, by_method in summary["class_bias"].items():
            assert abs(by_method["shapley"]["bias"]) < 1e-9, name
    bias = summary["class_bias"]
    assert bias["prefill/large_in_batch"]["token_count"]["bias"] > 0.01
    assert bias["prefill/small_in_batch"]["token_count"]["bias"] < -0.01
    low, high = bias["prefill/large_in_batch"]["token_count"]["ci95"]
    assert low <= bias["prefill/large_in_batch"]["token_count"]["bias"] <= high
    assert "prefill/shared_context" not in bias and bias["prefill/unique_context"]["shapley"]["n"] == summary["n_requests"]["prefill"]
    assert summary["batch_sizes"]["min"] == min(b.size for b in batches)
    assert summary["batch_sizes"]["max"] == max(b.size for b in batches)
    record = next(r for r in result["batches"] if r["phase"] == "prefill")
    assert record["loo_sum_gap_fraction"] == pytest.approx(-B / record["measured_step_s"])
    assert summary["loo_sum_gap_fraction"]["prefill"]["n"] == summary["n_batches"]["prefill"] == 6
    json.dumps(result, allow_nan=False)  # JSON-ready


def test_a_max_dependent_cost_shows_up_as_non_additivity(tmp_path):
    """Decode with a cost on the longest context in the step (padding): the additive rule misses it."""
    def padded(slices):
        return B + D7 * len(slices) + 4e-6 * len(slices) * max(s.num_context_tokens for s in slices)

    batches = [BatchSpec(0, "decode", "adversarial", "test", (1, 1, 1, 1), (3000, 20, 30, 40))]
    journal = Journal(tmp_path / "j.jsonl")
    measure(GameEngine(padded), batches, journal, repeat=1, warm_up_steps=0)
    record = analyse_batch(batches[0], journal, known_model(), repeat=1)
    assert record["additive_fit"]["rms_residual_fraction"] > 0.01
    phi = np.array(record["shapley_s"])
    share = np.array(record["shares_s"]["shapley"])
    assert phi[0] > share[0]  # the long request causes padding the additive split spreads over the others
    assert math.isclose(sum(share), record["measured_step_s"], rel_tol=1e-12)


def test_report_sections_render_from_a_result(tmp_path):
    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=8, max_batch=3, replicate_every=2)
    journal = Journal(tmp_path / "j.jsonl")
    measure(GameEngine(additive_cost, noise=0.03), batches, journal, repeat=3)
    result = build_result(batches, journal, known_model(), repeat=3, n_bootstrap=50, settings={"repeat": 3, "max_batch": 3})
    result = json.loads(json.dumps(result))  # as read back from the shipped file
    sections = report_sections(result)
    assert len(sections) == 4
    assert all(isinstance(h, str) and isinstance(body, str) for h, body in sections)
    assert sum(body.count("data:image/png;base64,") for _, body in sections) == 2
    assert result["summary"]["noise_floor"]["shapley"]["decode"]["p50"] > 0


def test_report_legends_hide_no_data():
    """On the shipped result (where the CDF legend once covered the shapley curve on decode): no legend overlaps an axes."""
    result = json.loads((shipped.result_path(shipped.VALIDATION_RESULT)).read_text())
    records = result["batches"]
    methods = [m for m in REPORT_METHODS if m in records[0]["shares_s"]]
    floor = result["summary"]["noise_floor"]
    for figure in (error_cdf_figure(records, floor, list(PHASES), methods), share_scatter_figure(records, list(PHASES), methods)):
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        legends = list(figure.legends) + [a.get_legend() for a in figure.axes if a.get_legend() is not None]
        assert legends
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for axis in figure.axes:
                assert not box.overlaps(axis.get_window_extent(renderer)), (axis.get_title(), box, axis.get_window_extent(renderer))
        plt.close(figure)


def test_controlled_engine_satisfies_the_measurer_protocol():
    assert issubclass(ControlledEngine, Measurer)
    assert isinstance(GameEngine(additive_cost), Measurer)

    class NoRelease(GameEngine):
        release = None

    assert not isinstance(NoRelease(additive_cost), Measurer)


def test_validate_command_user_errors(tmp_path):
    from llmvisor.cli.validate import validate

    with pytest.raises(LlmvisorError, match="no such model file"):
        validate(model=tmp_path / "missing.json", output=tmp_path / "r.json")
    model_path = tmp_path / "model.json"
    known_model().to_json(model_path)
    with pytest.raises(LlmvisorError, match="repeat"):
        validate(model=model_path, output=tmp_path / "r.json", repeat=0)
    with pytest.raises(LlmvisorError, match="no config.json"):
        validate(model=model_path, output=tmp_path / "r.json", engine_model=tmp_path)
    with pytest.raises(LlmvisorError, match=r"\.json"):
        validate(model=model_path, output=tmp_path / "r.txt")


def _write_mix_csvs(folder):
    rng = np.random.default_rng(7)
    folder.mkdir()
    for name in shipped.WORKLOAD_FILES:
        with open(folder / name, "w") as handle:
            handle.write("num_prefill_tokens,num_decode_tokens\n")
            for p, o in zip(rng.lognormal(6.5, 0.9, 300).astype(int) + 1, rng.lognormal(4.5, 1.0, 300).astype(int)):
                handle.write(f"{p},{o}\n")


def test_validate_re_analyses_a_packed_journal_without_the_engine(tmp_path, monkeypatch):
    """A finished (shipped, gzipped) journal is re-analysed under another model; vLLM is never started."""
    import gzip

    from llmvisor.cli.validate import validate
    from llmvisor.engines.vllm import controlled
    from llmvisor.shipped import engine_model_dir

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not start when everything is measured")

    monkeypatch.setattr(controlled, "ControlledEngine", no_engine)
    workloads = tmp_path / "workloads"
    _write_mix_csvs(workloads)
    batches, _ = draw_batches(read_length_mixes(workloads), ENVELOPE, n_batches=4, max_batch=3, seed=0)
    engine_settings = {
        "engine_model_config": json.loads((engine_model_dir() / "config.json").read_text()),
        "max_model_len": 4096, "max_num_batched_tokens": 2048, "max_num_seqs": 32, "threads": None,
    }
    plain = tmp_path / "r.journal.jsonl"
    journal = Journal(plain)
    journal.write_header({"engine_settings": engine_settings, "seed": 0})
    measure(GameEngine(additive_cost, noise=0.01), batches, journal, repeat=3)
    with open(plain, "rb") as source, gzip.open(tmp_path / "r.journal.jsonl.gz", "wb") as target:
        target.write(source.read())
    plain.unlink()
    model_path = tmp_path / "model.json"
    known_model().to_json(model_path)
    output = tmp_path / "r.json"
    validate(output=output, model=model_path, workloads=workloads, batches=4, max_batch=3, n_bootstrap=20)
    result = json.loads(output.read_text())
    assert result["n_batches_measured"] == 4 and result["settings"]["model_segments"]
    assert result["summary"]["errors"]["prefill"]["shapley"]["shapley"]["p90"] < 0.05
    assert report_sections(result)

    # Measurements taken under other engine settings are never mixed in.
    with pytest.raises(LlmvisorError, match="other engine settings"):
        validate(output=output, model=model_path, workloads=workloads, batches=4, max_batch=3, threads=1)
    # nor under another dtype: a journal that records none (as every one before the option) was measured with vLLM's auto
    with pytest.raises(LlmvisorError, match=r"other engine settings \(dtype: journal 'auto' vs now 'float32'\)"):
        validate(output=output, model=model_path, workloads=workloads, batches=4, max_batch=3, dtype="float32")

    # A journal measured the earlier (cold) way, as every shipped one was, is never extended by warm measuring: more
    # batches are refused before the engine starts, and the journal is left as it was.
    journal_bytes = plain.read_bytes()
    with pytest.raises(LlmvisorError, match="measured cold .* this llmvisor measures warm"):
        validate(output=output, model=model_path, workloads=workloads, batches=6, max_batch=3, n_bootstrap=20)
    assert plain.read_bytes() == journal_bytes


def test_shipped_validation_result_renders():
    """The result shipped with the package holds what the demo's report needs."""
    from importlib import resources

    path = resources.files("llmvisor") / "data" / "validation.json"
    if not path.is_file():
        pytest.skip("no shipped validation result")
    result = json.loads(path.read_text())
    summary = result["summary"]
    assert result["n_batches_measured"] >= 100
    assert set(summary["errors"]) == {"prefill", "decode"}
    for phase in ("prefill", "decode"):
        assert summary["noise_floor"]["shapley"][phase]["n_batches"] > 0
        assert summary["errors"][phase]["shapley"]["shapley"]["n"] == summary["n_requests"][phase]
    assert summary["n_batches"]["prefill"] >= 50 and summary["n_batches"]["decode"] >= 50
    sections = report_sections(result)
    assert len(sections) == 4


# ----------------------------------------------------------------------------------------------------------
# The real engine

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0, "vocab_size": 1000}


@pytest.mark.vllm
def test_controlled_steps_on_vllm_run_exactly_the_intended_batches(tmp_path):
    pytest.importorskip("vllm")
    from llmvisor.engines.vllm.controlled import ControlledEngine

    model_dir = write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)
    batches = [
        BatchSpec(0, "prefill", "workload", "test", (37, 90), (0, 0)),
        BatchSpec(1, "decode", "workload", "test", (1, 1), (130, 17)),
    ]
    trace = tmp_path / "steps.jsonl"
    journal = Journal(tmp_path / "j.jsonl")
    with ControlledEngine(model_dir, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_gib=1, num_threads=IN_PROCESS_ENGINE_THREADS, trace_path=trace) as engine:
        # Direct check of one decode subset and its recorded composition.
        handle = engine.prepare_decode([130, 17], max_decode_steps=20)
        step = engine.decode_step(handle, [1])
        assert step.matches, step.reason
        assert step.n_engine_steps == 1 and step.recorded == [Slice(1, 17, False)]
        canary = engine.canary_step()  # a prefill step while the decode batch is held: runs alone, disturbs nothing
        assert canary.matches and canary.recorded == [Slice(128, 0, True)], canary.reason
        step = engine.decode_step(handle, [0, 1])
        assert step.matches and step.recorded == [Slice(1, 130, False), Slice(1, 17, False)], step.reason  # warm: no growth
        engine.release(handle)
        step = engine.prefill_step([37, 90])
        assert step.matches and step.recorded == [Slice(37, 0, True), Slice(90, 0, True)] and step.step_latency_s > 0
        counts = measure(engine, batches, journal, repeat=2, warm_up_steps=1, guard=InterferenceGuard(tolerance=10.0, calibration=3))
    assert counts["measured_now"] == 2 * 3 * 2 and counts["rejected_now"] == 0
    # Every step the recorder wrote: each controlled step ran alone and as intended.
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["step_id"], []).append(row)
    compositions = [sorted((r["num_new_tokens"], r["num_context_tokens"], r["phase"]) for r in s) for s in steps.values()]
    assert [(37, 0, "prefill")] in compositions and [(37, 0, "prefill"), (90, 0, "prefill")] in compositions
    assert all(len(c) <= 2 for c in compositions)  # nothing else ever ran alongside
    decode_steps = [c for c in compositions if c[0][2] == "decode"]
    assert all(n == 1 for c in decode_steps for n, _, _ in c)
    for mask in (1, 2, 3):
        ms = journal.get(batches[1], 0, mask)
        assert len(ms) == 2
        expected_base = [c for i, c in enumerate((130, 17)) if mask >> i & 1]
        for m in ms:  # contexts grow by one per run, never below the prefilled context
            assert all(0 <= got - base <= 12 for got, base in zip(m.num_context_tokens, expected_base))


def test_interaction_diagnostics_find_a_padding_cost(tmp_path):
    """A decode cost on |S| × the longest context is found (and explains the non-additive residual)."""
    def padded(slices):
        return B + D7 * len(slices) + 2e-6 * len(slices) * max(s.num_context_tokens for s in slices)

    batches, _ = draw_batches(mixes(), ENVELOPE, n_batches=24, max_batch=5, replicate_every=0, seed=5)
    batches = [b for b in batches if b.phase == "decode"]
    journal = Journal(tmp_path / "j.jsonl")
    measure(GameEngine(padded), batches, journal, repeat=1, warm_up_steps=0)
    records = [analyse_batch(b, journal, known_model(), repeat=1) for b in batches]
    found = interaction_diagnostics(records)["decode"]["terms"]
    assert found["size_x_max_tokens"]["explained_fraction_of_additive_residual"] > 0.95
    assert found["size_x_max_tokens"]["coef"] == pytest.approx(2e-6, rel=0.05)
    assert found["pairs"]["explained_fraction_of_additive_residual"] < 0.5


def test_token_count_prices_prompt_tokens_once_and_output_tokens_twice():
    from llmvisor.validation.analysis import token_count_split

    # a mixed step: a 6-token prefill chunk with two decodes (one output token each, priced 2)
    np.testing.assert_allclose(token_count_split(np.array([6, 1, 1]), np.array([True, False, False])), [0.6, 0.2, 0.2])
    np.testing.assert_allclose(token_count_split(np.array([1, 1, 1, 1]), np.zeros(4, dtype=bool)), np.full(4, 0.25))
    np.testing.assert_allclose(token_count_split(np.array([30, 10]), np.ones(2, dtype=bool)), [0.75, 0.25])


def test_a_version_1_result_reads_under_todays_names():
    from llmvisor.validation.analysis import upgrade_result
    from llmvisor.validation.report import markdown_summary

    shipped_result = json.loads(shipped.result_path(shipped.VALIDATION_RESULT).read_text(encoding="utf-8"))
    old = json.loads(json.dumps(shipped_result).replace('"token_count"', '"token_proportional"').replace("_token_count", "_token_proportional"))
    old["format_version"] = 1
    assert "token_proportional" in old["batches"][0]["shares_s"]
    upgraded = upgrade_result(old)
    assert upgraded["batches"][0]["shares_s"]["token_count"] == shipped_result["batches"][0]["shares_s"]["token_count"]
    assert upgraded["summary"]["improvement_vs_token_count"] == shipped_result["summary"]["improvement_vs_token_count"]
    assert markdown_summary(old) == markdown_summary(shipped_result)


def test_validate_with_only_the_output_reanalyses_the_shipped_result_as_it_was_measured(tmp_path):
    """The shipped result was measured with non-default options (--max-prefill-tokens 1024, --threads 2); a re-run
    naming only -o takes them from the result instead of drawing a new plan that would need the engine."""
    result = tmp_path / "validation.json"
    shutil.copy(shipped.result_path(shipped.VALIDATION_RESULT), result)
    shutil.copy(shipped.result_path(shipped.VALIDATION_RESULT).with_name("validation.journal.jsonl.gz"), tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "llmvisor.cli", "validate", "-o", str(result), "--json", "--bootstrap", "200"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "subset steps to measure" not in done.stderr
    shipped_result = json.loads(shipped.result_path(shipped.VALIDATION_RESULT).read_text(encoding="utf-8"))
    again = json.loads(result.read_text(encoding="utf-8"))
    assert again["settings"]["max_prefill_tokens"] == shipped_result["settings"]["max_prefill_tokens"] == 1024
    assert again["n_batches_measured"] == shipped_result["n_batches_measured"]
    assert again["summary"]["errors"]["decode"]["shapley"]["shapley"]["p50"] == shipped_result["summary"]["errors"]["decode"]["shapley"]["shapley"]["p50"]
