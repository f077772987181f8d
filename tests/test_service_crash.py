"""The real server (uvicorn in a child process) killed with SIGKILL, repeatedly, while several clients
ingest with retries: afterwards every acknowledged step is stored exactly once."""

from __future__ import annotations

import random
import threading
import time

import httpx

from _service_fixtures import bearer, db_url, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.ledger import Ledger
from llmvisor.service.process import ServerProcess

N_CLIENTS = 4
STEPS_PER_CLIENT = 600
STEPS_PER_POST = 15
KILLS = 4
DEADLINE_S = 60.0


def test_kill_9_during_concurrent_ingest_loses_and_duplicates_nothing(model_path, db_url, tmp_path):
    ledger = Ledger(db_url)
    admin = bearer(ledger.create_key(is_admin=True))
    server = ServerProcess(model_path, db_url, log_path=tmp_path / "server.log").start()
    deadline = time.monotonic() + DEADLINE_S
    workloads = [make_steps(f"run-{c}", STEPS_PER_CLIENT, batch_size=8, seed=c) for c in range(N_CLIENTS)]
    acknowledged = [0] * N_CLIENTS
    duplicates = [0] * N_CLIENTS
    failed_attempts = [0] * N_CLIENTS
    problems: list[str] = []
    progress = threading.Event()

    def client(c: int) -> None:
        groups = workloads[c]
        with httpx.Client(base_url=server.url, headers=admin, timeout=10.0) as http:
            for i in range(0, len(groups), STEPS_PER_POST):
                chunk = groups[i : i + STEPS_PER_POST]
                while True:
                    if time.monotonic() > deadline:
                        problems.append(f"client {c} ran out of time at step {i}")
                        return
                    try:
                        response = http.post("/v1/steps", json={"steps": chunk})
                    except httpx.HTTPError:
                        failed_attempts[c] += 1
                        time.sleep(0.05)
                        continue
                    if response.status_code == 200:
                        acknowledged[c] += response.json()["steps_received"]
                        duplicates[c] += response.json()["steps_duplicate"]
                        progress.set()
                        break
                    if response.status_code == 503:
                        failed_attempts[c] += 1
                        time.sleep(0.05)
                        continue
                    problems.append(f"client {c}: HTTP {response.status_code}: {response.text[:200]}")
                    return

    threads = [threading.Thread(target=client, args=(c,)) for c in range(N_CLIENTS)]
    for thread in threads:
        thread.start()
    kills_mid_ingest = 0
    rng = random.Random(0)
    try:
        for _ in range(KILLS):
            progress.clear()
            if not progress.wait(timeout=20.0):
                break
            time.sleep(rng.uniform(0.0, 0.1))
            if not any(thread.is_alive() for thread in threads):
                break
            server.kill()
            kills_mid_ingest += 1
            server.start()
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for thread in threads:
            thread.join(timeout=1.0)

    try:
        assert not problems, problems
        assert kills_mid_ingest == KILLS, "the clients finished before every kill; make the workload larger"
        assert acknowledged == [STEPS_PER_CLIENT] * N_CLIENTS
        with httpx.Client(base_url=server.url, headers=admin, timeout=10.0) as http:
            totals = http.get("/v1/usage/totals").json()
        expected_ns = sum(measured_ns(groups) for groups in workloads)
        assert totals["num_steps"] == N_CLIENTS * STEPS_PER_CLIENT
        assert totals["num_slices"] == sum(len(g) for groups in workloads for g in groups)
        assert totals["measured_ns"] == expected_ns
        assert totals["attributed_ns"] == expected_ns
        per_run = {row.run_id: row for row in ledger.request_usage(limit=10_000)}
        assert {run for run in per_run} == {f"run-{c}" for c in range(N_CLIENTS)}
        print(
            f"\ncrash test ({ledger.backend}): {kills_mid_ingest} kill -9 mid-ingest, {N_CLIENTS} clients, "
            f"{sum(acknowledged)} steps acknowledged, {sum(duplicates)} re-sent steps found already committed "
            f"(ack lost in a kill), {sum(failed_attempts)} failed attempts retried; "
            f"stored {totals['num_steps']} steps, {totals['measured_ns']} ns = expected {expected_ns} ns"
        )
    finally:
        server.stop()
        ledger.close()
