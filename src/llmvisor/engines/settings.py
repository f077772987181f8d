"""Engine settings, each defined once with its command-line option and help text; imports no engine.

The commands that start an engine (`llmvisor profile`, `validate`, `experiment fairness`) build their options
from these fields (``llmvisor.cli.engine_options``), so a setting has one name, one default and one meaning.
Words: the *engine model* is the Hugging Face weights folder the engine runs; the *latency model* is the fitted
`StepLatencyModel` file that predicts and attributes step time. Fields marked ``cpu_only`` are settings of
vLLM's CPU build and do nothing on other builds.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, asdict, dataclass, field, fields

LORA_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks``)."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The ``--dtype`` values llmvisor passes on to vLLM (``auto``: vLLM's default)."""


def dtype_kwargs(dtype: str) -> dict:
    """vLLM's ``dtype`` argument for ``dtype``: none for ``auto`` (vLLM's default), so an engine that asks for no dtype
    starts with exactly the arguments it had before dtype was a setting."""
    return {} if dtype == "auto" else {"dtype": dtype}


def setting(default, *, option: str, help: str, cpu_only: bool = False, min: int | None = None):
    """A field of `EngineSettings` with the option name, help text and (for counts) least value the commands show."""
    if cpu_only:
        help = f"vLLM CPU build only: {help}"
    return field(default=default, metadata={"option": option, "help": help, "cpu_only": cpu_only, "min": min})


@dataclass
class EngineSettings:
    model: str = setting(
        "",
        option="--engine-model",
        help="Engine model: the Hugging Face model folder vLLM runs (a folder with only config.json runs with dummy "
        "weights). Default: the shipped engine model.",
    )
    max_model_len: int = setting(4096, option="--max-model-len", help="Longest prompt + output, in tokens.", min=1)
    max_num_batched_tokens: int = setting(2048, option="--max-num-batched-tokens", help="Most tokens in one engine step.", min=1)
    max_num_seqs: int = setting(32, option="--max-num-seqs", help="Most requests in one engine step.", min=1)
    kv_cache_space_gib: int = setting(
        4, option="--kv-cache-gib", help="KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE).", cpu_only=True, min=1
    )
    enforce_eager: bool = setting(
        False, option="--enforce-eager/--no-enforce-eager", help="Skip torch.compile: faster start, slower steps."
    )
    dtype: str = setting(
        "auto",
        option="--dtype",
        help="The engine's dtype (vLLM's --dtype): auto (vLLM's default: the model config's, a float32 config cast to "
        "bfloat16 on CPU), bfloat16, float16 or float32. It is part of the engine fingerprint: profile and validate "
        "with the dtype the served engine runs (on a CPU without AVX-512, vLLM's bfloat16 falls back to slow torch "
        "kernels, and float32 is served there).",
    )
    enable_prefix_caching: bool = setting(
        True,
        option="--prefix-caching/--no-prefix-caching",
        help="Share KV blocks of common prompt prefixes (vLLM's default: on). Off only where a run must control "
        "every request's context exactly.",
    )
    max_loras: int = setting(
        0,
        option="--max-loras",
        help="LoRA adapter slots of one step (vLLM's --max-loras, with --enable-lora; adapters kept in CPU memory: as many, "
        "vLLM's default max_cpu_loras). 0: LoRA off, as vLLM ships.",
        min=0,
    )
    max_lora_rank: int = setting(
        16,
        option="--max-lora-rank",
        help="Largest adapter rank (vLLM's --max-lora-rank, one of 1, 8, 16, 32, 64, 128, 256, 320, 512; every adapter is "
        "padded to it in the slots). Only with --max-loras > 0.",
        min=1,
    )
    seed: int = setting(0, option="--seed", help="Seed of the engine's sampling.", min=0)
    executor: str = setting(
        "uni",
        option="--executor",
        help="vLLM's executor: uni (the model runs in this process) or mp (in a worker process, as vLLM's OpenAI "
        "server runs it; the CPU build binds that worker to cores by VLLM_CPU_OMP_THREADS_BIND, so --threads "
        "does not reach it).",
    )
    threads: int | None = setting(
        None,
        option="--threads",
        help="OpenMP/torch threads of the engine (sets OMP_NUM_THREADS and torch.set_num_threads before vLLM "
        "starts); runs that are compared should use the same count. Default: as the environment says.",
        cpu_only=True,
        min=1,
    )

    def as_dict(self) -> dict:
        return asdict(self)

    def llm_kwargs(self, *, has_weights: bool, scheduler_cls: type, enable_prefix_caching: bool | None = None) -> dict:
        """Arguments of `vllm.LLM` for an in-process, synchronous engine (the scheduler and the recorder
        must run in this process, between steps; with the ``mp`` executor only the model runs in a worker
        process) with these settings; ``enable_prefix_caching`` overrides the setting. LoRA arguments only with
        ``max_loras`` > 0, and ``dtype`` only when not ``auto``, so an engine that asks for neither gets exactly the
        arguments it got before they were settings."""
        lora = {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank} if self.max_loras > 0 else {}
        return {
            **lora,
            **dtype_kwargs(self.dtype),
            "model": self.model,
            "load_format": "auto" if has_weights else "dummy",
            "skip_tokenizer_init": True,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "distributed_executor_backend": self.executor,
            "async_scheduling": False,
            "enable_prefix_caching": self.enable_prefix_caching if enable_prefix_caching is None else enable_prefix_caching,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "scheduler_cls": scheduler_cls,
        }


def setting_field(name: str) -> Field:
    """The dataclass field of one engine setting (its default and its ``option``/``help`` metadata)."""
    for item in fields(EngineSettings):
        if item.name == name:
            return item
    raise KeyError(name)


def default(name: str):
    value = setting_field(name).default
    return None if value is MISSING else value
