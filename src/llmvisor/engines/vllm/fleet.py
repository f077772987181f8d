"""One run of the fleet experiment (driven by `llmvisor.fairness.fleet_experiment`): N vLLM OpenAI API servers
behind vllm-router, optionally sharing VTC counters through a Redis, and a client sending a fixed arrival schedule.

Runs as ``python -m llmvisor.engines.vllm.fleet SPEC.json`` so each run gets fresh engines. Each replica is
``python -m vllm.entrypoints.openai.api_server`` serving the engine model with dummy weights (token-id prompts,
``--skip-tokenizer-init``), its scheduler `RecordingScheduler` (``fcfs``) or `FairScheduler` (``local``,
``shared``: attributed VTC, counters per replica or the pool's in Redis), configured through
``LLMVISOR_FAIR_CONFIG`` and writing its step trace to ``LLMVISOR_TRACE_PATH``. vllm-router routes with
``consistent_hash`` on the ``x-session-id`` header: a tenant that sends one session key lands on one replica, a
tenant whose requests carry fresh keys spreads over all of them. Servers are started as subprocesses only.

The spec (JSON): ``name``, ``policy`` (fcfs | local | shared), ``out_dir``, ``model_dir``, ``model_path``
(latency model), ``replicas``, ``engine`` (max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_gib,
seed), ``workload`` (``tenants``: name, rate_rps, prompt_tokens, output_tokens, routing sticky | spread;
``duration_s``, ``seed``), optional ``base_port`` (replicas on consecutive ports from it, then the
router; 0: any free ports), ``drain_s`` (let queued requests finish after the last arrival before stopping).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

from llmvisor.engines.vllm.fair_experiment import arrival_schedule
from llmvisor.errors import LlmvisorError
from llmvisor.net import free_loopback_port

POLICY_SCHEDULER = {
    "fcfs": "llmvisor.engines.vllm.recorder.RecordingScheduler",
    "local": "llmvisor.engines.vllm.fair.FairScheduler",
    "shared": "llmvisor.engines.vllm.fair.FairScheduler",
}
SESSION_HEADER = "x-session-id"
SERVED_MODEL = "engine"
VOCAB_LOW = 100


class ManagedProcess:
    """A child process in its own session, its output in a log file; stopped by signal to its process group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise LlmvisorError(f"{self.name} exited with code {self.process.returncode}; see {self.log_path}:\n" + "\n".join(tail))

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_timeout_s(spec: dict) -> float:
    """How long the engines may take to answer: the spec's ``start_timeout_s``, else ``LLMVISOR_ENGINE_START_TIMEOUT_S``,
    else 600 s (a loaded 2-core machine without AVX-512 can need more; the test suite raises it)."""
    return float(spec.get("start_timeout_s", os.environ.get("LLMVISOR_ENGINE_START_TIMEOUT_S", 600)))


def wait_healthy(processes: list[ManagedProcess], urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(urls, processes))
    while pending:
        for url, process in list(pending.items()):
            process.check_alive()
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    del pending[url]
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise LlmvisorError(f"not healthy within {timeout_s:.0f} s: {', '.join(p.name for p in pending.values())}")
        time.sleep(0.5)


def start_redis(folder: Path) -> tuple[ManagedProcess, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise LlmvisorError("the shared-counters run needs a redis-server binary on PATH (Debian: apt-get install redis-server)")
    port = free_loopback_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "", "--appendonly", "no"]
    process = ManagedProcess("redis-server", argv, folder / "redis.log")
    deadline = time.monotonic() + 10
    import redis

    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    while True:
        process.check_alive()
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise LlmvisorError("redis-server did not answer within 10 s") from None
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


def replica_argv(spec: dict, port: int) -> list[str]:
    engine = spec["engine"]
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec["model_dir"], "--served-model-name", SERVED_MODEL,
        "--load-format", "dummy", "--skip-tokenizer-init", "--no-async-scheduling", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(engine["max_model_len"]), "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]), "--seed", str(engine["seed"]),
        "--scheduler-cls", POLICY_SCHEDULER[spec["policy"]],
    ]  # fmt: skip


def replica_env(spec: dict, index: int, trace_path: Path, fair_config: dict) -> dict:
    """Each replica's model worker runs one thread, unbound: with more replicas than cores, the OS shares the
    cores among them (in a trial with workers bound two to a core, one of them went seconds without a step)."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": str(spec["engine"]["kv_cache_gib"]),
        "LLMVISOR_TRACE_PATH": str(trace_path),
        "LLMVISOR_RUN_ID": f"fleet-{spec['name']}-r{index}",
        "LLMVISOR_UNIQUE_RUN_ID": "0",
        "LLMVISOR_WARMUP_STEPS": "0",
        "LLMVISOR_FAIR_CONFIG": json.dumps(fair_config),
    }


def fixed_ports(base_port: int, count: int) -> list[int]:
    """``count`` consecutive loopback ports from ``base_port``, each checked free. The router's hash ring is
    built from the worker URLs, so the same ports in every run put a sticky tenant on the same replica."""
    ports = list(range(base_port, base_port + count))
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: a previous run's TIME_WAIT is no conflict
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                raise LlmvisorError(f"--base-port: port {port} on 127.0.0.1 is in use; choose another --base-port") from None
    return ports


def router_argv(worker_urls: list[str], port: int) -> list[str]:
    """The router over the workers (healthy before it starts). Before serving it checks each worker, and after a check
    that misses (a loaded machine can answer slower than the check's 5 s limit) it waits 30 s by default for the next;
    1 s here (measured with a worker up 2 s after the router: ready in 31 s by default, 3 s with it)."""
    executable = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not os.path.exists(executable):
        raise LlmvisorError("the fleet experiment needs vllm-router (pip install vllm-router)")
    return [executable, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls, "--policy", "consistent_hash",
            "--worker-startup-check-interval", "1", "--log-level", "warning"]


def request_body(tenant: dict, prompt: list[int]) -> dict:
    return {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": tenant["output_tokens"],
        "ignore_eos": True,
        "temperature": 0.0,
        "vllm_xargs": {"tenant": tenant["name"]},
    }


def session_key(tenant: dict, request_id: str) -> str:
    """Sticky tenants send one session key (one replica); spread tenants a fresh key per request."""
    return tenant["name"] if tenant["routing"] == "sticky" else request_id


async def drive(router_url: str, workload: dict, t0_wall: float, vocab_size: int) -> list[dict]:
    """Send the arrival schedule through the router; one record per request (times relative to ``t0_wall``)."""
    tenants = {t["name"]: {"history_tokens": 0, "n_conversations": 0, **t} for t in workload["tenants"]}
    schedule = arrival_schedule({**workload, "tenants": list(tenants.values())})
    records: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=router_url, timeout=None, limits=limits) as client:

        async def one(request: dict) -> None:
            tenant = tenants[request["tenant"]]
            prompt = np.random.default_rng(request["prompt_seed"]).integers(VOCAB_LOW, vocab_size - 1, tenant["prompt_tokens"]).tolist()
            record = {
                "request_id": request["request_id"],
                "tenant": tenant["name"],
                "arrival_s": request["arrival_s"],
                "submitted_s": time.time() - t0_wall,
                "finish_s": None,
                "output_tokens": 0,
                "status": None,
            }
            records.append(record)
            headers = {SESSION_HEADER: session_key(tenant, request["request_id"]), "x-request-id": request["request_id"]}
            try:
                response = await client.post("/v1/completions", json=request_body(tenant, prompt), headers=headers)
            except httpx.HTTPError as error:
                record["status"] = f"error: {type(error).__name__}"
                return
            record["status"] = response.status_code
            if response.status_code == 200:
                record["finish_s"] = time.time() - t0_wall
                record["output_tokens"] = int(response.json().get("usage", {}).get("completion_tokens", 0))

        tasks = []
        for request in schedule:
            delay = request["arrival_s"] - (time.time() - t0_wall)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        remaining = workload["duration_s"] - (time.time() - t0_wall)
        if remaining > 0:
            await asyncio.sleep(remaining)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for record in records:
        if record["status"] is None:
            record["status"] = "unfinished"
    return records


def warm_up(router_url: str, workload: dict, replicas: int, vocab_size: int) -> None:
    """A few requests through the router (tenant "warmup", spread over the replicas), outside the measurement."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=router_url, timeout=120.0) as client:
            tenant = {**workload["tenants"][0], "name": "warmup", "routing": "spread"}
            rng = np.random.default_rng(0)
            await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json=request_body(tenant, rng.integers(VOCAB_LOW, vocab_size - 1, tenant["prompt_tokens"]).tolist()),
                        headers={SESSION_HEADER: f"warmup-{k}"},
                    )
                    for k in range(4 * replicas)
                )
            )

    asyncio.run(run())


def redis_counters(url: str, pool: str) -> dict:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    counters = {tenant: float(value) for tenant, value in client.hgetall(f"llmvisor:fair:{{{pool}}}:counters").items()}
    applied = sorted(client.scan_iter(f"llmvisor:fair:{{{pool}}}:applied:*"))
    return {"counters": counters, "replicas_applied": len(applied)}


def run(spec: dict) -> dict:
    policy = spec["policy"]
    if policy not in POLICY_SCHEDULER:
        raise LlmvisorError(f"unknown fleet policy {policy!r}; choose from {', '.join(POLICY_SCHEDULER)}")
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    n = int(spec["replicas"])
    processes: list[ManagedProcess] = []
    pool = None
    redis_url = None
    try:
        fair_config: dict = {"cost": "attributed", "model": spec["model_path"]}
        if policy == "shared":
            redis_process, redis_url = start_redis(out_dir)
            processes.append(redis_process)
            pool = f"fleet-{uuid.uuid4().hex[:8]}"
            fair_config["shared_counters"] = {"url": redis_url, "pool": pool, "flush_interval_s": 0.1}
        started = time.perf_counter()
        base_port = int(spec.get("base_port", 0))
        ports = fixed_ports(base_port, n + 1) if base_port else [free_loopback_port() for _ in range(n + 1)]
        router_port = ports.pop()
        traces = [out_dir / f"replica-{k}.jsonl" for k in range(n)]
        replicas = []
        for k, (port, trace) in enumerate(zip(ports, traces)):
            trace.unlink(missing_ok=True)
            replicas.append(ManagedProcess(f"replica {k}", replica_argv(spec, port), out_dir / f"replica-{k}.log", replica_env(spec, k, trace, fair_config)))
        processes.extend(replicas)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        wait_healthy(replicas, [f"{url}/health" for url in urls], timeout_s=start_timeout_s(spec))
        router = ManagedProcess("vllm-router", router_argv(urls, router_port), out_dir / "router.log")
        processes.append(router)
        router_url = f"http://127.0.0.1:{router_port}"
        wait_healthy([router], [f"{router_url}/health"], timeout_s=60)
        start_s = time.perf_counter() - started
        vocab_size = int(spec.get("vocab_size", 32000))
        warm_up(router_url, spec["workload"], n, vocab_size)
        time.sleep(1.0)  # the warm-up's steps reach the traces (idle flush) before t0
        t0_wall = time.time()
        requests = asyncio.run(drive(router_url, spec["workload"], t0_wall, vocab_size))
        end_s = time.time() - t0_wall
        time.sleep(float(spec.get("drain_s", 0.0)))
        shared = redis_counters(redis_url, pool) if redis_url else None
        if shared is not None:
            shared["read_s"] = time.time() - t0_wall
            shared["flush_interval_s"] = fair_config["shared_counters"]["flush_interval_s"]
        for replica in replicas:
            replica.stop(signal.SIGINT)
        time.sleep(0.5)
        result = {
            "name": spec["name"],
            "policy": policy,
            "replicas": n,
            "traces": [str(t) for t in traces],
            "t0_wall_s": t0_wall,
            "end_s": end_s,
            "start_s": start_s,
            "requests": requests,
            "tenants": [t["name"] for t in spec["workload"]["tenants"]],
            "workload": spec["workload"],
            "engine": spec["engine"],
            "router": {"policy": "consistent_hash", "session_header": SESSION_HEADER},
            "worker_threads": "one per replica, unbound (OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind)",
            "ports": {"replicas": ports, "router": router_port},
            "fair_config": {k: v for k, v in fair_config.items() if k != "model"} if policy != "fcfs" else None,
            "shared_counters": shared,
        }
    finally:
        for process in reversed(processes):
            process.stop(signal.SIGTERM if process.name != "vllm-router" else signal.SIGINT, timeout_s=20)
    with open(out_dir / "result.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return result


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as handle:
        spec = json.load(handle)
    result = run(spec)
    finished = sum(1 for r in result["requests"] if r["finish_s"] is not None)
    print(f"llmvisor: fleet run {result['name']}: {finished} of {len(result['requests'])} requests finished", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
