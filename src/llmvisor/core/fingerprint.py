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
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from llmvisor.errors import LlmvisorError

FINGERPRINT_COLUMN = "engine_fingerprint"
"""Optional trace column: the fingerprint id of the engine that ran the step."""
METADATA_KEY = "engine_fingerprint"
"""Trace metadata key (and model file key) holding the fingerprint as a dict (`EngineFingerprint.to_dict`)."""
ID_HEX_DIGITS = 16
ID_PATTERN = re.compile(f"[0-9a-f]{{{ID_HEX_DIGITS}}}")
SIDECAR_SUFFIX = ".engine.json"
"""The recorder writes the engine's fingerprint record beside a trace it records: ``<trace path><suffix>``."""
INFORMATIONAL_FIELDS = ("model", "max_model_len", "core_ids", "executor_backend")
FINGERPRINT_FORMAT = 2
"""The format new fingerprints are written in; records without ``fingerprint_format`` are format 1."""
FORMAT_2_FIELDS = ("fingerprint_format", "cpu_flags", "cpu_capability", "gemm_backend", "device_count", "compute_capability")
"""Identity fields format 1 did not have: left out of a format-1 record's id, so its stored id still matches."""
LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
"""The engine's LoRA settings: in the identity (and the record) only when LoRA is enabled, so every fingerprint of an
engine without LoRA keeps the id it had before these fields existed (shipped traces, models and ledgers name them)."""
OPTIONAL_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", *INFORMATIONAL_FIELDS, *FORMAT_2_FIELDS, *LORA_FIELDS)
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "svebf16",
)
"""CPU flags that decide which kernels vLLM's CPU build and torch run (x86 ``flags``, Arm ``Features``)."""
IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures_path"})


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    """The first ``model name`` (x86), else ``Model``/``cpu model``/``Hardware`` line; "CPU" if none."""
    flags: tuple[str, ...]
    """The `ISA_FLAGS` the first processor lists, in `ISA_FLAGS` order."""


CPU_NAME_KEYS = ("model name", "Model", "cpu model", "Hardware", "cpu")
CPU_FLAG_KEYS = ("flags", "Features")


def parse_cpuinfo(text: str) -> CpuInfo:
    """The CPU's name and the ISA flags that matter, from the text of ``/proc/cpuinfo`` (first processor)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        key = key.strip()
        if colon and key not in values:
            values[key] = value.strip()
    name = next((values[key] for key in CPU_NAME_KEYS if values.get(key)), "CPU")
    listed = set(next((values[key] for key in CPU_FLAG_KEYS if key in values), "").split())
    return CpuInfo(model_name=name, flags=tuple(flag for flag in ISA_FLAGS if flag in listed))


def read_cpuinfo(path: str | os.PathLike = "/proc/cpuinfo") -> CpuInfo:
    """`parse_cpuinfo` of this machine's ``/proc/cpuinfo`` (no name or flags where it cannot be read)."""
    try:
        return parse_cpuinfo(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return CpuInfo(model_name="CPU", flags=())


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
    fingerprint_format: int = FINGERPRINT_FORMAT
    cpu_flags: tuple[str, ...] = ()
    """The `ISA_FLAGS` of the CPU that runs the model (empty on a GPU engine's record where not read)."""
    cpu_capability: str = ""
    """torch's CPU dispatch level (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ...)."""
    gemm_backend: str = ""
    """What vLLM's CPU build runs dense projections with: ``onednn``, ``torch`` (its fallback) or ``zentorch``;
    empty on a GPU."""
    device_count: int = 0
    """GPUs visible to the engine (0 on CPU)."""
    compute_capability: str = ""
    """The GPU's compute capability (``9.0``); empty on CPU."""
    enable_lora: bool = False
    """LoRA adapters enabled (vLLM ``--enable-lora``): a step's cost then depends on its adapters, and the base model's
    layers run through LoRA wrappers even for base-model requests."""
    max_loras: int = 0
    """Adapters a step can run (vLLM ``--max-loras``: the LoRA slots); 0 without LoRA."""
    max_lora_rank: int = 0
    """The rank every adapter is padded to in the slots (``--max-lora-rank``); 0 without LoRA."""
    max_cpu_loras: int = 0
    """Adapters kept in memory out of the slots (``--max-cpu-loras``, default ``max_loras``); 0 without LoRA."""
    model: str = field(default="", compare=False)
    max_model_len: int = field(default=0, compare=False)
    core_ids: tuple[int, ...] = field(default=(), compare=False)
    executor_backend: str = field(default="", compare=False)

    def identity(self) -> dict:
        left_out = INFORMATIONAL_FIELDS if self.fingerprint_format >= 2 else (*INFORMATIONAL_FIELDS, *FORMAT_2_FIELDS)
        if not self.enable_lora:
            left_out = (*left_out, *LORA_FIELDS)
        identity = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}
        if "cpu_flags" in identity:
            identity["cpu_flags"] = list(self.cpu_flags)
        return identity

    @property
    def id(self) -> str:
        """A stable hash of the identity fields (hex); equal ids mean the same step cost is expected."""
        return hashlib.sha256(canonical_json(self.identity()).encode()).hexdigest()[:ID_HEX_DIGITS]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["core_ids"] = list(self.core_ids)
        data["cpu_flags"] = list(self.cpu_flags)
        if self.fingerprint_format < 2:  # written back as it was read, so it stays a format-1 record
            for name in FORMAT_2_FIELDS:
                data.pop(name)
        if not self.enable_lora:  # the record of an engine without LoRA is the one written before LoRA was recorded
            for name in LORA_FIELDS:
                data.pop(name)
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
        values["cpu_flags"] = tuple(str(flag) for flag in values.get("cpu_flags", ()))
        values.setdefault("fingerprint_format", 1)
        fingerprint = cls(**values)
        if "id" in data and data["id"] != fingerprint.id:
            raise LlmvisorError(f"{source}: engine fingerprint id {data['id']!r} does not match its fields ({fingerprint.id})")
        return fingerprint

    def differences(self, other: EngineFingerprint) -> dict[str, tuple]:
        """Identity fields that differ: name -> (this value, other value); a field one format lacks is None."""
        mine, theirs = self.identity(), other.identity()
        names = [*mine, *(name for name in theirs if name not in mine)]
        return {name: (mine.get(name), theirs.get(name)) for name in names if mine.get(name) != theirs.get(name)}


def is_fingerprint_id(value) -> bool:
    """Whether ``value`` has the form of an id (`EngineFingerprint.id`): a malformed one is refused, not blanked."""
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


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
    differences = run.differences(model)
    notes = []
    if run.fingerprint_format != model.fingerprint_format:
        differences = {name: pair for name, pair in differences.items() if name not in FORMAT_2_FIELDS}
        older = "the model's" if model.fingerprint_format < run.fingerprint_format else "the run's"
        notes.append(f"fingerprint_format {run.fingerprint_format} vs {model.fingerprint_format}: {older} is of format "
                     f"{min(run.fingerprint_format, model.fingerprint_format)}, which records no CPU ISA flags or GEMM "
                     "backend, so the two never match; recalibrate")
    changed = ", ".join([*(f"{name} {a!r} vs {b!r}" for name, (a, b) in differences.items()), *notes])
    return f"{text} ({changed})" if changed else text
