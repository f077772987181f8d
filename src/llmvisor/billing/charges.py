"""Charges: a tenant's engine time per engine class, model version and hour, with its cost at the price in force,
and adjustments as charges of their own. What every export format writes, so all formats sum alike.

Usage stored step by step is kept per request per second (``usage_per_second``); the engine class and model version
of a run's second come from its steps. Should one second of a run have steps billed by two model versions (an
activation inside that second), its usage is charged under the higher version; the time is the same either way.
Usage metered in window aggregates (``tenant_seconds``) takes the class and version its window recorded, and is
charged in the hour its window starts in; pending windows (nothing attributed yet) are not charged.

Tokens: where the price in force has token prices, a usage charge of engine time is followed by one charge per priced
kind of token (`TOKEN_ITEMS`) with tokens of that kind, over the same tenant, class, version and hour, each rounded
once (`token_cost`). Their counts are the ledger's token split; usage whose split is unknown (rows copied from a
ledger before schema 6) cannot be priced per token and is refused in one line, never counted as 0 tokens.
Adjustments re-attribute engine time only: tokens do not change with a model.

KV memory (trace format 3, ledger schema 9): a usage charge of engine time is also followed by a memory charge
(`KV_MEMORY`) per block size its usage held, of the KV block-nanoseconds its tenant's requests held over the same
class, version and hour, priced per GiB-hour (`llmvisor.billing.prices.exact_memory_cost`) where the price in force
has ``gib_hour_price``, and unpriced where there is no price at all (for metering events); a price without a memory
price charges no memory. Usage not metered for memory (format 1 or 2) has no memory charge, as before. A memory
charge's quantity is its block-ns (exact, what the ledger holds); GiB-hours are block-ns × ``kv_block_bytes`` / 2^30 /
3.6·10¹². Adjustments do not change memory: a model re-attributes time only.

LoRA adapters (ledger schema 10): asked ``by_adapter``, usage is charged per tenant and adapter as well, each charge
naming its adapter (``lora_name``: '' the base model; None where not split). An adapter's line has a key of its own
(``|lora=<name>`` appended); the base model's keeps the key of the unsplit line, so a base-model-only ledger bills the
same lines either way. Rounding groups do not name the adapter: a tenant's adapter lines of one class, version and item
are rounded together, as its one unsplit line would be.

Rounding: every charge carries its exact cost (``exact_cost``); its ``cost`` in cents is given by `round_lines` in
line order within its line group (`line_group`: kind, tenant, class, version, item, currency and the calendar UTC
month of its start), carrying the sub-cent remainder forward (`llmvisor.billing.prices.carried_cents`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

from llmvisor.billing.prices import (
    TOKEN_ITEMS,
    US_PER_HOUR,
    Price,
    PriceBook,
    PriceError,
    carried_cents,
    exact_cost,
    exact_memory_cost,
    exact_token_cost,
    rounded_cost,
    token_unit_price,
)
from llmvisor.core.tokens import TOKEN_SPLIT, add_counts
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger

ID_NAMESPACE = uuid.UUID("5b0e7a52-3c1d-4e2a-9f47-6c6c6d766973")
"""Namespace of the idempotency ids (uuid5): fixed, so the same charge gets the same id on every export."""
DEFAULT_MODEL_VERSION = 0
"""Model version of steps billed by the service's default model (NULL in the ledger)."""
ENGINE_TIME = "engine_time"
KV_MEMORY = "kv_memory"
"""The item of a memory charge: KV block-ns held (module note)."""


@dataclass(frozen=True)
class Charge:
    """One tenant's charge for one engine class, model version and period: usage or an adjustment."""

    kind: str  # "usage" or "adjustment"
    tenant: str
    engine_class: str
    model_version: int  # usage: the version that billed it (0: default model); adjustment: the version re-attributing
    period_start_us: int
    period_end_us: int
    attributed_ns: int  # an adjustment's delta (negative: a credit)
    num_new_tokens: int
    price: Price | None
    cost: Decimal | None
    allocated_ratio: Decimal | None = None  # usage: this tenant's share of the class's time in the period
    from_versions: str = ""  # adjustment: the versions that billed the period
    made_at_us: int | None = None  # adjustment: when it was made (``llmvisor adjust``); not part of the id
    item: str = ENGINE_TIME  # what is charged: engine time, or one of `TOKEN_ITEMS`
    tokens: tuple[int | None, int | None, int | None] = (None, None, None)
    """The usage's (uncached prompt, cached prompt, output) tokens (`TOKEN_SPLIT`), None where unknown; a token
    charge's quantity is its own kind's count."""
    unit_price: Decimal | None = None  # a token charge: the price of one token of its kind
    exact_cost: Fraction | None = None  # the exact amount; ``cost`` is its line's cents (`round_lines`)
    revision: int = 0  # 0: the charge's first exported line; 1, 2, ...: its corrections (`llmvisor.billing.periods`)
    billed_period_start_us: int | None = None
    """The billing period (month) an exported line is billed in (`llmvisor.billing.periods`); None: not recorded."""
    kv_block_ns: int = 0
    """A memory charge (`KV_MEMORY`): the KV block-nanoseconds held, its quantity."""
    kv_block_bytes: int | None = None
    """A memory charge: bytes per KV block of the usage it charges (part of its key: block-ns of another size are
    another charge)."""
    lora_name: str | None = None
    """Usage charged per adapter (``by_adapter``): its LoRA adapter, '' the base model; None: not split by adapter."""

    @property
    def quantity(self) -> int:
        """A token charge's tokens; a memory charge's block-ns; engine time's nanoseconds."""
        if self.item == ENGINE_TIME:
            return self.attributed_ns
        if self.item == KV_MEMORY:
            return self.kv_block_ns
        return self.tokens[TOKEN_ITEMS.index(self.item)]

    def with_quantity(self, quantity: int) -> Charge:
        """The charge with ``quantity`` as its item's quantity (engine ns or block-ns; a token charge's count is its
        ``tokens``)."""
        if self.item == ENGINE_TIME:
            return replace(self, attributed_ns=quantity)
        if self.item == KV_MEMORY:
            return replace(self, kv_block_ns=quantity, attributed_ns=0)
        return replace(self, attributed_ns=0)

    @property
    def line_key(self) -> str:
        """What the charge is of (kind, tenant, period, engine class, model version, adjusted-from versions[, token
        kind, or the memory item and its block size]): the same for all its revisions."""
        parts = (self.kind, self.tenant, str(self.period_start_us), str(self.period_end_us), self.engine_class,
                 str(self.model_version), self.from_versions)
        if self.item == KV_MEMORY:
            parts = (*parts, self.item, str(self.kv_block_bytes))
        elif self.item != ENGINE_TIME:
            parts = (*parts, self.item)
        if self.lora_name:  # an adapter's line (the base model's keeps the unsplit key: module note)
            parts = (*parts, f"lora={self.lora_name}")
        return "|".join(parts)

    @property
    def idempotency_id(self) -> str:
        """Id of one line: uuid5 of its ``line_key`` and, from revision 1 on, its revision. Revision 0's id is that of
        the releases before revisions (and engine time's that of the releases before token prices), so a period
        exported by them and exported again is still deduplicated; each later revision is new content, a new id."""
        key = self.line_key if self.revision == 0 else f"{self.line_key}|revision {self.revision}"
        return str(uuid.uuid5(ID_NAMESPACE, key))


def month_bounds_us(us: int) -> tuple[int, int]:
    """The calendar UTC month holding ``us``: the billing period, [start, end) in Unix microseconds."""
    start = datetime.fromtimestamp(us // 1_000_000, tz=UTC).replace(day=1, hour=0, minute=0, second=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return int(start.timestamp()) * 1_000_000, int(end.timestamp()) * 1_000_000


def line_group(c: Charge) -> tuple:
    """The lines whose exact amounts are summed before rounding: one tenant's kind, class, version, item and
    currency in one billing period (the month of the line's start)."""
    return (c.kind, c.tenant, c.engine_class, c.model_version, c.item, c.price.currency, month_bounds_us(c.period_start_us)[0])


def round_lines(lines: list[Charge], history: dict[tuple, tuple[Fraction, Decimal]] | None = None) -> list[Charge]:
    """The lines with their cents (``cost``), in the order given, each group's remainder carried forward from the
    group's earlier lines: those of ``history`` (group → exact total and cents already exported; updated in place)
    and those before it in ``lines``. Unpriced lines are left as they are."""
    history = {} if history is None else history
    out = []
    for c in lines:
        if c.exact_cost is None:
            out.append(c)
            continue
        key = line_group(c)
        exact_before, cents_before = history.get(key, (Fraction(0), Decimal(0)))
        cents = carried_cents(exact_before, cents_before, c.exact_cost)
        history[key] = (exact_before + c.exact_cost, cents_before + cents)
        out.append(replace(c, cost=cents))
    return out


def _apportion(parts: list[int], digits: int = 12) -> list[Decimal]:
    """Ratios ``part/total`` to ``digits`` decimals that sum to exactly 1 (largest remainder)."""
    total = sum(parts)
    unit = 10**digits
    floors = [p * unit // total for p in parts]
    rest = unit - sum(floors)
    order = sorted(range(len(parts)), key=lambda k: (-(parts[k] * unit - floors[k] * total), k))
    for k in order[:rest]:
        floors[k] += 1
    return [Decimal(f).scaleb(-digits) for f in floors]


def usage_charges(ledger: Ledger, start_us: int, end_us: int, tenants: list[str] | None = None,
                  book: PriceBook | None = None, *, by_adapter: bool = False) -> list[Charge]:
    """Hourly usage charges of [start_us, end_us) (whole hours), each priced with the class's price in force at the
    hour's start (a charge without a price has cost None), ordered by hour, class, version, tenant (and adapter, with
    ``by_adapter``: one charge per tenant and LoRA adapter, module note)."""
    if start_us % US_PER_HOUR or end_us % US_PER_HOUR or end_us <= start_us:
        raise LlmvisorError("the export period must start and end on whole UTC hours, the end after the start")
    book = book if book is not None else PriceBook.load(ledger)
    summed: dict[tuple[int, str, int, str, str | None], list] = {}
    memory: dict[tuple[int, str, int, str, str | None], dict[int, int]] = {}
    for h, c, v, t, ns, tok, *rest in ledger.hourly_usage(start_us, end_us, default_version=DEFAULT_MODEL_VERSION,
                                                         by_adapter=by_adapter):
        split, (block_bytes, block_ns) = rest[:len(TOKEN_SPLIT)], rest[len(TOKEN_SPLIT):len(TOKEN_SPLIT) + 2]
        key = (int(h), c, int(v), t, str(rest[-1]) if by_adapter else None)
        total = summed.setdefault(key, [0, 0, *[0] * len(TOKEN_SPLIT)])
        total[0] += int(ns)
        total[1] += int(tok)
        for j, count in enumerate(split):
            total[2 + j] = add_counts(total[2 + j], None if count is None else int(count))
        if block_ns is not None and block_bytes is not None:
            held = memory.setdefault(key, {})
            held[int(block_bytes)] = held.get(int(block_bytes), 0) + int(block_ns)
    rows = [(h, c, v, t, ns, tok, tuple(split), a) for (h, c, v, t, a), (ns, tok, *split) in
            sorted(summed.items(), key=lambda item: (*item[0][:4], item[0][4] or ""))]
    groups: dict[tuple[int, str], list[int]] = {}
    for k, (h, c, *_rest) in enumerate(rows):
        groups.setdefault((h, c), []).append(k)
    ratios: dict[int, Decimal] = {}
    for members in groups.values():
        parts = [rows[k][4] for k in members]
        if sum(parts) > 0:
            ratios.update(zip(members, _apportion(parts)))
    wanted = None if tenants is None else set(tenants)
    charges = []
    for k, (h, c, v, t, ns, tok, split, adapter) in enumerate(rows):
        if wanted is not None and t not in wanted:
            continue
        price = book.price_at(c, h)
        exact = None if price is None else exact_cost(ns, price)
        usage = Charge("usage", t, c, v, h, h + US_PER_HOUR, ns, tok, price, None if exact is None else rounded_cost(exact),
                       ratios.get(k), tokens=split, exact_cost=exact, lora_name=adapter)
        charges.append(usage)
        if price is not None:
            charges.extend(token_charges(usage))
        charges.extend(memory_charges(usage, memory.get((h, c, v, t, adapter), {})))
    return round_lines(charges)


def memory_charges(usage: Charge, held: dict[int, int]) -> list[Charge]:
    """The memory charges beside a usage charge of engine time: one per block size of the block-ns its tenant held
    (``held``: bytes per block → block-ns), none of zero; priced per GiB-hour, unpriced without any price, and none
    where the price in force has no memory price (module note)."""
    if usage.price is not None and usage.price.gib_hour_price is None:
        return []
    out = []
    for block_bytes, block_ns in sorted(held.items()):
        if not block_ns:
            continue
        exact = None if usage.price is None else exact_memory_cost(block_ns, block_bytes, usage.price)
        out.append(replace(usage, item=KV_MEMORY, attributed_ns=0, num_new_tokens=0, tokens=(None,) * len(TOKEN_SPLIT), kv_block_ns=block_ns,
                           kv_block_bytes=block_bytes, unit_price=None if usage.price is None else usage.price.gib_hour_price,
                           cost=None if exact is None else rounded_cost(exact), exact_cost=exact, allocated_ratio=None))
    return out


def token_charges(usage: Charge) -> list[Charge]:
    """The token charges beside a usage charge of engine time: one per kind of token its price prices and the usage
    has (none of zero tokens); refused where its token split is unknown (module note)."""
    out = []
    for item, count in zip(TOKEN_ITEMS, usage.tokens):
        unit = token_unit_price(usage.price, item)
        if unit is None:
            continue
        if count is None:
            raise PriceError(
                f"price v{usage.price.version} of engine class {usage.engine_class!r} prices {item.replace('_', ' ')}, but "
                f"the usage of tenant {usage.tenant!r} in the hour from {usage.period_start_us // 1_000_000} (Unix seconds) has no token "
                "split (it was stored before ledger schema 6); give that period a price without token prices "
                "(llmvisor prices add, same valid_from) or start the token prices after it")
        if count:
            exact = exact_token_cost(count, unit)
            out.append(replace(usage, item=item, attributed_ns=0, num_new_tokens=0, unit_price=unit,
                               cost=rounded_cost(exact), exact_cost=exact, allocated_ratio=None))
    return out


def adjustment_charges(ledger: Ledger, start_us: int, end_us: int, tenants: list[str] | None = None,
                       book: PriceBook | None = None) -> list[Charge]:
    """Adjustment entries whose period starts in [start_us, end_us), priced at the price in force at the period's
    start; a period across a price change of its class is refused (its cost would be undefined)."""
    book = book if book is not None else PriceBook.load(ledger)
    wanted = None if tenants is None else set(tenants)
    charges = []
    for row in ledger.adjustment_rows():
        if not start_us <= row.period_start_us < end_us or (wanted is not None and row.tenant not in wanted):
            continue
        if book.changes_within(row.engine_class, row.period_start_us, row.period_end_us):
            raise PriceError(f"adjustment of engine class {row.engine_class!r} for [{row.period_start_us / 1e6:.0f}, "
                             f"{row.period_end_us / 1e6:.0f}) spans a price change; it cannot be priced")
        price = book.price_at(row.engine_class, row.period_start_us)
        exact = None if price is None else exact_cost(row.delta_ns, price)
        charges.append(Charge("adjustment", row.tenant, row.engine_class, row.to_version, row.period_start_us,
                              row.period_end_us, row.delta_ns, 0, price, None if exact is None else rounded_cost(exact),
                              from_versions=row.from_versions, made_at_us=row.created_at_us, exact_cost=exact))
    return round_lines(charges)


def charges(ledger: Ledger, start_us: int, end_us: int, tenants: list[str] | None = None, *,
            by_adapter: bool = False) -> list[Charge]:
    """Usage charges (per adapter too with ``by_adapter``), then adjustment charges, of a period (the two functions above)."""
    book = PriceBook.load(ledger)
    return (usage_charges(ledger, start_us, end_us, tenants, book, by_adapter=by_adapter)
            + adjustment_charges(ledger, start_us, end_us, tenants, book))


def tenant_costs(ledger: Ledger, start_us: int, end_us: int, tenants: list[str] | None = None) -> dict[str, dict[str, Decimal]]:
    """What each tenant owes for a period, per currency: the sum of its charges' costs (usage and adjustments, rounded
    by `round_lines` over the period asked: each line group's exact total rounded once). Unpriced charges add nothing;
    a tenant with no priced charge is absent."""
    owed: dict[str, dict[str, Decimal]] = {}
    for charge in charges(ledger, start_us, end_us, tenants):
        if charge.cost is not None:
            mine = owed.setdefault(charge.tenant, {})
            mine[charge.price.currency] = mine.get(charge.price.currency, Decimal(0)) + charge.cost
    return owed


def tenant_cost(ledger: Ledger, tenant: str, start_us: int, end_us: int) -> dict[str, Decimal]:
    """One tenant's ``tenant_costs``; for a usage page or a caller's own bill."""
    return tenant_costs(ledger, start_us, end_us, [tenant]).get(tenant, {})
