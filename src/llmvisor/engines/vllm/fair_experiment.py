"""One policy's run of the fairness experiment on the real vLLM engine (driven by `llmvisor.fairness.experiment`).

Runs in its own process (``python -m llmvisor.engines.vllm.fair_experiment SPEC.json``) so each policy gets a
fresh engine. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, async scheduling off),
with the step recorder on: ``fcfs`` is vLLM's own scheduler plus the recorder (`RecordingScheduler`), ``tokens``
and ``attributed`` are `FairScheduler` with that cost. Arrivals follow a schedule fixed by the seed, the same
for every policy; each step's new output tokens are logged with the time the step returned.

The spec (JSON) holds ``policy``, ``name`` (the run's name: the policy, ``alone-TENANT`` for a tenant run
alone, ``attributed-slo`` for attributed VTC with admission control), optional ``tpot_slo_s``, ``out_dir``, ``model_dir`` (engine config folder), ``model_path`` (llmvisor
model), ``engine`` (EngineSettings fields) and ``workload`` (see `llmvisor.fairness.experiment.run_experiment`), and
optionally ``kv_pool_blocks`` (the KV pool's usable blocks: vLLM's ``num_gpu_blocks_override`` less its null block)
and ``block_size``. Tenants with a ``mix`` (the memory-bound set-up, `llmvisor.fairness.memory_experiment`) draw each
request's prompt and output lengths from a shipped request-length mix (`mix_arrival_schedule`); a workload with
``only_tenant`` sends that tenant's requests alone, the same ones it sends beside the others. Every preemption is
logged with its time and tenant.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from llmvisor.engines.vllm.driver import EngineSettings, check_model_dir, configure_environment, freeze_startup_objects
from llmvisor.fairness.policy import POLICIES


def arrival_schedule(workload: dict) -> list[dict]:
    """Every request of the run, sorted by arrival: Poisson arrivals per tenant, same seed for every policy.

    A long-context tenant's requests continue its conversations in turn (request k: conversation k mod n),
    so with more conversations than requests running at once no two running requests share a history.
    """
    rng = np.random.default_rng(workload["seed"])
    requests = []
    for tenant in workload["tenants"]:
        t = float(rng.exponential(1.0 / tenant["rate_rps"]))
        k = 0
        while t < workload["duration_s"]:
            requests.append(
                {
                    "request_id": f"{tenant['name']}-{k:05d}",
                    "tenant": tenant["name"],
                    "arrival_s": t,
                    "doc": k % tenant["n_conversations"] if tenant["history_tokens"] else -1,
                    "prompt_seed": int(rng.integers(0, 2**31)),
                }
            )
            k += 1
            t += float(rng.exponential(1.0 / tenant["rate_rps"]))
    return sorted(requests, key=lambda r: r["arrival_s"])


def mix_lengths(mix: str, scale: float, max_model_len: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths of every row of a shipped request-length mix (`llmvisor.shipped.WORKLOAD_FILES`, named
    without ``.csv``): both times ``scale`` (rounded, at least 1), then clipped so the prompt is shorter than
    ``max_model_len`` and prompt + output fits it."""
    from llmvisor import shipped
    from llmvisor.core.workloads import read_workload_csv

    rows = read_workload_csv(shipped.workloads_dir() / f"{mix}.csv")
    out = []
    for row in rows:
        prompt = min(max(1, round(row.prompt_len * scale)), max_model_len - 1)
        out.append((prompt, min(max(1, round(row.output_len * scale)), max_model_len - prompt)))
    return out


def mix_arrival_schedule(workload: dict, max_model_len: int) -> list[dict]:
    """Every request of a run whose tenants draw lengths from mixes, sorted by arrival: per tenant its own random
    stream (seeded by the workload's seed and the tenant's place in the workload), Poisson arrivals at its
    ``rate_rps``, each request a row of its ``mix`` drawn at random. With ``only_tenant`` the others' requests are
    left out, so a tenant alone gets exactly the requests it gets beside the others."""
    requests = []
    for index, tenant in enumerate(workload["tenants"]):
        rng = np.random.default_rng([workload["seed"], index])
        lengths = mix_lengths(tenant["mix"], tenant.get("length_scale", 1.0), max_model_len)
        t = float(rng.exponential(1.0 / tenant["rate_rps"]))
        k = 0
        while t < workload["duration_s"]:
            prompt, output = lengths[int(rng.integers(len(lengths)))]
            requests.append({
                "request_id": f"{tenant['name']}-{k:05d}", "tenant": tenant["name"], "arrival_s": t, "doc": -1,
                "prompt_seed": int(rng.integers(0, 2**31)), "prompt_tokens": prompt, "output_tokens": output,
            })
            k += 1
            t += float(rng.exponential(1.0 / tenant["rate_rps"]))
    only = workload.get("only_tenant")
    return sorted((r for r in requests if only is None or r["tenant"] == only), key=lambda r: r["arrival_s"])


def documents(workload: dict, vocab_size: int) -> dict[tuple[str, int], list[int]]:
    """The long-context tenants' conversation histories (prefix-cached after their warm-up prefill)."""
    docs = {}
    for index, tenant in enumerate(workload["tenants"]):
        for d in range(tenant.get("n_conversations", 0) if tenant.get("history_tokens") else 0):
            rng = np.random.default_rng([workload["seed"], index, d])
            docs[(tenant["name"], d)] = rng.integers(100, vocab_size - 1, tenant["history_tokens"]).tolist()
    return docs


def run(spec: dict) -> dict:
    policy = spec["policy"]
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "trace.jsonl"
    if trace_path.exists():
        trace_path.unlink()
    settings = EngineSettings(model=spec["model_dir"], **spec["engine"])
    has_weights = check_model_dir(settings.model)
    configure_environment(settings)
    os.environ["LLMVISOR_TRACE_PATH"] = str(trace_path)
    name = spec.get("name", policy)
    os.environ["LLMVISOR_RUN_ID"] = f"fairness-{name}"
    os.environ["LLMVISOR_UNIQUE_RUN_ID"] = "0"
    os.environ["LLMVISOR_WARMUP_STEPS"] = "0"
    fair_config = {"cost": policy if policy != "fcfs" else "tokens", "model": spec["model_path"]}
    if spec.get("tpot_slo_s") is not None:
        fair_config["tpot_slo_s"] = spec["tpot_slo_s"]
    if spec.get("tpot_prediction_factor") is not None:
        fair_config["tpot_prediction_factor"] = spec["tpot_prediction_factor"]
    os.environ["LLMVISOR_FAIR_CONFIG"] = json.dumps(fair_config)

    import torch

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    from vllm import LLM, SamplingParams

    from llmvisor.engines.vllm.fair import FairScheduler
    from llmvisor.engines.vllm.recorder import RecordingScheduler
    from llmvisor.fairness.policy import FairnessConfig

    started_engine = time.perf_counter()
    scheduler_cls = RecordingScheduler if policy == "fcfs" else FairScheduler
    kwargs = settings.llm_kwargs(has_weights=has_weights, enable_prefix_caching=True, scheduler_cls=scheduler_cls)
    if spec.get("kv_pool_blocks") is not None:
        kwargs["num_gpu_blocks_override"] = int(spec["kv_pool_blocks"]) + 1  # vLLM's null block is no one's
    if spec.get("block_size") is not None:
        kwargs["block_size"] = int(spec["block_size"])
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - started_engine
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    vocab_size = int(engine.vllm_config.model_config.get_vocab_size())
    workload = spec["workload"]
    mixed = any("mix" in t for t in workload["tenants"])
    only = workload.get("only_tenant")
    tenants = {t["name"]: t for t in workload["tenants"] if only is None or t["name"] == only}
    docs = documents(workload, vocab_size)
    preemptions: list[tuple[float, str]] = []
    preempt = scheduler._preempt_request

    def logged_preemption(request, *args, **kwargs):
        preemptions.append((time.perf_counter(), scheduler.tenant_of(request)))
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = logged_preemption

    def params(tenant: str, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant}, temperature=0.0)

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    # Warm-up, outside the measurement: prefill each conversation history once (so it sits in the prefix cache)
    # and run a few requests of each tenant's shape through the engine.
    for (name, d), tokens in docs.items():
        engine.add_request(f"warmup-doc-{name}-{d}", {"prompt_token_ids": tokens}, params("warmup", 1))
    drain()
    rng = np.random.default_rng(0)
    for name, tenant in tenants.items():
        if "mix" in tenant:  # a few of its own requests (the first the schedule would draw for a seed of 0)
            lengths = mix_lengths(tenant["mix"], tenant.get("length_scale", 1.0), settings.max_model_len)
            shapes = [lengths[int(rng.integers(len(lengths)))] for _ in range(2)]
        else:
            shapes = [(tenant["prompt_tokens"], tenant["output_tokens"])] * 4
        for k, (prompt_len, output_len) in enumerate(shapes):
            prompt = (docs[(name, k % tenant["n_conversations"])] if tenant.get("history_tokens") else []) + rng.integers(100, vocab_size - 1, prompt_len).tolist()
            engine.add_request(f"warmup-{name}-{k}", {"prompt_token_ids": prompt}, params("warmup", output_len))
    drain()
    if mixed:  # warm-up prompts leave nothing cached for the measured requests to hit
        scheduler.kv_cache_manager.reset_prefix_cache()
    preemptions.clear()
    # Full collections measured here at up to 0.7 s inside engine steps, ~15% of a run's engine time.
    freeze_startup_objects()
    scheduler.flush_trace()
    first_step = int(scheduler.num_recorded_steps)
    if policy != "fcfs":
        scheduler.configure(FairnessConfig.from_env())  # counters start at zero with the measurement

    schedule = mix_arrival_schedule(workload, settings.max_model_len) if mixed else arrival_schedule(workload)
    live: dict[str, dict] = {}
    events: list[dict] = []
    step_times: list[float] = []
    step_tokens: list[list[int]] = []
    tenant_index = {name: k for k, name in enumerate(tenants)}
    position = 0
    t0_wall = time.time()
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        if now >= workload["duration_s"]:
            break
        while position < len(schedule) and schedule[position]["arrival_s"] <= now:
            request = schedule[position]
            tenant = tenants[request["tenant"]]
            prompt_rng = np.random.default_rng(request["prompt_seed"])
            prompt = (docs[(request["tenant"], request["doc"])] if request["doc"] >= 0 else []) + prompt_rng.integers(
                100, vocab_size - 1, request.get("prompt_tokens", tenant.get("prompt_tokens"))
            ).tolist()
            max_tokens = request.get("output_tokens", tenant.get("output_tokens"))
            engine.add_request(request["request_id"], {"prompt_token_ids": prompt}, params(request["tenant"], max_tokens))
            live[request["request_id"]] = {
                "request_id": request["request_id"],
                "tenant": request["tenant"],
                "arrival_s": request["arrival_s"],
                "submitted_s": time.perf_counter() - t0,
                "prompt_tokens": len(prompt),
                "max_tokens": max_tokens,
                "first_token_s": None,
                "finish_s": None,
                "output_tokens": 0,
            }
            position += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, schedule[position]["arrival_s"] - now)) if position < len(schedule) else 0.01)
            continue
        outputs = engine.step()
        returned = time.perf_counter() - t0
        counts = [0] * len(tenant_index)
        for output in outputs:
            record = live.get(output.request_id)
            if record is None:
                continue
            n = len(output.outputs[0].token_ids)
            if n > record["output_tokens"]:
                counts[tenant_index[record["tenant"]]] += n - record["output_tokens"]
                if record["first_token_s"] is None:
                    record["first_token_s"] = returned
                record["output_tokens"] = n
            if output.finished:
                record["finish_s"] = returned
                events.append(live.pop(output.request_id))
        step_times.append(returned)
        step_tokens.append(counts)
    end_s = time.perf_counter() - t0
    unfinished = list(live.values())
    waiting_at_end = len(scheduler.waiting)
    engine.abort_request(list(live), internal=False)
    scheduler.flush_trace()
    result = {
        "policy": policy,
        "name": name,
        "tpot_slo_s": spec.get("tpot_slo_s"),
        "engine_start_s": engine_start_s,
        "t0_wall_s": t0_wall,
        "end_s": end_s,
        "first_step": first_step,
        "trace": str(trace_path),
        "num_arrivals": position,
        "waiting_at_end": waiting_at_end,
        "requests": events + unfinished,
        "tenants": list(tenants),
        "step_return_s": step_times,
        "step_output_tokens": step_tokens,
        "recorder_overhead": scheduler.recorder_overhead().as_dict(),
        "engine": settings.as_dict(),
        "workload": workload,
        "kv_pool_blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1),
        "block_size": int(engine.vllm_config.cache_config.block_size),
        "enable_prefix_caching": bool(engine.vllm_config.cache_config.enable_prefix_caching),
        "preemptions": [[t - t0, tenant] for t, tenant in preemptions],
    }
    if policy != "fcfs":
        result["scheduler_overhead"] = scheduler.fair_overhead()
        result["scheduler_state"] = scheduler.fair_state()
    with open(out_dir / "result.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    engine.engine_core.shutdown()
    return result


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as handle:
        spec = json.load(handle)
    result = run(spec)
    overhead = result.get("scheduler_overhead")
    if overhead:
        print(
            f"llmvisor: {result['name']}: fair scheduler's own work {100 * overhead['fraction_of_step_time']:.3f}% of step time "
            f"({overhead['added_time_per_step_us']:.1f} us/step over {overhead['n_steps']} steps)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
