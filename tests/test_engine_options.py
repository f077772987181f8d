"""Engine options are defined once (EngineSettings) and every command that starts an engine shows that definition."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest
import typer

from llmvisor.cli import params
from llmvisor.cli.main import app
from llmvisor.engines.settings import EngineSettings

ENGINE_COMMANDS = (("profile",), ("validate",), ("experiment", "fairness"))


def command(path: tuple[str, ...]):
    node = typer.main.get_command(app)
    for name in path:
        node = node.get_command(typer.Context(node), name)
    return node


def test_every_engine_command_takes_the_settings_options_with_their_one_help_and_default():
    definitions = {f.metadata["option"].split("/")[0]: f for f in fields(EngineSettings)}
    for path in ENGINE_COMMANDS:
        options = {opt: param for param in command(path).params for opt in param.opts}
        for name in ("--engine-model", "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--kv-cache-gib", "--threads",
                     "--dtype"):
            param, definition = options[name], definitions[name]
            assert param.help.startswith(definition.metadata["help"]), (path, name)
            if name != "--engine-model":
                assert param.default == definition.default, (path, name)
        for name in ("--kv-cache-gib", "--threads"):
            assert options[name].help.startswith("vLLM CPU build only:"), (path, name)


def test_engine_model_and_latency_model_are_named_apart_and_old_names_still_work():
    profile = command(("profile",))
    options = {opt: param.name for param in profile.params for opt in param.opts}
    assert options["--engine-model"] == "engine_model" and "--model" not in options
    warnings = []
    assert params.rename_deprecated(profile, ["--model", "weights"], warnings.append) == ["--engine-model", "weights"]
    for path in (("validate",), ("experiment", "fairness")):
        node = command(path)
        options = {opt: param.name for param in node.params for opt in param.opts}
        assert options["--model"] == options["-m"] == "model"
        assert options["--engine-model"] == "engine_model"
        assert params.rename_deprecated(node, ["--latency-model", "m.json"], warnings.append) == ["--model", "m.json"]
    assert warnings == ["--model is deprecated; use --engine-model", *["--latency-model is deprecated; use --model"] * 2]


def test_the_engine_options_import_no_engine():
    code = "import sys, llmvisor.cli.engine_options, llmvisor.cli.main; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_dtype_reaches_vllm_only_when_asked_for():
    """``auto`` passes nothing (vLLM's default: an engine that asks for no dtype starts with the arguments it always had);
    another value is vLLM's ``dtype``; a value vLLM does not take is one line naming the ones it does."""
    from llmvisor.cli.engine_options import engine_settings
    from llmvisor.errors import LlmvisorError

    assert "dtype" not in engine_settings(None).llm_kwargs(has_weights=False, scheduler_cls=object)
    assert engine_settings(None, dtype="float32").llm_kwargs(has_weights=False, scheduler_cls=object)["dtype"] == "float32"
    with pytest.raises(LlmvisorError) as refused:
        engine_settings(None, dtype="fp8")
    assert str(refused.value) == "--dtype: expected one of auto, bfloat16, float16, float32, got 'fp8'"
