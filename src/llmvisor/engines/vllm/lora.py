"""LoRA adapters for the recorder (trace format 4): each slice's adapter and rank, and per step the adapters it ran
and those loaded for it, read from vLLM's worker.

**Adapter and rank.** A request's adapter is its ``lora_request`` (vLLM's ``LoRARequest``; None for the base
model), named by ``lora_name``. Its rank is the ``r`` of the adapter's ``adapter_config.json`` under
``lora_request.lora_path``, read once per adapter and kept (`AdapterRanks`); where that file cannot be read (a path
vLLM resolves elsewhere), the rank vLLM's worker loaded the adapter with.

**Loads: why they are read from the worker, not inferred.** vLLM's scheduler does not see the worker's LoRA slots.
The worker (``vllm/lora/worker_manager.py`` ``LRUCacheWorkerLoRAManager``, ``vllm/lora/model_manager.py``
``LRUCacheLoRAModelManager``, vLLM 0.32) keeps two LRU caches: adapters read from disk (``max_cpu_loras``, default
``max_loras``) and adapters active in the slots the kernels read (``max_loras``). For each step the model runner calls
``set_active_adapters`` with the *set* of the batch's ``LoRARequest``s, and adds them one by one in that set's
iteration order: an adapter not cached is read from disk (evicting the least recently used; an evicted adapter leaves
its slot too), then activated (copied into a slot, evicting the least recently used active one). The order matters:
with two slots holding A (older) and B, a step running {A, C} that adds C first evicts A, then reads A back from disk
and evicts B (two loads); adding A first touches it and C evicts B (one load). The set's order follows the hash of
``lora_name`` (randomised per process unless ``PYTHONHASHSEED`` is set) and the insertion history of the model
runner's batch, so a mirror of the LRU caches in the scheduler cannot know it. The recorder therefore reads what the
worker did: `WorkerLoraEvents` wraps, on this engine's own objects, the model runner's ``execute_model`` (to know
which scheduler output runs), the LoRA manager's ``set_active_adapters`` and ``_load_adapter`` (a disk load) and the
adapter manager's ``activate_adapter`` (True when it copied an adapter into a slot). That needs the worker in the
scheduler's process: vLLM's ``uni`` executor (the CPU build's, and any engine with one worker). With worker
processes (``mp``, ``ray``: tensor or pipeline parallel) the recorder records no LoRA columns and says so at start.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict

from llmvisor.core.lora_trace import encode_adapters

MAX_PENDING_STEPS = 64
"""Worker records kept for steps the recorder has not taken (an executed step whose output never came back)."""
FRAMES_SEARCHED = 16


class AdapterRanks:
    """Each adapter's rank, read once from its ``adapter_config.json`` (``r``), else from what the worker loaded."""

    def __init__(self) -> None:
        self._ranks: dict[str, int] = {}
        self.loaded_ranks: dict[str, int] = {}
        """Filled by `WorkerLoraEvents`: the rank of each adapter the worker read from disk."""
        self.unreadable: set[str] = set()

    def rank(self, lora_request) -> int | None:
        name = lora_request.lora_name
        rank = self._ranks.get(name)
        if rank is not None:
            return rank
        if name not in self.unreadable:
            try:
                with open(os.path.join(str(lora_request.lora_path), "adapter_config.json"), encoding="utf-8") as handle:
                    value = json.load(handle)["r"]
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    self._ranks[name] = value
                    return value
            except (OSError, ValueError, KeyError, TypeError):
                pass
            self.unreadable.add(name)
        rank = self.loaded_ranks.get(name)
        if rank is not None:
            self._ranks[name] = rank
        return rank


def in_process_model_runner():
    """The model runner of the engine whose scheduler is being built, when it runs in this process; else None.

    vLLM's ``EngineCore`` builds its executor, then its scheduler: the scheduler's constructor is called from
    ``EngineCore.__init__``, whose ``self`` holds ``model_executor``. The ``uni`` executor holds its one worker
    (``driver_worker.worker``); executors with worker processes hold none."""
    frame = sys._getframe(1)
    for _ in range(FRAMES_SEARCHED):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        executor = getattr(owner, "model_executor", None)
        if executor is not None:
            worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
            return getattr(worker, "model_runner", None)
        frame = frame.f_back
    return None


class WorkerLoraEvents:
    """What the in-process worker did with LoRA adapters, per scheduler output it executed (module docstring)."""

    def __init__(self, model_runner, ranks: AdapterRanks) -> None:
        manager = model_runner.lora_manager
        self._ranks = ranks
        self._current = None
        self._open: dict | None = None
        self._names: dict[int, str] = {}
        self._pending: OrderedDict[int, tuple[object, dict]] = OrderedDict()
        self.manager = manager
        execute_model = model_runner.execute_model
        set_active_adapters = manager.set_active_adapters
        load_adapter = manager._load_adapter
        activate_adapter = manager._adapter_manager.activate_adapter

        def executing(scheduler_output, *args, **kwargs):
            self._current = scheduler_output
            return execute_model(scheduler_output, *args, **kwargs)

        def setting(requests, mapping):
            record = {"requested": {r.lora_name for r in requests if r}, "loads": [], "disk_loads": []}
            for request in requests:
                if request:
                    self._names[request.lora_int_id] = request.lora_name
            self._open = record
            try:
                return set_active_adapters(requests, mapping)
            finally:
                self._open = None
                current = self._current
                if current is not None:
                    self._pending[id(current)] = (current, record)
                    while len(self._pending) > MAX_PENDING_STEPS:
                        self._pending.popitem(last=False)

        def loading(lora_request):
            lora = load_adapter(lora_request)
            if self._open is not None:
                self._open["disk_loads"].append(lora_request.lora_name)
            rank = getattr(lora, "rank", None)
            if isinstance(rank, int) and rank > 0:
                self._ranks.loaded_ranks[lora_request.lora_name] = rank
            return lora

        def activating(lora_id):
            activated = activate_adapter(lora_id)
            if activated and self._open is not None:
                self._open["loads"].append(self._names.get(lora_id, str(lora_id)))
            return activated

        model_runner.execute_model = executing
        manager.set_active_adapters = setting
        manager._load_adapter = loading
        manager._adapter_manager.activate_adapter = activating

    def take(self, scheduler_output) -> dict | None:
        """The worker's record of this step ({"requested", "loads", "disk_loads"}), or None if it made none."""
        entry = self._pending.pop(id(scheduler_output), None)
        if entry is None or entry[0] is not scheduler_output:
            return None
        return entry[1]

    def peek(self, scheduler_output) -> dict | None:
        """`take`'s record, left for the recorder to take (the fair scheduler charges the step's loads first)."""
        entry = self._pending.get(id(scheduler_output))
        return entry[1] if entry is not None and entry[0] is scheduler_output else None

    def resident(self) -> tuple[list[str], list[str]]:
        """(adapters in the slots, adapters in the CPU cache) now, by name, least recently used first."""
        adapters = self.manager._adapter_manager
        return ([self._names.get(i, str(i)) for i in adapters._active_adapters.cache],
                [self._names.get(i, str(i)) for i in adapters._registered_adapters.cache])


class LoraRecorder:
    """The recorder's LoRA part: per slice (name, rank) at schedule time, per step the named element of the relayed
    form (`llmvisor.core.relayed.NAMED_INDEX`) once the step's output is back."""

    def __init__(self, events: WorkerLoraEvents, ranks: AdapterRanks) -> None:
        self.events = events
        self.ranks = ranks
        self.num_unmatched_steps = 0
        """Steps whose worker record was missing or ran other adapters than the scheduler sent (logged, loads empty)."""

    @staticmethod
    def step_adapters(requests: dict, request_ids) -> list:
        """Each scheduled request's ``LoRARequest`` (None for the base model), in slice order."""
        return [requests[request_id].lora_request for request_id in request_ids]

    def named_element(self, scheduler_output, adapters: list) -> tuple[dict, bool]:
        """({"slice": {lora_name, lora_rank}, "step": {step_loras, step_lora_loads, step_lora_disk_loads}}, whether
        the worker's record matched the step)."""
        names = [a.lora_name if a else "" for a in adapters]
        ranks = [(self.ranks.rank(a) or 0) if a else 0 for a in adapters]
        ran = {n for n in names if n}
        record = self.events.take(scheduler_output)
        matched = record is not None and record["requested"] == ran
        if not matched:
            self.num_unmatched_steps += 1
            loads, disk_loads = [], []
        else:
            loads, disk_loads = record["loads"], record["disk_loads"]
        return {"slice": {"lora_name": names, "lora_rank": ranks},
                "step": {"step_loras": encode_adapters(ran), "step_lora_loads": encode_adapters(loads),
                         "step_lora_disk_loads": encode_adapters(disk_loads)}}, matched
