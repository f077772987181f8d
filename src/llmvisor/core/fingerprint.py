"""The engine fingerprint: what an engine's step cost depends on, with a stable id; engine-free.

A latency model fitted on one engine prices another engine's steps wrongly: a different model config, dtype,
core count, batch limits, KV block size, vLLM version or parallel layout changes what a step costs. The
recorder fills an `EngineFingerprint` from the vLLM config (``llmvisor.engines.vllm.fingerprint``), writes
its ``id`` on every trace row (column ``engine_fingerprint``) and the whole record in a profile's trace
metadata; a fitted model keeps the fingerprint of its training trace, and the service and `FairScheduler`
compare ids before they attribute.

The id hashes the identity fields only. ``model`` (a folder name), ``max_model_len``, ``core_ids`` and
``executor_backend`` are recorded for the operator (and for `llmvisor calibrate`, which profiles with the same
settings, pinned to the same cores) but are not part of the identity: the model config hash says what the model
is, the longest sequence allowed changes no step's cost, the same engine on other cores of the same machine
costs the same, and a profile runs the engine in-process (``uni``) where the OpenAI server runs a worker
process (``mp``; its per-step hand-over is part of a served step, which is why a model fitted on the served
engine's own steps is the closer calibration, see ``llmvisor calibrate --from-trace``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from llmvisor.errors import LlmvisorError

FINGERPRINT_COLUMN = "engine_fingerprint"
"""Optional trace column: the fingerprint id of the engine that ran the step."""
METADATA_KEY = "engine_fingerprint"
"""Trace metadata key (and model file key) holding the fingerprint as a dict (`EngineFingerprint.to_dict`)."""
ID_HEX_DIGITS = 16
SIDECAR_SUFFIX = ".engine.json"
"""The recorder writes the engine's fingerprint record beside a trace it records: ``<trace path><suffix>``."""
INFORMATIONAL_FIELDS = ("model", "max_model_len", "core_ids", "executor_backend")
OPTIONAL_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", *INFORMATIONAL_FIELDS)
IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures_path"})


def fingerprint_sidecar(trace_path: str | os.PathLike) -> Path:
    return Path(f"{trace_path}{SIDECAR_SUFFIX}")


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def model_config_hash(config: dict) -> str:
    """A hash of a model config (Hugging Face ``config.json`` as a dict) that ignores where it was loaded from."""
    kept = {key: value for key, value in config.items() if key not in IGNORED_CONFIG_KEYS}
    return hashlib.sha256(canonical_json(kept).encode()).hexdigest()[:ID_HEX_DIGITS]


@dataclass(frozen=True)
class EngineFingerprint:
    engine: str
    engine_version: str
    model_config_hash: str
    dtype: str
    device: str
    """``cpu``, or the accelerator's name."""
    hardware: str
    """The CPU model or accelerator name (without thread counts)."""
    threads: int
    """OpenMP/torch threads of the worker that runs the model (1 per core bound on vLLM's CPU build)."""
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    async_scheduling: bool
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    enforce_eager: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    model: str = field(default="", compare=False)
    max_model_len: int = field(default=0, compare=False)
    core_ids: tuple[int, ...] = field(default=(), compare=False)
    executor_backend: str = field(default="", compare=False)

    def identity(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in INFORMATIONAL_FIELDS}

    @property
    def id(self) -> str:
        """A stable hash of the identity fields (hex); equal ids mean the same step cost is expected."""
        return hashlib.sha256(canonical_json(self.identity()).encode()).hexdigest()[:ID_HEX_DIGITS]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["core_ids"] = list(self.core_ids)
        return {"id": self.id, **data}

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "<memory>") -> EngineFingerprint:
        if not isinstance(data, dict):
            raise LlmvisorError(f"{source}: engine fingerprint must be a JSON object")
        names = {f.name for f in fields(cls)}
        missing = sorted(name for name in names - set(data) if name not in OPTIONAL_FIELDS)
        if missing:
            raise LlmvisorError(f"{source}: engine fingerprint lacks {', '.join(missing)}")
        values = {key: value for key, value in data.items() if key in names}
        values["core_ids"] = tuple(int(core) for core in values.get("core_ids", ()))
        fingerprint = cls(**values)
        if "id" in data and data["id"] != fingerprint.id:
            raise LlmvisorError(f"{source}: engine fingerprint id {data['id']!r} does not match its fields ({fingerprint.id})")
        return fingerprint

    def differences(self, other: EngineFingerprint) -> dict[str, tuple]:
        """Identity fields that differ: name -> (this value, other value)."""
        mine, theirs = self.identity(), other.identity()
        return {name: (mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]}


def fingerprint_id(value) -> str | None:
    """The id of a fingerprint given as an `EngineFingerprint`, its dict, or the id itself; None if none."""
    if value is None:
        return None
    if isinstance(value, EngineFingerprint):
        return value.id
    if isinstance(value, dict):
        return str(value["id"]) if value.get("id") else None
    return str(value) or None


def describe_mismatch(run_fingerprint, model_fingerprint) -> str:
    """One line naming both ids and, when both are full records, the fields that differ."""
    run_id, model_id = fingerprint_id(run_fingerprint), fingerprint_id(model_fingerprint)
    text = f"engine fingerprint {run_id} differs from the model's {model_id}"
    try:
        run = run_fingerprint if isinstance(run_fingerprint, EngineFingerprint) else EngineFingerprint.from_dict(run_fingerprint)
        model = model_fingerprint if isinstance(model_fingerprint, EngineFingerprint) else EngineFingerprint.from_dict(model_fingerprint)
    except (LlmvisorError, TypeError, ValueError):
        return text
    changed = ", ".join(f"{name} {a!r} vs {b!r}" for name, (a, b) in run.differences(model).items())
    return f"{text} ({changed})" if changed else text
