"""The fleet experiment's skew comes from vllm-router itself: with the experiment's router command and session
keys, a sticky tenant's requests all reach one worker and a spread tenant's reach every worker. The workers
here are stand-ins answering like an OpenAI server with their own name, so no engine is needed."""

from __future__ import annotations

import collections
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from _processes import START_TIMEOUT_S
from llmvisor.engines.vllm.fleet import SESSION_HEADER, ManagedProcess, router_argv, session_key, wait_healthy
from llmvisor.net import free_loopback_port

ROUTER = Path(sys.executable).with_name("vllm-router")
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="needs vllm-router (pip install vllm-router)")

WORKER = textwrap.dedent(
    """
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"object": "list", "data": [{"id": "engine", "object": "model"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.answer({"object": "text_completion", "choices": [{"index": 0, "text": sys.argv[2], "finish_reason": "length"}]})

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def test_consistent_hashing_on_the_session_header_gives_the_experiments_skew(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ports = [free_loopback_port() for _ in range(3)]
    workers = [ManagedProcess(f"worker {k}", [sys.executable, str(script), str(port), f"w{k}"], tmp_path / f"w{k}.log") for k, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    processes = list(workers)
    try:
        wait_healthy(workers, [f"{url}/health" for url in urls], timeout_s=START_TIMEOUT_S)
        router_port = free_loopback_port()
        processes.append(ManagedProcess("vllm-router", router_argv(urls, router_port), tmp_path / "router.log"))
        wait_healthy(processes[-1:], [f"http://127.0.0.1:{router_port}/health"], timeout_s=START_TIMEOUT_S)
        served = collections.defaultdict(collections.Counter)
        with httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=10) as client:
            for k in range(30):
                for tenant in ({"name": "heavy", "routing": "sticky"}, {"name": "light-1", "routing": "spread"}):
                    headers = {SESSION_HEADER: session_key(tenant, f"{tenant['name']}-{k:05d}")}
                    response = client.post("/v1/completions", json={"model": "engine", "prompt": [1, 2], "max_tokens": 1}, headers=headers)
                    assert response.status_code == 200, response.text
                    served[tenant["name"]][response.json()["choices"][0]["text"]] += 1
    finally:
        for process in reversed(processes):
            process.stop()
        time.sleep(0.1)
    assert len(served["heavy"]) == 1 and sum(served["heavy"].values()) == 30, served["heavy"]
    assert set(served["light-1"]) == {"w0", "w1", "w2"}, served["light-1"]
