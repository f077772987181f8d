"""Attribution rules: nonnegative, conserving, equal to the exact Shapley value of the model's cost game."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmvisor.core.attribution import (
    RULES,
    AttributionRule,
    StepAttributor,
    aggregate,
    attribute,
    attribute_arrays,
    parse_rule,
    step_shapley_s,
    subset_costs_s,
)
from llmvisor.core.features import FEATURE_NAMES, slice_feature_matrix
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.core.trace import StepTrace, sharing_columns_from_blocks
from llmvisor.errors import LlmvisorError


def fixed_model(coef_sets, boundary=None) -> StepLatencyModel:
    """A model with given coefficients, loaded the way a model file is."""
    return StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES, c)) for c in coef_sets], boundary)


BASE = [DEFAULT_COEF_S[n] for n in FEATURE_NAMES]
HEAVY = [c * 3 for c in BASE]


@st.composite
def steps(draw, max_batch=8):
    batch = draw(st.integers(1, max_batch))
    is_prefill = np.array(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    new = np.array([draw(st.integers(1, 2048)) if pre else 1 for pre in is_prefill], dtype=np.int64)
    context = np.array(draw(st.lists(st.integers(0, 8192), min_size=batch, max_size=batch)), dtype=np.int64)
    measured = draw(st.floats(1e-4, 10.0, allow_nan=False))
    return new, context, is_prefill, measured


coefficient_sets = st.lists(st.floats(-1e-3, 1e-2, allow_nan=False), min_size=len(FEATURE_NAMES), max_size=len(FEATURE_NAMES))


SUBNORMAL_COEF = [0.0] * (len(FEATURE_NAMES) - 1) + [5e-324]
"""A model whose only price is the smallest float: a step's basis is subnormal (hypothesis found shares of inf/nan)."""


@settings(max_examples=300, deadline=None)
@given(step=steps(max_batch=64), coef=coefficient_sets, rule=st.sampled_from(["shapley", "proportional"]))
@example(step=(np.array([1, 1]), np.array([0, 1]), np.array([False, False]), 1.0), coef=SUBNORMAL_COEF, rule="shapley")
@example(step=(np.array([1]), np.array([1]), np.array([False]), 1.0), coef=SUBNORMAL_COEF, rule="shapley")
@example(step=(np.array([3, 1]), np.array([0, 9]), np.array([True, False]), 0.5), coef=SUBNORMAL_COEF, rule="proportional")
def test_shares_are_nonnegative_and_sum_to_the_measured_time(step, coef, rule):
    new, context, is_prefill, measured = step
    model = fixed_model([coef])
    result = attribute_arrays(model, new, context, is_prefill, np.array([0, len(new)]), np.array([measured]), rule)
    assert (result.share_s >= 0).all()
    assert math.isclose(result.share_s.sum(), measured, rel_tol=1e-12)
    online = StepAttributor(model, rule).attribute(new.astype(float), context.astype(float), is_prefill, measured)
    np.testing.assert_allclose(online, result.share_s, rtol=1e-9, atol=1e-15)


def exact_shapley(values_of_subsets, n):
    phi = np.zeros(n)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for size in range(n):
            for subset in itertools.combinations(others, size):
                weight = math.factorial(size) * math.factorial(n - size - 1) / math.factorial(n)
                phi[i] += weight * (values_of_subsets(set(subset) | {i}) - values_of_subsets(set(subset)))
    return phi


@settings(max_examples=60, deadline=None)
@given(step=steps(max_batch=6), boundary=st.floats(2.0, 2500.0))
def test_shapley_rule_is_the_exact_shapley_value_of_the_models_cost_game(step, boundary):
    """The game: v(S) = the model's time of a step running S alone, priced in S's own segment."""
    new, context, is_prefill, _ = step
    model = fixed_model([BASE, HEAVY], boundary=boundary)

    def cost(subset):
        if not subset:
            return 0.0
        members = sorted(subset)
        coef = np.array(HEAVY if new[members].sum() >= boundary else BASE)
        return coef[0] + float((slice_feature_matrix(new[members], context[members], is_prefill[members]) @ coef).sum())

    expected = exact_shapley(cost, len(new))
    predicted = attribute_arrays(model, new, context, is_prefill, np.array([0, len(new)]), None, "shapley")
    np.testing.assert_allclose(predicted.share_s, expected, rtol=1e-9)
    assert math.isclose(predicted.share_s.sum(), predicted.predicted_step_s[0], rel_tol=1e-12)


@st.composite
def straddling_steps(draw):
    """Batches of up to 9 slices with repeated loads (decodes all run 1 token) and a boundary between the
    smallest slice's load and the batch's, so subsets fall on both sides of it."""
    n_decode = draw(st.integers(0, 6))
    prefill_new = draw(st.lists(st.sampled_from([3, 5, 40, 200, 1000]), min_size=0 if n_decode >= 2 else 1, max_size=3))
    new = np.array([1] * n_decode + prefill_new, dtype=np.int64)
    is_prefill = np.array([False] * n_decode + [True] * len(prefill_new))
    context = np.array(draw(st.lists(st.integers(0, 4096), min_size=new.size, max_size=new.size)), dtype=np.int64)
    low, high = int(new.min()), int(new.sum())
    boundary = draw(st.floats(low + 0.5, high, exclude_max=False)) if high > low else float(high)
    return new, context, is_prefill, boundary


@settings(max_examples=120, deadline=None)
@given(step=straddling_steps(), seed=st.integers(0, 2**32 - 1))
def test_two_segment_shapley_matches_brute_force_over_every_subset(step, seed):
    """Random independent coefficient sets (a segment may be cheaper in some terms than the other), batches
    straddling the boundary: step_shapley_s against Shapley's formula over all 2^n subsets of v = subset_costs_s."""
    new, context, is_prefill, boundary = step
    rng = np.random.default_rng(seed)
    coef_sets = [np.array(BASE) * rng.uniform(0.2, 5.0, size=len(BASE)) for _ in range(2)]
    model = fixed_model(coef_sets, boundary=boundary)
    costs = subset_costs_s(model, new, context, is_prefill)
    n = new.size
    expected = exact_shapley(lambda subset: costs[sum(1 << j for j in subset)], n)
    phi = step_shapley_s(model.coef_, model.boundary_, new, context, is_prefill)
    np.testing.assert_allclose(phi, expected, rtol=1e-9, atol=1e-15)
    assert math.isclose(phi.sum(), costs[-1], rel_tol=1e-12)
    online = StepAttributor(model).attribute(new.astype(float), context.astype(float), is_prefill)
    np.testing.assert_allclose(online, np.maximum(expected, 0) * costs[-1] / np.maximum(expected, 0).sum(), rtol=1e-9)


def test_subset_costs_price_each_subset_in_its_own_segment():
    model = fixed_model([BASE, HEAVY], boundary=100.0)
    new, context, prefill = np.array([80, 60]), np.array([0, 0]), np.array([True, True])
    costs = subset_costs_s(model, new, context, prefill)
    alone = [model.predict(trace_of(new[[i]], context[[i]], prefill[[i]]))[0] for i in range(2)]
    assert costs[0] == 0.0
    assert costs[1] == pytest.approx(alone[0]) and costs[2] == pytest.approx(alone[1])
    assert costs[3] == pytest.approx(model.predict(trace_of(new, context, prefill))[0])
    own_heavy = slice_feature_matrix(new, context, prefill) @ np.array(HEAVY)
    assert costs[1] < HEAVY[0] + own_heavy[0]


def trace_of(new, context, prefill) -> StepTrace:
    n = len(new)
    return StepTrace(
        run_id=np.full(n, "r", dtype=object),
        step_id=np.zeros(n, dtype=np.int64),
        step_latency_s=np.ones(n),
        request_id=np.array([f"q{i}" for i in range(n)], dtype=object),
        tenant=np.full(n, "t", dtype=object),
        num_new_tokens=np.asarray(new, dtype=np.int64),
        num_context_tokens=np.asarray(context, dtype=np.int64),
        is_prefill=np.asarray(prefill, dtype=bool),
        step_offsets=np.array([0, n]),
    )


def test_paper_rule_leaves_the_intercept_and_residual_unattributed():
    model = fixed_model([BASE])
    trace = synthetic_trace(200, seed=3, noise=0.1)
    paper = attribute(model, trace, "paper")
    np.testing.assert_allclose(paper.share_s, paper.own_s)
    unattributed = trace.step_latency_s_per_step.sum() - paper.total_attributed_s
    assert unattributed > trace.n_steps * BASE[0] * 0.5
    shapley = attribute(model, trace, "shapley")
    assert math.isclose(shapley.total_attributed_s, trace.step_latency_s_per_step.sum(), rel_tol=1e-12)


def test_rules_differ_in_how_the_intercept_is_split():
    model = fixed_model([BASE])
    new = np.array([1000, 1])
    context = np.array([0, 100])
    prefill = np.array([True, False])
    offsets = np.array([0, 2])
    shapley = attribute_arrays(model, new, context, prefill, offsets, None, "shapley").share_s
    proportional = attribute_arrays(model, new, context, prefill, offsets, None, "proportional").share_s
    assert shapley.sum() == pytest.approx(proportional.sum())
    assert shapley[1] > proportional[1]
    own = slice_feature_matrix(new, context, prefill) @ np.array(BASE)
    assert shapley[1] == pytest.approx(own[1] + BASE[0] / 2)


def test_online_attributor_matches_offline_on_every_rule_and_segment():
    model = fixed_model([BASE, HEAVY], boundary=200.0)
    trace = synthetic_trace(300, seed=5)
    for rule in RULES:
        attributor = StepAttributor(model, rule)
        offline = attribute(model, trace, rule)
        for k in range(trace.n_steps):
            s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
            online = attributor.attribute(
                trace.num_new_tokens[s].astype(float),
                trace.num_context_tokens[s].astype(float),
                trace.is_prefill[s],
                float(trace.step_latency_s_per_step[k]),
            )
            np.testing.assert_allclose(online, offline.share_s[s], rtol=1e-9)
        steps_predicted = [
            attributor.predict_step_s(
                trace.num_new_tokens[trace.step_offsets[k] : trace.step_offsets[k + 1]].astype(float),
                trace.num_context_tokens[trace.step_offsets[k] : trace.step_offsets[k + 1]].astype(float),
                trace.is_prefill[trace.step_offsets[k] : trace.step_offsets[k + 1]],
            )
            for k in range(trace.n_steps)
        ]
        np.testing.assert_allclose(steps_predicted, model.predict(trace), rtol=1e-9)


def test_aggregate_by_tenant_and_request_conserves_the_total():
    model = StepLatencyModel(segments="none").fit(synthetic_trace(500, seed=1))
    trace = synthetic_trace(300, seed=2, n_tenants=3)
    result = attribute(model, trace)
    by_tenant = aggregate(trace, result, "tenant")
    by_request = aggregate(trace, result, "request")
    assert set(by_tenant) == set(trace.tenant.tolist())
    assert len(by_request) == trace.n_slices
    assert sum(by_tenant.values()) == pytest.approx(trace.step_latency_s_per_step.sum(), rel=1e-12)
    assert sum(by_request.values()) == pytest.approx(trace.step_latency_s_per_step.sum(), rel=1e-12)
    with pytest.raises(LlmvisorError, match="unknown grouping"):
        aggregate(trace, result, "model")
    with pytest.raises(LlmvisorError, match="unknown attribution rule"):
        attribute(model, trace, "fair")


def test_own_terms_are_the_slice_features_times_the_named_coefficients():
    from llmvisor.core.features import COEF_FEATURE, Coef, own_terms_s

    rng = np.random.default_rng(0)
    new, context = rng.integers(1, 500, 50), rng.integers(0, 4000, 50)
    prefill = rng.random(50) < 0.5
    new[~prefill] = 1
    coef = rng.random(len(FEATURE_NAMES))
    np.testing.assert_allclose(own_terms_s(coef, new, context, prefill), slice_feature_matrix(new, context, prefill) @ coef)
    assert COEF_FEATURE[Coef.A4] == "prefill_requests" and COEF_FEATURE[Coef.D2] == "decode_context_tokens"


def test_rules_parse_from_their_names_and_unknown_names_are_one_line_errors():
    assert [parse_rule(name) for name in RULES] == list(AttributionRule)
    assert parse_rule("shapley") is AttributionRule.SHAPLEY == "shapley"
    with pytest.raises(LlmvisorError, match="unknown attribution rule 'fair'"):
        parse_rule("fair")


def test_equal_splits_are_counted_offline_and_online():
    """An OLS model can predict ≤ 0 for every request of a step; the step is then split equally, and counted."""
    negative = [-1e-3] + [0.0] * (len(FEATURE_NAMES) - 1)
    model = fixed_model([negative])
    trace = synthetic_trace(20, seed=1)
    result = attribute(model, trace, "shapley")
    assert result.n_equal_split == trace.n_steps
    np.testing.assert_allclose(result.share_s, np.repeat(trace.step_latency_s_per_step / trace.batch_size_per_step, trace.batch_size_per_step))
    assert attribute(fixed_model([BASE]), trace).n_equal_split == 0
    online = StepAttributor(model)
    for k in range(3):
        s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
        online.attribute(trace.num_new_tokens[s].astype(float), trace.num_context_tokens[s].astype(float), trace.is_prefill[s], 0.1)
    assert online.n_equal_split == 3


# ---------------------------------------------------------------------------------------------------------
# Shared KV blocks (trace format v2)

SHARING_BASE = dict(DEFAULT_COEF_S, effective_context_tokens=1e-7)
E = FEATURE_NAMES.index("effective_context_tokens")


@st.composite
def sharing_structures(draw, max_batch=6):
    """A small batch whose slices read KV blocks (random sizes, random reader sets) plus private context."""
    n = draw(st.integers(1, max_batch))
    is_prefill = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    new = np.array([draw(st.integers(1, 600)) if pre else 1 for pre in is_prefill], dtype=np.int64)
    private = np.array(draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n)), dtype=np.int64)
    blocks = draw(
        st.lists(
            st.tuples(st.integers(1, 512), st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)),
            max_size=6,
        )
    )
    return new, private, is_prefill, blocks


def columns_from_structure(private, blocks):
    """num_context_tokens and the v2 columns by their definition, block by block (independent of llmvisor)."""
    n = private.size
    context = private.astype(np.int64).copy()
    shared = np.zeros(n, dtype=np.int64)
    effective = private.astype(np.float64).copy()
    for tokens, readers in blocks:
        for i in readers:
            context[i] += tokens
            effective[i] += tokens / len(readers)
            if len(readers) > 1:
                shared[i] += tokens
    return context, shared, effective


def block_game(coef_sets, boundary, new, private, is_prefill, blocks):
    """v(S) on the block structure: intercept, the own terms without the effective-context part, and each block's
    tokens priced once if any member of S reads it; in S's own segment."""
    context, _, _ = columns_from_structure(private, blocks)

    def cost(subset):
        if not subset:
            return 0.0
        members = sorted(subset)
        coef = np.array(coef_sets[0 if boundary is None or new[members].sum() < boundary else 1])
        x = slice_feature_matrix(new[members], context[members], is_prefill[members])
        per_request = float((x[:, :E] @ coef[:E]).sum())
        distinct = private[members].sum() + sum(tokens for tokens, readers in blocks if set(readers) & subset)
        return coef[0] + per_request + coef[E] * distinct

    return cost


@settings(max_examples=150, deadline=None)
@given(structure=sharing_structures(), seed=st.integers(0, 2**32 - 1), two_segments=st.booleans())
def test_shared_blocks_split_equally_is_the_shapley_value_of_the_block_game(structure, seed, two_segments):
    """Brute-force Shapley over every subset of the game on the block structure equals the shares computed from
    the per-slice v2 columns; with two segments (same effective-context coefficient) subsets are priced in their
    own segment, the boundary anywhere between a single slice's load and the batch's."""
    new, private, is_prefill, blocks = structure
    rng = np.random.default_rng(seed)
    base = np.array([SHARING_BASE[n] for n in FEATURE_NAMES])
    coef_sets = [base * rng.uniform(0.0, 5.0, size=base.size) for _ in range(2 if two_segments else 1)]
    boundary = None
    if two_segments:
        coef_sets[1][E] = coef_sets[0][E]
        boundary = float(rng.uniform(new.min(), new.sum() + 1))
    context, shared, effective = columns_from_structure(private, blocks)
    library_shared, library_effective = sharing_columns_from_blocks(context, blocks)
    np.testing.assert_array_equal(library_shared, shared)
    np.testing.assert_allclose(library_effective, effective, rtol=1e-12)

    model = fixed_model(coef_sets, boundary)
    cost = block_game(coef_sets, boundary, new, private, is_prefill, blocks)
    expected = exact_shapley(cost, new.size)
    phi = step_shapley_s(model.coef_, boundary, new, context, is_prefill, effective)
    np.testing.assert_allclose(phi, expected, rtol=1e-9, atol=1e-15)
    result = attribute_arrays(model, new, context, is_prefill, np.array([0, new.size]), None, "shapley", effective)
    assert math.isclose(result.predicted_step_s[0], cost(set(range(new.size))), rel_tol=1e-12)
    shared_blocks = [(t, r) for t, r in blocks if len(r) > 1]
    costs = subset_costs_s(model, new, context, is_prefill, shared_blocks)
    for mask in range(1 << new.size):
        members = {i for i in range(new.size) if mask >> i & 1}
        assert math.isclose(costs[mask], cost(members), rel_tol=1e-12, abs_tol=1e-15)

    if expected.min() < 0:  # independent segments can make a slice's exact value negative; the rule clips it
        return
    np.testing.assert_allclose(result.share_s, expected, rtol=1e-9, atol=1e-15)
    online = StepAttributor(model).attribute(new.astype(float), context.astype(float), is_prefill, None, effective)
    np.testing.assert_allclose(online, expected, rtol=1e-9, atol=1e-15)


def test_a_shared_prefix_decode_batch_bills_the_measured_step_with_equal_shares_of_the_prefix():
    """16 decodes over a cached 1,616-token prompt (101 blocks of 16) plus a private tail each, measured 17 ms."""
    model = fixed_model([[SHARING_BASE[n] for n in FEATURE_NAMES]])
    coef = model.coef_[0]
    n, prefix = 16, 1616
    tail = np.arange(n, dtype=np.int64) * 5 + 7
    context = prefix + tail
    new, is_prefill = np.ones(n, dtype=np.int64), np.zeros(n, dtype=bool)
    effective = tail + prefix / n
    measured_s = 0.017
    shares = attribute_arrays(model, new, context, is_prefill, np.array([0, n]), np.array([measured_s]), "shapley", effective)
    assert math.isclose(shares.share_s.sum(), measured_s, rel_tol=1e-12)
    scale = measured_s / shares.predicted_step_s[0]
    outside_prefix = scale * (coef[FEATURE_NAMES.index("decode_context_tokens")] * context + coef[FEATURE_NAMES.index("decode_requests")] + coef[E] * tail + coef[0] / n)
    prefix_share = shares.share_s - outside_prefix
    np.testing.assert_allclose(prefix_share, scale * coef[E] * prefix / n, rtol=1e-9)
    online = StepAttributor(model).attribute(new.astype(float), context.astype(float), is_prefill, measured_s, effective.astype(float))
    np.testing.assert_allclose(online, shares.share_s, rtol=1e-12)
    unshared = attribute_arrays(model, new, context, is_prefill, np.array([0, n]), None, "shapley")
    assert unshared.predicted_step_s[0] - shares.predicted_step_s[0] == pytest.approx(coef[E] * prefix * (n - 1))


def test_attribute_reads_the_sharing_columns_of_a_v2_trace():
    trace = synthetic_trace(200, coef_s=SHARING_BASE, shared_prefix_fraction=0.6, max_batch_size=12, seed=9)
    assert trace.has_shared_context_per_step.any()
    model = fixed_model([[SHARING_BASE[n] for n in FEATURE_NAMES]])
    result = attribute(model, trace, use_measured=False)
    np.testing.assert_allclose(result.predicted_step_s, trace.step_latency_s_per_step, rtol=1e-12)
    manual = attribute_arrays(
        model, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets, None, "shapley", trace.effective_context_tokens
    )
    np.testing.assert_array_equal(result.share_s, manual.share_s)
