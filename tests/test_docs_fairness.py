"""docs/fairness.md's configuration examples are what the scheduler reads: the TOML block loads through
`LLMVISOR_FAIR_CONFIG` with every key it shows taken as shown, and so does the inline JSON."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from llmvisor import shipped
from llmvisor.fairness.policy import FairnessConfig

DOC = (Path(__file__).resolve().parents[1] / "docs" / "fairness.md").read_text(encoding="utf-8")


def toml_block() -> str:
    blocks = re.findall(r"^```toml\n(.*?)^```", DOC, re.S | re.M)
    assert len(blocks) == 1
    return blocks[0]


def flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_documented_toml_config_loads_with_every_key_as_written(tmp_path, monkeypatch):
    (tmp_path / "fair.toml").write_text(toml_block(), encoding="utf-8")
    written = tomllib.loads(toml_block())
    shutil.copy(shipped.latency_model_path(), tmp_path / written["model"])
    monkeypatch.chdir(tmp_path)
    config = FairnessConfig.from_env({"LLMVISOR_FAIR_CONFIG": "fair.toml"})
    loaded = flatten(config.as_dict())
    for key, value in flatten(written).items():
        assert loaded[key] == pytest.approx(value) if isinstance(value, float) else loaded[key] == value, key
    assert config.load_model() is not None  # the model it names is a real model file


def test_the_documented_json_config_loads():
    inline = re.search(r"The same in JSON: `(\{.*?\})`", DOC, re.S).group(1)
    data = json.loads(inline.replace("\n", " "))
    config = FairnessConfig.from_env({"LLMVISOR_FAIR_CONFIG": json.dumps(data)})
    assert config.weights == {"acme": 2} and config.quotas["free-tier"].budget_s == 30 and config.tpot_slo_s == 0.08
    assert config.cost == data["cost"]
