"""LoRA adapters written locally (`llmvisor.profile.adapters`): the files vLLM's loader reads, shaped by the base
model's config; vLLM loading and running them is tests/test_vllm_lora.py."""

from __future__ import annotations

import json

import pytest

from llmvisor import shipped
from llmvisor.errors import LlmvisorError
from llmvisor.profile.adapters import write_adapter

safetensors = pytest.importorskip("safetensors.numpy", reason="safetensors comes with the [vllm] extra")


def test_an_adapter_for_the_shipped_engine_model_has_peft_names_and_shapes(tmp_path):
    config_path = shipped.engine_model_dir() / "config.json"
    base = json.loads(config_path.read_text())
    adapter = write_adapter(tmp_path / "a", config_path, rank=16, target_modules=("q_proj", "v_proj", "down_proj"))
    config = json.loads((adapter.path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"], config["bias"]) == (16, 16, ["q_proj", "v_proj", "down_proj"], "none")
    tensors = safetensors.load_file(str(adapter.path / "adapter_model.safetensors"))
    assert len(tensors) == base["num_hidden_layers"] * 3 * 2
    head_dim = base["head_dim"]
    layer = "base_model.model.model.layers.7"
    assert tensors[f"{layer}.self_attn.q_proj.lora_A.weight"].shape == (16, base["hidden_size"])
    assert tensors[f"{layer}.self_attn.q_proj.lora_B.weight"].shape == (base["num_attention_heads"] * head_dim, 16)
    assert tensors[f"{layer}.self_attn.v_proj.lora_B.weight"].shape == (base["num_key_value_heads"] * head_dim, 16)
    assert tensors[f"{layer}.mlp.down_proj.lora_A.weight"].shape == (16, base["intermediate_size"])
    again = write_adapter(tmp_path / "b", base, rank=16, target_modules=("q_proj", "v_proj", "down_proj"))
    assert (again.path / "adapter_model.safetensors").read_bytes() == (adapter.path / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 0}, "LoRA rank must be a positive integer"),
    ({"rank": 8, "target_modules": ("lm_head",)}, "LoRA target modules must be some of"),
])
def test_a_bad_rank_or_module_is_refused(tmp_path, kwargs, message):
    with pytest.raises(LlmvisorError, match=message):
        write_adapter(tmp_path / "a", {"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
                                       "num_hidden_layers": 1}, **kwargs)
