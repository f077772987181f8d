"""Usage queries: attributed time per tenant, engine class and request, totals that reconcile, the model versions
that billed a range, one step's detail, and the hourly usage that billing charges. Steps stored one by one and window
aggregates alike: a tenant's usage is the same whichever way it was metered.

Time ranges are [start_us, end_us) on the step's timestamp, None meaning unbounded, in whole seconds (usage is kept
per second, `LedgerConnection._range`).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import and_, case, func, select

from llmvisor.core.tokens import add_counts
from llmvisor.ledger.connection import LedgerConnection
from llmvisor.ledger.records import LedgerError, RequestUsageRow, SliceShare, StepDetail, Totals, UsageRow
from llmvisor.ledger.schema import (
    KV_USAGE_COLUMNS,
    LORA_USAGE_COLUMN,
    TOKEN_SPLIT_COLUMNS,
    USAGE_RESOLUTION_US,
    request_totals,
    slice_batches,
    step_ranges,
    steps,
    tenant_seconds,
    usage_per_second,
    windows,
)

BUCKET_US = {"minute": 60_000_000, "hour": 3_600_000_000, "day": 86_400_000_000}
KV_HALF = 2**31
"""KV block-ns are summed in SQL as two halves, ``ns // 2^31`` and ``ns % 2^31``: a tenant's month of block-ns
can pass 2^63, where SQLite's SUM of integers fails; each half's sum cannot (`kv_total` joins them exactly)."""


def kv_sums(table) -> list:
    """SQL sums of a usage relation's ``kv_block_ns`` in two halves (`KV_HALF`); NULL where no row was metered."""
    ns = table.c.kv_block_ns
    return [func.sum(ns // KV_HALF), func.sum(ns % KV_HALF)]


def kv_total(high, low) -> int | None:
    """The exact block-ns of `kv_sums`' two halves (None: nothing metered)."""
    return None if high is None else int(high) * KV_HALF + int(low)


def _add_kv(a: tuple[int | None, int | None], block_ns: int | None, block_bytes: int | None) -> tuple[int | None, int | None]:
    """(block-ns, byte-ns) ``a`` plus one block size's block-ns; None stays None only while nothing is metered."""
    if block_ns is None:
        return a
    byte_ns = block_ns * int(block_bytes or 0)
    return ((a[0] or 0) + block_ns, (a[1] or 0) + byte_ns)


def _tenant_usage_rows(*, with_class: bool = False):
    """Per-second usage of stored steps and the per-second tenant rows of window aggregates as one relation
    ([engine_class,] tenant, second_us, attributed_ns, num_slices, num_new_tokens and the token split), so a tenant's
    total is the same whichever way it was metered. A stored step's class is its run's (a run is one engine
    instance: its first class seen in `step_ranges`); a window's is its own."""
    w = tenant_seconds
    u = usage_per_second

    def sums(table):
        return [table.c.tenant, table.c.second_us, table.c.attributed_ns, table.c.num_slices, table.c.num_new_tokens,
                *(table.c[name] for name in TOKEN_SPLIT_COLUMNS), *(table.c[name] for name in KV_USAGE_COLUMNS),
                table.c[LORA_USAGE_COLUMN]]

    if not with_class:
        return select(*sums(u)).union_all(select(*sums(w))).subquery("usage")
    run_class = select(step_ranges.c.run_id, func.min(step_ranges.c.engine_class).label("engine_class")).group_by(step_ranges.c.run_id).subquery()
    per_step = select(func.coalesce(run_class.c.engine_class, "").label("engine_class"), *sums(u)).select_from(
        u.outerjoin(run_class, run_class.c.run_id == u.c.run_id))
    return per_step.union_all(select(w.c.engine_class, *sums(w))).subquery("usage")


def _request_usage_rows():
    """Per-second request usage of stored steps and request totals of aggregates as one relation."""
    u = usage_per_second
    r = request_totals
    return select(u.c.run_id, u.c.request_id, u.c.tenant, u.c.second_us, u.c.attributed_ns, u.c.num_slices, u.c.num_new_tokens,
                  u.c.first_timestamp_us, u.c.last_timestamp_us, *(u.c[name] for name in TOKEN_SPLIT_COLUMNS),
                  *(u.c[name] for name in KV_USAGE_COLUMNS), u.c[LORA_USAGE_COLUMN]).union_all(
        select(r.c.run_id, r.c.request_id, r.c.tenant, r.c.first_second_us, r.c.attributed_ns, r.c.num_slices, r.c.num_new_tokens,
               r.c.first_timestamp_us, r.c.last_timestamp_us, *(r.c[name] for name in TOKEN_SPLIT_COLUMNS),
               *(r.c[name] for name in KV_USAGE_COLUMNS), r.c[LORA_USAGE_COLUMN])
    ).subquery("usage")


def split_sums(table) -> list:
    """SQL sums of the token split over a group: NULL where any row of the group has its split NULL (stored before
    schema 6), so an unknown part is never read as 0."""
    return [case((func.count(table.c[name]) == func.count(), func.coalesce(func.sum(table.c[name]), 0)), else_=None)
            for name in TOKEN_SPLIT_COLUMNS]


def adapter_of(table):
    """A usage relation's adapter as read back: '' for the base model (NULL in the ledger, schema 10)."""
    return func.coalesce(table.c[LORA_USAGE_COLUMN], "")


def _counts(values) -> dict:
    return {name: None if value is None else int(value) for name, value in zip(TOKEN_SPLIT_COLUMNS, values)}


class UsageQueries(LedgerConnection):
    """Usage read back (module note)."""

    def tenant_usage(
        self,
        start_us: int | None = None,
        end_us: int | None = None,
        bucket: str | None = None,
        tenant: str | None = None,
        *,
        by_adapter: bool = False,
    ) -> list[UsageRow]:
        """Attributed time per tenant (and per UTC bucket of ``bucket`` if given; per LoRA adapter too with
        ``by_adapter``, '' the base model), ordered by tenant, adapter and time; steps stored one by one and window
        aggregates alike."""
        usage = _tenant_usage_rows()
        conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            conditions.append(usage.c.tenant == tenant)
        columns = [usage.c.tenant]
        if by_adapter:
            columns.append(adapter_of(usage).label(LORA_USAGE_COLUMN))
        if bucket is not None:
            if bucket not in BUCKET_US:
                raise LedgerError(f"unknown bucket {bucket!r}; choose one of {', '.join(BUCKET_US)}")
            size = BUCKET_US[bucket]
            columns.append(((usage.c.second_us // size) * size).label("bucket_start_us"))
        rows = self._summed(usage, columns, conditions)
        return [
            UsageRow(
                tenant=row[0],
                bucket_start_us=int(row[len(columns) - 1]) if bucket is not None else None,
                lora_name=str(row[1]) if by_adapter else None,
                attributed_ns=int(row[-8]),
                num_slices=int(row[-7]),
                num_new_tokens=int(row[-6]),
                **_counts(row[-5:-2]),
                kv_block_ns=row[-2],
                kv_byte_ns=row[-1],
            )
            for row in rows
        ]

    def class_usage(
        self, start_us: int | None = None, end_us: int | None = None, bucket: str = "hour", tenant: str | None = None
    ) -> list[tuple]:
        """(engine_class, bucket_start_us, attributed_ns, num_slices, num_new_tokens, num_uncached_prompt_tokens,
        num_cached_prompt_tokens, num_output_tokens) per engine class and UTC bucket, a tenant's if given (the split
        None where unknown, `split_sums`). A request's class is its run's (a run is one engine instance; its first
        class seen in `step_ranges`), so this reads the per-second usage, not the steps."""
        if bucket not in BUCKET_US:
            raise LedgerError(f"unknown bucket {bucket!r}; choose one of {', '.join(BUCKET_US)}")
        usage = _tenant_usage_rows(with_class=True)  # steps stored one by one, and window aggregates
        size = BUCKET_US[bucket]
        conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            conditions.append(usage.c.tenant == tenant)
        columns = [usage.c.engine_class, ((usage.c.second_us // size) * size).label("bucket_start_us")]
        return [(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), *_counts(r[5:8]).values())
                for r in self._summed(usage, columns, conditions)]

    def _summed(self, usage, columns: list, conditions: list) -> list:
        """Rows (``columns``, attributed_ns, num_slices, num_new_tokens, the token split, kv_block_ns, kv_byte_ns) of the
        usage relation ``usage`` summed per ``columns`` where ``conditions`` hold, ordered by ``columns``. SQL groups by
        block size as well (byte-ns are block-ns × the block size of their run); the sizes are joined here, exactly."""
        block_bytes = usage.c.kv_block_bytes
        query = (
            select(*columns, block_bytes, func.sum(usage.c.attributed_ns), func.sum(usage.c.num_slices),
                   func.sum(usage.c.num_new_tokens), *split_sums(usage), *kv_sums(usage))
            .where(and_(True, *conditions))
            .group_by(*columns, block_bytes)
            .order_by(*columns)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        merged: dict[tuple, list] = {}
        n = len(columns)
        for row in rows:
            key = tuple(row[:n])
            ns, slices, tokens = int(row[n + 1]), int(row[n + 2]), int(row[n + 3])
            split = [None if v is None else int(v) for v in row[n + 4:n + 7]]
            kv = kv_total(row[n + 7], row[n + 8])
            have = merged.get(key)
            if have is None:
                merged[key] = [ns, slices, tokens, *split, *_add_kv((None, None), kv, row[n])]
            else:
                have[:3] = [have[0] + ns, have[1] + slices, have[2] + tokens]
                have[3:6] = [add_counts(a, b) for a, b in zip(have[3:6], split)]
                have[6:8] = _add_kv((have[6], have[7]), kv, row[n])
        return [(*key, *values) for key, values in merged.items()]

    def billing_versions(self, start_us: int | None = None, end_us: int | None = None, tenant: str | None = None) -> list[tuple[str, int | None]]:
        """(engine_class, model_version) of the attributed steps of the runs a tenant (if given) had usage in, in
        the range: the model versions that billed it (None: the service's default model). No counts: a run's
        steps are other tenants' too."""
        usage = usage_per_second
        run_conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            run_conditions.append(usage.c.tenant == tenant)
        runs = select(usage.c.run_id).where(and_(True, *run_conditions)).distinct()
        conditions = [steps.c.run_id.in_(runs), steps.c.pending.is_(False)]
        if start_us is not None:
            conditions.append(steps.c.timestamp_us >= start_us)
        if end_us is not None:
            conditions.append(steps.c.timestamp_us < end_us)
        query = (
            select(steps.c.engine_class, steps.c.model_version)
            .where(and_(*conditions))
            .distinct()
            .order_by(steps.c.engine_class, steps.c.model_version)
        )
        w = tenant_seconds
        window_conditions = self._range(w.c.second_us, start_us, end_us)
        if tenant is not None:
            window_conditions.append(w.c.tenant == tenant)
        window_query = (  # metered in windows: the versions of the windows the tenant had usage in (0: pending)
            select(w.c.engine_class, w.c.model_version).where(and_(w.c.model_version != 0, *window_conditions)).distinct()
        )
        with self._read() as conn:
            found = {(str(r[0]), None if r[1] is None else int(r[1])) for r in [*conn.execute(query).all(), *conn.execute(window_query).all()]}
        return sorted(found, key=lambda cv: (cv[0], -1 if cv[1] is None else cv[1]))

    def request_usage(
        self,
        start_us: int | None = None,
        end_us: int | None = None,
        tenant: str | None = None,
        run_id: str | None = None,
        request_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
        request_id_prefix: str | None = None,
    ) -> list[RequestUsageRow]:
        """Attributed time per request, largest first. A request metered in windows counts in the range its
        first window starts in. ``request_id_prefix`` keeps the ids that start with it (matched as a literal: ``%``
        and ``_`` in it are not wildcards; SQLite's LIKE ignores ASCII case, so callers that need an exact prefix
        check the ids returned)."""
        usage = _request_usage_rows()
        conditions = self._range(usage.c.second_us, start_us, end_us)
        for column, value in ((usage.c.tenant, tenant), (usage.c.run_id, run_id), (usage.c.request_id, request_id)):
            if value is not None:
                conditions.append(column == value)
        if request_id_prefix is not None:
            conditions.append(usage.c.request_id.startswith(request_id_prefix, autoescape=True))
        total = func.sum(usage.c.attributed_ns)
        query = (
            select(
                usage.c.run_id,
                usage.c.request_id,
                usage.c.tenant,
                total,
                func.sum(usage.c.num_slices),
                func.sum(usage.c.num_new_tokens),
                func.min(usage.c.first_timestamp_us),
                func.max(usage.c.last_timestamp_us),
                *split_sums(usage),
                func.max(usage.c.kv_block_bytes),  # one run's: the same on all its rows
                *kv_sums(usage),
                func.max(adapter_of(usage)),  # a request runs one adapter
            )
            .where(and_(True, *conditions))
            .group_by(usage.c.run_id, usage.c.request_id, usage.c.tenant)
            .order_by(total.desc(), usage.c.run_id, usage.c.request_id, usage.c.tenant)
            .limit(limit)
            .offset(offset)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        out = []
        for r in rows:
            kv = kv_total(r[12], r[13])
            out.append(RequestUsageRow(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7]), **_counts(r[8:11]),
                                       kv_block_ns=kv, kv_byte_ns=None if kv is None else kv * int(r[11] or 0), lora_name=str(r[14])))
        return out

    def top_tenants(self, n: int, start_us: int | None = None, end_us: int | None = None) -> list[UsageRow]:
        """The ``n`` tenants with the most attributed time, largest first, with their KV memory-time (a second query over
        those tenants: the block sizes are summed apart, `_summed`)."""
        usage = _tenant_usage_rows()
        total = func.sum(usage.c.attributed_ns)
        query = (
            select(usage.c.tenant, total, func.sum(usage.c.num_slices), func.sum(usage.c.num_new_tokens))
            .where(and_(True, *self._range(usage.c.second_us, start_us, end_us)))
            .group_by(usage.c.tenant)
            .order_by(total.desc(), usage.c.tenant)
            .limit(n)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        if not rows:
            return []
        kv = {r[0]: (r[-2], r[-1]) for r in self._summed(usage, [usage.c.tenant], [
            *self._range(usage.c.second_us, start_us, end_us), usage.c.tenant.in_([r[0] for r in rows])])}
        return [UsageRow(r[0], None, int(r[1]), int(r[2]), int(r[3]), kv_block_ns=kv[r[0]][0], kv_byte_ns=kv[r[0]][1])
                for r in rows]

    def totals(self, start_us: int | None = None, end_us: int | None = None) -> Totals:
        """Steps and measured time, slices and attributed time, read in one snapshot so they reconcile."""
        step_query = (
            select(steps.c.pending, func.count(), func.coalesce(func.sum(steps.c.measured_ns), 0))
            .where(and_(True, *self._range(steps.c.timestamp_us, start_us, end_us)))
            .group_by(steps.c.pending)
        )
        window_query = (
            select(windows.c.pending, func.coalesce(func.sum(windows.c.num_steps), 0), func.coalesce(func.sum(windows.c.measured_ns), 0))
            .where(and_(True, *self._range(windows.c.window_start_us // USAGE_RESOLUTION_US * USAGE_RESOLUTION_US, start_us, end_us)))
            .group_by(windows.c.pending)
        )
        usage = _tenant_usage_rows()
        usage_query = (
            select(usage.c.kv_block_bytes, func.coalesce(func.sum(usage.c.num_slices), 0),
                   func.coalesce(func.sum(usage.c.attributed_ns), 0), *kv_sums(usage))
            .where(and_(True, *self._range(usage.c.second_us, start_us, end_us)))
            .group_by(usage.c.kv_block_bytes)
        )
        engine = self._read_engine
        if self.backend == "postgresql":
            engine = engine.execution_options(isolation_level="REPEATABLE READ")
        with engine.begin() as conn:
            by_state = {bool(pending): (int(n), int(ns)) for pending, n, ns in conn.execute(step_query)}
            for pending, n, ns in conn.execute(window_query):
                have = by_state.get(bool(pending), (0, 0))
                by_state[bool(pending)] = (have[0] + int(n), have[1] + int(ns))
            n_slices, attributed, kv = 0, 0, (None, None)
            for block_bytes, slices, ns, high, low in conn.execute(usage_query):
                n_slices, attributed = n_slices + int(slices), attributed + int(ns)
                kv = _add_kv(kv, kv_total(high, low), block_bytes)
        (n_steps, measured), (n_pending, pending_ns) = by_state.get(False, (0, 0)), by_state.get(True, (0, 0))
        return Totals(n_steps, measured, int(n_slices), int(attributed), n_pending, pending_ns, kv_block_ns=kv[0], kv_byte_ns=kv[1])

    def step_detail(self, run_id: str, step_id: int) -> StepDetail | None:
        """One stored step with its slices and their shares, read back from its batch's Parquet blob."""
        with self._read() as conn:
            row = conn.execute(
                select(steps, slice_batches.c.slices_parquet)
                .join(slice_batches, slice_batches.c.batch_id == steps.c.slice_batch_id)
                .where(steps.c.run_id == run_id, steps.c.step_id == step_id)
            ).first()
        if row is None:
            return None
        table = pq.read_table(
            pa.BufferReader(bytes(row.slices_parquet)), filters=[("run_id", "=", run_id), ("step_id", "=", step_id)]
        )
        table = table.sort_by([("request_id", "ascending")])
        kv = table["kv_block_ns"].to_pylist() if "kv_block_ns" in table.column_names else [None] * table.num_rows
        return StepDetail(
            run_id=row.run_id,
            step_id=int(row.step_id),
            measured_ns=int(row.measured_ns),
            predicted_s=None if row.predicted_s is None else float(row.predicted_s),
            timestamp_us=int(row.timestamp_us),
            ingested_at_us=int(row.ingested_at_us),
            content_sha256=bytes(row.content_sha256),
            engine_class=row.engine_class,
            model_version=row.model_version,
            pending=bool(row.pending),
            slices=[
                SliceShare(
                    request_id=r["request_id"], tenant=r["tenant"], num_new_tokens=r["num_new_tokens"],
                    num_context_tokens=r["num_context_tokens"], phase=r["phase"], attributed_ns=r["attributed_ns"],
                    kv_block_ns=block_ns,
                )
                for r, block_ns in zip(table.select(
                    ["request_id", "tenant", "num_new_tokens", "num_context_tokens", "phase", "attributed_ns"]
                ).to_pylist(), kv)
            ],
        )

    def tenant_window_seconds(self, tenant: str, start_us: int, end_us: int) -> dict[tuple[int, str, int], int]:
        """``tenant``'s attributed time metered in (attributed, not pending) windows, per (second, engine class, model
        version), for the seconds in [start_us, end_us)."""
        w = tenant_seconds
        query = (
            select(w.c.second_us, w.c.engine_class, w.c.model_version, func.sum(w.c.attributed_ns))
            .where(w.c.tenant == tenant, w.c.model_version != 0, *self._range(w.c.second_us, start_us, end_us))
            .group_by(w.c.second_us, w.c.engine_class, w.c.model_version)
        )
        with self._read() as conn:
            return {(int(r[0]), str(r[1]), int(r[2])): int(r[3]) for r in conn.execute(query)}

    def class_window_usage(self, engine_class: str, start_us: int, end_us: int) -> dict[tuple[str, int], int]:
        """One class's attributed time metered in (attributed, not pending) windows whose second is in [start_us,
        end_us), per (tenant, model version): what window mode billed the class's period."""
        w = tenant_seconds
        query = (
            select(w.c.tenant, w.c.model_version, func.sum(w.c.attributed_ns))
            .where(w.c.engine_class == engine_class, w.c.model_version != 0, *self._range(w.c.second_us, start_us, end_us))
            .group_by(w.c.tenant, w.c.model_version)
        )
        with self._read() as conn:
            return {(str(r[0]), int(r[1])): int(r[2]) for r in conn.execute(query) if int(r[2])}

    def hourly_usage(self, start_us: int, end_us: int, *, default_version: int = 0, by_adapter: bool = False) -> list[tuple]:
        """Usage of [start_us, end_us) per UTC hour, engine class, model version and tenant, as billing charges it
        (`llmvisor.billing.charges`): rows (hour_us, engine_class, model_version, tenant, attributed_ns, num_new_tokens,
        the token split, None where unknown, `split_sums`, then kv_block_bytes and kv_block_ns, None where not
        metered: a key's usage comes in one row per block size), those of steps stored one by one first (by hour, class,
        version, tenant), then those of window aggregates (in no set order); both read in one snapshot. A row can
        appear once in each part, for a tenant metered both ways in an hour.

        A stored step's usage takes the class and version of its run's steps in its second (the higher version where
        two billed that second; ``default_version`` for the service's default model, NULL in the ledger). A window's
        takes its own, in the hour the window starts; pending windows (version 0) are left out.

        ``by_adapter``: per LoRA adapter too (schema 10), each row's last element its adapter ('' the base model)."""
        hour_us = BUCKET_US["hour"]

        def adapter(table) -> list:
            return [adapter_of(table).label(LORA_USAGE_COLUMN)] if by_adapter else []

        second = (steps.c.timestamp_us // 1_000_000) * 1_000_000
        run_second = (
            select(steps.c.run_id, second.label("second_us"), func.min(steps.c.engine_class).label("engine_class"),
                   func.max(func.coalesce(steps.c.model_version, default_version)).label("model_version"))
            .where(and_(steps.c.timestamp_us >= start_us, steps.c.timestamp_us < end_us))
            .group_by(steps.c.run_id, second)
            .subquery()
        )
        u = usage_per_second
        hour = ((u.c.second_us // hour_us) * hour_us).label("hour_us")
        query = (
            select(hour, run_second.c.engine_class, run_second.c.model_version, u.c.tenant, func.sum(u.c.attributed_ns),
                   func.sum(u.c.num_new_tokens), *split_sums(u), u.c.kv_block_bytes, *kv_sums(u), *adapter(u))
            .join(run_second, and_(run_second.c.run_id == u.c.run_id, run_second.c.second_us == u.c.second_us))
            .where(and_(u.c.second_us >= start_us, u.c.second_us < end_us))
            .group_by(hour, run_second.c.engine_class, run_second.c.model_version, u.c.tenant, u.c.kv_block_bytes, *adapter(u))
            .order_by(hour, run_second.c.engine_class, run_second.c.model_version, u.c.tenant)
        )
        w = tenant_seconds
        window_hour = ((w.c.second_us // hour_us) * hour_us).label("hour_us")
        window_query = (
            select(window_hour, w.c.engine_class, w.c.model_version, w.c.tenant, func.sum(w.c.attributed_ns),
                   func.sum(w.c.num_new_tokens), *split_sums(w), w.c.kv_block_bytes, *kv_sums(w), *adapter(w))
            .where(and_(w.c.second_us >= start_us, w.c.second_us < end_us, w.c.model_version != 0))  # 0: pending windows
            .group_by(window_hour, w.c.engine_class, w.c.model_version, w.c.tenant, w.c.kv_block_bytes, *adapter(w))
        )
        with self._read() as conn:  # one snapshot: per-step and window usage read together
            return [(*row[:9], row[9], kv_total(row[10], row[11]), *row[12:]) for row in [*conn.execute(query), *conn.execute(window_query)]]
