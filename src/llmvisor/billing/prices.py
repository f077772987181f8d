"""The price book: per engine class, a price per engine-hour and optional prices per token, versioned in the ledger
with a time from which each version is in force, so usage becomes cost with the price of its time.

Token prices (`TOKEN_PRICE_FIELDS`, all optional): ``prompt_token_price`` per prompt token, ``output_token_price`` per
output token, and ``cached_token_discount``, the fraction in [0, 1] taken off the prompt price for prompt tokens found
in the prefix cache (it needs a prompt price; absent: 0, cached tokens cost the prompt price). They multiply the
ledger's token split (schema 6, `llmvisor.core.tokens`): uncached prompt tokens × prompt price, cached prompt tokens
× prompt price × (1 − discount), output tokens × output price (`token_unit_price`).

Memory (schema 9): ``gib_hour_price``, optional, is the price per GiB-hour of KV cache a tenant's requests held
(trace format 3's block-nanoseconds × the run's bytes per block, `exact_memory_cost`); usage not metered for memory
(a format 1 or 2 trace) has no memory charge.

Money is exact: prices are kept as decimal strings and costs are computed as exact fractions (``exact_cost``,
``exact_token_cost``). Rounding (half to even, to the currency's minor unit, the cent: ``rounded_cost``) happens once
per invoice line with the sub-cent remainder carried forward (`carried_cents`): a line's cents are the rounded
running exact total of its line group (tenant, class, model version, item, currency and calendar month) after it,
less the cents already given to the group's earlier lines, so the month's lines sum to its exact total rounded
once. Rounding each hourly charge by itself billed a charge of a few tenths of a cent as 0.00, every hour.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from pathlib import Path

from llmvisor.errors import LlmvisorError, unknown_name
from llmvisor.ledger import Ledger, billing_tables
from llmvisor.ledger.connection import now_us

NS_PER_HOUR = 3_600_000_000_000
GIB = 2**30
US_PER_HOUR = 3_600_000_000
MINOR_UNIT_DIGITS = 2
"""Costs are rounded to the cent (2 decimals), half to even, once per line group running total (module note)."""
MAX_PRICE_DIGITS = 28
"""Significant digits a price may have (Decimal's default precision: what it keeps exactly)."""


TOKEN_PRICE_FIELDS = ("prompt_token_price", "output_token_price", "cached_token_discount")
TOKEN_ITEMS = ("uncached_prompt_tokens", "cached_prompt_tokens", "output_tokens")
"""The priced kinds of token, each the charge item of its own charges; their counts are the ledger's split
(`llmvisor.core.tokens.TOKEN_SPLIT`, in this order)."""


class PriceError(LlmvisorError):
    """A price file or price entry that cannot be used as given."""


@dataclass(frozen=True)
class Price:
    """One version of one engine class's price, in force from ``valid_from_us`` until the class's next one."""

    engine_class: str
    version: int
    valid_from_us: int
    currency: str
    engine_hour_price: Decimal
    prompt_token_price: Decimal | None = None
    output_token_price: Decimal | None = None
    cached_token_discount: Decimal | None = None
    gib_hour_price: Decimal | None = None
    source: str = ""
    created_at_us: int = 0

    def to_dict(self) -> dict:
        def text(value):
            return None if value is None else str(value)

        return {"engine_class": self.engine_class, "version": self.version, "valid_from_us": self.valid_from_us,
                "currency": self.currency, "engine_hour_price": str(self.engine_hour_price),
                "prompt_token_price": text(self.prompt_token_price), "output_token_price": text(self.output_token_price),
                "cached_token_discount": text(self.cached_token_discount), "gib_hour_price": text(self.gib_hour_price),
                "source": self.source,
                "created_at_us": self.created_at_us}


def rounded_cost(exact: Fraction) -> Decimal:
    """An exact amount rounded half to even to the cent (``MINOR_UNIT_DIGITS``)."""
    minor = round(exact * 10**MINOR_UNIT_DIGITS)  # round() of a Fraction is exact and half to even
    return Decimal(minor).scaleb(-MINOR_UNIT_DIGITS)


def carried_cents(exact_before: Fraction, cents_before: Decimal, exact: Fraction) -> Decimal:
    """The cents of a line of ``exact`` amount whose group's earlier lines total ``exact_before`` exactly and were
    given ``cents_before``: the group's rounded running total after it less what was given (module note). With
    ``cents_before == rounded_cost(exact_before)`` the result is within one cent of ``rounded_cost(exact)``."""
    return rounded_cost(exact_before + exact) - cents_before


def exact_cost(attributed_ns: int, price: Price) -> Fraction:
    """Attributed engine time at a price per engine-hour, exact (negative time, an adjustment's credit: negative)."""
    return Fraction(int(attributed_ns)) * Fraction(price.engine_hour_price) / NS_PER_HOUR


def cost_of(attributed_ns: int, price: Price) -> Decimal:
    """``exact_cost`` rounded by itself: the cost of one charge standing alone (a line group of one line)."""
    return rounded_cost(exact_cost(attributed_ns, price))


def token_unit_price(price: Price, item: str) -> Decimal | None:
    """The exact price of one token of ``item`` (`TOKEN_ITEMS`) at ``price``, None where it has no such price: the
    prompt price for uncached prompt tokens, prompt price × (1 − cached_token_discount) for cached ones, the output
    price for output tokens."""
    if item == "output_tokens":
        return price.output_token_price
    if price.prompt_token_price is None:
        return None
    if item == "uncached_prompt_tokens":
        return price.prompt_token_price
    discount = price.cached_token_discount or Decimal(0)
    exact = Fraction(price.prompt_token_price) * (1 - Fraction(discount))
    with localcontext(prec=MAX_PRICE_DIGITS * 2 + 2):  # a product of two such decimals is exact at this precision
        unit = Decimal(exact.numerator) / Decimal(exact.denominator)
    assert Fraction(unit) == exact
    return unit


def gib_hours(block_ns: int, block_bytes: int) -> Fraction:
    """KV block-nanoseconds of blocks of ``block_bytes`` as GiB-hours, exact."""
    return Fraction(int(block_ns) * int(block_bytes), GIB * NS_PER_HOUR)


def exact_memory_cost(block_ns: int, block_bytes: int, price: Price) -> Fraction:
    """KV memory-time at the price per GiB-hour, exact (``price.gib_hour_price`` must be set)."""
    return gib_hours(block_ns, block_bytes) * Fraction(price.gib_hour_price)


def exact_token_cost(tokens: int, unit_price: Decimal) -> Fraction:
    """Tokens' cost at a unit price (`token_unit_price`), exact."""
    return Fraction(int(tokens)) * Fraction(unit_price)


def token_cost(tokens: int, unit_price: Decimal) -> Decimal:
    """``exact_token_cost`` rounded by itself, like `cost_of`."""
    return rounded_cost(exact_token_cost(tokens, unit_price))


def _decimal(source: str, field: str, value, *, required: bool) -> Decimal | None:
    if value is None:
        if required:
            raise PriceError(f"{source}: {field} is required")
        return None
    if isinstance(value, float):
        raise PriceError(f"{source}: {field} must be written as a string or an integer (\"0.25\"), not a float, so that "
                         "the price is exact")
    try:
        number = Decimal(str(value).strip())
    except InvalidOperation:
        raise PriceError(f"{source}: {field} must be a decimal number, got {value!r}") from None
    if not number.is_finite() or number < 0:
        raise PriceError(f"{source}: {field} must be a finite number at least 0, got {value!r}")
    if len(number.as_tuple().digits) > MAX_PRICE_DIGITS:
        raise PriceError(f"{source}: {field} has more than {MAX_PRICE_DIGITS} significant digits, got {value!r}")
    return number


def _valid_from_us(source: str, value) -> int:
    from datetime import UTC, datetime

    if isinstance(value, datetime):  # TOML datetimes arrive parsed
        moment = value
    elif isinstance(value, int) and not isinstance(value, bool):
        moment = datetime.fromtimestamp(value, tz=UTC)
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            raise PriceError(f"{source}: valid_from must be an ISO 8601 time or Unix seconds, got {value!r}") from None
    else:
        raise PriceError(f"{source}: valid_from must be an ISO 8601 time or Unix seconds, got {value!r}")
    moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    seconds = moment.timestamp()
    if seconds < 0 or seconds % 3600:
        raise PriceError(f"{source}: valid_from {value!r} must be a whole UTC hour at or after 1970 (charges are hourly)")
    return int(seconds) * 1_000_000


def read_price_file(path: Path) -> list[Price]:
    """Entries of a TOML or JSON price file: ``[[price]]`` tables (TOML) or ``{"prices": [...]}`` (JSON), each with
    ``engine_class``, ``currency``, ``engine_hour_price`` and ``valid_from``, optionally the token prices and
    ``gib_hour_price`` (module note). Versions are given when stored."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PriceError(f"{path}: cannot read the price file ({error.strerror})") from None
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
            entries = data.get("price")
        else:
            data = json.loads(text)
            entries = data.get("prices") if isinstance(data, dict) else None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise PriceError(f"{path}: not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'} ({error})") from None
    key = "[[price]] tables" if path.suffix.lower() == ".toml" else 'a "prices" list'
    if not isinstance(entries, list) or not entries:
        raise PriceError(f"{path}: expected {key}, one per engine class and start time")
    unknown = unknown_name(data, ("price",) if path.suffix.lower() == ".toml" else ("prices",), kind="key")
    if unknown:
        raise PriceError(f"{path}: {unknown}")
    return parse_prices(entries, str(path), source=path.name)


def parse_prices(entries: list, where_prefix: str, *, source: str) -> list[Price]:
    """Price entries (dicts of the price file's fields) checked and parsed; errors name ``where_prefix`` and the entry."""
    known = {"engine_class", "currency", "engine_hour_price", "valid_from", "prompt_token_price", "output_token_price",
             "cached_token_discount", "gib_hour_price"}
    out = []
    for k, entry in enumerate(entries, start=1):
        where = f"{where_prefix} price {k}"
        if not isinstance(entry, dict):
            raise PriceError(f"{where}: expected a table of fields")
        unknown = unknown_name(entry, sorted(known))
        if unknown:
            raise PriceError(f"{where}: {unknown}")
        engine_class = entry.get("engine_class")
        if not isinstance(engine_class, str):
            raise PriceError(f"{where}: engine_class must be a string (an engine fingerprint id; '' for steps without one)")
        currency = entry.get("currency")
        if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha() or not currency.isupper():
            raise PriceError(f"{where}: currency must be a three-letter ISO 4217 code such as \"USD\", got {currency!r}")
        if "valid_from" not in entry:
            raise PriceError(f"{where}: valid_from is required (the whole UTC hour the price is in force from)")
        tokens = {name: _decimal(where, name, entry.get(name), required=False) for name in TOKEN_PRICE_FIELDS}
        discount = tokens["cached_token_discount"]
        if discount is not None and discount > 1:
            raise PriceError(f"{where}: cached_token_discount must be a fraction from 0 to 1 (0.5: cached prompt tokens "
                             f"cost half the prompt price), got {entry['cached_token_discount']!r}")
        if discount is not None and tokens["prompt_token_price"] is None:
            raise PriceError(f"{where}: cached_token_discount needs a prompt_token_price (it is taken off that price)")
        out.append(Price(
            engine_class=engine_class, version=0, valid_from_us=_valid_from_us(where, entry["valid_from"]), currency=currency,
            engine_hour_price=_decimal(where, "engine_hour_price", entry.get("engine_hour_price"), required=True),
            gib_hour_price=_decimal(where, "gib_hour_price", entry.get("gib_hour_price"), required=False),
            **tokens, source=source,
        ))
    return out


def add_prices(ledger: Ledger, entries: list[Price]) -> list[Price]:
    """Store each entry as the next version of its class (one transaction); returns them with their versions.
    A class's prices share one currency (a bill is in one currency)."""
    stored = []
    created = now_us()
    with ledger.write_transaction() as conn:
        for entry in entries:
            currency = billing_tables.price_currency(conn, entry.engine_class)
            if currency is not None and currency != entry.currency:
                raise PriceError(f"{entry.source}: engine class {entry.engine_class!r} is priced in {currency}, not "
                                 f"{entry.currency}; nothing was stored")
            version = billing_tables.latest_price_version(conn, entry.engine_class) + 1
            row = Price(**{**entry.__dict__, "version": version, "created_at_us": created})
            billing_tables.insert_price(
                conn, engine_class=row.engine_class, version=row.version, valid_from_us=row.valid_from_us, currency=row.currency,
                engine_hour_price=str(row.engine_hour_price),
                prompt_token_price=None if row.prompt_token_price is None else str(row.prompt_token_price),
                output_token_price=None if row.output_token_price is None else str(row.output_token_price),
                cached_token_discount=None if row.cached_token_discount is None else str(row.cached_token_discount),
                gib_hour_price=None if row.gib_hour_price is None else str(row.gib_hour_price), source=row.source, created_at_us=row.created_at_us,
            )
            stored.append(row)
    return stored


def list_prices(ledger: Ledger, engine_class: str | None = None) -> list[Price]:
    """Every stored price version, by class, then start time, then version."""
    with ledger.read_transaction() as conn:
        rows = billing_tables.price_rows(conn, engine_class)

    def number(value):
        return None if value is None else Decimal(value)

    return [Price(engine_class=r.engine_class, version=r.version, valid_from_us=r.valid_from_us, currency=r.currency,
                  engine_hour_price=Decimal(r.engine_hour_price), prompt_token_price=number(r.prompt_token_price),
                  output_token_price=number(r.output_token_price), cached_token_discount=number(r.cached_token_discount),
                  gib_hour_price=number(r.gib_hour_price), source=r.source, created_at_us=r.created_at_us) for r in rows]


class PriceBook:
    """The stored prices, for looking up the one in force for a class at a time."""

    def __init__(self, entries: list[Price]):
        self._by_class: dict[str, list[Price]] = {}
        for entry in sorted(entries, key=lambda e: (e.valid_from_us, e.version)):
            self._by_class.setdefault(entry.engine_class, []).append(entry)

    @classmethod
    def load(cls, ledger: Ledger) -> PriceBook:
        return cls(list_prices(ledger))

    def price_at(self, engine_class: str, time_us: int) -> Price | None:
        """The version in force for usage at ``time_us``: the latest start at or before it; of versions starting at
        the same time, the highest (a later entry corrects an earlier one). None if the class has none yet."""
        found = None
        for entry in self._by_class.get(engine_class, []):
            if entry.valid_from_us <= time_us:
                found = entry
        return found

    def changes_within(self, engine_class: str, start_us: int, end_us: int) -> bool:
        """Whether another price of the class starts strictly inside (start, end)."""
        return any(start_us < e.valid_from_us < end_us for e in self._by_class.get(engine_class, []))
