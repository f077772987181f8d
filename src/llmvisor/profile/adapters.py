"""LoRA adapters made locally, for profiling and tests: a folder vLLM loads as an adapter, with random weights.

``write_adapter(folder, base_config, rank=16)`` writes what vLLM's loader reads (`vllm/lora/peft_helper.py`,
`vllm/lora/lora_model.py`, vLLM 0.32):

- ``adapter_config.json``: PEFT's LoRA fields vLLM requires (``r``, ``lora_alpha``, ``target_modules``) and the ones
  it checks (``bias`` "none", no DoRA, no ``modules_to_save``, ``init_lora_weights`` true); ``peft_type`` and
  ``task_type`` as PEFT writes them;
- ``adapter_model.safetensors``: per layer and target module, ``base_model.model.model.layers.{i}.{self_attn|mlp}.
  {module}.lora_A.weight`` of shape (r, in_features) and ``...lora_B.weight`` of shape (out_features, r), float32,
  written with the ``safetensors`` package (no torch, no peft, no download).

The shapes follow the base model's Hugging Face config (a Llama-style decoder: ``hidden_size``,
``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``num_hidden_layers``), so
the same call makes adapters for the tests' tiny Llama and for the shipped engine model
(``src/llmvisor/data/engine-model/config.json``). vLLM pads every adapter to ``--max-lora-rank`` in its slots, so
``rank`` must be at most the engine's ``max_lora_rank`` (vLLM refuses a larger one when it loads the adapter).

It lives under ``profile`` (a LoRA plan for ``llmvisor profile`` is to use it) and needs no vLLM: only numpy and
``safetensors`` (installed with the ``[vllm]`` extra, through transformers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmvisor.errors import LlmvisorError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGET_MODULES = ATTENTION_MODULES
"""What the common adapters of hosted fine-tuning target; every module of `ATTENTION_MODULES` and `MLP_MODULES`
can be asked for."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """An adapter written by `write_adapter`: its folder (vLLM's ``lora_path``), rank and target modules."""

    path: Path
    rank: int
    target_modules: tuple[str, ...]


def adapter_name(index: int, rank: int) -> str:
    """The name (vLLM's ``lora_name``) of a plan's adapter number ``index`` of rank ``rank``."""
    return f"lora-{index}-r{rank}"


def write_adapters(folder: str | Path, base_config: dict | str | Path, ranks: Sequence[int], *,
                   target_modules: Sequence[str] = DEFAULT_TARGET_MODULES, seed: int = 0) -> list[Adapter]:
    """One adapter per rank in ``ranks``, adapter k in ``folder``/`adapter_name` (k, rank), weights from seed
    (``seed``, k)."""
    return [write_adapter(Path(folder) / adapter_name(k, rank), base_config, rank=rank, target_modules=target_modules,
                          seed=seed * 1000 + k)
            for k, rank in enumerate(ranks)]


def module_shapes(base_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able projection of a Llama-style decoder layer."""
    try:
        hidden = int(base_config["hidden_size"])
        heads = int(base_config["num_attention_heads"])
        intermediate = int(base_config["intermediate_size"])
    except KeyError as error:
        raise LlmvisorError(f"base model config: missing {error.args[0]} (a Llama-style config is needed)") from None
    kv_heads = int(base_config.get("num_key_value_heads") or heads)
    head_dim = int(base_config.get("head_dim") or hidden // heads)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def write_adapter(folder: str | Path, base_config: dict | str | Path, *, rank: int,
                  target_modules: Sequence[str] = DEFAULT_TARGET_MODULES, alpha: int | None = None, seed: int = 0,
                  scale: float = 0.01) -> Adapter:
    """Write a LoRA adapter for ``base_config`` (a config dict, or the path of a config.json or of the model folder
    holding it) into ``folder`` (created; files in it are replaced): random weights, normal with standard deviation
    ``scale``, from ``seed``. ``alpha`` defaults to ``rank`` (scaling 1)."""
    if isinstance(base_config, (str, Path)):
        config_path = Path(base_config)
        if config_path.is_dir():
            config_path = config_path / "config.json"
        base_config = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LlmvisorError(f"LoRA rank must be a positive integer (got {rank!r})")
    shapes = module_shapes(base_config)
    targets = tuple(dict.fromkeys(target_modules))
    unknown = [name for name in targets if name not in shapes]
    if unknown or not targets:
        raise LlmvisorError(f"LoRA target modules must be some of {', '.join(shapes)} (got {', '.join(unknown) or 'none'})")
    from safetensors.numpy import save_file

    layers = int(base_config.get("num_hidden_layers", 0))
    if layers <= 0:
        raise LlmvisorError("base model config: num_hidden_layers must be >= 1")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for name in targets:
            block = "self_attn" if name in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            in_features, out_features = shapes[name]
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, in_features)) * scale).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) * scale).astype(np.float32)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "base_model_name_or_path": str(base_config.get("_name_or_path", "")),
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return Adapter(path=folder, rank=rank, target_modules=targets)
