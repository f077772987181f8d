"""Each test starts from the environment the session started with, and the session leaves no process behind.

The in-process engine drivers (profile, validation's controlled engine, the fairness runner) configure the
recorder through environment variables, as vLLM's scheduler plugins are configured; without this, one test's
settings (e.g. ``LLMVISOR_UNIQUE_RUN_ID=0``) would reach the servers a later test starts.

Every child of the session carries its marker (``_processes.SESSION_ENV``, set here before any test runs, so
children started with ``os.environ`` inherit it too); at the session's end any marked process still alive (after
a grace for the recorder's delivery processes to finish) is listed, killed, and fails the run.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from _processes import SESSION_ENV, START_TIMEOUT_S, describe, kill_all, leftover_processes

LEFTOVER_GRACE_S = float(os.environ.get("LLMVISOR_TEST_LEFTOVER_GRACE_S", "30"))

# A fresh marker (a pytest run inside a test is a session of its own), set before the first test saves the
# environment, so every child inherits it.
os.environ[SESSION_ENV] = uuid.uuid4().hex
# The experiments' own engine start-up waits (llmvisor.engines.vllm.fleet.start_timeout_s) get the suite's limit.
os.environ.setdefault("LLMVISOR_ENGINE_START_TIMEOUT_S", str(START_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _session_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(LEFTOVER_KEY, [])
    if lines:
        terminalreporter.section("processes the suite left running (killed now)", red=True)
        for line in lines:
            terminalreporter.write_line(line)
