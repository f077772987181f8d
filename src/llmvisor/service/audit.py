"""Audit a tenant's bill against the raw-step archive: re-attribute the period's archived steps with the model
versions the ledger says billed them, and compare with what the ledger billed.

The service bills each step by splitting its measured nanoseconds (``rint(step_latency_s · 1e9)``) among its
slices with one model version (`llmvisor.service.ingest.prepare_batch`); the same steps, the same version and the
same integer apportionment give the same nanoseconds, so the audit expects equality to the nanosecond:

- ``reattributed_ns`` (the archive's steps that the ledger billed, re-attributed) = ``usage_ns`` (the tenant's
  per-second usage, what bills are made of) = ``billed_steps_ns`` (Σ of the tenant's slices as stored per step);
- no step the ledger billed to the tenant is missing from the archive, and no step's share differs.

Adjustments (`llmvisor.service.adjust`) correct a period without rewriting it: those inside the audited period are
summed into ``adjusted_ns`` and the net bill (usage + adjustments) is reported beside the check; an adjustment
whose period only partly overlaps the audited one is counted (``partial_adjustments``), not split. Each adjusted
(class, period) inside is checked too: its newest entry's ``reattributed_ns`` (what usage plus all its
adjustments now bill the tenant) must equal the archive's steps of that class and period re-attributed with that
entry's version (``adjustment_mismatches`` lists those that do not). Archived steps
the ledger has not billed (pending, or not ingested yet) are counted as ``unbilled_steps``, not a mismatch.

KV memory-time (trace format 3, ledger schema 9) needs no model: the tenant's ``kv_block_ns`` of the archived steps the
ledger billed one by one are summed, and so are their block-ns × ``kv_block_bytes`` (byte-ns); both must equal the
ledger's (``kv_block_ns_ledger``, ``kv_byte_ns_ledger``: the tenant's usage rows of the period) exactly. Window
aggregates do not carry memory yet, so steps billed in windows are left out of the archive's sum. An archive whose
period holds no KV columns (format 1 or 2, or files of several versions read together: time only) leaves
``kv_checked`` false.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from llmvisor.archive.reader import read_archive
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import SHARING_COLUMNS, StepTrace
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.adjust import version_names
from llmvisor.service.archived import as_billed, match_windows, priced_with_sharing
from llmvisor.service.ingest import ModelChoice, prepare_batch, step_fingerprint_ids
from llmvisor.service.registry import load_version

MAX_LISTED_STEPS = 20


class AuditError(LlmvisorError):
    """An audit that cannot run as asked (no archived steps of the tenant in the period)."""


@dataclass
class AuditResult:
    """What the audit found; ``ok`` when the archive's re-attribution equals the ledger's bill exactly."""

    tenant: str
    start_us: int
    end_us: int
    archive_steps: int
    audited_steps: int
    unbilled_steps: int
    missing_steps: int
    reattributed_ns: int
    billed_steps_ns: int
    usage_ns: int
    adjusted_ns: int
    partial_adjustments: int
    versions: dict[str, int]
    mismatched_steps: list[dict] = field(default_factory=list)
    num_mismatched_steps: int = 0
    adjustments_checked: int = 0
    adjustment_mismatches: list[dict] = field(default_factory=list)
    window_steps: int = 0
    """Archived steps the ledger billed in window aggregates (the edge attributed them)."""
    windows_checked: int = 0
    """Windows holding the tenant's archived steps."""
    billed_windows_ns: int = 0
    """Σ of the tenant's attributed time metered in windows in the period, as the ledger stored it (per second)."""
    mismatched_windows: list[dict] = field(default_factory=list)
    num_mismatched_windows: int = 0
    kv_checked: bool = False
    """Whether the archive's steps carry the KV memory columns, so memory was checked (module note)."""
    kv_block_ns_archive: int | None = None
    kv_block_ns_ledger: int | None = None
    kv_byte_ns_archive: int | None = None
    kv_byte_ns_ledger: int | None = None
    requests: list[dict] = field(default_factory=list)
    """With ``requests=N``: the tenant's N largest requests of the period, re-attributed as billed (run_id, request_id,
    attributed_ns, num_steps): a request's usage where the ledger keeps no row per request (``LLMVISOR_REQUEST_TOTALS=0``)."""

    @property
    def ok(self) -> bool:
        return (self.reattributed_ns == self.usage_ns == self.billed_steps_ns + self.billed_windows_ns and self.missing_steps == 0
                and self.num_mismatched_steps == 0 and self.num_mismatched_windows == 0 and not self.adjustment_mismatches
                and self.kv_ok)

    @property
    def kv_ok(self) -> bool:
        """Memory ties (or there is none to check): the archive's block-ns and byte-ns equal the ledger's."""
        return not self.kv_checked or ((self.kv_block_ns_archive or 0) == (self.kv_block_ns_ledger or 0)
                                       and (self.kv_byte_ns_archive or 0) == (self.kv_byte_ns_ledger or 0))

    @property
    def net_billed_ns(self) -> int:
        return self.usage_ns + self.adjusted_ns

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok, "net_billed_ns": self.net_billed_ns,
                "difference_ns": self.reattributed_ns - self.usage_ns}


def audit_tenant(ledger: Ledger, archive_url: str, tenant: str, start_us: int, end_us: int,
                 default_model: StepLatencyModel, *, requests: int = 0) -> AuditResult:
    """Re-attribute ``tenant``'s archived steps starting in [start_us, end_us) and check them against ``ledger``
    (module docstring). ``default_model``: the service's ``--model``, for steps it billed (version 'default');
    ``requests``: list the tenant's largest requests of the period as re-attributed."""
    if end_us <= start_us:
        raise AuditError(f"the period must end after it starts (start {start_us / 1e6:.0f}, end {end_us / 1e6:.0f})")
    trace = read_archive(archive_url, start_us, end_us, tenant=tenant)
    if trace.n_steps == 0:
        raise AuditError(f"archive {archive_url}: no steps of tenant {tenant!r} start in [{start_us / 1e6:.0f}, {end_us / 1e6:.0f})")
    keys = list(zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist()))
    classes = step_fingerprint_ids(trace)
    version = np.full(trace.n_steps, -2, dtype=np.int64)  # -2: not billed by the ledger
    shared_stored = np.zeros(trace.n_steps, dtype=bool)
    billed_ns: dict[tuple[str, int], int] = {}
    for engine_class in dict.fromkeys(classes.tolist()):
        stored = ledger.billed_steps(engine_class, start_us, end_us)
        by_key = dict(zip(stored.keys, [] if stored.model_version is None else stored.model_version.tolist()))  # None: no steps
        slices = stored.slices
        has_sharing = slices.num_rows and all(name in slices.column_names for name in SHARING_COLUMNS)
        shared_keys = set()
        if slices.num_rows:
            runs, steps = slices["run_id"].to_pylist(), slices["step_id"].to_pylist()
            tenants, shares = slices["tenant"].to_pylist(), slices["attributed_ns"].to_pylist()
            sharing = slices["num_shared_context_tokens"].to_pylist() if has_sharing else [None] * len(runs)
            for run, step, owner, share, shared in zip(runs, steps, tenants, shares, sharing):
                if owner == tenant:
                    billed_ns[(run, step)] = billed_ns.get((run, step), 0) + int(share)
                if shared is not None:
                    shared_keys.add((run, step))
        for k in np.flatnonzero(classes == engine_class).tolist():
            version[k] = by_key.get(keys[k], -2)
            shared_stored[k] = keys[k] in shared_keys
    when_us = np.rint(trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) * 1e6)
    window_rows = ledger.run_windows(trace.run_id_per_step.tolist(), start_us, end_us)
    window_of = match_windows(trace, keys, classes, when_us, version, window_rows)
    in_window = window_of >= 0
    version[in_window] = [window_rows[i].model_version for i in window_of[in_window].tolist()]
    shared_stored[in_window] = priced_with_sharing(trace)[in_window]
    reattributed: dict[tuple[str, int], int] = {}
    per_request: dict[tuple[str, str], list[int]] = {}
    versions: dict[str, int] = {}
    groups = {(c, int(v), bool(s)) for c, v, s in zip(classes.tolist(), version.tolist(), shared_stored.tolist()) if v != -2}
    for engine_class, v, with_sharing in sorted(groups):
        mask = (classes == engine_class) & (version == v) & (shared_stored == with_sharing)
        part = as_billed(trace.select_steps(mask), with_sharing)
        model = default_model if v < 0 else load_version(ledger, engine_class, v)
        records = prepare_batch(model, part, received_at_us=0, choose=lambda _c, m=model, v=v: ModelChoice(m, None if v < 0 else v)).records
        _add_tenant_shares(reattributed, part, records.attributed_ns, tenant)
        if requests:
            _add_request_shares(per_request, part, records.attributed_ns, tenant)
        label = f"{engine_class or '(no fingerprint)'} {version_names(np.array([v]))}"
        versions[label] = versions.get(label, 0) + int(mask.sum())
    archived = set(keys)
    missing = [key for key in billed_ns if key not in archived]
    window_keys = {keys[k]: int(window_of[k]) for k in np.flatnonzero(in_window).tolist()}
    mismatched = [
        {"run_id": run, "step_id": step, "billed_ns": billed_ns.get((run, step), 0), "reattributed_ns": ns}
        for (run, step), ns in sorted(reattributed.items()) if (run, step) not in window_keys and billed_ns.get((run, step), 0) != ns
    ]
    # The ledger keeps window usage per tenant, class, version and second of window start (schema 7), so the
    # archive's re-attribution is compared per that key.
    per_second: dict[tuple[int, str, int], int] = {}
    for key, i in window_keys.items():
        row = window_rows[i]
        second_key = (row.window_start_us // 1_000_000 * 1_000_000, row.engine_class, row.model_version)
        per_second[second_key] = per_second.get(second_key, 0) + reattributed.get(key, 0)
    billed_seconds = ledger.tenant_window_seconds(tenant, start_us, end_us)
    mismatched_windows = [
        {"second_us": second_us, "engine_class": engine_class, "model_version": v,
         "billed_ns": billed_seconds.get((second_us, engine_class, v), 0), "reattributed_ns": per_second.get((second_us, engine_class, v), 0)}
        for second_us, engine_class, v in sorted(set(per_second) | set(billed_seconds))
        if billed_seconds.get((second_us, engine_class, v), 0) != per_second.get((second_us, engine_class, v), 0)
    ]
    usage = ledger.tenant_usage(start_us, end_us, tenant=tenant)
    kv_archive = _archived_kv(trace, tenant, (version != -2) & ~in_window)
    adjusted_ns, partial = 0, 0
    newest: dict[tuple[str, int, int], object] = {}
    for row in ledger.adjustment_rows(tenant=tenant):
        if start_us <= row.period_start_us and row.period_end_us <= end_us:
            adjusted_ns += row.delta_ns
            key = (row.engine_class, row.period_start_us, row.period_end_us)
            if key not in newest or (row.created_at_us, row.to_version) >= (newest[key].created_at_us, newest[key].to_version):
                newest[key] = row
        elif row.period_start_us < end_us and start_us < row.period_end_us:
            partial += 1
    adjustment_mismatches = []
    for (engine_class, period_start_us, period_end_us), row in sorted(newest.items()):
        in_period = (classes == engine_class) & (when_us >= period_start_us) & (when_us < period_end_us) & (version != -2)
        model = load_version(ledger, engine_class, row.to_version)
        ns: dict[tuple[str, int], int] = {}
        for with_sharing in (False, True):
            mask = in_period & (shared_stored == with_sharing)
            if mask.any():
                part = as_billed(trace.select_steps(mask), with_sharing)
                records = prepare_batch(model, part, received_at_us=0, choose=lambda _c, m=model, v=row.to_version: ModelChoice(m, v)).records
                _add_tenant_shares(ns, part, records.attributed_ns, tenant)
        if sum(ns.values()) != row.reattributed_ns:
            adjustment_mismatches.append({"engine_class": engine_class, "period_start_us": period_start_us,
                                          "period_end_us": period_end_us, "to_version": row.to_version,
                                          "adjusted_to_ns": row.reattributed_ns, "reattributed_ns": sum(ns.values())})
    return AuditResult(
        tenant=tenant, start_us=start_us, end_us=end_us, archive_steps=trace.n_steps, audited_steps=len(reattributed),
        unbilled_steps=int((version == -2).sum()), missing_steps=len(missing),
        reattributed_ns=sum(reattributed.values()), billed_steps_ns=sum(billed_ns.values()),
        usage_ns=sum(row.attributed_ns for row in usage), adjusted_ns=adjusted_ns, partial_adjustments=partial,
        versions=versions, mismatched_steps=mismatched[:MAX_LISTED_STEPS], num_mismatched_steps=len(mismatched),
        adjustments_checked=len(newest), adjustment_mismatches=adjustment_mismatches,
        window_steps=int(in_window.sum()), windows_checked=len(set(window_keys.values())),
        billed_windows_ns=sum(billed_seconds.values()),
        kv_checked=kv_archive is not None,
        kv_block_ns_archive=None if kv_archive is None else kv_archive[0],
        kv_byte_ns_archive=None if kv_archive is None else kv_archive[1],
        kv_block_ns_ledger=_known_sum(row.kv_block_ns for row in usage),
        kv_byte_ns_ledger=_known_sum(row.kv_byte_ns for row in usage),
        mismatched_windows=mismatched_windows[:MAX_LISTED_STEPS], num_mismatched_windows=len(mismatched_windows),
        requests=[{"run_id": run, "request_id": request, "attributed_ns": ns, "num_steps": n}
                  for (run, request), (ns, n) in sorted(per_request.items(), key=lambda kv: (-kv[1][0], kv[0]))[:requests]],
    )


def _known_sum(values) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _archived_kv(trace: StepTrace, tenant: str, billed_steps: np.ndarray) -> tuple[int, int] | None:
    """The tenant's KV block-ns and byte-ns over the archived steps in ``billed_steps`` (exact Python integers), None
    where the archive has no KV columns."""
    if not all(name in trace.extra for name in ("kv_block_ns", "kv_block_bytes")):
        return None
    mine = (trace.tenant == tenant) & billed_steps[trace.slice_step_index]
    block_ns = np.asarray(trace.extra["kv_block_ns"], dtype=np.int64)[mine].tolist()
    block_bytes = np.asarray(trace.extra["kv_block_bytes"], dtype=np.int64)[mine].tolist()
    return sum(block_ns), sum(ns * b for ns, b in zip(block_ns, block_bytes))


def _add_request_shares(out: dict, part: StepTrace, attributed_ns: np.ndarray, tenant: str) -> None:
    """Per (run, request) of the tenant: attributed nanoseconds and steps (a request has one slice per step)."""
    mine = np.flatnonzero(part.tenant == tenant)
    runs = part.run_id_per_step[part.slice_step_index[mine]].tolist()
    for run, request, ns in zip(runs, part.request_id[mine].tolist(), attributed_ns[mine].tolist()):
        have = out.setdefault((run, request), [0, 0])
        have[0] += int(ns)
        have[1] += 1


def _add_tenant_shares(out: dict, part: StepTrace, attributed_ns: np.ndarray, tenant: str) -> None:
    """Per step key, the tenant's attributed nanoseconds (steps where it ran nothing are not in the archive read)."""
    mine = part.tenant == tenant
    step_of_slice = part.slice_step_index
    sums = np.zeros(part.n_steps, dtype=np.int64)
    np.add.at(sums, step_of_slice[mine], attributed_ns[mine])
    for run, step, ns in zip(part.run_id_per_step.tolist(), part.step_id_per_step.tolist(), sums.tolist()):
        out[(run, step)] = out.get((run, step), 0) + int(ns)
