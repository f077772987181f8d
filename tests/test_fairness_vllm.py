"""The fair scheduler inside the real vLLM CPU engine (tiny dummy-weight Llama): admission order, counters,
quotas, SLO admission control and most-served-first preemption, checked against what was scheduled."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from _tiny_llama import lift_cpu_async_override, write_tiny_llama  # noqa: E402
from llmvisor.core.attribution import attribute_arrays  # noqa: E402
from llmvisor.core.model import StepLatencyModel  # noqa: E402
from llmvisor.core.synthetic import DEFAULT_COEF_S  # noqa: E402
from llmvisor.core.trace import read_trace  # noqa: E402
from llmvisor.fairness.policy import FairnessConfig, Quota  # noqa: E402

pytestmark = pytest.mark.vllm

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_theta": 10000.0, "vocab_size": 1024}


def fixed_model() -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([dict(DEFAULT_COEF_S)])


class Engine:
    """An in-process vLLM engine with `FairScheduler`, stepped by the test."""

    def __init__(self, folder, max_model_len: int = 1024, **engine_args):
        from vllm import LLM

        from llmvisor.engines.vllm.fair import FairScheduler

        model_dir = write_tiny_llama(folder / "model", **TINY_FIELDS)
        self.trace_path = str(folder / "trace.jsonl")
        saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "LLMVISOR_TRACE_PATH", "LLMVISOR_WARMUP_STEPS", "LLMVISOR_FAIR_CONFIG")}
        os.environ.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            LLMVISOR_TRACE_PATH=self.trace_path,
            LLMVISOR_WARMUP_STEPS="0",
            LLMVISOR_FAIR_CONFIG=json.dumps({"cost": "tokens"}),
        )
        try:
            self.llm = LLM(
                model=str(model_dir),
                load_format="dummy",
                skip_tokenizer_init=True,
                distributed_executor_backend="uni",
                async_scheduling=engine_args.pop("async_scheduling", False),
                enable_prefix_caching=False,
                enforce_eager=True,
                max_model_len=max_model_len,
                scheduler_cls=FairScheduler,
                seed=0,
                **engine_args,
            )
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler

    def configure(self, **config) -> None:
        model = fixed_model() if config.get("cost") == "attributed" or "quotas" in config or "tpot_slo_s" in config else None
        self.scheduler.configure(FairnessConfig(**config), model)

    def add(self, request_id: str, tenant: str, prompt_len: int, max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant}, temperature=0.0)
        self.engine.add_request(request_id, {"prompt_token_ids": [(7 * i + len(request_id)) % 900 + 50 for i in range(prompt_len)]}, params)

    def run(self, max_steps: int = 5000, until=None) -> dict[str, int]:
        """Step until no request is left (or ``until()``); output tokens per finished request."""
        finished: dict[str, int] = {}
        self.max_running = 0
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests() or (until is not None and until()):
                break
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = len(output.outputs[0].token_ids)
            self.max_running = max(self.max_running, len(self.scheduler.running))
        return finished

    def order(self) -> list[str]:
        return [a.request_id.rsplit("-", 1)[0] for a in self.scheduler.admissions]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """One running request at a time: every admission happens after the previous request was fully charged."""
    engine = Engine(tmp_path_factory.mktemp("one-slot"), max_num_seqs=1)
    yield engine
    engine.engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory):
    """Eight slots and a KV cache of 8 blocks of 128 tokens (one reserved): growing requests must preempt each other."""
    engine = Engine(tmp_path_factory.mktemp("small-kv"), max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=8)
    yield engine
    engine.engine.engine_core.shutdown()


def expected_vtc_order(requests: list[tuple[str, str, float]], weights: dict[str, float] | None = None) -> list[str]:
    """VTC by hand, one request at a time: (id, tenant, cost) all queued before the first admission."""
    weights = weights or {}
    queues: dict[str, list[tuple[str, float]]] = {}
    for request_id, tenant, cost in requests:
        queues.setdefault(tenant, []).append((request_id, cost))
    counter = dict.fromkeys(queues, 0.0)
    first_seen = {tenant: k for k, tenant in enumerate(queues)}
    order = []
    while any(queues.values()):
        tenant = min((t for t, q in queues.items() if q), key=lambda t: (counter[t], first_seen[t]))
        request_id, cost = queues[tenant].pop(0)
        counter[tenant] += cost / weights.get(tenant, 1.0)
        order.append(request_id)
    return order


def test_token_vtc_admits_in_vtc_order_and_counts_prompt_once_and_output_twice(one_slot):
    one_slot.configure(cost="tokens")
    requests = [(f"long{k}", "long", 96) for k in range(5)] + [(f"short{k}", "short", 16) for k in range(5)]
    for request_id, tenant, prompt_len in requests:
        one_slot.add(request_id, tenant, prompt_len, max_tokens=4)
    finished = one_slot.run()
    assert finished == {request_id: 4 for request_id, _, _ in requests}
    costs = [(request_id, tenant, prompt_len + 2 * 4) for request_id, tenant, prompt_len in requests]
    assert one_slot.order() == expected_vtc_order(costs)
    assert one_slot.order()[:3] == ["long0", "short0", "short1"]  # FCFS would run every long request first
    state = one_slot.scheduler.fair_state()
    assert state["counter"] == {"long": 5 * (96 + 8.0), "short": 5 * (16 + 8.0)}
    assert state["waiting"] == {"long": 0, "short": 0}


def test_weights_give_service_in_proportion(one_slot):
    one_slot.configure(cost="tokens", weights={"gold": 3.0})
    requests = [(f"free{k}", "free", 32) for k in range(4)] + [(f"gold{k}", "gold", 32) for k in range(8)]
    for request_id, tenant, prompt_len in requests:
        one_slot.add(request_id, tenant, prompt_len, max_tokens=2)
    one_slot.run()
    costs = [(request_id, tenant, prompt_len + 2 * 2) for request_id, tenant, prompt_len in requests]
    assert one_slot.order() == expected_vtc_order(costs, {"gold": 3.0})
    counter = one_slot.scheduler.fair_state()["counter"]
    served = one_slot.scheduler.fair_state()["served"]
    assert counter["gold"] == served["gold"] / 3.0 and counter["free"] == served["free"]


def test_attributed_vtc_charges_each_steps_measured_time_split_by_shares(one_slot):
    scheduler = one_slot.scheduler
    scheduler.flush_trace()
    first_step = scheduler.num_recorded_steps
    one_slot.configure(cost="attributed")
    for k in range(4):
        one_slot.add(f"ctx{k}", "ctx", 300, max_tokens=3)
    for k in range(4):
        one_slot.add(f"chat{k}", "chat", 20, max_tokens=3)
    one_slot.run()
    scheduler.flush_trace()
    state = scheduler.fair_state()
    # every admission went to the lowest counter among the tenants waiting at that moment
    for admission in scheduler.admissions:
        assert admission.keys[admission.tenant] == min(admission.keys.values())
    assert one_slot.order()[:2] == ["ctx0", "chat0"]
    # the counters are the measured step times, split by llmvisor's shares: recompute from the recorded trace
    trace = read_trace(one_slot.trace_path)
    trace = trace.select_steps(trace.step_id_per_step >= first_step)
    measured = np.asarray(scheduler.fair_step_latency_s)
    assert trace.n_steps == measured.size > 0
    shares = attribute_arrays(fixed_model(), trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets, measured)
    for tenant in ("ctx", "chat"):
        offline = math.fsum(shares.share_s[trace.tenant == tenant])
        assert state["counter"][tenant] == pytest.approx(offline, rel=1e-9)
        assert state["attributed_s"][tenant] == pytest.approx(offline, rel=1e-9)
    assert math.fsum(state["served"].values()) == pytest.approx(math.fsum(measured), rel=1e-9)


def test_quota_holds_an_over_budget_tenant_back_and_work_conserving_lets_it_use_idle_capacity(one_slot):
    one_slot.configure(cost="tokens", quotas={"capped": Quota(budget_s=1e-9, window_s=3600)}, work_conserving=True)
    for k in range(3):
        one_slot.add(f"capped{k}", "capped", 16, max_tokens=2)
    for k in range(3):
        one_slot.add(f"free{k}", "free", 64, max_tokens=2)
    one_slot.run()
    # capped0 runs while capped is within budget; after its first charge capped waits for free's requests,
    # then, with nothing else waiting, uses the capacity that would otherwise idle
    assert one_slot.order() == ["capped0", "free0", "free1", "free2", "capped1", "capped2"]
    assert one_slot.scheduler.fair.num_work_conserving > 0

    one_slot.configure(cost="tokens", quotas={"capped": Quota(budget_s=1e-9, window_s=3600)}, work_conserving=False)
    one_slot.add("capped-a", "capped", 16, max_tokens=2)
    one_slot.add("capped-b", "capped", 16, max_tokens=2)
    one_slot.add("free-a", "free", 16, max_tokens=2)
    one_slot.run(max_steps=60)
    assert one_slot.order() == ["capped-a", "free-a"]  # strict: capped-b waits although the engine idles
    assert one_slot.scheduler.fair_state()["waiting"]["capped"] == 1
    request_ids = [r.request_id for r in one_slot.scheduler.waiting]
    one_slot.engine.abort_request(request_ids, internal=True)
    assert len(one_slot.scheduler.waiting) == 0


def test_slo_admission_stops_batching_where_predicted_time_per_token_would_exceed_it(small_kv):
    model = fixed_model()
    from llmvisor.fairness.policy import AdmissionController

    probe = AdmissionController(model, tpot_slo_s=None)
    prompt, outputs = 64, 8
    fits = probe.decide(2, 2 * prompt, prompt, 0, outputs).predicted_tpot_s
    too_slow = probe.decide(3, 3 * prompt, prompt, 0, outputs).predicted_tpot_s
    slo = (fits + too_slow) / 2
    small_kv.configure(cost="tokens", tpot_slo_s=slo)
    for k in range(6):
        small_kv.add(f"slo{k}", "t", prompt, max_tokens=outputs)
    finished = small_kv.run()
    assert len(finished) == 6
    assert small_kv.max_running == 3  # a third request fits the SLO, a fourth would not
    assert small_kv.scheduler.fair.num_deferred > 0
    state = small_kv.scheduler.fair_state()
    waits = state["deferral_waits_s"]["t"]
    # the fourth request, refused at the head of the queue until the first three finished together
    assert len(waits) >= 1 and all(w > 0 for w in waits)
    assert state["deferred_waiting"] == {}  # every deferred request was admitted in the end
    for admission in small_kv.scheduler.admissions:
        decision = admission.decision
        assert decision is not None and decision.admit
        assert decision.predicted_tpot_s <= slo or decision.decode_step_before_s == 0.0


def test_a_deferred_request_aborted_while_waiting_is_no_longer_counted_as_deferred(small_kv):
    model = fixed_model()
    from llmvisor.fairness.policy import AdmissionController

    probe = AdmissionController(model, tpot_slo_s=None)
    fits = probe.decide(0, 0, 64, 0, 64).predicted_tpot_s
    too_slow = probe.decide(1, 64, 64, 0, 64).predicted_tpot_s
    small_kv.configure(cost="tokens", tpot_slo_s=(fits + too_slow) / 2)  # one request at a time
    for k in range(3):
        small_kv.add(f"abort{k}", "t", 64, max_tokens=64)
    small_kv.run(max_steps=4)
    assert small_kv.scheduler.fair_state()["deferred_waiting"] == {"t": 1}  # the head of the queue was refused
    small_kv.engine.abort_request([r.request_id for r in small_kv.scheduler.waiting], internal=True)
    assert len(small_kv.scheduler.waiting) == 0
    assert small_kv.scheduler.fair_state()["deferred_waiting"] == {}
    small_kv.run()


def test_preemption_evicts_the_most_served_tenant_first(small_kv):
    # 8 requests of 100 + 64 tokens need 2 blocks each, 16 of the 7: preemptions start when the running requests'
    # contexts cross their first block (128 tokens), and go on until the last ones finish
    small_kv.configure(cost="tokens")
    for k in range(4):
        small_kv.add(f"heavy{k}", "heavy", 100, max_tokens=64)
    small_kv.run(max_steps=3)  # heavy's requests run first, so FCFS would evict light's (admitted later) first
    for k in range(4):
        small_kv.add(f"light{k}", "light", 100, max_tokens=64)
    small_kv.scheduler.fair.vtc.charge("heavy", 10_000.0)  # heavy has been served far more
    finished = small_kv.run()
    assert finished == {**{f"heavy{k}": 64 for k in range(4)}, **{f"light{k}": 64 for k in range(4)}}
    preemptions = list(small_kv.scheduler.preemptions)
    assert preemptions, "the 7-block KV cache should have forced preemptions"
    for preemption in preemptions:
        assert preemption.keys[preemption.tenant] == max(preemption.keys.values())
    assert preemptions[0].tenant == "heavy" and set(preemptions[0].keys) == {"heavy", "light"}
    assert preemptions[0].request_id.startswith("heavy3")  # the most-served tenant's newest request


def test_under_async_scheduling_each_pass_sees_the_steps_scheduled_before_it_charged(tmp_path, monkeypatch):
    """A batch queue of 2 (the CPU platform's async override lifted, as the recorder's async test does): vLLM
    schedules step k+1 before step k's output arrives. The counters that pass sees already hold step k, at the
    model's predicted shares; once the outputs are in, they are the measured shares, as charged without a queue."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    lift_cpu_async_override(monkeypatch)
    engine = Engine(tmp_path, max_num_seqs=4, async_scheduling=True)
    try:
        scheduler = engine.scheduler
        assert isinstance(scheduler, AsyncScheduler) and engine.engine.engine_core.engine_core.batch_queue_size == 2
        engine.configure(cost="attributed")
        events: list[tuple[str, dict | None]] = []  # ("schedule", counters the pass starts from) / ("output", None)
        schedule, update_from_output = scheduler.schedule, scheduler.update_from_output

        def watched_schedule(*args, **kwargs):
            counters = dict(scheduler.fair.vtc.counter)
            output = schedule(*args, **kwargs)
            if output.total_num_scheduled_tokens:
                events.append(("schedule", counters))
            return output

        def watched_update(scheduler_output, model_runner_output):
            if scheduler_output.total_num_scheduled_tokens:
                events.append(("output", None))
            return update_from_output(scheduler_output, model_runner_output)

        monkeypatch.setattr(scheduler, "schedule", watched_schedule)
        monkeypatch.setattr(scheduler, "update_from_output", watched_update)
        for k in range(3):
            engine.add(f"ctx{k}", "ctx", 200 + 40 * k, max_tokens=4)
            engine.add(f"chat{k}", "chat", 16 + 8 * k, max_tokens=6)
        finished = engine.run()
        assert len(finished) == 6
        scheduler.flush_trace()
        state = scheduler.fair_state()
    finally:
        engine.engine.engine_core.shutdown()
    assert state["num_lifts"] == 0  # every request arrived before the first step: counters are sums of charges
    trace = read_trace(engine.trace_path)
    measured = np.asarray(scheduler.fair_step_latency_s)
    n_steps = trace.n_steps
    assert n_steps == measured.size == sum(kind == "schedule" for kind, _ in events) == sum(kind == "output" for kind, _ in events)
    step_of_slice = np.repeat(np.arange(n_steps), np.diff(trace.step_offsets))

    def per_step_tenant(shares: np.ndarray) -> dict[str, np.ndarray]:
        return {tenant: np.bincount(step_of_slice[trace.tenant == tenant], shares[trace.tenant == tenant], n_steps) for tenant in ("ctx", "chat")}

    model = fixed_model()
    args = (model, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets)
    measured_shares = per_step_tenant(attribute_arrays(*args, measured).share_s)
    predicted_shares = per_step_tenant(attribute_arrays(*args).share_s)
    # the steps come out in the order they were scheduled (the batch queue is FIFO): the trace numbers them so
    num_scheduled = num_out = num_ahead = 0
    for kind, counters in events:
        if kind == "output":
            num_out += 1
            continue
        for tenant in ("ctx", "chat"):
            expected = math.fsum(measured_shares[tenant][:num_out]) + math.fsum(predicted_shares[tenant][num_out:num_scheduled])
            assert counters.get(tenant, 0.0) == pytest.approx(expected, rel=1e-9, abs=1e-15), (num_scheduled, num_out, tenant)
        num_ahead += num_scheduled > num_out
        num_scheduled += 1
    assert num_ahead >= n_steps // 2  # most passes ran with the previous step still in the queue
    for tenant in ("ctx", "chat"):
        assert state["counter"][tenant] == pytest.approx(math.fsum(measured_shares[tenant]), rel=1e-9)
        assert state["attributed_s"][tenant] == pytest.approx(math.fsum(measured_shares[tenant]), rel=1e-9)
    assert math.fsum(state["served"].values()) == pytest.approx(math.fsum(measured), rel=1e-9)
