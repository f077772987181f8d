"""`run_engine_module`: an engine module that fails is reported with its log's tail, naming what ran."""

from __future__ import annotations

import json

import pytest

from llmvisor.engine_process import run_engine_module
from llmvisor.errors import LlmvisorError


def test_a_failed_engine_module_is_reported_with_its_log(tmp_path):
    with pytest.raises(LlmvisorError) as raised:
        run_engine_module("llmvisor.engines.no_such_engine", {"name": "x"}, spec_path=tmp_path / "runs" / "spec.json",
                          result_path=tmp_path / "result.json", log_path=tmp_path / "run.log", what="test run x")
    message = str(raised.value)
    assert message.startswith("test run x failed (exit 1); see ") and str(tmp_path / "run.log") in message
    assert "No module named llmvisor.engines.no_such_engine" in message
    assert json.loads((tmp_path / "runs" / "spec.json").read_text()) == {"name": "x"}
