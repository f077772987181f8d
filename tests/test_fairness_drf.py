"""DRF over engine time and KV memory-time (`DominantResourceCounter`, `FairShare.observe_memory`, ``cost = "drf"``),
engine-free: against VTC where memory is not charged, against DRF's allocation worked by hand, and the memory
charge against a brute-force sum of the pool readings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.policy import (
    POLICIES,
    DominantResourceCounter,
    FairnessConfig,
    FairShare,
    VirtualTokenCounter,
)


def fixed_model() -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([{n: DEFAULT_COEF_S[n] for n in FEATURE_NAMES}])


# ---------------------------------------------------------------------------------------------- config


def test_drf_is_a_cost_and_a_policy_and_needs_the_model():
    config = FairnessConfig.from_dict({"cost": "drf"})
    assert config.charges_memory and config.charges_attributed_time and config.needs_model
    assert not FairnessConfig.from_dict({"cost": "attributed"}).charges_memory
    assert not FairnessConfig.from_dict({"cost": "tokens"}).charges_attributed_time
    assert "drf" in POLICIES
    assert isinstance(FairShare(config, fixed_model()).vtc, DominantResourceCounter)
    assert type(FairShare(FairnessConfig(cost="attributed"), fixed_model()).vtc) is VirtualTokenCounter


def test_drf_with_shared_counters_and_an_unknown_cost_are_refused_naming_the_field():
    with pytest.raises(LlmvisorError, match=r'^fair.toml: shared_counters: not supported with cost = "drf"') as error:
        FairnessConfig.from_dict({"cost": "drf", "shared_counters": {"url": "redis://127.0.0.1:6379/0", "pool": "p"}}, source="fair.toml")
    assert "\n" not in str(error.value)
    with pytest.raises(LlmvisorError, match=r"^fair.toml: cost must be one of tokens, attributed, drf \(got 'dominant'\)$"):
        FairnessConfig.from_dict({"cost": "dominant"}, source="fair.toml")
    with pytest.raises(LlmvisorError, match="cost must be one of"):
        FairShare(FairnessConfig(cost="dominant"))  # a config built in code is checked too


# ---------------------------------------------------------------------------------------------- the counters


def test_dominant_share_is_the_larger_of_the_time_and_memory_shares_and_orders_admission():
    drf = DominantResourceCounter({"gold": 2.0})
    for tenant in ("hog", "cpu", "gold"):
        drf.arrive(tenant)
    drf.charge("hog", 1.0)  # 1 s of 10 s charged: time share 0.1
    drf.charge("cpu", 6.0)  # 0.6
    drf.charge("gold", 3.0)  # weighted: 1.5 / 10 = 0.15
    drf.charge_memory({"hog": 600.0, "cpu": 50.0, "gold": 100.0}, 1000.0)  # memory: 0.6, 0.05, 0.05
    assert drf.engine_s == 10.0 and drf.pool_block_ns == 1000.0
    assert drf.shares("hog") == pytest.approx((0.1, 0.6))
    assert drf.shares("gold") == pytest.approx((0.15, 0.05))
    assert drf.memory_served == {"hog": 600.0, "cpu": 50.0, "gold": 100.0}
    assert {t: drf.dominant_share(t) for t in ("hog", "cpu", "gold")} == pytest.approx({"hog": 0.6, "cpu": 0.6, "gold": 0.15})
    assert drf.lowest(["hog", "cpu", "gold"]) == "gold"
    assert drf.lowest(["hog", "cpu"]) == "hog"  # tied at 0.6: the tenant seen first
    drf.reserve("hog", 1.0)  # a reservation is engine seconds: time share (1 + 1) / 10 = 0.2 < 0.6
    assert drf.key("hog") == pytest.approx(0.6)
    drf.reserve("gold", 10.0)  # (3 + 10) / 2 / 10 = 0.65
    assert drf.lowest(["hog", "cpu", "gold"]) == "hog"


def test_returning_tenant_is_lifted_to_the_lowest_dominant_share_in_both_resources():
    drf = DominantResourceCounter()
    drf.arrive("a")
    drf.arrive("b")
    drf.charge("a", 2.0)
    drf.charge("b", 8.0)
    drf.charge_memory({"a": 500.0, "b": 100.0}, 1000.0)  # a: (0.2, 0.5) -> 0.5; b: (0.8, 0.1) -> 0.8
    drf.arrive("c")
    assert drf.num_lifts == 1
    assert drf.counter["c"] == pytest.approx(0.5 * 10.0) and drf.memory["c"] == pytest.approx(0.5 * 1000.0)
    assert drf.dominant_share("c") == pytest.approx(0.5)
    assert drf.served["c"] == 0.0 and drf.memory_served["c"] == 0.0  # a lift is no service
    # a tenant above the floor in one resource keeps it, and is raised in the other only to the floor
    drf.leave("c")
    drf.charge("c", 10.0)  # c: (15 / 20, 500 / 1000)
    drf.arrive("c")
    assert drf.counter["c"] == pytest.approx(15.0) and drf.memory["c"] == pytest.approx(500.0)
    # with no one backlogged, the floor is the last tenant to leave, at its counters when it left, as shares now
    for tenant in ("a", "b", "c"):
        drf.leave(tenant)
    drf.charge_memory({}, 1000.0)  # time passes with nothing held
    drf.arrive("d")
    departed = max(drf.counter["c"] / drf.engine_s, drf.memory["c"] / drf.pool_block_ns)
    assert drf.dominant_share("d") == pytest.approx(departed)


events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "leave", "charge", "reserve", "clear", "requeue"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(1, 40).map(lambda n: n / 4),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(events=events, weights=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 2.0])))
def test_with_no_memory_charged_drf_decides_exactly_as_vtc(events, weights):
    """One resource: DRF's dominant share is VTC's counter over a capacity every tenant shares, so the same events
    give the same lowest tenant, lifts and service at every point."""
    vtc, drf = VirtualTokenCounter(weights), DominantResourceCounter(weights)
    for action, tenant, amount in events:
        for counter in (vtc, drf):
            if action == "arrive":
                counter.arrive(tenant)
            elif action == "requeue":
                counter.requeue(tenant)
            elif action == "leave":
                if counter.backlog.get(tenant, 0) > 0:
                    counter.leave(tenant)
            elif action == "charge":
                counter.charge(tenant, amount)
            elif action == "reserve":
                counter.reserve(tenant, amount)
            else:
                counter.clear_reservations()
        assert drf.lowest(["a", "b", "c"]) == vtc.lowest(["a", "b", "c"])
        assert drf.lowest(drf.backlogged()) == vtc.lowest(vtc.backlogged())
        assert drf.num_lifts == vtc.num_lifts
        assert drf.served == vtc.served
        assert drf.counter == pytest.approx(vtc.counter, rel=1e-9, abs=1e-9)


def serve(counter, demands: dict[str, tuple[float, float]], pool_blocks: float, n_requests: int) -> dict[str, int]:
    """Every tenant backlogged; the lowest is served next, one request at a time on a serial engine: a request of
    tenant t takes demands[t][0] engine seconds (wall time too) and holds demands[t][1] block-seconds."""
    served = dict.fromkeys(demands, 0)
    for tenant in demands:
        counter.arrive(tenant)
    for _ in range(n_requests):
        tenant = counter.lowest(list(demands))
        seconds, block_s = demands[tenant]
        counter.charge(tenant, seconds)
        if isinstance(counter, DominantResourceCounter):
            counter.charge_memory({tenant: block_s}, pool_blocks * seconds)
        served[tenant] += 1
    return served


def test_drf_serves_the_allocation_worked_by_hand_where_time_only_vtc_does_not():
    """DRF's own example, as engine time and KV memory: A's request takes 1 s and holds 4 block-s, B's takes 3 s and
    holds 1 block-s, on a 2-block pool. A's dominant resource is memory (4/2 per request against 1), B's is time.
    Equal dominant shares: 4/2·x_A = 3·x_B, so A gets 1.5 requests per B request (memory used 7 of 9 block-s per
    B request); time-only VTC equalises time, 1·x_A = 3·x_B, and gives A 3 per B, more memory than the pool has."""
    demands = {"A": (1.0, 4.0), "B": (3.0, 1.0)}
    drf = serve(DominantResourceCounter(), demands, pool_blocks=2.0, n_requests=2000)
    assert drf["A"] / drf["B"] == pytest.approx(1.5, rel=0.01)
    vtc = serve(VirtualTokenCounter(), demands, pool_blocks=2.0, n_requests=2000)
    assert vtc["A"] / vtc["B"] == pytest.approx(3.0, rel=0.01)


@settings(max_examples=80, deadline=None)
@given(
    demands=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 80)), min_size=2, max_size=4),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=4, max_size=4),
    pool_blocks=st.integers(1, 16),
)
def test_backlogged_tenants_dominant_shares_stay_within_one_request_of_each_other(demands, weights, pool_blocks):
    """DRF's bound, as VTC's: serving the lowest dominant share next keeps every pair of backlogged tenants within
    one request's dominant share (its largest, over weight) of each other. On a serial engine both capacities
    grow with the engine seconds, so the bound holds in units of capacity at every point."""
    tenants = {f"t{k}": (float(s), float(b)) for k, (s, b) in enumerate(demands)}
    weight = dict(zip(tenants, weights))
    drf = DominantResourceCounter(weight)
    serve(drf, tenants, float(pool_blocks), 0)
    largest = max(max(s / drf.weight(t), b / pool_blocks / drf.weight(t)) for t, (s, b) in tenants.items())
    for _ in range(200):
        serve_one = drf.lowest(list(tenants))
        seconds, block_s = tenants[serve_one]
        drf.charge(serve_one, seconds)
        drf.charge_memory({serve_one: block_s}, pool_blocks * seconds)
        shares = [drf.dominant_share(t) * drf.engine_s for t in tenants]  # in engine seconds: capacity-free
        assert max(shares) - min(shares) <= largest + 1e-9


# ---------------------------------------------------------------------------------------------- memory readings


readings = st.lists(
    st.tuples(st.integers(0, 10_000), st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 64), max_size=3)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(readings=readings, pool_blocks=st.integers(64 * 3, 400))
def test_observe_memory_charges_each_reading_for_the_time_until_the_next(readings, pool_blocks):
    """Per tenant, Σ its blocks in a reading × the time to the next reading; the capacity is the pool × the time
    from the first reading to the last (integers: exact)."""
    fair = FairShare(FairnessConfig(cost="drf"), fixed_model())
    now = 1_000_000
    times = []
    for gap, blocks in readings:
        now += gap
        times.append(now)
        fair.observe_memory(now, {t: float(b) for t, b in blocks.items()}, pool_blocks)
    expected: dict[str, float] = {}
    for (t0, (_, blocks)), t1 in zip(zip(times, readings), times[1:]):
        for tenant, b in blocks.items():
            expected[tenant] = expected.get(tenant, 0.0) + b * (t1 - t0)
    drf = fair.vtc
    assert {t: v for t, v in drf.memory_served.items() if v} == {t: v for t, v in expected.items() if v}
    assert drf.pool_block_ns == pool_blocks * (times[-1] - times[0])
    assert drf.engine_s == 0.0


def test_observe_memory_is_a_no_op_for_vtc_and_feeds_the_choice_under_drf():
    vtc = FairShare(FairnessConfig(cost="attributed"), fixed_model())
    vtc.observe_memory(0, {"a": 4.0}, 8)
    vtc.observe_memory(10, {}, 8)
    assert not hasattr(vtc.vtc, "memory")
    fair = FairShare(FairnessConfig(cost="drf"), fixed_model())
    for tenant in ("hog", "chat"):
        fair.arrive(tenant)
    fair.vtc.charge("hog", 1.0)
    fair.vtc.charge("chat", 3.0)  # time: hog 0.25, chat 0.75; VTC alone would pick hog
    assert fair.choose(["hog", "chat"], 0.0) == "hog"
    fair.observe_memory(0, {"hog": 7.0, "chat": 1.0}, 8)
    fair.observe_memory(1_000, {}, 8)  # hog held 7 of 8 blocks: memory share 0.875
    assert fair.vtc.shares("hog") == pytest.approx((0.25, 0.875))
    assert fair.choose(["hog", "chat"], 0.0) == "chat"
