"""Recorder settings, read from environment variables or a JSON file, without importing vLLM.

The recorder runs inside vLLM's engine-core process (a separate process behind the OpenAI server), where
no llmvisor code can hand it arguments; environment variables reach it there.

Environment variables:

- ``LLMVISOR_TRACE_PATH``: the JSONL file to append step rows to. Unset: the recorder is inert (plain vLLM).
- ``LLMVISOR_RUN_ID``: the run's label (default ``vllm``). Each engine start records under its own run id,
  ``<label>-<start UTC time>-<8 hex digits>``, so a restart with the same label never reuses a
  (run_id, step_id) pair, the ledger's idempotency key. ``LLMVISOR_UNIQUE_RUN_ID=0`` records the label
  itself as the run id (for tools that make their own run ids unique, e.g. ``llmvisor profile``).
- ``LLMVISOR_TENANT_KEY``: the ``vllm_xargs`` key naming a request's tenant (default ``tenant``);
  `FairScheduler` uses its own ``tenant_key`` setting instead, so recording and charging agree.
- ``LLMVISOR_WARMUP_STEPS``: how many steps after engine start are marked ``is_warmup`` (default 3).
- ``LLMVISOR_FLUSH_EVERY_STEPS``: write the file every this many steps (default 16), and
  ``LLMVISOR_FLUSH_INTERVAL_S``: at least this often while steps run (default 1.0 s). A crash loses at most
  the steps not yet written; an idle engine's last steps are written within the interval (a timer).
  With a service URL (``LLMVISOR_SERVICE_URL``) every step leaves the engine process as it ends, to a
  delivery process that writes the trace and pushes to the service (`llmvisor.client.relay.StepRelay`).
  Otherwise rows are encoded at flush time, many steps at once: right after a step's kernels Python runs with cold caches, and encoding one step's rows there cost about ten times more (measured).
- ``LLMVISOR_MODEL_NAME``, ``LLMVISOR_HARDWARE``: override the ``model`` and ``hardware`` columns.
- ``LLMVISOR_RECORDER_CONFIG``: a JSON file with any of the keys ``trace_path``, ``run_id``,
  ``warmup_steps``, ``flush_every_steps``, ``flush_interval_s``, ``model_name``, ``hardware``, ``unique_run_id``,
  ``tenant_key``; environment variables win over it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, fields

from llmvisor.errors import LlmvisorError

ENV_TRACE_PATH = "LLMVISOR_TRACE_PATH"
ENV_RUN_ID = "LLMVISOR_RUN_ID"
ENV_WARMUP_STEPS = "LLMVISOR_WARMUP_STEPS"
ENV_FLUSH_EVERY_STEPS = "LLMVISOR_FLUSH_EVERY_STEPS"
ENV_FLUSH_INTERVAL_S = "LLMVISOR_FLUSH_INTERVAL_S"
ENV_MODEL_NAME = "LLMVISOR_MODEL_NAME"
ENV_HARDWARE = "LLMVISOR_HARDWARE"
ENV_CONFIG = "LLMVISOR_RECORDER_CONFIG"
ENV_UNIQUE_RUN_ID = "LLMVISOR_UNIQUE_RUN_ID"
ENV_TENANT_KEY = "LLMVISOR_TENANT_KEY"

DEFAULT_RUN_LABEL = "vllm"
DEFAULT_TENANT_KEY = "tenant"

DEFAULT_WARMUP_STEPS = 3
DEFAULT_FLUSH_EVERY_STEPS = 16
DEFAULT_FLUSH_INTERVAL_S = 1.0


@dataclass
class RecorderSettings:
    trace_path: str | None = None
    run_id: str | None = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    flush_every_steps: int = DEFAULT_FLUSH_EVERY_STEPS
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    model_name: str | None = None
    hardware: str | None = None
    unique_run_id: bool = True
    tenant_key: str = DEFAULT_TENANT_KEY

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RecorderSettings:
        environ = os.environ if environ is None else environ
        values: dict = {}
        config_path = environ.get(ENV_CONFIG)
        if config_path:
            values.update(_read_config_file(config_path))
        for key, name in (
            ("trace_path", ENV_TRACE_PATH),
            ("run_id", ENV_RUN_ID),
            ("warmup_steps", ENV_WARMUP_STEPS),
            ("flush_every_steps", ENV_FLUSH_EVERY_STEPS),
            ("flush_interval_s", ENV_FLUSH_INTERVAL_S),
            ("model_name", ENV_MODEL_NAME),
            ("hardware", ENV_HARDWARE),
            ("unique_run_id", ENV_UNIQUE_RUN_ID),
            ("tenant_key", ENV_TENANT_KEY),
        ):
            if environ.get(name):
                values[key] = environ[name]
        for key in ("warmup_steps", "flush_every_steps"):
            if key in values:
                values[key] = _non_negative_int(key, values[key], config_path)
        if "flush_interval_s" in values:
            values["flush_interval_s"] = _non_negative_float("flush_interval_s", values["flush_interval_s"], config_path)
        if values.get("flush_every_steps") == 0:
            values["flush_every_steps"] = 1
        if "unique_run_id" in values:
            values["unique_run_id"] = _boolean("unique_run_id", values["unique_run_id"], config_path)
        settings = cls(**values)
        if settings.unique_run_id or settings.run_id is None:
            settings.run_id = run_instance_id(settings.run_id or DEFAULT_RUN_LABEL)
        return settings


def run_instance_id(label: str, now_s: float | None = None) -> str:
    """The run id of one engine start: the configured label, the start time (UTC) and 8 random hex digits."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now_s is None else now_s))
    return f"{label}-{stamp}-{uuid.uuid4().hex[:8]}"


def _boolean(key: str, value, source: str | None) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise LlmvisorError(f"{source or 'environment'}: {key} must be true or false (got {value})")


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as error:
        raise LlmvisorError(f"{path}: cannot read recorder config ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise LlmvisorError(f"{path}: recorder config is not valid JSON ({error.msg})") from None
    if not isinstance(config, dict):
        raise LlmvisorError(f"{path}: recorder config must be a JSON object")
    known = {f.name for f in fields(RecorderSettings)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise LlmvisorError(f"{path}: unknown recorder config key(s) {', '.join(unknown)}")
    return config


def _non_negative_int(key: str, value, source: str | None) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0 or isinstance(value, bool):
        where = source or "environment"
        raise LlmvisorError(f"{where}: {key} must be a non-negative integer (got {value!r})")
    return number


def _non_negative_float(key: str, value, source: str | None) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number >= 0 or isinstance(value, bool):
        where = source or "environment"
        raise LlmvisorError(f"{where}: {key} must be a non-negative number (got {value!r})")
    return number
