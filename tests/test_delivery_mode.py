"""Which way the delivery process meters: every step (the default), or window aggregates with LLMVISOR_STORE_STEPS=0
(with a per-step pusher beside them, for the windows of a class no model bills)."""

import pytest

from llmvisor.client import StepDelivery, StepPusher, WindowDelivery, store_steps_from_env

HEADER = {"columns": {"run_id": "r"}, "trace_path": None}


def test_per_step_is_the_default_and_zero_asks_for_windows(monkeypatch):
    monkeypatch.delenv("LLMVISOR_STORE_STEPS", raising=False)
    assert store_steps_from_env() is True
    monkeypatch.setenv("LLMVISOR_SERVICE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LLMVISOR_SERVICE_KEY", "lvk_x_y")
    delivery = StepDelivery.from_env(dict(HEADER))
    assert isinstance(delivery.pusher, StepPusher) and delivery.windows is None
    delivery.pusher.close(0.1)
    monkeypatch.setenv("LLMVISOR_STORE_STEPS", "0")
    delivery = StepDelivery.from_env(dict(HEADER))
    assert delivery.pusher is None and isinstance(delivery.windows, WindowDelivery)
    assert isinstance(delivery.windows.step_pusher, StepPusher)
    delivery.windows.close(0.1)


def test_a_bad_value_is_named():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMVISOR_STORE_STEPS", "maybe")
        with pytest.raises(ValueError, match="LLMVISOR_STORE_STEPS='maybe'"):
            store_steps_from_env()
