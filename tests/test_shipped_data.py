"""Shipped data: the workload mixes resolve inside the package, and nothing shipped points outside it."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow.parquet as pq
import pytest

from llmvisor import shipped
from llmvisor.cli.profile import recorded_command
from llmvisor.core.trace import METADATA_KEY
from llmvisor.profile.plans import Envelope, build_workload
from llmvisor.validation.plans import read_length_mixes

# A reference to the sibling folder the data came from, or to a machine path (the development checkout, a
# home folder). "shared/" also catches "shared/data/..." and "shared/docs/...".
FOREIGN_PATH = re.compile(r"\.\./shared|(?<![\w.])shared/|/work/|/home/|/root/|/Users/|[A-Za-z]:\\\\")


def test_default_workloads_are_the_shipped_files_inside_the_package():
    folder = shipped.workloads_dir()
    assert folder.resolve().is_relative_to(shipped.data_dir().resolve())
    for name in shipped.WORKLOAD_FILES:
        assert (folder / name).is_file(), name
    mixes = read_length_mixes()  # the validation's default
    assert [m.name + ".csv" for m in mixes] == list(shipped.WORKLOAD_FILES)
    # Row counts as stated in data/workloads/README.md.
    assert [m.prompt_tokens.size for m in mixes] == [19_366, 8_819, 28_257]
    assert all(m.prompt_tokens.min() >= 1 and m.output_tokens.min() >= 1 for m in mixes)


def test_validate_defaults_to_the_shipped_workloads():
    import inspect

    from llmvisor.cli.validate import validate

    assert inspect.signature(validate).parameters["workloads"].default is None
    source = inspect.getsource(validate)
    assert "shipped.workloads_dir()" in source and "../shared" not in source


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _foreign(where: str, document) -> list[str]:
    found = []
    for text in _strings(document):
        if FOREIGN_PATH.search(text) or (text.startswith("/") and os.path.isabs(text)):
            found.append(f"{where}: {text[:120]!r}")
    return found


def test_nothing_shipped_points_outside_the_package():
    data = shipped.data_dir()
    found = []
    for path in sorted(data.rglob("*")):
        if not path.is_file():
            continue
        where = str(path.relative_to(data))
        if path.suffix == ".json":
            found += _foreign(where, json.loads(path.read_text(encoding="utf-8")))
        elif path.name.endswith(".jsonl.gz"):
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    found += _foreign(f"{where}:{number}", json.loads(line))
        elif path.suffix == ".parquet":
            metadata = pq.read_schema(path).metadata or {}
            assert METADATA_KEY in metadata, where
            found += _foreign(where, json.loads(metadata[METADATA_KEY]))
            raw = path.read_bytes()  # as `strings FILE | grep`: also the Arrow schema copy of the metadata
            assert b"shared/" not in raw and b"/work/" not in raw, where
        elif path.suffix == ".md":
            found += [f"{where}: {m.group(0)!r}" for m in FOREIGN_PATH.finditer(path.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


def test_the_scan_catches_what_it_looks_for():
    assert _foreign("x", {"engine_model_dir": "/work/main/src/llmvisor/data/engine-model"})
    assert _foreign("x", {"command": "llmvisor profile --workload ../shared/data/workloads/a.csv"})
    assert _foreign("x", [{"path": "/opt/data/a.csv"}])
    assert not _foreign("x", {"path": "llmvisor/data/workloads/a.csv", "note": "p50 / p90, a machine shared with other jobs"})


def test_portable_path_names_shipped_files_by_package_name(tmp_path):
    conv = shipped.workloads_dir() / "azure-2023-conv.csv"
    assert shipped.portable_path(conv) == "llmvisor/data/workloads/azure-2023-conv.csv"
    assert shipped.portable_path(shipped.engine_model_dir()) == "llmvisor/data/engine-model"
    outside = tmp_path / "mine.csv"
    assert shipped.portable_path(outside) == str(outside)
    assert shipped.portable_path("relative/mine.csv") == "relative/mine.csv"


def test_profile_records_shipped_workloads_by_package_name(tmp_path):
    conv = str(shipped.workloads_dir() / "azure-2023-conv.csv")
    own = tmp_path / "own.csv"
    own.write_text("num_prefill_tokens,num_decode_tokens\n10,2\n")
    plan = build_workload([conv, str(own)], Envelope(4096, 2048, 32), num_requests=2)
    assert [w["path"] for w in plan.metadata["workloads"]] == ["llmvisor/data/workloads/azure-2023-conv.csv", str(own)]
    command = recorded_command(["/somewhere/bin/llmvisor", "profile", "--workload", conv, f"--workload={own}", "-o", "missing/out.parquet"])
    assert command == f"llmvisor profile --workload llmvisor/data/workloads/azure-2023-conv.csv --workload={own} -o missing/out.parquet"


@pytest.mark.parametrize("name", shipped.WORKLOAD_FILES)
def test_shipped_workloads_are_described(name):
    readme = (shipped.workloads_dir() / "README.md").read_text(encoding="utf-8")
    assert name in readme and "CC-BY 4.0" in readme and "MIT" in readme
