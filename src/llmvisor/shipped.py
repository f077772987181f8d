"""Where the data shipped inside the package lives: one definition of every shipped path.

"Engine model" is the engine's weights folder (a Llama-shaped ``config.json``, run with dummy weights);
"latency model" is a fitted `StepLatencyModel` file. The two are never called plain "model" here.
What the package records about its own files (trace metadata, result settings) names them by
`portable_path` ("llmvisor/data/..."), never by where this installation happens to live.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from llmvisor.errors import LlmvisorError

TRAIN_TRACE = "sweep.parquet"
HELD_OUT_TRACES = (
    "azure-conv.parquet",
    "azure-code.parquet",
    "arxiv-summarization.parquet",
    "multi-tenant.parquet",
    "shared-documents.parquet",
)
MULTI_TENANT_TRACE = "multi-tenant.parquet"
VALIDATION_RESULT = "validation.json"
VALIDATION_JOURNAL = "validation.journal.jsonl.gz"
FAIRNESS_RESULT = "fairness.json"
FLEET_RESULT = "fleet.json"
WORKLOAD_FILES = ("azure-2023-conv.csv", "azure-2023-code.csv", "arxiv-summarization.csv")
"""The real request-length mixes shipped in ``data/workloads`` (provenance in its README.md)."""
PACKAGE_DATA_PREFIX = "llmvisor/data"


def data_dir() -> Path:
    """The package's data folder (inside an installed wheel or the source tree alike)."""
    return Path(str(resources.files("llmvisor") / "data"))


def engine_model_dir() -> Path:
    """The shipped engine model: a Llama-shaped config.json, run with dummy weights."""
    return data_dir() / "engine-model"


def latency_model_path() -> Path:
    """The shipped latency model, fitted on the shipped vLLM sweep trace."""
    return data_dir() / "model.json"


def trace_path(name: str) -> Path:
    """A shipped step trace by file name; a clear error if the package was installed without it."""
    path = data_dir() / "traces" / name
    if not path.is_file():
        raise LlmvisorError(f"{path}: shipped trace missing (is the package installed whole?)")
    return path


def workloads_dir() -> Path:
    """The shipped request-length mixes (`WORKLOAD_FILES`): Azure conversation, Azure code, arXiv summarization."""
    return data_dir() / "workloads"


def grafana_dashboard_path() -> Path:
    """The Grafana dashboard of the service's Prometheus metrics (import it: docs/service.md, Dashboard)."""
    return data_dir() / "grafana" / "llmvisor.json"


def portable_path(path: str | os.PathLike) -> str:
    """How to record a path: a file inside the package's data as "llmvisor/data/<relative path>", any other as given."""
    try:
        inside = Path(path).resolve().relative_to(data_dir().resolve())
    except (OSError, ValueError):
        return str(path)
    return f"{PACKAGE_DATA_PREFIX}/{inside.as_posix()}" if inside.parts else PACKAGE_DATA_PREFIX


def result_path(name: str) -> Path:
    """A shipped result file (validation, fairness, fleet) by file name."""
    return data_dir() / name
