"""CLI commands of the model registry: ``llmvisor models add|list|activate`` and ``llmvisor refit``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from llmvisor.cli.params import period_bound_us
from llmvisor.cli.serve import DEFAULT_DB_URL, DbOption, JsonOption, echo_json
from llmvisor.core.model import StepLatencyModel

ClassOption = Annotated[str | None, typer.Option("--class", help="Engine class: the engine fingerprint id its steps carry.", metavar="ID")]


def models_add(
    model_file: Annotated[Path, typer.Argument(help="A fitted model (JSON, `llmvisor fit -o`).", dir_okay=False, metavar="MODEL")],
    engine_class: ClassOption = None,
    activate_it: Annotated[bool, typer.Option("--activate", help="Make it the class's active model (attributes its pending steps).")] = False,
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Store a fitted model as the next version of its engine class (default: the fingerprint it was fitted on)."""
    from llmvisor.ledger import Ledger
    from llmvisor.service.registry import activate, model_class

    model = StepLatencyModel.from_json(model_file)
    engine_class = model_class(model, engine_class, source=str(model_file))
    ledger = Ledger(db)
    try:
        version = ledger.add_model(engine_class, json.dumps(model.to_dict()), model_file.name)
        pending = activate(ledger, engine_class, version) if activate_it else None
    finally:
        ledger.close()
    if json_output:
        echo_json({"engine_class": engine_class, "version": version, "active": activate_it,
                   "pending_steps_attributed": None if pending is None else pending.steps_attributed})
        return
    typer.echo(f"{engine_class} v{version}" + (f" active; {pending.steps_attributed} pending steps attributed" if pending else ""))


def models_list(db: DbOption = DEFAULT_DB_URL, json_output: JsonOption = False) -> None:
    """List the stored model versions per engine class, and which is active."""
    from llmvisor.ledger import Ledger

    ledger = Ledger(db)
    try:
        versions = ledger.list_models()
        pending = ledger.pending_classes()
    finally:
        ledger.close()
    rows = [
        {"engine_class": m.engine_class, "version": m.version, "active": m.active, "source": m.source,
         "created_utc": datetime.fromtimestamp(m.created_at_us / 1e6, tz=UTC).isoformat(timespec="seconds")}
        for m in versions
    ]
    if json_output:
        echo_json({"models": rows, "pending_steps": pending})
        return
    for row in rows:
        typer.echo(f"{row['engine_class']}\tv{row['version']}\t{'active' if row['active'] else '-'}\t{row['created_utc']}\t{row['source']}")
    for engine_class, n in pending.items():
        typer.echo(f"{engine_class or '(no fingerprint)'}: {n} steps pending")


def models_activate(
    engine_class: Annotated[str, typer.Argument(help="Engine class (fingerprint id).")],
    version: Annotated[int, typer.Argument(help="The version to activate.", min=1)],
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Make a stored version the one attributing its class, and attribute the class's pending steps with it.
    Steps already attributed keep their shares (bills are never rewritten)."""
    from llmvisor.ledger import Ledger
    from llmvisor.service.registry import activate

    ledger = Ledger(db)
    try:
        result = activate(ledger, engine_class, version)
    finally:
        ledger.close()
    if json_output:
        echo_json({"engine_class": engine_class, "version": version, "pending_steps_attributed": result.steps_attributed,
                   "pending_attributed_ns": result.attributed_ns})
        return
    typer.echo(f"{engine_class} v{version} active; {result.steps_attributed} pending steps attributed "
               f"({result.attributed_ns / 1e9:.3f} s)")


def refit(
    engine_class: Annotated[str, typer.Option("--class", help="Engine class (fingerprint id) to refit.", metavar="ID")],
    trace: Annotated[list[Path] | None, typer.Option("--from-trace", help="Fit on these trace files instead of the ledger (repeatable), as `llmvisor calibrate --from-trace` does.", dir_okay=False, metavar="TRACE")] = None,
    archive: Annotated[str | None, typer.Option("--from-archive", help="Fit on the class's steps in the raw-step archive (a directory or fsspec URL) instead of the ledger.", metavar="URL")] = None,
    test_fraction: Annotated[float, typer.Option(help="Newest fraction of the steps held out to compare the models.", min=0.0, max=1.0)] = 0.2,
    newest_steps: Annotated[int, typer.Option(help="Steps of the class read from the ledger (the newest).", min=1)] = 20_000,
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Fit a new version of a class's model from its recent steps; activate it only if it predicts the newest
    (held-out) steps better than the active version. The new version is stored either way."""
    from llmvisor.ledger import Ledger
    from llmvisor.service.refit import refit_class

    ledger = Ledger(db)
    try:
        result = refit_class(ledger, engine_class, traces=trace or (), archive_url=archive, test_fraction=test_fraction, newest_steps=newest_steps)
    finally:
        ledger.close()
    if json_output:
        echo_json({
            "engine_class": result.engine_class, "version": result.version, "activated": result.activated,
            "train_steps": result.train_steps, "test_steps": result.test_steps, "new_error": result.new_error,
            "active_version": result.active_version, "active_error": result.active_error,
            "pending_steps_attributed": None if result.pending is None else result.pending.steps_attributed,
        })
        return
    typer.echo(f"held-out error (mean |measured - predicted| / measured, newest {result.test_steps} steps):")
    typer.echo(f"  new v{result.version}: {result.new_error:.4f} (fitted on {result.train_steps} steps)")
    if result.active_version is not None:
        typer.echo(f"  active v{result.active_version}: {result.active_error:.4f}")
    typer.echo(f"v{result.version} {'activated' if result.activated else 'stored, not activated (not better)'}")



def adjust(
    engine_class: Annotated[str, typer.Option("--class", help="Engine class (fingerprint id) whose bills to correct.")],
    start: Annotated[str, typer.Option(help="Period start (steps starting at or after it): ISO 8601 or Unix seconds.", metavar="TIME")],
    end: Annotated[str, typer.Option(help="Period end (steps starting before it): ISO 8601 or Unix seconds.", metavar="TIME")],
    to_version: Annotated[int | None, typer.Option(help="Model version to re-attribute with (default: the class's active one).", min=1, metavar="N")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the entries without writing them.")] = False,
    archive: Annotated[str | None, typer.Option("--archive", help="The raw-step archive (a directory or an fsspec URL): needed "
                                                "where the period was billed in window aggregates (window mode).", metavar="URL")] = None,
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Correct a period's bills after a refit: re-attribute the class's billed steps (in window mode, the archived steps
    of its windows) with a newer model version and write one adjustment entry per tenant (re-attributed minus billed,
    summing to 0). Bills are never rewritten."""
    from llmvisor.ledger import Ledger
    from llmvisor.service.adjust import adjust_period

    start_us, end_us = period_bound_us("--start", start), period_bound_us("--end", end)
    ledger = Ledger(db)
    try:
        result = adjust_period(ledger, engine_class, start_us, end_us, to_version=to_version, dry_run=dry_run, archive_url=archive)
    finally:
        ledger.close()
    if json_output:
        echo_json(result.to_dict())
        return
    verb = "would write" if dry_run else "wrote"
    billed_by = ", ".join("the default model" if v == "default" else f"v{v}" for v in result.from_versions.split(","))
    windows = f" ({result.window_steps} of them in {result.num_windows} windows, from the archive)" if result.num_windows else ""
    typer.echo(f"{engine_class}: {result.num_steps} steps{windows} ({result.measured_ns / 1e9:.3f} s measured) billed by {billed_by}, "
               f"re-attributed with v{result.to_version}; {verb} {len(result.entries)} entries")
    for entry in result.entries:
        typer.echo(f"  {entry.tenant}\tbilled {entry.billed_ns / 1e9:.6f} s\tnow {entry.reattributed_ns / 1e9:.6f} s\t"
                   f"{'debit' if entry.delta_ns > 0 else 'credit' if entry.delta_ns < 0 else 'no change'} {abs(entry.delta_ns) / 1e9:.6f} s")
