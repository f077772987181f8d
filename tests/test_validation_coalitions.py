"""Serving-size batches measured on random complementary coalitions, mixed-sharing decode batches (2–3 prefix groups
beside own contexts) and their exact small versions, on a synthetic engine that shares KV blocks within a group."""

from __future__ import annotations

import numpy as np
import pytest

from llmvisor.engines.vllm.controlled import DecodeBatch
from llmvisor.errors import LlmvisorError
from llmvisor.validation.game import members
from llmvisor.validation.measurement import Journal, measure_sampled, missing_sampled_steps
from llmvisor.validation.plans import Envelope, SampledKind, draw_coalition_batches, draw_sampled_batches, sampled_plan
from test_validation import mixes
from test_validation_sampled_plan import BLOCK, ServingEngine, sharing_cost

ENVELOPE_64 = Envelope(4096, 2048, 64)


class GroupedEngine(ServingEngine):
    """`ServingEngine` plus decode batches in prefix groups (`DecodeBatch.intended` says what a step shares)."""

    def prepare_grouped_decode(self, contexts, shared, groups, *, max_decode_steps):
        sizes = {g: groups.count(g) for g in groups}
        whole = [p // BLOCK * BLOCK if g >= 0 and sizes[g] > 1 else 0 for p, g in zip(shared, groups, strict=True)]
        return DecodeBatch([str(i) for i in range(len(contexts))], list(contexts), list(contexts), whole, list(groups))

    def decode_step(self, handle, members):
        if isinstance(handle, DecodeBatch):
            return self._run(list(handle.intended(members).values()))
        return super().decode_step(handle, members)


def plan(**kwargs):
    options = dict(n_batches=6, coalitions_per_request=4, sizes=(16, 64), replicate_share=0.25, exact_sharing_batches=2, seed=3)
    return draw_coalition_batches(mixes(), ENVELOPE_64, **(options | kwargs))


def test_coalitions_are_complementary_pairs_with_each_request_in_about_half():
    batches = plan()
    serving = [b for b in batches if b.size >= 16]
    assert {(b.kind, b.size) for b in serving} >= {("decode", 16), ("mixed_sharing_decode", 64)}
    for b in serving:
        full = (1 << b.size) - 1
        masks = list(b.coalitions)
        assert masks[0] == full and len(masks) == 4 * b.size + 1 and len(set(masks)) == len(masks)
        assert all(masks[i] ^ masks[i + 1] == full for i in range(1, len(masks), 2))  # S and its complement
        share_in = np.array([[m >> i & 1 for i in range(b.size)] for m in masks[1:]]).mean(axis=0)
        np.testing.assert_allclose(share_in, 0.5)  # pairs: each request in exactly half
        assert b.rounds == 2 and len(b.replicated) == round(0.25 * len(masks) / 2) * 2  # a fixed share, every size and kind
        assert set(b.replicated) <= set(masks) and b.key.startswith("coalitions-")
        assert all(len(chunk) <= b.chunk for chunk in b.chunks(0))
    # The same settings draw the same plan (a resumed run finds its journal keys), another seed another.
    assert [b.key for b in plan()] == [b.key for b in batches] != [b.key for b in plan(seed=4)]
    settings = {"design": "coalitions", "batches": 6, "sizes": [16, 64], "kinds": ["decode", "shared_prefix_decode", "mixed_sharing_decode"],
                "coalitions_per_request": 4, "replicate_share": 0.25, "exact_sharing_batches": 2}
    assert [b.key for b in sampled_plan(mixes(), ENVELOPE_64, settings, seed=3)] == [b.key for b in batches]


def test_mixed_sharing_batches_hold_groups_of_different_sizes_beside_own_contexts():
    for b in plan():
        if b.kind != SampledKind.MIXED_SHARING_DECODE:
            continue
        groups = np.array(b.groups)
        sizes = sorted(int((groups == g).sum()) for g in set(b.groups) if g >= 0)
        assert 2 <= len(sizes) <= 3 and len(set(sizes)) == len(sizes) and (groups < 0).any()
        prefixes = {g: {p for p, h in zip(b.shared_prefix_tokens, b.groups, strict=True) if h == g} for g in set(b.groups)}
        assert prefixes[-1] == {0} and all(len(p) == 1 and min(p) >= BLOCK for g, p in prefixes.items() if g >= 0)
        assert all(c > p for c, p in zip(b.num_context_tokens, b.shared_prefix_tokens, strict=True))
        if b.size < 16:  # exact: every subset, twice
            assert sorted(b.coalitions) == list(range(1, 1 << b.size)) and b.replicated == b.coalitions


def test_grouped_batches_are_measured_resumably_with_sharing_within_each_group(tmp_path):
    batches = plan(sizes=(16,), n_batches=3)
    journal = Journal(tmp_path / "j.jsonl")
    total = missing_sampled_steps(batches, journal, 1)
    assert total == sum(len(b.coalitions) + len(b.replicated) for b in batches)
    counts = measure_sampled(GroupedEngine(sharing_cost), batches, journal, repeat=1, warm_up_steps=0)
    assert counts["measured_now"] == total
    reread = Journal(tmp_path / "j.jsonl")
    assert missing_sampled_steps(batches, reread, 1) == 0
    exact = next(b for b in batches if b.kind == SampledKind.MIXED_SHARING_DECODE and b.size < 16)
    for subset in exact.coalitions:
        chosen = members(subset, exact.size)
        (m,) = reread.get(exact, 0, subset)
        expected = [exact.shared_prefix_tokens[i] // BLOCK * BLOCK
                    if exact.groups[i] >= 0 and sum(exact.groups[j] == exact.groups[i] for j in chosen) >= 2 else 0 for i in chosen]
        assert (m.num_shared_context_tokens or [0] * len(chosen)) == expected


def test_the_prefixes_design_refuses_mixed_sharing_batches():
    with pytest.raises(LlmvisorError, match="coalitions only"):
        draw_sampled_batches(mixes(), ENVELOPE_64, n_batches=1, n_orders=2, sizes=(16,), kinds=(SampledKind.MIXED_SHARING_DECODE,))


def grouped_sharing_cost(slices) -> float:
    """`sharing_cost` with each prefix group's blocks read once by that group's readers (groups told apart by their
    shared length: the plan gives each group a prefix of its own length)."""
    from test_validation_sampled_plan import D6, D7, B

    readers: dict[int, int] = {}
    for s in slices:
        if s.num_shared_context_tokens:
            readers[s.num_shared_context_tokens] = readers.get(s.num_shared_context_tokens, 0) + 1
    cost = B
    for s in slices:
        shared = s.num_shared_context_tokens
        cost += D7 + D6 * (s.num_context_tokens - shared + (shared / readers[shared] if shared else 0.0))
    return cost


def test_the_sharing_check_passes_the_right_rule_and_flags_a_planted_wrong_one(tmp_path):
    from llmvisor.validation.coalitions import analyse_coalition_batch, coalition_summary
    from test_validation_sampled_plan import sharing_model

    batches = draw_coalition_batches(mixes(), ENVELOPE_64, n_batches=2, coalitions_per_request=4, sizes=(16,),
                                     kinds=(SampledKind.MIXED_SHARING_DECODE, SampledKind.DECODE), exact_sharing_batches=3, seed=5)
    journal = Journal(tmp_path / "j.jsonl")
    measure_sampled(GroupedEngine(grouped_sharing_cost, noise=0.01, seed=2), batches, journal, repeat=1, warm_up_steps=0)
    records = [analyse_coalition_batch(b, journal, sharing_model()) for b in batches]
    assert all(r is not None for r in records) and sum(r["exact"] for r in records) == 3
    summary = coalition_summary(records, trials=5)
    exact = summary["sharing"]["exact"]["rules"]
    right, wrong = exact["split_among_readers"], exact["whole_block_per_reader"]
    assert not right["flagged"] and abs(right["class_bias"]["shared"]["bias"]) < 0.03
    # each reader paying the whole block overcharges the readers and, the step's time being fixed, undercharges the rest
    assert wrong["flagged"] and wrong["verdict"]["unique"] == "missed" and "missed" not in right["verdict"].values()
    assert wrong["class_bias"]["shared"]["bias"] > 0.01 and wrong["class_bias"]["unique"]["bias"] < -0.03
    assert set(right["class_bias"]) >= {"largest_group", "smallest_group"}
    assert summary["batch_sizes"]["max"] == 16 and summary["batch_sizes"]["n_exact_batches"] == 3
    assert set(summary["sampled"]["halfwidth_over_share_p50"]) == {"mixed_sharing_decode", "decode"}
    assert summary["additivity"]["per_batch"] and summary["noise_floor"]["relative_per_measurement"]["n_groups"] > 0
    assert 0 <= summary["estimator"]["exact_coverage_95"] <= 1


def fake_grouped_command(tmp_path, monkeypatch, *, step_sleep_s: float):
    """`llmvisor validate`'s engine replaced by `GroupedEngine` (each decode step sleeping ``step_sleep_s``), with the
    test mixes and the model that prices its steps exactly; returns (workloads folder, model path)."""
    import time

    from llmvisor.engines.vllm import controlled
    from test_validation import _write_mix_csvs
    from test_validation_sampled_plan import FakeControlledEngine, sharing_model

    class FakeGroupedEngine(FakeControlledEngine, GroupedEngine):
        def decode_step(self, handle, members):
            time.sleep(step_sleep_s)
            return GroupedEngine.decode_step(self, handle, members)

    monkeypatch.setattr(controlled, "ControlledEngine", FakeGroupedEngine)
    workloads = tmp_path / "workloads"
    _write_mix_csvs(workloads)
    model_path = tmp_path / "model.json"
    sharing_model().to_json(model_path)
    return workloads, model_path


def test_validate_measures_the_coalitions_plan_within_a_time_limit_and_resumes(tmp_path, monkeypatch):
    import json

    from llmvisor.cli.validate import validate
    from llmvisor.engines.vllm import controlled

    # each step slow enough for the time limit to stop the first run part-way
    workloads, model_path = fake_grouped_command(tmp_path, monkeypatch, step_sleep_s=0.004)
    output = tmp_path / "c.json"
    common = dict(output=output, model=model_path, workloads=workloads, batches=0, repeat=1, n_bootstrap=20, max_num_seqs=32,
                  design="coalitions", sampled_batches=3, coalitions_per_request=2, sampled_sizes="16",
                  sampled_kinds="decode,shared_prefix_decode,mixed_sharing_decode", exact_sharing_batches=2)
    validate(**common, time_limit_s=1)
    first = json.loads(output.read_text())
    assert first["settings"]["measurement_runs"][-1]["stopped_by_time_limit"]
    assert first["n_sampled_batches_measured"] < 5
    validate(**common)  # resumes: measures only what the journal lacks
    result = json.loads(output.read_text())
    assert result["n_sampled_batches_measured"] == 5 and not result["settings"]["measurement_runs"][-1]["stopped_by_time_limit"]
    summary = result["summary"]
    assert summary["batch_sizes"]["max"] == 16 and summary["estimator"]["exact_coverage_95"] is not None
    assert set(summary["sampled"]["halfwidth_over_share_p50"]) == {"decode", "shared_prefix_decode", "mixed_sharing_decode"}
    assert summary["sharing"]["exact"]["rules"]["whole_block_per_reader"]["flagged"]
    from llmvisor.validation.report import coalitions_markdown_summary

    text = coalitions_markdown_summary(result)
    assert "| whole block per reader |" in text and text.count("| yes |") >= 1 and "mixed-sharing decode" in text

    def no_engine(*args, **kwargs):
        raise AssertionError("--no-measure must not start the engine")

    monkeypatch.setattr(controlled, "ControlledEngine", no_engine)
    validate(**common, measure_missing=False)
    assert json.loads(output.read_text())["summary"]["sampled"] == summary["sampled"]


def test_pools_add_batches_that_share_one_prefill_and_leave_the_rest_of_the_plan_as_it_was(tmp_path):
    """A pool is a 64-request batch and batches of 16 drawn from its requests (stratified by prefix group); adding pools
    changes no other batch's key, and a pooled batch measured with its pool held records the same steps as the same
    requests measured as a batch of their own (the held requests that a step does not name take no part in it)."""
    from dataclasses import replace

    base = plan()
    pooled_plan = plan(pools=3)
    assert [b.key for b in pooled_plan[: len(base)]] == [b.key for b in base]
    pooled = pooled_plan[len(base):]
    assert len(pooled) == 3 * 5 and len({b.key for b in pooled_plan}) == len(pooled_plan)
    assert {b.kind for b in pooled} == {"decode", "shared_prefix_decode", "mixed_sharing_decode"}
    for b in pooled:
        pool = next(p for p in pooled if p.size == 64 and p.pool_context_tokens == b.pool_context_tokens)
        assert list(b.pool_index) == sorted(set(b.pool_index)) and len(b.pool_index) == b.size
        assert b.num_context_tokens == tuple(pool.num_context_tokens[i] for i in b.pool_index)
        assert b.shared_prefix_tokens == tuple(pool.shared_prefix_tokens[i] for i in b.pool_index)
        if b.kind == SampledKind.MIXED_SHARING_DECODE:
            groups = np.array(b.groups)
            assert (groups < 0).any() and all((groups == g).sum() >= 2 for g in set(b.groups) if g >= 0)
            assert len(set(b.groups) - {-1}) == len(set(pool.groups) - {-1})
    small = [b for b in pooled if b.size == 16]
    engine = GroupedEngine(sharing_cost)
    held, alone = Journal(tmp_path / "held.jsonl"), Journal(tmp_path / "alone.jsonl")
    measure_sampled(engine, small, held, repeat=1, warm_up_steps=0)
    own = [replace(b, pool_index=(), pool_context_tokens=(), pool_shared_prefix_tokens=(), pool_groups=()) for b in small]
    measure_sampled(engine, own, alone, repeat=1, warm_up_steps=0)
    for b, o in zip(small, own, strict=True):
        for subset in b.coalitions:
            (m,), (n,) = held.get(b, 0, subset), alone.get(o, 0, subset)
            assert m.num_context_tokens == n.num_context_tokens and m.num_shared_context_tokens == n.num_shared_context_tokens
            assert m.step_latency_s == pytest.approx(n.step_latency_s, rel=1e-12)


def test_a_pool_chunk_lengthens_only_the_pools_batch_rounds_and_keeps_every_key():
    """--pool-chunk: the pools' coalitions go in rounds of that many (in plan order, every coalition once), the other
    batches keep theirs, and no batch's key or coalitions change (a journal measured before stays valid)."""
    before, after = plan(pools=2), plan(pools=2, pool_chunk=96)
    assert [b.key for b in before] == [b.key for b in after]
    assert [b.coalitions for b in before] == [b.coalitions for b in after]
    for b, a in zip(before, after, strict=True):
        if not b.pool_index:
            assert a.chunks(0) == b.chunks(0)
            continue
        chunks = a.chunks(0)
        assert [m for c in chunks for m in c] == list(a.coalitions)
        assert all(len(c) == 96 for c in chunks[:-1]) and len(chunks) < len(b.chunks(0))
    with pytest.raises(LlmvisorError, match="--pool-chunk: at least 2"):
        plan(pools=1, pool_chunk=1)


def test_a_journal_refuses_steps_from_a_machine_whose_canary_runs_many_times_slower(tmp_path):
    """Resuming on a host where the canary runs ~90× slower (no bf16 vector units) must not add its steps to batches
    measured elsewhere: the run stops before measuring or journaling anything; a like machine resumes."""
    from llmvisor.validation.measurement import InterferenceGuard

    batches = plan(sizes=(16,), n_batches=2, exact_sharing_batches=0)
    path = tmp_path / "j.jsonl"
    measure_sampled(GroupedEngine(sharing_cost), batches[:1], Journal(path), repeat=1, warm_up_steps=0, guard=InterferenceGuard())
    before = path.read_bytes()

    def slower(factor):
        return GroupedEngine(lambda slices: factor * sharing_cost(slices))

    with pytest.raises(LlmvisorError, match=r"canary step runs 90\.0× slower here .* another machine or engine build"):
        measure_sampled(slower(90.0), batches, Journal(path), repeat=1, warm_up_steps=0, guard=InterferenceGuard())
    assert path.read_bytes() == before
    counts = measure_sampled(slower(1.5), batches, Journal(path), repeat=1, warm_up_steps=0, guard=InterferenceGuard())
    assert counts["measured_now"] == len(batches[1].coalitions) + len(batches[1].replicated)


def test_each_batch_round_journals_where_its_wall_time_went(tmp_path):
    from llmvisor.validation.coalitions import measurement_cost
    from llmvisor.validation.measurement import InterferenceGuard

    batches = plan(sizes=(16,), n_batches=1, exact_sharing_batches=0)
    path = tmp_path / "j.jsonl"
    counts = measure_sampled(GroupedEngine(sharing_cost), batches, Journal(path), repeat=1, warm_up_steps=0, guard=InterferenceGuard())
    journal = Journal(path)
    rounds = sum(len(b.chunks(r)) for b in batches for r in range(b.rounds))
    assert len(journal.round_timing) == rounds and all(t["round_wall_s"] >= t["prepare_s"] >= 0 for t in journal.round_timing)
    steps_s = sum(m.step_latency_s for ms in journal.measurements.values() for m in ms)
    cost = measurement_cost(journal, [{"wall_s": 10.0, "measured_steps": counts["measured_now"]}])
    assert cost["rounds"]["n"] == rounds and cost["rounds"]["steps_s"] == pytest.approx(steps_s, rel=1e-3)
    assert cost["step_time_s"] == pytest.approx(steps_s) and cost["steps_per_wall_s"] == pytest.approx(counts["measured_now"] / 10.0)
    assert cost["other_fraction"] == pytest.approx(1 - (steps_s + sum(journal.canary_s)) / 10.0)


def test_the_pairs_layout_reads_each_document_by_a_short_and_a_long_reader():
    batches = plan(kinds=(SampledKind.MIXED_SHARING_DECODE,), sizes=(16, 32), sharing_layout="pairs")
    assert [b.key for b in batches] != [b.key for b in plan(kinds=(SampledKind.MIXED_SHARING_DECODE,), sizes=(16, 32))]
    for b in batches:
        groups = np.array(b.groups)
        own = np.array(b.num_context_tokens) - np.array(b.shared_prefix_tokens)
        if b.size < 16:  # the exact batches keep their groups of 3 and 2
            assert sorted(int((groups == g).sum()) for g in set(b.groups) if g >= 0) == [2, 3]
            continue
        documents = sorted(set(b.groups) - {-1})
        assert len(documents) == round(3 * b.size / 16) and (groups < 0).sum() == b.size - 2 * len(documents)
        for g in documents:
            short, long = sorted(own[groups == g])
            assert 16 <= short <= 64 and long >= (3840 - b.shared_prefix_tokens[b.groups.index(g)]) // 2
    settings = {"design": "coalitions", "batches": 6, "sizes": [16, 32], "kinds": ["mixed_sharing_decode"], "coalitions_per_request": 4,
                "replicate_share": 0.25, "exact_sharing_batches": 2, "sharing_layout": "pairs"}
    assert [b.key for b in sampled_plan(mixes(), ENVELOPE_64, settings, seed=3)] == [b.key for b in batches]
    with pytest.raises(LlmvisorError, match="sharing-layout"):
        plan(sharing_layout="triples")
    with pytest.raises(LlmvisorError, match="not with --pools"):  # a pool's smaller batches keep groups of 2 or more
        plan(sharing_layout="pairs", pools=1)


def test_on_pairs_the_sharing_check_flags_each_plausible_wrong_rule_and_passes_the_equal_split(tmp_path):
    """An engine whose readers split each document's blocks equally: at serving size the check passes that rule and
    flags the first reader paying, each reader paying the whole block and the split by context length (the pairs
    layout is what lets the last one depart from the equal split by more than the check's ±3%)."""
    from llmvisor.validation.coalitions import analyse_coalition_batch, coalition_summary
    from test_validation_sampled_plan import sharing_model

    batches = draw_coalition_batches(mixes(), ENVELOPE_64, n_batches=6, coalitions_per_request=4, sizes=(16, 32),
                                     kinds=(SampledKind.MIXED_SHARING_DECODE,), sharing_layout="pairs", seed=5)
    journal = Journal(tmp_path / "j.jsonl")
    measure_sampled(GroupedEngine(grouped_sharing_cost, noise=0.01, seed=2), batches, journal, repeat=1, warm_up_steps=0)
    records = [analyse_coalition_batch(b, journal, sharing_model()) for b in batches]
    rules = coalition_summary(records, trials=5)["sharing"]["serving_size"]["rules"]
    assert not rules["split_among_readers"]["flagged"]
    for wrong in ("first_reader_pays", "whole_block_per_reader", "split_by_context_length"):
        assert rules[wrong]["flagged"], (wrong, rules[wrong]["class_bias"])
    assert rules["split_by_context_length"]["verdict"]["short_readers"] == "missed"


def test_priced_with_its_own_cross_fitted_terms_the_check_judges_the_rule_not_the_models_price_of_sharing(tmp_path):
    """An engine that reads a shared block once and splits it equally, priced by a model that says sharing saves
    nothing (same price per context token, all of it per reader): the landed rule is flagged, though it is the engine's
    rule. Priced with the run's own terms (llmvisor's fit on the other request sets' steps), the fit finds that sharing
    saves the whole read and the landed rule passes; no request set is priced by a fit that saw its steps."""
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.validation.coalitions import (
        analyse_coalition_batch,
        coalition_steps_trace,
        crossfitted_models,
        engine_priced,
        sharing_own_terms,
    )
    from llmvisor.validation.groundtruth import sharing_rule_verdicts
    from test_validation_sampled_plan import D6, sharing_model

    batches = draw_coalition_batches(mixes(), ENVELOPE_64, n_batches=8, coalitions_per_request=4, sizes=(16, 32),
                                     kinds=(SampledKind.MIXED_SHARING_DECODE,), sharing_layout="pairs", seed=5)
    journal = Journal(tmp_path / "j.jsonl")
    measure_sampled(GroupedEngine(grouped_sharing_cost, noise=0.01, seed=2), batches, journal, repeat=1, warm_up_steps=0)
    no_saving = sharing_model().to_dict()
    no_saving["segments"][0]["coef_s"].update(decode_context_tokens=D6, effective_context_tokens=0.0)
    no_saving = StepLatencyModel.from_dict(no_saving)
    records = [analyse_coalition_batch(b, journal, no_saving) for b in batches]
    assert sharing_rule_verdicts(records)["serving_size"]["rules"]["split_among_readers"]["flagged"]
    priced, how = engine_priced(batches, journal, records, no_saving)
    rules = sharing_rule_verdicts(priced)["serving_size"]["rules"]
    assert not rules["split_among_readers"]["flagged"]
    assert how["model_shared_read_saving"] == [0.0] and how["n_folds"] == 4
    assert all(min(f["shared_read_saving"]) > 0.9 for f in how["folds"])
    indices = {b.index for b in batches}
    models = crossfitted_models(batches, journal, indices)
    for index, model in models.items():
        others = {i for i, m in models.items() if m is not model}
        assert index not in others and others
        again = StepLatencyModel().fit(coalition_steps_trace(batches, journal, others)).to_dict()["segments"]
        for seg, seg_again in zip(model.to_dict()["segments"], again, strict=True):
            assert seg["coef_s"] == pytest.approx(seg_again["coef_s"], rel=1e-6, abs=1e-12)
    # what validate writes: a batch the guard kept flagged (a record of its index and kind only) judges nothing, as in
    # the check priced with the given model
    flagged = {"interference_flagged": True, "index": 99, "kind": "mixed_sharing_decode", "size": 16, "exact": False, "n_disturbed_steps": 3}
    own = sharing_own_terms(batches, journal, [*records, flagged], no_saving)
    assert own["serving_size"]["n_batches"] == len(records) and not own["serving_size"]["rules"]["split_among_readers"]["flagged"]


def test_validate_records_the_pairs_layout_and_resumes_with_it(tmp_path, monkeypatch):
    import json

    from llmvisor.cli.validate import validate

    workloads, model_path = fake_grouped_command(tmp_path, monkeypatch, step_sleep_s=0.0)
    output = tmp_path / "pairs.json"
    common = dict(output=output, model=model_path, workloads=workloads, batches=0, repeat=1, n_bootstrap=20, max_num_seqs=32,
                  design="coalitions", sampled_batches=2, coalitions_per_request=2, sampled_sizes="16",
                  sampled_kinds="mixed_sharing_decode")
    with pytest.raises(LlmvisorError, match="only with --design coalitions"):
        validate(**{**common, "design": "prefixes", "output": tmp_path / "p.json"}, sharing_layout="pairs")
    validate(**common, sharing_layout="pairs")
    result = json.loads(output.read_text())
    assert result["settings"]["sampled"]["sharing_layout"] == "pairs" and result["n_sampled_batches_measured"] == 2
    rules = result["summary"]["sharing"]["serving_size"]["rules"]
    assert set(rules) == {"split_among_readers", "whole_block_per_reader", "first_reader_pays", "split_by_context_length"}
    for record in result["sampled_batches"]:
        documents = [g for g in set(record["groups"]) if g >= 0]
        assert len(documents) == 3 and all(record["groups"].count(g) == 2 for g in documents)
    # beside the check priced with the given model, the check priced with the run's own terms: each of the two request
    # sets priced by a fit on the other's steps, which finds that this engine reads a shared block once
    own = result["summary"]["sharing_own_terms"]
    assert own["pricing"]["n_folds"] == 2 and set(own["serving_size"]["rules"]) == set(rules)
    assert all(f["shared_read_saving"][0] > 0.9 for f in own["pricing"]["folds"])
    from llmvisor.validation.report import coalitions_markdown_summary

    assert "priced with the run's own terms" in coalitions_markdown_summary(result)


def test_a_wrong_rules_reach_grows_with_what_a_shared_read_saves_and_vanishes_without_it():
    """`sharing_rule_reach`: the largest class bill a wrong sharing rule can move from the landed rule's. With no saving
    (a shared block paid by every reader) the rules bill alike; with the whole read shared each wrong rule departs by
    far more than the check's ±3%, the split by context length most on the short reader of a pair; and the reach grows
    with the saving, so an engine whose second reader saves little can leave a rule within the tolerance."""
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.validation.coalitions import CLASS_BIAS_MAX, SHARING_RULES, shared_read_saving
    from llmvisor.validation.groundtruth import sharing_rule_reach
    from test_validation_sampled_plan import D6, sharing_model

    def with_saving(saving: float) -> StepLatencyModel:
        d = sharing_model().to_dict()
        d["segments"][0]["coef_s"].update(decode_context_tokens=D6 * (1 - saving), effective_context_tokens=D6 * saving)
        return StepLatencyModel.from_dict(d)

    small = dict(sizes=(16,), readers=(2, 4), document_shares=(0.1, 0.3))
    reach = {s: sharing_rule_reach(with_saving(s), max_context=3840, **small) for s in (0.0, 0.25, 1.0)}
    assert reach[1.0]["shared_read_saving"] == pytest.approx([1.0]) and reach[0.25]["shared_read_saving"] == pytest.approx([0.25])
    assert shared_read_saving(with_saving(0.25)) == pytest.approx([0.25])
    for rule in SHARING_RULES[1:]:
        assert abs(reach[0.0]["rules"][rule]["departure"]) < 1e-9, rule
        assert abs(reach[1.0]["rules"][rule]["departure"]) > 3 * CLASS_BIAS_MAX, rule
        assert abs(reach[0.25]["rules"][rule]["departure"]) < abs(reach[1.0]["rules"][rule]["departure"]), rule
    # contexts too short to hold a document and a question: no layout, nothing to reach
    assert {r["departure"] for r in sharing_rule_reach(with_saving(1.0), max_context=16, **small)["rules"].values()} == {0.0}
    by_length = reach[1.0]["rules"]["split_by_context_length"]
    assert by_length["departure"] < 0 and by_length["readers_per_document"] == 2
    assert by_length["class"] in {"short_readers", "shortest_readers", "later_readers", "first_readers"}
