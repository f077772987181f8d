"""Each test starts from the environment the session started with, and the session leaves no process behind.

The in-process engine drivers (profile, validation's controlled engine, the fairness runner) configure the
recorder through environment variables, as vLLM's scheduler plugins are configured; without this, one test's
settings (e.g. ``LLMVISOR_UNIQUE_RUN_ID=0``) would reach the servers a later test starts.

Every child of the session carries its marker (``_processes.SESSION_ENV``, set here before any test runs, so
children started with ``os.environ`` inherit it too); at the session's end any marked process still alive (after
a grace for the recorder's delivery processes to finish) is listed, killed, and fails the run.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
import uuid

import pytest

from _processes import SESSION_ENV, START_TIMEOUT_S, describe, kill_all, leftover_processes, stop_cli_fork_servers
from _tiny_llama import SUITE_VLLM_ENV

LEFTOVER_GRACE_S = float(os.environ.get("LLMVISOR_TEST_LEFTOVER_GRACE_S", "30"))

# A fresh marker (a pytest run inside a test is a session of its own), set before the first test saves the
# environment, so every child inherits it.
os.environ[SESSION_ENV] = uuid.uuid4().hex
# The experiments' own engine start-up waits (llmvisor.engines.vllm.fleet.start_timeout_s) get the suite's limit.
os.environ.setdefault("LLMVISOR_ENGINE_START_TIMEOUT_S", str(START_TIMEOUT_S))
# Every engine the suite starts, in this process or a child, compiles without vLLM's AOT step (_tiny_llama.SUITE_VLLM_ENV).
for _name, _value in SUITE_VLLM_ENV.items():
    os.environ.setdefault(_name, _value)
# numpy's OpenBLAS runs one thread in the suite's processes and their children (torch's own kernels are not OpenBLAS).
# With two workers on two cores, the other worker's engine keeps both cores busy, and a 2-thread OpenBLAS product waits
# on a thread that is not running: pytest running test_lora_model's held-out evaluation alone took 19.2 and 11.6 s beside
# the calibration experiment's engine with 2 threads, 5.2 and 5.2 s with 1; the test itself took 3.0 s on an idle
# machine and 90 s in a full suite run.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
try:  # numpy may have been imported (by a plugin) before this file: its pool is then set directly
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")
except ImportError:
    pass
# Children stop on SIGINT as they do started from a terminal, however the suite was started. A shell running the test
# command in the background (`cmd &` in a script, nohup) starts it with SIGINT ignored, and every child inherits that:
# a child that sets no handler of its own (test_fleet_router's stand-in workers) then ignores the SIGINT that stops it
# and is killed 30 s later. In a full suite run started that way the router test took 94 s, alone 3 s.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _session_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _cli_fork_servers():
    """The interpreters `_processes.cli_process` forks its commands from end with the session's fixtures."""
    yield
    stop_cli_fork_servers()


def pytest_sessionfinish(session, exitstatus):
    """Runs after every fixture's teardown, on a normal end, a failure or an interrupt."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = leftover_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftover_processes()
    if not left:
        return
    lines = [describe(proc) for proc in left]
    kill_all(left)
    session.config.stash[LEFTOVER_KEY] = lines
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


LEFTOVER_KEY = pytest.StashKey[list]()

HEAVY_MARKERS = ("vllm", "slow", "packaging")
"""Modules with a test of these markers start an engine or build a wheel (tens of seconds to minutes each)."""


def pytest_collection_modifyitems(session, config, items):
    """Order modules, each kept whole: those with a ``measures`` test first, each followed by a light one, then half
    the other light ones, the other heavy ones, and the rest of the light ones. pytest-xdist's ``--dist loadfile``
    (scripts/test.sh) hands the first modules out in turn, so one worker runs the measuring modules while the other
    works through light modules (not waiting on the lock below); the heavy ones follow, and light ones even out the
    end."""

    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

    def marked(*names):
        return {module(item) for item in items if any(item.get_closest_marker(m) for m in names)}

    modules = list(dict.fromkeys(module(item) for item in items))
    measures, heavy = marked("measures"), marked(*HEAVY_MARKERS)
    first = [m for m in modules if m in measures]
    light = [m for m in modules if m not in heavy and m not in measures]
    interleaved = [m for pair in zip(first, light[: len(first)]) for m in pair] + first[len(light):]
    light = light[len(first):]
    order = interleaved + light[: len(light) // 2] + [m for m in modules if m in heavy and m not in measures] + light[len(light) // 2:]
    rank = {name: k for k, name in enumerate(order)}
    items.sort(key=lambda item: rank[module(item)])


ENGINE_LOCK_WAIT_S = float(os.environ.get("LLMVISOR_TEST_ENGINE_LOCK_WAIT_S", "1800"))
"""How long a module waits for the engine lock (the longest measuring module takes a few minutes) before failing."""


@pytest.fixture(scope="module", autouse=True)
def _engine_lock(request, tmp_path_factory):
    """A module with a test that ``measures`` step times runs with no other real-engine module at once (an exclusive
    lock), and a module with a ``vllm`` test shares the lock with the others: under pytest-xdist a second engine on
    the same cores makes the measured steps drift and the calibration rules refuse them, as they should on a machine
    that busy. Held for the whole module, since a module's fixtures may start its engines before its first test."""
    tests = [item for item in request.session.items if item.nodeid.split("::", 1)[0] == request.node.nodeid]
    exclusive = any(item.get_closest_marker("measures") for item in tests)
    if not exclusive and not any(item.get_closest_marker("vllm") for item in tests):
        yield
        return
    # Beside the base temps: under xdist the folder of this run's workers; without it, the user's folder of runs
    # (a measuring module then also waits for another run's engines on the machine, which is as it should be).
    path = tmp_path_factory.getbasetemp().parent / "llmvisor-engine.lock"
    with open(path, "a+") as handle:
        # bounded: a run left hanging elsewhere on the machine must fail this one with a reason, not stall it for ever
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > ENGINE_LOCK_WAIT_S:
                    pytest.fail(f"waited {ENGINE_LOCK_WAIT_S:.0f} s for {path}: another pytest run on this machine holds it "
                                "(one still starting engines, or left hanging); stop that run or let it finish", pytrace=False)
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(LEFTOVER_KEY, [])
    if lines:
        terminalreporter.section("processes the suite left running (killed now)", red=True)
        for line in lines:
            terminalreporter.write_line(line)
