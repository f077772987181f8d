"""Run an engine module in a fresh Python process: ``python -m MODULE SPEC.json``, its output in a log file,
its result read back from a JSON file. Experiments start their engines this way, so every run gets a fresh
engine and applications never import an engine (only `llmvisor.engines` imports vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmvisor.errors import LlmvisorError


def run_engine_module(module: str, spec: dict, *, spec_path: Path, result_path: Path, log_path: Path, what: str) -> dict:
    """Write ``spec`` to ``spec_path``, run ``module`` on it, and return the JSON it wrote to ``result_path``;
    a failed run raises with the log's tail, naming ``what`` ran."""
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    with open(log_path, "w", encoding="utf-8") as log:
        done = subprocess.run([sys.executable, "-m", module, str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise LlmvisorError(f"{what} failed (exit {done.returncode}); see {log_path}:\n" + "\n".join(tail))
    return json.loads(result_path.read_text(encoding="utf-8"))
