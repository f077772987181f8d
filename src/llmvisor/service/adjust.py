"""Adjustments: correct a past period's bills when a later model of its engine class prices it better.

Bills are never rewritten (a tenant may have paid them; an invoice system has exported them). As billing systems
correct invoices, a correction is a new entry: for one engine class and one period (steps starting in
[start, end), whole seconds), every billed step is attributed again with a registry model version (by default
the class's active one, e.g. what `llmvisor refit` just activated), its measured nanoseconds split by the same
integer apportionment the service bills with, and each tenant gets one entry

    delta_ns = re-attributed_ns − billed_ns,   billed_ns = the period's usage as stored + earlier adjustments of it,

naming the versions that billed the steps and the one that re-attributed them. Both splits sum to the steps'
measured time to the nanosecond, so the deltas of one adjustment sum to exactly 0: time moves between tenants,
none is created or lost, and usage plus adjustments still reconciles with the measured total.

A period can be adjusted again to a newer version (the new entries correct what the earlier ones left); periods
of one class that partly overlap are refused, so what each entry corrects stays defined.

Window mode (engines attribute at the edge and send window aggregates, `llmvisor.metering`): the ledger keeps no
step rows, only each window's facts and its usage per tenant, class, version and second of window start. The
steps are in the raw-step archive (`llmvisor.archive`), so the period's windows are re-attributed from it: billed
are the class's attributed windows whose start is in [start, end) (``Ledger.class_window_usage``), re-attributed
are the archived steps of those windows (matched as the audit matches them, `llmvisor.service.archived`). A window
that a period bound cuts (it starts before a bound and ends after it) is refused, so "windows starting in the
period" and "steps starting in the period" are the same steps and the audit checks the entries as it checks
step-mode ones. The archive must hold every billed window's steps (their number and measured time equal the
window's) and the windows it holds must sum to what the ledger billed the period; otherwise nothing is written,
never an adjustment of part of the period.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmvisor.archive.reader import read_archive
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import AdjustmentRow, Ledger
from llmvisor.ledger.connection import now_us
from llmvisor.service.archived import as_billed, match_windows, priced_with_sharing
from llmvisor.service.ingest import ModelChoice, attribute_stored, prepare_batch, step_fingerprint_ids
from llmvisor.service.registry import load_version


class AdjustmentError(LlmvisorError):
    """An adjustment that cannot be made as asked (no such version, no billed steps, overlapping periods)."""


@dataclass(frozen=True)
class AdjustmentResult:
    """What one adjustment found and (unless a dry run) wrote."""

    engine_class: str
    start_us: int
    end_us: int
    to_version: int
    from_versions: str
    num_steps: int
    measured_ns: int
    entries: list[AdjustmentRow]
    written: bool
    window_steps: int = 0
    """Of ``num_steps``, those billed in window aggregates (re-attributed from the archive)."""
    num_windows: int = 0
    """The window aggregates those steps were billed in."""

    @property
    def total_delta_ns(self) -> int:
        """Σ delta_ns over tenants: 0 by construction (checked before writing)."""
        return sum(entry.delta_ns for entry in self.entries)

    def to_dict(self) -> dict:
        return {
            "engine_class": self.engine_class,
            "start_us": self.start_us,
            "end_us": self.end_us,
            "to_version": self.to_version,
            "from_versions": self.from_versions,
            "num_steps": self.num_steps,
            "measured_ns": self.measured_ns,
            "window_steps": self.window_steps,
            "num_windows": self.num_windows,
            "written": self.written,
            "total_delta_ns": self.total_delta_ns,
            "tenants": [
                {"tenant": e.tenant, "billed_ns": e.billed_ns, "reattributed_ns": e.reattributed_ns, "delta_ns": e.delta_ns,
                 "num_steps": e.num_steps}
                for e in self.entries
            ],
        }


def version_names(versions: np.ndarray) -> str:
    """``'default,2'``: the distinct versions that billed some steps, the service's default model as 'default'."""
    return ",".join("default" if v < 0 else str(v) for v in sorted(set(versions.tolist())))


def _tenant_sums(tenants: np.ndarray, values: np.ndarray) -> dict[str, int]:
    names, codes = np.unique(tenants.astype(str), return_inverse=True)
    sums = np.zeros(names.size, dtype=np.int64)
    np.add.at(sums, codes, values.astype(np.int64))
    return dict(zip(names.tolist(), (int(v) for v in sums)))


def _step_counts(run_id: np.ndarray, step_id: np.ndarray, tenants: np.ndarray) -> dict[str, int]:
    """Per tenant, the number of distinct steps it ran in."""
    seen = {(t, r, s) for t, r, s in zip(tenants.astype(str).tolist(), run_id.astype(str).tolist(), step_id.tolist())}
    counts: dict[str, int] = {}
    for tenant, _r, _s in seen:
        counts[tenant] = counts.get(tenant, 0) + 1
    return counts


def _add(out: dict[str, int], more: dict[str, int]) -> None:
    for key, value in more.items():
        out[key] = out.get(key, 0) + value


@dataclass
class _Part:
    """One source of a period's bills: its steps stored one by one, or its windows re-attributed from the archive."""

    billed_ns: dict[str, int]
    new_ns: dict[str, int]
    counts: dict[str, int]
    measured_ns: int
    num_steps: int
    versions: list[int]
    num_windows: int = 0


def _stored_part(ledger: Ledger, engine_class: str, start_us: int, end_us: int, model: StepLatencyModel,
                 to_version: int) -> tuple[_Part | None, set[tuple[str, int]]]:
    """The steps billed one by one (step mode): billed as stored, re-attributed from the ledger's own slices; and
    their keys (so the archive's copies of them are not looked for in windows)."""
    stored = ledger.billed_steps(engine_class, start_us, end_us)
    if not stored.keys:
        return None, set()
    billed = stored.slices
    prepared = attribute_stored(model, to_version, stored, engine_class).records
    billed_ns = _tenant_sums(billed["tenant"].to_numpy(zero_copy_only=False), billed["attributed_ns"].to_numpy())
    counts = _step_counts(billed["run_id"].to_numpy(zero_copy_only=False), billed["step_id"].to_numpy(),
                          billed["tenant"].to_numpy(zero_copy_only=False))
    part = _Part(billed_ns, _tenant_sums(prepared.tenant, prepared.attributed_ns), counts, int(prepared.measured_ns.sum()),
                 len(stored.keys), stored.model_version.tolist())
    return part, set(stored.keys)


def _window_part(ledger: Ledger, archive_url: str, engine_class: str, start_us: int, end_us: int, model: StepLatencyModel,
                 to_version: int, billed: dict[tuple[str, int], int], per_step_keys: set[tuple[str, int]]) -> _Part:
    """The windows billed in the period (window mode, module docstring), re-attributed from the archive's steps;
    refused whole where a bound cuts a window or the archive lacks steps the windows billed."""
    where = f"engine class {engine_class!r} [{start_us / 1e6:.0f}, {end_us / 1e6:.0f})"
    billed_total = sum(billed.values())
    trace = read_archive(archive_url, start_us, end_us)
    if trace.n_steps:
        trace = trace.select_steps(step_fingerprint_ids(trace) == engine_class)
    classes = step_fingerprint_ids(trace)
    runs = sorted(set(trace.run_id_per_step.tolist()))
    for bound_us, name in ((start_us, "start"), (end_us, "end")):
        cut = [w for w in ledger.windows_crossing(runs, bound_us) if w.engine_class == engine_class and not w.pending]
        if cut:
            w = cut[0]
            raise AdjustmentError(
                f"{where}: the period's {name} cuts {len(cut)} window(s) (first: run {w.run_id!r} [{w.window_start_us / 1e6:.3f}, "
                f"{w.window_end_us / 1e6:.3f})), billed whole in the period they start in; choose bounds on window edges; "
                "nothing was written"
            )
    rows = [w for w in ledger.run_windows(runs, start_us, end_us) if w.engine_class == engine_class and not w.pending]
    keys = list(zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist()))
    window_of = np.full(trace.n_steps, -1, dtype=np.int64)
    if trace.n_steps:
        version = np.asarray([-1 if key in per_step_keys else -2 for key in keys], dtype=np.int64)  # -2: find its window
        when_us = np.rint(trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) * 1e6)
        window_of = match_windows(trace, keys, classes, when_us, version, rows)
    in_window = window_of >= 0
    measured_ns = np.rint(trace.step_latency_s_per_step * 1e9).astype(np.int64)
    steps_in = np.bincount(window_of[in_window], minlength=len(rows))
    ns_in = np.zeros(len(rows), dtype=np.int64)
    np.add.at(ns_in, window_of[in_window], measured_ns[in_window])
    short = [i for i, w in enumerate(rows) if (int(steps_in[i]), int(ns_in[i])) != (w.num_steps, w.measured_ns)]
    archived_ns = int(ns_in.sum())
    if short or archived_ns != billed_total:
        first = ""
        if short:
            w = rows[short[0]]
            first = f" (first: run {w.run_id!r} window at {w.window_start_us / 1e6:.3f}, {int(steps_in[short[0]])} of {w.num_steps} steps)"
        raise AdjustmentError(
            f"{where}: archive {archive_url} does not hold the whole period: {archived_ns} of the {billed_total} ns billed in "
            f"windows are archived, {len(short)} of the {len(rows)} windows of its runs incomplete{first}; nothing was written"
        )
    new_ns: dict[str, int] = {}
    counts: dict[str, int] = {}
    sharing = priced_with_sharing(trace)
    for with_sharing in (False, True):  # priced with the sharing columns where the edge priced with them
        mask = in_window & (sharing == with_sharing)
        if not mask.any():
            continue
        part = as_billed(trace.select_steps(mask), with_sharing)
        records = prepare_batch(model, part, received_at_us=0, choose=lambda _c: ModelChoice(model, to_version)).records
        _add(new_ns, _tenant_sums(records.tenant, records.attributed_ns))
        sizes = np.diff(records.step_offsets)
        _add(counts, _step_counts(np.repeat(records.run_id, sizes), np.repeat(records.step_id, sizes), records.tenant))
    billed_ns: dict[str, int] = {}
    for (tenant, _version), ns in billed.items():
        billed_ns[tenant] = billed_ns.get(tenant, 0) + ns
    return _Part(billed_ns, new_ns, counts, archived_ns, int(in_window.sum()), sorted({v for _t, v in billed}), len(rows))


def adjust_period(
    ledger: Ledger, engine_class: str, start_us: int, end_us: int, *, to_version: int | None = None, dry_run: bool = False,
    archive_url: str | None = None,
) -> AdjustmentResult:
    """Re-attribute one class's billed steps in [start_us, end_us) with ``to_version`` (default: the active one)
    and write one adjustment entry per tenant (module docstring); ``dry_run`` computes without writing.
    ``archive_url``: the raw-step archive, needed where the period was billed in window aggregates."""
    if end_us <= start_us:
        raise AdjustmentError(f"the period must end after it starts (start {start_us / 1e6:.0f}, end {end_us / 1e6:.0f})")
    if to_version is None:
        to_version = ledger.active_versions().get(engine_class)
        if to_version is None:
            raise AdjustmentError(f"engine class {engine_class!r} has no active model version; name one with --to-version")
    model = load_version(ledger, engine_class, to_version)
    earlier = [row for row in ledger.adjustment_rows(engine_class=engine_class)
               if row.period_start_us < end_us and start_us < row.period_end_us]
    partial = [row for row in earlier if (row.period_start_us, row.period_end_us) != (start_us, end_us)]
    if partial:
        row = partial[0]
        raise AdjustmentError(
            f"engine class {engine_class!r}: the period overlaps one adjusted before ([{row.period_start_us / 1e6:.0f}, "
            f"{row.period_end_us / 1e6:.0f}) to version {row.to_version}); adjust that same period or one apart from it"
        )
    if any(row.to_version == to_version for row in earlier):
        raise AdjustmentError(f"engine class {engine_class!r}: this period is already adjusted to model version {to_version}")
    stored, per_step_keys = _stored_part(ledger, engine_class, start_us, end_us, model, to_version)
    window_billed = ledger.class_window_usage(engine_class, start_us, end_us)
    if stored is None and not window_billed:
        raise AdjustmentError(f"engine class {engine_class!r} has no billed steps starting in the period")
    parts = [] if stored is None else [stored]
    if window_billed:
        if archive_url is None:
            raise AdjustmentError(
                f"engine class {engine_class!r}: the period was billed in window aggregates (window mode), whose steps only "
                "the raw-step archive holds: give --archive URL"
            )
        parts.append(_window_part(ledger, archive_url, engine_class, start_us, end_us, model, to_version, window_billed, per_step_keys))
    billed_ns: dict[str, int] = {}
    new_ns: dict[str, int] = {}
    counts: dict[str, int] = {}
    for part in parts:
        _add(billed_ns, part.billed_ns)
        _add(new_ns, part.new_ns)
        _add(counts, part.counts)
    measured_ns = sum(part.measured_ns for part in parts)
    if sum(billed_ns.values()) != measured_ns or sum(new_ns.values()) != measured_ns:
        raise AdjustmentError(  # a ledger whose bills do not reconcile: never paper over it with an adjustment
            f"engine class {engine_class!r}: billed {sum(billed_ns.values())} ns and re-attributed {sum(new_ns.values())} ns "
            f"do not both equal the measured {measured_ns} ns; nothing was written"
        )
    for row in earlier:
        billed_ns[row.tenant] = billed_ns.get(row.tenant, 0) + row.delta_ns
    from_versions = version_names(np.asarray([v for part in parts for v in part.versions], dtype=np.int64))
    created = now_us()
    entries = [
        AdjustmentRow(
            engine_class=engine_class, period_start_us=start_us, period_end_us=end_us, to_version=to_version, tenant=tenant,
            from_versions=from_versions, billed_ns=billed_ns.get(tenant, 0), reattributed_ns=new_ns.get(tenant, 0),
            delta_ns=new_ns.get(tenant, 0) - billed_ns.get(tenant, 0), num_steps=counts.get(tenant, 0), created_at_us=created,
        )
        for tenant in sorted(set(billed_ns) | set(new_ns))
    ]
    if sum(e.delta_ns for e in entries) != 0:  # cannot happen when both splits reconcile (checked above)
        raise AdjustmentError(f"engine class {engine_class!r}: the adjustment does not sum to 0; nothing was written")
    if not dry_run:
        ledger.add_adjustments(entries)
    return AdjustmentResult(
        engine_class=engine_class, start_us=start_us, end_us=end_us, to_version=to_version, from_versions=from_versions,
        num_steps=sum(part.num_steps for part in parts), measured_ns=measured_ns, entries=entries, written=not dry_run,
        window_steps=sum(part.num_steps for part in parts if part.num_windows), num_windows=sum(part.num_windows for part in parts),
    )
