"""`llmvisor experiment fleet`: fair sharing across a pool of vLLM replicas behind a router.

Setup (stated; the same arrivals for every policy): N replicas of the engine behind vllm-router with consistent
hashing on a session header. Tenant "heavy" sends one session key, so all its requests land on one replica;
the "light-*" tenants send a fresh key per request, so theirs spread over every replica. Every tenant sends
requests of the same size at a Poisson rate above what it gets, so all stay backlogged. Three runs, each on
fresh engines (`llmvisor.engines.vllm.fleet`): ``fcfs`` (vLLM's scheduler plus the recorder), ``local``
(attributed VTC, counters per replica) and ``shared`` (attributed VTC, counters shared through Redis).

Rule (identical for every run): every replica's step trace is analysed with the charging model: each step's
measured time is split by llmvisor's shares (Shapley rule) and summed per tenant over all replicas (the
fleet-wide attributed engine time), over the steps that start between ``warmup_s`` and the end of arrivals.
Fairness is max/min and Jain's index of that time among the tenants backlogged throughout. A tenant is
backlogged at a moment when it has more requests outstanding at the client (sent, no answer yet) than running
in the replicas' current steps; it is backlogged throughout when that holds at every step start of every
replica in the interval. Model-free: requests are all the same size, so completions/s per tenant is a service
measure without any latency model; its max/min and Jain are reported over the same tenants. Throughput is
output tokens/s of requests answered in the interval, and, from the traces, decode tokens/s (every decode
slice of a step starting in the interval: tokens generated whether or not their request finished in it).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from llmvisor.core.attribution import attribute
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import read_trace
from llmvisor.engine_process import run_engine_module
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.experiment import charge_model_path
from llmvisor.fairness.policy import jain_index, max_min_ratio

FLEET_POLICIES = ("fcfs", "local", "shared")
FLEET_LABELS = {"fcfs": "FCFS", "local": "attributed VTC, per-replica counters", "shared": "attributed VTC, Redis-shared counters"}
IN_STEP_GAP_S = 0.05
"""A replica's latest step counts as running at a moment up to this long after the step ended (the next step
starts within a few ms while requests remain)."""


def fleet_tenants(n_light: int, *, heavy_rate_rps: float, light_rate_rps: float, prompt_tokens: int, output_tokens: int) -> list[dict]:
    """Tenant "heavy" (one session key: one replica) and ``n_light`` tenants "light-1".. (a key per request)."""
    if n_light < 1:
        raise LlmvisorError(f"--light-tenants must be >= 1 (got {n_light})")
    for option, value in (("--heavy-rate-rps", heavy_rate_rps), ("--light-rate-rps", light_rate_rps)):
        if not (math.isfinite(value) and value > 0):
            raise LlmvisorError(f"{option} must be a positive number (got {value})")
    shape = {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    return [{"name": "heavy", "rate_rps": heavy_rate_rps, "routing": "sticky", **shape}] + [
        {"name": f"light-{k}", "rate_rps": light_rate_rps, "routing": "spread", **shape} for k in range(1, n_light + 1)
    ]


def _fairness(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return None, None
    return max_min_ratio(values), jain_index(values)


def _replica_steps(path: str, t0_wall_s: float) -> tuple:
    """A replica's trace with step start times relative to t0 (None: no trace, or no step since t0)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    trace = read_trace(path)
    if "timestamp_s" not in trace.extra:
        raise LlmvisorError(f"{path}: no timestamp_s column; the fleet analysis needs the recorder's step start times")
    start_s = trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) - t0_wall_s
    if not (start_s >= 0).any():
        return None
    return trace, start_s


def analyse_fleet_run(result: dict, model: StepLatencyModel, *, warmup_s: float) -> dict:
    """Fleet-wide figures of one run (see the module docstring)."""
    tenants = list(result["tenants"])
    index = {t: k for k, t in enumerate(tenants)}
    n = len(tenants)
    lo, hi = float(warmup_s), float(result["end_s"])
    if hi <= lo:
        raise LlmvisorError(f"run {result['name']}: arrivals ended at {hi:.1f} s, before the warm-up of {lo:.1f} s")
    attributed = np.zeros((len(result["traces"]), n))
    charged_all = np.zeros(n)
    shared = result.get("shared_counters")
    # a charge reaches Redis within one flush interval (plus a round trip) of its step's end
    charged_by_s = math.inf if shared is None else shared.get("read_s", math.inf) - 2 * shared.get("flush_interval_s", 0.0)
    requests_seen = [[set() for _ in tenants] for _ in result["traces"]]
    busy_s = []
    decode_tokens = np.zeros(n)
    timelines = []  # per replica: step starts, step ends, per-step slices per tenant
    for r, path in enumerate(result["traces"]):
        loaded = _replica_steps(path, result["t0_wall_s"])
        if loaded is None:
            busy_s.append(0.0)
            timelines.append((np.zeros(0), np.zeros(0), np.zeros((0, n))))
            continue
        trace, start_s = loaded
        after_t0 = trace.select_steps(start_s >= 0)
        start_after = start_s[start_s >= 0]
        shares = attribute(model, after_t0)
        slice_tenant = np.array([index.get(str(t), -1) for t in after_t0.tenant.tolist()], dtype=np.int64)
        slice_step = np.repeat(np.arange(after_t0.n_steps), after_t0.batch_size_per_step)
        known = slice_tenant >= 0
        flushed = (start_after + after_t0.step_latency_s_per_step <= charged_by_s)[slice_step]
        charged_all += np.bincount(slice_tenant[known & flushed], weights=shares.share_s[known & flushed], minlength=n)
        in_interval = (start_after >= lo) & (start_after < hi)
        take = known & in_interval[slice_step]
        attributed[r] = np.bincount(slice_tenant[take], weights=shares.share_s[take], minlength=n)
        decode_tokens += np.bincount(slice_tenant[take & ~after_t0.is_prefill], minlength=n)
        for request_id, k in zip(after_t0.request_id[take].tolist(), slice_tenant[take].tolist()):
            requests_seen[r][k].add(request_id)
        busy_s.append(float(after_t0.step_latency_s_per_step[in_interval].sum()))
        per_step = np.zeros((after_t0.n_steps, n))
        np.add.at(per_step, (slice_step[known], slice_tenant[known]), 1.0)
        timelines.append((start_after, start_after + after_t0.step_latency_s_per_step, per_step))

    requests = [r for r in result["requests"] if r["tenant"] in index and not str(r["status"]).startswith("error")]
    errors = sum(1 for r in result["requests"] if str(r["status"]).startswith("error") or r["status"] not in (200, "unfinished"))
    samples = np.sort(np.concatenate([s[(s >= lo) & (s < hi)] for s, _, _ in timelines] or [np.zeros(0)]))
    backlogged = np.zeros(n, dtype=bool)
    if samples.size:
        running = np.zeros((samples.size, n))
        for starts, ends, per_step in timelines:
            if not starts.size:
                continue
            latest = np.searchsorted(starts, samples, side="right") - 1
            live = (latest >= 0) & (samples < ends[np.maximum(latest, 0)] + IN_STEP_GAP_S)
            running[live] += per_step[latest[live]]
        for tenant, k in index.items():
            submitted = np.sort([r["submitted_s"] for r in requests if r["tenant"] == tenant])
            answered = np.sort([r["finish_s"] for r in requests if r["tenant"] == tenant and r["finish_s"] is not None])
            outstanding = np.searchsorted(submitted, samples, side="right") - np.searchsorted(answered, samples, side="right")
            backlogged[k] = bool((outstanding > running[:, k]).all())

    totals = attributed.sum(axis=0)
    finished = {t: 0 for t in tenants}
    output_tokens = {t: 0 for t in tenants}
    for r in requests:
        if r["finish_s"] is not None and lo <= r["finish_s"] < hi:
            finished[r["tenant"]] += 1
            output_tokens[r["tenant"]] += int(r["output_tokens"])
    rates = {t: finished[t] / (hi - lo) for t in tenants}
    always = [t for t in tenants if backlogged[index[t]]]
    ratio, jain = _fairness([float(totals[index[t]]) for t in always])
    free_ratio, free_jain = _fairness([rates[t] for t in always])
    summary = {
        "interval_s": [lo, hi],
        "attributed_s": dict(zip(tenants, totals.tolist())),
        "attributed_fraction": dict(zip(tenants, (totals / max(totals.sum(), 1e-12)).tolist())),
        "attributed_s_per_replica": [dict(zip(tenants, row.tolist())) for row in attributed],
        "requests_per_replica": [{t: len(seen[index[t]]) for t in tenants} for seen in requests_seen],
        "replica_busy_fraction": [b / (hi - lo) for b in busy_s],
        "backlogged_throughout": always,
        "engine_time_max_min": ratio,
        "jain": jain,
        "requests_finished": finished,
        "completions_per_s": rates,
        "completions_max_min": free_ratio,
        "completions_jain": free_jain,
        "output_tokens": output_tokens,
        "output_tokens_per_s": sum(output_tokens.values()) / (hi - lo),
        "decode_tokens": dict(zip(tenants, decode_tokens.tolist())),
        "decode_tokens_per_s": float(decode_tokens.sum() / (hi - lo)),
        "requests_sent": len(result["requests"]),
        "requests_failed": errors,
    }
    out = {"summary": summary, "run": {"start_s": result.get("start_s"), "replicas": len(result["traces"])}}
    if shared is not None:
        out["pool_counters"] = pool_check(shared, dict(zip(tenants, charged_all.tolist())))
    return out


def pool_check(shared: dict, charged_s: dict[str, float]) -> dict:
    """The pool's Redis counters against the replicas' charges recomputed from their traces (every step since
    t0 that ended two flush intervals before the counters were read): a counter is the tenant's charges plus
    VTC's lifts, so it is never below them."""
    counters = shared["counters"]
    return {
        "replicas_applied": shared["replicas_applied"],
        "tenants": {
            t: {"redis_counter": counters.get(t), "charged_s": c, "lifted_s": None if counters.get(t) is None else counters[t] - c}
            for t, c in charged_s.items()
        },
    }


def compare(analysed: dict[str, dict]) -> dict:
    """Throughput of each run relative to FCFS, and each run's fairness figures side by side."""
    base = analysed.get("fcfs", {}).get("summary", {}).get("output_tokens_per_s")
    base_decode = analysed.get("fcfs", {}).get("summary", {}).get("decode_tokens_per_s")
    return {
        name: {
            "engine_time_max_min": data["summary"]["engine_time_max_min"],
            "jain": data["summary"]["jain"],
            "completions_max_min": data["summary"]["completions_max_min"],
            "completions_jain": data["summary"]["completions_jain"],
            "output_tokens_per_s": data["summary"]["output_tokens_per_s"],
            "throughput_vs_fcfs": data["summary"]["output_tokens_per_s"] / base if base else None,
            "decode_tokens_per_s": data["summary"]["decode_tokens_per_s"],
            "decode_throughput_vs_fcfs": data["summary"]["decode_tokens_per_s"] / base_decode if base_decode else None,
        }
        for name, data in analysed.items()
    }


def plot(result: dict):
    """Per run: fleet-wide attributed engine time per tenant (stacked by replica) and completions/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(result["runs"])
    tenants = result["setup"]["tenants"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(tenants))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, name in enumerate(runs):
        summary = result["runs"][name]["summary"]
        bottom = np.zeros(len(tenants))
        for r, per_replica in enumerate(summary["attributed_s_per_replica"]):
            values = np.array([per_replica[t] for t in tenants])
            axes[0].bar(x + (j - (len(runs) - 1) / 2) * width, values, width, bottom=bottom, color=colors[j % len(colors)], alpha=1.0 - 0.25 * r, edgecolor="white",
                        label=FLEET_LABELS.get(name, name) if r == 0 else None)  # fmt: skip
            bottom += values
        axes[1].bar(x + (j - (len(runs) - 1) / 2) * width, [summary["completions_per_s"][t] for t in tenants], width, color=colors[j % len(colors)])
        ratio = summary["engine_time_max_min"]
        if ratio is not None:
            axes[0].text(j / max(len(runs), 1) + 0.02, 0.97, f"{name}: max/min {ratio:.2f}", transform=axes[0].transAxes, va="top", fontsize=8)
    axes[0].set_ylabel("fleet-wide attributed engine time (s)\n(shades: replicas)")
    axes[1].set_ylabel("completions/s")
    for axis in axes:
        axis.set_xticks(x, tenants)
        axis.grid(alpha=0.3, axis="y")
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    figure.legend(loc="upper center", ncol=len(runs), fontsize=9, frameon=False)
    return figure


def run_fleet(spec: dict, log_path: Path) -> dict:
    """One run in a fresh process (`llmvisor.engines.vllm.fleet`); its result dict."""
    out_dir = Path(spec["out_dir"])
    return run_engine_module("llmvisor.engines.vllm.fleet", spec, spec_path=out_dir / "spec.json",
                             result_path=out_dir / "result.json", log_path=log_path, what=f"fleet run {spec['name']}")


def run_fleet_experiment(
    output: Path,
    *,
    latency_model_path: Path | None,
    engine_dir: Path,
    engine: dict,
    replicas: int,
    workload: dict,
    warmup_s: float,
    policies: list[str] | None = None,
    drain_s: float = 0.0,
    base_port: int = 0,
    analyse_only: bool = False,
    progress=None,
) -> dict:
    """Run each policy on fresh replicas (or re-read its run), analyse all alike, write fleet.json and fleet.png."""
    say = progress or (lambda message: None)
    policies = list(policies or FLEET_POLICIES)
    unknown = [p for p in policies if p not in FLEET_POLICIES]
    if unknown:
        raise LlmvisorError(f"--policy: unknown {', '.join(unknown)}; choose from {', '.join(FLEET_POLICIES)}")
    if replicas < 2:
        raise LlmvisorError(f"--replicas must be >= 2 (got {replicas})")
    if not 0 <= warmup_s < workload["duration_s"]:
        raise LlmvisorError(f"--warmup-s must be >= 0 and below --duration-s (got {warmup_s} and {workload['duration_s']})")
    model_path = charge_model_path(latency_model_path)
    model = StepLatencyModel.from_json(model_path)
    output.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in policies:
        out_dir = output / name
        if analyse_only:
            if not (out_dir / "result.json").is_file():
                raise LlmvisorError(f"--analyse-only: {out_dir / 'result.json'} not found; run {name} first")
            runs[name] = json.loads((out_dir / "result.json").read_text())
            continue
        spec = {
            "name": name, "policy": name, "out_dir": str(out_dir), "model_dir": str(engine_dir), "model_path": model_path,
            "replicas": replicas, "engine": engine, "workload": workload, "drain_s": drain_s, "base_port": base_port,
        }  # fmt: skip
        say(f"running {name} on {replicas} replicas for {workload['duration_s']:.0f} s (+ starts) …")
        started = time.perf_counter()
        runs[name] = run_fleet(spec, out_dir / "run.log")
        say(f"  done in {time.perf_counter() - started:.0f} s (replicas and router up in {runs[name]['start_s']:.0f} s)")
    analysed = {name: analyse_fleet_run(run, model, warmup_s=warmup_s) for name, run in runs.items()}
    first = runs[policies[0]]
    result = {
        "experiment": "fleet",
        "setup": {
            "model": os.path.basename(model_path),
            "engine_model": os.path.basename(os.path.normpath(str(engine_dir))),
            "replicas": replicas,
            "worker_threads": first.get("worker_threads"),
            "engine": first["engine"],
            "router": {"package": "vllm-router", **first["router"]},
            "workload": first["workload"],
            "tenants": first["tenants"],
            "warmup_s": warmup_s,
            "drain_s": drain_s,
            "attribution_rule": "shapley",
            "alone_runs": "not run: every request has the same size, so completions/s is compared directly",
        },
        "runs": analysed,
        "comparison": compare(analysed),
    }
    (output / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result).savefig(output / "fleet.png", dpi=110, bbox_inches="tight")
    return result


FLEET_LABELS = {"fcfs": "vLLM FCFS", "local": "attributed VTC, per-replica counters", "shared": "attributed VTC, Redis-shared counters"}


def _fmt(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_summary(result: dict) -> str:
    """The result's tables as Markdown, for docs/fleet.md (a test keeps the doc's copy equal to this)."""
    runs = [name for name in FLEET_POLICIES if name in result["runs"]]
    tenants = list(result["runs"][runs[0]]["summary"]["attributed_s"])
    comparison = result["comparison"]
    lines = [
        f"| run | engine time {' / '.join(tenants)} (s) | max/min | Jain | completions/s {' / '.join(tenants)} | max/min | Jain | "
        "output tok/s (vs FCFS) | decode tok/s (vs FCFS) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in runs:
        s = result["runs"][name]["summary"]
        c = comparison[name]
        engine_s = " / ".join(f"{s['attributed_s'][t]:.1f}" for t in tenants)
        rates = " / ".join(f"{s['completions_per_s'][t]:.2f}" for t in tenants)
        lines.append(
            f"| {FLEET_LABELS[name]} | {engine_s} | {_fmt(s['engine_time_max_min'])} | {_fmt(s['jain'], 3)} | {rates} | "
            f"{_fmt(s['completions_max_min'])} | {_fmt(s['completions_jain'], 3)} | {s['output_tokens_per_s']:.0f} ({_fmt(c['throughput_vs_fcfs'])}) | "
            f"{s['decode_tokens_per_s']:.0f} ({_fmt(c['decode_throughput_vs_fcfs'])}) |"
        )
    lines += ["", f"| run | replica | busy | engine time {' / '.join(tenants)} (s) |", "| --- | --- | --- | --- |"]
    for name in runs:
        s = result["runs"][name]["summary"]
        for r, per_tenant in enumerate(s["attributed_s_per_replica"]):
            engine_s = " / ".join(f"{per_tenant[t]:.1f}" for t in tenants)
            lines.append(f"| {FLEET_LABELS[name] if r == 0 else ''} | {r} | {100 * s['replica_busy_fraction'][r]:.0f}% | {engine_s} |")
    return "\n".join(lines)
