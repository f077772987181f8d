"""One policy's run of the fairness experiment on the real vLLM engine (driven by `llmvisor.fairness.experiment`).

Runs in its own process (``python -m llmvisor.engines.vllm.fair_experiment SPEC.json``) so each policy gets a
fresh engine. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, async scheduling off),
with the step recorder on: ``fcfs`` is vLLM's own scheduler plus the recorder (`RecordingScheduler`), ``tokens``
and ``attributed`` are `FairScheduler` with that cost. Arrivals follow a schedule fixed by the seed, the same
for every policy; each step's new output tokens are logged with the time the step returned.

The spec (JSON) holds ``policy``, ``name`` (the run's name: the policy, ``alone-TENANT`` for a tenant run
alone, ``attributed-slo`` for attributed VTC with admission control), optional ``tpot_slo_s``, ``out_dir``, ``model_dir`` (engine config folder), ``model_path`` (llmvisor
model), ``engine`` (EngineSettings fields) and ``workload`` (see `llmvisor.fairness.experiment.run_experiment`).
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


def documents(workload: dict, vocab_size: int) -> dict[tuple[str, int], list[int]]:
    """The long-context tenants' conversation histories (prefix-cached after their warm-up prefill)."""
    docs = {}
    for index, tenant in enumerate(workload["tenants"]):
        for d in range(tenant["n_conversations"] if tenant["history_tokens"] else 0):
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
    llm = LLM(**settings.llm_kwargs(has_weights=has_weights, enable_prefix_caching=True, scheduler_cls=scheduler_cls))
    engine_start_s = time.perf_counter() - started_engine
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    vocab_size = int(engine.vllm_config.model_config.get_vocab_size())
    workload = spec["workload"]
    tenants = {t["name"]: t for t in workload["tenants"]}
    docs = documents(workload, vocab_size)

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
        for k in range(4):
            prompt = (docs[(name, k % tenant["n_conversations"])] if tenant["history_tokens"] else []) + rng.integers(100, vocab_size - 1, tenant["prompt_tokens"]).tolist()
            engine.add_request(f"warmup-{name}-{k}", {"prompt_token_ids": prompt}, params("warmup", tenant["output_tokens"]))
    drain()
    # Full collections measured here at up to 0.7 s inside engine steps, ~15% of a run's engine time.
    freeze_startup_objects()
    scheduler.flush_trace()
    first_step = int(scheduler.num_recorded_steps)
    if policy != "fcfs":
        scheduler.configure(FairnessConfig.from_env())  # counters start at zero with the measurement

    schedule = arrival_schedule(workload)
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
                100, vocab_size - 1, tenant["prompt_tokens"]
            ).tolist()
            engine.add_request(request["request_id"], {"prompt_token_ids": prompt}, params(request["tenant"], tenant["output_tokens"]))
            live[request["request_id"]] = {
                "request_id": request["request_id"],
                "tenant": request["tenant"],
                "arrival_s": request["arrival_s"],
                "submitted_s": time.perf_counter() - t0,
                "prompt_tokens": len(prompt),
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
