"""Closed billing periods, recorded lines and corrections, and once-per-line rounding (issue #36 items 2 and 3,
docs/billing.md "Periods and corrections"): real ledgers (SQLite, PostgreSQL), the real CLI, and a real HTTP receiver
on a loopback port that deduplicates by id as Stripe and Lago do."""

from __future__ import annotations

import http.server
import json
import threading
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

import pytest
from sqlalchemy import create_engine, text

from _billing_checks import VALIDATOR, read_csv, run_cli, run_validator
from _cli import invoke_cli
from _service_fixtures import db_url  # noqa: F401
from llmvisor.billing.push import push
from llmvisor.ledger import Ledger
from llmvisor.metering.windows import RequestWindow, WindowAggregate
from test_billing import focus_rule_violations

CLASS = "c0ffee0123456789"
PRICE = "3.1415"  # per engine-hour
OCT = int(datetime(2026, 10, 1, tzinfo=UTC).timestamp())  # a past month: closed by the export (3 days after its end)
NOV = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
HOUR_US = 3_600_000_000


def _window(run_id: str, start_us: int, tenant_ns: dict[str, int]) -> WindowAggregate:
    requests = [RequestWindow(f"{run_id}-{t}", t, ns, ns, 10, 1, start_us, start_us + 1, 4, 0, 6) for t, ns in tenant_ns.items()]
    total = sum(tenant_ns.values())
    return WindowAggregate(run_id=f"{run_id}@{start_us}", engine_class=CLASS, window_start_us=start_us, window_end_us=start_us + 1_000_000,
                           model_version=1, pending=False, num_steps=1, measured_ns=total, attributed_ns=total,
                           step_ranges=[[0, 0]], requests=requests)


def _priced(db: str, tmp_path, price: str = PRICE) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text(f'[[price]]\nengine_class = "{CLASS}"\ncurrency = "USD"\nengine_hour_price = "{price}"\n'
                      "valid_from = 2026-01-01T00:00:00Z\n")
    added = invoke_cli("prices", "add", str(prices), "--db", db)
    assert added.returncode == 0, added.stderr


def _exact(ns: int, price: str = PRICE) -> Fraction:
    return Fraction(ns) * Fraction(price) / 3_600_000_000_000


def _cents(exact: Fraction) -> Decimal:
    return Decimal(round(exact * 100)) / 100


class _Lago(http.server.BaseHTTPRequestHandler):
    """Lago's batch endpoint as far as billing goes: each event taken once by ``transaction_id`` (a re-sent id is
    dropped), its engine_ns and cost summed per customer."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.server.lock:
            for event in body["events"]:
                if event["transaction_id"] in self.server.taken:
                    self.server.dropped.append(event["transaction_id"])
                    continue
                self.server.taken[event["transaction_id"]] = event
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def lago():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Lago)
    server.lock, server.taken, server.dropped = threading.Lock(), {}, []
    server.url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/events/batch"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _totals(server) -> tuple[dict[str, int], dict[str, Decimal]]:
    ns, cost = defaultdict(int), defaultdict(Decimal)
    for event in server.taken.values():
        ns[event["external_subscription_id"]] += event["properties"]["engine_ns"]
        cost[event["external_subscription_id"]] += Decimal(event["properties"]["cost"])
    return dict(ns), dict(cost)


def _export(db: str, format_: str, *more: str, period=(OCT, NOV), run=invoke_cli):
    """``llmvisor export`` of the period, in this process; ``run=run_cli`` for a refusal (its own process)."""
    return run("export", "--format", format_, "--db", db, "--start", str(period[0]), "--end", str(period[1]), *more)


def test_late_usage_becomes_a_correction_with_a_new_id_and_a_deduplicating_receiver_totals_the_ledger(db_url, tmp_path, lago):  # noqa: F811
    ledger = Ledger(db_url)
    h1, h2 = OCT * 1_000_000 + 5 * HOUR_US, OCT * 1_000_000 + 30 * HOUR_US
    ledger.ingest_windows([_window("run-1", h1, {"a": 1_234_567_891, "b": 700_000_001}),
                           _window("run-1", h2, {"a": 2_000_000_003})])
    ledger.close()
    _priced(db_url, tmp_path)

    first = _export(db_url, "lago", "--push", lago.url, "-o", str(tmp_path / "first.json"), "--json")
    assert first.returncode == 0, first.stderr
    ids1 = json.loads(first.stdout)["ids"]
    assert len(ids1) == 3 and json.loads(first.stdout)["corrections"] == 0
    assert _totals(lago)[0] == {"a": 1_234_567_891 + 2_000_000_003, "b": 700_000_001}

    ledger = Ledger(db_url)  # late usage for the exported (and by now closed) hour h1, under another run
    ledger.ingest_windows([_window("run-2", h1 + 7_000_000, {"a": 900_000_007})])
    ledger.close()
    taken_before = dict(lago.taken)
    refused = _export(db_url, "lago", "--push", lago.url, run=run_cli)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error: 3 lines of this period were already exported as lago; a receiver deduplicates "
                                     "ids only for a while (Stripe: 24 hours)")
    assert lago.taken == taken_before  # nothing sent

    second = _export(db_url, "lago", "--push", lago.url, "--force", "-o", str(tmp_path / "second.json"), "--json")
    assert second.returncode == 0, second.stderr
    out = json.loads(second.stdout)
    [correction_id] = out["ids"]
    assert out["corrections"] == 1 and out["already_exported"] == 3 and correction_id not in ids1
    [event] = json.loads((tmp_path / "second.json").read_text())
    assert event["transaction_id"] == correction_id and event["properties"]["revision"] == 1
    assert event["properties"]["engine_ns"] == 900_000_007 and event["external_subscription_id"] == "a"

    ledger = Ledger(db_url)
    usage = {r.tenant: r.attributed_ns for r in ledger.tenant_usage(OCT * 1_000_000, NOV * 1_000_000)}
    ledger.close()
    exact = {"a": _exact(usage["a"]), "b": _exact(usage["b"])}  # one line group per tenant here
    ns, cost = _totals(lago)
    assert ns == usage == {"a": 1_234_567_891 + 2_000_000_003 + 900_000_007, "b": 700_000_001}
    assert cost == {t: _cents(e) for t, e in exact.items()}  # the exact total, rounded once

    for name in ("first.json", "second.json"):  # the same exports pushed again: nothing changes at the receiver
        events = json.loads((tmp_path / name).read_text())
        push(lago.url, [{"events": events}], content_type="application/json")
    assert _totals(lago) == (ns, cost) and len(lago.dropped) == 4
    again = _export(db_url, "lago", "--push", lago.url, "--force", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["ids"] == [] and _totals(lago) == (ns, cost)

    focus = tmp_path / "focus.csv"  # FOCUS has none of them yet: the original lines and the correction, as its own row
    written = _export(db_url, "focus", "-o", str(focus), "--json")
    assert written.returncode == 0, written.stderr
    rows = read_csv(focus)
    assert [r["x_IdempotencyId"] for r in rows] == [*ids1, correction_id]
    [fix] = [r for r in rows if r["x_IdempotencyId"] == correction_id]
    assert fix["ChargeClass"] == "Correction" and fix["ChargeCategory"] == "Usage" and int(fix["x_AttributedNs"]) == 900_000_007
    now_month = datetime.now(UTC).strftime("%Y-%m-01T00:00:00Z")
    assert fix["BillingPeriodStart"] == now_month and fix["ChargePeriodStart"] == "2026-10-01T05:00:00Z"
    assert {r["ChargeClass"] for r in rows if r["x_IdempotencyId"] in ids1} == {""}
    assert {r["BillingPeriodStart"] for r in rows if r["x_IdempotencyId"] in ids1} == {"2026-10-01T00:00:00Z"}
    assert sum(Decimal(r["BilledCost"]) for r in rows) == sum(cost.values())
    assert focus_rule_violations(rows) == []
    if VALIDATOR.exists():
        check = run_validator(focus)
        assert check.returncode == 0 and "Validation succeeded." in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]


def test_a_month_of_small_hourly_charges_sums_to_its_exact_total_rounded_once(db_url, tmp_path):  # noqa: F811
    """A few tenths of a cent an hour: rounding each hour by itself billed most hours 0.00 (the old code: Σ of the
    lines 0.00 here); rounded once per line with the remainder carried, Σ is the exact total rounded once."""
    price = "36"  # 0.01 per 10^9 ns
    hours = (NOV - OCT) // 3600
    ns = [200_000_000 + (k * 7_919_003) % 250_000_000 for k in range(hours)]  # 0.2 to 0.45 cents each
    ledger = Ledger(db_url)
    ledger.ingest_windows([_window(f"run-{k}", OCT * 1_000_000 + k * HOUR_US, {"t": n}) for k, n in enumerate(ns)])
    ledger.close()
    _priced(db_url, tmp_path, price)
    out = tmp_path / "month.json"
    assert _export(db_url, "lago", "-o", str(out)).returncode == 0
    events = json.loads(out.read_text())
    assert len(events) == hours
    cents = [Decimal(e["properties"]["cost"]) for e in events]
    exact = [_exact(n, price) for n in ns]
    assert sum(cents) == _cents(sum(exact)) > Decimal(2)  # Σ lines = the exact month total rounded once
    assert all(abs(c - _cents(e)) <= Decimal("0.01") for c, e in zip(cents, exact))  # each line within a cent
    assert sum(_cents(e) for e in exact) == Decimal(0)  # what rounding each hour by itself bills


def test_close_period_freezes_the_month_and_refuses_an_open_one(db_url, tmp_path):  # noqa: F811
    ledger = Ledger(db_url)
    ledger.ingest_windows([_window("run-1", OCT * 1_000_000, {"a": 5_000_000_000})])
    ledger.close()
    _priced(db_url, tmp_path)
    closed = invoke_cli("close-period", "--db", db_url, "--period", "2026-10", "--json")
    assert closed.returncode == 0, closed.stderr
    assert json.loads(closed.stdout) | {"closed_at_us": 0} == {"period": "2026-10", "closed": True, "closed_at_us": 0, "lines": 1}
    again = invoke_cli("close-period", "--db", db_url, "--period", "2026-10")
    assert again.returncode == 0 and again.stdout == "period 2026-10 was already closed (1 lines); nothing changed\n"
    this_month = datetime.now(UTC).strftime("%Y-%m")
    for period, reason in ((this_month, f"--period {this_month} has not ended"), ("2026-13", "--period: expected a calendar month as YYYY-MM")):
        bad = run_cli("close-period", "--db", db_url, "--period", period)
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {reason}") and bad.stderr.count("\n") == 1, bad.stderr
    ledger = Ledger(db_url)  # late usage after the close: the next export bills it as a correction, in a later month
    ledger.ingest_windows([_window("run-2", OCT * 1_000_000, {"a": 1_000_000_000})])
    ledger.close()
    focus = tmp_path / "focus.csv"
    written = invoke_cli("export", "--format", "focus", "--db", db_url, "--start", str(OCT), "--end", str(OCT + 3600), "-o", str(focus))
    assert written.returncode == 0, written.stderr
    rows = read_csv(focus)
    assert [(r["x_AttributedNs"], r["ChargeClass"]) for r in rows] == [("5000000000", ""), ("1000000000", "Correction")]


def test_an_export_closes_a_period_only_after_the_configured_delay(db_url, tmp_path, monkeypatch):  # noqa: F811
    from llmvisor.billing.periods import closed_period_rows

    ledger = Ledger(db_url)
    ledger.ingest_windows([_window("run-1", OCT * 1_000_000, {"a": 5_000_000_000})])
    ledger.close()
    _priced(db_url, tmp_path)
    monkeypatch.setenv("LLMVISOR_CLOSE_PERIOD_AFTER_S", str(10**9))  # not yet due
    assert _export(db_url, "lago", "-o", str(tmp_path / "a.json")).returncode == 0
    ledger = Ledger(db_url)
    assert closed_period_rows(ledger) == []
    ledger.close()
    monkeypatch.setenv("LLMVISOR_CLOSE_PERIOD_AFTER_S", "0")
    assert _export(db_url, "cloudevents", "-o", str(tmp_path / "b.json")).returncode == 0
    ledger = Ledger(db_url)
    [row] = closed_period_rows(ledger)
    ledger.close()
    assert (row.period_start_us, row.closed_by, row.num_lines) == (OCT * 1_000_000, "export", 1)
    monkeypatch.setenv("LLMVISOR_CLOSE_PERIOD_AFTER_S", "soon")
    bad = _export(db_url, "stripe", "-o", str(tmp_path / "c.json"), run=run_cli)
    assert bad.returncode == 2 and bad.stderr == ("error: LLMVISOR_CLOSE_PERIOD_AFTER_S: expected whole seconds (0 or more) "
                                                  "or 'off', got 'soon'\n")


def test_a_schema_7_ledger_is_upgraded_in_place_with_its_data(db_url, tmp_path):  # noqa: F811
    ledger = Ledger(db_url)
    ledger.ingest_windows([_window("run-1", OCT * 1_000_000, {"a": 5_000_000_000, "b": 3})])
    before = [(r.tenant, r.attributed_ns) for r in ledger.tenant_usage()]
    ledger.close()
    engine = create_engine(db_url)
    with engine.begin() as conn:  # what schema 7 had: no schema-8 tables, version 7
        for table in ("billing_lines", "line_exports", "closed_periods"):
            conn.execute(text(f"DROP TABLE {table}"))
        conn.execute(text("UPDATE ledger_info SET value = '7' WHERE name = 'schema_version'"))
    engine.dispose()
    ledger = Ledger(db_url)
    assert [(r.tenant, r.attributed_ns) for r in ledger.tenant_usage()] == before
    ledger.close()
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT value FROM ledger_info WHERE name = 'schema_version'")).scalar() == "10"
        assert conn.execute(text("SELECT COUNT(*) FROM billing_lines")).scalar() == 0
    engine.dispose()
    _priced(db_url, tmp_path)
    assert _export(db_url, "lago", "-o", str(tmp_path / "a.json")).returncode == 0  # the new tables work
