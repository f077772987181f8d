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


SUITE_ENGINE_CONFIG = {
    **BASE_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}
"""What the suite serves where a command or doc would serve the shipped engine model (an 8-layer, 1024-wide bf16
Llama): its shape's vocabulary and context length, 2 layers of a quarter the width. Its config says float32, but vLLM
casts a float32 config to the platform's preferred dtype unless ``--dtype float32`` is given (bfloat16 on x86 CPUs:
``vllm.config.model._resolve_auto_dtype``), so it runs in bf16 like the shipped model, as its fingerprint records. On
a CPU without AVX-512 torch emulates bf16 matrix products (a 512x1024 @ 1024x2816 product measured 5.8 s in bf16
against 0.07 s in float32) and the shipped shape's journeys took over half an hour each there; this shape does far less
work per step (a quarter of the layers, a quarter of the width). Nothing the tests check depends on the engine's size."""


SUITE_VLLM_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""vLLM settings of every engine the suite starts (tests/conftest.py puts them in the session's environment; a doc's
bare environment adds them). vLLM 0.32's CPU build saves its ahead-of-time compiled model but fails to load it again
("'function' object has no attribute 'finalize_loading'"), so with AOT compilation, its default, each compiled start
compiles afresh (warm-up 22 s); without it the same graph is traced and the warm-up takes 4-6 s. The documented server
on the suite's engine, a fresh model folder each time, was ready in 48 s and 52 s with it, 34 s and 32 s without; with
it and without, tests/test_controlled_sampled.py took 37 s and 26 s, tests/test_validation_warm.py 56 s and 22 s (the
machine shared). Engines started with enforce-eager compile nothing either way."""


IN_PROCESS_ENGINE_THREADS = 1
"""Worker threads of the in-process engines the suite starts to check what runs, not how long it takes (the controlled
engine's tests; `tiny_engine_args`' tests set ``OMP_NUM_THREADS=1`` themselves). With two pytest workers on two cores,
a 2-thread engine's every parallel region waits for a thread the other worker's processes keep off a core:
test_controlled_steps_on_vllm_run_exactly_the_intended_batches took 8 s in one full run and 73 s in the next."""


def write_suite_engine(folder: Path) -> Path:
    """Create ``folder`` holding the `SUITE_ENGINE_CONFIG` config.json (a model for vLLM with dummy weights)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SUITE_ENGINE_CONFIG))
    return folder


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
