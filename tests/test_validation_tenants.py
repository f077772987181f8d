"""Per-tenant ground truth (issue #39): the tenants' game measured exactly, its truths on constructed games whose answer
is known, the tenants plan, the sharing check against plausible wrong rules, and `llmvisor validate --tenant-batches`
(a synthetic engine for the figures, the real vLLM engine for a short smoke run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.validation.game import exact_shapley, members
from llmvisor.validation.measurement import Journal, measure_sampled
from llmvisor.validation.plans import Envelope, TenantRole, draw_tenant_batches, tenant_coalition_masks
from llmvisor.validation.tenants import analyse_tenant_batch, tenant_game_values, tenant_summary
from test_validation import mixes
from test_validation_coalitions import GroupedEngine, grouped_sharing_cost
from test_validation_sampled_plan import sharing_model

ENVELOPE_64 = Envelope(4096, 2048, 64)


def tenant_times(cost, tenants: list[int], repeats: int = 2, noise: float = 0.0, rng=None) -> list[np.ndarray]:
    """Each tenant coalition's measured times (tenant masks 1 … 2**T − 1) from a request-level ``cost(mask)``."""
    count = max(tenants) + 1
    of = [sum(1 << i for i, t in enumerate(tenants) if t == k) for k in range(count)]
    out = []
    for c in range(1, 1 << count):
        v = cost(sum(of[k] for k in range(count) if c >> k & 1))
        out.append(v * (1 + noise * rng.standard_normal(repeats)) if noise else np.full(repeats, v))
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.integers(0, 6), st.integers(0, 10_000))
def test_in_an_additive_game_a_tenant_is_owed_its_requests_shapley_values_summed(n_tenants, extra, seed):
    rng = np.random.default_rng(seed)
    n = n_tenants + extra
    tenants = list(range(n_tenants)) + [int(t) for t in rng.integers(0, n_tenants, extra)]
    b, f = rng.uniform(0.005, 0.02), rng.uniform(0.0005, 0.005, n)

    def cost(mask: int) -> float:
        return b + sum(f[i] for i in members(mask, n))

    game = tenant_game_values(tenant_times(cost, tenants), n_tenants, np.bincount(tenants, minlength=n_tenants))
    requests = f + b / n  # the Shapley value of each request in an additive game
    np.testing.assert_allclose(game["shapley_s"], np.bincount(tenants, weights=requests, minlength=n_tenants), rtol=1e-9)
    # the tenants' game itself splits the shared cost per tenant, not per request
    np.testing.assert_allclose(game["tenant_game_shapley_s"], np.bincount(tenants, weights=f, minlength=n_tenants) + b / n_tenants, rtol=1e-9)
    assert game["shapley_s"].sum() == pytest.approx(cost((1 << n) - 1))
    assert np.all(game["half_s"] == 0)


TENANTS_OF_8 = [0, 1, 0, 2, 1, 0, 2, 1]


def document_game(readers: set[int], block_s: float, seed: int):
    """A batch of `TENANTS_OF_8`'s requests, additive (b + Σ f_i) plus one document of ``block_s`` read once per step by
    any requests of the ``readers`` tenants in it."""
    f = np.random.default_rng(seed).uniform(0.001, 0.004, len(TENANTS_OF_8))

    def cost(mask: int) -> float:
        chosen = members(mask, len(TENANTS_OF_8))
        return (0.01 + sum(f[i] for i in chosen) + block_s * any(TENANTS_OF_8[i] in readers for i in chosen)) if chosen else 0.0

    return cost


def test_a_document_shared_within_one_tenant_leaves_its_requests_summed_shapley_values_its_truth():
    """Requests of tenant 0 read one block once per step (not additive over requests): the request-level exact Shapley
    values, summed per tenant, are still what the tenants' game gives."""
    cost = document_game({0}, 0.006, seed=7)
    exact = exact_shapley(np.array([cost(m) for m in range(1 << len(TENANTS_OF_8))]))
    game = tenant_game_values(tenant_times(cost, TENANTS_OF_8), 3, np.bincount(TENANTS_OF_8))
    np.testing.assert_allclose(game["shapley_s"], np.bincount(TENANTS_OF_8, weights=exact), rtol=1e-9)
    assert game["additivity"]["interaction_rms"] < 1e-12  # additive over tenants: the block is one tenant's


def test_a_document_shared_across_tenants_shows_as_a_tenants_game_that_is_not_additive():
    """Where two tenants read one document, the sum of request values is no longer what the tenants' game gives; the
    repeats' additivity test says so."""
    rng = np.random.default_rng(3)
    cost = document_game({0, 1}, 0.02, seed=3)
    game = tenant_game_values(tenant_times(cost, TENANTS_OF_8, repeats=8, noise=0.005, rng=rng), 3, np.bincount(TENANTS_OF_8))
    assert game["additivity"]["rejected"]


def test_intervals_from_the_repeats_cover_the_truth_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    tenants = [0] * 10 + [1] * 2 + [2] * 4
    n = len(tenants)
    b, f = 0.01, rng.uniform(0.001, 0.004, n)
    truth = np.bincount(tenants, weights=f + b / n)

    def cost(mask: int) -> float:
        return b + sum(f[i] for i in members(mask, n))

    covered = []
    for _ in range(300):
        game = tenant_game_values(tenant_times(cost, tenants, repeats=6, noise=0.05, rng=rng), 3, np.bincount(tenants))
        covered.extend(np.abs(game["shapley_s"] - truth) <= game["half_s"])
    assert 0.91 <= np.mean(covered) <= 0.99


def test_the_tenants_plan_holds_unequal_tenants_and_measures_every_coalition_of_them():
    batches = draw_tenant_batches(mixes(), ENVELOPE_64, n_batches=18, repeat=3, rounds=2, seed=2)
    assert [b.size for b in batches[:3]] == [16, 32, 64]
    assert {len(b.tenant_roles) for b in batches} == {2, 3, 4} and {b.phase for b in batches} >= {"prefill", "mixed_sharing_decode", "decode"}
    assert len({b.key for b in batches}) == len(batches)
    for b in batches:
        counts = np.bincount(b.tenants)
        heavy, light = b.tenant_roles.index(TenantRole.HEAVY), b.tenant_roles.index(TenantRole.LIGHT)
        assert counts[heavy] >= b.size / 2 and counts[light] < counts[heavy] and counts.sum() == b.size
        distinct = tenant_coalition_masks(b.tenants)
        assert len(distinct) == (1 << len(b.tenant_roles)) - 1 and distinct[0] == (1 << b.size) - 1
        assert sorted(b.coalitions) == sorted(distinct * 3) and b.chunks(0) == [list(b.coalitions)] and b.replicated == b.coalitions
        if TenantRole.SHARING in b.tenant_roles:
            readers = np.array(b.tenants) == b.tenant_roles.index(TenantRole.SHARING)
            assert np.all(np.array(b.groups)[readers] == 0) and np.all(np.array(b.groups)[~readers] == -1)
            assert len({b.shared_prefix_tokens[i] for i in np.flatnonzero(readers)}) == 1


def test_measured_tenant_values_judge_the_bills_on_a_synthetic_sharing_engine(tmp_path):
    batches = draw_tenant_batches(mixes(), ENVELOPE_64, n_batches=6, sizes=(16, 32), tenant_counts=(2, 3, 4), phases=("decode",),
                                  repeat=3, rounds=2, seed=4)
    journal = Journal(tmp_path / "j.jsonl")
    counts = measure_sampled(GroupedEngine(grouped_sharing_cost, noise=0.01, seed=3), batches, journal, repeat=1, warm_up_steps=0)
    assert counts["measured_now"] == sum(2 * len(b.coalitions) for b in batches)
    records = [analyse_tenant_batch(b, journal, sharing_model()) for b in batches]
    assert all(r is not None and not r["interference_flagged"] for r in records)
    for r in records:
        assert r["n_rounds"] == 2 and r["shapley_s"].sum() == pytest.approx(r["measured_step_s"], rel=0.05)
    summary = tenant_summary(records, n_bootstrap=100)
    # the engine's game is the model's: the landed rule bills each tenant its measured value within the noise (1% a step)
    assert summary["by_size"]["16"]["relative_error"]["shapley"]["p90"] < 0.06
    assert summary["by_size"]["16"]["bill_within_interval_fraction"] >= 0.85
    assert summary["by_size"]["16"]["relative_error"]["token_count"]["p90"] > summary["by_size"]["16"]["relative_error"]["shapley"]["p90"]
    rules = summary["sharing_tenant_by_rule"]
    assert rules["split_among_readers"]["p50"] < rules["whole_block_per_reader"]["p50"]
    assert set(summary["by_role"]) == {"heavy", "light", "sharing", "medium"} and set(summary["by_sharing_class"]) == {"own", "sharing"}
    assert summary["goal"]["by_size"]["32"]["judged"] and not summary["goal"]["by_size"]["16"]["judged"]


def test_every_plausible_wrong_sharing_rule_is_flagged_with_enough_samples_and_the_landed_one_is_not():
    """Constructed mixed-sharing batches whose true values are the engine's (a group's block read once, split among its
    readers), known to 0.5%: the check flags each wrong rule and passes the landed one."""
    from llmvisor.validation.coalitions import SHARING_RULES, sharing_check, sharing_rule_shares
    from llmvisor.validation.groundtruth import sharing_rule_verdicts
    from test_validation_sampled_plan import D6, D7, B

    rng = np.random.default_rng(11)
    model = sharing_model()
    records = []
    for _ in range(40):
        n = 16
        groups = np.array([0] * 5 + [1] * 4 + [-1] * 7)
        rng.shuffle(groups)
        prefix = {0: 1600, 1: 800}
        shared = np.array([prefix.get(int(g), 0) for g in groups], dtype=np.float64)
        context = shared + rng.integers(10, 1500, n)
        eff = context.copy()
        for g in (0, 1):
            idx = groups == g
            eff[idx] = context[idx] - shared[idx] + shared[idx] / idx.sum()
        value = D7 + D6 * eff + B / n  # the Shapley value of the engine's step: own terms + the intercept split
        measured = float(value.sum())
        shares = sharing_rule_shares(model, np.ones(n), context, np.zeros(n, dtype=bool), measured, shared, groups)
        records.append({"kind": "mixed_sharing_decode", "size": n, "groups": groups.tolist(), "num_context_tokens": context.tolist(),
                        "shapley_s": value, "cov_s2": np.diag((0.005 * value) ** 2), "sharing_rule_shares_s": shares})
    check = sharing_check(records)["serving_size"]["rules"]
    assert set(check) == set(SHARING_RULES)
    assert not check["split_among_readers"]["flagged"]
    assert all(check[r]["flagged"] for r in SHARING_RULES[1:])
    assert check["first_reader_pays"]["verdict"]["first_readers"] == "missed"
    assert "missed" in {check["split_by_context_length"]["verdict"][c] for c in ("longest_readers", "shortest_readers")}
    verdicts = sharing_rule_verdicts(records)["serving_size"]["rules"]
    assert verdicts["split_by_context_length"]["deciding_class"] in {"longest_readers", "shortest_readers"}


def test_validate_runs_the_tenants_plan_and_writes_its_section(tmp_path, monkeypatch):
    from llmvisor.cli.validate import validate
    from test_validation_coalitions import fake_grouped_command

    workloads, model_path = fake_grouped_command(tmp_path, monkeypatch, step_sleep_s=0.0005)
    output = tmp_path / "t.json"
    common = dict(output=output, model=model_path, workloads=workloads, batches=0, n_bootstrap=20, max_num_seqs=32,
                  tenant_batches=6, tenant_sizes="16", tenant_repeat=2, tenant_rounds=2)
    validate(**common)
    result = json.loads(output.read_text())
    assert result["settings"]["tenants"]["batches"] == 6 and len(result["tenant_batches"]) == 6
    tenants = result["summary"]["tenants"]
    assert tenants["n_batches"] == 6 and set(tenants["by_phase"]) == {"decode", "prefill"}
    assert tenants["by_size"]["16"]["relative_error"]["shapley"]["p90_ci95"] is not None
    validate(**common, measure_missing=False)  # re-analysis: nothing left to measure
    assert json.loads(output.read_text())["summary"]["tenants"]["n_tenants"] == tenants["n_tenants"]


@pytest.mark.vllm
def test_validate_measures_a_small_tenants_plan_on_vllm(tmp_path):
    """A short smoke run on the real engine (tiny Llama): two tenant batches of 8 requests (two tenants; three, one
    sharing a document), every coalition of tenants twice; the result carries the tenants' section."""
    pytest.importorskip("vllm")
    from _tiny_llama import write_tiny_llama
    from llmvisor.cli.validate import validate
    from test_validation import TINY_FIELDS

    model_dir = write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)
    output = tmp_path / "t.json"
    validate(output=output, engine_model=model_dir, batches=0, n_bootstrap=20, max_model_len=1024, max_num_batched_tokens=512,
             max_num_seqs=8, kv_cache_gib=1, threads=2, tenant_batches=2, tenant_sizes="8", tenant_repeat=2, tenant_rounds=1,
             guard_max_redos=0, guard_max_wait_s=0, guard_every=3)
    result = json.loads(output.read_text())
    (run,) = result["settings"]["measurement_runs"]  # the canary spacing asked for is the one run with, recorded and stated
    assert run["guard_every"] == 3 and "after every 3 subset steps" in result["interference"]["rule"]
    rounds = [row for row in map(json.loads, (tmp_path / "t.journal.jsonl").read_text().splitlines()) if row.get("timing")]
    assert max(len(row["canary_s"]) for row in rounds) >= 5  # 14 steps of three tenants: 4 canaries within and 1 closing
    records = result["tenant_batches"]
    assert len(records) == 2 and [r["n_tenants"] for r in records] == [2, 3]
    assert records[1]["kind"] == "mixed_sharing_decode" and "sharing" in records[1]["roles"]
    for r in (r for r in records if not r["interference_flagged"]):
        assert len(r["shapley_s"]) == r["n_tenants"] and sum(r["shapley_s"]) == pytest.approx(r["measured_step_s"], rel=0.5)
        assert all(h >= 0 for h in r["half_s"]) and set(r["bills_s"]) == {"shapley", "token_count", "equal_split"}
    assert "tenants" in result["summary"] and result["settings"]["tenants"]["sizes"] == [8]
