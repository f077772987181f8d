"""``llmvisor export``: the ledger's charges of a period as FOCUS rows or metering events, to a file or an ingest URL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmvisor.cli.params import WHOLE_HOUR, check_ledger_exists, period_bound_us
from llmvisor.cli.serve import DEFAULT_DB_URL, DbOption, JsonOption, echo_json
from llmvisor.errors import LlmvisorError


def export(
    format_: Annotated[str, typer.Option("--format", help="focus (CSV or Parquet by -o's suffix), cloudevents, stripe or lago.",
                                         metavar="FORMAT")],
    start: Annotated[str, typer.Option(help="Period start, a whole UTC hour: ISO 8601 or Unix seconds.", metavar="TIME")],
    end: Annotated[str, typer.Option(help="Period end (exclusive), a whole UTC hour.", metavar="TIME")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="File to write (FOCUS: .csv or .parquet; events: JSON).",
                                                dir_okay=False, metavar="FILE")] = None,
    tenant: Annotated[list[str] | None, typer.Option("--tenant", help="Only this tenant (repeatable).", metavar="NAME")] = None,
    customers: Annotated[Path | None, typer.Option("--customers", help="JSON object of tenant name to customer id (events).",
                                                   dir_okay=False, metavar="FILE")] = None,
    push_url: Annotated[str | None, typer.Option("--push", help="POST the events to this ingest URL, retrying 429, "
                                                 "5xx and connection errors.", metavar="URL")] = None,
    progress: Annotated[Path | None, typer.Option("--progress", help="With --push: record each body the receiver "
                                                  "acknowledged in this file; a rerun with it resumes, skipping them.",
                                                  dir_okay=False, metavar="FILE")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be written or sent; write, send and record "
                                          "nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Export a period some of whose lines this format already has: "
                                        "only the lines it has not (the corrections).")] = False,
    auth_env: Annotated[str | None, typer.Option("--auth-env", help="Send 'Authorization: Bearer $VAR' with --push (the "
                                                 "receiver's API key, read from this environment variable).",
                                                 metavar="VAR")] = None,
    event_name: Annotated[str, typer.Option(help="Stripe meter event name / Lago billable metric code.",
                                            metavar="NAME")] = "llmvisor_engine_ns",
    by_adapter: Annotated[bool, typer.Option("--by-adapter", help="One usage line per tenant and LoRA adapter (FOCUS "
                                             "x_LoraAdapter, events' lora_adapter; '' the base model).")] = False,
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Export a period's charges (usage per tenant, engine class, model version and hour, priced at the price in force;
    adjustments as their own records), each line with an id that names its content. Every line exported is recorded
    in the ledger; usage stored later for an exported hour is exported as a correction line of its own. A period
    already exported in this format is refused without --force (receivers deduplicate ids only for a while: Stripe
    24 hours), and with it only the corrections are sent. A period whose end is LLMVISOR_CLOSE_PERIOD_AFTER_S (default 3
    days) in the past is closed first (llmvisor close-period)."""
    from llmvisor.billing import formats as fmt
    from llmvisor.billing import periods
    from llmvisor.ledger import Ledger

    if format_ not in fmt.FORMATS:
        raise LlmvisorError(f"--format: choose one of {', '.join(fmt.FORMATS)}, not {format_!r}")
    if output is None and push_url is None and not dry_run:
        raise LlmvisorError("name a file (-o FILE), an ingest URL (--push URL) or --dry-run")
    if format_ == "focus" and push_url is not None:
        raise LlmvisorError("--push sends metering events; a FOCUS export is a file (-o FILE.csv or FILE.parquet)")
    if progress is not None and push_url is None:
        raise LlmvisorError("--progress records what a push sent; name the ingest URL (--push URL)")
    start_us, end_us = period_bound_us("--start", start, WHOLE_HOUR), period_bound_us("--end", end, WHOLE_HOUR)
    headers = {}
    if auth_env is not None:
        import os

        if not os.environ.get(auth_env):
            raise LlmvisorError(f"--auth-env: the environment variable {auth_env} is not set")
        headers["Authorization"] = f"Bearer {os.environ[auth_env]}"
    customer_ids = fmt.read_customer_map(customers)
    close_after = periods.close_after_s()
    check_ledger_exists(db)
    ledger = Ledger(db)
    try:
        _export(ledger, format_, start_us, end_us, tenant or None, output, customer_ids, push_url, progress, dry_run, force,
                headers, event_name, json_output, close_after, by_adapter)
    finally:
        ledger.close()


def _export(ledger, format_, start_us, end_us, tenants, output, customer_ids, push_url, progress, dry_run, force, headers,
            event_name, json_output, close_after, by_adapter=False) -> None:
    """Plan (record the new lines), write or push what the format does not have yet, then mark it delivered."""
    from llmvisor.billing import formats as fmt
    from llmvisor.billing import periods

    if format_ == "focus":  # refuse an unpriced class before recording anything
        fmt.focus_rows([c for c in charges_of(ledger, start_us, end_us, tenants, by_adapter) if c.price is None])
    plan = periods.plan_export(ledger, format_, start_us, end_us, tenants, force=force, dry_run=dry_run,
                               close_after=close_after, by_adapter=by_adapter)
    found = plan.lines
    if format_ == "focus":
        rows = fmt.focus_rows(found)
        if dry_run:
            for row in rows:
                typer.echo(json.dumps(row))
            return
        fmt.write_focus(rows, output)
        periods.mark_exported(ledger, format_, found)
        if json_output:
            echo_json({"format": format_, "file": str(output), "records": len(rows), "ids": [r["x_IdempotencyId"] for r in rows],
                       "corrections": sum(c.revision > 0 for c in found), "already_exported": plan.already_exported})
        else:
            typer.echo(f"{output}: {len(rows)} FOCUS rows ({sum(c.revision > 0 for c in found)} corrections)")
        return
    if format_ == "cloudevents":
        bodies = fmt.cloudevents_json(fmt.cloudevents(found, customer_ids))
        sends, content_type = [bodies] if bodies else [], "application/cloudevents-batch+json"
    elif format_ == "stripe":
        bodies = fmt.stripe_events(found, customer_ids, event_name=event_name, warn=lambda line: typer.echo(line, err=True))
        sends, content_type = bodies, "application/x-www-form-urlencoded"
    else:
        bodies = fmt.lago_events(found, customer_ids, code=event_name)
        sends, content_type = fmt.lago_batches(bodies), "application/json"
    if dry_run:
        for body in sends:
            typer.echo(json.dumps(body))
        typer.echo(f"dry run: {len(bodies)} events in {len(sends)} requests{f' to {push_url}' if push_url else ''}; nothing sent",
                   err=True)
        return
    say = (lambda _line: None) if json_output else typer.echo
    if output is not None:
        output.write_text(json.dumps(bodies, indent=1) + "\n", encoding="utf-8")
        say(f"{output}: {len(bodies)} {format_} events")
    requests = 0
    if push_url is not None:
        from llmvisor.billing.push import push, stripe_form

        requests = push(push_url, sends, content_type=content_type, headers=headers,
                        encode=stripe_form if format_ == "stripe" else None, progress=progress)
        say(f"{push_url}: {len(bodies)} events sent in {len(sends)} bodies ({requests} requests with retries)")
    periods.mark_exported(ledger, format_, found)
    if json_output:
        echo_json({"format": format_, "file": None if output is None else str(output), "records": len(bodies),
                   "ids": [c.idempotency_id for c in found], "corrections": sum(c.revision > 0 for c in found),
                   "already_exported": plan.already_exported,
                   "pushed_to": push_url, "bodies_sent": len(sends) if push_url else 0, "requests": requests})


def charges_of(ledger, start_us: int, end_us: int, tenants, by_adapter: bool = False):
    from llmvisor.billing import charges

    return charges(ledger, start_us, end_us, tenants, by_adapter=by_adapter)


def close_period(
    period: Annotated[str, typer.Option("--period", help="The billing period: a calendar UTC month, YYYY-MM.", metavar="MONTH")],
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Close a billing period (a calendar UTC month that has ended): record what it bills, its lines as the ledger has
    them now, so that usage stored for it later is billed as corrections in a later month, never merged into them.
    An export closes a period by itself LLMVISOR_CLOSE_PERIOD_AFTER_S after its end (default 3 days)."""
    from llmvisor.billing import periods
    from llmvisor.ledger import Ledger

    month = periods.parse_period(period)
    check_ledger_exists(db)
    ledger = Ledger(db)
    try:
        closed = periods.close_period(ledger, month)
    finally:
        ledger.close()
    if json_output:
        echo_json({"period": closed.period, "closed": closed.closed, "closed_at_us": closed.closed_at_us,
                   "lines": closed.num_lines})
    elif closed.closed:
        typer.echo(f"period {closed.period} closed: {closed.num_lines} lines frozen")
    else:
        typer.echo(f"period {closed.period} was already closed ({closed.num_lines} lines); nothing changed")
