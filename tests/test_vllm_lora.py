"""LoRA adapters recorded from the real engine (vLLM CPU build, tiny Llama, prefix caching on as shipped): four
adapters made locally (ranks 8, 16, 64, 8) and base-model requests on an engine with two LoRA slots, so adapters are
swapped in and out of the slots and read from disk again. The trace (format 4) is read back: each slice's adapter and
rank are what its request was submitted with, and each step's adapters and loads are what the worker did, seen by
the test's own hooks on vLLM's classes and by the worker's slots after every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _tiny_llama import tiny_engine_args, write_tiny_llama

vllm = pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

RANKS = {"tenant-a": 8, "tenant-b": 16, "tenant-c": 64, "tenant-d": 8}
MAX_LORAS = 2


def probe_class(worker_events: list):
    from llmvisor.engines.vllm.recorder import RecordingScheduler

    class LoraProbe(RecordingScheduler):
        """The recorder as shipped; after each step's output, the worker's slots and CPU cache (by adapter id), and
        the test's own hook events of the step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.after: list[dict] = []
            self.worker_manager = self._lora.events.manager if self._lora is not None else None
            worker_events.clear()  # the engine's warm-up used dummy adapters

        def update_from_output(self, scheduler_output, model_runner_output):
            out = super().update_from_output(scheduler_output, model_runner_output)
            if scheduler_output.total_num_scheduled_tokens:
                adapters = self.worker_manager._adapter_manager
                self.after.append({"slots": set(adapters._active_adapters.cache),
                                   "cpu": set(adapters._registered_adapters.cache), "events": list(worker_events)})
                worker_events.clear()
            return out

    return LoraProbe


def test_each_slice_has_its_adapter_and_each_step_the_workers_loads(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.request import LoRARequest

    from llmvisor.core.lora_trace import decode_adapters
    from llmvisor.core.trace import format_version, read_trace
    from llmvisor.profile.adapters import write_adapter

    trace_path = tmp_path / "lora.jsonl"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("LLMVISOR_TRACE_PATH", str(trace_path))
    monkeypatch.setenv("LLMVISOR_RUN_ID", "lora-run")
    monkeypatch.setenv("LLMVISOR_UNIQUE_RUN_ID", "0")
    model = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=4, max_position_embeddings=1024, vocab_size=1024)
    adapters = {name: write_adapter(tmp_path / "adapters" / name, model, rank=rank, seed=i,
                                    target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
                for i, (name, rank) in enumerate(RANKS.items())}
    assert json.loads((adapters["tenant-c"].path / "adapter_config.json").read_text())["r"] == 64
    lora_ids = {name: i + 1 for i, name in enumerate(RANKS)}
    names_by_id = {i: name for name, i in lora_ids.items()}

    # the test's own view of the worker: every adapter copied into a slot, every adapter read from disk
    worker_events: list[tuple[str, str]] = []
    activate, from_checkpoint = LoRAModelManager.activate_adapter, LoRAModel.from_local_checkpoint.__func__

    def activating(self, lora_id):
        copied = activate(self, lora_id)
        if copied:
            worker_events.append(("slot", names_by_id.get(lora_id, f"dummy-{lora_id}")))
        return copied

    def reading(cls, lora_dir, *args, **kwargs):
        worker_events.append(("disk", Path(lora_dir).name))
        return from_checkpoint(cls, lora_dir, *args, **kwargs)

    monkeypatch.setattr(LoRAModelManager, "activate_adapter", activating)
    monkeypatch.setattr(LoRAModel, "from_local_checkpoint", classmethod(reading))

    args = tiny_engine_args(model, probe_class(worker_events))
    args.update(enable_prefix_caching=True, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=64, max_num_seqs=4,
                max_model_len=256)
    llm = LLM(**args)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler._lora is not None, "the recorder did not find the in-process worker"
    fingerprint = scheduler.engine_fingerprint.to_dict()
    assert (fingerprint["enable_lora"], fingerprint["max_loras"], fingerprint["max_lora_rank"]) == (True, MAX_LORAS, 64)

    # 15 requests: every fifth on the base model, the others cycling through the four adapters, so each step of
    # up to 4 requests wants up to 4 adapters of which 2 fit (vLLM's scheduler holds back the others)
    submitted = [None, *RANKS] * 3
    prompts = [{"prompt_token_ids": [10 + (7 * i + j) % 900 for j in range(20 + 3 * i)]} for i in range(len(submitted))]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False, extra_args={"tenant": f"req-{i}"})
              for i in range(len(submitted))]
    requests = [None if name is None else LoRARequest(name, lora_ids[name], str(adapters[name].path)) for name in submitted]
    outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12] * len(prompts)
    after = scheduler.after
    llm.llm_engine.engine_core.shutdown()

    trace = read_trace(trace_path)  # format 4, checked by the reader step by step
    assert format_version(list(trace.extra)) == 4
    assert trace.n_steps == len(after)
    # each slice: the adapter and rank its request was submitted with (the tenant names the request)
    submitted_by_tenant = {f"req-{i}": name or "" for i, name in enumerate(submitted)}
    names, ranks = trace.extra["lora_name"].tolist(), trace.extra["lora_rank"].tolist()
    assert names == [submitted_by_tenant[t] for t in trace.tenant.tolist()]
    assert ranks == [RANKS.get(n, 0) for n in names]
    assert {"", *RANKS} == set(names)

    # each step: its adapters, and its loads as the test's hooks saw the worker make them; the slots after it
    starts = trace.step_starts
    slots_before: set[str] = set()
    swaps = 0
    for k, (start, state) in enumerate(zip(starts.tolist(), after)):
        step_loras = decode_adapters(trace.extra["step_loras"][start])
        loads = decode_adapters(trace.extra["step_lora_loads"][start])
        disk = decode_adapters(trace.extra["step_lora_disk_loads"][start])
        slots = {names_by_id[i] for i in state["slots"]}
        cpu = {names_by_id[i] for i in state["cpu"]}
        assert len(step_loras) <= MAX_LORAS and step_loras <= slots <= cpu, k
        assert sorted(loads) == sorted(n for kind, n in state["events"] if kind == "slot"), k
        assert sorted(disk) == sorted(n for kind, n in state["events"] if kind == "disk"), k
        assert step_loras - slots_before <= loads, k  # an adapter not resident before the step was loaded for it
        swaps += len(slots_before - slots)
        slots_before = slots
    all_loads = sum(len(decode_adapters(v)) for v in trace.extra["step_lora_loads"][starts])
    all_disk = sum(len(decode_adapters(v)) for v in trace.extra["step_lora_disk_loads"][starts])
    assert swaps > 0 and all_loads > len(RANKS) and all_disk > len(RANKS), (swaps, all_loads, all_disk)
    assert scheduler._lora.num_unmatched_steps == 0
