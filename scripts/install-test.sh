#!/usr/bin/env bash
# Installs everything the test suite needs into .venv: llmvisor (editable) with every extra (all: service,
# postgres, report, eval, vllm) and the test tools (pytest, hypothesis, ruff), minus the optional torch
# add-ons that break `import vllm` (see docs/recorder.md). Also the Prometheus server binary (Debian's
# `prometheus` package) for the fleet metrics test, when it is missing; the test starts the binary itself on a
# free loopback port, so the package's own service (if the system starts one) plays no part.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[all,test]"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, llmvisor; print('vllm', vllm.__version__, '| llmvisor', llmvisor.__version__)" 2>/dev/null | tail -1
if ! command -v prometheus >/dev/null; then
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -qq --no-install-recommends prometheus >&2; then
            apt-get update -qq >&2
            apt-get install -y -qq --no-install-recommends prometheus >&2
        fi
    else
        echo "install-test: no prometheus binary and cannot apt-get it (not root or no apt): the Prometheus test will be skipped" >&2
    fi
fi
