"""Charges in the records billing and FinOps tools read: FOCUS rows (CSV, Parquet), CloudEvents for OpenMeter,
Stripe meter events and Lago events. Each record carries its line's idempotency id, which names one content
(`llmvisor.billing.periods`: a correction is a line of its own, with its own id). Metering events carry engine time in integer nanoseconds (``engine_ns``), exact.

Token charges (a price with token prices, `llmvisor.billing.charges`) are records of their own: a FOCUS Usage row per
kind of token (ConsumedUnit and PricingUnit ``Tokens``, a SkuId per kind, `TOKEN_SKUS`), and a metering event per kind
(CloudEvents type ``llmvisor.tokens``, Stripe event name / Lago code `TOKEN_EVENT_NAMES`) whose value is the token
count. KV memory charges (trace format 3, `llmvisor.billing.charges.KV_MEMORY`) likewise: a FOCUS Usage row in
``GiB-Hours`` with a SkuId of its own (``kv-memory/<class>``) and the exact block-ns and block size in ``x_KvBlockNs``
and ``x_KvBlockBytes``; a metering event of type ``llmvisor.kv_memory`` (CloudEvents) or named ``llmvisor_kv_block_ns``
(Stripe, Lago) whose value is the block-ns. Engine time's rows and events carry the usage's token split as well (FOCUS ``x_UncachedPromptTokens``,
``x_CachedPromptTokens``, ``x_OutputTokens``; event data ``uncached_prompt_tokens``, ...; null where unknown).

Lines of usage per LoRA adapter (``llmvisor export --by-adapter``, `llmvisor.billing.charges`) name their adapter: FOCUS
``x_LoraAdapter`` ('' the base model; the column is written only when some line is split by adapter, so other exports
are what they were) and a ``llmvisor/lora_adapter`` tag; event data (CloudEvents, Lago) and the Stripe payload
``lora_adapter``."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from llmvisor.billing.charges import ENGINE_TIME, KV_MEMORY, Charge
from llmvisor.billing.prices import GIB, NS_PER_HOUR, TOKEN_ITEMS
from llmvisor.errors import LlmvisorError

SERVICE_NAME = "llmvisor"
EVENT_TYPE = "llmvisor.engine_time"
EVENT_SOURCE = "llmvisor"
STRIPE_MAX_AGE_S = 35 * 86400
"""Stripe accepts meter events whose timestamp is at most 35 days old."""
LAGO_BATCH = 100
"""Lago's batch endpoint takes at most 100 events per request."""
ALLOCATION_METHOD_ID = "llmvisor-step-latency-split"
FORMATS = ("focus", "cloudevents", "stripe", "lago")
TOKEN_EVENT_TYPE = "llmvisor.tokens"
TOKEN_SKUS = {"uncached_prompt_tokens": "prompt-token", "cached_prompt_tokens": "cached-prompt-token",
              "output_tokens": "output-token"}
"""SkuId stem of each kind of token (``<stem>/<engine class>``; SkuPriceId adds ``/v<price version>``)."""
TOKEN_EVENT_NAMES = {item: f"llmvisor_{item}" for item in TOKEN_SKUS}
"""Stripe meter event name and Lago billable metric code of each kind of token (one meter per kind)."""
TOKEN_COLUMNS = {"x_UncachedPromptTokens": 0, "x_CachedPromptTokens": 1, "x_OutputTokens": 2}
"""FOCUS ``x_`` columns of engine time's usage rows: the usage's token split (`Charge.tokens` index)."""
MEMORY_EVENT_TYPE = "llmvisor.kv_memory"
MEMORY_EVENT_NAME = "llmvisor_kv_block_ns"
"""Stripe meter event name and Lago billable metric code of KV memory: the value is KV block-nanoseconds."""
MEMORY_SKU = "kv-memory"
"""SkuId stem of KV memory (``kv-memory/<engine class>``; SkuPriceId adds ``/v<price version>``)."""
MEMORY_COLUMNS = ("x_KvBlockNs", "x_KvBlockBytes")
"""FOCUS ``x_`` columns of a memory row: its exact block-ns and bytes per block (GiB-hours = their product / 2^30 /
3.6·10¹²)."""


def _iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _month_bounds(us: int) -> tuple[str, str]:
    moment = datetime.fromtimestamp(us / 1e6, tz=UTC)
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start.strftime("%Y-%m-%dT%H:%M:%SZ"), end.strftime("%Y-%m-%dT%H:%M:%SZ")


def _number(value: Decimal) -> str:
    """A decimal in FOCUS's NumericFormat: plain notation (never an exponent, so never its '+' sign), '-' only for
    a negative value."""
    return format(value, "f")


def _seconds(ns: int) -> str:
    """Nanoseconds as exact decimal seconds."""
    return _number(Decimal(int(ns)).scaleb(-9))


def _hours(ns: int) -> str:
    """Nanoseconds as engine-hours, to Decimal's 28 significant digits (ns / 3.6·10¹² rarely ends)."""
    return _number(Decimal(int(ns)) / Decimal(3_600_000_000_000))


def _gib_hours(block_ns: int, block_bytes: int) -> str:
    """Block-ns of blocks of ``block_bytes`` as GiB-hours, to Decimal's 28 significant digits (they rarely end)."""
    return _number(Decimal(int(block_ns) * int(block_bytes)) / Decimal(GIB * NS_PER_HOUR))


def _allocation_details(c: Charge) -> str:
    """FOCUS 1.3's AllocatedMethodDetails object: ``Elements`` of one entry with ``AllocatedRatio`` (a JSON
    number in [0, 1]), ``UsageUnit`` and ``UsageQuantity`` (a number) and the tenant as a custom ``x_`` key (the
    object admits no other keys). The numbers are written as exact decimals, not through a float."""
    return (f'{{"Elements":[{{"AllocatedRatio":{_number(c.allocated_ratio)},"UsageUnit":"Engine-Seconds",'
            f'"UsageQuantity":{_seconds(c.attributed_ns)},"x_SubAccountId":{json.dumps(c.tenant)}}}]}}')


def _billing(c: Charge) -> tuple[str, str, str | None]:
    """(BillingPeriodStart, BillingPeriodEnd, ChargeClass) of a line: billed in the period it was recorded for
    (`Charge.billed_period_start_us`: its own month, or for a correction of a closed period the month the correction
    was made; an adjustment not recorded: the month it was made). A line billed in a later month than its charge's
    corrects a period already invoiced: ChargeClass "Correction"; one within its own month is null (FOCUS 1.2,
    ChargeClass: null for a correction within the current billing period)."""
    if c.billed_period_start_us is not None:
        billed = _month_bounds(c.billed_period_start_us)
    elif c.kind == "adjustment":
        billed = _month_bounds(c.made_at_us if c.made_at_us is not None else c.period_start_us)
    else:
        billed = _month_bounds(c.period_start_us)
    return billed[0], billed[1], None if billed == _month_bounds(c.period_start_us) else "Correction"


def _correction_note(c: Charge) -> str:
    return f" (correction {c.revision} of this charge: the usage stored after it was exported)" if c.revision else ""


def read_customer_map(path: Path | None) -> dict[str, str]:
    """Tenant → customer id from a JSON object file (``{"tenant": "cus_..."}``); a tenant not in it is its own id."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise LlmvisorError(f"{path}: cannot read the customer map ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise LlmvisorError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in data.items()):
        raise LlmvisorError(f"{path}: expected a JSON object of tenant name to customer id (non-empty strings)")
    return data


def _customer(charge: Charge, customers: dict[str, str]) -> str:
    return customers.get(charge.tenant, charge.tenant)


# FOCUS --------------------------------------------------------------------------------------------------------------

FOCUS_COLUMNS = (
    "AvailabilityZone", "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargeFrequency", "ChargePeriodEnd",
    "ChargePeriodStart", "CommitmentDiscountCategory", "CommitmentDiscountId", "CommitmentDiscountName",
    "CommitmentDiscountStatus", "CommitmentDiscountType", "ConsumedQuantity", "ConsumedUnit", "ContractedCost",
    "ContractedUnitPrice", "EffectiveCost", "InvoiceIssuer", "ListCost", "ListUnitPrice", "PricingCategory",
    "PricingQuantity", "PricingUnit", "Provider", "Publisher", "RegionId", "RegionName", "ResourceId", "ResourceName",
    "ResourceType", "ServiceCategory", "ServiceName", "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName", "Tags",
    "AllocatedMethodId", "AllocatedMethodDetails",
    "x_IdempotencyId", "x_EngineClass", "x_ModelVersion", "x_AttributedNs", "x_NewTokens", "x_AdjustedFromVersions",
    *TOKEN_COLUMNS, *MEMORY_COLUMNS,
)
"""FOCUS 1.0's columns, the 1.3 split-cost allocation columns, and llmvisor's own (``x_``). ``ResourceId`` is the
spec's spelling; the 1.0 validator checks ``ResourceID``, which the CSV carries as well (same value)."""
LORA_COLUMN = "x_LoraAdapter"
"""FOCUS column of a line split by LoRA adapter (module note), after `FOCUS_COLUMNS` where written."""
LORA_TAG = "llmvisor/lora_adapter"


def _with_adapter(row: dict, c: Charge) -> dict:
    """A FOCUS row of a line split by adapter names it (``x_LoraAdapter`` and a tag); other rows are left as they are."""
    if c.lora_name is None:
        return row
    tags = json.loads(row["Tags"]) if row.get("Tags") else {}
    return {**row, "Tags": json.dumps({**tags, LORA_TAG: c.lora_name}, separators=(",", ":")), LORA_COLUMN: c.lora_name}


def focus_columns(rows: list[dict]) -> tuple[str, ...]:
    """The columns of an export's rows: `FOCUS_COLUMNS`, and ``x_LoraAdapter`` where a row is split by adapter."""
    return (*FOCUS_COLUMNS, LORA_COLUMN) if any(LORA_COLUMN in row for row in rows) else FOCUS_COLUMNS


def focus_rows(charges: list[Charge], *, billing_account: str = "llmvisor") -> list[dict]:
    """One FOCUS row per charge. Only priced charges can be rows (BilledCost is never null): unpriced ones are refused."""
    unpriced = [c for c in charges if c.price is None]
    if unpriced:
        c = unpriced[0]
        raise LlmvisorError(f"engine class {c.engine_class!r} has no price in force at {_iso(c.period_start_us)}; add one "
                            f"(llmvisor prices add FILE) before a FOCUS export ({len(unpriced)} charges unpriced)")
    return [_with_adapter(_focus_row(c, billing_account), c) for c in charges]


def _focus_row(c: Charge, billing_account: str) -> dict:
    """One priced charge's FOCUS row (before `_with_adapter`)."""
    if c.item == KV_MEMORY:
        return _focus_memory_row(c, billing_account)
    if c.item != ENGINE_TIME:
        return _focus_token_row(c, billing_account)
    usage = c.kind == "usage"
    billing_start, billing_end, charge_class = _billing(c)
    version = "default model" if c.model_version == 0 else f"model v{c.model_version}"
    details = _allocation_details(c) if usage and c.allocated_ratio is not None else None
    cost = _number(c.cost)
    resource = f"llmvisor/engine-class/{c.engine_class or 'none'}"
    return {
        "AvailabilityZone": None,
        "BilledCost": cost,
        "BillingAccountId": billing_account,
        "BillingAccountName": billing_account,
        "BillingCurrency": c.price.currency,
        "BillingPeriodEnd": billing_end,
        "BillingPeriodStart": billing_start,
        "ChargeCategory": "Usage" if usage else "Adjustment",
        "ChargeClass": charge_class,
        "ChargeDescription": (f"engine time on engine class {c.engine_class or '(none)'}, attributed by the {version}"
                              if usage else f"correction of the bill by model v{c.model_version} (billed by {c.from_versions})")
                             + _correction_note(c),
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodEnd": _iso(c.period_end_us),
        "ChargePeriodStart": _iso(c.period_start_us),
        "CommitmentDiscountCategory": None,
        "CommitmentDiscountId": None,
        "CommitmentDiscountName": None,
        "CommitmentDiscountStatus": None,
        "CommitmentDiscountType": None,
        "ConsumedQuantity": _seconds(c.attributed_ns) if usage else None,
        "ConsumedUnit": "Engine-Seconds" if usage else None,
        "ContractedCost": cost,
        "ContractedUnitPrice": _number(c.price.engine_hour_price),
        "EffectiveCost": cost,
        "InvoiceIssuer": billing_account,
        "ListCost": cost,
        "ListUnitPrice": _number(c.price.engine_hour_price),
        "PricingCategory": "Standard",
        "PricingQuantity": _hours(c.attributed_ns),
        "PricingUnit": "Engine-Hours",
        "Provider": billing_account,
        "Publisher": billing_account,
        "RegionId": None,
        "RegionName": None,
        "ResourceId": resource,
        "ResourceName": f"engine class {c.engine_class or '(none)'}",
        "ResourceType": "LLM engine class",
        "ServiceCategory": "AI and Machine Learning",
        "ServiceName": SERVICE_NAME,
        "SkuId": f"engine-hour/{c.engine_class or 'none'}",
        "SkuPriceId": f"engine-hour/{c.engine_class or 'none'}/v{c.price.version}",
        "SubAccountId": c.tenant,
        "SubAccountName": c.tenant,
        "Tags": json.dumps({"llmvisor/engine_class": c.engine_class, "llmvisor/model_version": str(c.model_version)},
                           separators=(",", ":")),
        "AllocatedMethodId": ALLOCATION_METHOD_ID if details else None,
        "AllocatedMethodDetails": details,
        "x_IdempotencyId": c.idempotency_id,
        "x_EngineClass": c.engine_class,
        "x_ModelVersion": c.model_version,
        "x_AttributedNs": c.attributed_ns,
        "x_NewTokens": c.num_new_tokens,
        "x_AdjustedFromVersions": c.from_versions or None,
        **{name: c.tokens[k] if usage else None for name, k in TOKEN_COLUMNS.items()},
        **dict.fromkeys(MEMORY_COLUMNS),
    }


def _focus_memory_row(c: Charge, billing_account: str) -> dict:
    """A memory charge's FOCUS Usage row: the KV memory-time in GiB-hours as ConsumedQuantity and PricingQuantity
    (``GiB-Hours``), the price per GiB-hour as ListUnitPrice and ContractedUnitPrice, a SkuId of its own
    (``kv-memory/<class>``), the exact block-ns and block size in ``x_KvBlockNs``/``x_KvBlockBytes``; no split-cost
    allocation. The rest as a token row's."""
    row = _focus_token_row(c, billing_account)
    version = "default model" if c.model_version == 0 else f"model v{c.model_version}"
    quantity, sku = _gib_hours(c.kv_block_ns, c.kv_block_bytes), f"{MEMORY_SKU}/{c.engine_class or 'none'}"
    row.update({
        "ChargeDescription": f"KV cache memory-time held on engine class {c.engine_class or '(none)'} ({c.kv_block_bytes} bytes "
                             f"per block), usage attributed by the {version}" + _correction_note(c),
        "ConsumedQuantity": quantity, "ConsumedUnit": "GiB-Hours", "PricingQuantity": quantity, "PricingUnit": "GiB-Hours",
        "SkuId": sku, "SkuPriceId": f"{sku}/v{c.price.version}",
        "x_KvBlockNs": c.kv_block_ns, "x_KvBlockBytes": c.kv_block_bytes,
    })
    return row


def _focus_token_row(c: Charge, billing_account: str) -> dict:
    """A token charge's FOCUS Usage row: the tokens of one kind as ConsumedQuantity and PricingQuantity (``Tokens``),
    the unit price as ListUnitPrice and ContractedUnitPrice (cached prompt tokens: the prompt price less the cached
    discount), a SkuId of its own; no split-cost allocation (a tenant's tokens are its own, not a share)."""
    billing_start, billing_end, charge_class = _billing(c)
    version = "default model" if c.model_version == 0 else f"model v{c.model_version}"
    cost, quantity = _number(c.cost), str(c.quantity)
    sku = f"{TOKEN_SKUS.get(c.item, MEMORY_SKU)}/{c.engine_class or 'none'}"
    return {
        "AvailabilityZone": None, "BilledCost": cost, "BillingAccountId": billing_account, "BillingAccountName": billing_account,
        "BillingCurrency": c.price.currency, "BillingPeriodEnd": billing_end, "BillingPeriodStart": billing_start,
        "ChargeCategory": "Usage", "ChargeClass": charge_class,
        "ChargeDescription": f"{c.item.replace('_', ' ')} on engine class {c.engine_class or '(none)'}, usage attributed by the {version}"
                             + _correction_note(c),
        "ChargeFrequency": "Usage-Based", "ChargePeriodEnd": _iso(c.period_end_us), "ChargePeriodStart": _iso(c.period_start_us),
        "CommitmentDiscountCategory": None, "CommitmentDiscountId": None, "CommitmentDiscountName": None,
        "CommitmentDiscountStatus": None, "CommitmentDiscountType": None,
        "ConsumedQuantity": quantity, "ConsumedUnit": "Tokens", "ContractedCost": cost,
        "ContractedUnitPrice": _number(c.unit_price), "EffectiveCost": cost, "InvoiceIssuer": billing_account, "ListCost": cost,
        "ListUnitPrice": _number(c.unit_price), "PricingCategory": "Standard", "PricingQuantity": quantity, "PricingUnit": "Tokens",
        "Provider": billing_account, "Publisher": billing_account, "RegionId": None, "RegionName": None,
        "ResourceId": f"llmvisor/engine-class/{c.engine_class or 'none'}", "ResourceName": f"engine class {c.engine_class or '(none)'}",
        "ResourceType": "LLM engine class", "ServiceCategory": "AI and Machine Learning", "ServiceName": SERVICE_NAME,
        "SkuId": sku, "SkuPriceId": f"{sku}/v{c.price.version}", "SubAccountId": c.tenant, "SubAccountName": c.tenant,
        "Tags": json.dumps({"llmvisor/engine_class": c.engine_class, "llmvisor/model_version": str(c.model_version)},
                           separators=(",", ":")),
        "AllocatedMethodId": None, "AllocatedMethodDetails": None,
        "x_IdempotencyId": c.idempotency_id, "x_EngineClass": c.engine_class, "x_ModelVersion": c.model_version,
        "x_AttributedNs": None, "x_NewTokens": None, "x_AdjustedFromVersions": None, **dict.fromkeys(TOKEN_COLUMNS),
        **dict.fromkeys(MEMORY_COLUMNS),
    }


def write_focus(rows: list[dict], path: Path) -> None:
    """FOCUS rows as CSV (``.csv``) or Parquet (``.parquet``); CSV also carries ``ResourceID`` (module note)."""
    import pyarrow as pa

    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        columns = {name: [row.get(name) for row in rows] for name in focus_columns(rows)}
        integers = ("x_ModelVersion", "x_AttributedNs", "x_NewTokens", *TOKEN_COLUMNS, *MEMORY_COLUMNS)
        table = pa.table({name: pa.array(values, type=pa.int64() if name in integers else pa.string())
                          for name, values in columns.items()})
        pq.write_table(table, path)
        return
    if path.suffix.lower() != ".csv":
        raise LlmvisorError(f"{path}: a FOCUS export is written as .csv or .parquet")
    import csv

    names = [*focus_columns(rows), "ResourceID"]
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow({name: ("" if value is None else value) for name, value in {**row, "ResourceID": row["ResourceId"]}.items()})


# Metering events ----------------------------------------------------------------------------------------------------

def _data(c: Charge) -> dict:
    """An event's data: `_charge_data`, with the line's adapter where it is split by adapter."""
    data = _charge_data(c)
    if c.lora_name is not None:
        data["lora_adapter"] = c.lora_name
    return data


def _charge_data(c: Charge) -> dict:
    if c.item == KV_MEMORY:  # a memory charge: its exact block-ns and block size
        data = {"kv_block_ns": c.kv_block_ns, "kv_block_bytes": c.kv_block_bytes,
                "gib_hours": _gib_hours(c.kv_block_ns, c.kv_block_bytes), "engine_class": c.engine_class,
                "model_version": c.model_version, "kind": c.kind, "period_start": _iso(c.period_start_us),
                "period_end": _iso(c.period_end_us)}
        if c.cost is not None:
            data.update(unit_price=str(c.unit_price), cost=str(c.cost), currency=c.price.currency)
        if c.revision:
            data["revision"] = c.revision
        return data
    if c.item != ENGINE_TIME:  # a token charge: its kind and count
        data = {"token_kind": c.item, "tokens": c.quantity, "engine_class": c.engine_class, "model_version": c.model_version,
                "kind": c.kind, "period_start": _iso(c.period_start_us), "period_end": _iso(c.period_end_us),
                "unit_price": str(c.unit_price)}
        data.update(cost=str(c.cost), currency=c.price.currency)
        if c.revision:
            data["revision"] = c.revision
        return data
    data = {"engine_ns": c.attributed_ns, "engine_class": c.engine_class, "model_version": c.model_version, "kind": c.kind,
            "period_start": _iso(c.period_start_us), "period_end": _iso(c.period_end_us), "new_tokens": c.num_new_tokens}
    if c.kind == "usage":
        data.update(zip(TOKEN_ITEMS, c.tokens))
    if c.cost is not None:
        data.update(cost=str(c.cost), currency=c.price.currency)
    if c.kind == "adjustment":
        data["adjusted_from_versions"] = c.from_versions
    if c.revision:
        data["revision"] = c.revision
    return data


def _event_type(c: Charge) -> str:
    return EVENT_TYPE if c.item == ENGINE_TIME else MEMORY_EVENT_TYPE if c.item == KV_MEMORY else TOKEN_EVENT_TYPE


def _event_name(c: Charge, engine_name: str) -> str:
    return engine_name if c.item == ENGINE_TIME else MEMORY_EVENT_NAME if c.item == KV_MEMORY else TOKEN_EVENT_NAMES[c.item]


def cloudevents(charges: list[Charge], customers: dict[str, str]) -> list:
    """CloudEvents 1.0 (OpenMeter's ingest format), built with the ``cloudevents`` SDK (its v1 event class, which
    validates the attributes). Token charges are of type ``llmvisor.tokens``, memory charges ``llmvisor.kv_memory``."""
    from cloudevents.core.v1.event import CloudEvent

    return [CloudEvent({"id": c.idempotency_id, "type": _event_type(c),
                        "source": EVENT_SOURCE, "subject": _customer(c, customers),
                        "time": datetime.fromtimestamp(c.period_start_us / 1e6, tz=UTC), "datacontenttype": "application/json",
                        "specversion": "1.0"}, _data(c))
            for c in charges]


def cloudevents_json(events: list) -> list[dict]:
    """Structured-mode JSON of each event (the SDK's JSON format), as OpenMeter's batch ingest takes them."""
    from cloudevents.core.formats.json import JSONFormat

    writer = JSONFormat()
    return [json.loads(writer.write(event)) for event in events]


def stripe_events(charges: list[Charge], customers: dict[str, str], *, event_name: str = "llmvisor_engine_ns",
                  now_s: float | None = None, warn=None) -> list[dict]:
    """Stripe meter events: ``value`` is engine nanoseconds as a whole-number string (a token charge: its tokens, under
    its kind's event name, `TOKEN_EVENT_NAMES`; a memory charge: its block-ns, under ``llmvisor_kv_block_ns``; a line
    split by adapter: ``lora_adapter`` in the payload). Stripe takes no negative values, so a credit (an adjustment below 0)
    is left out with one warning line (issue a credit note for it); events more than 35 days old are warned about in
    one line (Stripe refuses them)."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    now_s = time.time() if now_s is None else now_s
    events, credits, old = [], [], 0
    for c in charges:
        if c.quantity < 0:
            credits.append(c)
            continue
        if c.quantity == 0:
            continue
        timestamp = c.period_start_us // 1_000_000
        old += now_s - timestamp > STRIPE_MAX_AGE_S
        name = _event_name(c, event_name)
        payload = {"stripe_customer_id": _customer(c, customers), "value": str(c.quantity)}
        if c.lora_name is not None:  # a line split by adapter: a payload key a meter can group by (a dimension)
            payload["lora_adapter"] = c.lora_name
        events.append({"event_name": name, "identifier": c.idempotency_id, "timestamp": timestamp, "payload": payload})
    if credits:
        warn(f"stripe: {len(credits)} credits ({sum(c.attributed_ns for c in credits)} ns) left out: meter events take no "
             "negative values; issue them as credit notes")
    if old:
        warn(f"stripe: {old} events are more than 35 days old; Stripe refuses them")
    return events


def lago_events(charges: list[Charge], customers: dict[str, str], *, code: str = "llmvisor_engine_ns") -> list[dict]:
    """Lago events (``transaction_id`` is Lago's idempotency key), one per charge, credits as negative values; a token
    charge under its kind's code (`TOKEN_EVENT_NAMES`), its tokens in ``properties.tokens``."""
    return [{"transaction_id": c.idempotency_id, "external_subscription_id": _customer(c, customers),
             "code": _event_name(c, code), "timestamp": c.period_start_us // 1_000_000,
             "properties": _data(c)}
            for c in charges]


def lago_batches(events: list[dict]) -> list[dict]:
    """Lago batch bodies of at most ``LAGO_BATCH`` events."""
    return [{"events": events[k:k + LAGO_BATCH]} for k in range(0, len(events), LAGO_BATCH)]
