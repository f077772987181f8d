"""Typer options of the engine settings, built from their one definition (`llmvisor.engines.settings`).

Every command that starts an engine declares its engine options with these types and defaults, and turns
them into `EngineSettings` with `engine_settings`. Importing this module does not import vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmvisor import shipped
from llmvisor.engines.settings import DTYPES, LORA_MAX_RANKS, EngineSettings, default, setting_field
from llmvisor.errors import LlmvisorError

ENGINE_PANEL = "Engine settings"


def engine_option(name: str, **more) -> typer.models.OptionInfo:
    """The typer option of one `EngineSettings` field: its option name, help text and least value."""
    metadata = setting_field(name).metadata
    return typer.Option(metadata["option"], help=metadata["help"], min=metadata["min"], rich_help_panel=ENGINE_PANEL, **more)


EngineModel = Annotated[Path | None, engine_option("model", file_okay=False, metavar="DIR")]
MaxModelLen = Annotated[int, engine_option("max_model_len")]
MaxNumBatchedTokens = Annotated[int, engine_option("max_num_batched_tokens")]
MaxNumSeqs = Annotated[int, engine_option("max_num_seqs")]
KvCacheGib = Annotated[int, engine_option("kv_cache_space_gib")]
EnforceEager = Annotated[bool, engine_option("enforce_eager")]
Threads = Annotated[int | None, engine_option("threads")]
Executor = Annotated[str, engine_option("executor")]
MaxLoras = Annotated[int, engine_option("max_loras")]
MaxLoraRank = Annotated[int, engine_option("max_lora_rank")]
Dtype = Annotated[str, engine_option("dtype", metavar="|".join(DTYPES))]

MAX_MODEL_LEN = default("max_model_len")
MAX_NUM_BATCHED_TOKENS = default("max_num_batched_tokens")
MAX_NUM_SEQS = default("max_num_seqs")
KV_CACHE_GIB = default("kv_cache_space_gib")
ENFORCE_EAGER = default("enforce_eager")
THREADS = default("threads")
EXECUTOR = default("executor")
MAX_LORAS = default("max_loras")
MAX_LORA_RANK = default("max_lora_rank")
DTYPE = default("dtype")
EXECUTORS = ("uni", "mp")

LatencyModel = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "-m",
        help="Latency model: the fitted step-latency model file (JSON from `llmvisor fit`). Default: the shipped "
        "latency model.",
        dir_okay=False,
        metavar="FILE",
    ),
]
"""``--model`` is the latency model in every command (the engine model is ``--engine-model``); the older
``--latency-model`` still works, with a warning (`llmvisor.cli.params.RENAMED_OPTIONS`)."""


def engine_settings(
    engine_model: Path | None,
    *,
    max_model_len: int = MAX_MODEL_LEN,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = MAX_NUM_SEQS,
    kv_cache_gib: int = KV_CACHE_GIB,
    enforce_eager: bool = ENFORCE_EAGER,
    threads: int | None = THREADS,
    seed: int = 0,
    executor: str = EXECUTOR,
    max_loras: int = MAX_LORAS,
    max_lora_rank: int = MAX_LORA_RANK,
    dtype: str = DTYPE,
) -> EngineSettings:
    """The command's engine options as `EngineSettings`; no engine model means the shipped one."""
    if executor not in EXECUTORS:
        raise LlmvisorError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    check_dtype(dtype)
    if max_lora_rank not in LORA_MAX_RANKS:
        raise LlmvisorError(f"--max-lora-rank: vLLM takes one of {', '.join(map(str, LORA_MAX_RANKS))}, got {max_lora_rank}")
    return EngineSettings(
        model=str(engine_model if engine_model is not None else shipped.engine_model_dir()),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_space_gib=kv_cache_gib,
        enforce_eager=enforce_eager,
        seed=seed,
        threads=threads,
        executor=executor,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        dtype=dtype,
    )


def check_dtype(dtype: str) -> str:
    """``dtype`` when vLLM takes it, else a one-line error naming the values it takes."""
    if dtype not in DTYPES:
        raise LlmvisorError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype
