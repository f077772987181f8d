#!/usr/bin/env bash
# Installs everything the test suite needs into .venv: llmvisor (editable) with every extra (all: service,
# postgres, report, eval, vllm) and the test tools (pytest, hypothesis, ruff), minus the torch add-ons that
# break vLLM's server, exactly as the README's operator install says. Also two server binaries from Debian, each only when
# it is missing: `prometheus` for the fleet metrics test and `redis-server` for the shared fairness counters
# tests. The tests start each binary themselves on a free loopback port, so the packages' own services (if the
# system starts them) play no part.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The README's operator install, with every extra and the test tools: the same two pip lines
# (tests/test_install_doc.py keeps them in step).
.venv/bin/pip install -q -e ".[all,test]"
.venv/bin/pip uninstall -y torchvision torchaudio torchcodec
.venv/bin/python -c "import vllm, llmvisor; print('vllm', vllm.__version__, '| llmvisor', llmvisor.__version__)" 2>/dev/null | tail -1

install_binary() {  # BINARY PACKAGE WHAT-SKIPS-WITHOUT-IT
    command -v "$1" >/dev/null && return 0
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -qq --no-install-recommends "$2" >&2; then
            apt-get update -qq >&2
            apt-get install -y -qq --no-install-recommends "$2" >&2
        fi
    else
        echo "install-test: no $1 binary and cannot apt-get $2 (not root or no apt): $3 will be skipped" >&2
    fi
}
# focus-validator (the FinOps Foundation's FOCUS validator) pins numpy<2 and multimethod<2 (it does not import with
# multimethod 2), which vLLM's stack cannot share: it gets its own environment, used only by the FOCUS export test.
[ -x .venv-focus/bin/focus-validator ] || { python3 -m venv .venv-focus && .venv-focus/bin/pip install -q "focus-validator==1.0.0" "multimethod<2"; }
install_binary prometheus prometheus "the Prometheus test"
install_binary redis-server redis-server "the shared fairness counters tests"
install_binary chromium chromium "the usage page's browser test"
install_binary chromedriver chromium-driver "the usage page's browser test"
