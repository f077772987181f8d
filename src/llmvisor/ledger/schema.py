"""The ledger's tables, one definition shared by the store, the service and the tests.

Seconds are stored as integer nanoseconds (``*_ns``) so that sums are exact in SQL on every backend: a
tenant's total plus the other tenants' totals equals the measured total to the nanosecond, whatever the
order of summation. Times are integer microseconds since the Unix epoch (``*_us``), so time buckets are
integer divisions that SQLite and PostgreSQL compute alike.

Schema 2 keeps one row per step (the idempotency key, measured and predicted time), each ingest's slices
as one compressed Parquet blob (the detail, for audits: a trace-format file with an ``attributed_ns``
column), and usage per request per second of step start, which every usage query reads. A row per slice
(schema 1) made the database most of the ingest cost; per second, a request has one row instead of one per
step, and a second is finer than any bill.

Schema 3 adds engine classes: each step records the engine fingerprint id it ran on (``engine_class``),
the registry version of the model that attributed it (``model_version``, NULL for the service's default
model) and whether it is still ``pending`` (its class had no active model: its measured time is stored, its
slices are kept in its batch's blob, and it is attributed, once, when a model of its class is activated).
Fitted models are kept per class and version in ``engine_models``; ``active_models`` names the version
attributing each class.

Schema 4 adds ``step_ranges``: the step ids received per run as merged ranges (a run instance numbers its steps
0, 1, 2, ...), so the steps a run is missing — ids below its highest received id that never arrived — are a
query over a few rows per run instead of a scan of its steps (`Ledger.run_gaps`).

``adjustments`` (schema 4 too) holds
corrections of past bills: when a later model version of a class prices a period better, ``llmvisor adjust``
writes one entry per tenant and period, the re-attributed minus the billed time, naming both model versions. A
bill already written is never rewritten; usage plus its adjustments is what the tenant owes.

Schema 5 (billing, `llmvisor.billing`) adds ``prices``: a price book per engine class, versioned like the models. Each
version is in force from ``valid_from_us`` on (until a later one of the class starts), so usage becomes cost with the
price of its time; prices are exact decimal strings, never floats.
Schema 5 (window aggregates, `llmvisor.metering`) adds ``windows``, ``window_tenant_usage`` and
``request_totals``; see their block at the end of this module.

Schema 6 (token prices) splits the new tokens of every usage row (``usage_per_second``, ``window_tenant_usage``,
``request_totals``) into ``num_uncached_prompt_tokens`` (prefill slices' new tokens: prompt tokens the engine
computed), ``num_cached_prompt_tokens`` (prompt tokens found in the prefix cache when the request was first
scheduled, where the step said so; 0 where it did not) and ``num_output_tokens`` (decode slices' new tokens), so a
price per prompt and output token has exact counts to multiply (`TOKEN_SPLIT_COLUMNS`). NULL: a row stored before
schema 6 (a migrated one), whose split is unknown; a sum onto such a row stays NULL (an unknown part keeps the
whole unknown), and a token price refuses to price it (`llmvisor.billing.charges`) instead of reading it as 0.

Schema 7 (fleet scale, issue #22) replaces schema 5's ``window_tenant_usage`` (a row per engine window and tenant:
79 bytes of table per step at 1,000 engines) with ``tenant_seconds``: per write transaction, one row per tenant,
engine class, model version and second, summed over every window that transaction stores (a service process
commits the windows of concurrent POSTs together, `Ledger.ingest_windows`), so its rows grow with tenants and
seconds, not with engines. ``request_totals`` is kept only where the service is asked to
(``LLMVISOR_REQUEST_TOTALS``, on by default): at fleet scale a request's usage comes from the raw-step archive.

Schema 8 adds new tables only (its block at the end of this module), so a schema-7 ledger is upgraded in place: the
missing tables are created and the version recorded (`SCHEMA_8_TABLES`, `llmvisor.ledger.store.Ledger`). Billing
(issue #36): ``billing_lines`` (every exported line's content, per line and revision), ``line_exports`` (which lines
each export format has written or pushed) and ``closed_periods`` (billing months closed, what they billed frozen in
``billing_lines``).

Schema 9 (KV memory-time, issue #37) adds nullable columns only, so schemas 7 and 8 are upgraded in place
(`SCHEMA_9_COLUMNS`): every usage row (``usage_per_second``; ``tenant_seconds`` and ``request_totals`` for window
mode, which leaves them NULL until the edge meters memory) gains ``kv_block_ns``, the KV block-nanoseconds its slices
held (trace format 3), and ``kv_block_bytes``, the bytes of one block of its run, so GiB-seconds are exact
(Σ block-ns × block bytes / 2^30 / 10^9, summed per block size, `llmvisor.core.kv_memory.gib_seconds`). NULL: not
metered (a trace of format 1 or 2, or a row stored before schema 9): such usage is billed for time only. Block-ns are
kept, not byte-ns: a tenant's hour of byte-ns can pass 2^63, its block-ns cannot. Sums over many rows are taken in
two 31-bit halves (`llmvisor.ledger.usage.kv_sums`), so SQLite's 64-bit SUM never overflows. The per-step figures
(interval, idle cache, free, carried in and out, pool) stay in the step's slice blob, as the trace has them.
``billing_lines`` gains ``kv_block_bytes``: a memory line's block size (its quantity is block-ns); ``prices`` gains
``gib_hour_price``, the price per GiB-hour of KV cache held (NULL: memory not priced).

Schema 10 (LoRA adapters, issue #38) adds one nullable column, ``lora_name``, so schemas 7 to 9 are upgraded in place
(`SCHEMA_10_COLUMNS`): the adapter a usage row's requests ran (trace format 4, window format 3). On
``usage_per_second`` and ``request_totals`` it is the request's (a request runs one adapter); ``tenant_seconds`` is
keyed by it too, so a tenant's usage can be read and billed per adapter. NULL: the base model, or stored before
schema 10 (a ledger before LoRA held base-model usage only), so a base-model-only ledger's rows are what they were.
``billing_lines`` gains it too: a line of usage billed per adapter (`llmvisor export --by-adapter`).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from llmvisor.core.tokens import TOKEN_SPLIT

SCHEMA_VERSION = 10
IN_PLACE_UPGRADES = ("7", "8", "9")
"""Versions a ledger is upgraded from when opened: each later schema only added tables (`SCHEMA_8_TABLES`) and
nullable columns (`SCHEMA_9_COLUMNS`, `SCHEMA_10_COLUMNS`)."""
LORA_USAGE_COLUMN = "lora_name"
"""Schema 10's adapter of a usage row (module note); NULL for the base model."""
KV_USAGE_COLUMNS = ("kv_block_ns", "kv_block_bytes")
"""Schema 9's KV memory-time of a usage row (module note); NULL where not metered."""
TOKEN_SPLIT_COLUMNS = TOKEN_SPLIT
"""Schema 6's token split of a usage row's tokens (module note); NULL where stored before schema 6."""
USAGE_RESOLUTION_US = 1_000_000
"""Usage is kept per second of step start, so usage queries take time ranges in whole seconds."""

metadata = MetaData()

# SQLite autoincrements only an INTEGER PRIMARY KEY (which is 64-bit there).
_AutoincrementId = BigInteger().with_variant(Integer, "sqlite")

ledger_info = Table(
    "ledger_info",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

slice_batches = Table(
    "slice_batches",
    metadata,
    Column("batch_id", _AutoincrementId, primary_key=True, autoincrement=True),
    Column("ingested_at_us", BigInteger, nullable=False),
    Column("num_steps", Integer, nullable=False),
    Column("num_slices", Integer, nullable=False),
    Column("slices_parquet", LargeBinary, nullable=False, doc="the steps' slices as a trace-format Parquet file"),
)

steps = Table(
    "steps",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("step_id", BigInteger, primary_key=True, autoincrement=False),
    Column("measured_ns", BigInteger, nullable=False),
    Column("predicted_s", Float, nullable=True, doc="the model's prediction, for residuals; not billed; NULL while pending"),
    Column("batch_size", Integer, nullable=False),
    Column("timestamp_us", BigInteger, nullable=False, doc="step start (trace timestamp_s, else ingest time)"),
    Column("ingested_at_us", BigInteger, nullable=False),
    Column("content_sha256", LargeBinary(32), nullable=False, doc="canonical content, for idempotent re-sends"),
    Column("slice_batch_id", BigInteger, ForeignKey("slice_batches.batch_id"), nullable=False),
    Column("engine_class", Text, nullable=False, doc="engine fingerprint id of the step ('' where it carried none)"),
    Column("model_version", Integer, nullable=True, doc="registry version that attributed it; NULL: default model or pending"),
    Column("pending", Boolean, nullable=False, doc="stored unattributed: its class had no active model"),
    Index("ix_steps_timestamp_us", "timestamp_us"),
    Index("ix_steps_class_pending", "engine_class", "pending"),
)

usage_per_second = Table(
    "usage_per_second",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("request_id", Text, primary_key=True),
    Column("tenant", Text, primary_key=True),
    Column("second_us", BigInteger, primary_key=True, autoincrement=False, doc="start of the second its steps started in"),
    Column("attributed_ns", BigInteger, nullable=False),
    Column("num_slices", BigInteger, nullable=False, doc="steps the request ran in during this second"),
    Column("num_new_tokens", BigInteger, nullable=False),
    Column("first_timestamp_us", BigInteger, nullable=False),
    Column("last_timestamp_us", BigInteger, nullable=False),
    *(Column(name, BigInteger, nullable=True, doc="schema 6 token split; NULL: stored before it") for name in TOKEN_SPLIT_COLUMNS),
    *(Column(name, BigInteger, nullable=True, doc="schema 9 KV memory-time; NULL: not metered") for name in KV_USAGE_COLUMNS),
    Column(LORA_USAGE_COLUMN, Text, nullable=True, doc="schema 10: the request's LoRA adapter; NULL: the base model"),
    Index("ix_usage_per_second_tenant_second_us", "tenant", "second_us"),
    Index("ix_usage_per_second_second_us", "second_us"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("secret_sha256", LargeBinary(32), nullable=False),
    Column("tenant", Text, nullable=True, doc="the tenant a tenant key reads; null for admin keys"),
    Column("is_admin", Boolean, nullable=False),
    Column("created_at_us", BigInteger, nullable=False),
    Column("revoked_at_us", BigInteger, nullable=True),
)

engine_models = Table(
    "engine_models",
    metadata,
    Column("engine_class", Text, primary_key=True),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("model_json", Text, nullable=False, doc="the fitted model (`StepLatencyModel.to_dict`) as JSON"),
    Column("source", Text, nullable=False, doc="where it came from: a file name, or a refit's summary"),
    Column("created_at_us", BigInteger, nullable=False),
)

active_models = Table(
    "active_models",
    metadata,
    Column("engine_class", Text, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("activated_at_us", BigInteger, nullable=False),
)

step_ranges = Table(
    "step_ranges",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("first_step_id", BigInteger, primary_key=True, autoincrement=False),
    Column("last_step_id", BigInteger, nullable=False, doc="inclusive: every id first..last of the run is stored"),
    Column("engine_class", Text, nullable=False, doc="engine class of the run's steps in the range (first seen)"),
    Column("first_received_us", BigInteger, nullable=False, doc="when the range's first step was stored (earliest)"),
)
"""Merged on insert (adjacent ranges join), under a per-run lock on PostgreSQL: concurrent service processes
storing steps of one run take turns on its ranges."""

adjustments = Table(
    "adjustments",
    metadata,
    Column("engine_class", Text, primary_key=True),
    Column("period_start_us", BigInteger, primary_key=True, autoincrement=False, doc="steps starting at or after this"),
    Column("period_end_us", BigInteger, primary_key=True, autoincrement=False, doc="steps starting before this"),
    Column("to_version", Integer, primary_key=True, autoincrement=False, doc="the registry version that re-attributed"),
    Column("tenant", Text, primary_key=True),
    Column("from_versions", Text, nullable=False, doc="the versions that billed the steps ('default' for the service's model), comma-separated"),
    Column("billed_ns", BigInteger, nullable=False, doc="the tenant's time in the period as billed before this entry, earlier adjustments included"),
    Column("reattributed_ns", BigInteger, nullable=False),
    Column("delta_ns", BigInteger, nullable=False, doc="reattributed − billed: negative is a credit"),
    Column("num_steps", BigInteger, nullable=False, doc="steps of the period the tenant ran in"),
    Column("created_at_us", BigInteger, nullable=False),
    Index("ix_adjustments_tenant", "tenant"),
)

# --- schema 5: billing (price book) -------------------------------------------------------------------------------
prices = Table(
    "prices",
    metadata,
    Column("engine_class", Text, primary_key=True),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("valid_from_us", BigInteger, nullable=False, doc="in force for usage at or after this (a whole hour)"),
    Column("currency", String(3), nullable=False, doc="ISO 4217 code"),
    Column("engine_hour_price", Text, nullable=False, doc="price per engine-hour, an exact decimal string"),
    Column("prompt_token_price", Text, nullable=True, doc="price per prompt token, an exact decimal string; NULL: none"),
    Column("output_token_price", Text, nullable=True, doc="price per output token; NULL: none"),
    Column("cached_token_discount", Text, nullable=True, doc="fraction in [0, 1] off the prompt price for cached prompt tokens; NULL: 0"),
    Column("gib_hour_price", Text, nullable=True, doc="schema 9: price per GiB-hour of KV cache held, an exact decimal string; NULL: none"),
    Column("source", Text, nullable=False, doc="the price file it came from"),
    Column("created_at_us", BigInteger, nullable=False),
    Index("ix_prices_class_valid_from", "engine_class", "valid_from_us"),
)
# --- end of schema 5: billing -------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------
# Schema 5: window aggregates (issue #22). Engines attribute at the edge and send one aggregate per run
# instance and window (`llmvisor.metering.WindowAggregate`, POST /v1/windows) instead of every step: the
# ledger keeps a row per window (the idempotency key, measured time, residual statistics for drift), per commit a
# row per tenant, class, version and second (what bills read; schema 7, ``tenant_seconds``) and, where kept, a row per
# request (accumulated over its windows), not a row per step.
# The windows' step-id ranges go to ``step_ranges`` like stored steps', so gaps show the same either way.

windows = Table(
    "windows",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("window_start_us", BigInteger, primary_key=True, autoincrement=False, doc="steps starting at or after this"),
    Column("window_end_us", BigInteger, nullable=False, doc="steps starting before this"),
    Column("engine_class", Text, nullable=False),
    Column("model_version", Integer, nullable=True, doc="registry version that attributed it at the edge; NULL: pending"),
    Column("pending", Boolean, nullable=False, doc="its class had no active model: measured time kept, nothing attributed"),
    Column("num_steps", BigInteger, nullable=False),
    Column("measured_ns", BigInteger, nullable=False),
    Column("attributed_ns", BigInteger, nullable=False, doc="= measured_ns exactly, or 0 while pending"),
    Column("residual_count", BigInteger, nullable=False),
    Column("residual_sum_s", Float, nullable=False),
    Column("residual_sum_sq_s2", Float, nullable=False),
    Column("residual_min_s", Float, nullable=True),
    Column("residual_max_s", Float, nullable=True),
    Column("content_sha256", LargeBinary(32), nullable=False, doc="canonical JSON of the aggregate, for idempotent re-sends"),
    Column("ingested_at_us", BigInteger, nullable=False),
)
"""Read by run (its key) only: schema 7 dropped schema 5's index on ``window_start_us``, which no query used."""

tenant_seconds = Table(
    "tenant_seconds",
    metadata,
    Column("tenant", Text, nullable=False),
    Column("engine_class", Text, nullable=False),
    Column("model_version", Integer, nullable=False, doc="registry version that attributed it at the edge; 0: pending windows"),
    Column("second_us", BigInteger, nullable=False, doc="the second its windows start in: usage queries' time key"),
    Column("attributed_ns", BigInteger, nullable=False),
    Column("measured_ns", BigInteger, nullable=False, doc="Σ over the tenant's requests of their steps' measured time"),
    Column("num_slices", BigInteger, nullable=False),
    Column("num_new_tokens", BigInteger, nullable=False),
    *(Column(name, BigInteger, nullable=True, doc="schema 6 token split; NULL: unknown") for name in TOKEN_SPLIT_COLUMNS),
    *(Column(name, BigInteger, nullable=True, doc="schema 9 KV memory-time; NULL: not metered (window mode, so far)")
      for name in KV_USAGE_COLUMNS),
    Column(LORA_USAGE_COLUMN, Text, nullable=True, doc="schema 10: the LoRA adapter of the usage; NULL: the base model"),
    Index("ix_tenant_seconds_tenant_second_us", "tenant", "second_us"),
    Index("ix_tenant_seconds_second_us", "second_us"),
)
"""Insert-only (schema 7): each write transaction of windows adds its own rows, summed over its windows; readers sum
the rows of a key. No row is updated, so concurrent service processes never wait on one another's rows."""

request_totals = Table(
    "request_totals",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("request_id", Text, primary_key=True),
    Column("tenant", Text, primary_key=True),
    Column("first_second_us", BigInteger, nullable=False, doc="the second of its first window: usage queries' time key"),
    Column("attributed_ns", BigInteger, nullable=False),
    Column("measured_ns", BigInteger, nullable=False),
    Column("num_slices", BigInteger, nullable=False),
    Column("num_new_tokens", BigInteger, nullable=False),
    Column("first_timestamp_us", BigInteger, nullable=False),
    Column("last_timestamp_us", BigInteger, nullable=False),
    *(Column(name, BigInteger, nullable=True, doc="schema 6 token split; NULL: stored before it") for name in TOKEN_SPLIT_COLUMNS),
    *(Column(name, BigInteger, nullable=True, doc="schema 9 KV memory-time; NULL: not metered (window mode, so far)")
      for name in KV_USAGE_COLUMNS),
    Column(LORA_USAGE_COLUMN, Text, nullable=True, doc="schema 10: the request's LoRA adapter; NULL: the base model"),
    Index("ix_request_totals_tenant", "tenant"),
)
"""One row per request, summed over its windows as they arrive (each window is stored once, so adding is safe)."""


# ---------------------------------------------------------------------------------------------------------
# Schema 8: new tables only (a schema-7 ledger gains them in place when opened).
#
# Runs (issue #36): ``run_digests`` keeps, per run, a content digest of its first step (step 0, or the window that
# covers it) with the run id left out, so a run re-sent under a new run id is refused instead of billed twice
# (``duplicate_runs`` remembers the refusal, so the rest of such a run is refused too);
# ``run_ends`` keeps the end-of-run record a recorder's delivery process sends when the engine stops (its last step id
# and how many steps it recorded), so steps lost after the last one stored show as a gap.

run_digests = Table(
    "run_digests",
    metadata,
    Column("digest", LargeBinary(32), primary_key=True, doc="SHA-256 of the run's first step (or first window) without its run id"),
    Column("run_id", Text, nullable=False, doc="the run stored first with this content"),
    Column("form", String(16), nullable=False, doc="'step' (POST /v1/steps) or 'window' (POST /v1/windows)"),
    Column("created_at_us", BigInteger, nullable=False),
)
"""Looked up by digest once per new run (the batch or window that carries its step 0), never per step."""

duplicate_runs = Table(
    "duplicate_runs",
    metadata,
    Column("run_id", Text, primary_key=True, doc="a run refused as a re-send of another under a new run id"),
    Column("duplicate_of", Text, nullable=False, doc="the run it repeats"),
    Column("form", String(16), nullable=False, doc="what repeated: 'step' (step 0) or 'window' (the window covering it)"),
    Column("refused_at_us", BigInteger, nullable=False),
)
"""Written when a run's first step is refused, so its later steps and windows are refused too (one lookup per batch
or group commit of the runs in it), not stored as a run without its step 0."""

run_ends = Table(
    "run_ends",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("last_step_id", BigInteger, nullable=False, doc="the last step id the recorder recorded (-1: none)"),
    Column("num_steps", BigInteger, nullable=False, doc="steps the recorder recorded"),
    Column("received_at_us", BigInteger, nullable=False, doc="when the record was stored: a gap it opens is that old"),
)
"""One row per ended run; a run without one is open (still running, or it ended without a clean shutdown)."""

#
# Billing (issue #36, `llmvisor.billing.periods`): an exported line's id names one immutable content. A charge's
# line (``line_key``: kind, tenant, charge period, class, version, adjusted-from versions, item) is recorded with
# revision 0 the first time it is exported; usage stored for it later is never merged into it but becomes the next
# revision, a correction line of the difference, with an id of its own.

billing_lines = Table(
    "billing_lines",
    metadata,
    Column("line_id", Text, primary_key=True, doc="the idempotency id every export format carries (uuid5)"),
    Column("line_key", Text, nullable=False, doc="the charge the line is of; revisions of one charge share it"),
    Column("revision", Integer, nullable=False, doc="0: the first line of the charge; 1, 2, ...: its corrections"),
    Column("kind", Text, nullable=False, doc="usage or adjustment"),
    Column("tenant", Text, nullable=False),
    Column("engine_class", Text, nullable=False),
    Column("model_version", Integer, nullable=False),
    Column("from_versions", Text, nullable=False),
    Column("item", Text, nullable=False, doc="engine_time or a kind of token"),
    Column("charge_start_us", BigInteger, nullable=False),
    Column("charge_end_us", BigInteger, nullable=False),
    Column("period_start_us", BigInteger, nullable=False, doc="the billing period (calendar UTC month) of the charge"),
    Column("billed_period_start_us", BigInteger, nullable=False,
           doc="the billing period the line is billed in: the charge's own, or for a correction of a closed one the month it was made"),
    Column("quantity", BigInteger, nullable=False, doc="this line's engine ns (a correction: the difference) or tokens"),
    Column("num_new_tokens", BigInteger, nullable=False),
    *(Column(name, BigInteger, nullable=True, doc="this line's token split (a correction: the difference); NULL: unknown")
      for name in TOKEN_SPLIT_COLUMNS),
    Column("currency", String(3), nullable=True, doc="NULL: unpriced"),
    Column("exact_cost", Text, nullable=True, doc="this line's exact amount, a fraction 'p/q'; NULL: unpriced"),
    Column("cost", Text, nullable=True, doc="this line's cents (decimal string), remainders carried within the period"),
    Column("created_at_us", BigInteger, nullable=False),
    Column("kv_block_bytes", BigInteger, nullable=True, doc="schema 9: a KV memory line's bytes per block (its quantity is block-ns)"),
    Column(LORA_USAGE_COLUMN, Text, nullable=True, doc="schema 10: the LoRA adapter of a line billed per adapter; NULL: not split by adapter"),
    UniqueConstraint("line_key", "revision", name="uq_billing_lines_key_revision"),
    Index("ix_billing_lines_period_start_us", "period_start_us"),
)
"""Insert-only: a recorded line is never changed, so one id always names the same content."""

line_exports = Table(
    "line_exports",
    metadata,
    Column("format", Text, primary_key=True, doc="focus, cloudevents, stripe or lago"),
    Column("line_id", Text, primary_key=True),
    Column("exported_at_us", BigInteger, nullable=False, doc="when the file was written or the push acknowledged"),
)
"""A line counts as exported in a format once its file was written or every body of its push was acknowledged."""

closed_periods = Table(
    "closed_periods",
    metadata,
    Column("period_start_us", BigInteger, primary_key=True, autoincrement=False, doc="a calendar UTC month"),
    Column("period_end_us", BigInteger, nullable=False),
    Column("closed_at_us", BigInteger, nullable=False),
    Column("closed_by", Text, nullable=False, doc="close-period, or export (LLMVISOR_CLOSE_PERIOD_AFTER_S after the end)"),
    Column("num_lines", BigInteger, nullable=False, doc="lines of the period in billing_lines when it was closed"),
)

SCHEMA_8_TABLES = (run_digests, duplicate_runs, run_ends, billing_lines, line_exports, closed_periods)
"""Created on opening a schema-7 ledger (`IN_PLACE_UPGRADES`); existing tables are not touched."""

SCHEMA_9_COLUMNS = (
    *((usage_per_second, name) for name in KV_USAGE_COLUMNS),
    *((tenant_seconds, name) for name in KV_USAGE_COLUMNS),
    *((request_totals, name) for name in KV_USAGE_COLUMNS),
    (billing_lines, "kv_block_bytes"),
    (prices, "gib_hour_price"),
)
"""Nullable columns added to a schema-7 or schema-8 ledger when opened (`IN_PLACE_UPGRADES`), where missing."""

SCHEMA_10_COLUMNS = tuple((table, LORA_USAGE_COLUMN) for table in (usage_per_second, tenant_seconds, request_totals, billing_lines))
"""Schema 10's nullable adapter column, added to a schema-7, -8 or -9 ledger when opened, where missing."""
