"""`FairScheduler`: vLLM's scheduler with VTC admission, quotas and SLO admission control (`llmvisor.fairness.policy`).

Pass it as ``LLM(..., scheduler_cls=FairScheduler)`` or to the OpenAI server as
``--scheduler-cls llmvisor.engines.vllm.fair.FairScheduler``; settings come from ``LLMVISOR_FAIR_CONFIG``
(a JSON or TOML file, or the JSON itself; ``docs/fairness.md``). It is the step recorder
(`llmvisor.engines.vllm.recorder.RecordingScheduler`) too: with ``LLMVISOR_TRACE_PATH`` set it writes the trace.

What it changes in vLLM (0.32, V1):

- ``self.waiting`` is a `TenantRequestQueue`: one FIFO per tenant (`request_tenant` with the config's
  ``tenant_key``; the recorded trace uses the same tenant).
  During a scheduling pass the queue offers the head of the tenant `FairShare.choose` picks, and reports itself
  empty when no tenant may be admitted (quota, SLO), which ends vLLM's admission loop for that pass.
- Before each pass ``self.running`` is stably sorted by tenant counter, most-served tenant last. vLLM's FCFS
  preemption evicts ``running[-1]``, so the most-served tenant's newest request goes first, and under a tight
  token budget the least-served tenants' running requests get their tokens first.
- Each step is charged when it is scheduled (its composition is known then): tokens, or the model's predicted
  shares of it in seconds, per tenant (`FairShare.charge_scheduled`). When its output arrives the counters are
  corrected to its measured time (the recorder's step time, `llmvisor.engines.vllm.step_clock`) split by the
  shares, and quotas get those measured seconds (`FairShare.charge_step`). Under async scheduling vLLM schedules
  step k+1 before step k's output arrives; the pass that makes k+1 already sees k's charge, and the counters end
  at the measured totals.
- With ``cost = "drf"`` the KV memory meter runs whatever the recorder records (`RecordingScheduler.start_kv_meter`):
  after each of its pool readings (schedule, update_from_output, finish_requests) each tenant's effective blocks go to
  `FairShare.observe_memory`, which charges the previous reading's blocks × the time since; steps are charged
  attributed seconds as above. Admission and preemption order follow the dominant share
  (`llmvisor.fairness.counters.DominantResourceCounter`).
- With ``shared_counters`` in the config, the counters are shared with the pool's other replicas through Redis
  (`llmvisor.fairness.shared_counters`; a background thread does the I/O, the engine loop never waits on it).

Like the recorder, it runs on vLLM's `AsyncScheduler` when the engine has async scheduling on, else on `Scheduler`.

Its own work (queue operations, ordering, predictions, charging) is timed with ``perf_counter`` and reported
against step time by `fair_overhead` and at shutdown.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import prometheus_client
from vllm.logger import init_logger
from vllm.v1.core.sched.request_queue import RequestQueue

from llmvisor.core.features import LoraSlices, lora_slices
from llmvisor.core.fingerprint import describe_mismatch, fingerprint_id
from llmvisor.engines.vllm.lora import AdapterRanks
from llmvisor.engines.vllm.recorder import RecordingScheduler
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.policy import AdmissionDecision, DominantResourceCounter, FairnessConfig, FairShare

logger = init_logger(__name__)
MODEL_FINGERPRINT_MISMATCH = prometheus_client.Gauge(
    "llmvisor_fair_model_fingerprint_mismatch",
    "1 when FairScheduler charges with a latency model fitted on an engine of another fingerprint, else 0.",
)


def _count_by_tenant(tenants) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tenant in tenants:
        counts[tenant] = counts.get(tenant, 0) + 1
    return counts


def check_model_fingerprint(model, fingerprint) -> bool | None:
    """Whether ``model`` was fitted on this engine (None: the model or the engine has no fingerprint); a
    mismatch is logged as a warning and sets ``llmvisor_fair_model_fingerprint_mismatch``."""
    model_fingerprint = getattr(model, "engine_fingerprint_", None) if model is not None else None
    if model_fingerprint is None or fingerprint is None:
        MODEL_FINGERPRINT_MISMATCH.set(0)
        return None
    matches = fingerprint_id(model_fingerprint) == fingerprint.id
    MODEL_FINGERPRINT_MISMATCH.set(0 if matches else 1)
    if not matches:
        logger.warning(
            "llmvisor: FairScheduler charges with a latency model of another engine: %s; fit one on this engine "
            "with `llmvisor calibrate`", describe_mismatch(fingerprint, model_fingerprint),
        )
    return matches

MAX_KEPT_STEPS = 1 << 20


@dataclass
class Admission:
    """One admission from the waiting queue, with the keys (counters + reservations) it was decided on."""

    step: int
    request_id: str
    tenant: str
    keys: dict[str, float]
    decision: AdmissionDecision | None


@dataclass
class Preemption:
    step: int
    request_id: str
    tenant: str
    keys: dict[str, float]
    """Keys of the tenants with a request running (the victim's included) when it was evicted."""


class TenantRequestQueue(RequestQueue):
    """vLLM's waiting queue as per-tenant FIFOs; the owning `FairScheduler` decides whose head goes next."""

    def __init__(self, owner: FairScheduler):
        self._owner = owner
        self._fifos: dict[str, deque] = {}
        self._len = 0
        self._in_pass = False
        self._version = 0
        self._cached: tuple[int, str | None] = (-1, None)
        self.time_s = 0.0

    # pass control, from the scheduler
    def begin_pass(self) -> None:
        self._in_pass = True
        self._cached = (-1, None)

    def end_pass(self) -> None:
        self._in_pass = False

    def _choice(self) -> str | None:
        if self._cached[0] == self._version:
            return self._cached[1]
        tenants = [t for t, fifo in self._fifos.items() if fifo]
        tenant = self._owner._choose(tenants) if tenants else None
        self._cached = (self._version, tenant)
        return tenant

    def _lowest(self) -> str | None:
        return self._owner.fair.vtc.lowest(t for t, fifo in self._fifos.items() if fifo)

    def head(self, tenant: str):
        return self._fifos[tenant][0]

    # RequestQueue
    def add_request(self, request) -> None:
        started = time.perf_counter()
        tenant = self._owner.tenant_of(request)
        fifo = self._fifos.get(tenant)
        if fifo is None:
            fifo = self._fifos[tenant] = deque()
        fifo.append(request)
        self._len += 1
        self._version += 1
        self._owner.fair.arrive(tenant)
        self.time_s += time.perf_counter() - started

    def peek_request(self):
        started = time.perf_counter()
        tenant = self._choice() if self._in_pass else self._lowest()
        self.time_s += time.perf_counter() - started
        if tenant is None:
            raise IndexError("peek from an empty queue (or no tenant may be admitted now)")
        return self._fifos[tenant][0]

    def pop_request(self):
        started = time.perf_counter()
        tenant = self._choice() if self._in_pass else self._lowest()
        if tenant is None:
            raise IndexError("pop from an empty queue (or no tenant may be admitted now)")
        request = self._fifos[tenant].popleft()
        self._len -= 1
        self._version += 1
        self._owner.fair.leave(tenant)
        self._owner._popped(request, tenant)
        self.time_s += time.perf_counter() - started
        return request

    def prepend_request(self, request) -> None:
        started = time.perf_counter()
        tenant = self._owner.tenant_of(request)
        fifo = self._fifos.get(tenant)
        if fifo is None:
            fifo = self._fifos[tenant] = deque()
        fifo.appendleft(request)
        self._len += 1
        self._version += 1
        self._owner.fair.requeue(tenant)
        self._owner._returned(request, tenant)
        self.time_s += time.perf_counter() - started

    def prepend_requests(self, requests: Iterable) -> None:
        # Same order as vLLM's FCFS queue (deque.extendleft): each one goes to the front of its tenant's FIFO.
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable) -> None:
        started = time.perf_counter()
        doomed = requests if isinstance(requests, set) else set(requests)
        for tenant, fifo in self._fifos.items():
            kept = [r for r in fifo if r not in doomed]
            removed = len(fifo) - len(kept)
            if removed:
                fifo.clear()
                fifo.extend(kept)
                self._len -= removed
                self._owner.fair.leave(tenant, removed)
        self._owner._forget_deferred(request.request_id for request in doomed)
        self._version += 1
        self.time_s += time.perf_counter() - started

    def __bool__(self) -> bool:
        if not self._in_pass:
            return self._len > 0
        started = time.perf_counter()
        admissible = self._len > 0 and self._choice() is not None
        self.time_s += time.perf_counter() - started
        return admissible

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator:
        vtc = self._owner.fair.vtc
        for tenant in sorted((t for t, f in self._fifos.items() if f), key=lambda t: (vtc.key(t), vtc.order.get(t, 0))):
            yield from list(self._fifos[tenant])

    def tenant_lengths(self) -> dict[str, int]:
        return {t: len(f) for t, f in self._fifos.items()}


def _lora_of(adapters: tuple | None, num_new_tokens, record: dict | None = None) -> LoraSlices | None:
    """A step's ``LoraSlices`` from its slices' (names, ranks), their new tokens and the worker's record of its loads
    (none without)."""
    if adapters is None:
        return None
    names, ranks = adapters
    if record is not None and record["requested"] != {n for n in names if n}:
        record = None  # the worker ran other adapters than scheduled: no loads, as the recorder records none
    loads = frozenset(record["loads"]) if record else frozenset()
    disk_loads = frozenset(record["disk_loads"]) if record else frozenset()
    return lora_slices(names, ranks, np.array([0, len(names)]), [loads], [disk_loads], num_new_tokens=num_new_tokens)


class FairScheduler(RecordingScheduler):
    """vLLM's scheduler with fair admission order, most-served-first preemption and per-step charging."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.configure(FairnessConfig.from_env())

    def configure(self, config: FairnessConfig, model=None) -> None:
        """(Re)start the policy with ``config``; only while no request is waiting or running."""
        if getattr(self, "waiting", None) is not None and (len(self.waiting) or self.running):
            raise RuntimeError("FairScheduler.configure needs an idle engine (no waiting or running requests)")
        if self.policy.value != "fcfs":
            logger.warning("llmvisor: FairScheduler replaces vLLM's %r policy with per-tenant VTC order", self.policy.value)
        previous = getattr(self, "fair", None)
        if previous is not None:
            previous.close()
        config.check()
        if config.charges_memory and not self.start_kv_meter():
            raise LlmvisorError('fairness config: cost = "drf" needs KV memory-time, but this engine\'s KV cache cannot be metered (see the warning above)')
        self.fair_config = config
        self.fair = FairShare(config, model, max_chunk_tokens=int(self.scheduler_config.max_num_batched_tokens))
        # a LoRA model prices adapters: each step's adapters and ranks (and, once it ran, its loads) go with its charge
        lora_model = self.fair.model is not None and self.fair.model.is_lora_ and self.vllm_config.lora_config is not None
        recorder_lora = getattr(self, "_lora", None)
        self._fair_lora_ranks = (recorder_lora.ranks if recorder_lora is not None else AdapterRanks()) if lora_model else None
        self.model_fingerprint_matches = check_model_fingerprint(self.fair.model, self.engine_fingerprint)
        self.tenant_key = config.tenant_key
        self.default_tenant = config.default_tenant
        logger.info(
            "llmvisor: fair scheduler: cost %s, tenant key %r, weights %s, %d quotas, tpot_slo_s %s, shared counters %s",
            config.cost, config.tenant_key, dict(config.weights) or "none", len(config.quotas) + (config.default_quota is not None),
            config.tpot_slo_s, "on" if config.shared_counters is not None else "off",
        )
        self.waiting = TenantRequestQueue(self)
        self._queue_time_counted_s = 0.0
        self.admissions: deque[Admission] = deque(maxlen=max(1, config.log_size))
        self.preemptions: deque[Preemption] = deque(maxlen=max(1, config.log_size))
        self.num_admitted = 0
        self.num_preempted = 0
        self._pass_now_s = 0.0
        self._pass_running: list[float] | None = None
        self._pass_reserved: dict[str, tuple[str, float]] = {}
        self._pass_decision: AdmissionDecision | None = None
        self._pass_keys: dict[str, float] = {}
        self._deferred_since: dict[str, tuple[str, float]] = {}
        self._pass_admitted_deferred: dict[str, tuple[str, float]] = {}
        self.deferral_waits_s: dict[str, list[float]] = {}
        self._steps: dict[int, tuple] = {}
        self._fair_time_s = 0.0
        self._fair_step_s = 0.0
        self.num_charged_steps = 0
        self.fair_step_overhead_s = array("d")
        self.fair_step_latency_s = array("d")

    # ---------------------------------------------------------------------------------------------------
    def _kv_observe(self, since_ns: int | None = None) -> None:
        """The recorder's pool reading; under DRF each tenant's effective blocks in it also go to the policy."""
        super()._kv_observe(since_ns)
        fair = getattr(self, "fair", None)
        if fair is None or not fair.config.charges_memory:
            return
        started = time.perf_counter()
        now_ns, holders = self._kv_meter.reading
        requests = self.requests
        tenant_of = self.tenant_of
        blocks: dict[str, float] = {}
        for request_id, effective in holders.items():
            request = requests.get(request_id)
            tenant = tenant_of(request) if request is not None else self.default_tenant
            blocks[tenant] = blocks.get(tenant, 0.0) + effective
        fair.observe_memory(now_ns, blocks, self._kv_pool_blocks)
        self._fair_time_s += time.perf_counter() - started

    def _choose(self, tenants: list[str]) -> str | None:
        """Called by the queue during a pass (cached until the queue changes)."""
        fair = self.fair
        self._pass_keys = {t: fair.vtc.key(t) for t in tenants}
        self._pass_decision = None
        decide = self._decide if fair.config.tpot_slo_s is not None else None
        return fair.choose(tenants, self._pass_now_s, decide)

    def _running_stats(self) -> list[float]:
        """[number of running requests, their total context tokens], as decode slices after this pass."""
        if self._pass_running is None:
            self._pass_running = [float(len(self.running)), float(sum(r.num_tokens for r in self.running))]
        return self._pass_running

    def _decide(self, tenant: str) -> AdmissionDecision:
        request = self.waiting.head(tenant)
        num_running, sum_context = self._running_stats()
        decision = self.fair.admission.decide(
            int(num_running),
            sum_context,
            request.num_tokens,
            0,
            max(1, request.max_tokens - request.num_output_tokens),
        )
        self._pass_decision = decision
        if not decision.admit:
            self._deferred_since.setdefault(request.request_id, (tenant, self._pass_now_s))
        return decision

    def _popped(self, request, tenant: str) -> None:
        """A request left the waiting queue in a pass: admitted (or skipped, undone by `_returned`)."""
        amount = self.fair.reservation(request.num_tokens, request.num_computed_tokens)
        self.fair.vtc.reserve(tenant, amount)
        self._pass_reserved[request.request_id] = (tenant, amount)
        stats = self._running_stats()
        stats[0] += 1
        stats[1] += request.num_tokens
        self.admissions.append(Admission(self.current_step, request.request_id, tenant, self._pass_keys, self._pass_decision))
        self.num_admitted += 1
        deferred = self._deferred_since.pop(request.request_id, None)
        if deferred is not None:
            self._pass_admitted_deferred[request.request_id] = deferred

    def _forget_deferred(self, request_ids: Iterable[str]) -> None:
        """Requests that left the waiting queue without being admitted (aborted) are no longer deferred."""
        for request_id in request_ids:
            self._deferred_since.pop(request_id, None)

    def _returned(self, request, tenant: str) -> None:
        reserved = self._pass_reserved.pop(request.request_id, None)
        if reserved is not None:
            self.fair.vtc.unreserve(*reserved)
            stats = self._running_stats()
            stats[0] -= 1
            stats[1] -= request.num_tokens
            self.num_admitted -= 1
            deferred = self._pass_admitted_deferred.pop(request.request_id, None)
            if deferred is not None:
                self._deferred_since[request.request_id] = deferred
            if self.admissions and self.admissions[-1].request_id == request.request_id:
                self.admissions.pop()

    def _order_running(self) -> None:
        running = self.running
        if len(running) < 2:
            return
        key = self.fair.vtc.key
        tenant_of = self.tenant_of
        keys = [key(tenant_of(r)) for r in running]
        if all(a <= b for a, b in zip(keys, keys[1:])):
            return
        order = sorted(range(len(running)), key=keys.__getitem__)
        running[:] = [running[i] for i in order]

    def _preempt_request(self, request, *args, **kwargs):
        started = time.perf_counter()
        key = self.fair.vtc.key
        tenants = {self.tenant_of(r) for r in self.running}
        tenant = self.tenant_of(request)
        tenants.add(tenant)
        self.preemptions.append(Preemption(self.current_step, request.request_id, tenant, {t: key(t) for t in tenants}))
        self.num_preempted += 1
        self._fair_time_s += time.perf_counter() - started
        return super()._preempt_request(request, *args, **kwargs)

    # ---------------------------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        started = time.perf_counter()
        queue = self.waiting
        self._pass_now_s = time.monotonic()
        self._pass_running = None
        self._pass_reserved.clear()
        if self.fair_config.preempt_most_served:
            self._order_running()
        queue.begin_pass()
        before_s = time.perf_counter() - started
        try:
            scheduler_output = super().schedule(*args, **kwargs)
        finally:
            queue.end_pass()
        for tenant, since_s in self._pass_admitted_deferred.values():
            self.deferral_waits_s.setdefault(tenant, []).append(self._pass_now_s - since_s)
        self._pass_admitted_deferred.clear()
        resumed = time.perf_counter()
        if scheduler_output.total_num_scheduled_tokens:
            step = self._step_slices(scheduler_output)
            charged = self.fair.charge_scheduled(*step[:5], effective_context_tokens=step[5], lora=_lora_of(step[6], step[1]))
            self._steps[id(scheduler_output)] = (*step, charged)
        finished = time.perf_counter()
        # queue work since the last pass: arrivals (add_request) in between and this pass's admissions
        queue_s = queue.time_s - self._queue_time_counted_s
        self._queue_time_counted_s = queue.time_s
        if scheduler_output.total_num_scheduled_tokens:
            self._steps[id(scheduler_output)] += (finished, before_s + (finished - resumed) + queue_s)
        else:
            self._fair_time_s += before_s + (finished - resumed) + queue_s
        return scheduler_output

    def _step_slices(self, scheduler_output) -> tuple:
        """(tenants, new tokens, context tokens, is_prefill, samples a token, effective context tokens, adapters) of
        the step's slices; the effective context splits KV blocks shared through prefix caching among their readers;
        adapters: (names, ranks) per slice where a LoRA model prices them, else None."""
        slices = self._slices(scheduler_output)
        requests = self.requests
        tenant_of = self.tenant_of
        tenants = [tenant_of(requests[s[0]]) for s in slices]
        num_new = np.fromiter((s[2] for s in slices), dtype=np.float64, count=len(slices))
        num_context = np.fromiter((s[3] for s in slices), dtype=np.float64, count=len(slices))
        is_prefill = np.fromiter((s[4] for s in slices), dtype=bool, count=len(slices))
        samples = np.fromiter((s[3] + s[2] >= requests[s[0]].num_tokens for s in slices), dtype=bool, count=len(slices))
        effective = np.fromiter((s[6] for s in slices), dtype=np.float64, count=len(slices))
        adapters = None
        if self._fair_lora_ranks is not None:
            lora_requests = [requests[s[0]].lora_request for s in slices]
            adapters = ([a.lora_name if a else "" for a in lora_requests],
                        [(self._fair_lora_ranks.rank(a) or 0) if a else 0 for a in lora_requests])
        return (tenants, num_new, num_context, is_prefill, samples, effective, adapters)

    def update_from_output(self, scheduler_output, model_runner_output):
        entered = time.perf_counter()
        step = self._steps.pop(id(scheduler_output), None)
        timing = self.step_timing(scheduler_output, entered)
        if step is not None and timing is not None:
            tenants, num_new, num_context, is_prefill, samples, effective, adapters, charged, _, schedule_overhead_s = step
            latency_s = timing[1]
            record = None  # the loads the worker made for the step, where the recorder reads them
            if adapters is not None and getattr(self, "_lora", None) is not None:
                record = self._lora.events.peek(scheduler_output)
            self.fair.charge_step(
                tenants, num_new, num_context, is_prefill, samples, latency_s, time.monotonic(),
                effective_context_tokens=effective, charged_when_scheduled=charged, lora=_lora_of(adapters, num_new, record),
            )
            overhead_s = schedule_overhead_s + time.perf_counter() - entered
            self.num_charged_steps += 1
            self._fair_time_s += overhead_s
            self._fair_step_s += latency_s
            if len(self.fair_step_latency_s) < MAX_KEPT_STEPS:
                self.fair_step_overhead_s.append(overhead_s)
                self.fair_step_latency_s.append(latency_s)
        return super().update_from_output(scheduler_output, model_runner_output)

    # ---------------------------------------------------------------------------------------------------
    def fair_overhead(self) -> dict:
        """The scheduler's added work against the step time it measured."""
        overhead = np.asarray(self.fair_step_overhead_s)
        latency = np.asarray(self.fair_step_latency_s)
        fractions = overhead / np.maximum(latency, 1e-12) if latency.size else np.zeros(0)
        return {
            "n_steps": self.num_charged_steps,
            "added_time_s": self._fair_time_s,
            "step_time_s": self._fair_step_s,
            "fraction_of_step_time": self._fair_time_s / self._fair_step_s if self._fair_step_s > 0 else 0.0,
            "added_time_per_step_us": 1e6 * self._fair_time_s / self.num_charged_steps if self.num_charged_steps else 0.0,
            "added_time_per_step_us_p50": float(np.percentile(overhead, 50) * 1e6) if overhead.size else 0.0,
            "added_time_per_step_us_p99": float(np.percentile(overhead, 99) * 1e6) if overhead.size else 0.0,
            "step_fraction_p50": float(np.percentile(fractions, 50)) if fractions.size else 0.0,
            "step_fraction_p99": float(np.percentile(fractions, 99)) if fractions.size else 0.0,
        }

    def fair_state(self) -> dict:
        """Counters, service and queue lengths per tenant, as plain data."""
        vtc = self.fair.vtc
        return {
            "cost": self.fair_config.cost,
            "counter": dict(vtc.counter),
            "served": dict(vtc.served),
            "attributed_s": dict(self.fair.attributed_s),
            "waiting": self.waiting.tenant_lengths(),
            "num_admitted": self.num_admitted,
            "num_preempted": self.num_preempted,
            "num_lifts": vtc.num_lifts,
            "num_deferred": self.fair.num_deferred,
            "deferral_waits_s": {tenant: list(waits) for tenant, waits in self.deferral_waits_s.items()},
            "deferred_waiting": _count_by_tenant(tenant for tenant, _ in self._deferred_since.values()),
            "tpot_prediction_factor": None if self.fair.admission is None else self.fair.admission.prediction_factor,
            "num_quota_waits": self.fair.num_quota_waits,
            "num_work_conserving": self.fair.num_work_conserving,
            "shared_counters": None if self.fair.shared is None else self.fair.shared.status(),
            **self._drf_state(),
        }

    def _drf_state(self) -> dict:
        vtc = self.fair.vtc
        if not isinstance(vtc, DominantResourceCounter):
            return {}
        return {
            "kv_block_ns": dict(vtc.memory_served),
            "engine_s": vtc.engine_s,
            "pool_block_ns": vtc.pool_block_ns,
            "shares": {t: dict(zip(("time", "memory"), vtc.shares(t))) for t in vtc.order},
        }

    def shutdown(self) -> None:
        overhead = self.fair_overhead()
        if overhead["n_steps"]:
            logger.info(
                "llmvisor: fair scheduler (%s cost) charged %d steps; its own work took %.3f%% of step time "
                "(%.1f us/step, p99 %.1f us)",
                self.fair_config.cost,
                overhead["n_steps"],
                100 * overhead["fraction_of_step_time"],
                overhead["added_time_per_step_us"],
                overhead["added_time_per_step_us_p99"],
            )
        self.fair.close()
        super().shutdown()
