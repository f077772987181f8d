"""The checks every export must pass on a ledger, whoever filled it: the service fed synthetic steps
(tests/test_billing.py) or a real served run, vLLM's OpenAI server with the recorder pushing to `llmvisor serve`
(tests/test_vllm_usage.py). One function, `check_exports_tie_to_the_ledger`, so both ledgers are held to the same
contracts:

- FOCUS (CSV, by the CLI as an operator runs it) passes ``focus-validator --validate-version 1.0``;
- its per-tenant ``BilledCost`` sums equal the ledger's seconds × price plus its tokens × token prices, computed here
  from the ledger's own usage query (`Ledger.class_usage`, per engine class and hour: engine time and the token
  split) with exact fractions, rounded half to even per charge (one per kind of token);
- its token rows' quantities per tenant and kind equal the ledger's token split, and so do the ``x_`` token columns;
- its KV memory rows (``GiB-Hours``, trace format 3, priced per GiB-hour) carry per tenant the ledger's KV block-ns,
  to the block-nanosecond, their cost the ledger's block-ns × block bytes × price, exact, rounded once per group;
- a re-export gives identical ids;
- CloudEvents, Stripe and Lago exports of the same ledger validate (the SDK, the JSON Schemas in tests/data/billing)
  and sum to the same nanoseconds, the same tokens of each priced kind, the same KV block-ns and the same money per
  tenant.
"""

from __future__ import annotations

import csv
import json
import subprocess
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import jsonschema

from _cli import invoke_cli
from _processes import cli_process
from llmvisor.billing import PriceBook, charges
from llmvisor.billing.formats import lago_batches
from llmvisor.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "billing"
VALIDATOR = ROOT / ".venv-focus" / "bin" / "focus-validator"
US_PER_HOUR = 3_600_000_000
NS_PER_HOUR = 3_600_000_000_000


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``llmvisor ARGS`` as its own process (`cli_process`): for the refusals (one line on stderr, exit 2) and what only a process shows.
    A command that is a step of a check runs in this process instead (`invoke_cli`, tests/_cli.py)."""
    return cli_process(*args, cwd=cwd, timeout_s=300)


def run_validator(path: Path) -> subprocess.CompletedProcess:
    """focus-validator on a CSV, from its site-packages folder (1.0.0 reads its currency-code list by a path relative
    to the working directory), skipping the rule tests/data/billing/focus-validator-overrides.yaml explains."""
    [packages] = VALIDATOR.resolve().parent.parent.glob("lib/python*/site-packages")
    return subprocess.run([str(VALIDATOR), "--data-file", str(path.resolve()), "--validate-version", "1.0", "--override-file",
                           str(DATA / "focus-validator-overrides.yaml")], capture_output=True, text=True, timeout=600, cwd=packages)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def export(db_url: str, format_: str, period_s: tuple[int, int], output: Path, *extra: str) -> subprocess.CompletedProcess:
    result = invoke_cli("export", "--format", format_, "--db", db_url, "--start", str(period_s[0]), "--end", str(period_s[1]),
                     "-o", str(output), *extra)
    assert result.returncode == 0, result.stderr
    return result


def price_every_class(db_url: str, period_s: tuple[int, int], folder: Path, engine_hour_price: str,
                      gib_hour_price: str | None = None) -> list[str]:
    """Price each engine class that has usage in the period (from its start hour on) with ``llmvisor prices add``,
    as an operator does (with ``gib_hour_price``, KV memory too); returns the classes."""
    from llmvisor.billing import usage_charges

    ledger = Ledger(db_url)
    try:
        classes = sorted({c.engine_class for c in usage_charges(ledger, period_s[0] * 1_000_000, period_s[1] * 1_000_000)})
    finally:
        ledger.close()
    assert classes, "no usage in the period"
    price_file = folder / "prices.toml"
    memory = "" if gib_hour_price is None else f'gib_hour_price = "{gib_hour_price}"\n'
    price_file.write_text("".join(f'[[price]]\nengine_class = "{c}"\ncurrency = "USD"\nengine_hour_price = "{engine_hour_price}"\n'
                                  f"{memory}valid_from = {period_s[0]}\n\n" for c in classes))
    added = invoke_cli("prices", "add", str(price_file), "--db", db_url)
    assert added.returncode == 0, added.stderr
    return classes


def exact_cost(ns: int, engine_hour_price: Decimal) -> Fraction:
    """ns × price per hour, exactly (written out here, not taken from llmvisor)."""
    return Fraction(ns) * Fraction(engine_hour_price) / NS_PER_HOUR


def cents(exact: Fraction) -> Decimal:
    """An exact amount rounded half to even to the cent, once."""
    return Decimal(round(exact * 100)) / 100


TOKEN_KINDS = ("uncached_prompt_tokens", "cached_prompt_tokens", "output_tokens")
TOKEN_SKU_KIND = {"prompt-token": "uncached_prompt_tokens", "cached-prompt-token": "cached_prompt_tokens",
                  "output-token": "output_tokens"}


def exact_token_costs(split, price) -> dict[str, Fraction]:
    """Per priced kind of token, tokens × its price (cached: prompt price × (1 − discount)), exactly (written out
    here); kinds without a price or without tokens are absent."""
    prompt, output = price.prompt_token_price, price.output_token_price
    discount = Fraction(price.cached_token_discount or 0)
    unit = {"uncached_prompt_tokens": None if prompt is None else Fraction(prompt),
            "cached_prompt_tokens": None if prompt is None else Fraction(prompt) * (1 - discount),
            "output_tokens": None if output is None else Fraction(output)}
    out = {}
    for kind, count in zip(TOKEN_KINDS, split):
        if unit[kind] is not None and count:
            out[kind] = Fraction(count) * unit[kind]
    return out


def check_exports_tie_to_the_ledger(db_url: str, period_s: tuple[int, int], folder: Path, *, focus_file: Path | None = None) -> dict:
    """Every export of the period, checked against the published contracts and the ledger (module note). Returns
    the per-tenant figures: ledger nanoseconds (usage plus adjustments) and money. ``focus_file``: the period's FOCUS
    export already made (a second one is refused: its lines are recorded as exported), checked instead of a new one."""
    start_us, end_us = period_s[0] * 1_000_000, period_s[1] * 1_000_000
    ledger = Ledger(db_url)
    try:
        book = PriceBook.load(ledger)
        tenants = sorted({r.tenant for r in ledger.tenant_usage(start_us, end_us)})
        usage_ns = {r.tenant: r.attributed_ns for r in ledger.tenant_usage(start_us, end_us)}
        exact_per_line_group: dict[tuple, Fraction] = defaultdict(Fraction)  # rounded once per group (docs/billing.md)
        expected_tokens: dict[tuple[str, str], int] = defaultdict(int)  # (tenant, kind) → priced tokens
        cells: dict[str, set] = defaultdict(set)
        for tenant in tenants:  # the ledger's own per-class, per-hour usage, priced here
            for engine_class, hour_us, ns, _slices, _tokens, *split in ledger.class_usage(start_us, end_us, "hour", tenant):
                price = book.price_at(engine_class, hour_us)
                exact_per_line_group[(tenant, "usage", engine_class, "engine_time")] += exact_cost(ns, price.engine_hour_price)
                for kind, cost in exact_token_costs(split, price).items():
                    exact_per_line_group[(tenant, "usage", engine_class, kind)] += cost
                    expected_tokens[(tenant, kind)] += split[TOKEN_KINDS.index(kind)]
                cells[tenant].add((engine_class, hour_us))
        split_per_tenant = {r.tenant: (r.num_uncached_prompt_tokens, r.num_cached_prompt_tokens, r.num_output_tokens)
                            for r in ledger.tenant_usage(start_us, end_us)}
        expected_kv: dict[str, int] = defaultdict(int)  # tenant → block-ns billed as memory (its price has a GiB-hour price)
        for hour_us, engine_class, _v, tenant, *_rest, block_bytes, block_ns in ledger.hourly_usage(start_us, end_us):
            price = book.price_at(engine_class, hour_us)
            if block_ns and price.gib_hour_price is not None:
                expected_kv[tenant] += block_ns
                exact_per_line_group[(tenant, "usage", engine_class, "kv_memory")] += (
                    Fraction(block_ns * block_bytes, 2**30 * NS_PER_HOUR) * Fraction(price.gib_hour_price))
        adjustments = [a for a in ledger.adjustment_rows() if start_us <= a.period_start_us < end_us]
    finally:
        ledger.close()
    owed_ns = dict(usage_ns)
    for a in adjustments:
        owed_ns[a.tenant] = owed_ns.get(a.tenant, 0) + a.delta_ns
        exact_per_line_group[(a.tenant, "adjustment", a.engine_class, a.to_version)] += exact_cost(
            a.delta_ns, book.price_at(a.engine_class, a.period_start_us).engine_hour_price)
    expected_cost: dict[str, Decimal] = defaultdict(Decimal)  # one month, one model version per class and tenant here
    for (tenant, *_group), exact in exact_per_line_group.items():
        expected_cost[tenant] += cents(exact)

    focus = folder / "focus.csv" if focus_file is None else focus_file
    if focus_file is None:
        ids = json.loads(export(db_url, "focus", period_s, focus, "--json").stdout)["ids"]
    rows = read_csv(focus)
    if focus_file is not None:
        ids = [r["x_IdempotencyId"] for r in rows]
    assert ids == [r["x_IdempotencyId"] for r in rows] and len(set(ids)) == len(ids)
    billed: dict[str, Decimal] = defaultdict(Decimal)
    consumed: dict[str, Decimal] = defaultdict(Decimal)
    usage_cells: dict[str, list] = defaultdict(list)
    ratios: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    focus_tokens: dict[tuple[str, str], int] = defaultdict(int)
    x_split: dict[str, list] = defaultdict(lambda: [0, 0, 0])
    focus_kv: dict[str, int] = defaultdict(int)
    for r in rows:
        billed[r["SubAccountId"]] += Decimal(r["BilledCost"])
        assert r["BillingCurrency"] == "USD" and Decimal(r["BilledCost"]) == Decimal(r["EffectiveCost"])
        if r["ChargeCategory"] == "Usage" and r["ConsumedUnit"] == "Tokens":  # a token charge: no allocation
            assert r["PricingQuantity"] == r["ConsumedQuantity"] and not r["AllocatedMethodDetails"]
            kind = TOKEN_SKU_KIND[r["SkuId"].split("/")[0]]
            focus_tokens[(r["SubAccountId"], kind)] += int(r["ConsumedQuantity"])
        elif r["ChargeCategory"] == "Usage" and r["ConsumedUnit"] == "GiB-Hours":  # KV memory: no allocation
            assert r["PricingQuantity"] == r["ConsumedQuantity"] and not r["AllocatedMethodDetails"]
            assert r["SkuId"] == f"kv-memory/{r['x_EngineClass'] or 'none'}" and r["PricingUnit"] == "GiB-Hours"
            block_ns, block_bytes = int(r["x_KvBlockNs"]), int(r["x_KvBlockBytes"])
            assert abs(Decimal(r["ConsumedQuantity"]) - Decimal(block_ns * block_bytes) / Decimal(2**30 * NS_PER_HOUR)) < Decimal("1e-20")
            focus_kv[r["SubAccountId"]] += block_ns
        elif r["ChargeCategory"] == "Usage":
            for k, name in enumerate(("x_UncachedPromptTokens", "x_CachedPromptTokens", "x_OutputTokens")):
                x_split[r["SubAccountId"]][k] += int(r[name])
            consumed[r["SubAccountId"]] += Decimal(r["ConsumedQuantity"])
            usage_cells[r["SubAccountId"]].append((r["x_EngineClass"], r["ChargePeriodStart"]))
            [element] = json.loads(r["AllocatedMethodDetails"], parse_float=Decimal)["Elements"]
            ratios[(r["x_EngineClass"], r["ChargePeriodStart"])] += Decimal(element["AllocatedRatio"])
    # one usage charge per tenant, class and hour (one model version each here), so the per-cell pricing above applies
    assert {t: len(c) for t, c in usage_cells.items()} == {t: len(c) for t, c in cells.items()}
    assert dict(billed) == dict(expected_cost), (dict(billed), dict(expected_cost))  # to the cent, per tenant
    assert {t: q * 10**9 for t, q in consumed.items()} == {t: Decimal(ns) for t, ns in usage_ns.items()}  # to the ns
    assert set(ratios.values()) == {Decimal(1)}
    assert dict(focus_tokens) == dict(expected_tokens)  # every priced token, once
    assert dict(focus_kv) == dict(expected_kv)  # every KV block-ns priced as memory, once, to the block-nanosecond
    assert {t: tuple(v) for t, v in x_split.items()} == split_per_tenant  # the x_ columns: the ledger's split
    again = folder / "again.csv"  # a re-export is refused (docs/billing.md: Stripe dedupes for 24 h only); forced: nothing new
    refused = run_cli("export", "--format", "focus", "--db", db_url, "--start", str(period_s[0]), "--end", str(period_s[1]),
                      "-o", str(again))
    assert refused.returncode == 2 and not again.exists(), refused.stderr
    assert refused.stderr.startswith(f"error: {len(ids)} lines of this period were already exported as focus; a receiver "
                                     "deduplicates ids only for a while (Stripe: 24 hours)") and refused.stderr.count("\n") == 1
    forced = json.loads(export(db_url, "focus", period_s, again, "--json", "--force").stdout)
    assert forced["ids"] == [] and forced["already_exported"] == len(ids) and read_csv(again) == []
    ledger = Ledger(db_url)
    try:  # the ids are the charges' revision-0 ids, those of the releases before revisions
        assert ids == [c.idempotency_id for c in charges(ledger, start_us, end_us)]
    finally:
        ledger.close()

    events = _cloudevents(db_url, period_s, folder)
    stripe = _stripe(db_url, period_s, folder)
    lago = _lago(db_url, period_s, folder)
    positive_ns = dict(usage_ns)
    for a in adjustments:  # Stripe takes no negative values: credits are left out (and warned about)
        if a.delta_ns > 0:
            positive_ns[a.tenant] = positive_ns.get(a.tenant, 0) + a.delta_ns
    assert events["ns"] == lago["ns"] == owed_ns, (events["ns"], lago["ns"], owed_ns)
    assert events["cost"] == lago["cost"] == dict(billed)
    assert stripe["ns"] == {t: ns for t, ns in positive_ns.items() if ns}
    assert events["tokens"] == lago["tokens"] == stripe["tokens"] == dict(expected_tokens)
    assert events["kv"] == lago["kv"] == stripe["kv"] == dict(expected_kv)

    validated = None
    if VALIDATOR.exists():
        check = run_validator(focus)
        assert check.returncode == 0 and "Validation succeeded." in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]
        validated = True
    return {"tenants": tenants, "owed_ns": owed_ns, "billed": {t: str(c) for t, c in billed.items()}, "rows": len(rows),
            "token_rows": sum(r["ConsumedUnit"] == "Tokens" for r in rows),
            "tokens": {f"{t}/{k}": n for (t, k), n in sorted(expected_tokens.items())}, "focus_validated": validated,
            "kv_block_ns": dict(expected_kv), "memory_rows": sum(r["ConsumedUnit"] == "GiB-Hours" for r in rows)}


def _cloudevents(db_url: str, period_s: tuple[int, int], folder: Path) -> dict:
    from cloudevents.core.formats.json import JSONFormat

    out = folder / "events.json"
    export(db_url, "cloudevents", period_s, out)
    bodies = json.loads(out.read_text())
    schema = json.loads((DATA / "openmeter-event.schema.json").read_text())
    ns: dict[str, int] = defaultdict(int)
    cost: dict[str, Decimal] = defaultdict(Decimal)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    kv: dict[str, int] = defaultdict(int)
    for body in bodies:
        jsonschema.validate(body, schema)
        event = JSONFormat().read(None, json.dumps(body))  # parsed back with the SDK (it checks the attributes)
        assert event.get_specversion() == "1.0" and event.get_time().utcoffset().total_seconds() == 0
        data = event.get_data()
        if event.get_type() == "llmvisor.tokens":
            tokens[(event.get_subject(), data["token_kind"])] += data["tokens"]
        elif event.get_type() == "llmvisor.kv_memory":
            kv[event.get_subject()] += data["kv_block_ns"]
        else:
            assert event.get_type() == "llmvisor.engine_time"
            ns[event.get_subject()] += data["engine_ns"]
        cost[event.get_subject()] += Decimal(data["cost"])
    assert len({b["id"] for b in bodies}) == len(bodies)
    return {"ns": dict(ns), "cost": dict(cost), "tokens": dict(tokens), "kv": dict(kv)}


def _stripe(db_url: str, period_s: tuple[int, int], folder: Path) -> dict:
    out = folder / "stripe.json"
    export(db_url, "stripe", period_s, out)
    events = json.loads(out.read_text())
    schema = json.loads((DATA / "stripe-meter-event.schema.json").read_text())
    ns: dict[str, int] = defaultdict(int)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    kv: dict[str, int] = defaultdict(int)
    for event in events:
        jsonschema.validate(event, schema)
        customer, value = event["payload"]["stripe_customer_id"], int(event["payload"]["value"])
        if event["event_name"] == "llmvisor_engine_ns":
            ns[customer] += value
        elif event["event_name"] == "llmvisor_kv_block_ns":  # KV memory's meter: block-ns
            kv[customer] += value
        else:  # one meter per kind of token: llmvisor_<kind>
            tokens[(customer, event["event_name"].removeprefix("llmvisor_"))] += value
    assert len({e["identifier"] for e in events}) == len(events)
    return {"ns": dict(ns), "tokens": dict(tokens), "kv": dict(kv)}


def _lago(db_url: str, period_s: tuple[int, int], folder: Path) -> dict:
    out = folder / "lago.json"
    export(db_url, "lago", period_s, out)
    events = json.loads(out.read_text())
    schema = json.loads((DATA / "lago-event-batch.schema.json").read_text())
    for batch in lago_batches(events):  # the bodies --push sends
        jsonschema.validate(batch, schema)
    ns: dict[str, int] = defaultdict(int)
    cost: dict[str, Decimal] = defaultdict(Decimal)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    kv: dict[str, int] = defaultdict(int)
    for event in events:
        if event["code"] == "llmvisor_engine_ns":
            ns[event["external_subscription_id"]] += event["properties"]["engine_ns"]
        elif event["code"] == "llmvisor_kv_block_ns":
            kv[event["external_subscription_id"]] += event["properties"]["kv_block_ns"]
        else:
            assert event["code"] == f"llmvisor_{event['properties']['token_kind']}"
            tokens[(event["external_subscription_id"], event["properties"]["token_kind"])] += event["properties"]["tokens"]
        cost[event["external_subscription_id"]] += Decimal(event["properties"]["cost"])
    assert len({e["transaction_id"] for e in events}) == len(events)
    return {"ns": dict(ns), "cost": dict(cost), "tokens": dict(tokens), "kv": dict(kv)}
