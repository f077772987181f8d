"""LoRA adapters in the cost game (issue #38 item 3): a slice's per-token adapter work is its own, each adapter's
per-step terms (its kernels, its slot load, its disk load) are split equally among the step's slices of that adapter
and nobody else. Checked against brute-force Shapley over every subset of a game written here from its definition
(a subset pays an adapter's fixed price iff one of its members runs the adapter), on a hand-made step with two
adapters and base-model requests and on hypothesis-generated steps, one and two segments; a deliberately wrong rule
(the per-adapter terms split over every request of the step) fails the same check. Offline and online attribution
give the same shares; a LoRA model on a trace without the LoRA columns bills what its base part bills."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.attribution import (
    RULES,
    StepAttributor,
    aggregate,
    attribute,
    attribute_arrays,
    step_shapley_s,
    subset_costs_s,
)
from llmvisor.core.features import FEATURE_NAMES, FEATURE_NAMES_LORA, LoraCoef, lora_slices, lora_slices_of, slice_feature_matrix
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, DEFAULT_LORA_COEF_S, DEFAULT_LORA_RANKS, synthetic_trace
from llmvisor.core.trace import StepTrace

RANKS = {"a": 8, "b": 16, "c": 64}
LORA_BASE = np.array([{**DEFAULT_COEF_S, **DEFAULT_LORA_COEF_S, "effective_context_tokens": 1e-7,
                       "prefill_lora_tokens": 3e-5, "decode_lora_tokens": 1e-4, "lora_steps": 2e-3,
                       "lora_base_tokens": 2e-5}[name] for name in FEATURE_NAMES_LORA])
"""Every coefficient nonzero, so no term of the game can hide."""
FIXED = [LoraCoef.L5, LoraCoef.L6, LoraCoef.L7, LoraCoef.L8, LoraCoef.L9]
N_BASE = len(FEATURE_NAMES)


def lora_model(coef_sets, boundary=None) -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES_LORA, c)) for c in coef_sets], boundary)


def exact_shapley(value, n):
    phi = np.zeros(n)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for size in range(n):
            weight = math.factorial(size) * math.factorial(n - size - 1) / math.factorial(n)
            for subset in itertools.combinations(others, size):
                phi[i] += weight * (value(set(subset) | {i}) - value(set(subset)))
    return phi


def adapter_game(coef_sets, boundary, new, context, is_prefill, names, loads, disk_loads):
    """v(S) from the definition, independent of llmvisor's LoRA code: the base model's price of S alone (intercept and
    the base own terms of its slices), each member's per-token adapter work, each adapter run by a member of S
    once: its kernels, plus its slot load and disk load if it was loaded for the step, and, if any member runs an
    adapter, the LoRA path: its set-up and its kernels over S's base-model tokens; in S's own segment."""
    rank = np.array([RANKS.get(a, 0) for a in names], dtype=np.float64)

    def cost(subset):
        if not subset:
            return 0.0
        members = sorted(subset)
        coef = np.asarray(coef_sets[0 if boundary is None or new[members].sum() < boundary else 1])
        base = coef[0] + float((slice_feature_matrix(new[members], context[members], is_prefill[members]) @ coef[:N_BASE]).sum())
        work = 0.0
        for i in members:
            if names[i]:
                work += (coef[LoraCoef.L1] * new[i] + coef[LoraCoef.L2] * rank[i] * new[i] if is_prefill[i]
                         else coef[LoraCoef.L3] + coef[LoraCoef.L4] * rank[i])
        present = {names[i] for i in members} - {""}
        fixed = sum(coef[LoraCoef.L5] + coef[LoraCoef.L6] * (a in loads) + coef[LoraCoef.L7] * (a in disk_loads) for a in present)
        path = coef[LoraCoef.L8] + coef[LoraCoef.L9] * sum(new[i] for i in members if not names[i]) if present else 0.0
        return base + work + fixed + path

    return cost


def matches_brute_force(shares, coef_sets, boundary, new, context, is_prefill, names, loads, disk_loads) -> bool:
    """The check: do ``shares`` equal the brute-force Shapley value of the adapter game?"""
    expected = exact_shapley(adapter_game(coef_sets, boundary, new, context, is_prefill, names, loads, disk_loads), new.size)
    return bool(np.allclose(shares, expected, rtol=1e-9, atol=1e-15))


def wrong_rule_shares(coef, new, context, is_prefill, names, loads, disk_loads) -> np.ndarray:
    """A deliberately wrong rule: each adapter's per-step price split over every request of the step."""
    rank = np.array([RANKS.get(a, 0) for a in names], dtype=np.float64)
    none = lora_slices(names, rank, [0, new.size], [frozenset()], [frozenset()], num_new_tokens=new)
    none = none._replace(adapter_share=np.zeros(new.size))
    own = step_shapley_s(np.asarray([coef]), None, new, context, is_prefill, lora=none)
    present = set(names) - {""}
    fixed = sum(coef[LoraCoef.L5] + coef[LoraCoef.L6] * (a in loads) + coef[LoraCoef.L7] * (a in disk_loads) for a in present)
    return own + fixed / new.size


def step_lora(names, new, loads=(), disk_loads=()):
    rank = np.array([RANKS.get(a, 0) for a in names], dtype=np.int64)
    return lora_slices(np.array(names, dtype=object), rank, [0, len(names)], [frozenset(loads)], [frozenset(disk_loads)],
                       num_new_tokens=new)


# A step with two adapters and base-model requests: a (rank 8) loaded from disk for the step with two requests,
# b (rank 64 here as c) resident with one, two base-model requests; prefill and decode slices of each.
TWO_ADAPTERS = {
    "names": ["", "a", "a", "c", ""],
    "new": np.array([1, 1, 120, 1, 300]),
    "context": np.array([500, 800, 0, 1500, 40]),
    "is_prefill": np.array([False, False, True, False, True]),
    "loads": {"a"},
    "disk_loads": {"a"},
}


def test_a_step_with_two_adapters_and_base_requests_is_split_as_brute_force_shapley_says():
    step = TWO_ADAPTERS
    names, new, context, is_prefill = step["names"], step["new"], step["context"], step["is_prefill"]
    model = lora_model([LORA_BASE])
    lora = step_lora(names, new, step["loads"], step["disk_loads"])
    phi = step_shapley_s(model.coef_, None, new, context, is_prefill, lora=lora)
    assert matches_brute_force(phi, [LORA_BASE], None, new, context, is_prefill, names, step["loads"], step["disk_loads"])
    # what the rule says in words: a's kernels and its load in two equal halves to a's requests, c's kernels to its one
    # request, nothing of either to the base-model requests; the LoRA path's set-up in thirds to the three adapter
    # requests, and its kernels over the 301 base-model tokens 3/4 to the base requests (each its own tokens') and
    # 1/4 to the adapter requests (A = 3: A/(A+1) and 1/(A(A+1)) each)
    base_only = lora_model([np.where(np.arange(LORA_BASE.size) >= N_BASE, 0.0, LORA_BASE)])
    extra = phi - step_shapley_s(base_only.coef_, None, new, context, is_prefill)
    a_fixed = LORA_BASE[LoraCoef.L5] + LORA_BASE[LoraCoef.L6] + LORA_BASE[LoraCoef.L7]
    path = LORA_BASE[LoraCoef.L8] / 3 + LORA_BASE[LoraCoef.L9] * 301 / 12
    assert extra[[0, 4]] == pytest.approx(LORA_BASE[LoraCoef.L9] * np.array([1, 300]) * 3 / 4, rel=1e-12)
    assert extra[1] == pytest.approx(LORA_BASE[LoraCoef.L3] + 8 * LORA_BASE[LoraCoef.L4] + a_fixed / 2 + path, rel=1e-12)
    assert extra[2] == pytest.approx(120 * (LORA_BASE[LoraCoef.L1] + 8 * LORA_BASE[LoraCoef.L2]) + a_fixed / 2 + path, rel=1e-12)
    assert extra[3] == pytest.approx(LORA_BASE[LoraCoef.L3] + 64 * LORA_BASE[LoraCoef.L4] + LORA_BASE[LoraCoef.L5] + path, rel=1e-12)
    # the game the library prices subsets with is the game written here
    costs = subset_costs_s(model, new, context, is_prefill, lora_name=names, lora_rank=lora.rank, lora_loads=step["loads"],
                           lora_disk_loads=step["disk_loads"])
    cost = adapter_game([LORA_BASE], None, new, context, is_prefill, names, step["loads"], step["disk_loads"])
    for mask in range(1 << new.size):
        assert costs[mask] == pytest.approx(cost({i for i in range(new.size) if mask >> i & 1}), rel=1e-12, abs=1e-15)


def test_the_wrong_rule_splitting_adapter_terms_over_the_whole_step_fails_the_brute_force_check():
    step = TWO_ADAPTERS
    args = (step["new"], step["context"], step["is_prefill"], step["names"], step["loads"], step["disk_loads"])
    wrong = wrong_rule_shares(LORA_BASE, *args)
    right = step_shapley_s(lora_model([LORA_BASE]).coef_, None, *args[:3], lora=step_lora(args[3], args[0], *args[4:]))
    assert wrong.sum() == pytest.approx(right.sum(), rel=1e-12)  # same total: only the split is wrong
    assert not matches_brute_force(wrong, [LORA_BASE], None, *args)
    assert matches_brute_force(right, [LORA_BASE], None, *args)


@st.composite
def adapter_steps(draw, max_batch=7):
    """A small batch: each slice runs the base model or one of three adapters, prefill or decode; the step's loads
    are some of its adapters, its disk loads some of the loads."""
    n = draw(st.integers(1, max_batch))
    names = draw(st.lists(st.sampled_from(["", "a", "b", "c"]), min_size=n, max_size=n))
    is_prefill = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    new = np.array([draw(st.integers(1, 600)) if pre else 1 for pre in is_prefill], dtype=np.int64)
    context = np.array(draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n)), dtype=np.int64)
    ran = sorted(set(names) - {""})
    loads = set(draw(st.lists(st.sampled_from(ran), unique=True))) if ran else set()
    disk = set(draw(st.lists(st.sampled_from(sorted(loads)), unique=True))) if loads else set()
    return names, new, context, is_prefill, loads, disk


@settings(max_examples=150, deadline=None)
@given(step=adapter_steps(), seed=st.integers(0, 2**32 - 1), two_segments=st.booleans())
def test_adapter_terms_split_among_their_requests_is_the_shapley_value_of_the_adapter_game(step, seed, two_segments):
    """Random coefficients; with two segments (the same per-adapter coefficients in both, as the game's exactness
    needs, the boundary anywhere between a slice's load and the batch's) subsets are priced in their own segment."""
    names, new, context, is_prefill, loads, disk = step
    rng = np.random.default_rng(seed)
    coef_sets = [LORA_BASE * rng.uniform(0.0, 5.0, size=LORA_BASE.size) for _ in range(2 if two_segments else 1)]
    boundary = None
    if two_segments:
        coef_sets[1][FIXED] = coef_sets[0][FIXED]
        boundary = float(rng.uniform(new.min(), new.sum() + 1))
    model = lora_model(coef_sets, boundary)
    lora = step_lora(names, new, loads, disk)
    phi = step_shapley_s(model.coef_, boundary, new, context, is_prefill, lora=lora)
    assert matches_brute_force(phi, coef_sets, boundary, new, context, is_prefill, names, loads, disk)
    cost = adapter_game(coef_sets, boundary, new, context, is_prefill, names, loads, disk)
    result = attribute_arrays(model, new, context, is_prefill, np.array([0, new.size]), None, "shapley", lora=lora)
    assert math.isclose(result.predicted_step_s[0], cost(set(range(new.size))), rel_tol=1e-12)
    costs = subset_costs_s(model, new, context, is_prefill, lora_name=names, lora_rank=lora.rank, lora_loads=loads,
                           lora_disk_loads=disk)
    for mask in range(1 << new.size):
        assert math.isclose(costs[mask], cost({i for i in range(new.size) if mask >> i & 1}), rel_tol=1e-12, abs_tol=1e-15)
    if phi.min() < 0:  # independent segments can make a slice's exact value negative; the rule clips it
        return
    np.testing.assert_allclose(result.share_s, phi, rtol=1e-9, atol=1e-15)
    online = StepAttributor(model).attribute(new.astype(float), context.astype(float), is_prefill, None, None, lora)
    np.testing.assert_allclose(online, phi, rtol=1e-9, atol=1e-15)
    # the wrong rule fails the same check whenever a base-model request shares a step with an adapter's
    if "" in names and set(names) - {""} and coef_sets[0][LoraCoef.L5] > 1e-6 and not two_segments:
        assert not matches_brute_force(wrong_rule_shares(coef_sets[0], new, context, is_prefill, names, loads, disk),
                                       coef_sets, boundary, new, context, is_prefill, names, loads, disk)


@settings(max_examples=100, deadline=None)
@given(step=adapter_steps(max_batch=40), measured=st.floats(1e-4, 10.0), rule=st.sampled_from(["shapley", "proportional"]))
def test_shares_with_adapters_are_nonnegative_and_sum_to_the_measured_time(step, measured, rule):
    names, new, context, is_prefill, loads, disk = step
    model = lora_model([LORA_BASE])
    lora = step_lora(names, new, loads, disk)
    result = attribute_arrays(model, new, context, is_prefill, np.array([0, new.size]), np.array([measured]), rule, lora=lora)
    assert (result.share_s >= 0).all()
    assert math.isclose(result.share_s.sum(), measured, rel_tol=1e-12)
    online = StepAttributor(model, rule).attribute(new.astype(float), context.astype(float), is_prefill, measured, None, lora)
    np.testing.assert_allclose(online, result.share_s, rtol=1e-9, atol=1e-15)


def lora_trace(n_steps=300, seed=5, **kwargs) -> StepTrace:
    return synthetic_trace(n_steps, max_batch_size=12, lora_ranks=DEFAULT_LORA_RANKS, lora_load_probability=0.3,
                           shared_prefix_fraction=0.3, noise=0.05, seed=seed, **kwargs)


@pytest.mark.parametrize("boundary", [None, 200.0])
def test_online_attributor_matches_offline_on_a_lora_trace_for_every_rule(boundary):
    rng = np.random.default_rng(3)
    coef_sets = [LORA_BASE * rng.uniform(0.5, 2.0, size=LORA_BASE.size) for _ in range(1 if boundary is None else 2)]
    model = lora_model(coef_sets, boundary)
    trace = lora_trace()
    lora = lora_slices_of(trace)
    assert lora is not None and lora.adapter_share.any() and lora.slot_load_share.any() and lora.disk_load_share.any()
    for rule in RULES:
        attributor = StepAttributor(model, rule)
        offline = attribute(model, trace, rule)
        for k in range(trace.n_steps):
            s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
            online = attributor.attribute(trace.num_new_tokens[s].astype(float), trace.num_context_tokens[s].astype(float),
                                          trace.is_prefill[s], float(trace.step_latency_s_per_step[k]),
                                          trace.effective_context_tokens[s], lora.take(s))
            np.testing.assert_allclose(online, offline.share_s[s], rtol=1e-9, atol=1e-15)
            predicted = attributor.predict_step_s(trace.num_new_tokens[s].astype(float), trace.num_context_tokens[s].astype(float),
                                                  trace.is_prefill[s], trace.effective_context_tokens[s], lora.take(s))
            assert predicted == pytest.approx(offline.predicted_step_s[k], rel=1e-9)
        if rule != "paper":
            assert offline.total_attributed_s == pytest.approx(trace.step_latency_s_per_step.sum(), rel=1e-12)
    np.testing.assert_allclose(model.predict(trace), attribute(model, trace).predicted_step_s, rtol=1e-12)


def test_a_lora_model_bills_a_trace_without_lora_columns_as_its_base_part_does():
    model = lora_model([LORA_BASE])
    base = StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES, LORA_BASE[:N_BASE]))])
    trace = synthetic_trace(200, shared_prefix_fraction=0.3, noise=0.05, seed=2)
    for rule in RULES:
        np.testing.assert_array_equal(attribute(model, trace, rule).share_s, attribute(base, trace, rule).share_s)
    np.testing.assert_array_equal(model.predict(trace), base.predict(trace))
    # and an adapter-blind (base) model ignores a trace's LoRA columns
    with_adapters = lora_trace()
    blind = attribute(base, with_adapters)
    stripped = StepTrace(**{**with_adapters.__dict__, "extra": {k: v for k, v in with_adapters.extra.items() if "lora" not in k}})
    np.testing.assert_array_equal(blind.share_s, attribute(base, stripped).share_s)


def test_a_rank_64_tenant_pays_more_than_a_base_tenant_with_the_same_tokens_by_what_the_model_says():
    """Two decode requests with the same context, one on a resident rank-64 adapter: the adapter's tenant pays its
    work (l3 + 64·l4), the adapter's kernels (l5) and the LoRA path's set-up (l8) more, on the model's prediction (the
    path's kernels over the base request's token are split in halves); a load of the adapter adds l6."""
    model = lora_model([LORA_BASE])
    new, context, prefill = np.array([1, 1]), np.array([700, 700]), np.array([False, False])
    for loads, load_price in (((), 0.0), (("c",), LORA_BASE[LoraCoef.L6])):
        shares = attribute_arrays(model, new, context, prefill, np.array([0, 2]), None, lora=step_lora(["c", ""], new, loads)).share_s
        expected = LORA_BASE[LoraCoef.L3] + 64 * LORA_BASE[LoraCoef.L4] + LORA_BASE[LoraCoef.L5] + LORA_BASE[LoraCoef.L8] + load_price
        assert shares[0] - shares[1] == pytest.approx(expected, rel=1e-12)


def test_an_adapters_load_goes_to_the_tenants_whose_requests_ran_it():
    model = lora_model([LORA_BASE])
    trace = lora_trace(n_steps=150, seed=8)
    loaded = model.coef_.copy()
    no_loads = model.coef_.copy()
    no_loads[:, [LoraCoef.L6, LoraCoef.L7]] = 0.0
    with_loads = attribute(model, trace, use_measured=False)
    without = attribute(StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES_LORA, no_loads[0]))]), trace, use_measured=False)
    load_bill = aggregate(trace, with_loads)
    base_bill = aggregate(trace, without)
    # the synthetic engine's tenants are drawn per request, independent of adapters: recompute who ran each load
    names = trace.extra["lora_name"]
    expected = dict.fromkeys(load_bill, 0.0)
    for k in range(trace.n_steps):
        s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
        step_names = names[s].tolist()
        for text, price in ((trace.extra["step_lora_loads"][s][0], loaded[0, LoraCoef.L6]),
                            (trace.extra["step_lora_disk_loads"][s][0], loaded[0, LoraCoef.L7])):
            for adapter in json.loads(text):
                runners = [i for i, a in enumerate(step_names) if a == adapter]
                for i in runners:
                    expected[trace.tenant[s][i]] += price / len(runners)
    assert sum(expected.values()) > 0
    for tenant in load_bill:
        assert load_bill[tenant] - base_bill[tenant] == pytest.approx(expected[tenant], rel=1e-9, abs=1e-12)
