"""The model registry: fitted models per engine class (fingerprint id), versioned, one active per class; and which
classes have steps pending a model.
"""

from __future__ import annotations

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from llmvisor.ledger.connection import WRITE_ATTEMPTS, LedgerConnection, now_us
from llmvisor.ledger.records import LedgerError, ModelVersion
from llmvisor.ledger.schema import active_models, engine_models, steps


class ModelRegistry(LedgerConnection):
    """Models per engine class and the pending steps waiting for one (module note)."""

    def __init__(self, url: str, *, request_totals: bool = True):
        self._known_versions: set[tuple[str, int]] = set()  # stored model versions are never changed nor removed
        super().__init__(url, request_totals=request_totals)

    def add_model(self, engine_class: str, model_json: str, source: str, *, activate: bool = False) -> int:
        """Store a model as the next version of its class; returns the version (1, 2, ...)."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    latest = conn.execute(
                        select(func.max(engine_models.c.version)).where(engine_models.c.engine_class == engine_class)
                    ).scalar()
                    version = int(latest or 0) + 1
                    conn.execute(
                        insert(engine_models).values(
                            engine_class=engine_class, version=version, model_json=model_json, source=source,
                            created_at_us=now_us(),
                        )
                    )
                    if activate:
                        self._set_active(conn, engine_class, version)
                return version
            except IntegrityError:  # another writer took the same version number
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def list_models(self, engine_class: str | None = None) -> list[ModelVersion]:
        query = (
            select(engine_models.c.engine_class, engine_models.c.version, engine_models.c.source,
                   engine_models.c.created_at_us, active_models.c.version)
            .outerjoin(active_models, active_models.c.engine_class == engine_models.c.engine_class)
            .order_by(engine_models.c.engine_class, engine_models.c.version)
        )
        if engine_class is not None:
            query = query.where(engine_models.c.engine_class == engine_class)
        with self._read() as conn:
            return [ModelVersion(r[0], int(r[1]), r[2], int(r[3]), r[4] == r[1]) for r in conn.execute(query)]

    def active_versions(self) -> dict[str, int]:
        """Each class with an active model, and its version."""
        with self._read() as conn:
            return {r[0]: int(r[1]) for r in conn.execute(select(active_models.c.engine_class, active_models.c.version))}

    def model_json(self, engine_class: str, version: int) -> str | None:
        with self._read() as conn:
            return conn.execute(
                select(engine_models.c.model_json).where(
                    engine_models.c.engine_class == engine_class, engine_models.c.version == version
                )
            ).scalar()

    def has_model_version(self, engine_class: str, version: int) -> bool:
        """Whether version ``version`` of ``engine_class`` is registered; a version found is remembered (the
        windows route asks this of every window)."""
        key = (engine_class, int(version))
        if key in self._known_versions:
            return True
        with self._read() as conn:
            found = conn.execute(
                select(engine_models.c.version).where(engine_models.c.engine_class == engine_class, engine_models.c.version == version)
            ).first() is not None
        if found:
            self._known_versions.add(key)
        return found

    def activate_model(self, engine_class: str, version: int) -> None:
        """Make a stored version the one attributing its class (its pending steps are attributed separately:
        `resolve_pending`)."""
        with self.write_transaction() as conn:
            self._set_active(conn, engine_class, version)

    def _set_active(self, conn: Connection, engine_class: str, version: int) -> None:
        exists = conn.execute(
            select(engine_models.c.version).where(engine_models.c.engine_class == engine_class, engine_models.c.version == version)
        ).first()
        if exists is None:
            raise LedgerError(f"no model version {version} of engine class {engine_class!r} is stored (see `llmvisor models list`)")
        updated = conn.execute(
            update(active_models).where(active_models.c.engine_class == engine_class).values(version=version, activated_at_us=now_us())
        )
        if updated.rowcount == 0:
            conn.execute(insert(active_models).values(engine_class=engine_class, version=version, activated_at_us=now_us()))
    def pending_classes(self) -> dict[str, int]:
        """Classes with pending steps, and how many (reads every step's state: for reports, not per request)."""
        query = select(steps.c.engine_class, func.count()).where(steps.c.pending.is_(True)).group_by(steps.c.engine_class)
        with self._read() as conn:
            return {r[0]: int(r[1]) for r in conn.execute(query)}

    def has_pending(self, engine_class: str) -> bool:
        """Whether a class has a pending step (one index lookup)."""
        query = select(steps.c.step_id).where(steps.c.engine_class == engine_class, steps.c.pending.is_(True)).limit(1)
        with self._read() as conn:
            return conn.execute(query).first() is not None
