"""`RecordingScheduler`: vLLM's own scheduler, plus one step-trace row per request slice per step.

Pass it as ``LLM(..., scheduler_cls=RecordingScheduler)`` or to the OpenAI server as
``--scheduler-cls llmvisor.engines.vllm.recorder.RecordingScheduler``; settings come from environment
variables (`llmvisor.engines.vllm.settings`). It changes no scheduling decision.

Its base is vLLM's `AsyncScheduler` when the engine runs with async scheduling (vLLM's default wherever the
platform allows it) and the synchronous `Scheduler` otherwise: ``RecordingScheduler.__new__`` picks the class
from ``vllm_config.scheduler_config.async_scheduling``, so the same class name works for both (also when
named by ``--scheduler-cls``), and subclasses (`FairScheduler`, the profiling and controlled schedulers) get
the same choice. The recording logic is one code path on either base.

A step's latency is its execution and sampling time as seen by the engine loop, from the scheduler's calls
alone (`llmvisor.engines.vllm.step_clock`): without overlap, from ``schedule()`` returning to the engine's
next call into the scheduler; with overlapped async scheduling, between consecutive output arrivals while
the engine stays busy. The recorder's own work happens outside that window, and is timed separately so its
overhead on the engine loop can be reported.

Per slice it records ``num_new_tokens`` (``SchedulerOutput.num_scheduled_tokens``), ``num_context_tokens``
(the request's computed tokens before the step as sent to the worker, prefix-cache hits included), the phase
(prefill while the context is shorter than the prompt, or when a slice runs more than one token without
speculative tokens, as a preempted request's recomputation does), the tenant (`request_tenant`:
``sampling_params.extra_args[tenant_key]``, default ``"default"``; `FairScheduler` decides it the same way),
and how much of its context lies in KV blocks that other slices of the step read too
(``num_shared_context_tokens``, ``effective_context_tokens``; `llmvisor.engines.vllm.kv_sharing`), from the
scheduler's KV cache manager. Whenever it records, it also meters KV memory-time (trace format 3,
`llmvisor.core.kv_memory.KvMeter`): after each call that can change the block pool (``schedule``,
``update_from_output``, ``finish_requests``) it reads who holds which blocks, and each slice carries the block-ns its
request held since its previous slice. With LoRA enabled it records each slice's adapter and rank and each step's
adapters and adapter loads (trace format 4, `llmvisor.engines.vllm.lora`). Request ids are vLLM's internal ids,
``"<external id>-<8 random characters>"``: unique within a run, which external ids need not be.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from array import array
from dataclasses import dataclass

import vllm
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from llmvisor.client.push import StepPusher, service_url_from_env
from llmvisor.client.relay import StepRelay
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN, EngineFingerprint, fingerprint_sidecar
from llmvisor.core.kv_memory import KvMemoryError, KvMeter
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import TraceWriter
from llmvisor.engines.vllm.fingerprint import engine_fingerprint
from llmvisor.engines.vllm.kv_holdings import IdleCacheCount, RequestHoldings, block_bytes, pool_blocks
from llmvisor.engines.vllm.kv_sharing import shared_context_tokens
from llmvisor.engines.vllm.lora import AdapterRanks, LoraRecorder, WorkerLoraEvents, in_process_model_runner
from llmvisor.engines.vllm.settings import RecorderSettings
from llmvisor.engines.vllm.step_clock import StepClock

logger = init_logger(__name__)
IDLE_FLUSH_AFTER_S = 0.1

ENGINE = "vllm"
DEFAULT_TENANT = "default"
ORPHANED_TENANT = "(orphaned)"
"""The tenant of steps that ran after the API server died: measured and stored, billed to no client's tenant."""
ORPHAN_EXIT_AFTER_S = 10.0
PARENT_POLL_S = 1.0
MAX_KEPT_STEPS = 1 << 20


@dataclass
class RecorderOverhead:
    """The recorder's own time against the step time it measured, over the steps recorded so far."""

    n_steps: int
    recorder_time_s: float
    step_latency_s: float
    max_step_fraction: float
    kv_meter_time_s: float = 0.0
    """Of ``recorder_time_s``, the KV memory meter's part (reading the pool, billing the interval, draining a step)."""

    @property
    def fraction(self) -> float:
        return self.recorder_time_s / self.step_latency_s if self.step_latency_s > 0 else 0.0

    @property
    def kv_meter_fraction(self) -> float:
        return self.kv_meter_time_s / self.step_latency_s if self.step_latency_s > 0 else 0.0

    @property
    def recorder_time_per_step_us(self) -> float:
        return 1e6 * self.recorder_time_s / self.n_steps if self.n_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "n_steps": self.n_steps,
            "recorder_time_s": self.recorder_time_s,
            "step_latency_s": self.step_latency_s,
            "fraction_of_step_time": self.fraction,
            "recorder_time_per_step_us": self.recorder_time_per_step_us,
            "max_step_fraction": self.max_step_fraction,
            "kv_meter_time_s": self.kv_meter_time_s,
            "kv_meter_fraction_of_step_time": self.kv_meter_fraction,
            "kv_meter_time_per_step_us": 1e6 * self.kv_meter_time_s / self.n_steps if self.n_steps else 0.0,
        }


def describe_hardware() -> str:
    """The accelerator's name, or the CPU model and the threads torch uses."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = "CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def request_tenant(request, tenant_key: str, default_tenant: str = DEFAULT_TENANT) -> str:
    """A request's tenant: ``sampling_params.extra_args[tenant_key]`` (``vllm_xargs`` of the OpenAI server) as a
    string, or ``default_tenant``. The recorder and `FairScheduler` both decide it here."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    tenant = extra.get(tenant_key) if extra else None
    return default_tenant if tenant is None else str(tenant)


def write_fingerprint_record(fingerprint: EngineFingerprint, trace_path: str) -> None:
    """``<trace>.engine.json``: the engine's fingerprint record beside its trace (`llmvisor calibrate --fingerprint`)."""
    path = fingerprint_sidecar(trace_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fingerprint.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        logger.warning("llmvisor: cannot write the engine fingerprint record %s (%s)", path, error.strerror)


def relayed_step(step: list, kv: list | None, named: dict | None) -> list:
    """A recorded step in the relayed form (`llmvisor.core.relayed`): the KV figures fifth, the named columns sixth."""
    if named is not None:
        return [*step, kv, named]
    return step if kv is None else [*step, kv]


def route_llmvisor_logs() -> None:
    """Send llmvisor's log records to vLLM's handlers (same stream, same format), once.

    vLLM configures only its own ``vllm`` logger (no propagation to the root), so without this llmvisor's INFO
    lines never reach the server log. The ``llmvisor`` logger gets vLLM's handler objects themselves and does
    not propagate, so no line is written twice."""
    ours = logging.getLogger("llmvisor")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


route_llmvisor_logs()


_ASYNC_VARIANTS: dict[type, type] = {}


def async_variant(cls: type) -> type:
    """``cls`` with vLLM's `AsyncScheduler` between its own logic and `Scheduler` in the MRO (made once per class)."""
    if issubclass(cls, AsyncScheduler):
        return cls
    variant = _ASYNC_VARIANTS.get(cls)
    if variant is None:
        variant = type(f"Async{cls.__name__}", (cls, AsyncScheduler), {"__module__": cls.__module__, "__doc__": cls.__doc__})
        _ASYNC_VARIANTS[cls] = variant
    return variant


def scheduler_class_for(cls: type, vllm_config) -> type:
    """The class vLLM gets for ``cls``: its async variant when the config has async scheduling on."""
    return async_variant(cls) if vllm_config.scheduler_config.async_scheduling else cls


def steps_overlap(vllm_config) -> bool:
    """Whether a step executes while the engine thread schedules the next one.

    Only with a batch queue (async scheduling, pipeline parallelism), and not when the executor runs the
    forward pass synchronously in the engine thread: the CPU build's ``uni`` executor does, so its steps
    run one after another even with a batch queue."""
    if vllm_config.max_concurrent_batches <= 1:
        return False
    from vllm.platforms import current_platform

    return not (current_platform.is_cpu() and vllm_config.parallel_config.distributed_executor_backend == "uni")


class RecordingScheduler(Scheduler):
    """vLLM's scheduler (`Scheduler` or `AsyncScheduler`, as the config says), recording every step."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if vllm_config is not None:
            cls = scheduler_class_for(cls, vllm_config)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorder_settings = RecorderSettings.from_env()
        self.trace_path = self.recorder_settings.trace_path
        self.run_id = self.recorder_settings.run_id
        self.tenant_key = self.recorder_settings.tenant_key
        self.default_tenant = DEFAULT_TENANT
        model = self.vllm_config.model_config.model
        self._constant_columns = {
            "run_id": self.run_id,
            "engine": ENGINE,
            "engine_version": vllm.__version__,
            "model": self.recorder_settings.model_name
            or (os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model),
            "hardware": self.recorder_settings.hardware or describe_hardware(),
            "tensor_parallel_size": int(self.parallel_config.tensor_parallel_size),
        }
        self.engine_fingerprint = self._fingerprint()
        if self.engine_fingerprint is not None:
            self._constant_columns[FINGERPRINT_COLUMN] = self.engine_fingerprint.id
        self._setup_kv_meter()
        self._setup_lora()
        self._writer, self._pusher, self._relay = self._start_delivery()
        self._wall_minus_perf_s = time.time() - time.perf_counter()
        self._in_flight: dict[int, tuple[list[tuple], float]] = {}
        self._unwritten: list[tuple[float, float, list[tuple]]] = []
        self._last_flush_s = time.perf_counter()
        self._last_update_exit_s = 0.0
        self.step_clock = StepClock(overlapped=steps_overlap(self.vllm_config))
        self._step_timing_cache: tuple[int, tuple[float, float] | None] | None = None
        self._setup_kv_sharing()
        self.num_recorded_steps = 0
        self._recorder_time_s = 0.0
        self._recorded_latency_s = 0.0
        self._max_step_fraction = 0.0
        self.overhead_s_per_step = array("d")
        self.latency_s_per_step = array("d")
        self._flush_lock = threading.Lock()
        self._flush_stop = threading.Event()
        self._flush_thread: threading.Thread | None = None
        self.orphaned_since_s: float | None = None
        self.num_orphaned_steps = 0
        self._watch_parent()
        if self._writer is not None or self._pusher is not None:
            self._flush_thread = threading.Thread(target=self._flush_when_idle, name="llmvisor-trace-flush", daemon=True)
            self._flush_thread.start()
        logger.info(
            "llmvisor: %s base, steps timed as %s",
            "AsyncScheduler" if isinstance(self, AsyncScheduler) else "Scheduler",
            "overlapped (between output arrivals)" if self.step_clock.overlapped else "serial",
        )

    def _fingerprint(self) -> EngineFingerprint | None:
        """The engine's fingerprint (logged once); None, with a warning, if the config cannot be read."""
        try:
            fingerprint = engine_fingerprint(self.vllm_config, model_name=self.recorder_settings.model_name)
        except Exception as error:  # a config this vLLM version lays out differently must not stop the engine
            logger.warning("llmvisor: cannot read the engine fingerprint (%s: %s); steps carry none", type(error).__name__, error)
            return None
        logger.info("llmvisor: engine fingerprint %s: %s", fingerprint.id, json.dumps(fingerprint.to_dict()))
        if self.trace_path:
            write_fingerprint_record(fingerprint, self.trace_path)
        return fingerprint

    def schedule(self, *args, **kwargs):
        self.step_clock.scheduler_called(time.perf_counter())
        scheduler_output = self._schedule_step(*args, **kwargs)
        started = time.perf_counter()
        if self._kv_meter is not None:
            self._kv_observe()
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self._kv_meter is not None:
                self._recorder_time_s += time.perf_counter() - started
            return scheduler_output
        if not self.is_recording:
            self.step_clock.scheduled(id(scheduler_output), time.perf_counter())
            return scheduler_output
        slices = self._slices(scheduler_output)
        finished = time.perf_counter()
        if self._lora is not None:
            self._lora_in_flight[id(scheduler_output)] = LoraRecorder.step_adapters(self.requests, [s[0] for s in slices])
        self._in_flight[id(scheduler_output)] = (slices, finished - started)
        self.step_clock.scheduled(id(scheduler_output), finished)
        return scheduler_output

    def _schedule_step(self, *args, **kwargs):
        """vLLM's scheduling decision; subclasses that steer it override this, so their work is not timed."""
        return super().schedule(*args, **kwargs)

    def step_timing(self, scheduler_output, entered_s: float) -> tuple[float, float] | None:
        """(start, latency) of the step whose output this is, or None for an empty step; once per step,
        at the top of ``update_from_output`` (subclasses that need it first call it and pass it on)."""
        timing = self._step_timing_cache
        if timing is not None and timing[0] == id(scheduler_output):
            return timing[1]
        self.step_clock.scheduler_called(entered_s)
        result = self.step_clock.output_arrived(id(scheduler_output), entered_s)
        self._step_timing_cache = (id(scheduler_output), result)
        return result

    def update_from_output(self, scheduler_output, model_runner_output):
        entered = time.perf_counter()
        entered_ns = time.perf_counter_ns()
        timing = self.step_timing(scheduler_output, entered)
        self._step_timing_cache = None
        in_flight = self._in_flight.pop(id(scheduler_output), None)
        adapters = self._lora_in_flight.pop(id(scheduler_output), None) if self._lora is not None else None
        if self._kv_meter is not None:
            # the pool has not changed since the last reading: bill it up to now, when the step's output arrived
            kv_started = time.perf_counter()
            self._kv_meter.advance(entered_ns)
        if in_flight is not None and timing is not None:
            # Recorded (and relayed) before vLLM processes the output, so no client can have an answer from a step
            # that was not handed over yet.
            slices, schedule_overhead_s = in_flight
            kv = None
            if self._kv_meter is not None:
                block_ns, step_kv = self._kv_meter.drain([s[0] for s in slices])
                slices = [(*s, held) for s, held in zip(slices, block_ns)]
                kv = [step_kv.interval_ns, step_kv.idle_cached_block_ns, step_kv.free_block_ns,
                      step_kv.carried_in_block_ns, step_kv.carried_out_block_ns]
                self._kv_time_s += time.perf_counter() - kv_started
            if self.orphaned_since_s is not None:
                slices = self._orphaned(slices)
            named = None
            if adapters is not None:
                named, matched = self._lora.named_element(scheduler_output, adapters)
                if not matched and self._lora.num_unmatched_steps == 1:
                    logger.warning("llmvisor: step %d: the worker's LoRA record is missing or ran other adapters than "
                                   "scheduled; its loads are recorded as none (counted in the log at shutdown)",
                                   self.num_recorded_steps)
            start, latency_s = timing
            self._record(start, latency_s, slices, entered, kv, named)
            overhead_s = schedule_overhead_s + time.perf_counter() - entered
            self._recorder_time_s += overhead_s
            self._max_step_fraction = max(self._max_step_fraction, overhead_s / latency_s)
            if len(self.overhead_s_per_step) < MAX_KEPT_STEPS:
                self.overhead_s_per_step.append(overhead_s)
                self.latency_s_per_step.append(latency_s)
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._kv_meter is not None:
            # what vLLM freed (finished requests' blocks) counts as freed from the output's arrival on: a request's
            # blocks are billed until its last step ended
            started = time.perf_counter()
            self._kv_observe(since_ns=entered_ns)
            if not self.is_recording:  # no step drains the meter (it runs for a subclass's reading): keep it bounded
                self._kv_meter.discard()
            self._recorder_time_s += time.perf_counter() - started
        self._last_update_exit_s = time.perf_counter()
        return result

    def finish_requests(self, request_ids, finished_status):
        """vLLM's abort (or stop-string finish) from outside a step; the KV meter bills the freed blocks up to
        now, and forgets a request no step in flight will bill (what it held since its last slice is carried out
        and unbilled: `llmvisor.core.kv_memory.StepKv`)."""
        result = super().finish_requests(request_ids, finished_status)
        if self._kv_meter is not None:
            self._kv_observe()
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            in_flight = {s[0] for slices, _ in self._in_flight.values() for s in slices}
            for request_id in ids:
                if request_id not in in_flight and request_id not in self.requests:
                    self._kv_meter.forget(request_id)
        return result

    def _slices(self, scheduler_output) -> list[tuple]:
        """(request_id, tenant, num_new_tokens, num_context_tokens, is_prefill, num_shared_context_tokens,
        effective_context_tokens, num_cached_prompt_tokens) for each scheduled request.

        A newly scheduled request's computed tokens are its prefix-cache hits (vLLM counts the same number as the
        request's ``num_cached_tokens``); a request scheduled before (running, or resumed after preemption)
        records 0, so each request's cached prompt tokens are counted once."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        cached = scheduler_output.scheduled_cached_reqs
        contexts = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
        num_first = len(contexts)
        contexts.extend(zip(cached.req_ids, cached.num_computed_tokens))
        shared, effective = self._shared_context_columns(contexts)
        slices = []
        for index, ((request_id, num_context), num_shared, num_effective) in enumerate(zip(contexts, shared, effective)):
            request = self.requests[request_id]
            num_new = num_scheduled[request_id]
            tenant = self.tenant_of(request)
            is_prefill = num_context < request.num_prompt_tokens or (num_new > 1 and request_id not in spec_tokens)
            num_cached_prompt = num_context if index < num_first else 0
            slices.append((request_id, tenant, num_new, num_context, is_prefill, num_shared, num_effective, num_cached_prompt))
        return slices

    def tenant_of(self, request) -> str:
        return request_tenant(request, self.tenant_key, self.default_tenant)

    # ---------------------------------------------------------------------------------------------------
    # The API server's death

    def _watch_parent(self) -> None:
        """Watch the process that started this engine-core process (vLLM's API server), if one did.

        When the API server is killed (SIGKILL, OOM), vLLM's engine core does not notice: it runs the requests
        it holds to their end, answers nobody, and then idles. A daemon thread waits on the parent's
        `multiprocessing` sentinel (readable once the parent is gone; a reparenting seen by ``os.getppid`` too)
        and then stops the engine (`_parent_died`). An engine in the process that runs it (``LLM``) has no
        such parent and is not watched."""
        parent = multiprocessing.parent_process()
        if parent is None or parent.sentinel is None:
            return
        threading.Thread(target=self._await_parent_death, args=(parent.pid, parent.sentinel), name="llmvisor-parent-watch", daemon=True).start()

    def _await_parent_death(self, parent_pid: int, sentinel: int) -> None:
        from multiprocessing.connection import wait

        while not wait([sentinel], timeout=PARENT_POLL_S) and os.getppid() == parent_pid:
            pass
        self._parent_died(parent_pid)

    def _parent_died(self, parent_pid: int) -> None:
        """Record the steps still to come as orphaned and stop the engine as vLLM's SIGTERM does, aborting (not
        draining) what it runs, since no answer can reach a client; exit outright if that takes too long."""
        self.orphaned_since_s = time.perf_counter()
        logger.error(
            "llmvisor: the API server (pid %d) is gone (seen at unix time %.6f); stopping the engine. Steps that end "
            "from now on are recorded under tenant %r (measured, billed to no tenant)",
            parent_pid, self.orphaned_since_s + self._wall_minus_perf_s, ORPHANED_TENANT,
        )
        try:
            self.vllm_config.shutdown_timeout = 0
        except Exception as error:  # a config that refuses the change still stops, after draining
            logger.warning("llmvisor: cannot switch the engine's shutdown to abort (%s)", error)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_EXIT_AFTER_S)
        logger.error("llmvisor: the engine has not exited %.0f s after its API server died; exiting now", ORPHAN_EXIT_AFTER_S)
        try:
            self.flush_trace()
        finally:
            os._exit(1)

    def _orphaned(self, slices: list[tuple]) -> list[tuple]:
        """A step that ended after the API server died: its slices under `ORPHANED_TENANT`."""
        self.num_orphaned_steps += 1
        return [(s[0], ORPHANED_TENANT, *s[2:]) for s in slices]

    def _start_delivery(self) -> tuple[TraceWriter | None, StepPusher | None, StepRelay | None]:
        """With a service URL, a delivery process writes the trace and pushes (`StepRelay`: each step leaves this
        process as it ends, so vLLM's kill at shutdown loses none); without, this process writes the trace."""
        if self.trace_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.trace_path)), exist_ok=True)
            logger.info("llmvisor: recording step trace of run %s to %s", self.run_id, self.trace_path)
        url = service_url_from_env()
        if url:
            header = {
                "columns": self._constant_columns,
                "warmup_steps": self.recorder_settings.warmup_steps,
                "trace_path": os.path.abspath(self.trace_path) if self.trace_path else None,
                "engine_fingerprint": self.engine_fingerprint.to_dict() if self.engine_fingerprint else None,
            }
            relay = StepRelay(header)
            logger.info(
                "llmvisor: steps of run %s go to the accounting service at %s through delivery process %d",
                self.run_id, url, relay.pid,
            )
            return None, None, relay
        metadata = {"engine_fingerprint": self.engine_fingerprint.to_dict()} if self.engine_fingerprint else None
        writer = TraceWriter(self.trace_path, flush_every_steps=1 << 62, metadata=metadata) if self.trace_path else None
        return writer, None, None

    def _record(self, start_s: float, latency_s: float, slices: list[tuple], now_s: float, kv: list | None = None,
                named: dict | None = None) -> None:
        if self._relay is not None:
            step = [self.num_recorded_steps, start_s + self._wall_minus_perf_s, latency_s, slices]
            self._relay.send(relayed_step(step, kv, named))
            self.num_recorded_steps += 1
        else:
            with self._flush_lock:
                self._unwritten.append((start_s, latency_s, slices, kv, named))
                self.num_recorded_steps += 1
            if (
                len(self._unwritten) >= self.recorder_settings.flush_every_steps
                or now_s - self._last_flush_s >= self.recorder_settings.flush_interval_s
            ):
                self.flush_trace()
        self._recorded_latency_s += latency_s

    def _flush_when_idle(self) -> None:
        """Write recorded steps once the engine has run none for `IDLE_FLUSH_AFTER_S`, or the flush interval has
        passed: the engine loop calls no scheduler method while idle, so its own check cannot do it."""
        interval_s = self.recorder_settings.flush_interval_s
        while not self._flush_stop.wait(IDLE_FLUSH_AFTER_S / 2):
            if not self._unwritten:
                continue
            now_s = time.perf_counter()
            if now_s - self._last_update_exit_s >= IDLE_FLUSH_AFTER_S or now_s - self._last_flush_s >= interval_s:
                self.flush_trace()

    def _setup_kv_meter(self) -> None:
        """The KV memory-time meter (`llmvisor.core.kv_memory.KvMeter`), on when steps are recorded (subclasses whose
        policy needs KV memory-time switch it on with `start_kv_meter`)."""
        self._kv_meter: KvMeter | None = None
        self._kv_errors = 0
        self._kv_time_s = 0.0
        self._kv_meter_failed = False
        if self.trace_path or service_url_from_env():
            self.start_kv_meter()

    def start_kv_meter(self) -> bool:
        """Meter KV memory from now on (once; later calls return whether it runs): after each call that can change the
        block pool the recorder reads who holds which blocks (`_kv_observe`). When steps are recorded, the pool's size
        and block bytes become constant columns of the run (trace format version 3) and each step drains the meter;
        otherwise its readings are there for a subclass (`KvMeter.reading`) and nothing accumulates. False, with a
        warning logged, when this engine's KV cache cannot be read."""
        if self._kv_meter is not None or self._kv_meter_failed:
            return self._kv_meter is not None
        try:
            manager = self.kv_cache_manager
            self._kv_pool_blocks = pool_blocks(manager)
            bytes_per_block = block_bytes(self.kv_cache_config, self.parallel_config.tensor_parallel_size)
            self._kv_idle = IdleCacheCount(manager.block_pool)
            self._kv_holdings = RequestHoldings(manager, self._kv_idle)
        except Exception as error:  # a KV cache layout this vLLM version lays out differently must not stop the engine
            self._kv_meter_failed = True
            logger.warning("llmvisor: cannot meter KV memory (%s: %s); steps carry step time only", type(error).__name__, error)
            return False
        self._kv_meter = KvMeter(self._kv_pool_blocks, time.perf_counter_ns())
        self._constant_columns["kv_pool_blocks"] = self._kv_pool_blocks
        self._constant_columns["kv_block_bytes"] = bytes_per_block
        logger.info("llmvisor: metering KV memory: %d blocks of %d bytes", self._kv_pool_blocks, bytes_per_block)
        return True

    def _setup_lora(self) -> None:
        """With LoRA enabled and steps recorded, each slice's adapter and each step's adapters and loads (trace format
        4), read from the worker when it runs in this process (`llmvisor.engines.vllm.lora`); else none, said once."""
        self._lora: LoraRecorder | None = None
        self._lora_in_flight: dict[int, list] = {}
        if self.vllm_config.lora_config is None or not (self.trace_path or service_url_from_env()):
            return
        model_runner = in_process_model_runner()
        if model_runner is None or getattr(model_runner, "lora_manager", None) is None:
            logger.warning("llmvisor: LoRA is enabled but the worker runs outside this process (executor %s): adapters "
                           "and adapter loads are not recorded (trace format 4 needs the uni executor)",
                           self.parallel_config.distributed_executor_backend)
            return
        ranks = AdapterRanks()
        try:
            events = WorkerLoraEvents(model_runner, ranks)
        except AttributeError as error:  # a worker this vLLM version lays out differently must not stop the engine
            logger.warning("llmvisor: cannot read the worker's LoRA adapters (%s); adapters are not recorded", error)
            return
        self._lora = LoraRecorder(events, ranks)
        logger.info("llmvisor: recording LoRA adapters (max_loras %d, max_cpu_loras %s)",
                    self.vllm_config.lora_config.max_loras, self.vllm_config.lora_config.max_cpu_loras)

    def _kv_observe(self, since_ns: int | None = None) -> None:
        """The pool as it stands now, to the KV meter (holding from ``since_ns``, when given: the meter has billed
        up to then). A reading the meter refuses (holdings that do not add up) is logged and billed to no one
        (counted as free) rather than stopping the engine."""
        manager = self.kv_cache_manager
        now_ns = time.perf_counter_ns()
        held = self._kv_pool_blocks - manager.block_pool.get_num_free_blocks()
        try:
            self._kv_read(manager, now_ns if since_ns is None else since_ns, held)
        finally:
            self._kv_time_s += (time.perf_counter_ns() - now_ns) / 1e9

    def _kv_read(self, manager, now_ns: int, held: int) -> None:
        try:
            self._kv_meter.observe(now_ns, self._kv_holdings.read(held), held, self._kv_idle.count)
        except KvMemoryError as error:
            self._kv_errors += 1
            if self._kv_errors == 1:
                logger.error("llmvisor: KV memory reading refused (%s); such readings are billed to no one", error)
            self._kv_meter.observe(now_ns, {}, 0, 0)

    def _setup_kv_sharing(self) -> None:
        """Find the KV cache group whose blocks hold every token of a request's context (full attention).

        Without prefix caching, or without such a group, no two requests hold the same block."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self._kv_group: int | None = None
        self._kv_block_size = 0
        if not getattr(self.kv_cache_manager, "enable_caching", False):
            return
        for index, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if isinstance(group.kv_cache_spec, FullAttentionSpec):
                self._kv_group = index
                self._kv_block_size = int(group.kv_cache_spec.block_size)
                return
        logger.warning("llmvisor: no full-attention KV cache group; shared-context columns record no sharing")

    def _shared_context_columns(self, contexts: list[tuple[str, int]]) -> tuple[list[int], list[float]]:
        """Per (request_id, num_context_tokens): the step's shared-KV columns (`kv_sharing`).

        A block is known by its object's identity: the block pool keeps one `KVCacheBlock` per physical
        block for the engine's lifetime, and reading ``id()`` touches no block (cheaper than ``block_id``
        right after a step's kernels, when Python runs with cold caches)."""
        if self._kv_group is None:
            return [0] * len(contexts), [float(c) for _, c in contexts]
        req_to_blocks = self.kv_cache_manager.coordinator.single_type_managers[self._kv_group].req_to_blocks
        block_size = self._kv_block_size
        blocks = []
        first_ids = []
        for request_id, num_context in contexts:
            request_blocks = req_to_blocks.get(request_id, ()) if num_context > 0 else ()
            blocks.append(request_blocks)
            first_ids.append(id(request_blocks[0]) if request_blocks else None)

        contexts_tokens = [c for _, c in contexts]
        return shared_context_tokens(first_ids, blocks.__getitem__, contexts_tokens, block_size, id)

    def flush_trace(self) -> None:
        """Encode the steps recorded since the last flush; append them to the trace and hand them to the service."""
        if self._relay is not None:
            self._relay.flush()
            return
        with self._flush_lock:
            self._flush_unwritten()

    def _flush_unwritten(self) -> None:
        if not self.is_recording:
            return
        first_step_id = self.num_recorded_steps - len(self._unwritten)
        header = {"columns": self._constant_columns, "warmup_steps": self.recorder_settings.warmup_steps}
        for offset, (start_s, latency_s, slices, kv, named) in enumerate(self._unwritten):
            step = [first_step_id + offset, start_s + self._wall_minus_perf_s, latency_s, slices]
            rows = step_rows(header, relayed_step(step, kv, named))
            if self._writer is not None:
                self._writer.write_step(rows)
            if self._pusher is not None:
                self._pusher.push_step(rows)
        if self._writer is not None:
            self._writer.flush()
        self._unwritten.clear()
        self._last_flush_s = time.perf_counter()

    @property
    def delivery_pid(self) -> int | None:
        """The delivery process's id (with a service URL), e.g. to wait for it after shutdown."""
        return self._relay.pid if self._relay is not None else None

    @property
    def is_recording(self) -> bool:
        return self._writer is not None or self._pusher is not None or self._relay is not None

    def recorder_overhead(self) -> RecorderOverhead:
        return RecorderOverhead(
            n_steps=self.num_recorded_steps,
            recorder_time_s=self._recorder_time_s,
            step_latency_s=self._recorded_latency_s,
            max_step_fraction=self._max_step_fraction,
            kv_meter_time_s=self._kv_time_s if self._kv_meter is not None else 0.0,
        )

    def shutdown(self) -> None:
        if self._lora is not None and self._lora.num_unmatched_steps:
            logger.warning("llmvisor: %d steps had no matching LoRA record from the worker; their loads are recorded as none",
                           self._lora.num_unmatched_steps)
        if self.orphaned_since_s is not None:
            logger.warning(
                "llmvisor: %d steps of run %s ended after the API server died; recorded under tenant %r",
                self.num_orphaned_steps, self.run_id, ORPHANED_TENANT,
            )
        # The idle-flush thread ends before the writer closes, and the last flush and the close hold its lock:
        # no flush runs into a closed (or None) writer, and no daemon thread is cut off mid-write at exit.
        self._flush_stop.set()
        if self._flush_thread is not None:
            self._flush_thread.join()
            self._flush_thread = None
        if self._relay is not None:
            self._relay.close()
            overhead = self.recorder_overhead()
            logger.info(
                "llmvisor: relayed %d steps of run %s to delivery process %d; recorder overhead %.3f%% of step time "
                "(%.1f us/step)",
                overhead.n_steps, self.run_id, self._relay.pid, 100 * overhead.fraction, overhead.recorder_time_per_step_us,
            )
            self._relay = None
        if self._writer is not None:
            with self._flush_lock:
                self._flush_unwritten()
                self._writer.close()
            overhead = self.recorder_overhead()
            logger.info(
                "llmvisor: recorded %d steps of run %s to %s; recorder overhead %.3f%% of step time (%.1f us/step)",
                overhead.n_steps,
                self.run_id,
                self.trace_path,
                100 * overhead.fraction,
                overhead.recorder_time_per_step_us,
            )
            with self._flush_lock:
                self._writer = None
        if self._pusher is not None:
            with self._flush_lock:
                self._flush_unwritten()
            if not self._pusher.close():
                logger.warning("llmvisor: some steps are not acknowledged by the service yet; they stay in the spool %s", self._pusher.spool_path)
            self._pusher = None
        super().shutdown()
