"""The fair scheduler charges adapters on the real engine (issue #38 item 6; vLLM CPU build, tiny Llama, one LoRA slot
so adapters are swapped in and out): with a LoRA model and ``cost = "attributed"``, each tenant's counter is the
measured step times split by the shares the model gives the recorded steps with their adapters, ranks and the loads
the worker made (the recorded trace, format 4, attributed offline with ``lora=``), not the adapter-blind split."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from _lora_runs import lora_model  # noqa: E402
from _tiny_llama import tiny_engine_args, write_tiny_llama  # noqa: E402
from llmvisor.core.attribution import attribute_arrays  # noqa: E402
from llmvisor.core.features import lora_slices_of  # noqa: E402
from llmvisor.core.lora_trace import decode_adapters  # noqa: E402
from llmvisor.core.trace import read_trace  # noqa: E402
from llmvisor.fairness.policy import FairnessConfig  # noqa: E402

pytestmark = pytest.mark.vllm

RANKS = {"t64": 64, "t8": 8}


def test_the_fair_scheduler_charges_each_tenant_its_adapters_work_and_loads(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from llmvisor.engines.vllm.fair import FairScheduler
    from llmvisor.profile.adapters import write_adapter

    trace_path = tmp_path / "fair-lora.jsonl"
    for name, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "LLMVISOR_TRACE_PATH": str(trace_path), "LLMVISOR_RUN_ID": "fair-lora", "LLMVISOR_UNIQUE_RUN_ID": "0",
                        "LLMVISOR_WARMUP_STEPS": "0", "LLMVISOR_FAIR_CONFIG": json.dumps({"cost": "tokens"})}.items():
        monkeypatch.setenv(name, value)
    model_dir = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=4, max_position_embeddings=1024, vocab_size=1024)
    adapters = {name: write_adapter(tmp_path / "adapters" / name, model_dir, rank=rank, seed=i,
                                    target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
                for i, (name, rank) in enumerate(RANKS.items())}
    args = tiny_engine_args(model_dir, FairScheduler)
    args.update(enable_lora=True, max_loras=1, max_lora_rank=64, max_num_seqs=3, max_model_len=256)
    llm = LLM(**args)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler._lora is not None, "the recorder did not find the in-process worker"
        model = lora_model()
        scheduler.configure(FairnessConfig(cost="attributed"), model)
        first_step = scheduler.num_recorded_steps
        tenants = ["t64", "t8", "base"] * 3
        lora_ids = {name: i + 1 for i, name in enumerate(RANKS)}
        prompts = [{"prompt_token_ids": [10 + (5 * i + j) % 900 for j in range(24)]} for i in range(len(tenants))]
        params = [SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False, extra_args={"tenant": t}) for t in tenants]
        requests = [LoRARequest(t, lora_ids[t], str(adapters[t].path)) if t in RANKS else None for t in tenants]
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * len(prompts)
        scheduler.flush_trace()
        state = scheduler.fair_state()
        measured = np.asarray(scheduler.fair_step_latency_s)
    finally:
        llm.llm_engine.engine_core.shutdown()
    trace = read_trace(trace_path)
    trace = trace.select_steps(trace.step_id_per_step >= first_step)
    assert trace.n_steps == measured.size > 0
    lora = lora_slices_of(trace)
    loads = sum(len(decode_adapters(v)) for v in trace.extra["step_lora_loads"][trace.step_starts])
    assert loads > len(RANKS)  # one slot: the adapters were swapped in and out
    shares = attribute_arrays(model, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets, measured,
                              effective_context_tokens=trace.effective_context_tokens if trace.has_sharing_columns else None,
                              lora=lora)
    blind = attribute_arrays(model, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets, measured,
                             effective_context_tokens=trace.effective_context_tokens if trace.has_sharing_columns else None)
    for tenant in ("t64", "t8", "base"):
        offline = math.fsum(shares.share_s[trace.tenant == tenant])
        assert state["attributed_s"][tenant] == pytest.approx(offline, rel=1e-9)
        assert state["counter"][tenant] == pytest.approx(offline, rel=1e-9)
        assert offline != pytest.approx(math.fsum(blind.share_s[trace.tenant == tenant]), rel=1e-6)
    assert os.path.exists(trace_path)
