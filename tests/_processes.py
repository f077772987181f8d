"""The one way the tests start and stop the processes they own (servers, engines, CLI commands that start them).

Each process starts in its own session, so its process group holds it and everything it starts that does not
leave the group (vLLM's engine core and workers, a doc script's background servers), and is stopped by signalling
the whole group: SIGTERM (or the signal given), then SIGKILL after a grace, however the test ends (exception,
timeout, KeyboardInterrupt; at interpreter exit for any still registered). Every child also carries
``LLMVISOR_TEST_SESSION=<this session's id>`` in its environment, which its own children inherit even when they
leave the group (the recorder's delivery process starts a new session on purpose), so the session's end can list
what the suite left behind (``leftover_processes``; conftest.py fails the run on any and kills them).

Start-up waits use one generous limit, ``START_TIMEOUT_S`` (``LLMVISOR_TEST_START_TIMEOUT_S``, default 1800 s: a
loaded 2-core machine without AVX-512 takes minutes to bring vLLM up), and fail at once when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

SESSION_ENV = "LLMVISOR_TEST_SESSION"
START_TIMEOUT_S = float(os.environ.get("LLMVISOR_TEST_START_TIMEOUT_S", "1800"))
GRACE_S = 10.0

_running: dict[int, subprocess.Popen] = {}  # process group id -> its leader, while the group may be alive


def session_id() -> str:
    """This test session's marker; set once in the test process's environment (conftest.py does it at start)."""
    return os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def marked_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with the session marker, for every child the tests start."""
    return {**(os.environ if env is None else env), SESSION_ENV: session_id()}


def start_process(argv: list[str], *, env: dict | None = None, log_path: str | Path | None = None, **popen) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group; output to ``log_path`` (appended) unless given in ``popen``."""
    if log_path is not None:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, env=marked_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    else:
        process = subprocess.Popen(argv, env=marked_env(env), start_new_session=True, **popen)
    _running[process.pid] = process
    return process


def group_members(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of a process group."""
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process(process: subprocess.Popen | None, timeout_s: float = GRACE_S, sig: int | None = signal.SIGTERM) -> None:
    """Stop ``process`` and its whole process group: ``sig``, then SIGKILL to whatever of the group is left after
    ``timeout_s``; its descendants that left the group (found while it still runs) get SIGTERM, then SIGKILL. With
    ``sig=None`` nothing is sent at first: the group gets ``timeout_s`` to end on its own (a server shutting down
    after its own signal). A process not started by ``start_process`` (not a group leader) is signalled alone."""
    if process is None:
        return
    leads_group = _running.pop(process.pid, None) is not None
    if not leads_group:
        if process.poll() is None:
            if sig is not None:
                process.send_signal(sig)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return
    pgid = process.pid
    try:  # children that left the group (a server the command started in a session of its own) go too
        outside = [c for c in psutil.Process(pgid).children(recursive=True) if os.getpgid(c.pid) != pgid]
    except (psutil.Error, OSError):
        outside = []
    if sig is not None:
        _signal_group(pgid, sig)
    deadline = time.monotonic() + timeout_s
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    if outside:
        kill_all(outside, grace_s=max(1.0, deadline - time.monotonic()))


@contextlib.contextmanager
def running(argv: list[str], **kwargs) -> Iterator[subprocess.Popen]:
    """``start_process`` for the ``with`` block; the group is stopped when the block ends, however it ends."""
    process = start_process(argv, **kwargs)
    try:
        yield process
    finally:
        stop_process(process)


def run_process(argv: list[str], *, timeout_s: float, env: dict | None = None, cwd: str | Path | None = None,
                input: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` in its own process group: on timeout
    (``subprocess.TimeoutExpired``), any other exception, or normal exit, the group is stopped, so a command that
    starts servers (a doc's script, an experiment) leaves none of them behind."""
    process = start_process(argv, env=env, cwd=cwd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(input, timeout=timeout_s)
    finally:
        stop_process(process)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def tree_pids(pid: int) -> set[int]:
    try:
        return {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def listener_pids(port: int) -> set[int]:
    """The processes (of this user: others' are not visible) listening on TCP ``port``."""
    return {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}


def wait_ready(process: subprocess.Popen, url: str, *, port: int, timeout_s: float = START_TIMEOUT_S,
               log: Callable[[], str] = lambda: "", ready: Callable[[object], bool] | None = None, interval_s: float = 0.5) -> None:
    """Wait until ``url`` answers 200 (and ``ready(response)``, if given) from a server of ``process``'s own tree
    listening on ``port``: a foreign server holding the port cannot satisfy it. Fails at once if ``process`` exits."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{process.args[:4]} exited with code {process.returncode} before it was ready:\n{log()[-3000:]}"
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200 and (ready is None or ready(response)):
                owners = listener_pids(port)
                assert owners & tree_pids(process.pid), f"{url} answers, but port {port} is held by {sorted(owners)}, not by {process.pid}"
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, (
            f"{url} not ready within {timeout_s:g} s (LLMVISOR_TEST_START_TIMEOUT_S raises the limit):\n{log()[-3000:]}"
        )
        time.sleep(interval_s)


def leftover_processes() -> list[psutil.Process]:
    """Processes of this session still alive (marked by ``SESSION_ENV`` or in a group the tests started), except
    this process and its ancestors."""
    marker = f"{SESSION_ENV}={session_id()}".encode()
    me = psutil.Process()
    exclude = {me.pid, *(p.pid for p in me.parents())}
    found = {}
    for pgid in list(_running):
        for proc in group_members(pgid):
            found[proc.pid] = proc
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in exclude or proc.pid in found:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0") and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    return [proc for pid, proc in sorted(found.items()) if pid not in exclude]


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ppid {proc.ppid()} pgid {os.getpgid(proc.pid)}: {' '.join(proc.cmdline())[:200]}"
    except (psutil.Error, OSError):
        return f"pid {proc.pid} (gone)"


def kill_all(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` for those still alive."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@atexit.register
def _stop_every_group() -> None:
    """A run cut short (KeyboardInterrupt past the teardowns) still stops the groups it started."""
    for process in list(_running.values()):
        stop_process(process, timeout_s=2.0)
