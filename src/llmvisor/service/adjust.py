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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmvisor.errors import LlmvisorError
from llmvisor.ledger import AdjustmentRow, Ledger
from llmvisor.ledger.store import now_us
from llmvisor.service.ingest import attribute_stored
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


def adjust_period(
    ledger: Ledger, engine_class: str, start_us: int, end_us: int, *, to_version: int | None = None, dry_run: bool = False
) -> AdjustmentResult:
    """Re-attribute one class's billed steps in [start_us, end_us) with ``to_version`` (default: the active one)
    and write one adjustment entry per tenant (module docstring); ``dry_run`` computes without writing."""
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
    stored = ledger.billed_steps(engine_class, start_us, end_us)
    if not stored.keys:
        raise AdjustmentError(f"engine class {engine_class!r} has no billed steps starting in the period")
    billed = stored.slices
    prepared = attribute_stored(model, to_version, stored, engine_class).records
    measured_ns = int(prepared.measured_ns.sum())
    billed_ns = _tenant_sums(billed["tenant"].to_numpy(zero_copy_only=False), billed["attributed_ns"].to_numpy())
    new_ns = _tenant_sums(prepared.tenant, prepared.attributed_ns)
    if sum(billed_ns.values()) != measured_ns or sum(new_ns.values()) != measured_ns:
        raise AdjustmentError(  # a ledger whose bills do not reconcile: never paper over it with an adjustment
            f"engine class {engine_class!r}: billed {sum(billed_ns.values())} ns and re-attributed {sum(new_ns.values())} ns "
            f"do not both equal the measured {measured_ns} ns; nothing was written"
        )
    for row in earlier:
        billed_ns[row.tenant] = billed_ns.get(row.tenant, 0) + row.delta_ns
    counts = _step_counts(billed["run_id"].to_numpy(zero_copy_only=False), billed["step_id"].to_numpy(),
                          billed["tenant"].to_numpy(zero_copy_only=False))
    from_versions = version_names(stored.model_version)
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
        num_steps=len(stored.keys), measured_ns=measured_ns, entries=entries, written=not dry_run,
    )
