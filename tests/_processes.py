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
import json
import os
import shutil
import signal
import subprocess
import sys
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


# `llmvisor` commands as processes of their own, started from an interpreter that has already imported them.
CLI_PRELOAD = (
    "llmvisor.cli.main",  # what `python -m llmvisor.cli` imports before it parses the command line; then the
    # modules the commands import when they run (each ~0.1-1 s: FastAPI, SQLAlchemy, scipy, pyarrow), engines aside
    "llmvisor.billing", "llmvisor.billing.prices", "llmvisor.billing.push", "llmvisor.core.attribution", "llmvisor.core.model",
    "llmvisor.core.trace", "llmvisor.evaluation.heldout", "llmvisor.ledger", "llmvisor.ledger.migrate", "llmvisor.service.adjust",
    "llmvisor.service.app", "llmvisor.service.audit", "llmvisor.service.fleet", "llmvisor.service.load", "llmvisor.service.metrics",
    "llmvisor.service.refit", "llmvisor.service.registry",
)  # fmt: skip
_CLI_FORK_SERVER = """\
import gc, importlib, json, os, signal, sys, time
replies, grace_s = os.fdopen(int(sys.argv[1]), "w", buffering=1), float(sys.argv[2])
for name in sys.argv[3:]:
    importlib.import_module(name)
gc.collect()
gc.freeze()  # the imports' objects stay out of the children's collections (each exit would copy every page of them: 0.6 s)
sys.stdout.flush()
sys.stderr.flush()
replies.write("ready\\n")
while True:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    replies.write(json.dumps({"pid": pid}) + "\\n")
    _, status = os.waitpid(pid, 0)
    try:  # what the command left in its process group goes, as run_process stops a command's group
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            os.killpg(pid, 0)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\\n")
os.setsid()
replies.close()
for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.path[0] = os.getcwd()
sys.argv = ["-m", *request["args"]]
del fd, path, flags, opened, line, pid, replies, request
import runpy
runpy.run_module("llmvisor.cli", run_name="__main__", alter_sys=True)
"""


class _CliForkServer:
    """A fresh interpreter that imports `CLI_PRELOAD` once (its stdout and stderr meanwhile kept) and then forks a
    child per command: the child leaves for a session of its own, takes the command's working folder, environment
    and argv, points stdin at /dev/null and stdout and stderr at files (the file descriptors, so whatever the process
    writes is there), and runs ``python -m llmvisor.cli`` as the interpreter would (`runpy`), ending as it would
    (exit status, traceback on stderr, atexit)."""

    def __init__(self, env: dict):
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="llmvisor-cli-"))
        read_fd, write_fd = os.pipe()
        with open(self.folder / "import.out", "wb") as out, open(self.folder / "import.err", "wb") as err:
            self.process = start_process([sys.executable, "-c", _CLI_FORK_SERVER, str(write_fd), str(GRACE_S), *CLI_PRELOAD], env=env,
                                         stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.replies, self.pending = read_fd, b""
        ready = self._reply(START_TIMEOUT_S)
        assert ready == "ready", f"the CLI fork server did not start:\n{(self.folder / 'import.err').read_text()[-3000:]}"
        # what importing printed, every process of `python -m llmvisor.cli` would print first
        self.import_out, self.import_err = ((self.folder / name).read_text() for name in ("import.out", "import.err"))

    def _reply(self, timeout_s: float) -> str | None:
        """The server's next line, or None if none comes within ``timeout_s``."""
        import select

        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.pending:
            if not select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(self.replies, 65536)
            assert chunk, f"the CLI fork server ended (exit {self.process.poll()}):\n{(self.folder / 'import.err').read_text()[-3000:]}"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def run(self, argv: list[str], cwd: str, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        out, err = self.folder / "out", self.folder / "err"
        self.process.stdin.write(json.dumps({"args": argv, "cwd": cwd, "env": env, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.process.stdin.flush()
        pid = json.loads(self._reply(START_TIMEOUT_S))["pid"]
        done = self._reply(timeout_s)
        if done is None:
            for kill in (os.killpg, os.kill):  # its group, and the child itself if it has not left for its own session yet
                with contextlib.suppress(ProcessLookupError):
                    kill(pid, signal.SIGKILL)
            self._reply(START_TIMEOUT_S)
        stdout, stderr = self.import_out + out.read_text(errors="replace"), self.import_err + err.read_text(errors="replace")
        command = [sys.executable, "-m", "llmvisor.cli", *argv]
        if done is None:
            raise subprocess.TimeoutExpired(command, timeout_s, stdout, stderr)
        return subprocess.CompletedProcess(command, json.loads(done)["returncode"], stdout, stderr)

    def stop(self) -> None:
        self.process.stdin.close()
        stop_process(self.process, sig=None, timeout_s=GRACE_S)
        os.close(self.replies)
        shutil.rmtree(self.folder, ignore_errors=True)


_cli_fork_servers: dict[tuple, _CliForkServer] = {}  # by environment, the least recently used first
CLI_FORK_SERVERS_KEPT = 3


def cli_process(*args, cwd: str | Path | None = None, env: dict | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m llmvisor.cli ARGS`` as a process of its own: what ``subprocess.run(..., capture_output=True,
    text=True)`` returns (exit status, stdout, stderr, each as the process wrote it), for the checks that are about
    the process (a refusal is one line on stderr and exit 2, no traceback, not a stray warning or log line: in the
    test's own process pytest would take those off stderr). Forked from an interpreter of the same environment that
    has imported the commands (`CLI_PRELOAD`, each environment its own), so each command does not pay the start and
    the imports (1-4 s on a loaded 2-core machine); anything those imports print is in each command's output, as it
    would be in a fresh process. Commands that start servers of their own run with `run_process` instead."""
    env = marked_env(env)
    key = tuple(sorted((name, value) for name, value in env.items() if name != "PYTEST_CURRENT_TEST"))
    server = _cli_fork_servers.pop(key, None)
    if server is None or server.process.poll() is not None:
        while len(_cli_fork_servers) >= CLI_FORK_SERVERS_KEPT:  # the one used longest ago goes (each holds ~300 MB)
            _cli_fork_servers.pop(next(iter(_cli_fork_servers))).stop()
        server = _CliForkServer(env)
    _cli_fork_servers[key] = server  # last: the most recently used
    return server.run([str(a) for a in args], str(Path(cwd or os.getcwd()).resolve()), env, timeout_s)


def stop_cli_fork_servers() -> None:
    """At the session's end (tests/conftest.py), before the check for leftover processes."""
    while _cli_fork_servers:
        _cli_fork_servers.popitem()[1].stop()
