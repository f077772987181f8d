"""The fair scheduler charges adapters (issue #38 item 6): with a LoRA model, a step's ``LoraSlices`` go into the
counters' attribution, so a tenant on a rank-64 adapter is charged its adapter's work, kernels and loads, the amounts
the model's coefficients say, and a base-model tenant with the same tokens is not; at schedule time and when the step
ran alike (VTC's attributed cost and DRF's time counter). Without adapters nothing changes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from _lora_runs import lora_model
from llmvisor.core.attribution import StepAttributor
from llmvisor.core.features import LoraCoef, lora_slices
from llmvisor.fairness.policy import FairnessConfig, FairShare

RANK = 64


def twin_step(loaded: bool, prefill: bool = False):
    """Two requests with the same tokens, one of tenant "lora" on a rank-64 adapter, one of "base"."""
    tenants = ["lora", "base"]
    p = np.array([300.0, 300.0]) if prefill else np.ones(2)
    c = np.array([900.0, 900.0])
    is_prefill = np.array([prefill, prefill])
    loads = [frozenset({"r64"}) if loaded else frozenset()]
    lora = lora_slices(["r64", ""], [RANK, 0], np.array([0, 2]), loads, [frozenset()], num_new_tokens=p)
    return tenants, p, c, is_prefill, lora


@pytest.mark.parametrize("cost", ["attributed", "drf"])
@pytest.mark.parametrize("loaded, prefill", [(False, False), (True, False), (False, True)])
def test_a_rank_64_tenant_is_charged_its_adapters_terms_and_a_base_tenant_is_not(cost, loaded, prefill):
    model = lora_model()
    coef = model.coef_[0]
    tenants, p, c, is_prefill, lora = twin_step(loaded, prefill)
    measured = StepAttributor(model).predict_step_s(p, c, is_prefill, None, lora)
    fair = FairShare(FairnessConfig(cost=cost), model)
    charge = fair.charge_step(tenants, p, c, is_prefill, np.ones(2, bool), measured, 0.0, lora=lora)
    own = p[0] * (coef[LoraCoef.L1] + RANK * coef[LoraCoef.L2]) if prefill else coef[LoraCoef.L3] + RANK * coef[LoraCoef.L4]
    # and the LoRA path's set-up; its kernels over the base request's tokens go half to each (A = 1: A/(A+1))
    expected = own + coef[LoraCoef.L5] + (coef[LoraCoef.L6] if loaded else 0.0) + coef[LoraCoef.L8]
    assert charge.cost["lora"] - charge.cost["base"] == pytest.approx(expected, rel=1e-9)
    assert fair.vtc.counter["lora"] - fair.vtc.counter["base"] == pytest.approx(expected, rel=1e-9)
    assert math.fsum(charge.cost.values()) == pytest.approx(measured, rel=1e-12)
    # the same step charged blind to its adapters splits it equally between the twins
    blind = FairShare(FairnessConfig(cost=cost), model).charge_step(tenants, p, c, is_prefill, np.ones(2, bool), measured, 0.0)
    assert blind.cost["lora"] == pytest.approx(blind.cost["base"], rel=1e-12)


def test_a_step_charged_when_scheduled_with_its_adapters_is_corrected_to_what_it_cost():
    model = lora_model()
    tenants, p, c, is_prefill, lora = twin_step(False)
    fair = FairShare(FairnessConfig(cost="attributed"), model)
    scheduled = fair.charge_scheduled(tenants, p, c, is_prefill, np.ones(2, bool), lora=lora)
    assert scheduled["lora"] > scheduled["base"]
    # it ran, and the worker loaded the adapter for it: the counters end at the measured step's shares, load included
    _, _, _, _, ran = twin_step(True)
    measured = 1.3 * StepAttributor(model).predict_step_s(p, c, is_prefill, None, ran)
    fair.charge_step(tenants, p, c, is_prefill, np.ones(2, bool), measured, 0.0, charged_when_scheduled=scheduled, lora=ran)
    shares = StepAttributor(model).attribute(p, c, is_prefill, measured, None, ran)
    assert fair.vtc.counter["lora"] == pytest.approx(shares[0], rel=1e-9)
    assert fair.vtc.counter["base"] == pytest.approx(shares[1], rel=1e-9)
