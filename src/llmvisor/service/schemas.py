"""Request and response bodies of the HTTP API, by role: ingest, usage, audit, keys.

They validate the small inputs and document every answer in the OpenAPI document; the large ingest bodies
are parsed by `llmvisor.service.ingest`, so `STEP_BATCH_SCHEMA` only describes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from llmvisor.errors import unknown_name
from llmvisor.service.ingest import MAX_STRING_CHARS

# ---------------------------------------------------------------------------------------------------------
# Ingest


class StrictBody(BaseModel):
    """A write body: an unknown field is a 422 naming it and the closest known name (``unknown field activte; did
    you mean activate?``), since a misspelled optional field ignored would change what is billed or done without a
    word. The check runs before the fields' own (``extra="forbid"`` stays as the schema's ``additionalProperties``)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data):
        if isinstance(data, dict):
            unknown = unknown_name(data, cls.model_fields)
            if unknown:
                raise PydanticCustomError("unknown_field", unknown)
        return data


class TraceRow(StrictBody):
    """One request slice of one step, as in the step-trace format (`docs/trace-format.md`): the OpenAPI schema of a
    row (`llmvisor.service.ingest` parses the bodies). Its fields are the format's known columns, no more."""

    run_id: str
    step_id: int
    step_latency_s: float = Field(gt=0)
    request_id: str
    tenant: str
    num_new_tokens: int = Field(ge=1)
    num_context_tokens: int = Field(ge=0)
    phase: Literal["prefill", "decode"]
    timestamp_s: float | None = Field(None, ge=0, description="step start, Unix seconds; else the time received")
    engine_fingerprint: str | None = Field(None, pattern="^[0-9a-f]{16}$", description="the engine class: its fingerprint id")
    num_cached_prompt_tokens: int | None = Field(None, ge=0, description="prompt tokens the prefix cache served")
    num_shared_context_tokens: int | None = Field(None, ge=0, description="format v2: context tokens in KV blocks other slices read")
    effective_context_tokens: float | None = Field(None, ge=0, description="format v2: context with each block divided among its readers")
    is_warmup: bool | None = None
    is_drifted: bool | None = None
    engine: str | None = None
    engine_version: str | None = None
    model: str | None = None
    hardware: str | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    model_version: int | None = Field(None, ge=1)
    episode: str | None = None


_ROW_SCHEMA = TraceRow.model_json_schema()
STEP_BATCH_SCHEMA = {
    "oneOf": [
        {
            "title": "StepsAsRows",
            "type": "object",
            "required": ["steps"],
            "properties": {
                "steps": {
                    "type": "array",
                    "description": "One list per step holding all of that step's rows.",
                    "items": {"type": "array", "minItems": 1, "items": _ROW_SCHEMA},
                }
            },
        },
        {
            "title": "StepsAsColumns",
            "type": "object",
            "required": ["columns"],
            "properties": {
                "columns": {
                    "type": "object",
                    "description": "The rows of whole steps, one list per column, all of one length (cheaper to validate).",
                    "required": _ROW_SCHEMA["required"],
                    "properties": {
                        name: {"type": "array", "items": {k: v for k, v in prop.items() if k != "title"}}
                        for name, prop in _ROW_SCHEMA["properties"].items()
                    },
                }
            },
        },
    ]
}


class IngestResponse(BaseModel):
    steps_received: int
    steps_inserted: int
    steps_duplicate: int = Field(description="already stored with identical content: acknowledged, not counted again")
    slices_inserted: int
    attributed_ns: int = Field(description="seconds newly attributed by this batch, in integer nanoseconds")
    steps_pending: int = Field(0, description="new steps stored pending: their engine class has no active model yet")


# ---------------------------------------------------------------------------------------------------------
# Usage


KV_BLOCK_NS = Field(None, description="KV block-nanoseconds held, exact (trace format 3); null: not metered")
KV_BYTE_NS = Field(None, description="Σ block-ns × bytes per block of their run: exact byte-nanoseconds")
KV_GIB_S = Field(None, description="GiB-seconds held: kv_byte_ns / 2^30 / 1e9")
"""KV memory-time beside engine time (trace format 3), the last fields of each usage model (`kv_memory` fills them),
after the fields they had before, so answers keep their order."""


def kv_memory(block_ns: int | None, byte_ns: int | None) -> dict:
    """The KV memory fields (``kv_block_ns``, ``kv_byte_ns``, ``kv_gib_s``) of a usage row's block-ns and byte-ns."""
    return {"kv_block_ns": block_ns, "kv_byte_ns": byte_ns, "kv_gib_s": None if byte_ns is None else byte_ns / 2**30 / 1e9}


class BucketUsage(BaseModel):
    start: datetime
    attributed_s: float
    attributed_ns: int
    num_slices: int
    num_new_tokens: int
    kv_block_ns: int | None = KV_BLOCK_NS
    kv_byte_ns: int | None = KV_BYTE_NS
    kv_gib_s: float | None = KV_GIB_S


class AdapterUsage(BaseModel):
    """One tenant's usage of one LoRA adapter (``group_by=adapter``)."""

    lora_adapter: str = Field(description="the LoRA adapter its requests ran; '' the base model")
    attributed_s: float
    attributed_ns: int
    num_slices: int
    num_new_tokens: int
    kv_block_ns: int | None = KV_BLOCK_NS
    kv_byte_ns: int | None = KV_BYTE_NS
    kv_gib_s: float | None = KV_GIB_S


class TenantUsage(BaseModel):
    tenant: str
    attributed_s: float
    attributed_ns: int = Field(description="exact total; attributed_s is this divided by 1e9")
    num_slices: int
    num_new_tokens: int
    buckets: list[BucketUsage] | None = None
    adjustments_ns: int = Field(0, description="Σ delta_ns of the adjustments whose whole period lies in the range (/v1/adjustments)")
    adjusted_ns: int = Field(0, description="attributed_ns + adjustments_ns: what the tenant owes after corrections")
    cost: dict[str, str] | None = Field(None, description=(
        "what the tenant owes, per currency (ISO 4217 code to an exact decimal string), when a price is in force: the "
        "costs of its hourly charges in the range and of the adjustments whose period starts in it, each rounded half "
        "to even to the cent (docs/billing.md). Null when nothing is priced, or when a bound of the range is not a "
        "whole UTC hour (charges are hourly)"))
    kv_block_ns: int | None = KV_BLOCK_NS
    kv_byte_ns: int | None = KV_BYTE_NS
    kv_gib_s: float | None = KV_GIB_S
    adapters: list[AdapterUsage] | None = Field(None, description=(
        "with group_by=adapter: the tenant's usage per LoRA adapter ('' the base model), summing to its own; null otherwise"))


class AdjustmentOut(BaseModel):
    engine_class: str
    period_start: datetime
    period_end: datetime
    tenant: str
    from_versions: str = Field(description="the model versions that billed the period ('default': the service's model)")
    to_version: int = Field(description="the model version that re-attributed it")
    billed_ns: int = Field(description="the tenant's time in the period as billed before this entry, earlier adjustments included")
    reattributed_ns: int
    delta_ns: int = Field(description="reattributed_ns − billed_ns; negative is a credit")
    delta_s: float
    num_steps: int
    created_at: datetime


class AdjustmentsResponse(BaseModel):
    adjustments: list[AdjustmentOut]


class TenantUsageResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    bucket: str | None
    tenants: list[TenantUsage]


class RequestUsage(BaseModel):
    run_id: str
    request_id: str
    tenant: str
    attributed_s: float
    attributed_ns: int
    num_steps: int
    num_new_tokens: int
    first_step_at: datetime
    last_step_at: datetime
    kv_block_ns: int | None = KV_BLOCK_NS
    kv_byte_ns: int | None = KV_BYTE_NS
    kv_gib_s: float | None = KV_GIB_S
    lora_adapter: str = Field("", description="the LoRA adapter the request ran (trace format 4); '' the base model")


class RequestUsageResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    requests: list[RequestUsage]


class TopResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    tenants: list[TenantUsage]


class TotalsResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    num_steps: int
    measured_s: float
    measured_ns: int
    num_slices: int
    attributed_s: float
    attributed_ns: int = Field(description="equals measured_ns: every measured nanosecond is billed once")
    pending_steps: int = Field(0, description="steps stored pending (not in num_steps): their class has no model yet")
    pending_measured_ns: int = Field(0, description="their measured time, billed once they are attributed")
    kv_block_ns: int | None = KV_BLOCK_NS
    kv_byte_ns: int | None = KV_BYTE_NS
    kv_gib_s: float | None = KV_GIB_S


# ---------------------------------------------------------------------------------------------------------
# Audit


class SliceShareOut(BaseModel):
    request_id: str
    tenant: str
    num_new_tokens: int
    num_context_tokens: int
    phase: str
    attributed_s: float
    attributed_ns: int
    kv_block_ns: int | None = Field(None, description="KV block-ns the request held since its previous slice (format 3)")


class StepOut(BaseModel):
    run_id: str
    step_id: int
    measured_s: float
    measured_ns: int
    predicted_s: float | None = Field(description="the model's prediction of the whole step; null while pending")
    engine_class: str = Field("", description="engine fingerprint id of the step ('' where none)")
    model_version: int | None = Field(None, description="registry version that attributed it; null: the default model, or pending")
    pending: bool = Field(False, description="stored unattributed until a model of its class is activated (shares 0)")
    started_at: datetime
    ingested_at: datetime
    content_sha256: str = Field(description="hex digest of the step's canonical content (idempotency key)")
    slices: list[SliceShareOut] = Field(description="by request id; attributed_ns sum to measured_ns")


# ---------------------------------------------------------------------------------------------------------
# Keys


class KeyCreate(StrictBody):
    tenant: str | None = Field(None, min_length=1, max_length=MAX_STRING_CHARS)
    admin: bool = False


class KeyCreated(BaseModel):
    key: str = Field(description="shown once; only a hash is stored")
    key_id: str
    tenant: str | None
    is_admin: bool


class KeyDescription(BaseModel):
    key_id: str
    tenant: str | None
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None


class WhoAmI(BaseModel):
    key_id: str
    tenant: str | None
    is_admin: bool


# ---------------------------------------------------------------------------------------------------------
# Model registry and drift


class ModelAdd(StrictBody):
    model: dict = Field(description="a fitted model file's JSON (`llmvisor fit -o`)")
    engine_class: str | None = Field(None, max_length=512, description="fingerprint id; default: the one the model was fitted on")
    activate: bool = False


class ModelVersionOut(BaseModel):
    engine_class: str
    version: int
    source: str
    created_at: datetime
    active: bool


class ActivationOut(BaseModel):
    engine_class: str
    version: int
    pending_steps_attributed: int
    pending_attributed_ns: int


class ClassDriftOut(BaseModel):
    engine_class: str
    active_version: int | None
    window_steps: int
    relative_residual: dict[str, float] = Field(description="quantiles of (measured - predicted) / measured")
    abs_relative_residual: dict[str, float] = Field(description="quantiles of |measured - predicted| / measured")
    median_relative_residual: float | None
    out_of_band_steps: int
    alarm: bool


class DriftOut(BaseModel):
    band: float
    window_steps: int
    min_window_steps: int
    alarm_after_steps: int
    classes: list[ClassDriftOut]
