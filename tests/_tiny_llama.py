"""The tiny Llama config the real-engine tests run with dummy weights (a bare config.json is a model).

The tests differ in a few fields (vocabulary, KV heads, context length), each passed by the test that needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_tiny_llama(folder: Path, **fields) -> Path:
    """Create ``folder`` holding a config.json of `BASE_CONFIG` with ``fields`` added."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**BASE_CONFIG, **fields}))
    return folder


def tiny_engine_args(model: str | Path, scheduler_cls: type) -> dict:
    """`vllm.LLM` arguments of the recorder tests: in process, synchronous, small batches."""
    return dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        distributed_executor_backend="uni",
        async_scheduling=False,
        enable_prefix_caching=False,
        enforce_eager=True,
        scheduler_cls=scheduler_cls,
    )


def lift_cpu_async_override(monkeypatch) -> None:
    """Undo the CPU platform's ``scheduler_config.async_scheduling = False`` (vllm/platforms/cpu.py)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config):
        requested = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = requested

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async_scheduling))
