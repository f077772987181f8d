#!/usr/bin/env bash
# The README's test command: installs what the tests need into .venv (llmvisor with every extra and the test
# tools), runs ruff (lint, no reformatting), starts a throwaway PostgreSQL server for the database tests (unless LLMVISOR_TEST_POSTGRES_URL
# already names one), runs pytest with any arguments given, and stops the server again. pytest runs in
# LLMVISOR_TEST_WORKERS processes (pytest-xdist, default 2, each module whole on one worker: module fixtures such as
# a real engine or service are started once), handed out in the order tests/conftest.py gives them
# (--no-loadscope-reorder: by default xdist hands out the modules with the most tests first); `-n 0` among the
# arguments runs it in this process alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test.sh
.venv/bin/python -m ruff check src tests
if [[ -z "${LLMVISOR_TEST_POSTGRES_URL:-}" ]]; then
    LLMVISOR_TEST_POSTGRES_URL="$(bash scripts/start-postgres.sh)"
    export LLMVISOR_TEST_POSTGRES_URL
    trap 'bash scripts/start-postgres.sh --stop "$LLMVISOR_TEST_POSTGRES_URL"' EXIT
fi
.venv/bin/python -m pytest -n "${LLMVISOR_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
