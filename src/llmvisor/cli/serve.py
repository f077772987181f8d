"""CLI commands of the service: ``llmvisor serve``, ``llmvisor keys create|list|revoke`` and
``llmvisor ledger migrate``."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from llmvisor import shipped
from llmvisor.errors import LlmvisorError

DEFAULT_DB_URL = "sqlite:///llmvisor.db"
DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        help="Ledger database URL: sqlite:///PATH (WAL mode) or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB.",
        metavar="URL",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON to stdout.")]


def echo_json(data) -> None:
    typer.echo(json.dumps(data, indent=2))


def serve(
    model: Annotated[
        Path | None,
        typer.Option("--model", "-m", help="Fitted latency model (JSON) billing the engine class it was fitted on (its fingerprint) while "
                     "the registry has no active version of it, and steps without a fingerprint (`llmvisor calibrate` fits one to "
                     "the served engine; `llmvisor models add FILE --activate` registers it for every process). Default: the "
                     "shipped latency model.", dir_okay=False, metavar="FILE"),
    ] = None,
    fallback_model: Annotated[
        Path | None,
        typer.Option("--fallback-model", help="Bill steps of every other engine class without an active model with this model, "
                     "a model of another engine (warned once per class in the log). Without it those steps are stored pending "
                     "until a model of their class is activated.", dir_okay=False, metavar="FILE"),
    ] = None,
    db: DbOption = DEFAULT_DB_URL,
    host: Annotated[str, typer.Option(help="Address to listen on.", metavar="ADDRESS")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (not 8000: vLLM's OpenAI server listens there by default).", min=1, max=65535)] = 8080,
    max_body_mb: Annotated[float, typer.Option(help="Largest POST /v1/steps body accepted (MiB); larger is a 413.", min=0.001)] = 64.0,
    max_steps_per_request: Annotated[int, typer.Option(help="Most steps in one POST /v1/steps.", min=1)] = 20_000,
    public_metrics: Annotated[bool, typer.Option(help="Serve /metrics without a key (it names every tenant).")] = False,
    gzip_bodies: Annotated[bool, typer.Option(help="Take gzip request bodies (Content-Encoding: gzip, as the engines' pushers send "
                                              "them; --max-body-mb bounds them decoded too). --no-gzip-bodies answers them 415: the "
                                              "pushers then send plain JSON.")] = True,
    max_concurrent_ingest: Annotated[
        int, typer.Option(help="Batches attributed and stored at once; more wait their turn (at most the 16 database connections).", min=1, max=16)
    ] = 8,
    pending_unknown_classes: Annotated[
        bool, typer.Option(help="Deprecated, no effect: steps of an engine class without a model are stored pending by default "
                           "(--fallback-model bills them instead).")
    ] = False,
    drift_band: Annotated[float, typer.Option(help="Drift alarm: the band the median signed relative residual of a class must stay in (+-).", min=0.0)] = 0.10,
    drift_window_steps: Annotated[int, typer.Option(help="Drift: steps per class in the residual window.", min=1)] = 2000,
    drift_alarm_steps: Annotated[int, typer.Option(help="Drift alarm: steps the median must stay outside the band.", min=1)] = 500,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.", metavar="critical|error|warning|info|debug|trace")] = "info",
) -> None:
    """Run the accounting service: ingest steps, attribute them, keep the ledger, answer usage queries."""
    import uvicorn

    from llmvisor.cli.console import stderr
    from llmvisor.service.app import create_app
    from llmvisor.service.metrics import DriftSettings

    if pending_unknown_classes:
        stderr.print("[yellow]warning:[/] --pending-unknown-classes is deprecated and has no effect: steps of an engine class "
                     "without a model are stored pending by default (--fallback-model FILE bills them instead)", highlight=False)
    if model is None:
        model = shipped.latency_model_path()
    for path in (model, fallback_model):
        if path is not None and not path.is_file():
            raise LlmvisorError(f"{path}: no such model file (fit one with `llmvisor fit`)")
    listening = bind_listening_socket(host, port)  # before the ledger exists: a busy port leaves nothing behind
    try:
        app = create_app(
            model,
            db,
            max_body_bytes=int(max_body_mb * 1024 * 1024),
            max_steps_per_request=max_steps_per_request,
            public_metrics=public_metrics,
            gzip_bodies=gzip_bodies,
            max_concurrent_ingest=max_concurrent_ingest,
            fallback_model_path=fallback_model,
            drift=DriftSettings(band=drift_band, window_steps=drift_window_steps,
                                min_window_steps=min(200, drift_window_steps), alarm_after_steps=drift_alarm_steps),
        )
        stderr.print(f"llmvisor serve: --model {shipped.portable_path(str(model))}"
                     + (f", --fallback-model {fallback_model}" if fallback_model is not None else ""), highlight=False)
        for line in app.state.registry.billing_summary():
            stderr.print(f"  {line}", highlight=False)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10))
        server.run(sockets=[listening])
    finally:
        listening.close()
    if not server.started:
        raise typer.Exit(code=3)  # uvicorn's own exit code when the application fails to start


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for the server to listen on, as uvicorn binds it; a port another process
    holds, or an address this machine does not have, is one line naming it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise LlmvisorError(f"--host {host}: not an address to listen on ({error.strerror})") from None
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(address)
    except OSError as error:
        listening.close()
        raise LlmvisorError(f"--port {port}: cannot listen on {host}:{port} ({error.strerror}); is another server running there?") from None
    listening.set_inheritable(True)
    return listening


def keys_create(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Tenant whose usage the key may read.")] = None,
    db: DbOption = DEFAULT_DB_URL,
    admin: Annotated[bool, typer.Option("--admin", help="An admin key: ingest, key administration, every tenant.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Create an API key and print it once; only its hash is stored."""
    from llmvisor.ledger import Ledger
    from llmvisor.ledger.keys import split_key

    if admin == (tenant is not None):
        raise LlmvisorError("give --tenant T for a tenant key or --admin for an admin key (not both)")
    ledger = Ledger(db)
    try:
        key = ledger.create_key(tenant, is_admin=admin)
    finally:
        ledger.close()
    if json_output:
        echo_json({"key": key, "key_id": split_key(key)[0], "tenant": tenant, "admin": admin})
        return
    typer.echo(key)


def keys_list(db: DbOption = DEFAULT_DB_URL, json_output: JsonOption = False) -> None:
    """List API keys (ids, tenants, roles; never the secrets)."""
    from llmvisor.ledger import Ledger

    ledger = Ledger(db)
    try:
        keys = ledger.list_keys()
    finally:
        ledger.close()
    if json_output:
        echo_json(
            [
                {
                    "key_id": key.key_id,
                    "tenant": key.tenant,
                    "admin": bool(key.is_admin),
                    "revoked": key.revoked_at_us is not None,
                    "created_utc": datetime.fromtimestamp(key.created_at_us / 1e6, tz=UTC).isoformat(timespec="seconds"),
                    "revoked_utc": None
                    if key.revoked_at_us is None
                    else datetime.fromtimestamp(key.revoked_at_us / 1e6, tz=UTC).isoformat(timespec="seconds"),
                }
                for key in keys
            ]
        )
        return
    for key in keys:
        created = datetime.fromtimestamp(key.created_at_us / 1e6, tz=UTC).isoformat(timespec="seconds")
        role = "admin" if key.is_admin else f"tenant={key.tenant}"
        state = "revoked" if key.revoked_at_us is not None else "active"
        typer.echo(f"{key.key_id}\t{role}\t{state}\tcreated {created}")


def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (the part after lvk_ and before the next _).")],
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Revoke an API key; requests with it are refused from then on."""
    from llmvisor.ledger import Ledger

    ledger = Ledger(db)
    try:
        revoked = ledger.revoke_key(key_id)
    finally:
        ledger.close()
    if not revoked:
        raise LlmvisorError(f"no active key {key_id!r}")
    if json_output:
        echo_json({"revoked": key_id})
        return
    typer.echo(f"revoked {key_id}")


def ledger_migrate(
    source: Annotated[str, typer.Option("--from", help="URL of the schema-1 to -6 ledger to copy (only read; a schema-7 or -8 ledger is upgraded in place when opened).", metavar="URL")],
    target: Annotated[str, typer.Option("--to", help="URL of an empty database to copy it into (the current schema).", metavar="URL")],
    json_output: JsonOption = False,
) -> None:
    """Copy a ledger of an older schema into a new ledger and check that every total matches."""
    from rich.progress import Progress

    from llmvisor.ledger.migrate import migrate

    with Progress(transient=True, disable=json_output) as progress:
        task = progress.add_task("copying steps", total=None)
        report = migrate(source, target, progress=lambda done, total: progress.update(task, completed=done, total=total))
    if json_output:
        echo_json(
            {
                "num_steps": report.num_steps,
                "num_slices": report.num_slices,
                "num_keys": report.num_keys,
                "num_tenants": len(report.attributed_ns_per_tenant),
                "measured_ns": report.measured_ns,
                "attributed_ns": report.attributed_ns,
                "attributed_ns_per_tenant": report.attributed_ns_per_tenant,
                "totals_match": True,
            }
        )
        return
    typer.echo(
        f"copied {report.num_steps:,} steps, {report.num_slices:,} slices, {report.num_keys} keys and "
        f"{len(report.attributed_ns_per_tenant)} tenants' usage; measured and attributed ns, and every tenant's "
        f"total, match the source ({report.measured_ns / 1e9:,.3f} s). The source was not changed."
    )
