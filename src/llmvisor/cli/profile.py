"""`llmvisor profile`: record a real vLLM engine's step trace under a sweep or a real request mix."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from llmvisor import shipped
from llmvisor.cli import engine_options as eo
from llmvisor.cli import params
from llmvisor.cli.console import stdout_to_stderr
from llmvisor.core.trace import read_trace, write_trace
from llmvisor.engines.settings import LORA_MAX_RANKS
from llmvisor.errors import LlmvisorError
from llmvisor.profile.adapters import DEFAULT_TARGET_MODULES, adapter_name, write_adapters
from llmvisor.profile.drift import DEFAULT_DRIFT_THRESHOLD, canary_drift, is_canary_episode, mark_drifted, with_canaries
from llmvisor.profile.eta import SweepClock, SweepProgress
from llmvisor.profile.plans import (
    MAX_BASE_SHARE,
    Envelope,
    build_workload,
    episode_dict,
    lora_episodes,
    sweep_episodes,
    workload_name,
)
from llmvisor.profile.stats import coverage, mark_warmup_window, noise_floor, print_coverage, print_noise_floor

PLANS = ("sweep", "workload", "lora")
DEFAULT_LORA_RANKS = "8,16,64,8"


def profile(
    output: Annotated[Path, typer.Option("--output", "-o", help="Trace to write (.parquet, with metadata).", dir_okay=False, metavar="FILE")],
    plan: Annotated[str, typer.Option(help="sweep: space-filling episodes over the engine envelope; workload: replay --workload CSVs; lora: the sweep's episodes with each request on one of --lora-ranks' adapters (written locally, random weights) or the base model.", metavar="sweep|workload|lora")] = "sweep",
    engine_model: eo.EngineModel = None,
    workload: Annotated[list[Path] | None, typer.Option(help="Request-length CSV (num_prefill_tokens, num_decode_tokens[, arrived_at]); repeat for a multi-tenant mix, one tenant per file.", dir_okay=False, metavar="CSV")] = None,
    points: Annotated[int, typer.Option(help="sweep: number of design points (episodes).", min=1)] = 48,
    repeat: Annotated[int, typer.Option(help="Run the whole plan this many times with identical batches; 2 or more measures the noise floor.", min=1)] = 1,
    max_decode_steps: Annotated[int, typer.Option(help="sweep: most decode steps of an episode.", min=1)] = 24,
    max_episode_tokens: Annotated[int, typer.Option(help="sweep: most prompt tokens of an episode (pools are shrunk to fit).", min=1)] = 65536,
    num_requests: Annotated[int, typer.Option(help="workload: requests taken from each CSV, consecutive from --start-row.", min=1)] = 200,
    start_row: Annotated[int, typer.Option(help="workload: first CSV row (0-based) taken.", min=0)] = 0,
    lengths: Annotated[str, typer.Option(help="workload: fit lengths to max_model_len by 'clip' or 'scale'.", metavar="clip|scale")] = "clip",
    tenants: Annotated[int, typer.Option(help="workload: tenants assigned round-robin within a single CSV.", min=1)] = 1,
    arrival: Annotated[str, typer.Option(help="workload: 'closed' (fixed --concurrency) or 'trace' (arrived_at times --time-scale).", metavar="closed|trace")] = "closed",
    concurrency: Annotated[int, typer.Option(help="workload, closed loop: requests in flight.", min=1)] = 16,
    time_scale: Annotated[float, typer.Option(help="workload, trace arrivals: multiply arrived_at by this.", min=0)] = 1.0,
    max_seconds: Annotated[float | None, typer.Option(help="workload: stop submitting and abort after this many seconds per repeat.", min=0)] = None,
    shared_documents: Annotated[int, typer.Option(help="workload: prompts start with one of this many shared documents (request k: document k mod N); 0: none.", min=0)] = 0,
    document_tokens: Annotated[int, typer.Option(help="workload: tokens of each shared document, prepended to the row's prompt.", min=0)] = 0,
    max_model_len: eo.MaxModelLen = eo.MAX_MODEL_LEN,
    max_num_batched_tokens: eo.MaxNumBatchedTokens = eo.MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: eo.MaxNumSeqs = eo.MAX_NUM_SEQS,
    max_loras: eo.MaxLoras = eo.MAX_LORAS,
    max_lora_rank: eo.MaxLoraRank = eo.MAX_LORA_RANK,
    lora_ranks: Annotated[str, typer.Option(help="lora: the adapters' ranks, one adapter each (comma-separated). The plan turns LoRA on with half as many slots (--max-loras, unless given), so adapters are swapped, and raises --max-lora-rank to the largest rank.", metavar="RANKS")] = DEFAULT_LORA_RANKS,
    lora_modules: Annotated[str, typer.Option(help="lora: the projections every adapter targets (comma-separated; q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).", metavar="MODULES")] = ",".join(DEFAULT_TARGET_MODULES),
    kv_cache_gib: eo.KvCacheGib = eo.KV_CACHE_GIB,
    threads: eo.Threads = eo.THREADS,
    executor: eo.Executor = eo.EXECUTOR,
    enforce_eager: eo.EnforceEager = eo.ENFORCE_EAGER,
    dtype: eo.Dtype = eo.DTYPE,
    warmup_steps: Annotated[int, typer.Option(help="Steps after engine start marked is_warmup.", min=0)] = 3,
    warmup_seconds: Annotated[float, typer.Option(help="Also mark is_warmup every step starting within this many seconds of the first.", min=0)] = 0.0,
    run_id: Annotated[str | None, typer.Option(help="Run id written on every row. Default: from the plan and the time.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the design, the prompts, the decode subsets and the engine's sampling.", min=0)] = 0,
    keep_jsonl: Annotated[bool, typer.Option(help="Keep the JSONL the recorder wrote, beside the output.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON summary (run, steps, coverage, noise floor, overhead) to stdout; progress stays on stderr.")] = False,
    canary_every: Annotated[int, typer.Option(help="sweep: run the fixed canary episode before the sweep, after every this many episodes and at the end, to measure drift (0: no canaries).", min=0)] = 8,
    drift_threshold: Annotated[float, typer.Option(help="A canary run whose steps are slower or faster than the median run by more than this fraction (or three robust standard deviations of the runs' drifts, if larger) drifts; the steps around it are flagged is_drifted.", min=0)] = DEFAULT_DRIFT_THRESHOLD,
    prefix_caching: Annotated[bool, typer.Option(help="Prefix caching, on by default as in vLLM (the sweep's shared-prefix episodes and --shared-documents need it); --no-prefix-caching computes every context.")] = True,
    cores: Annotated[str | None, typer.Option(help="Pin the engine to these CPU cores (e.g. '0' or '0-3,6'), as the served engine is pinned; sets the thread count to their number unless --threads is given.", metavar="CORES")] = None,
) -> None:
    """Profile a vLLM engine in this process and write its step trace."""
    from rich.console import Console


    console = Console(stderr=True)
    if plan not in PLANS:
        raise LlmvisorError(f"--plan: unknown plan {plan!r}; expected one of {', '.join(PLANS)}")
    if Path(output).suffix.lower() != ".parquet":
        raise LlmvisorError(f"{output}: output must be a .parquet file (it carries the trace metadata)")
    params.check_output_file(Path(output))
    if repeat < 1:
        raise LlmvisorError(f"--repeat: must be at least 1 (got {repeat})")
    if plan == "workload" and not workload:
        raise LlmvisorError("--workload: the workload plan needs at least one workload CSV")
    if plan != "workload" and workload:
        raise LlmvisorError("--workload: only the workload plan replays workload CSVs (use --plan workload)")
    if concurrency < 1:
        raise LlmvisorError(f"--concurrency: must be at least 1 (got {concurrency})")
    adapter_ranks = parse_ranks(lora_ranks) if plan == "lora" else []
    if plan == "lora":
        max_loras = max_loras or max(1, len(adapter_ranks) // 2)
        max_lora_rank = max_lora_rank if max_lora_rank >= max(adapter_ranks) else min(r for r in LORA_MAX_RANKS if r >= max(adapter_ranks))
    if cores:
        pinned = pin_to_cores(cores)
        threads = threads if threads is not None else len(pinned)
    settings = eo.engine_settings(
        engine_model,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=kv_cache_gib,
        enforce_eager=enforce_eager,
        threads=threads,
        seed=seed,
        executor=executor,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        dtype=dtype,
    )

    from llmvisor.engines.vllm.driver import check_model_dir

    check_model_dir(settings.model)
    envelope = Envelope(max_model_len, max_num_batched_tokens, max_num_seqs)
    workload_plan = None
    if plan == "workload":
        workload_plan = build_workload(
            [str(path) for path in workload],
            envelope,
            num_requests=num_requests,
            start_row=start_row,
            length_rule=lengths,
            tenants=tenants,
            arrival=arrival,
            time_scale=time_scale,
            shared_documents=shared_documents,
            document_tokens=document_tokens,
        )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if run_id is None:
        label = plan if plan != "workload" else "+".join(workload_name(str(p)) for p in workload)
        run_id = f"{label}-{stamp}"

    output = Path(output)
    jsonl_path = output.with_suffix(".recording.jsonl")
    if jsonl_path.exists():
        jsonl_path.unlink()

    with stdout_to_stderr(json_output), tempfile.TemporaryDirectory(prefix="llmvisor-adapters-") as adapter_dir:
        adapters = write_adapters(adapter_dir, settings.model, adapter_ranks, target_modules=lora_modules.split(","), seed=seed)
        result = _record(
            console,
            settings,
            plan=plan,
            jsonl_path=str(jsonl_path),
            run_id=run_id,
            warmup_steps=warmup_steps,
            repeat=repeat,
            points=points,
            max_decode_steps=max_decode_steps,
            max_episode_tokens=max_episode_tokens,
            workload_plan=workload_plan,
            arrival=arrival,
            concurrency=concurrency,
            max_seconds=max_seconds,
            canary_every=canary_every if plan != "workload" else 0,
            prefix_caching=prefix_caching,
            adapters=adapters,
        )


    trace = read_trace(jsonl_path)
    n_warmup = mark_warmup_window(trace, warmup_seconds)
    drift = None
    if plan != "workload" and canary_every > 0:
        drifted, drift = canary_drift(trace, drift_threshold)
        mark_drifted(trace, drifted)
    engine_info = result["engine"]
    floor = noise_floor(trace) if repeat > 1 else None
    summary = coverage(trace, engine_info)
    plan_info: dict = {"plan": plan, "repeat": repeat, "seed": seed}
    if plan != "workload":
        plan_info.update(
            {
                "points": points,
                "max_decode_steps": max_decode_steps,
                "max_episode_tokens": max_episode_tokens,
                "design": "Latin hypercube (scipy.stats.qmc, random-cd) over pool size, longest prompt, "
                "step token budget, decode steps, second wave; see llmvisor.profile.plans",
                "episodes": result["episodes"],
            }
        )
    if plan == "lora":
        plan_info["lora"] = {
            "adapters": [{"name": adapter_name(k, a.rank), "rank": a.rank, "target_modules": list(a.target_modules)} for k, a in enumerate(adapters)],
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
            "max_cpu_loras": max_loras,
            "weights": "random, normal (sd 0.01), written with safetensors by llmvisor.profile.adapters from --seed",
            "assignment": "each episode: k adapters (k uniform on 0..the number of adapters), each request the base model with "
            f"a probability uniform on 0..{MAX_BASE_SHARE} (1 when k = 0), else the next of the k in a shuffled round-robin; "
            "episodes[*].lora_adapters (-1: base model); see llmvisor.profile.plans.lora_episodes",
        }
    if plan == "workload":
        plan_info.update(workload_plan.metadata)
        plan_info.update({"concurrency": concurrency if arrival == "closed" else None, "max_seconds": max_seconds})
        plan_info["replay"] = result["replay"]
    trace.metadata = {
        "run_id": run_id,
        "recorded_at": stamp,
        "command": recorded_command(sys.argv),
        "engine": engine_info,
        **plan_info,
        "warmup_steps": warmup_steps,
        "warmup_rule": warmup_rule(warmup_steps, warmup_seconds, n_warmup),
        "noise_floor": floor,
        "recorder_overhead": result["overhead"],
        "coverage": summary,
        "wall_time_s": result["wall_time_s"],
        "engine_fingerprint": result["engine_fingerprint"],
        "drift": drift,
        "cores": sorted(os.sched_getaffinity(0)),
    }
    write_trace(trace, output)
    if not keep_jsonl:
        jsonl_path.unlink()

    print_coverage(console, summary)
    print_noise_floor(console, floor)
    if drift and drift.get("canaries"):
        console.print(
            f"drift: {drift['n_drifted_canaries']} of {drift['n_canary_runs']} canary runs drifted (cut {100 * drift['cut']:.0f}%), "
            f"{drift['n_drifted_steps']} steps flagged"
            + (f"; the machine's speed swings by {100 * drift['spread']:.0f}% (robust sd of the canary runs) all through the "
               "profile, more than the drift threshold: the fit carries that noise, profile on a quieter machine for a tighter model"
               if drift["spread"] > drift["threshold"] else "")
        )
    overhead = result["overhead"]
    console.print(
        f"recorder overhead: {100 * overhead['fraction_of_step_time']:.3f}% of step time over {overhead['n_steps']} steps "
        f"({overhead['recorder_time_per_step_us']:.0f} us/step; per step p50 {100 * overhead.get('step_fraction_p50', 0):.2f}%, "
        f"p99 {100 * overhead.get('step_fraction_p99', 0):.2f}%)"
    )
    if overhead.get("kv_meter_time_s"):
        console.print(
            f"of which the KV memory meter: {100 * overhead['kv_meter_fraction_of_step_time']:.3f}% of step time "
            f"({overhead['kv_meter_time_per_step_us']:.0f} us/step)"
        )
    if plan == "workload":
        replay = result["replay"]
        console.print(
            f"workload: {sum(r['finished'] for r in replay)} requests finished, "
            f"{sum(r['aborted'] for r in replay)} aborted at the deadline; {plan_info['length_rule']}; "
            f"tenants: {plan_info['tenant_rule']}; arrivals: {plan_info['arrival']}"
        )
    console.print(f"wrote {trace.n_steps} steps ({trace.n_slices} rows) of run {run_id!r} to {output}")
    if json_output:
        typer.echo(json.dumps(profile_summary(trace, output), indent=2, default=str))


def profile_summary(trace, output: Path) -> dict:
    """The machine-readable summary of a recorded trace: where it is, what it holds and its metadata's figures."""
    metadata = trace.metadata
    return {
        "output": str(output),
        "run_id": metadata["run_id"],
        "plan": metadata["plan"],
        "n_steps": int(trace.n_steps),
        "n_rows": int(trace.n_slices),
        "n_warmup_steps": int(trace.is_warmup_per_step.sum()),
        **{key: metadata.get(key) for key in ("engine", "coverage", "noise_floor", "recorder_overhead", "wall_time_s", "warmup_rule", "engine_fingerprint", "drift")},
    }


def recorded_command(argv: list[str]) -> str:
    """The command line as run, for the trace's metadata: the program as ``llmvisor``, and files shipped in the
    package by their package name (`shipped.portable_path`), so the record says nothing of this machine."""
    args = []
    for arg in argv[1:]:
        option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value and os.path.exists(value):
            value = shipped.portable_path(value)
        args.append(option + equals + value)
    return " ".join(shlex.quote(arg) for arg in ["llmvisor", *args])


def warmup_rule(warmup_steps: int, warmup_seconds: float, n_warmup: int) -> str:
    rule = f"is_warmup: the first {warmup_steps} steps after engine start"
    if warmup_seconds > 0:
        rule += f", and every step starting within {warmup_seconds:g} s of the first step"
    return rule + f" ({n_warmup} steps); kept in the trace, left out of the noise floor and coverage"


def _record(console, settings, *, plan, jsonl_path, run_id, warmup_steps, repeat, points, max_decode_steps, max_episode_tokens,
            workload_plan, arrival, concurrency, max_seconds, canary_every=0, prefix_caching=True, adapters=()) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from llmvisor.engines.vllm.driver import ProfiledEngine

    started = time.perf_counter()
    with console.status(f"starting vLLM on {settings.model} ..."):
        engine = ProfiledEngine(
            settings, trace_path=jsonl_path, run_id=run_id, warmup_steps=warmup_steps, enable_prefix_caching=prefix_caching,
            adapters=adapters,
        )
    console.print(f"vLLM started in {time.perf_counter() - started:.0f} s; KV cache holds {engine.kv_cache_tokens} tokens")
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    result: dict = {}
    try:
        with Progress(*columns, console=console) as progress:
            if plan != "workload":
                episodes = sweep_episodes(
                    engine.envelope, points, seed=settings.seed, max_decode_steps=max_decode_steps, max_episode_tokens=max_episode_tokens
                )
                if adapters:
                    episodes = lora_episodes(episodes, len(adapters), seed=settings.seed)
                result["episodes"] = [episode_dict(e) for e in episodes]
                episodes = with_canaries(episodes, engine.envelope, canary_every)
                result["canary_episodes"] = sum(map(is_canary_episode, episodes))
                task = progress.add_task("sweep episodes", total=len(episodes) * repeat)
                sweep = SweepProgress(SweepClock.for_episodes(episodes, repeat), progress.console.print)
                for repeat_index in range(repeat):
                    for episode in episodes:
                        episode_started = time.perf_counter()
                        engine.run_episode(episode, repeat_index)
                        sweep.episode_done(time.perf_counter() - episode_started)
                        progress.advance(task)
            else:
                task = progress.add_task("workload requests", total=len(workload_plan.requests) * repeat)
                result["replay"] = []
                for repeat_index in range(repeat):
                    counts = engine.run_workload(
                        workload_plan,
                        arrival=arrival,
                        concurrency=concurrency,
                        repeat_index=repeat_index,
                        deadline_s=max_seconds,
                        on_finished=lambda n: progress.advance(task, n),
                    )
                    result["replay"].append(counts)
        result["overhead"] = engine.finish_recording()
        result["engine"] = engine.describe()
        fingerprint = getattr(engine.scheduler, "engine_fingerprint", None)
        result["engine_fingerprint"] = fingerprint.to_dict() if fingerprint is not None else None
    finally:
        engine.close()
    result["wall_time_s"] = time.perf_counter() - started
    return result


def parse_ranks(text: str) -> list[int]:
    """'8,16,64' -> [8, 16, 64]: the LoRA plan's adapter ranks, each a positive integer vLLM can hold."""
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise LlmvisorError(f"--lora-ranks: expected ranks like '8,16,64', got {text!r}") from None
    if not ranks or min(ranks) < 1 or max(ranks) > max(LORA_MAX_RANKS):
        raise LlmvisorError(f"--lora-ranks: each rank must be 1..{max(LORA_MAX_RANKS)} (got {text!r})")
    return ranks


def parse_cores(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise LlmvisorError(f"--cores: expected core ids like '0-3,6', got {text!r}") from None
    if not cores:
        raise LlmvisorError(f"--cores: no core ids in {text!r}")
    return sorted(cores)


def pin_to_cores(text: str) -> list[int]:
    """Pin this process (and the engine it starts) to the given cores."""
    cores = parse_cores(text)
    available = os.sched_getaffinity(0)
    missing = sorted(set(cores) - available)
    if missing:
        raise LlmvisorError(f"--cores: core(s) {missing} are not available to this process (it may use {sorted(available)})")
    os.sched_setaffinity(0, cores)
    return cores
