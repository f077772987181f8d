"""Serving-size validation batches of every kind on a synthetic engine: mixed and shared-prefix decode steps,
the model's shared-KV game in their analysis, and the ``validate`` command's sampled plan (resumable, and a
re-analysis that never starts the engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.engines.vllm.controlled import Slice
from llmvisor.errors import LlmvisorError
from llmvisor.validation.analysis import analyse_sampled_batch, model_step_s
from llmvisor.validation.game import members
from llmvisor.validation.measurement import Journal, measure_sampled
from llmvisor.validation.plans import SAMPLED_KINDS, SampledKind, draw_sampled_batches, sampled_run_budget_s
from test_validation import ENVELOPE, GameEngine, _write_mix_csvs, mixes

B, K1, K3, A2, D6, D7 = 0.010, 2e-5, 1e-9, 3e-6, 1e-6, 5e-4
BLOCK = 16


def sharing_cost(slices: list[Slice]) -> float:
    """A step's time with every slice's context read through KV blocks (either phase): a block several slices read,
    read once."""
    readers = sum(1 for s in slices if s.num_shared_context_tokens > 0)
    cost = B
    for s in slices:
        if s.is_prefill:
            cost += K1 * s.num_new_tokens + K3 * s.num_new_tokens**2 + (A2 + D6) * s.num_context_tokens
        else:
            shared = s.num_shared_context_tokens
            cost += D7 + D6 * (s.num_context_tokens - shared + (shared / readers if shared else 0.0))
    return cost


def sharing_model() -> StepLatencyModel:
    """The model that prices `sharing_cost` exactly: decode context through the effective-context term only."""
    coef = dict.fromkeys(FEATURE_NAMES, 0.0)
    coef.update(intercept=B, prefill_new_tokens=K1, prefill_new_tokens_squared=K3, prefill_context_tokens=A2,
                decode_requests=D7, effective_context_tokens=D6)
    return StepLatencyModel.from_dict({
        "format": "llmvisor.step_latency_model", "format_version": 2, "params": {}, "feature_names": list(FEATURE_NAMES),
        "boundary_new_tokens": None, "segments": [{"name": "all", "coef_s": coef}],
    })


class ServingEngine(GameEngine):
    """`GameEngine` plus mixed steps and shared-prefix decode batches; decode contexts stay put, so the model
    prices every step exactly. A step of two or more shared-prefix readers records the prefix's whole blocks."""

    def prepare_decode(self, contexts, *, max_decode_steps):
        return {"contexts": list(contexts), "shared": [0] * len(contexts)}

    def decode_step(self, handle, members):
        sharing = sum(1 for i in members if handle["shared"][i]) >= 2
        return self._run([Slice(1, handle["contexts"][i], False, handle["shared"][i] if sharing else 0) for i in members])

    def prepare_shared_decode(self, contexts, shared_prefix_tokens, *, max_decode_steps):
        return {"contexts": list(contexts), "shared": [shared_prefix_tokens // BLOCK * BLOCK] * len(contexts)}

    def prepare_mixed(self, chunk_tokens, cached_tokens, decode_contexts, *, max_decode_steps):
        return {"chunk": Slice(chunk_tokens, cached_tokens, True), **self.prepare_decode(decode_contexts, max_decode_steps=1)}

    def mixed_step(self, handle, members):
        return self._run([handle["chunk"] if i == 0 else Slice(1, handle["contexts"][i - 1], False) for i in members])


def _expected_shapley(batch) -> np.ndarray:
    """own term (the shared prefix split equally among its readers) + intercept / n."""
    n = batch.size
    shared = np.array(batch.shared_prefix_tokens) // BLOCK * BLOCK
    readers = int((shared > 0).sum())
    out = []
    for i in range(n):
        if batch.is_prefill[i]:
            p, c = batch.num_new_tokens[i], batch.num_context_tokens[i]
            own = K1 * p + K3 * p**2 + (A2 + D6) * c
        else:
            c = batch.num_context_tokens[i]
            own = D7 + D6 * (c - shared[i] + (shared[i] / readers if readers > 1 else shared[i]))
        out.append(own + B / n)
    return np.array(out)


def test_mixed_and_shared_prefix_batches_are_estimated_with_the_shared_kv_game(tmp_path):
    batches = draw_sampled_batches(mixes(), ENVELOPE, n_batches=2, n_orders=4, sizes=(16,),
                                   kinds=(SampledKind.MIXED, SampledKind.SHARED_PREFIX_DECODE))
    mixed, shared = batches
    assert mixed.is_prefill[0] and not any(mixed.is_prefill[1:]) and mixed.num_context_tokens[0] > 0
    assert len(set(shared.shared_prefix_tokens)) == 1 and shared.shared_prefix_tokens[0] >= BLOCK
    assert all(c > shared.shared_prefix_tokens[0] for c in shared.num_context_tokens)
    engine = ServingEngine(sharing_cost)
    journal = Journal(tmp_path / "j.jsonl")
    counts = measure_sampled(engine, batches, journal, repeat=1, warm_up_steps=0)
    assert counts["measured_now"] == sum(len(b.subsets()) for b in batches)
    reread = Journal(tmp_path / "j.jsonl")
    for subset in shared.subsets():
        (m,) = reread.get(shared, 0, subset)
        if len(members(subset, shared.size)) >= 2:
            assert m.num_shared_context_tokens == [shared.shared_prefix_tokens[0] // BLOCK * BLOCK] * len(members(subset, shared.size))
        else:
            assert m.num_shared_context_tokens is None
    model = sharing_model()
    for b in batches:
        record = analyse_sampled_batch(b, reread, model, repeat=1)
        # The model's game is the engine's, so the control variate leaves no spread and the estimate is exact.
        np.testing.assert_allclose(record["shapley_s"], _expected_shapley(b), rtol=1e-9)
        np.testing.assert_allclose(record["shapley_ci95_s"][0], record["shapley_ci95_s"][1], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(record["shares_s"]["shapley_predicted"], _expected_shapley(b), rtol=1e-9)
    record = analyse_sampled_batch(shared, reread, model, repeat=1)
    s = shared.shared_prefix_tokens[0] // BLOCK * BLOCK
    assert record["kind"] == "sampled_shared_prefix_decode" and record["phase"] == "decode"
    np.testing.assert_allclose(record["effective_context_tokens"], np.array(shared.num_context_tokens) - s + s / shared.size)
    # Priced as if nothing were shared, the same batch's predicted shares miss the measured ones.
    blind = analyse_sampled_batch(shared, _without_sharing(reread, tmp_path), model, repeat=1)
    assert np.max(np.abs(np.array(blind["shares_s"]["shapley_predicted"]) - _expected_shapley(shared))) > 1e-5


def _without_sharing(journal: Journal, tmp_path) -> Journal:
    rows = [json.loads(line) for line in journal.path.read_text().splitlines()]
    path = tmp_path / "blind.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "num_shared_context_tokens"}) + "\n" for r in rows))
    return Journal(path)


def test_the_budget_is_the_models_time_of_every_distinct_prefix():
    batches = draw_sampled_batches(mixes(), ENVELOPE, n_batches=4, n_orders=4, sizes=(16,), kinds=SAMPLED_KINDS)
    model = sharing_model()
    step_s = model_step_s(model)
    budget = sampled_run_budget_s(batches, step_s, repeat=2)
    by_hand = 0.0
    for b in batches:
        engine = ServingEngine(sharing_cost)
        handle = (engine.prepare_shared_decode(list(b.num_context_tokens), b.shared_prefix_tokens[0], max_decode_steps=1)
                  if b.kind == SampledKind.SHARED_PREFIX_DECODE else None)
        for subset in b.subsets():
            chosen = members(subset, b.size)
            if handle is not None:  # the model reads the nominal prefix once, the fake its whole blocks
                sl = [Slice(1, b.num_context_tokens[i], False, b.shared_prefix_tokens[i] if len(chosen) > 1 else 0) for i in chosen]
            else:
                sl = [Slice(b.num_new_tokens[i], b.num_context_tokens[i], b.is_prefill[i]) for i in chosen]
            by_hand += sharing_cost(sl)
    assert budget == pytest.approx(2 * by_hand, rel=1e-9)


class FakeControlledEngine(ServingEngine):
    """Stands in for `ControlledEngine` in the command: same constructor and context-manager surface."""

    instances: list = []

    def __init__(self, model_dir, **kwargs):
        super().__init__(sharing_cost, noise=0.01)
        self.kwargs = kwargs
        FakeControlledEngine.instances.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def describe(self):
        return {"engine": "fake"}

    def warm_up(self, **kwargs):
        pass


def test_validate_measures_the_sampled_plan_resumes_and_re_analyses_without_the_engine(tmp_path, monkeypatch, capsys):
    from llmvisor.cli.validate import validate
    from llmvisor.engines.vllm import controlled

    monkeypatch.setattr(controlled, "ControlledEngine", FakeControlledEngine)
    workloads = tmp_path / "workloads"
    _write_mix_csvs(workloads)
    model_path = tmp_path / "model.json"
    sharing_model().to_json(model_path)
    output = tmp_path / "r.json"
    common = dict(output=output, model=model_path, workloads=workloads, batches=4, max_batch=4, repeat=1, n_bootstrap=20,
                  replicate_every=0, max_num_seqs=32)
    validate(**common, sampled_batches=4, orders=4, sampled_sizes="16", sampled_kinds="decode,prefill,mixed,shared_prefix_decode")
    printed = " ".join(capsys.readouterr().err.split())
    assert "4 sampled batches × 4 orders" in printed and "min of controlled steps by the model" in printed
    result = json.loads(output.read_text())
    assert result["n_batches_measured"] == 4 and result["n_sampled_batches_measured"] == 4
    summary = result["summary"]
    kinds = {"sampled_decode", "sampled_prefill", "sampled_mixed", "sampled_shared_prefix_decode"}
    assert set(summary["sampled"]) == kinds
    assert kinds <= set(summary["per_request_error"]) and {"prefill", "decode"} <= set(summary["per_request_error"])
    assert {"decode/sampled_shared_prefix_decode", "mixed/sampled_mixed", "prefill/sampled_prefill", "decode/workload"} <= set(
        summary["batch_sizes"]["by_kind"])
    assert summary["batch_sizes"]["min"] == 2 and summary["batch_sizes"]["max"] == 16
    assert "sampled_shared_prefix_decode/shared_context" in summary["class_bias"]
    assert summary["sampled"]["sampled_decode"]["errors"]["shapley"]["p90"] < 0.05
    agreement = summary["sampler_agreement"]
    assert agreement["n_batches"] == 2 and agreement["n_orders"] == 4  # the exact batches of 3 and 4 requests
    assert agreement["abs_error_fraction_of_step"]["p90"] < 0.05
    assert set(summary["errors"]) == {"prefill", "decode"}  # the exact tables stay over the exact batches
    assert result["settings"]["sampled"]["model_budget_s"] > 0
    steps_run = FakeControlledEngine.instances[-1].n_steps

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not start when everything is measured")

    # Everything measured: a re-run (and one without the sampled plan) only re-analyses.
    monkeypatch.setattr(controlled, "ControlledEngine", no_engine)
    validate(**common, sampled_batches=4, orders=4, sampled_sizes="16", sampled_kinds="decode,prefill,mixed,shared_prefix_decode")
    again = json.loads(output.read_text())
    assert again["summary"]["sampled"] == summary["sampled"]
    validate(**common)
    plain = json.loads(output.read_text())
    assert "sampled" not in plain["summary"] and "sampled_batches" not in plain and plain["n_batches_measured"] == 4
    assert steps_run > 0

    # A bigger plan measures only what is new: the fifth batch's distinct prefixes.
    monkeypatch.setattr(controlled, "ControlledEngine", FakeControlledEngine)
    validate(**common, sampled_batches=5, orders=4, sampled_sizes="16", sampled_kinds="decode,prefill,mixed,shared_prefix_decode")
    grown = json.loads(output.read_text())
    assert grown["n_sampled_batches_measured"] == 5
    fifth = grown["sampled_batches"][-1]
    # and a warm-up run of the full batch before each order (every order adds prefixes of its own)
    assert FakeControlledEngine.instances[-1].n_steps == fifth["n_subsets_measured"] + fifth["n_orders"]


def test_validate_runs_a_sampled_plan_alone(tmp_path, monkeypatch):
    """--batches 0 with --sampled-batches: serving-size batches only (e.g. a run at --max-num-seqs 64 of its own)."""
    from llmvisor.cli.validate import validate
    from llmvisor.engines.vllm import controlled

    monkeypatch.setattr(controlled, "ControlledEngine", FakeControlledEngine)
    workloads = tmp_path / "workloads"
    _write_mix_csvs(workloads)
    model_path = tmp_path / "model.json"
    sharing_model().to_json(model_path)
    validate(output=tmp_path / "r.json", model=model_path, workloads=workloads, batches=0, sampled_batches=2, orders=2,
             sampled_sizes="64", sampled_kinds="shared_prefix_decode,mixed", max_num_seqs=64, n_bootstrap=10)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["n_batches_measured"] == 0 and result["n_sampled_batches_measured"] == 2
    assert set(result["summary"]["sampled"]) == {"sampled_shared_prefix_decode", "sampled_mixed"}
    assert result["summary"]["batch_sizes"] == {"min": 64, "max": 64, "by_kind": {
        "decode/sampled_shared_prefix_decode": {"min": 64, "max": 64, "n_batches": 1}, "mixed/sampled_mixed": {"min": 64, "max": 64, "n_batches": 1}}}


def test_validate_sampled_flags_are_checked(tmp_path):
    from llmvisor.cli.validate import validate

    model_path = tmp_path / "model.json"
    sharing_model().to_json(model_path)
    with pytest.raises(LlmvisorError, match="--sampled-kinds: unknown kind"):
        validate(output=tmp_path / "r.json", model=model_path, sampled_batches=2, sampled_kinds="decode,chunky")
    with pytest.raises(LlmvisorError, match="--sampled-sizes"):
        validate(output=tmp_path / "r.json", model=model_path, sampled_batches=2, sampled_sizes="16,big")
    with pytest.raises(LlmvisorError, match="max_num_seqs"):
        validate(output=tmp_path / "r.json", model=model_path, sampled_batches=2, sampled_sizes="64", max_num_seqs=32)
    with pytest.raises(LlmvisorError, match="--orders"):
        validate(output=tmp_path / "r.json", model=model_path, sampled_batches=2, orders=3)
    with pytest.raises(LlmvisorError, match="--sampled-repeat"):
        validate(output=tmp_path / "r.json", model=model_path, sampled_batches=2, sampled_repeat=0)


def test_class_bias_of_a_class_whose_estimated_values_sum_below_zero_has_no_interval():
    """A sampled estimate can be negative; a class living in one such batch gets its bias but no interval."""
    from llmvisor.validation.analysis import class_bias

    records = [
        {"phase": "decode", "kind": "workload", "index": 0, "size": 2, "num_new_tokens": [1, 1], "num_context_tokens": [10, 20],
         "shapley_s": [0.01, 0.02], "shares_s": {"shapley": [0.012, 0.018]}},
        {"phase": "decode", "kind": "sampled_decode", "sampled": True, "index": 0, "size": 2, "num_new_tokens": [1, 1],
         "num_context_tokens": [10, 20], "shapley_s": [-0.01, 0.005], "shares_s": {"shapley": [0.001, 0.002]}},
    ]
    out, _ = class_bias(records, ["shapley"], n_bootstrap=50)
    assert out["decode"]["shapley"]["ci95"] is not None
    assert out["sampled_decode"]["shapley"]["ci95"] is None
    assert out["sampled_decode"]["shapley"]["bias"] == pytest.approx(0.003 / -0.005 - 1)
