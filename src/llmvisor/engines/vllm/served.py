"""One served session of the calibration experiment (driven by `llmvisor.profile.calibration_experiment`): vLLM's
OpenAI server as the operator journey runs it (docs/recorder.md: dummy weights, token-id prompts, the recorder
pushing every step to an accounting service through its delivery process), traffic from a workload's request
lengths in phases of rising concurrency, and a fixed canary before every phase and after the last.

The canary is the served engine's noise floor: a fixed sequence of requests sent one at a time while nothing
else runs (fresh random token ids, so prefix caching never shortens them), so each of its steps has the same
composition every time it runs, in every session. How much the same canary step varies across the sessions is
what re-measuring an identical served step costs; no model can be closer to a served run than that.

Runs as ``python -m llmvisor.engines.vllm.served SPEC.json``; writes ``result.json`` beside the trace. The
spec (JSON): ``name``, ``out_dir``, ``model_dir``, ``service_url``, ``service_key``, ``kv_cache_gib``,
``workload`` (``path``: a request-length CSV; ``max_prompt_tokens``, ``max_output_tokens``), ``phases``
(concurrency of each phase), ``phase_s``, ``canary`` (list of [prompt_tokens, output_tokens]), ``seed``,
``vocab_size``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from llmvisor.client.relay import wait_for_delivery
from llmvisor.core.workloads import read_workload_csv
from llmvisor.engines.vllm.fleet import SERVED_MODEL, VOCAB_LOW, ManagedProcess, start_timeout_s, wait_healthy
from llmvisor.errors import LlmvisorError
from llmvisor.net import free_loopback_port

CANARY_TENANT = "canary"
DELIVERY_LINE = re.compile(r"steps of run (\S+) go to the accounting service at \S+ through delivery process (\d+)")


def server_argv(spec: dict, port: int) -> list[str]:
    """The documented command (docs/recorder.md), on its own port."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec["model_dir"],
        "--served-model-name", SERVED_MODEL, "--load-format", "dummy", "--skip-tokenizer-init", "--no-async-scheduling",
        "--host", "127.0.0.1", "--port", str(port), "--scheduler-cls", "llmvisor.engines.vllm.recorder.RecordingScheduler",
    ]  # fmt: skip


def server_env(spec: dict, trace_path: Path) -> dict:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(spec["kv_cache_gib"]),
        "LLMVISOR_SERVICE_URL": spec["service_url"],
        "LLMVISOR_SERVICE_KEY": spec["service_key"],
        "LLMVISOR_TRACE_PATH": str(trace_path),
        "LLMVISOR_RUN_ID": spec["name"],
    }


class Traffic:
    """Completions from the workload's request lengths, ``concurrency`` clients at a time, one record each."""

    def __init__(self, base_url: str, spec: dict):
        workload = spec["workload"]
        self.rows = read_workload_csv(workload["path"])
        self.max_prompt = int(workload["max_prompt_tokens"])
        self.max_output = int(workload["max_output_tokens"])
        self.vocab_size = int(spec.get("vocab_size", 32000))
        self.rng = np.random.default_rng(int(spec["seed"]))
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.client = httpx.Client(base_url=base_url, timeout=600.0)
        self.t0 = time.time()

    def complete(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        with self.lock:
            prompt = self.rng.integers(VOCAB_LOW, self.vocab_size - 1, prompt_tokens).tolist()
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
                "temperature": 0.0, "vllm_xargs": {"tenant": tenant}}
        record = {"tenant": tenant, "prompt_tokens": prompt_tokens, "max_tokens": output_tokens, "submitted_s": time.time() - self.t0}
        response = self.client.post("/v1/completions", json=body)
        record["finish_s"] = time.time() - self.t0
        record["status"] = response.status_code
        record["completion_tokens"] = int(response.json().get("usage", {}).get("completion_tokens", 0)) if response.status_code == 200 else 0
        with self.lock:
            self.records.append(record)

    def draw(self) -> tuple[int, int]:
        with self.lock:
            row = self.rows[int(self.rng.integers(len(self.rows)))]
        return min(row.prompt_len, self.max_prompt), max(2, min(row.output_len, self.max_output))

    def canary(self, shapes: list[list[int]]) -> None:
        time.sleep(0.5)  # the previous phase's last steps end first
        for prompt_tokens, output_tokens in shapes:
            self.complete(CANARY_TENANT, prompt_tokens, output_tokens)

    def phase(self, concurrency: int, seconds: float) -> None:
        end = time.monotonic() + seconds
        errors: list[BaseException] = []

        def client(k: int) -> None:
            try:
                while time.monotonic() < end:
                    self.complete(f"team-{k % 3}", *self.draw())
            except BaseException as error:  # surfaced below, in the calling thread
                errors.append(error)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise LlmvisorError(f"a client failed during the phase of concurrency {concurrency}: {errors[0]!r}")


def run(spec: dict) -> dict:
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / f"{spec['name']}.jsonl"
    for stale in (trace_path, trace_path.with_name(trace_path.name + ".engine.json")):
        stale.unlink(missing_ok=True)
    port = free_loopback_port()
    log_path = out_dir / f"{spec['name']}.vllm.log"
    log_path.unlink(missing_ok=True)
    server = ManagedProcess(f"vLLM server {spec['name']}", server_argv(spec, port), log_path, server_env(spec, trace_path))
    try:
        wait_healthy([server], [f"http://127.0.0.1:{port}/health"], timeout_s=start_timeout_s(spec))
        found = DELIVERY_LINE.findall(log_path.read_text(encoding="utf-8", errors="replace"))
        if not found:
            raise LlmvisorError(f"{log_path}: the recorder started no delivery process (is LLMVISOR_SERVICE_URL reachable?)")
        run_id, delivery_pid = found[-1][0], int(found[-1][1])
        traffic = Traffic(f"http://127.0.0.1:{port}", spec)
        started = time.time()
        for concurrency in spec["phases"]:
            traffic.canary(spec["canary"])
            traffic.phase(int(concurrency), float(spec["phase_s"]))
        traffic.canary(spec["canary"])
        traffic_s = time.time() - started
        traffic.client.close()
    finally:
        server.stop(signal.SIGINT, timeout_s=60)
    if not wait_for_delivery(delivery_pid, 120):
        raise LlmvisorError(f"the delivery process {delivery_pid} of {spec['name']} did not finish within 120 s")
    result = {
        "name": spec["name"],
        "run_id": run_id,
        "trace": trace_path.name,
        "workload": {**spec["workload"], "path": Path(spec["workload"]["path"]).name},
        "phases": spec["phases"],
        "phase_s": spec["phase_s"],
        "canary": spec["canary"],
        "seed": spec["seed"],
        "traffic_s": traffic_s,
        "requests": traffic.records,
    }
    (out_dir / f"{spec['name']}.result.json").write_text(json.dumps(result), encoding="utf-8")
    return result


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as handle:
        spec = json.load(handle)
    result = run(spec)
    failed = sum(1 for r in result["requests"] if r["status"] != 200)
    print(f"llmvisor: served session {result['name']}: {len(result['requests'])} requests, {failed} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
