"""Charging a step when it is scheduled and correcting it when its output arrives (`FairShare.charge_scheduled`
then `charge_step(..., charged_when_scheduled=...)`), as under async scheduling with a batch queue: the counters
seen by each pass include every step scheduled before it, and end where charging measured steps alone ends."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.attribution import StepAttributor
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.fairness.policy import FairnessConfig, FairShare, Quota

MODEL = StepLatencyModel.from_coefficients([{name: DEFAULT_COEF_S[name] for name in FEATURE_NAMES}])
TENANTS = ["a", "b", "c"]
WEIGHTS = {"b": 2.0}

slice_strategy = st.tuples(st.sampled_from(TENANTS), st.integers(0, 3000), st.booleans(), st.integers(1, 256))
step_strategy = st.tuples(st.lists(slice_strategy, min_size=1, max_size=8), st.floats(1e-3, 0.5))


def arrays(batch):
    tenants = [t for t, *_ in batch]
    c = np.array([ctx for _, ctx, _, _ in batch], dtype=np.float64)
    prefill = np.array([pre for _, _, pre, _ in batch])
    p = np.where(prefill, [n for *_, n in batch], 1).astype(np.float64)
    return tenants, p, c, prefill, np.ones(len(batch), bool)


def make_share(cost: str) -> FairShare:
    config = FairnessConfig(cost=cost, weights=WEIGHTS, quotas={"a": Quota(budget_s=1.0, window_s=3600)})
    return FairShare(config, MODEL)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(step_strategy, min_size=1, max_size=12), depth=st.integers(1, 3), cost=st.sampled_from(["attributed", "tokens"]))
def test_each_pass_sees_every_scheduled_step_and_the_counters_end_at_the_measured_charges(steps, depth, cost):
    """A batch queue of ``depth``: step k+depth is scheduled before step k's output arrives."""
    queued = make_share(cost)
    measured_only = make_share(cost)  # today's charging: each step once, measured, in output order
    in_flight: deque = deque()
    predicted_in_flight: dict[str, float] = {}

    def settle():
        (tenants, p, c, prefill, samples), measured_s, charged = in_flight.popleft()
        step = queued.charge_step(tenants, p, c, prefill, samples, measured_s, 1.0, charged_when_scheduled=charged)
        reference = measured_only.charge_step(tenants, p, c, prefill, samples, measured_s, 1.0)
        assert step == reference
        for tenant, cost_units in charged.items():
            predicted_in_flight[tenant] -= cost_units / queued.vtc.weight(tenant)

    for batch, measured_s in steps:
        if len(in_flight) == depth:
            settle()
        # what the next pass sees: every settled step measured, every step still in flight at its prediction
        for tenant in TENANTS:
            expected = measured_only.vtc.counter.get(tenant, 0.0) + predicted_in_flight.get(tenant, 0.0)
            assert queued.vtc.counter.get(tenant, 0.0) == pytest.approx(expected, rel=1e-9, abs=1e-12)
        queued.vtc.reserve(batch[0][0], 5.0)  # this pass's admission reserves; the step's charge replaces it
        step = arrays(batch)
        charged = queued.charge_scheduled(*step)
        assert queued.vtc.reserved == {}
        if cost == "attributed":
            predicted = StepAttributor(MODEL).attribute(*step[1:4]).copy()
            assert math.fsum(charged.values()) == pytest.approx(math.fsum(predicted), rel=1e-12)
            assert math.fsum(predicted) == pytest.approx(StepAttributor(MODEL).predict_step_s(*step[1:4]), rel=1e-9)
        else:
            tokens = measured_only.tokens.slice_costs(step[1], step[3], step[4])
            assert charged == {t: math.fsum(x for u, x in zip(step[0], tokens) if u == t) for t in set(step[0])}
        for tenant, cost_units in charged.items():
            predicted_in_flight[tenant] = predicted_in_flight.get(tenant, 0.0) + cost_units / queued.vtc.weight(tenant)
        in_flight.append((step, measured_s, charged))
    while in_flight:
        settle()
    for tenant in TENANTS:
        want_counter = measured_only.vtc.counter.get(tenant, 0.0)
        want_served = measured_only.vtc.served.get(tenant, 0.0)
        if cost == "tokens":  # the token cost is known when the step is scheduled: nothing to correct
            assert queued.vtc.counter.get(tenant, 0.0) == want_counter
            assert queued.vtc.served.get(tenant, 0.0) == want_served
        else:
            assert queued.vtc.counter.get(tenant, 0.0) == pytest.approx(want_counter, rel=1e-9, abs=1e-12)
            assert queued.vtc.served.get(tenant, 0.0) == pytest.approx(want_served, rel=1e-9, abs=1e-12)
    # quotas and attributed seconds are charged measured, when the output arrives, exactly as before
    assert queued.attributed_s == measured_only.attributed_s
    assert queued.quota_of("a").used_s(1.0) == measured_only.quota_of("a").used_s(1.0)
    assert math.fsum(queued.attributed_s.values()) == pytest.approx(math.fsum(m for _, m in steps), rel=1e-9)


def test_a_scheduled_step_is_charged_its_predicted_shares_and_corrected_to_its_measured_ones():
    share = make_share("attributed")
    tenants, p, c, prefill, samples = ["a", "b", "a"], np.array([512.0, 1.0, 1.0]), np.array([0.0, 900.0, 40.0]), np.array([True, False, False]), np.ones(3, bool)
    predicted = StepAttributor(MODEL).attribute(p, c, prefill).copy()
    charged = share.charge_scheduled(tenants, p, c, prefill, samples)
    assert charged == pytest.approx({"a": predicted[0] + predicted[2], "b": predicted[1]}, rel=1e-12)
    assert share.vtc.counter == pytest.approx({"a": charged["a"], "b": charged["b"] / 2.0}, rel=1e-12)
    assert share.attributed_s == {}  # quotas and attributed seconds wait for the measured time
    measured_s = 3 * math.fsum(predicted)  # the step ran three times slower than predicted
    step = share.charge_step(tenants, p, c, prefill, samples, measured_s, 0.0, charged_when_scheduled=charged)
    assert step.cost == pytest.approx({tenant: 3 * cost for tenant, cost in charged.items()}, rel=1e-9)
    assert share.vtc.counter == pytest.approx({"a": step.cost["a"], "b": step.cost["b"] / 2.0}, rel=1e-9)
    assert share.attributed_s == pytest.approx(step.cost, rel=1e-12)
