"""A tenant on a rank-64 LoRA adapter is billed more than a base-model tenant with the same token counts, by what the
model says, end to end (issue #38 item 6, Done when): two tenants run twin requests, step by step the same new and
context tokens in the same phase, one on adapter ``adapter-r64`` (rank 64, loaded into its slot in some steps), the
other on the base model. Their steps (built here from the project's synthetic generator's token draws, timed by the
LoRA model) go through the service per step and in window aggregates into a real ledger (SQLite and PostgreSQL), are
priced per engine-hour, and exported by ``llmvisor export`` as FOCUS (through the FOCUS validator). The difference of
the two tenants' exported nanoseconds is the difference the model's attribution gives (`attribute`, the ledger's
nanosecond rounding), which is, term by term from the model's coefficients, the adapter's own work (l1 + 64·l2 per
prefill token, l3 + 64·l4 per decode step), its kernels (l5) and its loads (l6, l7), to the rounding; the difference of
their billed costs is that many engine-hours at the price, each tenant's cost rounded once. With ``--by-adapter`` the
usage rows name the adapter (``x_LoraAdapter``); a base-model-only ledger exports the same lines either way."""

from __future__ import annotations

import json
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from fastapi.testclient import TestClient

from _billing_checks import ROOT, VALIDATOR, cents, exact_cost, export, read_csv, run_validator
from _cli import invoke_cli
from _lora_runs import as_rows, lora_model, relayed_lora_run
from _service_fixtures import T0_S, bearer, db_url, model_path  # noqa: F401
from llmvisor.billing import usage_charges
from llmvisor.core.attribution import attribute, attribute_arrays
from llmvisor.core.features import LoraCoef, lora_slices
from llmvisor.core.lora_trace import encode_adapters
from llmvisor.core.rounding import apportion_ns
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import trace_from_rows
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregator
from llmvisor.service.app import create_app

CLASS_L = "1a1a1a1a1a1a1a1a"
ADAPTER, RANK = "adapter-r64", 64
TENANT_LORA, TENANT_BASE = "tenant-lora", "tenant-base"
PRICE = Decimal("12.5")
HOUR0 = int(T0_S) // 3600 * 3600
PERIOD_S = (HOUR0, HOUR0 + 3600)

NO_VALIDATOR = f"no FOCUS validator at {VALIDATOR.relative_to(ROOT)} (scripts/install-test.sh creates it)"


def twin_run(run_id: str, n_steps: int, *, t0_s: float, seed: int, model) -> list[list]:
    """Relayed steps where every slice of the synthetic generator's draw is run twice, by the adapter's tenant and by
    the base tenant; each step timed by the model's own prediction (so the attribution is the model's terms)."""
    draw = synthetic_trace(n_steps, max_batch_size=3, seed=seed, run_id=run_id)
    rng = np.random.default_rng(seed)
    steps = []
    for k in range(draw.n_steps):
        s = slice(int(draw.step_offsets[k]), int(draw.step_offsets[k + 1]))
        slices, names, ranks = [], [], []
        for i, (p, c, f) in enumerate(zip(draw.num_new_tokens[s].tolist(), draw.num_context_tokens[s].tolist(), draw.is_prefill[s].tolist())):
            for tenant, name, rank in ((TENANT_LORA, ADAPTER, RANK), (TENANT_BASE, "", 0)):
                slices.append([f"{run_id}-{tenant}-{k}-{i}", tenant, p, c, f, 0, float(c)])
                names.append(name)
                ranks.append(rank)
        loaded = [ADAPTER] if rng.random() < 0.25 else []
        from_disk = loaded if rng.random() < 0.5 else []
        new = np.array([x[2] for x in slices], dtype=np.float64)
        lora = lora_slices(names, ranks, np.array([0, len(slices)]), [frozenset(loaded)], [frozenset(from_disk)], num_new_tokens=new)
        context = np.array([x[3] for x in slices], dtype=np.float64)
        prefill = np.array([x[4] for x in slices], dtype=bool)
        predicted_s = attribute_step_predicted(model, new, context, prefill, lora)
        steps.append([k, round(t0_s + 0.3 * k, 6), predicted_s, slices, None,
                      {"slice": {"lora_name": names, "lora_rank": ranks},
                       "step": {"step_loras": encode_adapters([ADAPTER]), "step_lora_loads": encode_adapters(loaded),
                                "step_lora_disk_loads": encode_adapters(from_disk)}}])
    return steps


def attribute_step_predicted(model, new, context, prefill, lora) -> float:
    return float(attribute_arrays(model, new, context, prefill, np.array([0, new.size]), None, lora=lora).predicted_step_s[0])


def model_says_ns(model, steps, run_id) -> dict[str, int]:
    """Each tenant's nanoseconds by the model's attribution of the steps, rounded as the ledger rounds."""
    trace = trace_from_rows([row for group in as_rows(steps, run_id, CLASS_L) for row in group])
    shares = attribute(model, trace).share_s
    measured_ns = np.rint(trace.step_latency_s_per_step * 1e9).astype(np.int64)
    out: dict[str, int] = defaultdict(int)
    for tenant, ns in zip(trace.tenant.tolist(), apportion_ns(shares, trace.step_offsets, measured_ns).tolist()):
        out[tenant] += ns
    return dict(out)


def adapter_terms_s(model, steps) -> float:
    """What the adapter adds to its tenant's bill over its twin's, from the model's coefficients alone: per twin pair
    its own adapter work; per step the adapter's kernels and loads (its tenant is the only one running it), the LoRA
    path's set-up, and of the path's kernels over the base tokens P (its twin's) the adapter tenant's P/(A+1) less
    the base tenant's P·A/(A+1), A the step's adapter requests (docs/attribution.md)."""
    coef = model.coef_[0]
    total = 0.0
    for step in steps:
        lora_slices_of_step = [x for x in step[3] if x[1] == TENANT_LORA]
        for _, _, p, _, is_prefill, _, _ in lora_slices_of_step:
            total += p * (coef[LoraCoef.L1] + RANK * coef[LoraCoef.L2]) if is_prefill else coef[LoraCoef.L3] + RANK * coef[LoraCoef.L4]
        n_adapter = len(lora_slices_of_step)
        base_tokens = sum(x[2] for x in step[3] if x[1] == TENANT_BASE)
        total += coef[LoraCoef.L8] + coef[LoraCoef.L9] * base_tokens * (1 - n_adapter) / (n_adapter + 1)
        total += coef[LoraCoef.L5]
        total += coef[LoraCoef.L6] * (step[5]["step"]["step_lora_loads"] != "[]")
        total += coef[LoraCoef.L7] * (step[5]["step"]["step_lora_disk_loads"] != "[]")
    return total


def fill_ledger(model_path, db_url, model) -> dict[str, list]:
    runs = {"twin-steps": twin_run("twin-steps", 120, t0_s=T0_S, seed=21, model=model),
            "twin-windows": twin_run("twin-windows", 120, t0_s=T0_S + 60, seed=22, model=model)}
    ledger = Ledger(db_url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    with TestClient(create_app(model_path, db_url)) as client:
        added = client.post("/v1/models", headers=bearer(admin),
                            json={"model": model.to_dict(), "engine_class": CLASS_L, "activate": True})
        assert added.status_code == 201, added.text
        posted = client.post("/v1/steps", headers=bearer(admin), json={"steps": as_rows(runs["twin-steps"], "twin-steps", CLASS_L)})
        assert posted.status_code == 200, posted.text
        agg = WindowAggregator("twin-windows", CLASS_L, lambda: (model, added.json()["version"]), window_s=1.0)
        windows = [w for step in runs["twin-windows"] for w in agg.add(*step)] + agg.close()
        posted = client.post("/v1/windows", headers=bearer(admin), json={"windows": [w.to_json() for w in windows]})
        assert posted.status_code == 200, posted.text
    prices = f'[[price]]\nengine_class = "{CLASS_L}"\ncurrency = "USD"\nengine_hour_price = "{PRICE}"\nvalid_from = {PERIOD_S[0]}\n'
    return runs, prices


def add_prices(db_url, tmp_path, prices: str) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(prices)
    added = invoke_cli("prices", "add", str(path), "--db", db_url)
    assert added.returncode == 0, added.stderr


def charged_both_ways(db: str) -> tuple[list, list]:
    """The period's usage charges unsplit and split by adapter."""
    ledger = Ledger(db)
    try:
        return (usage_charges(ledger, PERIOD_S[0] * 1_000_000, PERIOD_S[1] * 1_000_000),
                usage_charges(ledger, PERIOD_S[0] * 1_000_000, PERIOD_S[1] * 1_000_000, by_adapter=True))
    finally:
        ledger.close()


def per_tenant(rows: list[dict]) -> tuple[dict[str, int], dict[str, Decimal]]:
    ns: dict[str, int] = defaultdict(int)
    cost: dict[str, Decimal] = defaultdict(Decimal)
    for r in rows:
        ns[r["SubAccountId"]] += int(r["x_AttributedNs"])
        cost[r["SubAccountId"]] += Decimal(r["BilledCost"])
    return dict(ns), dict(cost)


def test_a_rank_64_tenant_is_billed_more_than_a_base_tenant_by_what_the_model_says(model_path, db_url, tmp_path):
    model = lora_model(CLASS_L)
    runs, prices = fill_ledger(model_path, db_url, model)
    add_prices(db_url, tmp_path, prices)
    focus = tmp_path / "focus.csv"
    export(db_url, "focus", PERIOD_S, focus)
    rows = read_csv(focus)
    assert {r["SubAccountId"] for r in rows} == {TENANT_LORA, TENANT_BASE} and "x_LoraAdapter" not in rows[0]
    billed_ns, billed = per_tenant(rows)
    # the twins' tokens are the same, tenant by tenant, in every phase
    tokens = defaultdict(lambda: defaultdict(int))
    for r in rows:
        for name in ("x_NewTokens", "x_UncachedPromptTokens", "x_OutputTokens"):
            tokens[r["SubAccountId"]][name] += int(r[name])
    assert tokens[TENANT_LORA] == tokens[TENANT_BASE] and tokens[TENANT_BASE]["x_NewTokens"] > 0
    # the exported nanoseconds are the model's attribution, tenant by tenant
    says: dict[str, int] = defaultdict(int)
    for run_id, steps in runs.items():
        for tenant, ns in model_says_ns(model, steps, run_id).items():
            says[tenant] += ns
    assert billed_ns == dict(says)
    difference_ns = billed_ns[TENANT_LORA] - billed_ns[TENANT_BASE]
    # ... and their difference is the adapter's terms, from the coefficients, to the ledger's rounding (< 1 ns a slice)
    expected_s = sum(adapter_terms_s(model, steps) for steps in runs.values())
    n_slices = sum(len(step[3]) for steps in runs.values() for step in steps)
    assert difference_ns > 0.01 * billed_ns[TENANT_BASE]
    assert abs(difference_ns - expected_s * 1e9) <= n_slices
    # the money: each tenant's engine-hours at the price, rounded once; the difference is the adapter's cost
    exact = {t: exact_cost(ns, PRICE) for t, ns in billed_ns.items()}
    assert billed == {t: cents(e) for t, e in exact.items()}
    assert billed[TENANT_LORA] - billed[TENANT_BASE] == cents(exact[TENANT_LORA]) - cents(exact[TENANT_BASE])
    assert abs(Fraction(billed[TENANT_LORA] - billed[TENANT_BASE]) - exact_cost(difference_ns, PRICE)) <= Fraction(1, 100)
    assert billed[TENANT_LORA] > billed[TENANT_BASE]
    if not VALIDATOR.exists():
        pytest.skip(NO_VALIDATOR)
    check = run_validator(focus)
    assert check.returncode == 0, check.stdout + check.stderr


def test_by_adapter_the_usage_rows_name_the_adapter_and_bill_the_same(model_path, tmp_path):
    db = f"sqlite:///{tmp_path}/ledger.db"
    model = lora_model(CLASS_L)
    runs, prices = fill_ledger(model_path, db, model)
    add_prices(db, tmp_path, prices)
    whole, split = charged_both_ways(db)
    assert {(c.tenant, c.lora_name) for c in split} == {(TENANT_LORA, ADAPTER), (TENANT_BASE, "")}
    assert {c.tenant: c.attributed_ns for c in split} == {c.tenant: c.attributed_ns for c in whole}
    # the base model's line keeps the unsplit line's id; the adapter's is its own
    ids = {c.tenant: c.idempotency_id for c in whole}
    assert {c.tenant: c.idempotency_id == ids[c.tenant] for c in split} == {TENANT_LORA: False, TENANT_BASE: True}
    focus = tmp_path / "by-adapter.csv"
    export(db, "focus", PERIOD_S, focus, "--by-adapter")
    rows = read_csv(focus)
    assert {(r["SubAccountId"], r["x_LoraAdapter"]) for r in rows} == {(TENANT_LORA, ADAPTER), (TENANT_BASE, "")}
    assert all(('"llmvisor/lora_adapter":' in r["Tags"]) for r in rows)
    assert per_tenant(rows)[0] == {c.tenant: c.attributed_ns for c in whole}
    if VALIDATOR.exists():
        check = run_validator(focus)
        assert check.returncode == 0, check.stdout + check.stderr
    # metering events name the adapter too, in every format, and carry the same engine-ns per tenant
    expected = {(TENANT_LORA, ADAPTER), (TENANT_BASE, "")}
    engine_ns = {c.tenant: c.attributed_ns for c in whole}
    for format_, adapter_of, tenant_of, ns_of in (
        ("lago", lambda e: e["properties"]["lora_adapter"], lambda e: e["external_subscription_id"],
         lambda e: e["properties"].get("engine_ns")),
        ("stripe", lambda e: e["payload"]["lora_adapter"], lambda e: e["payload"]["stripe_customer_id"],
         lambda e: int(e["payload"]["value"]) if e["event_name"] == "llmvisor_engine_ns" else None),
        ("cloudevents", lambda e: e["data"]["lora_adapter"], lambda e: e["subject"], lambda e: e["data"].get("engine_ns")),
    ):
        events = tmp_path / f"events-{format_}.json"
        export(db, format_, PERIOD_S, events, "--by-adapter")
        body = json.loads(events.read_text())
        assert {(tenant_of(e), adapter_of(e)) for e in body} == expected, format_
        summed: dict[str, int] = defaultdict(int)
        for e in body:
            ns = ns_of(e)
            if ns is not None:
                summed[tenant_of(e)] += int(ns)
        assert dict(summed) == engine_ns, format_
    if not VALIDATOR.exists():
        pytest.skip(NO_VALIDATOR + "; every other check passed")


def test_a_base_model_only_ledger_exports_the_same_lines_with_or_without_by_adapter(model_path, tmp_path):
    db = f"sqlite:///{tmp_path}/ledger.db"
    steps = relayed_lora_run("base-run", 80, t0_s=T0_S, seed=5, lora_ranks=None)
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    with TestClient(create_app(model_path, db)) as client:
        rows = as_rows(steps, "base-run", None)
        assert client.post("/v1/steps", headers=bearer(admin), json={"steps": rows}).status_code == 200
    whole, split = charged_both_ways(db)
    assert whole and [(c.idempotency_id, c.attributed_ns, c.lora_name) for c in whole] == [
        (c.idempotency_id, c.attributed_ns, None) for c in split]
    assert {c.lora_name for c in split} == {""}


@pytest.fixture(autouse=True)
def _no_close(monkeypatch):
    """The period is long past: an export would close it first; these tests are about lines, not closing."""
    monkeypatch.setenv("LLMVISOR_CLOSE_PERIOD_AFTER_S", "off")
