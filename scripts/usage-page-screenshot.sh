#!/usr/bin/env bash
# Screenshot of the tenant usage page (docs/usage-page.png): runs the browser test (tests/test_usage_page.py), which
# serves a ledger of two tenants with `llmvisor serve`, logs in as tenant "acme" in headless chromium, and saves the page.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
LLMVISOR_USAGE_SCREENSHOT="$PWD/docs/usage-page.png" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m pytest tests/test_usage_page.py -q -x
echo "wrote docs/usage-page.png"
