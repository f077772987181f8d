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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be written or sent; write and send nothing.")] = False,
    auth_env: Annotated[str | None, typer.Option("--auth-env", help="Send 'Authorization: Bearer $VAR' with --push (the "
                                                 "receiver's API key, read from this environment variable).",
                                                 metavar="VAR")] = None,
    event_name: Annotated[str, typer.Option(help="Stripe meter event name / Lago billable metric code.",
                                            metavar="NAME")] = "llmvisor_engine_ns",
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Export a period's charges (usage per tenant, engine class, model version and hour, priced at the price in force;
    adjustments as their own records), each with a stable idempotency id."""
    from llmvisor.billing import charges
    from llmvisor.billing import formats as fmt
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
    check_ledger_exists(db)
    ledger = Ledger(db)
    try:
        found = charges(ledger, start_us, end_us, tenant or None)
    finally:
        ledger.close()
    if format_ == "focus":
        rows = fmt.focus_rows(found)
        if dry_run:
            for row in rows:
                typer.echo(json.dumps(row))
            return
        fmt.write_focus(rows, output)
        if json_output:
            echo_json({"format": format_, "file": str(output), "records": len(rows), "ids": [r["x_IdempotencyId"] for r in rows]})
        else:
            typer.echo(f"{output}: {len(rows)} FOCUS rows")
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
    if json_output:
        echo_json({"format": format_, "file": None if output is None else str(output), "records": len(bodies),
                   "pushed_to": push_url, "bodies_sent": len(sends) if push_url else 0, "requests": requests})
