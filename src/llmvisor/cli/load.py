"""``llmvisor load``: the command over `llmvisor.service.load` (throughput) and `llmvisor.service.fleet`
(``--engines N``: a fleet of engines at a fixed step rate), printing a line or JSON per target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmvisor.errors import LlmvisorError


def load(
    db: Annotated[
        list[str] | None,
        typer.Option(
            "--db",
            help="Database to load (repeatable): 'sqlite' for a temporary SQLite file, or a URL of a scratch "
            "database (load runs are stored there). A server is started for each.",
        ),
    ] = None,
    url: Annotated[str | None, typer.Option(help="Load an already running service on loopback instead (needs --api-key).", metavar="URL")] = None,
    api_key: Annotated[str | None, typer.Option(help="Admin key for --url.", metavar="KEY")] = None,
    model: Annotated[Path | None, typer.Option("--model", "-m", help="Latency model JSON; default: one fitted on synthetic steps.", dir_okay=False, metavar="FILE")] = None,
    steps: Annotated[int, typer.Option(help="Steps to send per target.", min=1, max=2_000_000)] = 60_000,
    batch_size: Annotated[int, typer.Option(help="Requests per step (B).", min=1, max=1024)] = 32,
    steps_per_request: Annotated[int, typer.Option(help="Steps per POST.", min=1, max=20_000)] = 1000,
    concurrency: Annotated[int, typer.Option(help="Concurrent client connections, like engines pushing at once.", min=1, max=16)] = 2,
    step_interval_ms: Annotated[
        float, typer.Option(help="Time between the steps' timestamps; the ledger stores a row per request per second.", min=0, max=3_600_000)
    ] = 20.0,
    max_seconds: Annotated[float, typer.Option(help="Stop sending after this long, per target (with --engines: the run's length).", min=1, max=600)] = 120.0,
    body: Annotated[
        str, typer.Option(help="Body form: 'parquet' (a trace file), 'columns' (JSON, one list per column) or 'rows' (JSON, one object per row).")
    ] = "parquet",
    engines: Annotated[
        int | None,
        typer.Option(help="Simulate this many engines, each stepping at --engine-steps-per-s and POSTing what ended every --flush-ms "
                     "(JSON columns, as the engine pusher sends), into --processes service processes; reports accepted steps/s, "
                     "ingest latency and staleness.", min=1, max=5000),
    ] = None,
    processes: Annotated[int, typer.Option(help="With --engines: service processes on the one database.", min=1, max=16)] = 2,
    engine_steps_per_s: Annotated[float, typer.Option(help="With --engines: steps per second of each engine.", min=0.1, max=1000)] = 50.0,
    flush_ms: Annotated[float, typer.Option(help="With --engines: how often each engine POSTs the steps that ended.", min=1, max=60_000)] = 200.0,
    mode: Annotated[
        str, typer.Option(help="With --engines: 'steps' (each engine POSTs its steps to /v1/steps) or 'aggregate' (one window "
                          "aggregate per --window-s to /v1/windows, attributed at the edge, raw steps to a Parquet archive).")
    ] = "steps",
    window_s: Annotated[float, typer.Option(help="With --mode aggregate: the window, seconds (the engines' default).", min=0.05, max=600)] = 1.0,
    archive: Annotated[
        str | None, typer.Option(help="With --mode aggregate: where the engines archive their raw steps (directory or fsspec URL); "
                                 "default: a temporary directory, removed after the run.", metavar="URL")
    ] = None,
    request_totals: Annotated[
        bool, typer.Option(help="With --mode aggregate: the service processes keep a row per request (LLMVISOR_REQUEST_TOTALS); "
                           "--no-request-totals leaves a request's usage to the archive, as a large fleet does.")
    ] = True,
    json_output: Annotated[bool, typer.Option("--json", help="Print only JSON to stdout: the settings and each target's figures.")] = False,
) -> None:
    """Measure sustained ingest throughput (steps/s) on loopback, or with --engines a fleet's accepted rate,
    latency and staleness; bounded by --steps and --max-seconds."""
    from llmvisor.service.fleet import FleetSettings, load_fleet
    from llmvisor.service.load import load_targets

    if engines is not None:
        if url is not None:
            raise LlmvisorError("--engines starts its own service processes; it does not take --url")
        if archive is not None and mode != "aggregate":
            raise LlmvisorError("--archive: only engines in --mode aggregate archive their steps")
        if archive is not None and len(db or ["sqlite"]) > 1:
            raise LlmvisorError("--archive: give one --db with it (each run archives its own steps)")
        settings = FleetSettings(engines=engines, processes=processes, steps_per_s_per_engine=engine_steps_per_s,
                                 batch_size=batch_size, flush_interval_s=flush_ms / 1e3, duration_s=max_seconds,
                                 warmup_s=min(5.0, max_seconds / 4), mode=mode, window_s=window_s if mode == "aggregate" else None,
                                 request_totals=request_totals)
        results = [load_fleet(target, settings, model_path=model, archive_url=archive) for target in (db or ["sqlite"])]
        if json_output:
            typer.echo(json.dumps({"runs": [result.to_json() for result in results]}, indent=2))
            return
        for result in results:
            typer.echo(result.line())
        return
    results = load_targets(
        db or [],
        url=url,
        api_key=api_key,
        model_path=model,
        total_steps=steps,
        batch_size=batch_size,
        steps_per_request=steps_per_request,
        concurrency=concurrency,
        max_seconds=max_seconds,
        body=body,
        step_interval_s=step_interval_ms / 1e3,
    )
    if json_output:
        settings = {"batch_size": batch_size, "steps_per_request": steps_per_request, "concurrency": concurrency,
                    "body": body, "step_interval_ms": step_interval_ms}
        typer.echo(json.dumps({"settings": settings, "targets": [result.to_json() for result in results]}, indent=2))
        return
    for result in results:
        typer.echo(result.line(batch_size, steps_per_request, concurrency, body, step_interval_ms))
