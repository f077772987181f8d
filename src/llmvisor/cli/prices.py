"""CLI of the price book: ``llmvisor prices add FILE`` and ``llmvisor prices list``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from llmvisor.cli.serve import DEFAULT_DB_URL, DbOption, JsonOption, echo_json


def prices_add(
    price_file: Annotated[Path, typer.Argument(help="A TOML ([[price]] tables) or JSON ({\"prices\": [...]}) price file.",
                                               dir_okay=False, metavar="FILE")],
    db: DbOption = DEFAULT_DB_URL,
    json_output: JsonOption = False,
) -> None:
    """Store each price of the file as the next version of its engine class, in force from its valid_from hour."""
    from llmvisor.billing.prices import add_prices, read_price_file
    from llmvisor.ledger import Ledger

    entries = read_price_file(price_file)
    ledger = Ledger(db)
    try:
        stored = add_prices(ledger, entries)
    finally:
        ledger.close()
    if json_output:
        echo_json({"prices": [p.to_dict() for p in stored]})
        return
    for p in stored:
        typer.echo(f"{p.engine_class or '(no fingerprint)'} v{p.version}: {p.engine_hour_price} {p.currency}/engine-hour from "
                   f"{datetime.fromtimestamp(p.valid_from_us / 1e6, tz=UTC).isoformat()}")


def prices_list(db: DbOption = DEFAULT_DB_URL, json_output: JsonOption = False) -> None:
    """List the stored price versions per engine class and when each is in force from."""
    from llmvisor.billing.prices import list_prices
    from llmvisor.cli.params import check_ledger_exists
    from llmvisor.ledger import Ledger

    check_ledger_exists(db)
    ledger = Ledger(db)
    try:
        stored = list_prices(ledger)
    finally:
        ledger.close()
    if json_output:
        echo_json({"prices": [p.to_dict() for p in stored]})
        return
    for p in stored:
        tokens = "".join(f", {name} {value}" for name, value in (("prompt token", p.prompt_token_price),
                         ("output token", p.output_token_price), ("cached discount", p.cached_token_discount), ("KV memory GiB-hour", p.gib_hour_price))
                         if value is not None)
        typer.echo(f"{p.engine_class or '(no fingerprint)'}\tv{p.version}\tfrom "
                   f"{datetime.fromtimestamp(p.valid_from_us / 1e6, tz=UTC).isoformat()}\t{p.engine_hour_price} "
                   f"{p.currency}/engine-hour{tokens}\t{p.source}")
