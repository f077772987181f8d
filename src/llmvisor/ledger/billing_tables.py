"""The billing tables' reads and writes: price versions (``prices``), recorded billing lines (``billing_lines``), the
lines each export format has delivered (``line_exports``) and closed billing periods (``closed_periods``).

`llmvisor.billing` decides what they hold (prices in force, lines and their corrections, when a period closes); these
functions are how it reads and writes them. Each works in the caller's transaction (``conn``, from
`Ledger.read_transaction` or `Ledger.write_transaction`), so that one export closes periods, records lines, checks
what was delivered and reads its lines in one transaction. Rows are returned as the database gives them (attributes
named as the table's columns).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, and_, func, insert, select

from llmvisor.ledger.schema import billing_lines, closed_periods, line_exports, prices

# -----------------------------------------------------------------------------------------------------
# Prices: versions per engine class, each in force from its start (`llmvisor.billing.prices`)


def price_currency(conn: Connection, engine_class: str) -> str | None:
    """The currency ``engine_class`` is priced in (that of one of its stored prices), None if it has none."""
    return conn.execute(select(prices.c.currency).where(prices.c.engine_class == engine_class).limit(1)).scalar()


def latest_price_version(conn: Connection, engine_class: str) -> int:
    """The highest stored price version of ``engine_class``, 0 if it has none."""
    return conn.execute(select(func.max(prices.c.version)).where(prices.c.engine_class == engine_class)).scalar() or 0


def insert_price(conn: Connection, **values) -> None:
    """Store one price version (``values`` by column name)."""
    conn.execute(insert(prices).values(**values))


def price_rows(conn: Connection, engine_class: str | None = None) -> list:
    """The stored price versions (of one class, or all), by class, then start time, then version."""
    query = select(prices)
    if engine_class is not None:
        query = query.where(prices.c.engine_class == engine_class)
    query = query.order_by(prices.c.engine_class, prices.c.valid_from_us, prices.c.version)
    return conn.execute(query).all()


# -----------------------------------------------------------------------------------------------------
# Recorded lines and their exports (`llmvisor.billing.periods`)


def lines_of_periods(conn: Connection, start_us: int, end_us: int) -> list:
    """The recorded lines of the billing periods starting in [start_us, end_us), by charge start, line key, revision."""
    query = (
        select(billing_lines)
        .where(and_(billing_lines.c.period_start_us >= start_us, billing_lines.c.period_start_us < end_us))
        .order_by(billing_lines.c.charge_start_us, billing_lines.c.line_key, billing_lines.c.revision)
    )
    return list(conn.execute(query))


def line_rows(conn: Connection, period_start_us: int | None = None) -> list:
    """The recorded lines (of the period starting at ``period_start_us``, or all), by charge start, line key, revision."""
    query = select(billing_lines).order_by(billing_lines.c.charge_start_us, billing_lines.c.line_key, billing_lines.c.revision)
    if period_start_us is not None:
        query = query.where(billing_lines.c.period_start_us == period_start_us)
    return list(conn.execute(query))


def _in_scope(start_us: int, end_us: int, tenants: set | None):
    """Lines whose charge starts in [start_us, end_us), of ``tenants`` (None: every tenant)."""
    c = billing_lines.c
    where = [c.charge_start_us >= start_us, c.charge_start_us < end_us]
    if tenants is not None:
        where.append(c.tenant.in_(sorted(tenants)))
    return and_(*where)


def lines_in_range(conn: Connection, start_us: int, end_us: int, tenants: set | None) -> list:
    """The recorded lines whose charge starts in [start_us, end_us), of ``tenants`` (None: all), in no set order."""
    return list(conn.execute(select(billing_lines).where(_in_scope(start_us, end_us, tenants))))


def insert_lines(conn: Connection, rows: list[dict]) -> None:
    """Record new lines (``rows`` by column name); a line id or (line key, revision) recorded already fails the insert."""
    conn.execute(insert(billing_lines), rows)


def exported_line_ids(conn: Connection, format_: str, start_us: int, end_us: int, tenants: set | None) -> set[str]:
    """The ids of the lines of [start_us, end_us) (of ``tenants``) already delivered in ``format_``."""
    query = (
        select(line_exports.c.line_id)
        .join(billing_lines, billing_lines.c.line_id == line_exports.c.line_id)
        .where(and_(_in_scope(start_us, end_us, tenants), line_exports.c.format == format_))
    )
    return {r.line_id for r in conn.execute(query)}


def add_line_exports(conn: Connection, format_: str, line_ids: Iterable[str], at_us: int) -> None:
    """Record that ``line_ids`` were delivered in ``format_`` at ``at_us``; ids recorded for it already are left as
    they are."""
    ids = list(line_ids)
    have = {r.line_id for r in conn.execute(select(line_exports.c.line_id).where(
        and_(line_exports.c.format == format_, line_exports.c.line_id.in_(ids))))}
    rows = [{"format": format_, "line_id": i, "exported_at_us": at_us} for i in dict.fromkeys(ids) if i not in have]
    if rows:
        conn.execute(insert(line_exports), rows)


# -----------------------------------------------------------------------------------------------------
# Closed periods


def closed_period_starts(conn: Connection) -> set[int]:
    """The starts of the closed billing periods."""
    return {r.period_start_us for r in conn.execute(select(closed_periods.c.period_start_us))}


def is_period_closed(conn: Connection, period_start_us: int) -> bool:
    return conn.execute(
        select(closed_periods.c.period_start_us).where(closed_periods.c.period_start_us == period_start_us)
    ).first() is not None


def count_period_lines(conn: Connection, period_start_us: int) -> int:
    """How many lines (revisions included) the period starting at ``period_start_us`` has recorded."""
    return len(list(conn.execute(select(billing_lines.c.line_id).where(billing_lines.c.period_start_us == period_start_us))))


def insert_closed_period(conn: Connection, period: tuple[int, int], at_us: int, by: str, num_lines: int) -> None:
    """Mark the period [start, end) closed at ``at_us`` by ``by``, with ``num_lines`` lines recorded."""
    conn.execute(insert(closed_periods).values(period_start_us=period[0], period_end_us=period[1], closed_at_us=at_us,
                                               closed_by=by, num_lines=num_lines))


def closed_period(conn: Connection, period_start_us: int):
    """The row of the closed period starting at ``period_start_us`` (it must be closed)."""
    return conn.execute(select(closed_periods).where(closed_periods.c.period_start_us == period_start_us)).one()


def closed_period_rows(conn: Connection) -> list:
    """Every closed period, oldest first."""
    return list(conn.execute(select(closed_periods).order_by(closed_periods.c.period_start_us)))
