"""What the ledger knows of a run instance: the step ids it holds (`step_ranges`, merged as steps and windows are
stored, so a step is billed once whatever key it came under), the gaps between them, its end-of-run record
(`run_ends`), and its first step's digest (`run_digests`: a run re-sent under a new run id is refused,
`DuplicateRunError`).

`RunStore` is the part of `llmvisor.ledger.Ledger` that reads and writes them; step and window ingest
(`llmvisor.ledger.steps`, `llmvisor.ledger.windows`) build on it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from sqlalchemy import Connection, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from llmvisor.ledger.connection import LOOKUP_CHUNK, WRITE_ATTEMPTS, LedgerConnection, now_us
from llmvisor.ledger.records import DuplicateRunError, HeldStepsError, RunEnd, RunEndConflictError, RunGaps, RunHoldings, StepGap
from llmvisor.ledger.schema import duplicate_runs, run_digests, run_ends, step_ranges, windows


def gaps_of_ranges(run_id: str, ranges: Sequence[tuple[int, int, str, int]], end: RunEnd | None = None) -> RunGaps:
    """A run's gaps from its stored ranges ``(first_step_id, last_step_id, engine_class, first_received_us)``:
    the ids below each range not covered by an earlier one, from 0. A gap is as old as the earliest range after it.
    With an end-of-run record, the ids after the last range up to ``end.last_step_id`` are a gap too (a lost tail),
    as old as the record."""
    ranges = sorted(ranges)
    gaps: list[StepGap] = []
    earliest_after = [0] * len(ranges)
    running = None
    for k in range(len(ranges) - 1, -1, -1):
        received = ranges[k][3]
        running = received if running is None else min(running, received)
        earliest_after[k] = running
    expected = min(0, ranges[0][0]) if ranges else 0
    for k, (first, last, _class, _received) in enumerate(ranges):
        if first > expected:
            gaps.append(StepGap(expected, first - 1, earliest_after[k]))
        expected = max(expected, last + 1)
    if end is not None and end.last_step_id >= expected:
        gaps.append(StepGap(expected, end.last_step_id, end.received_at_us))
    return RunGaps(
        run_id=run_id,
        engine_class=ranges[0][2] if ranges else "",
        num_received=sum(last - first + 1 for first, last, _c, _r in ranges),
        last_step_id=max((last for _f, last, _c, _r in ranges), default=-1),
        gaps=gaps,
        end=end,
    )


def merge_ranges(ranges: Sequence[tuple[int, int, str, int]]) -> list[tuple[int, int, str, int]]:
    """Overlapping or adjacent ranges joined; a joined range keeps the earliest receipt and that range's class."""
    merged: list[list] = []
    for first, last, engine_class, received in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            top = merged[-1]
            top[1] = max(top[1], last)
            if received < top[3]:
                top[2], top[3] = engine_class, received
        else:
            merged.append([first, last, engine_class, received])
    return [tuple(item) for item in merged]


def range_overlaps(ours: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ids two lists of sorted, disjoint ``(first, last)`` ranges share, as ranges (one sweep)."""
    out, i, j = [], 0, 0
    while i < len(ours) and j < len(theirs):
        first, last = max(ours[i][0], theirs[j][0]), min(ours[i][1], theirs[j][1])
        if first <= last:
            out.append((first, last))
        if ours[i][1] < theirs[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_id_ranges(step_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted, distinct step ids as runs of consecutive ids ``(first, last)``."""
    ids = np.unique(np.asarray(step_ids, dtype=np.int64))
    if not ids.size:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1)
    firsts = np.concatenate(([ids[0]], ids[breaks + 1]))
    lasts = np.concatenate((ids[breaks], [ids[-1]]))
    return list(zip(firsts.tolist(), lasts.tolist()))


class RunStore(LedgerConnection):
    """A run's held step ids, gaps, end-of-run record and first-step digest (module note)."""

    def _refuse_duplicate_runs(self, conn: Connection, run_ids) -> dict[str, DuplicateRunError]:
        """The runs among ``run_ids`` refused before as re-sends of another run (`duplicate_runs`), with their error."""
        runs = sorted(set(run_ids))
        out: dict[str, DuplicateRunError] = {}
        for i in range(0, len(runs), LOOKUP_CHUNK):
            query = select(duplicate_runs.c.run_id, duplicate_runs.c.duplicate_of, duplicate_runs.c.form).where(
                duplicate_runs.c.run_id.in_(runs[i : i + LOOKUP_CHUNK]))
            for run_id, other, form in conn.execute(query):
                out[run_id] = DuplicateRunError(run_id, other, form, earlier=True)
        return out

    def _remember_duplicate(self, duplicate: DuplicateRunError) -> None:
        """Record a refused run (its own transaction: the refused batch was rolled back), so the rest of it is refused."""
        try:
            with self.write_transaction() as conn:
                if not self._refuse_duplicate_runs(conn, [duplicate.run_id]):
                    conn.execute(insert(duplicate_runs).values(run_id=duplicate.run_id, duplicate_of=duplicate.other_run_id,
                                                               form=duplicate.form, refused_at_us=now_us()))
        except IntegrityError:
            pass  # another process recorded it at the same moment

    def _claim_run_digests(self, conn: Connection, claims: Sequence[tuple[str, bytes]], form: str,
                           held: dict[bytes, str] | None = None) -> None:
        """Record ``claims`` (new run, its first-step digest) in `run_digests` with one lookup for all of them
        (or against ``held``, looked up already); `DuplicateRunError` if a digest is held by another run, or
        claimed by two runs of the batch. Two writers claiming one digest at once: the later insert fails on the
        key and its retry sees the earlier one's."""
        if not claims:
            return
        if held is None:
            held = self._held_run_digests(conn, [d for _r, d in claims])
        mine: dict[bytes, str] = {}
        for run_id, digest in claims:
            other = held.get(digest, mine.get(digest))
            if other is not None and other != run_id:
                raise DuplicateRunError(run_id, other, form)
            mine[digest] = run_id
        new = [{"digest": d, "run_id": r, "form": form, "created_at_us": now_us()} for d, r in mine.items() if d not in held]
        if new:
            conn.execute(insert(run_digests), new)

    @staticmethod
    def _held_run_digests(conn: Connection, digests: Sequence[bytes]) -> dict[bytes, str]:
        rows = conn.execute(select(run_digests.c.digest, run_digests.c.run_id).where(run_digests.c.digest.in_(list(set(digests))))).all()
        return {bytes(digest): run_id for digest, run_id in rows}

    def add_step_ranges(self, conn: Connection, run_id: np.ndarray, step_id: np.ndarray, engine_class: np.ndarray,
                        received_us: np.ndarray) -> list[str]:
        """Merge newly stored steps' ids into their runs' ranges (`step_ranges`), run by run in name order;
        `HeldStepsError` if a step id is held already (in a stored window, or stored one by one) or twice in
        this batch, so a step is billed once whatever key it came under: a delivery process that replaced a
        dead one and aggregated steps whose window was still on its way is refused, not counted twice.

        Last in the transaction, after every row lock it takes: on PostgreSQL a transaction-scoped advisory
        lock per run makes concurrent writers of one run take turns on its ranges, and taking those locks in
        one order while waiting on nothing else cannot deadlock. SQLite has one writer at a time anyway.

        Returns the runs whose ranges changed other than by their one range next to the new steps growing
        over them: a run's gaps (the holes between its ranges) are unchanged in that usual case."""
        run_id = np.asarray(run_id, dtype=object).astype(str)
        reshaped = []
        for run in sorted(set(run_id.tolist())):
            mine = run_id == run
            ids, counts = np.unique(np.asarray(step_id[mine], dtype=np.int64), return_counts=True)
            if np.any(counts > 1):
                raise HeldStepsError(run, step_id_ranges(ids[counts > 1]))
            islands = step_id_ranges(ids)
            engine_class_of_run = str(np.asarray(engine_class, dtype=object)[mine][0])
            received = int(np.min(np.asarray(received_us)[mine]))
            if self.backend == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(run, 0))))
            low, high = islands[0][0], islands[-1][1]
            table = step_ranges
            existing = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us).where(
                    table.c.run_id == run, table.c.last_step_id >= low - 1, table.c.first_step_id <= high + 1
                )
            ).all()
            overlaps = range_overlaps(islands, sorted((int(row[0]), int(row[1])) for row in existing))
            if overlaps:
                raise HeldStepsError(run, overlaps)
            merged = merge_ranges([*((a, b, engine_class_of_run, received) for a, b in islands), *map(tuple, existing)])
            if len(existing) == 1 and len(merged) == 1:  # the usual case: the new steps extend the run's one range
                a, b, c, r = merged[0]
                conn.execute(
                    update(table).where(table.c.run_id == run, table.c.first_step_id == existing[0][0])
                    .values(first_step_id=a, last_step_id=b, engine_class=c, first_received_us=r)
                )
                continue
            reshaped.append(run)
            if existing:
                conn.execute(
                    delete(table).where(table.c.run_id == run, table.c.first_step_id.in_([row[0] for row in existing]))
                )
            conn.execute(
                insert(table),
                [{"run_id": run, "first_step_id": a, "last_step_id": b, "engine_class": c, "first_received_us": r}
                 for a, b, c, r in merged],
            )
        return reshaped
    # -----------------------------------------------------------------------------------------------------
    # Gaps: step ids a run never delivered

    def run_gaps(self, run_id: str) -> RunGaps | None:
        """The run's received ids and gaps (with its end-of-run record, if stored); None if neither a step of it
        nor its end record is stored."""
        table = step_ranges
        with self._read() as conn:
            rows = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us)
                .where(table.c.run_id == run_id)
            ).all()
            end = self._run_ends(conn, [run_id]).get(run_id)
        return gaps_of_ranges(run_id, [tuple(r) for r in rows], end) if rows or end else None

    @staticmethod
    def _run_ends(conn: Connection, run_ids: Sequence[str]) -> dict[str, RunEnd]:
        out: dict[str, RunEnd] = {}
        for i in range(0, len(run_ids), LOOKUP_CHUNK):
            query = select(run_ends.c.run_id, run_ends.c.last_step_id, run_ends.c.num_steps, run_ends.c.received_at_us).where(
                run_ends.c.run_id.in_(list(run_ids[i : i + LOOKUP_CHUNK])))
            out.update({run: RunEnd(run, int(last), int(n), int(at)) for run, last, n, at in conn.execute(query)})
        return out

    def end_run(self, run_id: str, last_step_id: int, num_steps: int) -> tuple[RunEnd, bool]:
        """Store a run's end-of-run record; ``(record, True)`` when stored now, ``(stored record, False)`` for an
        identical re-send. `RunEndConflictError` if the run has one with other values (a run ends once)."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    stored = self._run_ends(conn, [run_id]).get(run_id)
                    if stored is not None:
                        if (stored.last_step_id, stored.num_steps) != (last_step_id, num_steps):
                            raise RunEndConflictError(stored, last_step_id, num_steps)
                        return stored, False
                    record = RunEnd(run_id, last_step_id, num_steps, now_us())
                    conn.execute(insert(run_ends).values(run_id=run_id, last_step_id=last_step_id, num_steps=num_steps,
                                                         received_at_us=record.received_at_us))
                return record, True
            except (IntegrityError, OperationalError):  # stored by another writer meanwhile: the next look sees it
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def run_holdings(self, run_id: str, from_step_id: int = 0) -> RunHoldings:
        """`RunHoldings` of ``run_id``: the one read a replacement delivery process resumes from (read-only; the
        step ranges and the windows read in one transaction)."""
        table = step_ranges
        with self._read() as conn:
            rows = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id)
                .where(table.c.run_id == run_id, table.c.last_step_id >= from_step_id)
                .order_by(table.c.first_step_id)
            ).all()
            num_windows, last_end = conn.execute(
                select(func.count(), func.max(windows.c.window_end_us)).where(windows.c.run_id == run_id)
            ).one()
        return RunHoldings(
            run_id=run_id, from_step_id=from_step_id, step_ranges=[(max(int(a), from_step_id), int(b)) for a, b in rows],
            num_windows=int(num_windows), last_window_end_us=None if last_end is None else int(last_end),
        )

    def runs_with_gaps(self, limit: int = 1000) -> list[RunGaps]:
        """Runs missing steps (by most recent gap first, at most ``limit``), with their gaps: holes in their ranges,
        and a lost tail (an end-of-run record naming a later last step than the last one stored)."""
        table = step_ranges
        gapped = (
            select(table.c.run_id, func.max(table.c.first_received_us).label("since_us"))
            .group_by(table.c.run_id)
            .having(or_(func.count() > 1, func.min(table.c.first_step_id) > 0))
            .order_by(func.max(table.c.first_received_us).desc(), table.c.run_id)
            .limit(limit)
        )
        last_stored = select(func.max(table.c.last_step_id)).where(table.c.run_id == run_ends.c.run_id).scalar_subquery()
        tails = (
            select(run_ends.c.run_id, run_ends.c.received_at_us)
            .where(run_ends.c.last_step_id > func.coalesce(last_stored, -1))
            .order_by(run_ends.c.received_at_us.desc(), run_ends.c.run_id)
            .limit(limit)
        )
        with self._read() as conn:
            found = {run: int(since) for run, since in conn.execute(gapped)}
            for run, since in conn.execute(tails):
                found[run] = max(found.get(run, 0), int(since))
            runs = sorted(found, key=lambda run: (-found[run], run))[:limit]
            by_run: dict[str, list[tuple]] = {run: [] for run in runs}
            for i in range(0, len(runs), LOOKUP_CHUNK):
                query = select(
                    table.c.run_id, table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us
                ).where(table.c.run_id.in_(runs[i : i + LOOKUP_CHUNK]))
                for run, *rest in conn.execute(query):
                    by_run[run].append(tuple(rest))
            ends = self._run_ends(conn, runs)
        return [gaps_of_ranges(run, ranges, ends.get(run)) for run, ranges in by_run.items()]
