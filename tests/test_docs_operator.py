"""The documented operator commands run as written: the ```bash operator``` blocks of a doc, in order, in one
shell, in an empty folder. docs/recorder.md: service, keys, vLLM's OpenAI server with the recorder pushing, a
completion stored pending (no model of the engine yet), traffic, calibration, the calibrated model activated and
the tenant's usage billed with it. docs/service.md: fit, keys,
serve, both JSON ingest forms, every usage query."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_DOC = ROOT / "docs" / "recorder.md"
SERVICE_DOC = ROOT / "docs" / "service.md"
FAIRNESS_DOC = ROOT / "docs" / "fairness.md"
BLOCK = re.compile(r"^```bash operator\n(.*?)^```", re.S | re.M)


def operator_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def operator_script(text: str) -> str:
    """The blocks as one bash script that stops its background servers however it ends."""
    return "\n".join(["set -euo pipefail", "trap 'kill $(jobs -p) 2> /dev/null || true' EXIT", *operator_blocks(text)])


def test_the_operator_blocks_are_the_whole_journey():
    blocks = operator_blocks(OPERATOR_DOC.read_text(encoding="utf-8"))
    joined = "\n".join(blocks)
    for step in ("llmvisor keys create --admin", "llmvisor serve", "--scheduler-cls llmvisor.engines.vllm.recorder.RecordingScheduler",
                 '"vllm_xargs": {"tenant": "team-a"}', "/v1/usage/tenants", "llmvisor calibrate"):
        assert step in joined, step
    assert "--load-format dummy --skip-tokenizer-init" in joined
    assert not re.search(r"127\.0\.0\.1:8000|LLMVISOR_SERVICE_URL=\S*:8000|serve .*--port 8000", joined)
    assert len(blocks) >= 5
    assert operator_script("```bash operator\necho a\n```\ntext\n```bash\necho b\n```\n").endswith("echo a\n")


def run_doc(doc: Path, tmp_path: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, Path]:
    """Run a doc's operator blocks in an empty folder, with `llmvisor` and this Python on the PATH."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "llmvisor").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m llmvisor.cli "$@"\n')
    (shims / "llmvisor").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "PATH": f"{shims}:{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT / "src"),
        "HOME": str(tmp_path),
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    script = operator_script(doc.read_text(encoding="utf-8"))
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in work.glob("*.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    return done, work


def test_the_documented_service_commands_run(tmp_path):
    done, work = run_doc(SERVICE_DOC, tmp_path, timeout_s=300)
    acknowledged = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"steps_received"')]
    uploaded = read_trace(work / "run.parquet")
    assert [(a["steps_inserted"], a["slices_inserted"]) for a in acknowledged] == [(1, 2), (1, 2), (uploaded.n_steps, uploaded.n_slices)]
    totals = json.loads(re.search(r'\{"start":null,"end":null,"num_steps".*?\}', done.stdout).group())
    uploaded_ns = int(acknowledged[2]["attributed_ns"])
    assert abs(uploaded_ns - uploaded.step_latency_s_per_step.sum() * 1e9) <= uploaded.n_steps  # each step rounded to 1 ns
    assert totals["num_steps"] == 2 + uploaded.n_steps
    assert totals["attributed_ns"] == totals["measured_ns"] == 31_000_000 + 12_000_000 + uploaded_ns


@pytest.mark.vllm
def test_the_documented_operator_commands_run(tmp_path):
    done, work = run_doc(OPERATOR_DOC, tmp_path, timeout_s=900)
    held = json.loads(next(line for line in done.stdout.splitlines() if '"pending_steps"' in line))
    assert held["num_steps"] == 0 and held["attributed_ns"] == 0 and held["pending_steps"] > 0  # no model of this engine yet
    assert re.search(r"v1 active; \d+ pending steps attributed", done.stdout)
    usage = json.loads(next(line for line in done.stdout.splitlines() if '"tenants"' in line))
    assert [t["tenant"] for t in usage["tenants"]] == ["team-a"] and usage["tenants"][0]["attributed_ns"] > 0
    assert usage["tenants"][0]["num_new_tokens"] == 6 + 15  # the prompt, then one token per decode step
    served = read_trace(work / "served.jsonl")
    assert (work / "served.jsonl.engine.json").exists()
    served_id = json.loads((work / "served.jsonl.engine.json").read_text())["id"]
    assert served.engine_fingerprint_ids() == [served_id]
    assert set(served.tenant) == {"team-a", "team-0", "team-1", "team-2"}
    calibration = json.loads((work / "calibration.json").read_text())
    assert calibration["fingerprint_matches"] is True
    assert StepLatencyModel.from_json(work / "calibrated.json").engine_fingerprint_["id"] == served_id
    figures = calibration["evaluation"]["models"]
    assert figures["calibrated"]["n_steps"] == figures["baseline"]["n_steps"] > 100


@pytest.mark.vllm
def test_the_documented_fair_scheduler_commands_run(tmp_path):
    """docs/fairness.md: the OpenAI server with FairScheduler reading the documented fair.toml, two tenants served."""
    done, _ = run_doc(FAIRNESS_DOC, tmp_path, timeout_s=600)
    assert re.search(r"llmvisor: fair scheduler: cost attributed, tenant key 'tenant', weights \{'team-a': 2\.0\}, 0 quotas, tpot_slo_s 0\.2", done.stdout)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"id"')]
    assert [answer["usage"]["completion_tokens"] for answer in answers] == [8, 8]
