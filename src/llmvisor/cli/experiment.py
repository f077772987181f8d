"""`llmvisor experiment fairness`: FCFS vs token VTC vs attributed VTC on the real engine, per tenant over time;
`llmvisor experiment fleet`: the same question across replicas behind a router; `llmvisor experiment calibration`:
`llmvisor calibrate` scored on a held-out served session against the served engine's noise floor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from llmvisor import shipped
from llmvisor.cli import engine_options as eo
from llmvisor.cli.console import print_table
from llmvisor.cli.params import check_output_folder
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.experiment import (
    POLICIES,
    POLICY_LABELS,
    TIME_POLICIES,
    admission_markdown_summary,
    format_seconds,
    run_admission_experiment,
    run_experiment,
    workload_tenants,
)
from llmvisor.fairness.fleet_experiment import FLEET_LABELS, fleet_tenants, run_fleet_experiment


def fairness(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for traces, logs, fairness.json and fairness.png.", file_okay=False, metavar="DIR")] = Path("fairness-experiment"),
    model: eo.LatencyModel = None,
    engine_model: eo.EngineModel = None,
    policy: Annotated[list[str] | None, typer.Option(help="Policies to run: fcfs, tokens, attributed, drf (repeat). Default: fcfs, tokens, attributed.", metavar="fcfs|tokens|attributed|drf")] = None,
    tenants: Annotated[int, typer.Option(help="Tenants, 2 to 4: long-context and short-context alternately.", min=2, max=4)] = 2,
    rate_rps: Annotated[float, typer.Option(help="Requests per second from each tenant (Poisson); high enough that all stay backlogged.", min=0.01)] = 16.0,
    history_tokens: Annotated[int, typer.Option(help="Long-context tenants: tokens of conversation history (prefix-cached) in front of each prompt.", min=1)] = 1536,
    conversations: Annotated[int, typer.Option(help="Long-context tenants: conversations, continued in turn; more than run at once, so running requests do not share a history.", min=1)] = 40,
    shared_documents: Annotated[int, typer.Option(help="Add a tenant 'shared' whose requests continue one of this many documents (history-tokens long), so its running requests share cached KV blocks; 0: no such tenant.", min=0)] = 2,
    prompt_tokens: Annotated[int, typer.Option(help="New prompt tokens per request (every tenant).", min=1)] = 64,
    output_tokens: Annotated[int, typer.Option(help="Output tokens per request (every tenant).", min=1)] = 64,
    duration_s: Annotated[float, typer.Option(help="Seconds of arrivals and measurement per policy.", min=1)] = 90.0,
    warmup_s: Annotated[float, typer.Option(help="Seconds at the start left out of the figures (queues build up).", min=0)] = 10.0,
    window_s: Annotated[float, typer.Option(help="Window of the per-tenant time series, in seconds.", min=0.1)] = 10.0,
    max_model_len: eo.MaxModelLen = eo.MAX_MODEL_LEN,
    max_num_seqs: eo.MaxNumSeqs = eo.MAX_NUM_SEQS,
    max_num_batched_tokens: eo.MaxNumBatchedTokens = eo.MAX_NUM_BATCHED_TOKENS,
    kv_cache_gib: eo.KvCacheGib = eo.KV_CACHE_GIB,
    threads: eo.Threads = eo.THREADS,
    enforce_eager: eo.EnforceEager = eo.ENFORCE_EAGER,
    dtype: eo.Dtype = eo.DTYPE,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, prompts and the engine's sampling (the same for every policy).", min=0)] = 0,
    alone: Annotated[bool, typer.Option(help="Also run each tenant alone (at the total offered rate) for the model-free fairness figures.")] = True,
    tpot_slo_s: Annotated[float, typer.Option(help="Also run attributed VTC with admission control at this TPOT SLO (seconds) for the admission figures; 0: no such run.", min=0)] = 0.05,
    analyse_only: Annotated[bool, typer.Option(help="Re-analyse the runs already in --output instead of running the engine.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the result JSON to stdout.")] = False,
) -> None:
    """Fair sharing on the real vLLM engine: FCFS vs token VTC vs attributed VTC, per tenant over time."""
    console = Console(stderr=True)
    check_output_folder(output)
    settings = eo.engine_settings(
        engine_model,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=kv_cache_gib,
        enforce_eager=enforce_eager,
        threads=threads,
        seed=seed,
        dtype=dtype,
    )
    engine = {key: value for key, value in settings.as_dict().items() if key != "model"}
    workload = {
        "tenants": workload_tenants(
            tenants,
            rate_rps=rate_rps,
            history_tokens=history_tokens,
            n_conversations=conversations,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            shared_documents=shared_documents,
        ),
        "duration_s": duration_s,
        "seed": seed,
    }
    result = run_experiment(
        output,
        latency_model_path=model,
        engine_dir=Path(settings.model),
        engine=engine,
        policies=list(policy or TIME_POLICIES),
        workload=workload,
        window_s=window_s,
        warmup_s=warmup_s,
        alone=alone,
        tpot_slo_s=tpot_slo_s or None,
        analyse_only=analyse_only,
        progress=lambda message: console.print(f"[bold]fairness[/]: {message}", highlight=False),
    )
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    print_summary(console, result)
    console.print(f"wrote {output / 'fairness.json'} and {output / 'fairness.png'}", highlight=False)


def fairness_memory(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for traces, logs, fairness-memory.json and fairness-memory.png.", file_okay=False, metavar="DIR")] = Path("fairness-memory-experiment"),
    model: eo.LatencyModel = None,
    engine_model: eo.EngineModel = None,
    policy: Annotated[list[str] | None, typer.Option(help="Policies to run: fcfs, tokens, attributed, drf (repeat). Default: all four.", metavar="fcfs|tokens|attributed|drf")] = None,
    rate_rps: Annotated[float, typer.Option(help="Requests per second from each tenant (Poisson); high enough that all stay backlogged, alone on their share of the engine too.", min=0.01)] = 6.0,
    length_scale: Annotated[float, typer.Option(help="Both lengths of every request drawn from the mixes are multiplied by this (then clipped to --max-model-len).", min=0.01, max=1.0)] = 0.25,
    kv_pool_blocks: Annotated[int, typer.Option(help="Usable KV blocks of the engine (vLLM's num_gpu_blocks_override less its null block): small, so memory binds.", min=1)] = 24,
    duration_s: Annotated[float, typer.Option(help="Seconds of arrivals and measurement per run.", min=1)] = 120.0,
    warmup_s: Annotated[float, typer.Option(help="Seconds at the start left out of the figures (queues build up).", min=0)] = 20.0,
    window_s: Annotated[float, typer.Option(help="Window of the per-tenant time series, in seconds.", min=0.1)] = 10.0,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="Longest prompt + output, in tokens.", min=2, rich_help_panel=eo.ENGINE_PANEL)] = 1024,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Most requests in one engine step (each tenant alone gets 1/3 of it).", min=3, rich_help_panel=eo.ENGINE_PANEL)] = 24,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", help="Most tokens in one engine step (long prompts are prefilled in chunks of it, between decodes).", min=1, rich_help_panel=eo.ENGINE_PANEL)] = 512,
    threads: Annotated[int, typer.Option("--threads", help="OpenMP/torch threads of the engine: 1 by default, so a machine shared with other processes slows the engine's steps without stalling its threads on each other.", min=1, rich_help_panel=eo.ENGINE_PANEL)] = 1,
    enforce_eager: eo.EnforceEager = eo.ENFORCE_EAGER,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, request lengths, prompts and the engine's sampling (the same for every run).", min=0)] = 0,
    alone: Annotated[bool, typer.Option(help="Also run each tenant alone on 1/3 of the engine, the sharing-incentive baseline.")] = True,
    analyse_only: Annotated[bool, typer.Option(help="Re-analyse the runs already in --output instead of running the engine.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the result JSON to stdout.")] = False,
) -> None:
    """Fairness when KV memory binds: FCFS vs token VTC vs time-only VTC vs DRF, against each tenant alone on 1/3 of the engine."""
    from llmvisor.fairness.memory_experiment import FIGURE_FILE, RESULT_FILE, memory_tenants, run_memory_experiment
    from llmvisor.fairness.memory_report import markdown_summary

    console = Console(stderr=True)
    check_output_folder(output)
    settings = eo.engine_settings(
        engine_model, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager, threads=threads, seed=seed,
    )
    engine = {key: value for key, value in settings.as_dict().items() if key != "model"}
    workload = {"tenants": memory_tenants(rate_rps=rate_rps, length_scale=length_scale), "duration_s": duration_s, "seed": seed}
    result = run_memory_experiment(
        output, latency_model_path=model, engine_dir=Path(settings.model), engine=engine, kv_pool_blocks=kv_pool_blocks,
        policies=list(policy or POLICIES), workload=workload, window_s=window_s, warmup_s=warmup_s, alone=alone,
        analyse_only=analyse_only,
        progress=lambda message: console.print(f"[bold]fairness-memory[/]: {message}", highlight=False),
    )
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    console.print(markdown_summary(result), highlight=False, markup=False, soft_wrap=True)
    console.print("goals:", highlight=False)
    for name, value in result["goals"].items():
        text = json.dumps(value) if isinstance(value, (list, dict)) else plain_value(value)
        console.print(f"  {name.replace('_', ' ')}: {text}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {output / RESULT_FILE} and {output / FIGURE_FILE}", highlight=False)


def print_summary(console: Console, result: dict) -> None:
    table = Table(title="fairness: attributed engine time per tenant (backlogged throughout)")
    for column in ("policy", "tenant", "engine s", "share", "token service", "TTFT p50/p99 s", "TPOT p50/p99 ms", "max/min", "Jain", "out tok/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for policy, data in result["policies"].items():
        summary = data["summary"]
        for k, tenant in enumerate(summary["attributed_s"]):
            table.add_row(
                POLICY_LABELS[policy] if k == 0 else "",
                tenant,
                f"{summary['attributed_s'][tenant]:.1f}",
                f"{summary['attributed_fraction'][tenant]:.1%}",
                f"{summary['token_service'][tenant]:.0f}",
                f"{format_seconds(summary['ttft_s'][tenant]['p50'])}/{format_seconds(summary['ttft_s'][tenant]['p99'])}",
                f"{format_seconds(summary['tpot_s'][tenant]['p50'], 1000)}/{format_seconds(summary['tpot_s'][tenant]['p99'], 1000)}",
                f"{summary['engine_time_max_min']:.2f}" if k == 0 and summary["engine_time_max_min"] is not None else "",
                f"{summary['jain']:.3f}" if k == 0 and summary["jain"] is not None else "",
                f"{summary['output_tokens_per_s']:.1f}" if k == 0 else "",
            )
    print_table(table, console)
    free = [(policy, data["model_free"]) for policy, data in result["policies"].items() if data.get("model_free")]
    if free:
        table = Table(title="model-free: completions/s under the policy ÷ completions/s alone")
        for column in ("policy", *next(iter(free))[1]["normalised_service"], "max/min", "Jain"):
            table.add_column(column, justify="right", no_wrap=True)
        for policy, figures in free:
            table.add_row(
                POLICY_LABELS[policy],
                *(f"{value:.2f}" for value in figures["normalised_service"].values()),
                "–" if figures["max_min"] is None else f"{figures['max_min']:.2f}",
                "–" if figures["jain"] is None else f"{figures['jain']:.3f}",
            )
        print_table(table, console)
    if "admission" in result:
        data = result["admission"]
        table = Table(title=f"admission control at a TPOT SLO of {1000 * data['tpot_slo_s']:.0f} ms (attributed VTC)")
        for column in ("tenant", "run", "finished", "met SLO", "TPOT p50/p99 ms", "goodput tok/s", "deferred", "wait p50/p99 s"):
            table.add_column(column, justify="right", no_wrap=True)
        for tenant in [*data["with"]["tenants"], "all"]:
            for key in ("without", "with"):
                row = data[key]["all"] if tenant == "all" else data[key]["tenants"][tenant]
                deferral = data["deferrals"].get(tenant) if key == "with" else None
                table.add_row(
                    tenant if key == "without" else "",
                    key,
                    f"{row['requests']}",
                    "–" if row["met_slo_fraction"] is None else f"{row['met_slo_fraction']:.0%}",
                    f"{format_seconds(row['tpot_s']['p50'], 1000)}/{format_seconds(row['tpot_s']['p99'], 1000)}",
                    f"{row['goodput_tokens_per_s']:.0f}",
                    "" if deferral is None else f"{deferral['requests_deferred']}",
                    "" if deferral is None else f"{format_seconds(deferral['wait_s']['p50'])}/{format_seconds(deferral['wait_s']['p99'])}",
                )
        print_table(table, console)
    console.print("goals:", highlight=False)
    for name, value in result["goals"].items():
        console.print(f"  {name.replace('_', ' ')}: {plain_value(value)}", highlight=False)


def plain_value(value) -> str:
    """A goal's figure or verdict in words: yes / no, a number to 3 significant figures, or – when not judged."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def fleet(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for traces, logs, fleet.json and fleet.png.", file_okay=False, metavar="DIR")] = Path("fleet-experiment"),
    model: eo.LatencyModel = None,
    engine_model: eo.EngineModel = None,
    policy: Annotated[list[str] | None, typer.Option(help="Runs: fcfs, local (per-replica VTC counters), shared (Redis-shared counters) (repeat). Default: all three.", metavar="fcfs|local|shared")] = None,
    replicas: Annotated[int, typer.Option(help="vLLM OpenAI API servers behind vllm-router.", min=1)] = 3,
    light_tenants: Annotated[int, typer.Option(help="Tenants light-1.. whose requests spread over every replica (a session key per request).", min=1)] = 3,
    heavy_rate_rps: Annotated[float, typer.Option(help="Requests per second from tenant heavy (one session key: one replica), Poisson.", min=0.01)] = 6.0,
    light_rate_rps: Annotated[float, typer.Option(help="Requests per second from each light tenant, Poisson.", min=0.01)] = 6.0,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt tokens per request (every tenant).", min=1)] = 64,
    output_tokens: Annotated[int, typer.Option(help="Output tokens per request (every tenant).", min=1)] = 64,
    duration_s: Annotated[float, typer.Option(help="Seconds of arrivals and measurement per run.", min=1)] = 90.0,
    warmup_s: Annotated[float, typer.Option(help="Seconds at the start left out of the figures (queues build up).", min=0)] = 15.0,
    max_model_len: Annotated[int, typer.Option(help="Each replica's --max-model-len.", min=1)] = 512,
    max_num_seqs: Annotated[int, typer.Option(help="Each replica's --max-num-seqs (requests running at once; the rest queue in its scheduler).", min=1)] = 8,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Each replica's --max-num-batched-tokens.", min=1)] = 512,
    kv_cache_gib: Annotated[int, typer.Option(help="Each replica's VLLM_CPU_KVCACHE_SPACE (GiB).", min=1)] = 1,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, prompts and the engines (the same for every run).", min=0)] = 0,
    base_port: Annotated[int, typer.Option(help="Replicas listen on consecutive loopback ports from this one, then the router: the same ports every run put tenant heavy on the same replica. 0: any free ports.", min=0, max=65535)] = 18400,
    analyse_only: Annotated[bool, typer.Option(help="Re-analyse the runs already in --output instead of starting servers.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the result JSON to stdout.")] = False,
) -> None:
    """Fair sharing across vLLM replicas behind vllm-router: FCFS vs per-replica vs Redis-shared attributed VTC."""
    console = Console(stderr=True)
    check_output_folder(output)
    settings = eo.engine_settings(engine_model)
    workload = {
        "tenants": fleet_tenants(light_tenants, heavy_rate_rps=heavy_rate_rps, light_rate_rps=light_rate_rps, prompt_tokens=prompt_tokens, output_tokens=output_tokens),
        "duration_s": duration_s,
        "seed": seed,
    }
    engine = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "kv_cache_gib": kv_cache_gib, "seed": seed}
    result = run_fleet_experiment(
        output,
        latency_model_path=model,
        engine_dir=Path(settings.model),
        engine=engine,
        replicas=replicas,
        workload=workload,
        warmup_s=warmup_s,
        policies=policy,
        base_port=base_port,
        analyse_only=analyse_only,
        progress=lambda message: console.print(f"[bold]fleet[/]: {message}", highlight=False),
    )
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title="fleet: attributed engine time per tenant, summed over replicas")
    for column in ("run", "tenant", "engine s", "share", "per replica s", "done/s", "backlogged", "max/min", "Jain", "done max/min", "out tok/s", "out vs FCFS", "decode tok/s", "decode vs FCFS"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, data in result["runs"].items():
        summary, comparison = data["summary"], result["comparison"][name]
        for k, tenant in enumerate(summary["attributed_s"]):
            first = k == 0
            table.add_row(
                FLEET_LABELS[name] if first else "",
                tenant,
                f"{summary['attributed_s'][tenant]:.1f}",
                f"{summary['attributed_fraction'][tenant]:.1%}",
                "/".join(f"{row[tenant]:.1f}" for row in summary["attributed_s_per_replica"]),
                f"{summary['completions_per_s'][tenant]:.2f}",
                "yes" if tenant in summary["backlogged_throughout"] else "no",
                f"{summary['engine_time_max_min']:.2f}" if first and summary["engine_time_max_min"] is not None else "",
                f"{summary['jain']:.3f}" if first and summary["jain"] is not None else "",
                f"{summary['completions_max_min']:.2f}" if first and summary["completions_max_min"] is not None else "",
                f"{summary['output_tokens_per_s']:.1f}" if first else "",
                f"{comparison['throughput_vs_fcfs']:.2f}" if first and comparison["throughput_vs_fcfs"] is not None else "",
                f"{summary['decode_tokens_per_s']:.1f}" if first else "",
                f"{comparison['decode_throughput_vs_fcfs']:.2f}" if first and comparison["decode_throughput_vs_fcfs"] is not None else "",
            )
    print_table(table, console)
    console.print(f"wrote {output / 'fleet.json'} and {output / 'fleet.png'}", highlight=False)


def calibration(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the sessions' traces, logs, the calibrated models and calibration.json.", file_okay=False, metavar="DIR")] = Path("calibration-experiment"),
    engine_model: eo.EngineModel = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(help="Two shipped workloads (file stems) or CSV paths: the calibration session's, then the held-out session's. Default: azure-2023-conv, azure-2023-code.", metavar="NAME|CSV"),
    ] = None,
    phases: Annotated[str, typer.Option(help="Concurrent clients of each traffic phase, comma-separated.", metavar="N,N,...")] = "1,2,4,8,12,16,24",
    phase_s: Annotated[float, typer.Option(help="Seconds of each traffic phase.", min=1)] = 15.0,
    canary: Annotated[str, typer.Option(help="The canary's requests, sent one at a time before each phase and after the last: PROMPTxOUTPUT tokens, comma-separated.", metavar="PxO,...")] = "384x16,1024x16",
    max_prompt_tokens: Annotated[int, typer.Option(help="Workload prompts longer than this are cut to it.", min=1)] = 1500,
    max_output_tokens: Annotated[int, typer.Option(help="Workload outputs longer than this are cut to it.", min=2)] = 48,
    kv_cache_gib: eo.KvCacheGib = eo.KV_CACHE_GIB,
    seed: Annotated[int, typer.Option(help="Seed of the calibration session's request draws and prompts (the held-out session: seed + 1).", min=0)] = 0,
    profile: Annotated[bool, typer.Option(help="Also calibrate by profiling the served settings (llmvisor calibrate --fingerprint; about 3 minutes).")] = True,
    profile_points: Annotated[int, typer.Option(help="--points of the profile.", min=1)] = 12,
    profile_max_decode_steps: Annotated[int, typer.Option(help="--max-decode-steps of the profile.", min=1)] = 16,
    analyse_only: Annotated[bool, typer.Option(help="Re-analyse the sessions already in --output (the live fit is redone; a profile already there is kept).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the result JSON to stdout.")] = False,
) -> None:
    """Calibration on the served engine: fit on one served session, score on a held-out one, against the canary's noise floor."""
    from llmvisor.profile.calibration_experiment import run_calibration_experiment

    console = Console(stderr=True)
    check_output_folder(output)
    settings = eo.engine_settings(engine_model)
    stems = workload or ["azure-2023-conv", "azure-2023-code"]
    if len(stems) != 2:
        raise LlmvisorError(f"--workload: give two (the calibration session's, then the held-out one's), got {len(stems)}")
    paths = tuple(Path(stem) if Path(stem).suffix == ".csv" else shipped.workloads_dir() / f"{stem}.csv" for stem in stems)
    for path in paths:
        if not path.is_file():
            raise LlmvisorError(f"--workload: {path}: no such workload file (shipped: {', '.join(Path(f).stem for f in shipped.WORKLOAD_FILES)})")
    result = run_calibration_experiment(
        output,
        engine_dir=Path(settings.model),
        workloads=paths,
        phases=parse_int_list(phases, "--phases"),
        phase_s=phase_s,
        canary=parse_canary(canary),
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
        seed=seed,
        kv_cache_gib=kv_cache_gib,
        profile=profile,
        profile_points=profile_points,
        profile_max_decode_steps=profile_max_decode_steps,
        analyse_only=analyse_only,
    )
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    floor = result["noise_floor"]
    table = Table(title=f"held-out served session: relative residuals (noise floor p50 {floor['p50']:.1%}, p90 {floor['p90']:.1%})")
    for column in ("model", "|r| p50", "|r| p90", "signed p50", "decode-only p50", "with prefill p50", f"p50 <= {result['goal']['limit']:.1%}"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, figures in result["residuals"].items():
        every = figures["all"]
        table.add_row(name, f"{every['abs_relative_residual_p50']:.1%}", f"{every['abs_relative_residual_p90']:.1%}",
                      f"{every['relative_residual_p50']:+.1%}", *(
                          "–" if figures[kind] is None else f"{figures[kind]['abs_relative_residual_p50']:.1%}" for kind in ("decode_only", "with_prefill")
                      ), "met" if result["goal"]["met"][name] else "not met")
    print_table(table, console)
    console.print(f"wrote {output / 'calibration.json'}", highlight=False)


def parse_int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise LlmvisorError(f"{option}: expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise LlmvisorError(f"{option}: expected one or more numbers >= 1, got {text!r}")
    return values


def parse_canary(text: str) -> list[list[int]]:
    shapes = []
    for part in text.split(","):
        prompt, _, output = part.strip().partition("x")
        if not (prompt.isdigit() and output.isdigit()) or int(prompt) < 1 or int(output) < 2:
            raise LlmvisorError(f"--canary: {part.strip()!r} is not PROMPTxOUTPUT (prompt >= 1, output >= 2 tokens), e.g. 384x16")
        shapes.append([int(prompt), int(output)])
    return shapes


def held_out_factor(path: Path) -> float:
    """``models.llmvisor.decode.underprediction_factor_p90`` of an `llmvisor eval` result (held-out runs)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LlmvisorError(f"--held-out-eval: {path}: not a readable JSON file ({exc.__class__.__name__})") from None
    evaluation = value.get("evaluation", value) if isinstance(value, dict) else None
    try:
        factor = float(evaluation["models"]["llmvisor"]["decode"]["underprediction_factor_p90"])
    except (KeyError, TypeError, ValueError):
        raise LlmvisorError(f"--held-out-eval: {path}: no models.llmvisor.decode.underprediction_factor_p90 (write it with `llmvisor eval --json`)") from None
    return factor


def admission(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for each seed's runs and admission.json.", file_okay=False, metavar="DIR")] = Path("admission-experiment"),
    like: Annotated[Path | None, typer.Option(help="A fairness.json whose workload and engine settings to repeat. Default: the shipped one.", dir_okay=False, metavar="FAIRNESS.json")] = None,
    model: eo.LatencyModel = None,
    engine_model: eo.EngineModel = None,
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated: each draws its own arrivals, prompts and engine sampling.", metavar="S,S,...")] = "0,1,2",
    tpot_slo_s: Annotated[float, typer.Option(help="TPOT SLO of the admission control, seconds.", min=0.001)] = 0.05,
    held_out_eval: Annotated[Path | None, typer.Option(help="An `llmvisor eval` result (e.g. docs/results/demo.json): its held-out decode underprediction_factor_p90 scales the predictions.", dir_okay=False, metavar="EVAL.json")] = None,
    tpot_prediction_factor: Annotated[float | None, typer.Option(help="The prediction factor itself (instead of --held-out-eval). Neither: the model's training factor.", min=0.01)] = None,
    analyse_only: Annotated[bool, typer.Option(help="Re-analyse the runs already in --output instead of running the engine.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the result JSON to stdout.")] = False,
) -> None:
    """SLO admission repeated over seeds: attributed VTC without and with admission control on the same arrivals."""
    console = Console(stderr=True)
    if not analyse_only:
        check_output_folder(output)
    source = like if like is not None else shipped.result_path("fairness.json")
    try:
        setup = json.loads(source.read_text(encoding="utf-8"))["setup"]
        workload = {"tenants": setup["workload"]["tenants"], "duration_s": float(setup["workload"]["duration_s"])}
        window_s, warmup_s = float(setup["window_s"]), float(setup["warmup_s"])
        given = setup["engine"]
        engine_given = {"max_model_len": int(given["max_model_len"]), "max_num_batched_tokens": int(given["max_num_batched_tokens"]),
                        "max_num_seqs": int(given["max_num_seqs"]), "kv_cache_gib": int(given["kv_cache_space_gib"]),
                        "enforce_eager": bool(given["enforce_eager"]), "threads": given.get("threads"), "executor": given.get("executor", "uni"),
                        "dtype": given.get("dtype", eo.DTYPE)}  # a run before --dtype ran vLLM's auto
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise LlmvisorError(f"--like: {source}: not a fairness.json with setup.workload, setup.engine, window_s and warmup_s") from None
    try:
        seed_list = [int(part) for part in seeds.split(",") if part.strip()]
    except ValueError:
        raise LlmvisorError(f"--seeds: comma-separated whole numbers (got {seeds!r})") from None
    if held_out_eval is not None and tpot_prediction_factor is not None:
        raise LlmvisorError("--held-out-eval and --tpot-prediction-factor: give one")
    if held_out_eval is not None:
        factor = held_out_factor(held_out_eval)
        factor_source = f"held-out: {held_out_eval.name} models.llmvisor.decode.underprediction_factor_p90"
    elif tpot_prediction_factor is not None:
        factor, factor_source = tpot_prediction_factor, "configured"
    else:
        factor, factor_source = None, "the model's training factor (1 / (1 - train p90 |relative error|))"
    settings = eo.engine_settings(engine_model, **engine_given, seed=0)
    engine = {key: value for key, value in settings.as_dict().items() if key not in ("model", "seed")}
    result = run_admission_experiment(
        output, latency_model_path=model, engine_dir=Path(settings.model), engine=engine, workload=workload, seeds=seed_list,
        tpot_slo_s=tpot_slo_s, tpot_prediction_factor=factor, prediction_factor_source=factor_source, window_s=window_s,
        warmup_s=warmup_s, analyse_only=analyse_only,
        progress=lambda message: console.print(f"[bold]admission[/]: {message}", highlight=False),
    )
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(admission_markdown_summary(result))
    console.print(f"wrote {output / 'admission.json'}", highlight=False)
