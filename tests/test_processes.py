"""The suite's process helper stops whole process groups however a test ends, and the session's leftover check
sees a child that left the group (as the recorder's delivery process does)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from _processes import SESSION_ENV, leftover_processes, run_process, running, session_id, start_process, stop_process, wait_ready
from llmvisor.net import free_loopback_port

# A parent that starts a grandchild in its group, prints the grandchild's pid and waits.
PARENT = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); print(c.pid, flush=True); time.sleep(300)"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def environ(pid: int) -> list[bytes]:
    """The process's environment; empty for a moment while it execs, so read until it is not."""
    for _ in range(50):
        with open(f"/proc/{pid}/environ", "rb") as handle:
            found = handle.read().split(b"\0")
        if found != [b""]:
            return found
        time.sleep(0.1)
    return found


def test_stopping_a_process_stops_its_group_and_children_carry_the_marker():
    process = start_process([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(process.stdout.readline())
        assert alive(grandchild)
        assert f"{SESSION_ENV}={session_id()}".encode() in environ(grandchild)
        assert {p.pid for p in leftover_processes()} >= {process.pid, grandchild}
    finally:
        stop_process(process, timeout_s=2)
    assert process.poll() is not None and not alive(grandchild)


def test_a_with_block_stops_the_group_when_the_test_fails():
    with pytest.raises(KeyboardInterrupt), running([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True) as process:
        grandchild = int(process.stdout.readline())
        raise KeyboardInterrupt
    assert not alive(grandchild)


def test_a_command_that_times_out_leaves_no_background_server():
    script = "sleep 302 & echo $!; wait"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process(["bash", "-c", script], timeout_s=1)
    assert time.monotonic() - started < 15
    assert not [p for p in leftover_processes() if "sleep 302" in " ".join(p.cmdline())]


def test_a_timed_out_command_takes_the_servers_it_started_in_their_own_session_along():
    """As `llmvisor experiment calibration` starts vLLM servers (ManagedProcess: a session of their own)."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '303'], start_new_session=True); time.sleep(300)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_process([sys.executable, "-c", code], timeout_s=2)
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "303"]]


def test_a_child_that_leaves_the_group_is_still_found_by_its_marker():
    done = run_process([sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '300'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                       timeout_s=30)
    escaped = int(done.stdout)
    try:
        assert escaped in {p.pid for p in leftover_processes()}
    finally:
        psutil.Process(escaped).kill()


def test_readiness_is_not_satisfied_by_a_foreign_server_on_the_port():
    """A server of this process (not of the child) answers 200 on the port: the wait fails, naming the holder."""
    port = free_loopback_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with running(["sleep", "300"]) as process, pytest.raises(AssertionError, match=f"port {port} is held by"):
            wait_ready(process, f"http://127.0.0.1:{port}/", port=port, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()


def test_readiness_fails_fast_when_the_process_dies():
    port = free_loopback_port()
    started = time.monotonic()
    with running([sys.executable, "-c", "raise SystemExit(3)"]) as process, pytest.raises(AssertionError, match="exited with code 3"):
        wait_ready(process, f"http://127.0.0.1:{port}/health", port=port, timeout_s=600)
    assert time.monotonic() - started < 30


def test_a_session_that_leaves_a_process_fails_and_kills_it(tmp_path):
    """A pytest run with this conftest whose test starts a server in a session of its own and forgets it."""
    (tmp_path / "test_leak.py").write_text(
        "import subprocess\n\n\ndef test_leaks():\n"
        "    subprocess.Popen(['sleep', '301'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent / "src")]), "LLMVISOR_TEST_LEFTOVER_GRACE_S": "1"}
    done = run_process([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path / "test_leak.py")],
                       timeout_s=120, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "processes the suite left running (killed now)" in done.stdout
    assert "sleep 301" in done.stdout
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "301"]]


def test_without_a_signal_the_group_gets_its_grace_to_end_on_its_own():
    process = start_process([sys.executable, "-c", "import time; time.sleep(1.5)"])
    started = time.monotonic()
    stop_process(process, timeout_s=30, sig=None)
    assert process.returncode == 0 and time.monotonic() - started < 20  # it ran to its end, not killed
    stubborn = start_process(["sleep", "300"])
    stop_process(stubborn, timeout_s=1, sig=None)
    assert stubborn.returncode == -9
