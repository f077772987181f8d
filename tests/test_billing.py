"""Prices and `llmvisor export`, checked against the published contracts: the FOCUS validator, the CloudEvents SDK,
JSON Schemas of Stripe's and Lago's bodies (tests/data/billing, sources cited there), and the ledger's own totals.

The ledger is filled by the real service (POST /v1/steps), two engine classes over two hours, and an adjustment is
made by `adjust_period` with a second model version, as `llmvisor adjust` does.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction
from urllib.parse import parse_qs

import jsonschema
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from _billing_checks import DATA, ROOT, VALIDATOR, check_exports_tie_to_the_ledger, run_cli, run_validator
from _billing_checks import read_csv as _read_csv
from _cli import invoke_cli
from _service_fixtures import T0_S, bearer, class_body, class_model, db_url, model_path  # noqa: F401
from llmvisor.billing import PriceBook, cost_of, list_prices, tenant_cost, usage_charges
from llmvisor.billing.charges import charges
from llmvisor.billing.formats import cloudevents, cloudevents_json, lago_batches, lago_events, stripe_events
from llmvisor.billing.prices import Price, add_prices, read_price_file
from llmvisor.billing.push import PushError, push
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.ledger import Ledger
from llmvisor.service.adjust import adjust_period
from llmvisor.service.app import create_app

CLASS_A, CLASS_B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
HOUR0 = int(T0_S) // 3600 * 3600
PERIOD = (HOUR0, HOUR0 + 2 * 3600)
PRICES_TOML = f"""
[[price]]
engine_class = "{CLASS_A}"
currency = "USD"
engine_hour_price = "3.1415"
valid_from = {HOUR0}

[[price]]
engine_class = "{CLASS_A}"
currency = "USD"
engine_hour_price = "4.75"
valid_from = {HOUR0 + 3600}

[[price]]
engine_class = "{CLASS_B}"
currency = "USD"
engine_hour_price = "12"
valid_from = "{__import__('datetime').datetime.fromtimestamp(HOUR0, tz=__import__('datetime').UTC).isoformat()}"
"""


@pytest.fixture
def served(model_path, db_url, tmp_path):  # noqa: F811
    """A ledger filled by the service: class A in both hours (v1), class B in the first; prices stored; class A's
    first hour adjusted to v2."""
    ledger = Ledger(db_url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    bodies = [class_body(CLASS_A, 120, run_id="a0", seed=1, first_timestamp_s=T0_S),
              class_body(CLASS_A, 120, run_id="a1", seed=2, first_timestamp_s=HOUR0 + 3600 + 30, cached_prompt=True),
              class_body(CLASS_B, 120, run_id="b0", seed=3, first_timestamp_s=T0_S + 10)]
    app = create_app(model_path, db_url, registry_refresh_s=0.0)
    with TestClient(app) as client:
        for engine_class in (CLASS_A, CLASS_B):
            response = client.post("/v1/models", json={"model": class_model(engine_class).to_dict(), "activate": True},
                                   headers=bearer(admin))
            assert response.status_code == 201, response.text
        for body in bodies:
            assert client.post("/v1/steps", json=body, headers=bearer(admin)).status_code == 200
    price_file = tmp_path / "prices.toml"
    price_file.write_text(PRICES_TOML)
    ledger = Ledger(db_url)
    add_prices(ledger, read_price_file(price_file))  # what `llmvisor prices add` runs, without its 1-2 s process start per test
    coef = {**DEFAULT_COEF_S, "decode_context_tokens": DEFAULT_COEF_S["decode_context_tokens"] * 5}  # another split
    second = ledger.add_model(CLASS_A, json.dumps(class_model(CLASS_A, coef_s=coef, seed=7).to_dict()), "second.json")
    adjust_period(ledger, CLASS_A, HOUR0 * 1_000_000, (HOUR0 + 3600) * 1_000_000, to_version=second)
    ledger.close()
    return db_url


def test_cost_is_exact_and_rounds_half_to_even_per_charge():
    price = Price(engine_class="", version=1, valid_from_us=0, currency="USD", engine_hour_price=Decimal("36"))
    # 36 per hour is 0.01 per 10^9 ns... per 10^11 ns: 0.5e9 ns is exactly half a cent, 1.5e9 one and a half
    assert cost_of(500_000_000, price) == Decimal("0.00")
    assert cost_of(1_500_000_000, price) == Decimal("0.02")
    assert cost_of(2_500_000_000, price) == Decimal("0.02")
    assert cost_of(-1_500_000_000, price) == Decimal("-0.02")
    odd = Price(engine_class="", version=1, valid_from_us=0, currency="USD", engine_hour_price=Decimal("3.1415"))
    ns = 123_456_789_012_345
    assert cost_of(ns, odd) == Decimal(round(Fraction(ns) * Fraction("3.1415") * 100 / 3_600_000_000_000)) / 100
    assert str(cost_of(ns, odd)) == "107.73"


def test_every_export_ties_to_the_ledger(served, tmp_path):
    """The checks the real served run passes too (tests/test_vllm_usage.py), here with two classes, a price change
    and an adjustment (a credit Stripe leaves out)."""
    summary = check_exports_tie_to_the_ledger(served, PERIOD, tmp_path)
    assert summary["tenants"] and summary["rows"] > len(summary["tenants"])
    if not summary["focus_validated"]:
        pytest.skip(f"no FOCUS validator at {VALIDATOR.relative_to(ROOT)} (scripts/install-test.sh creates it)")


def test_prices_are_versioned_and_in_force_from_their_hour(served, tmp_path):
    ledger = Ledger(served)
    stored = list_prices(ledger)
    book = PriceBook(stored)
    ledger.close()
    assert [(p.engine_class, p.version, str(p.engine_hour_price)) for p in stored] == [
        (CLASS_A, 1, "3.1415"), (CLASS_A, 2, "4.75"), (CLASS_B, 1, "12")]
    assert book.price_at(CLASS_A, HOUR0 * 1_000_000 - 1) is None
    assert book.price_at(CLASS_A, (HOUR0 + 3599) * 1_000_000).version == 1
    assert book.price_at(CLASS_A, (HOUR0 + 3600) * 1_000_000).version == 2
    assert all(p.prompt_token_price is None and p.output_token_price is None and p.cached_token_discount is None for p in stored)  # none given
    listed = invoke_cli("prices", "list", "--db", served)
    assert listed.returncode == 0 and "4.75 USD/engine-hour" in listed.stdout
    bad = tmp_path / "bad.toml"
    for text, reason in (("[[price]]\nengine_class = 'x'\ncurrency = 'USD'\nengine_hour_price = 0.1\nvalid_from = 0\n", "not a float"),
                         ("[[price]]\nengine_class = 'x'\ncurrency = 'usd'\nengine_hour_price = '1'\nvalid_from = 0\n", "ISO 4217"),
                         ("[[price]]\nengine_class = 'x'\ncurrency = 'USD'\nengine_hour_price = '1'\nvalid_from = 60\n", "whole UTC hour"),
                         ("[[price]]\nengine_class = 'x'\ncurrency = 'USD'\nengine_hour_price = '-1'\nvalid_from = 0\n", "at least 0")):
        bad.write_text(text)
        result = run_cli("prices", "add", str(bad), "--db", served)
        assert result.returncode == 2 and reason in result.stderr and "price 1" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    other_currency = tmp_path / "eur.json"
    other_currency.write_text(json.dumps({"prices": [{"engine_class": CLASS_A, "currency": "EUR", "engine_hour_price": "1",
                                                      "valid_from": HOUR0}]}))
    result = run_cli("prices", "add", str(other_currency), "--db", served)
    assert result.returncode == 2 and "priced in USD" in result.stderr
    assert len(list_prices(Ledger(served))) == 3


def test_focus_export_passes_the_validator_and_sums_to_the_ledger(served, tmp_path):
    out = tmp_path / "focus.csv"
    result = invoke_cli("export", "--format", "focus", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "-o", str(out))
    assert result.returncode == 0, result.stderr
    rows = _read_csv(out)

    ledger = Ledger(served)
    usage = {r.tenant: r.attributed_ns for r in ledger.tenant_usage(PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)}
    adjustments = ledger.adjustment_rows()
    book = PriceBook.load(ledger)
    ledger.close()
    assert adjustments and {r["ChargeCategory"] for r in rows} == {"Usage", "Adjustment"}
    exported_ns: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["ChargeCategory"] == "Usage":
            exported_ns[r["SubAccountId"]] += int(r["x_AttributedNs"])
    assert dict(exported_ns) == usage  # to the nanosecond
    for entry in adjustments:
        [row] = [r for r in rows if r["ChargeCategory"] == "Adjustment" and r["SubAccountId"] == entry.tenant]
        assert int(row["x_AttributedNs"]) == entry.delta_ns and row["ChargeClass"] == "Correction"
    group_exact: dict[tuple, Fraction] = defaultdict(Fraction)
    group_cents: dict[tuple, Decimal] = defaultdict(Decimal)
    for r in rows:  # cost = seconds × price exactly; cents given once per line, the remainder carried within its group
        price = book.price_at(r["x_EngineClass"], int(__import__("datetime").datetime.fromisoformat(r["ChargePeriodStart"]).timestamp()) * 1_000_000)
        exact = Fraction(int(r["x_AttributedNs"])) * Fraction(price.engine_hour_price) / 3_600_000_000_000
        assert abs(Decimal(r["BilledCost"]) - Decimal(round(exact * 100)) / 100) <= Decimal("0.01")
        assert Decimal(r["BilledCost"]) == Decimal(r["EffectiveCost"])
        group = (r["SubAccountId"], r["ChargeCategory"], r["x_EngineClass"], r["x_ModelVersion"])
        group_exact[group] += exact
        group_cents[group] += Decimal(r["BilledCost"])
        assert Decimal(r["ConsumedQuantity"] or "0") * 10**9 == (int(r["x_AttributedNs"]) if r["ChargeCategory"] == "Usage" else 0)
    assert {g: Decimal(round(e * 100)) / 100 for g, e in group_exact.items()} == dict(group_cents)  # rounded once per group
    second_hour = [r for r in rows if r["x_EngineClass"] == CLASS_A and r["ChargePeriodStart"].endswith(f"{(HOUR0 // 3600 + 1) % 24:02d}:00:00Z")]
    assert second_hour and {r["ListUnitPrice"] for r in second_hour} == {"4.75"}

    ratios: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for r in rows:
        if r["ChargeCategory"] == "Usage":
            assert r["AllocatedMethodId"]
            [element] = json.loads(r["AllocatedMethodDetails"], parse_float=Decimal)["Elements"]
            ratios[(r["x_EngineClass"], r["ChargePeriodStart"])] += Decimal(element["AllocatedRatio"])
    assert len(ratios) == 3 and set(ratios.values()) == {Decimal(1)}

    again = tmp_path / "again.csv"
    rerun = invoke_cli("export", "--format", "focus", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                       "-o", str(again), "--json", "--force")
    assert rerun.returncode == 0 and json.loads(rerun.stdout)["ids"] == [] and _read_csv(again) == []  # nothing new
    assert len({r["x_IdempotencyId"] for r in rows}) == len(rows)

    from llmvisor.billing.formats import focus_rows, write_focus
    from llmvisor.billing.periods import recorded_lines

    parquet = tmp_path / "focus.parquet"  # the recorded lines, written as Parquet by the export's writer
    ledger = Ledger(served)
    order = [r["x_IdempotencyId"] for r in rows]
    write_focus(focus_rows(sorted(recorded_lines(ledger), key=lambda c: order.index(c.idempotency_id))), parquet)
    ledger.close()
    table = pq.read_table(parquet).to_pylist()
    assert [t["x_IdempotencyId"] for t in table] == [r["x_IdempotencyId"] for r in rows]
    assert [t["BilledCost"] for t in table] == [r["BilledCost"] for r in rows]
    assert [t["x_AttributedNs"] for t in table] == [int(r["x_AttributedNs"]) for r in rows]

    if not VALIDATOR.exists():
        pytest.skip(f"no FOCUS validator at {VALIDATOR.relative_to(ROOT)} (scripts/install-test.sh creates it)")
    check = run_validator(out)
    assert check.returncode == 0 and "Validation succeeded." in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]
    broken = tmp_path / "broken.csv"  # the same check fails a file that breaks a rule
    broken.write_text(out.read_text().replace("Usage-Based", "Sometimes"))
    assert "ChargeFrequency_Enum failed" in run_validator(broken).stdout


NUMERIC = re.compile(r"^-?[0-9]+(\.[0-9]+)?(E-?[0-9]+)?$")  # FOCUS NumericFormat: no '+', no separators
DATETIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$")  # FOCUS DateTimeFormat


def focus_rule_violations(rows: list[dict]) -> list[str]:
    """Each row's values against the column definitions of tests/data/billing (sources cited there)."""
    spec = json.loads((DATA / "focus-1.2-1.3-columns.json").read_text())
    details_schema = json.loads((DATA / "focus-1.3-allocated-method-details.schema.json").read_text())
    unit = re.compile(spec["unit_format"]["pattern"])
    found = []

    def holds(condition: dict, row: dict) -> bool:
        return all(row[column] in values for column, values in condition.items())

    for k, row in enumerate(rows):
        for name, rule in spec["columns"].items():
            value = row.get(name)
            if value is None:
                found.append(f"row {k}: no column {name}")
                continue
            if value == "":
                if not rule["nullable"] or ("not_null_when" in rule and holds(rule["not_null_when"], row)):
                    found.append(f"row {k}: {name} is null")
                continue
            if "null_when" in rule and holds(rule["null_when"], row):
                found.append(f"row {k}: {name} must be null ({rule['null_when']})")
            kind = rule["type"]
            if kind == "Decimal" and (not NUMERIC.match(value) or (rule.get("non_negative") and Decimal(value) < 0)):
                found.append(f"row {k}: {name} {value!r} is not a FOCUS decimal")
            elif kind == "DateTime" and not DATETIME.match(value):
                found.append(f"row {k}: {name} {value!r} is not YYYY-MM-DDTHH:mm:ssZ")
            elif kind == "JSON" and not isinstance(json.loads(value), dict):
                found.append(f"row {k}: {name} is not a JSON object")
            elif kind == "CurrencyCode" and not re.fullmatch("[A-Z]{3}", value):
                found.append(f"row {k}: {name} {value!r} is not an ISO 4217 code")
            elif kind == "Unit" and not unit.match(value):
                found.append(f"row {k}: {name} {value!r} breaks the UnitFormat")
            if "allowed" in rule and value not in rule["allowed"]:
                found.append(f"row {k}: {name} {value!r} is not an allowed value")
        for quantity, unit_column in (("ConsumedQuantity", "ConsumedUnit"), ("PricingQuantity", "PricingUnit")):
            if (row[quantity] == "") != (row[unit_column] == ""):
                found.append(f"row {k}: {unit_column} must be null exactly when {quantity} is")
        if (row["AllocatedMethodId"] == "") != (row["AllocatedMethodDetails"] == ""):
            found.append(f"row {k}: AllocatedMethodId and AllocatedMethodDetails must be set together")
        if row["AllocatedMethodDetails"]:
            try:
                jsonschema.validate(json.loads(row["AllocatedMethodDetails"]), details_schema)
            except jsonschema.ValidationError as error:
                found.append(f"row {k}: AllocatedMethodDetails: {error.message}")
        if row["ChargeClass"] != "Correction" and row["PricingQuantity"]:  # the deviation the contract file states:
            for price, cost in (("ListUnitPrice", "ListCost"), ("ContractedUnitPrice", "ContractedCost")):  # within half a cent
                if abs(Decimal(row["PricingQuantity"]) * Decimal(row[price]) - Decimal(row[cost])) > Decimal("0.005"):
                    found.append(f"row {k}: PricingQuantity x {price} is more than half a cent from {cost}")
    return found


def test_focus_columns_follow_the_spec_definitions(served, tmp_path):
    spec = json.loads((DATA / "focus-1.2-1.3-columns.json").read_text())
    out = tmp_path / "focus.csv"
    assert invoke_cli("export", "--format", "focus", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                      "-o", str(out)).returncode == 0
    rows = _read_csv(out)
    assert {r["ChargeCategory"] for r in rows} == {"Usage", "Adjustment"}
    assert focus_rule_violations(rows) == []
    assert all(row["ServiceCategory"] == "AI and Machine Learning" for row in rows)
    assert all(row["SkuPriceId"] for row in rows if row["ChargeCategory"] == "Usage")  # the intent of a skipped 1.0 rule
    custom = [name for name in rows[0] if name not in spec["columns"] and name.startswith("x_")]
    assert custom and all(name.startswith(spec["custom_column_prefix"]) for name in custom)
    # the checks can fail: the previous export's spellings break them
    broken = [{**rows[0], "AllocatedMethodDetails": json.dumps({"Elements": [{"AllocatedRatio": "0.5", "SubAccountId": "t"}]}),
               "BilledCost": "1E+2", "ChargeClass": "Correction" if rows[0]["ChargeCategory"] == "Adjustment" else "",
               "ConsumedUnit": "engine seconds"}]
    assert len(focus_rule_violations(broken)) == 3


def test_an_adjustment_is_billed_in_the_month_it_was_made_and_corrects_only_an_earlier_one():
    """FOCUS 1.2 ChargeClass: 'Correction' for a correction of a previously invoiced billing period, null for one
    within the current billing period; the row sits in the billing period it was made in."""
    from llmvisor.billing.charges import Charge
    from llmvisor.billing.formats import focus_rows

    price = Price(engine_class="c", version=1, valid_from_us=0, currency="USD", engine_hour_price=Decimal("36"))
    june, july = 1_749_340_800_000_000, 1_751_932_800_000_000  # 2025-06-08, 2025-07-08 00:00 UTC
    made = {"same month": june + 86_400_000_000, "next month": july}
    rows = {name: focus_rows([Charge("adjustment", "t", "c", 2, june, june + 3_600_000_000, -1_500_000_000, 0, price,
                                     cost_of(-1_500_000_000, price), from_versions="1", made_at_us=at)])[0]
            for name, at in made.items()}
    assert rows["same month"]["ChargeClass"] is None and rows["same month"]["BillingPeriodStart"] == "2025-06-01T00:00:00Z"
    assert rows["next month"]["ChargeClass"] == "Correction" and rows["next month"]["BillingPeriodStart"] == "2025-07-01T00:00:00Z"
    assert {r["ChargePeriodStart"] for r in rows.values()} == {"2025-06-08T00:00:00Z"} and rows["same month"]["BilledCost"] == "-0.02"
    assert focus_rule_violations([{k: "" if v is None else str(v) for k, v in r.items()} for r in rows.values()]) == []


def test_metering_events_validate_and_sum_to_the_ledger(served, tmp_path):
    from cloudevents.core.formats.json import JSONFormat
    from cloudevents.core.v1.event import CloudEvent

    ledger = Ledger(served)
    found = charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)
    usage = {r.tenant: r.attributed_ns for r in ledger.tenant_usage(PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)}
    delta = defaultdict(int)
    for row in ledger.adjustment_rows():
        delta[row.tenant] += row.delta_ns
    ledger.close()
    owed = {t: usage.get(t, 0) + delta.get(t, 0) for t in set(usage) | set(delta)}
    customers = tmp_path / "customers.json"
    customers.write_text(json.dumps({"tenant-0": "cus_zero"}))

    result = invoke_cli("export", "--format", "cloudevents", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                        "--customers", str(customers), "-o", str(tmp_path / "events.json"))
    assert result.returncode == 0, result.stderr
    bodies = json.loads((tmp_path / "events.json").read_text())
    events = [JSONFormat().read(None, json.dumps(body)) for body in bodies]  # parsed back with the SDK
    assert all(isinstance(e, CloudEvent) and e.get_specversion() == "1.0" and e.get_type() == "llmvisor.engine_time"
               and e.get_source() == "llmvisor" and e.get_time().utcoffset().total_seconds() == 0 for e in events)
    assert [e.get_id() for e in events] == [c.idempotency_id for c in found]
    subjects = {e.get_subject() for e in events}
    assert "cus_zero" in subjects and "tenant-0" not in subjects
    summed = defaultdict(int)
    for e in events:
        summed["tenant-0" if e.get_subject() == "cus_zero" else e.get_subject()] += e.get_data()["engine_ns"]
    assert dict(summed) == owed  # usage plus adjustments, to the nanosecond
    assert [b["id"] for b in cloudevents_json(cloudevents(found, {}))] == [e.get_id() for e in events]  # re-export

    stripe_schema = json.loads((DATA / "stripe-meter-event.schema.json").read_text())
    warnings = []
    stripe = stripe_events(found, {}, warn=warnings.append)
    for event in stripe:
        jsonschema.validate(event, stripe_schema)
    assert any("35 days" in w for w in warnings)  # the test ledger's steps are from 2025
    credits = sum(c.attributed_ns for c in found if c.attributed_ns < 0)
    assert credits < 0 and any("credits" in w for w in warnings)
    assert sum(int(e["payload"]["value"]) for e in stripe) == sum(owed.values()) + delta_total_credit(found)
    assert len({e["identifier"] for e in stripe}) == len(stripe)
    assert stripe_events(found, {}, warn=lambda _line: None) == stripe  # same ids on a re-export

    lago_schema = json.loads((DATA / "lago-event-batch.schema.json").read_text())
    lago = lago_events(found, {"tenant-1": "sub_one"})
    batches = lago_batches(lago * 60)  # more than one batch's worth
    assert len(batches) == -(-len(lago) * 60 // 100) and all(len(b["events"]) <= 100 for b in batches)
    for batch in batches:
        jsonschema.validate(batch, lago_schema)
    lago_sum = defaultdict(int)
    for event in lago:
        lago_sum["tenant-1" if event["external_subscription_id"] == "sub_one" else event["external_subscription_id"]] += (
            event["properties"]["engine_ns"])
    assert dict(lago_sum) == owed


def delta_total_credit(found) -> int:
    """What Stripe leaves out: the credits (negative adjustments), which it cannot take as meter events."""
    return -sum(c.attributed_ns for c in found if c.attributed_ns < 0)


def test_an_unpriced_class_is_refused_for_focus_in_one_line(served, tmp_path):
    result = invoke_cli("export", "--format", "focus", "--db", served, "--start", str(PERIOD[0] - 3600), "--end", str(PERIOD[1]),
                        "-o", str(tmp_path / "x.csv"))
    assert result.returncode == 0  # no usage before HOUR0: nothing unpriced
    ledger = Ledger(served)
    found = usage_charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)
    ledger.close()
    assert all(c.price is not None for c in found)
    bad = run_cli("export", "--format", "focus", "--db", served, "--start", str(PERIOD[0] + 1), "--end", str(PERIOD[1]), "-o", "x.csv")
    assert bad.returncode == 2 and "whole UTC hour" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


TOKEN_PRICES_TOML = f"""
[[price]]
engine_class = "{CLASS_A}"
currency = "USD"
engine_hour_price = "4.75"
valid_from = {HOUR0 + 3600}
prompt_token_price = "0.0000031"
output_token_price = "0.0000157"
cached_token_discount = "0.75"

[[price]]
engine_class = "{CLASS_B}"
currency = "USD"
engine_hour_price = "12"
valid_from = {HOUR0}
output_token_price = "0.00002"
"""
"""Token prices beside the engine-hour ones: class A's second hour gets all three (a correction of its v2, same
valid_from), class B output tokens only; class A's first hour stays priced by engine-hours alone."""


@pytest.fixture
def token_priced(served, tmp_path):
    price_file = tmp_path / "token-prices.toml"
    price_file.write_text(TOKEN_PRICES_TOML)
    result = invoke_cli("prices", "add", str(price_file), "--db", served)
    assert result.returncode == 0, result.stderr
    return served


def test_token_prices_are_charged_with_the_version_in_force_and_every_export_ties(token_priced, tmp_path):
    """Tokens × token prices in every export, tied to the ledger's token split (tests/_billing_checks.py): class A's
    first hour has no token charge (its price has none), its second hour all three kinds (its cached tokens at a 75%
    discount), class B output tokens only."""
    ledger = Ledger(token_priced)
    found = charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)
    split = {r.tenant: r for r in ledger.tenant_usage(PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)}
    ledger.close()
    items = {(c.engine_class, c.period_start_us // 1_000_000, c.item) for c in found}
    assert not {i for i in items if i[:2] == (CLASS_A, HOUR0) and i[2] != "engine_time"}
    assert {i[2] for i in items if i[:2] == (CLASS_A, HOUR0 + 3600)} == {"engine_time", "uncached_prompt_tokens",
                                                                         "cached_prompt_tokens", "output_tokens"}
    assert {i[2] for i in items if i[0] == CLASS_B} == {"engine_time", "output_tokens"}
    cached = [c for c in found if c.item == "cached_prompt_tokens"]
    assert cached and all(c.unit_price == Decimal("0.000000775") for c in cached)  # 0.0000031 × (1 − 0.75), exact
    assert all(r.num_uncached_prompt_tokens + r.num_output_tokens == r.num_new_tokens for r in split.values())
    assert sum(r.num_cached_prompt_tokens for r in split.values()) > 0  # run a1 carried the prefix-cache fact
    summary = check_exports_tie_to_the_ledger(token_priced, PERIOD, tmp_path)
    assert summary["token_rows"] == len([c for c in found if c.item != "engine_time"]) > 0
    assert len({c.idempotency_id for c in found}) == len(found)  # a token kind's id differs from its usage's
    rows = _read_csv(tmp_path / "focus.csv")
    assert focus_rule_violations(rows) == []
    tokens = [r for r in rows if r["ConsumedUnit"] == "Tokens"]
    assert {r["SkuId"].split("/")[0] for r in tokens} == {"prompt-token", "cached-prompt-token", "output-token"}
    assert all(r["SkuPriceId"].endswith("/v3") for r in tokens if r["x_EngineClass"] == CLASS_A)
    if not summary["focus_validated"]:
        pytest.skip(f"no FOCUS validator at {VALIDATOR.relative_to(ROOT)} (scripts/install-test.sh creates it)")


def test_usage_api_cost_includes_the_token_cost(token_priced, model_path):
    """/v1/usage/tenants ``cost`` is `tenant_costs`: engine time and tokens, per currency."""
    from llmvisor.billing import tenant_costs
    from llmvisor.service.routes.usage import COST_END_US

    ledger = Ledger(token_priced)
    admin = ledger.create_key(is_admin=True)
    owed = tenant_costs(ledger, 0, COST_END_US)  # an open range, as the route reads one
    engine_only = defaultdict(Decimal)
    for c in charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000):
        if c.item == "engine_time":
            engine_only[c.tenant] += c.cost
    ledger.close()
    assert all(owed[t]["USD"] > engine_only[t] for t in owed)  # the tokens cost something on top
    with TestClient(create_app(model_path, token_priced, registry_refresh_s=0.0)) as client:
        response = client.get("/v1/usage/tenants", headers=bearer(admin))
    assert response.status_code == 200, response.text
    assert {t["tenant"]: t["cost"] for t in response.json()["tenants"]} == {t: {"USD": str(c["USD"])} for t, c in owed.items()}


@pytest.mark.parametrize("field, value, reason", [
    ("prompt_token_price", '"-0.000001"', "prompt_token_price must be a finite number at least 0"),
    ("output_token_price", "0.000002", "output_token_price must be written as a string or an integer"),
    ("output_token_price", '"cheap"', "output_token_price must be a decimal number"),
    ("cached_token_discount", '"1.5"', "cached_token_discount must be a fraction from 0 to 1"),
    ("cached_token_discount", '"0.5"', "cached_token_discount needs a prompt_token_price"),
])
def test_a_bad_token_price_is_refused_in_one_line_and_nothing_is_stored(served, tmp_path, field, value, reason):
    price_file = tmp_path / "tokens.toml"
    price_file.write_text(f'[[price]]\nengine_class = "{CLASS_A}"\ncurrency = "USD"\nengine_hour_price = "1"\n'
                          f'valid_from = {HOUR0}\n{field} = {value}\n')
    result = run_cli("prices", "add", str(price_file), "--db", served)
    assert result.returncode == 2, result.stderr
    assert f"{price_file} price 1: {reason}" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    ledger = Ledger(served)
    assert len(list_prices(ledger)) == 3
    ledger.close()


def test_a_price_version_stored_with_a_token_price_is_charged_not_refused(served, tmp_path):
    """A version an earlier llmvisor stored with a token price (it refused them on input, but its table had the
    columns) is now charged with it, like any version."""
    from sqlalchemy import update

    from llmvisor.ledger.schema import prices

    ledger = Ledger(served)
    with ledger.write_transaction() as conn:
        conn.execute(update(prices).where(prices.c.engine_class == CLASS_B).values(output_token_price="0.000002"))
    found = [c for c in charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000) if c.engine_class == CLASS_B]
    ledger.close()
    assert {c.item for c in found} == {"engine_time", "output_tokens"}
    assert all(c.cost == Decimal(round(Fraction(c.quantity) * Fraction("0.000002") * 100)) / 100
               for c in found if c.item == "output_tokens")


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first two requests, then 200; records the bodies."""

    def do_POST(self):  # noqa: N802
        server = self.server
        body = self.rfile.read(int(self.headers["content-length"]))
        server.headers.append(dict(self.headers))
        server.seen.append(json.loads(body) if "json" in self.headers["content-type"] else parse_qs(body.decode()))
        status = server.statuses.pop(0) if server.statuses else 200
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    server.seen, server.statuses, server.headers = [], [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_push_retries_5xx_then_succeeds_and_never_retries_4xx(flaky_server, served):
    url = f"http://127.0.0.1:{flaky_server.server_address[1]}/events"
    flaky_server.statuses = [503, 502]
    result = invoke_cli("export", "--format", "lago", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--push", url)
    assert result.returncode == 0, result.stderr
    assert len(flaky_server.seen) == 3 and flaky_server.seen[0] == flaky_server.seen[2]  # the same body, the same ids
    assert "3 requests with retries" in result.stdout
    flaky_server.seen.clear()
    flaky_server.statuses = [422]
    with pytest.raises(PushError, match="refused the body with HTTP 422"):
        push(url, [{"a": 1}], wait_s=0.01)
    assert len(flaky_server.seen) == 1
    flaky_server.statuses = [500] * 5
    with pytest.raises(PushError, match="HTTP 500 after 5 attempts"):
        push(url, [{"a": 1}], wait_s=0.01)
    dry = invoke_cli("export", "--format", "stripe", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                     "--push", url, "--dry-run")
    assert dry.returncode == 0 and "nothing sent" in dry.stderr and len(flaky_server.seen) == 6
    assert all(json.loads(line)["event_name"] == "llmvisor_engine_ns" for line in dry.stdout.splitlines())


def test_prices_api_reads_with_any_key_and_adds_with_an_admin_key(model_path, db_url):  # noqa: F811
    ledger = Ledger(db_url)
    admin, tenant_key = ledger.create_key(is_admin=True), ledger.create_key("tenant-0")
    ledger.close()
    entry = {"engine_class": CLASS_A, "currency": "USD", "engine_hour_price": "2.50", "valid_from": HOUR0}
    with TestClient(create_app(model_path, db_url, registry_refresh_s=0.0)) as client:
        assert client.post("/v1/prices", json={"prices": [entry]}, headers=bearer(tenant_key)).status_code == 403
        added = client.post("/v1/prices", json={"prices": [entry, {**entry, "valid_from": HOUR0 + 3600}]}, headers=bearer(admin))
        assert added.status_code == 201, added.text
        assert [(p["version"], p["engine_hour_price"]) for p in added.json()] == [(1, "2.50"), (2, "2.50")]
        bad = client.post("/v1/prices", json={"prices": [{**entry, "engine_hour_price": 2.5}]}, headers=bearer(admin))
        assert bad.status_code == 422 and "body price 1" in bad.text and "not a float" in bad.text
        tokens = client.post("/v1/prices", json={"prices": [{**entry, "cached_token_discount": "2"}]}, headers=bearer(admin))
        assert tokens.status_code == 422 and "body price 1: cached_token_discount must be a fraction from 0 to 1" in tokens.text
        listed = client.get("/v1/prices", headers=bearer(tenant_key))
        assert listed.status_code == 200 and [p["version"] for p in listed.json()] == [1, 2]
        assert client.get("/v1/prices").status_code == 401


def test_a_schema_4_ledger_migrates_to_schema_5_with_its_totals(served, tmp_path, model_path):  # noqa: F811
    """A schema-4 ledger is this one without the billing table, marked version 4."""
    if not served.startswith("sqlite"):
        pytest.skip("the schema-4 ledger is built as a SQLite file")
    from sqlalchemy import create_engine, text

    from llmvisor.ledger.migrate import migrate

    engine = create_engine(served)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE prices"))
        conn.execute(text("UPDATE ledger_info SET value = '4' WHERE name = 'schema_version'"))
    engine.dispose()
    with pytest.raises(Exception, match="schema version 4, this llmvisor reads 10"):
        Ledger(served)
    from _service_fixtures import POSTGRES_URL, empty_postgres

    targets = [f"sqlite:///{tmp_path}/five.db"] + ([empty_postgres(POSTGRES_URL)] if POSTGRES_URL else [])
    for target in targets:
        report = migrate(served, target)
        copied = Ledger(target)
        assert {r.tenant: r.attributed_ns for r in copied.tenant_usage()} == report.attributed_ns_per_tenant
        assert len(copied.adjustment_rows()) > 0 and list_prices(copied) == []
        assert {m.version for m in copied.list_models(CLASS_A)} == {1, 2}
        admin = copied.create_key(is_admin=True)
        steps_before = copied.totals().num_steps
        copied.close()
        with TestClient(create_app(model_path, target, registry_refresh_s=0.0)) as client:  # new batches after the copied ids
            body = class_body(CLASS_B, 30, run_id="after", seed=9, first_timestamp_s=T0_S + 100)
            assert client.post("/v1/steps", json=body, headers=bearer(admin)).status_code == 200
        after = Ledger(target)
        assert after.totals().num_steps == steps_before + 30
        after.close()


def test_stripe_push_is_form_encoded_with_the_key_from_the_environment(flaky_server, served):
    url = f"http://127.0.0.1:{flaky_server.server_address[1]}/v1/billing/meter_events"
    result = invoke_cli("export", "--format", "stripe", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--push", url,
                        "--auth-env", "LLMVISOR_TEST_STRIPE_KEY", env={"LLMVISOR_TEST_STRIPE_KEY": "sk_test_123"})
    assert result.returncode == 0, result.stderr
    ledger = Ledger(served)
    expected = stripe_events(charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000), {}, warn=lambda _line: None)
    ledger.close()
    assert len(flaky_server.seen) == len(expected)
    for sent, event, headers in zip(flaky_server.seen, expected, flaky_server.headers):
        assert headers["Authorization"] == "Bearer sk_test_123"
        assert sent == {"event_name": [event["event_name"]], "identifier": [event["identifier"]], "timestamp": [str(event["timestamp"])],
                        "payload[stripe_customer_id]": [event["payload"]["stripe_customer_id"]],
                        "payload[value]": [event["payload"]["value"]]}
    unset = run_cli("export", "--format", "stripe", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                    "--push", url, "--auth-env", "LLMVISOR_TEST_UNSET_VARIABLE")
    assert unset.returncode == 2 and "LLMVISOR_TEST_UNSET_VARIABLE is not set" in unset.stderr


def test_tenant_cost_sums_the_charges_per_currency(served):
    ledger = Ledger(served)
    found = charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000, ["tenant-1"])
    owed = tenant_cost(ledger, "tenant-1", PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)
    ledger.close()
    assert found and owed == {"USD": sum(c.cost for c in found)}
    assert all(c.tenant == "tenant-1" for c in found)
    everyone = {c.idempotency_id for c in charges(Ledger(served), PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)}
    assert {c.idempotency_id for c in found} < everyone  # a tenant's export is a subset with the same ids


@pytest.mark.parametrize("args, reason", [
    (["--format", "xml", "-o", "x.csv"], "--format: choose one of"),
    (["--format", "focus", "--push", "http://127.0.0.1:9/"], "a FOCUS export is a file"),
    (["--format", "focus", "-o", "x.txt"], "written as .csv or .parquet"),
    (["--format", "lago"], "name a file"),
    (["--format", "lago", "-o", "x.json", "--customers", "missing.json"], "cannot read the customer map"),
])
def test_export_input_errors_are_one_line(served, tmp_path, args, reason):
    result = run_cli("export", "--db", served, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), *args, cwd=tmp_path)
    assert result.returncode == 2 and reason in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_prices_list_refuses_a_ledger_file_that_does_not_exist_and_creates_none(tmp_path):
    missing = tmp_path / "typo.db"
    result = run_cli("prices", "list", "--db", f"sqlite:///{missing}", cwd=tmp_path)
    assert result.returncode == 2 and f"--db sqlite:///{missing}: no such ledger file" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not missing.exists()


def test_export_refuses_a_ledger_file_that_does_not_exist_and_creates_none(tmp_path):
    missing = tmp_path / "typo.db"
    result = run_cli("export", "--db", f"sqlite:///{missing}", "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--format", "lago",
                     "-o", "x.json", cwd=tmp_path)
    assert result.returncode == 2 and "no such ledger file" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not missing.exists()
