"""Each test starts from the environment the session started with.

The in-process engine drivers (profile, validation's controlled engine, the fairness runner) configure the
recorder through environment variables, as vLLM's scheduler plugins are configured; without this, one test's
settings (e.g. ``LLMVISOR_UNIQUE_RUN_ID=0``) would reach the servers a later test starts.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _session_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
