#!/usr/bin/env bash
# Installs everything the test suite needs into .venv: llmvisor (editable) with every extra (all: service,
# postgres, report, eval, vllm) and the test tools (pytest, hypothesis, ruff), minus the optional torch
# add-ons that break `import vllm` (see docs/recorder.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[all,test]"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, llmvisor; print('vllm', vllm.__version__, '| llmvisor', llmvisor.__version__)" 2>/dev/null | tail -1
