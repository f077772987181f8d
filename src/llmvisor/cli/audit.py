"""``llmvisor audit``: check a tenant's bill in the ledger against the raw-step archive, to the nanosecond."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from llmvisor import shipped
from llmvisor.cli.console import print_table, stderr, stdout
from llmvisor.cli.params import check_ledger_exists, period_bound_us
from llmvisor.cli.serve import DEFAULT_DB_URL, DbOption, JsonOption, echo_json


def _seconds(ns: int) -> str:
    return f"{ns / 1e9:.9f}"



def audit(
    archive: Annotated[str, typer.Option("--archive", help="The step archive: a directory or an fsspec URL (LLMVISOR_ARCHIVE_URL).", metavar="URL")],
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant whose bill to check.")],
    start: Annotated[str, typer.Option(help="Period start (steps starting at or after it): ISO 8601 or Unix seconds.", metavar="TIME")],
    end: Annotated[str, typer.Option(help="Period end (steps starting before it): ISO 8601 or Unix seconds.", metavar="TIME")],
    model: Annotated[Path | None, typer.Option("--model", help="The service's --model, for steps it billed with it (default: the shipped latency model).", dir_okay=False, metavar="MODEL")] = None,
    requests: Annotated[int, typer.Option(help="Also list the tenant's N largest requests of the period, re-attributed as billed "
                                          "(a request's usage where the service keeps no row per request).", min=0, metavar="N")] = 0,
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Re-attribute a tenant's period from the archived raw steps with the model versions the ledger billed them
    with, and check it against the ledger's bill (equal to the nanosecond, or exit 1). Adjustments are shown."""
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.ledger import Ledger
    from llmvisor.service.audit import audit_tenant

    start_us, end_us = period_bound_us("--start", start), period_bound_us("--end", end)
    check_ledger_exists(db)
    default_model = StepLatencyModel.from_json(model or shipped.latency_model_path())
    ledger = Ledger(db)
    try:
        result = audit_tenant(ledger, archive, tenant, start_us, end_us, default_model, requests=requests)
    finally:
        ledger.close()
    if json_output:
        echo_json(result.to_dict())
    else:
        table = Table(title=f"Audit of tenant {tenant} [{start_us / 1e6:.0f}, {end_us / 1e6:.0f})")
        table.add_column("")
        table.add_column("seconds", justify="right")
        table.add_column("steps", justify="right")
        table.add_row("re-attributed from the archive", _seconds(result.reattributed_ns), str(result.audited_steps))
        table.add_row("billed per step (ledger)", _seconds(result.billed_steps_ns), "")
        table.add_row("billed usage (ledger)", _seconds(result.usage_ns), "")
        table.add_row("difference", _seconds(result.reattributed_ns - result.usage_ns), str(result.num_mismatched_steps))
        table.add_row("adjustments in the period", _seconds(result.adjusted_ns), "")
        table.add_row("net billed (usage + adjustments)", _seconds(result.net_billed_ns), "")
        print_table(table)
        if result.kv_checked:
            stdout.print(f"KV memory: archive {result.kv_block_ns_archive} block-ns ({result.kv_byte_ns_archive} byte-ns), ledger "
                         f"{result.kv_block_ns_ledger or 0} block-ns ({result.kv_byte_ns_ledger or 0} byte-ns): "
                         f"{'equal' if result.kv_ok else 'DIFFERENT'}", highlight=False)
        for label, n in result.versions.items():
            stdout.print(f"billed by {label}: {n} steps", highlight=False)
        notes = [f"{result.unbilled_steps} archived steps not billed (pending or not ingested)" if result.unbilled_steps else "",
                 f"{result.missing_steps} billed steps missing from the archive" if result.missing_steps else "",
                 f"{result.partial_adjustments} adjustments only partly in the period (not counted)" if result.partial_adjustments else ""]
        for note in filter(None, notes):
            stdout.print(note, highlight=False)
        if result.adjustments_checked:
            stdout.print(f"{result.adjustments_checked} adjusted periods re-attributed with their newest version: "
                         f"{len(result.adjustment_mismatches)} differ", highlight=False)
        for item in result.adjustment_mismatches:
            stdout.print(f"adjustment of {item['engine_class']} [{item['period_start_us'] / 1e6:.0f}, {item['period_end_us'] / 1e6:.0f}) "
                         f"to v{item['to_version']}: adjusted to {item['adjusted_to_ns']} ns, archive re-attributes "
                         f"{item['reattributed_ns']} ns", highlight=False)
        if result.requests:
            listed = Table(title=f"The tenant's {len(result.requests)} largest requests, re-attributed")
            for name, justify in (("run", "left"), ("request", "left"), ("seconds", "right"), ("steps", "right")):
                listed.add_column(name, justify=justify)
            for item in result.requests:
                listed.add_row(item["run_id"], item["request_id"], _seconds(item["attributed_ns"]), str(item["num_steps"]))
            print_table(listed)
        for step in result.mismatched_steps:
            stdout.print(f"step {step['step_id']} of run {step['run_id']}: billed {step['billed_ns']} ns, "
                         f"re-attributed {step['reattributed_ns']} ns", highlight=False)
        stdout.print("OK: the ledger's bill equals the archive's re-attribution" if result.ok else "MISMATCH", highlight=False)
    if not result.ok:
        if json_output:
            stderr.print("MISMATCH: the ledger's bill differs from the archive's re-attribution", highlight=False)
        raise typer.Exit(code=1)
