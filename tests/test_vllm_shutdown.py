"""Stopping the real OpenAI server (vLLM CPU build) with requests in flight: the documented stop ends in the stated
time and bills every step the engine ran (docs/recorder.md, "Stopping the server").

vLLM's own entry point waits for open connections without a time limit once its engine has stopped ("Waiting
for connections to close"); `llmvisor.engines.vllm.openai_server` runs that entry point with uvicorn's graceful
shutdown bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from llmvisor.client import wait_for_delivery
from llmvisor.core.trace import read_trace
from llmvisor.engines.vllm.openai_server import DEFAULT_HTTP_SHUTDOWN_GRACE_S, http_shutdown_grace_s
from llmvisor.errors import LlmvisorError
from test_vllm_delivery import (  # noqa: F401
    ApiServer,
    assert_completed_requests_billed_once,
    assert_ledger_matches_trace,
    request_rows,
    service,
    whole_answer,
)

pytestmark = pytest.mark.vllm

LAUNCHER = "llmvisor.engines.vllm.openai_server"
ENGINE_TEARDOWN_S = 30.0
"""Allowance on top of ``--shutdown-timeout`` and the HTTP grace for the engine's and workers' teardown (vLLM gives
its workers 5 s, then signals them) on a loaded 2-core machine; the docs state the bound with this allowance."""


ORPHAN_EXIT_BOUND_S = 20.0
"""How long the engine side may take to exit after its API server is SIGKILLed (measured: see the test's output)."""
ORPHANED_TENANT = "(orphaned)"


class Clients:
    """Clients sending long completions back to back; each request's start, end and answer are kept."""

    def __init__(self, server: ApiServer, n_clients: int, max_tokens: int):
        self.server = server
        self.max_tokens = max_tokens
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(seed,), daemon=True) for seed in range(n_clients)]
        for thread in self.threads:
            thread.start()

    def run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        k = 0
        while not self.stop.is_set() and self.server.process.poll() is None:
            k += 1
            tenant = f"{self.server.run_id}-c{seed}-{k}"
            prompt_len = int(rng.integers(8, 64))
            max_tokens = self.max_tokens + 40 * seed  # clients out of step: some request is always mid-answer
            record = {"tenant": tenant, "prompt_len": prompt_len, "max_tokens": max_tokens, "start_s": time.monotonic(), "end_s": None,
                      "status": None}  # fmt: skip
            with self.lock:
                self.records.append(record)
            body = {"model": self.server.model, "prompt": rng.integers(10, 1000, prompt_len).tolist(), "max_tokens": max_tokens,
                    "ignore_eos": True, "vllm_xargs": {"tenant": tenant}}  # fmt: skip
            try:
                response = httpx.post(f"{self.server.base}/v1/completions", json=body, timeout=300)
            except httpx.HTTPError as error:
                record.update(end_s=time.monotonic(), status=type(error).__name__)
                return
            record.update(end_s=time.monotonic(), status=response.status_code)
            if response.status_code == 200:
                answer = response.json()
                record["finish_reason"] = answer["choices"][0]["finish_reason"]
                record["completion_tokens"] = answer["usage"]["completion_tokens"]
                if whole_answer(answer):
                    with self.server._lock:
                        self.server.completed[tenant] = (prompt_len, record["completion_tokens"])

    def wait_mid_answer(self, timeout_s: float) -> None:
        """Until some request has been answered in full, vLLM's own gauge (``vllm:num_requests_running`` on the
        server's /metrics) counts at least two requests the scheduler has taken on, and a request still unanswered
        has a step in the trace: a signal sent now finds the engine running one. (Time in flight alone says nothing
        on a loaded machine: a request can wait seconds in the API server before its first step; nor does the gauge
        alone: it is as old as the last stats the engine sent, and the requests it counted may have ended since.)"""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.server._lock:
                answered = bool(self.server.completed)
            if answered:
                try:
                    metrics = httpx.get(f"{self.server.base}/metrics", timeout=10).text
                except httpx.HTTPError:
                    metrics = ""
                running = [sample.value for family in text_string_to_metric_families(metrics) for sample in family.samples
                           if sample.name == "vllm:num_requests_running"]  # fmt: skip
                # the trace last, just before the caller's signal: a request seen there before a slow /metrics read
                # could have been answered by the time the signal went (CI once sent it with none left in flight)
                if running and sum(running) >= 2 and self.unanswered_in_trace():
                    return
            time.sleep(0.05)
        pytest.fail(f"no request answered in full with two others running, one of them in the trace, within {timeout_s:.0f} s")

    def unanswered_in_trace(self) -> bool:
        """Whether a request not yet answered has run a step: its tenant is in the trace written so far."""
        with self.lock:
            unanswered = [r["tenant"] for r in self.records if r["end_s"] is None]
        path = self.server.folder / "trace.jsonl"
        text = path.read_text(errors="replace") if path.exists() else ""
        return any(f'"{tenant}"' in text for tenant in unanswered)

    def in_flight(self, at_s: float) -> list[dict]:
        with self.lock:
            return [r for r in self.records if r["start_s"] < at_s and (r["end_s"] is None or r["end_s"] > at_s)]

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("shutdown_timeout_s", [0, 20])
def test_sigint_with_requests_in_flight_ends_within_the_stated_time_and_bills_every_step(service, tmp_path, monkeypatch, shutdown_timeout_s):
    monkeypatch.setenv("LLMVISOR_HTTP_SHUTDOWN_GRACE_S", str(DEFAULT_HTTP_SHUTDOWN_GRACE_S))
    # Steps reach the trace file within 0.1 s (not the default 1 s), so the wait below sees a request mid-answer.
    server = ApiServer(service, tmp_path, "stop", extra_args=("--shutdown-timeout", str(shutdown_timeout_s)), entry_point=LAUNCHER,
                       extra_env={"LLMVISOR_FLUSH_INTERVAL_S": "0.1"})  # fmt: skip
    clients = None
    try:
        engine_pid = server.engine_pid()
        clients = Clients(server, n_clients=4, max_tokens=200)
        clients.wait_mid_answer(timeout_s=120)
        sigint_s = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        bound_s = shutdown_timeout_s + DEFAULT_HTTP_SHUTDOWN_GRACE_S + ENGINE_TEARDOWN_S
        try:
            server.process.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs {bound_s:.0f} s after SIGINT:\n{server.log()[-3000:]}")
        stopped_s = time.monotonic() - sigint_s
        print(f"--shutdown-timeout {shutdown_timeout_s}: SIGINT to exit {stopped_s:.1f} s")
    finally:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
        if clients is not None:
            clients.join()
    assert gone(engine_pid), "the engine-core process outlived the server"
    assert wait_for_delivery(server.delivery_pid, 60), "the delivery process did not finish"
    in_flight = clients.in_flight(sigint_s)
    assert in_flight, "no request was in flight at SIGINT"
    log = server.log()
    if shutdown_timeout_s:
        # Draining: every request in flight at SIGINT that the engine had started (it ran a step: its tenant is in the
        # trace) was answered in full. One still on its way to the engine (sent, not yet scheduled: on a loaded
        # machine the API server's side can lag seconds) is refused when the HTTP grace ends, and was never billed.
        assert f"mode=drain timeout={shutdown_timeout_s}s" in log
        ran = set(read_trace(tmp_path / "trace.jsonl").tenant.tolist())
        started = [r for r in in_flight if r["tenant"] in ran]
        assert started, f"no request in flight at SIGINT had run a step: {in_flight}\n{log[-4000:]}"
        assert all(r["status"] == 200 and r["completion_tokens"] == r["max_tokens"] for r in started), started
        # One the engine never ran got no tokens: refused, or answered 200 with finish_reason "abort" and nothing in it
        # (vLLM answers a request aborted before its first step that way). Tokens without a step would be unbilled.
        never_ran = [r for r in in_flight if r["tenant"] not in ran]
        assert all(r["status"] != 200 or r.get("completion_tokens") == 0 for r in never_ran), never_ran
    else:
        assert "mode=abort timeout=0s" in log
    assert_completed_requests_billed_once(service["db_url"], server)
    n_steps = assert_ledger_matches_trace(service["db_url"], tmp_path / "trace.jsonl", server.run_id)
    assert n_steps > 20
    relayed = re.findall(r"relayed (\d+) steps of run", log)
    if relayed:  # the engine lived to log what it handed over: the ledger holds exactly that many steps
        assert int(relayed[-1]) == n_steps


def test_http_shutdown_grace_comes_from_the_environment_and_bad_values_are_one_line_errors():
    assert http_shutdown_grace_s({}) == DEFAULT_HTTP_SHUTDOWN_GRACE_S
    assert http_shutdown_grace_s({"LLMVISOR_HTTP_SHUTDOWN_GRACE_S": "2.5"}) == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(LlmvisorError, match="LLMVISOR_HTTP_SHUTDOWN_GRACE_S must be a number of seconds"):
            http_shutdown_grace_s({"LLMVISOR_HTTP_SHUTDOWN_GRACE_S": bad})


def test_bound_http_shutdown_sets_uvicorns_graceful_timeout_unless_given(monkeypatch):
    import uvicorn

    from llmvisor.engines.vllm.openai_server import bound_http_shutdown

    monkeypatch.setattr(uvicorn, "Config", uvicorn.Config)  # restored after the test
    original = uvicorn.Config
    assert original(app=None).timeout_graceful_shutdown is None  # uvicorn's default: wait for ever
    bound_http_shutdown(3.0)
    bound_http_shutdown(4.0)  # a second call replaces the first, it does not stack
    assert uvicorn.Config.__mro__[1] is original
    assert uvicorn.Config(app=None).timeout_graceful_shutdown == 4.0
    assert uvicorn.Config(app=None, timeout_graceful_shutdown=1).timeout_graceful_shutdown == 1


def ends_s_of(trace) -> np.ndarray:
    """Each slice's step end, unix seconds."""
    return trace.extra["timestamp_s"].astype(float) + trace.step_latency_s


def assert_orphaned_tail(trace, run_id: str, seen_s: float, log: str, ledger_rows: dict[str, list], excerpt: str) -> tuple[int, int]:
    """The steps recorded after the API server's death was seen (``seen_s``, unix time) are the run's last ones (none
    only where the engine's own count says 0: it is stopped at once, and a step in flight may not end), each wholly
    orphaned and measured; every step billed to a client's tenant ended before the death was seen (a step that ended
    just before, recorded just after, is orphaned too); the ledger holds the orphaned steps' tokens under the orphaned
    tenant. Returns (orphaned, all) step counts."""
    mine = trace.run_id == run_id
    orphaned = mine & (trace.tenant == ORPHANED_TENANT)
    orphaned_steps = np.unique(trace.step_id[orphaned])
    all_steps = np.unique(trace.step_id[mine])
    counted = re.findall(r"(\d+) steps of run (\S+) ended after the API server died", log)
    if orphaned_steps.size == 0:
        # The recorder stops the engine as soon as it sees the death (abort shutdown): a step in flight then may or
        # may not end first, so none orphaned is possible, but only with the engine's own count saying so.
        assert counted and counted[-1] == ("0", run_id), f"no step recorded as orphaned, and the engine did not say 0:\n{excerpt}"
        assert ends_s_of(trace)[mine].max() <= seen_s + 1e-3, excerpt
        return 0, int(all_steps.size)
    assert orphaned_steps.tolist() == all_steps[all_steps.size - orphaned_steps.size :].tolist(), excerpt
    assert not np.isin(trace.step_id[mine & ~orphaned], orphaned_steps).any()
    assert ends_s_of(trace)[mine & ~orphaned].max() <= seen_s + 1e-3, excerpt
    if counted:  # the engine logged it on its way out (unless its teardown was cut short)
        assert int(counted[-1][0]) == orphaned_steps.size and counted[-1][1] == run_id, excerpt
    assert ORPHANED_TENANT in ledger_rows, f"the ledger holds nothing under {ORPHANED_TENANT}: {sorted(ledger_rows)}"
    assert sum(r.num_new_tokens for r in ledger_rows[ORPHANED_TENANT]) == int(trace.num_new_tokens[orphaned].sum()) > 0
    orphaned_per_step = (trace.run_id_per_step == run_id) & np.isin(trace.step_id_per_step, orphaned_steps)
    assert orphaned_per_step.sum() == orphaned_steps.size and (trace.step_latency_s_per_step[orphaned_per_step] > 0).all()
    return int(orphaned_steps.size), int(all_steps.size)


def test_sigkill_of_the_api_server_stops_the_engine_and_bills_the_steps_after_it_to_no_tenant(service, tmp_path):
    server = ApiServer(service, tmp_path, "orphan")
    clients = None
    try:
        engine_side = {c.pid: c.name() for c in psutil.Process(server.process.pid).children(recursive=True)}
        assert server.engine_pid() in engine_side
        clients = Clients(server, n_clients=4, max_tokens=200)
        clients.wait_mid_answer(timeout_s=120)  # the engine is running requests: the steps it ends next are orphaned
        os.kill(server.process.pid, signal.SIGKILL)  # the API server only, as an OOM kill does
        server.process.wait()
        killed_s = time.monotonic()
        while time.monotonic() - killed_s < ORPHAN_EXIT_BOUND_S and not all(gone(pid) for pid in engine_side):
            time.sleep(0.1)
        exit_s = time.monotonic() - killed_s
        left = {pid: name for pid, name in engine_side.items() if not gone(pid)}
        assert not left, f"still running {ORPHAN_EXIT_BOUND_S:.0f} s after the API server's SIGKILL: {left}"
        print(f"engine side gone {exit_s:.1f} s after the API server's SIGKILL")
    finally:
        for pid in engine_side:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if clients is not None:
            clients.join()
    assert wait_for_delivery(server.delivery_pid, 60), "the delivery process did not finish"
    log = server.log()
    seen = re.findall(rf"the API server \(pid {server.process.pid}\) is gone \(seen at unix time ([0-9.]+)\)", log)
    excerpt = "\n".join(line for line in log.splitlines() if "llmvisor" in line or "shutdown" in line)[-4000:]
    assert seen, excerpt
    # stored and measured, under the orphaned tenant only; the ledger holds every step of the trace once
    assert_ledger_matches_trace(service["db_url"], tmp_path / "trace.jsonl", server.run_id)
    trace = read_trace(tmp_path / "trace.jsonl")
    n_orphaned, n_steps = assert_orphaned_tail(trace, server.run_id, float(seen[-1]), log, request_rows(service["db_url"], server.run_id), excerpt)
    print(f"{n_orphaned} of {n_steps} steps recorded as orphaned")
