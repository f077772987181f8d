"""LoRA adapters in window mode (issue #38 item 6): the edge's windows attribute with the steps' LoRA columns exactly
as per-step ingest does (one call, `attribute_arrays` with ``lora=``), so each tenant's nanoseconds are the same either
way; a window where a request ran an adapter is format 3 and carries each request's adapter; a window of base-model
steps is byte for byte what it was, whether or not its steps carry (empty) LoRA columns; the pusher sends the LoRA
columns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _lora_runs import RANKS, adapter_of_slices, as_rows, header_of, lora_model, relayed_lora_run, without_adapters
from llmvisor.client.push import columns_body
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import trace_from_rows
from llmvisor.metering import WindowAggregator
from llmvisor.metering.windows import WindowAggregate, WindowError
from llmvisor.service.ingest import prepare_batch

CLASS_L = "1a1a1a1a1a1a1a1a"
T0_S = 1_750_000_000.0


def per_step_tenants(model, steps, run_id) -> dict[str, int]:
    rows = [row for group in as_rows(steps, run_id, CLASS_L) for row in group]
    records = prepare_batch(model, trace_from_rows(rows), received_at_us=0).records
    out: dict[str, int] = {}
    for tenant, ns in zip(records.tenant.tolist(), records.attributed_ns.tolist()):
        out[tenant] = out.get(tenant, 0) + ns
    return out


def windows_of(model, steps, run_id, *, window_s: float = 1.0) -> list[WindowAggregate]:
    agg = WindowAggregator(run_id, CLASS_L, lambda: (model, 1), window_s=window_s)
    out = []
    for step in steps:
        out += agg.add(step[0], step[1], step[2], step[3], step[4] if len(step) > 4 else None, step[5] if len(step) > 5 else None)
    return out + agg.close()


def window_tenants(windows) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in windows:
        for tenant, t in w.tenant_totals().items():
            out[tenant] = out.get(tenant, 0) + t["attributed_ns"]
    return out


def test_windows_bill_adapters_exactly_as_per_step_ingest():
    model = lora_model(CLASS_L)
    steps = relayed_lora_run("run-l", 120, t0_s=T0_S, seed=4)
    windows = windows_of(model, steps, "run-l")
    assert window_tenants(windows) == per_step_tenants(model, steps, "run-l")
    # the adapters matter: the same steps without their LoRA columns bill otherwise, both ways alike
    blind = windows_of(model, without_adapters(steps), "run-l")
    assert window_tenants(blind) == per_step_tenants(model, without_adapters(steps), "run-l") != window_tenants(windows)
    assert {w.format for w in blind} == {1}
    # every window ran some adapter here: format 3, each request with its own adapter, read back as written
    assert {w.format for w in windows} == {3}
    adapters = adapter_of_slices(steps)
    assert {q.request_id: q.lora_name for w in windows for q in w.requests} == adapters
    assert set(adapters.values()) == {"", *RANKS}
    for w in windows:
        back = WindowAggregate.from_json(json.loads(w.canonical_bytes()))
        assert back == w and back.content_sha256() == w.content_sha256()


def test_a_window_of_base_model_steps_is_what_it_was_with_or_without_lora_columns():
    """A LoRA-enabled engine serving only the base model relays empty adapter columns: its windows are format 1, byte
    for byte those of an engine without LoRA (the same digest), and priced the same."""
    model = lora_model(CLASS_L)
    steps = relayed_lora_run("run-b", 60, t0_s=T0_S, seed=2)
    base_only = []
    for step in steps:
        n = len(step[3])
        base_only.append([*step[:4], None, {"slice": {"lora_name": [""] * n, "lora_rank": [0] * n},
                                            "step": {"step_loras": "[]", "step_lora_loads": "[]", "step_lora_disk_loads": "[]"}}])
    with_columns = windows_of(model, base_only, "run-b")
    plain = windows_of(model, without_adapters(steps), "run-b")
    assert [w.canonical_bytes() for w in with_columns] == [w.canonical_bytes() for w in plain]
    assert {w.format for w in plain} == {1} and all("lora_name" not in q for w in plain for q in w.to_json()["requests"])


def test_format_3_windows_are_checked_and_other_formats_refuse_an_adapter():
    model = lora_model(CLASS_L)
    window = windows_of(model, relayed_lora_run("run-c", 10, t0_s=T0_S, seed=1), "run-c", window_s=60.0)[0]
    data = window.to_json()
    missing = json.loads(json.dumps(data))
    del missing["requests"][0]["lora_name"]
    with pytest.raises(WindowError, match=r"requests\[0\]\.lora_name: missing"):
        WindowAggregate.from_json(missing)
    older = json.loads(json.dumps(data))
    older["format"] = 1
    with pytest.raises(WindowError, match=r"requests\[0\]: unknown field 'lora_name'|requests\[0\].*lora_name"):
        WindowAggregate.from_json(older)


def test_an_unattributed_window_hands_back_its_steps_with_their_lora_columns():
    steps = relayed_lora_run("run-u", 6, t0_s=T0_S, seed=3)
    agg = WindowAggregator("run-u", CLASS_L, lambda: None, window_s=60.0, unattributed_steps=True)
    for step in steps:
        agg.add(*step)
    (window,) = agg.close()
    assert window.steps == [[s[0], s[1], s[2], s[3], None, s[5]] for s in steps]


def test_the_pusher_sends_the_lora_columns():
    steps = relayed_lora_run("run-p", 5, t0_s=T0_S, seed=5)
    header = header_of("run-p", CLASS_L)
    body = json.loads(columns_body([step_rows(header, step) for step in steps]))["columns"]
    expected = [name for step in steps for name in step[5]["slice"]["lora_name"]]
    assert body["lora_name"] == expected and len(body["step_lora_loads"]) == len(expected)
    assert np.sum(body["lora_rank"]) == sum(r for step in steps for r in step[5]["slice"]["lora_rank"])


def test_the_archive_keeps_the_adapters_so_an_audit_prices_them_as_ingest_did(tmp_path):
    from llmvisor.archive import ArchiveWriter, read_archive

    model = lora_model(CLASS_L)
    steps = relayed_lora_run("run-a", 50, t0_s=T0_S, seed=11)
    header = header_of("run-a", CLASS_L)
    writer = ArchiveWriter(str(tmp_path), window_s=5.0, metadata={"engine_fingerprint": {"id": CLASS_L}})
    for step in steps:
        writer.add_relayed(header, step)
    assert writer.close()
    archived = read_archive(str(tmp_path))
    assert archived.extra["lora_name"].tolist() == [n for step in steps for n in step[5]["slice"]["lora_name"]]
    records = prepare_batch(model, archived, received_at_us=0).records
    got: dict[str, int] = {}
    for tenant, ns in zip(records.tenant.tolist(), records.attributed_ns.tolist()):
        got[tenant] = got.get(tenant, 0) + ns
    assert got == per_step_tenants(model, steps, "run-a") != per_step_tenants(model, without_adapters(steps), "run-a")
