"""The limits and switches of one service instance (`create_app`'s arguments), kept on ``app.state.settings``."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SMALL_BODY_BYTES = 64 * 1024
DEFAULT_MAX_STEPS_PER_REQUEST = 20_000
DEFAULT_MAX_ROWS_PER_REQUEST = 1_000_000
DEFAULT_MAX_TENANT_LABELS = 1000
DEFAULT_MAX_CONCURRENT_INGEST = 8
ENV_REQUEST_TOTALS = "LLMVISOR_REQUEST_TOTALS"
"""1 (default): the ledger keeps a row per request of window aggregates; 0: not (`llmvisor.ledger.schema`, schema 7)."""


@dataclass(frozen=True)
class ServiceSettings:
    """``max_body_bytes`` bounds POST /v1/steps and /v1/windows (and what a Parquet body may decode to); every other route
    takes at most ``max_small_body_bytes``, either limit bounding a gzip body (``Content-Encoding: gzip``) once
    decoded too; ``gzip_bodies=False`` refuses gzip bodies (415: the pushers then send plain JSON, at about twice the
    bytes of window aggregates, in exchange for no decompression here). ``public_metrics`` serves /metrics without a key.
    ``max_concurrent_ingest`` batches are attributed and stored at once (no more than the ledger's connection
    pool holds); the others wait their turn in the event loop, so a fleet of engines posting at once queues
    instead of running out of database connections."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_small_body_bytes: int = DEFAULT_MAX_SMALL_BODY_BYTES
    max_steps_per_request: int = DEFAULT_MAX_STEPS_PER_REQUEST
    max_rows_per_request: int = DEFAULT_MAX_ROWS_PER_REQUEST
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS
    public_metrics: bool = False
    gzip_bodies: bool = True
    max_concurrent_ingest: int = DEFAULT_MAX_CONCURRENT_INGEST
