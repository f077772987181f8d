"""The fairness experiment's memory-bound set-up (``llmvisor experiment fairness-memory``): vLLM's FCFS, token VTC,
time-only (attributed) VTC and DRF over engine time and KV memory-time, on a KV pool small enough that memory binds.

**Workload** (`memory_tenants`, the same arrivals for every policy): three tenants, each sending Poisson arrivals at
``rate_rps``, every request's prompt and output lengths a random row of one of the shipped real mixes
(``llmvisor/data/workloads``), both lengths × ``length_scale`` and clipped to ``max_model_len``
(`llmvisor.engines.vllm.fair_experiment.mix_lengths`): ``hog`` arXiv summarization (long prompts, long outputs: it
decodes for many steps and holds its blocks all the while), ``chat`` Azure conversation, ``code`` Azure code (long
prompts, very short outputs: its cost is prefill compute, and it holds blocks briefly). Prompts are random tokens, so
prefix caching (on, vLLM's default) finds nothing to share. Rates are above what the engine serves: every tenant
stays backlogged.

**Alone on 1/n of the engine** (the sharing-incentive baseline, `partition_engine`): the tenant by itself, sending the
same requests at the same times (``only_tenant``), on an engine with 1/n of ``max_num_seqs`` and 1/n of the KV pool's
blocks (rounded down), and 1/n of its compute: the engine time-sliced n ways. A time slice runs whole steps, so the
token budget per step stays; a tenant backlogged throughout its run turns 1/n of the engine's time into exactly 1/n
of the throughput it measures with the whole CPU, which is how the baseline is computed (`alone_on_share`).

**Throughput**: output tokens per second of engine time over the measured interval (the experiment's windows after
its warm-up): the tenant's output tokens over the summed measured time of the interval's steps. The engine is busy
throughout every run (each run reports its busy fraction), so on a dedicated machine this is the wall-clock rate;
on a shared one it leaves out the time other processes took the CPU from the engine, which varied several-fold from
run to run on the project's 2-core machine. Every policy serves each tenant's requests in arrival order, so this is
how far along the same stream of requests the tenant got. Output tokens per wall-clock second and completions per
second are reported beside it. **Sharing incentive** is met for a tenant when its throughput under the policy is at
least its throughput alone on 1/n of the engine.

**Dominant shares** (per run, over the measured interval, unweighted): each tenant's share of engine time (the
charging model's attributed seconds over the measured step time) and of KV memory-time (its block-nanoseconds in the
trace over the pool's blocks × the wall time), and the larger of the two; Jain's index and max/min of the dominant
shares. **Service ratio**: max/min over tenants of throughput ÷ alone on 1/n. Preemptions per tenant (logged by the
engine run), and the hog's p50/p99 latency from arrival to its last token, and in the engine (first scheduled to last
token), of its requests finished in the interval.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import quantile_summary
from llmvisor.core.trace import read_trace
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.experiment import (
    ALONE_PREFIX,
    analyse_run,
    charge_model_path,
    completion_rates,
    load_run,
    machine_description,
    run_policy,
)
from llmvisor.fairness.experiment_analysis import throughput, wall_throughput
from llmvisor.fairness.policy import POLICIES, jain_index, max_min_ratio

RESULT_FILE = "fairness-memory.json"
FIGURE_FILE = "fairness-memory.png"
MIXES = {"hog": "arxiv-summarization", "chat": "azure-2023-conv", "code": "azure-2023-code"}
"""Each tenant's request-length mix (a shipped workload file, without ``.csv``)."""


def memory_tenants(*, rate_rps: float, length_scale: float) -> list[dict]:
    """The three tenants of `MIXES`, each at ``rate_rps`` with lengths × ``length_scale``."""
    if not (math.isfinite(rate_rps) and rate_rps > 0):
        raise LlmvisorError(f"--rate-rps: must be a positive number (got {rate_rps})")
    if not (math.isfinite(length_scale) and 0 < length_scale <= 1):
        raise LlmvisorError(f"--length-scale: must be in (0, 1] (got {length_scale})")
    return [{"name": name, "mix": mix, "rate_rps": rate_rps, "length_scale": length_scale} for name, mix in MIXES.items()]


def partition_engine(engine: dict, kv_pool_blocks: int, n: int) -> tuple[dict, int]:
    """The engine settings and pool of 1/n of the engine: ``max_num_seqs`` and the pool's blocks divided by n
    (rounded down, at least 1)."""
    return {**engine, "max_num_seqs": max(1, engine["max_num_seqs"] // n)}, max(1, kv_pool_blocks // n)


def alone_on_share(alone_output_tokens_per_s: float, n: int) -> float:
    """A backlogged tenant's throughput on 1/n of the engine's time, from its throughput with the whole CPU."""
    return alone_output_tokens_per_s / n


# ------------------------------------------------------------------------------------------------ analysis


def _first_scheduled(trace, t0_wall_s: float) -> dict[str, float]:
    """Each request's (external id) first scheduled step start, in seconds since the run's start."""
    starts = trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) - t0_wall_s
    slice_t = np.repeat(starts, trace.batch_size_per_step)
    first: dict[str, float] = {}
    for request_id, t in zip(trace.request_id.tolist(), slice_t.tolist()):
        first.setdefault(request_id.rsplit("-", 1)[0], t)
    return first


def memory_figures(run: dict, summary: dict, *, window_s: float, warmup_s: float) -> dict:
    """KV memory-time per tenant over the measured interval and per window (from the trace's version-3 columns: each
    slice's block-ns, each step's interval and the pool), the time and memory shares and the dominant share, the
    preemptions logged in the interval, and latencies."""
    tenants = list(run["tenants"])
    trace = read_trace(run["trace"])
    trace = trace.select_steps(trace.step_id_per_step >= run["first_step"])
    if "kv_block_ns" not in trace.extra:
        raise LlmvisorError(f"{run['trace']}: no KV memory columns (trace format 3); rerun the experiment")
    lo, hi = summary["interval_s"]
    starts = trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) - run["t0_wall_s"]
    n_windows = max(1, round((hi - lo) / window_s))
    edges = lo + window_s * np.arange(n_windows + 1)
    step_window = np.searchsorted(edges, starts, side="right") - 1
    in_range = (step_window >= 0) & (step_window < n_windows)
    slice_window = np.repeat(step_window, trace.batch_size_per_step)
    slice_in = np.repeat(in_range, trace.batch_size_per_step)
    index = {t: k for k, t in enumerate(tenants)}
    slice_tenant = np.array([index.get(str(t), -1) for t in trace.tenant.tolist()], dtype=np.int64)
    keep = slice_in & (slice_tenant >= 0)
    block_ns = np.zeros((n_windows, len(tenants)))
    np.add.at(block_ns, (slice_window[keep], slice_tenant[keep]), trace.extra["kv_block_ns"][keep].astype(np.float64))
    pool = trace.extra["kv_pool_blocks"][trace.step_starts].astype(np.float64)
    interval = trace.extra["kv_interval_ns"][trace.step_starts].astype(np.float64)
    pool_ns = np.zeros(n_windows)
    np.add.at(pool_ns, step_window[in_range], (pool * interval)[in_range])
    totals = block_ns.sum(axis=0)
    memory_share = totals / max(pool_ns.sum(), 1.0)
    attributed = np.array([summary["attributed_s"][t] for t in tenants])
    time_share = attributed / max(attributed.sum(), 1e-12)
    dominant = np.maximum(time_share, memory_share)
    preempted = dict.fromkeys(tenants, 0)
    for t, tenant in run.get("preemptions", []):
        if lo <= t < hi and tenant in preempted:
            preempted[tenant] += 1
    first = _first_scheduled(trace, run["t0_wall_s"])
    latency: dict[str, list[float]] = {t: [] for t in tenants}
    in_engine: dict[str, list[float]] = {t: [] for t in tenants}
    for r in run["requests"]:
        if r["finish_s"] is not None and lo <= r["finish_s"] < hi and r["tenant"] in latency:
            latency[r["tenant"]].append(r["finish_s"] - r["arrival_s"])
            if r["request_id"] in first:
                in_engine[r["tenant"]].append(r["finish_s"] - first[r["request_id"]])
    return {
        "kv_block_ns": dict(zip(tenants, totals.tolist())),
        "pool_block_ns": float(pool_ns.sum()),
        "time_share": dict(zip(tenants, time_share.tolist())),
        "memory_share": dict(zip(tenants, memory_share.tolist())),
        "dominant_share": dict(zip(tenants, dominant.tolist())),
        "dominant_resource": {t: "memory" if m > s else "time" for t, s, m in zip(tenants, time_share, memory_share)},
        "dominant_share_jain": jain_index(dominant) if len(tenants) > 1 else None,
        "dominant_share_max_min": max_min_ratio(dominant) if len(tenants) > 1 else None,
        "preemptions": preempted,
        "preemptions_total": int(sum(preempted.values())),
        "latency_s": {t: quantile_summary(v, (50, 99)) for t, v in latency.items()},
        "in_engine_s": {t: quantile_summary(v, (50, 99)) for t, v in in_engine.items()},
        "windows": [
            {"start_s": float(edges[w]), "end_s": float(edges[w + 1]),
             "memory_share": dict(zip(tenants, (block_ns[w] / max(pool_ns[w], 1.0)).tolist()))}
            for w in range(n_windows)
        ],
        "pool_blocks": int(run["kv_pool_blocks"]),
        "block_size": int(run["block_size"]),
    }


def sharing_incentive(summary: dict, alone: dict[str, dict], n: int) -> dict:
    """Each tenant's throughput under the policy against alone on 1/n of the engine; met where ≥ 1."""
    rates, wall = throughput(summary), wall_throughput(summary)
    baseline = {tenant: data["on_share_output_tokens_per_s"] for tenant, data in alone.items()}
    wall_baseline = {tenant: data["on_share_output_tokens_per_wall_s"] for tenant, data in alone.items()}
    ratio = {tenant: rates[tenant] / baseline[tenant] for tenant in rates if baseline.get(tenant)}
    met = {tenant: bool(value >= 1.0) for tenant, value in ratio.items()}
    return {
        "output_tokens_per_engine_s": rates,
        "output_tokens_per_wall_s": wall,
        "completions_per_s": completion_rates(summary),
        "alone_on_share_output_tokens_per_engine_s": baseline,
        "ratio": ratio,
        "ratio_wall_clock": {tenant: wall[tenant] / wall_baseline[tenant] for tenant in wall if wall_baseline.get(tenant)},
        "met": met,
        "all_met": bool(met) and all(met.values()) and len(met) == len(rates),
        "service_max_min": max_min_ratio(ratio.values()) if len(ratio) > 1 else None,
        "service_jain": jain_index(ratio.values()) if len(ratio) > 1 else None,
    }


def memory_goals(policies: dict) -> dict:
    """The issue's goal: DRF meets sharing incentive for every tenant while FCFS, token VTC or time-only VTC does not
    for at least one tenant (None where it could not be judged)."""
    verdict = {name: data["sharing_incentive"]["all_met"] for name, data in policies.items() if "sharing_incentive" in data}
    others = [name for name in ("fcfs", "tokens", "attributed") if name in verdict]
    drf = verdict.get("drf")
    return {
        "all_tenants_met": verdict,
        "drf_meets_sharing_incentive": drf,
        "baselines_missing_it": [name for name in others if not verdict[name]],
        "met": None if drf is None or not others else bool(drf and any(not verdict[name] for name in others)),
    }


# ------------------------------------------------------------------------------------------------ command


def run_memory_experiment(
    output: Path,
    *,
    latency_model_path: Path | None,
    engine_dir: Path,
    engine: dict,
    kv_pool_blocks: int,
    policies: list[str],
    workload: dict,
    window_s: float,
    warmup_s: float,
    alone: bool = True,
    analyse_only: bool = False,
    progress=None,
) -> dict:
    """Each policy, then each tenant alone on 1/n of the engine, in a fresh engine process; writes fairness-memory.json
    and fairness-memory.png in ``output``."""
    say = progress or (lambda message: None)
    policies = [str(p) for p in policies]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise LlmvisorError(f"--policy: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    if kv_pool_blocks < len(workload["tenants"]):
        raise LlmvisorError(f"--kv-pool-blocks: at least one block per tenant's share (got {kv_pool_blocks})")
    model_path = charge_model_path(latency_model_path)
    charge_model = StepLatencyModel.from_json(model_path)
    output.mkdir(parents=True, exist_ok=True)
    n = len(workload["tenants"])
    share_engine, share_pool = partition_engine(engine, kv_pool_blocks, n)
    plan = [(name, name, workload, engine, kv_pool_blocks) for name in policies]
    if alone:
        plan += [(ALONE_PREFIX + t["name"], "fcfs", {**workload, "only_tenant": t["name"]}, share_engine, share_pool)
                 for t in workload["tenants"]]
    runs = {}
    loads = {}
    for name, policy, run_workload, run_engine, pool in plan:
        out_dir = output / name
        if analyse_only:
            runs[name] = load_run(out_dir, name)
            continue
        spec = {"policy": policy, "name": name, "tpot_slo_s": None, "out_dir": str(out_dir), "model_dir": str(engine_dir),
                "model_path": model_path, "engine": run_engine, "workload": run_workload, "kv_pool_blocks": pool}
        say(f"running {name} for {run_workload['duration_s']:.0f} s (+ engine start) …")
        started = time.perf_counter()
        runs[name] = run_policy(spec, out_dir / "engine.log")
        loads[name] = os.getloadavg()[0]
        say(f"  done in {time.perf_counter() - started:.0f} s (load average {loads[name]:.2f})")
    analysed = {}
    for name, run in runs.items():
        data = analyse_run(run, charge_model, window_s=window_s, warmup_s=warmup_s)
        data["memory"] = memory_figures(run, data["summary"], window_s=window_s, warmup_s=warmup_s)
        analysed[name] = data
    alone_runs = {name.removeprefix(ALONE_PREFIX): analysed[name] for name in runs if name.startswith(ALONE_PREFIX)}
    alone_figures = {}
    for tenant, data in alone_runs.items():
        rate, wall = throughput(data["summary"])[tenant], wall_throughput(data["summary"])[tenant]
        alone_figures[tenant] = {
            "output_tokens_per_engine_s": rate,
            "output_tokens_per_wall_s": wall,
            "completions_per_s": completion_rates(data["summary"])[tenant],
            "on_share_output_tokens_per_s": alone_on_share(rate, n),
            "on_share_output_tokens_per_wall_s": alone_on_share(wall, n),
            "backlogged_throughout": tenant in data["summary"]["backlogged_throughout"],
            "summary": data["summary"],
            "memory": data["memory"],
        }
    results = {name: analysed[name] for name in policies}
    if len(alone_figures) == n:
        for data in results.values():
            data["sharing_incentive"] = sharing_incentive(data["summary"], alone_figures, n)
    first = runs[policies[0]]
    result = {
        "experiment": "fairness-memory",
        "setup": {
            "model": os.path.basename(model_path),
            "engine_model": os.path.basename(os.path.normpath(str(engine_dir))),
            "engine": {**first["engine"], "model": os.path.basename(os.path.normpath(first["engine"]["model"]))},
            "kv_pool_blocks": first["kv_pool_blocks"],
            "block_size": first["block_size"],
            "enable_prefix_caching": first["enable_prefix_caching"],
            "workload": {k: v for k, v in first["workload"].items() if k != "only_tenant"},
            "mixes": MIXES,
            "window_s": window_s,
            "warmup_s": warmup_s,
            "attribution_rule": "shapley",
            "hardware": machine_description(),
            "n_tenants": n,
            "alone_rule": (
                f"each tenant alone (the same requests at the same times), vLLM's FCFS, on 1/{n} of the engine: max_num_seqs "
                f"{share_engine['max_num_seqs']} and {share_pool} KV blocks, its output tokens per engine second with the whole "
                f"CPU divided by {n} (the engine's time sliced {n} ways)"
            ),
            "throughput_unit": "output tokens per second of engine time (the measured interval's summed step times)",
            "load_average_1m": loads or None,
        },
        "policies": results,
        "goals": memory_goals(results),
    }
    if alone_figures:  # the 1/n baseline divides a backlogged tenant's throughput: say whether each one was
        result["goals"]["alone_backlogged_throughout"] = {t: data["backlogged_throughout"] for t, data in alone_figures.items()}
    if alone_figures:
        result["alone"] = alone_figures
        result["alone_engine"] = {"max_num_seqs": share_engine["max_num_seqs"], "kv_pool_blocks": alone_runs[next(iter(alone_runs))]["memory"]["pool_blocks"]}
    (output / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    from llmvisor.fairness.memory_report import plot_memory

    plot_memory(result).savefig(output / FIGURE_FILE, dpi=110, bbox_inches="tight")
    return result
