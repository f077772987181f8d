"""The delivery process (`python -m llmvisor.client`, what the vLLM recorder relays its steps to) writes the raw-step
archive when ``LLMVISOR_ARCHIVE_URL`` is set: every relayed step is in it, as `step_rows` makes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from llmvisor.archive import archive_files, read_archive
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import trace_from_rows


def test_the_delivery_process_archives_every_relayed_step(tmp_path):
    header = {"columns": {"run_id": "run-d", "engine": "vllm", "engine_fingerprint": "00000000000000fd"}, "warmup_steps": 2,
              "trace_path": None, "engine_fingerprint": {"id": "00000000000000fd"}}
    rng = np.random.default_rng(3)
    t0_s = float(int(time.time()))  # now: windows of past steps would be written as soon as the process looks
    steps = []
    for step_id in range(400):
        slices = [[f"q{k}", f"t{k % 3}", int(rng.integers(1, 50)) if k == 0 else 1, int(rng.integers(0, 900)), k == 0, 0, 0.0]
                  for k in range(int(rng.integers(1, 9)))]
        for item in slices:
            item[6] = float(item[3])
        steps.append([step_id, t0_s + step_id * 0.01, float(rng.uniform(0.001, 0.05)), slices])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMVISOR_SERVICE")}
    env.update({"LLMVISOR_ARCHIVE_URL": str(tmp_path / "archive"), "LLMVISOR_ARCHIVE_WINDOW_S": "1"})
    lines = "".join(json.dumps(x) + "\n" for x in [header, *steps])
    done = subprocess.run([sys.executable, "-m", "llmvisor.client"], input=lines, text=True, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(archive_files(str(tmp_path / "archive"))) == 4  # 4 s of steps, 1 s windows
    got = read_archive(str(tmp_path / "archive"))
    expected = trace_from_rows([row for step in steps for row in step_rows(header, step)])
    assert got.step_id_per_step.tolist() == list(range(400))
    for name in ("step_latency_s", "request_id", "tenant", "num_new_tokens", "num_context_tokens", "is_prefill"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    assert got.extra["is_warmup"].tolist() == expected.extra["is_warmup"].tolist()
    assert got.metadata["engine_fingerprint"] == {"id": "00000000000000fd"}
