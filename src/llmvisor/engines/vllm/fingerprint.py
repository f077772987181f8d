"""The `EngineFingerprint` of a running vLLM engine, read from its ``VllmConfig`` (in the scheduler's process),
with what decides the step cost on this silicon: the CPU's ISA flags (``/proc/cpuinfo``), torch's CPU
capability and the GEMM backend vLLM's CPU build picks, or the GPUs' name, count and compute capability."""

from __future__ import annotations

import os

import vllm

from llmvisor.core.fingerprint import EngineFingerprint, model_config_hash, read_cpuinfo

GEMM_PROBE_SHAPE = (64, 64)
"""A [K, N] weight small enough to cost nothing: only whether oneDNN can build a matmul for the dtype matters."""


def cpu_model_name() -> str:
    return read_cpuinfo().model_name


def cpu_capability() -> str:
    """torch's CPU dispatch level (``AVX512``, ``AVX2``, ``DEFAULT``, ...); "" where torch cannot say."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return ""


def gemm_backend(dtype) -> str:
    """What vLLM's CPU build runs a dense (unquantized) projection with, decided as
    ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` decides it: ``zentorch`` on the Zen
    platform with its op, else ``onednn`` when vLLM's kernels provide it and oneDNN can build a matmul for
    ``dtype`` on this CPU (it cannot for bfloat16 without AVX-512, and vLLM then falls back), else ``torch``
    (``torch.nn.functional.linear``). Small weights (MoE routers) take the AMX kernel where ``amx_tile`` is
    flagged; that is in ``cpu_flags``."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.is_zen_cpu() and hasattr(getattr(torch.ops, "zentorch", None), "zentorch_linear_unary"):
        return "zentorch"
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return "torch"
    if not getattr(ops, "_supports_onednn", False) or current_platform.get_cpu_architecture() == CpuArchEnum.POWERPC:
        return "torch"
    try:
        ops.create_onednn_mm(torch.zeros(GEMM_PROBE_SHAPE, dtype=dtype), 1)
    except RuntimeError:
        return "torch"
    return "onednn"


def worker_cores(vllm_config) -> tuple[int, ...]:
    """The cores vLLM binds the (first) model worker's threads to, or this process's cores when it binds none.

    vLLM's CPU build with a worker process (the OpenAI server's ``mp`` executor) binds each worker to cores of
    its own (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``, which also reserves a core for the engine core);
    `OMPProcessManager` computes the same lists from the same config, so they are taken from it here."""
    from vllm.platforms import current_platform

    own = tuple(sorted(os.sched_getaffinity(0)))
    backend = str(vllm_config.parallel_config.distributed_executor_backend)
    if not current_platform.is_cpu() or backend != "mp":
        return own
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(vllm_config)
    except Exception:  # an unsupported CPU or binding string: vLLM itself reports it
        return own
    if getattr(manager, "skip_setup", True) or not manager.cpu_lists:
        return own
    return tuple(manager.cpu_lists[0])


def engine_fingerprint(vllm_config, *, model_name: str | None = None, hardware: str | None = None) -> EngineFingerprint:
    import torch
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    scheduler_config = vllm_config.scheduler_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    model = model_config.model
    is_cpu = current_platform.is_cpu()
    cores = worker_cores(vllm_config) if is_cpu else ()
    backend = str(parallel_config.distributed_executor_backend)
    silicon: dict = {}
    if is_cpu:
        threads = len(cores) if backend == "mp" else torch.get_num_threads()
        device = "cpu"
        cpu = read_cpuinfo()
        hardware_name = hardware or cpu.model_name
        silicon = {"cpu_flags": cpu.flags, "cpu_capability": cpu_capability(), "gemm_backend": gemm_backend(model_config.dtype)}
    else:
        threads = 0
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else str(current_platform.device_name)
        hardware_name = hardware or device
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            silicon = {"device_count": int(torch.cuda.device_count()), "compute_capability": f"{major}.{minor}"}
    lora_config = getattr(vllm_config, "lora_config", None)
    lora = {} if lora_config is None else {
        "enable_lora": True, "max_loras": int(lora_config.max_loras), "max_lora_rank": int(lora_config.max_lora_rank),
        "max_cpu_loras": int(lora_config.max_cpu_loras or lora_config.max_loras),
    }
    return EngineFingerprint(
        engine="vllm",
        engine_version=vllm.__version__,
        model=model_name or (os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model),
        model_config_hash=model_config_hash(model_config.hf_config.to_dict()),
        dtype=str(model_config.dtype).removeprefix("torch."),
        device=device,
        hardware=hardware_name,
        threads=int(threads),
        max_num_batched_tokens=int(scheduler_config.max_num_batched_tokens),
        max_num_seqs=int(scheduler_config.max_num_seqs),
        max_model_len=int(model_config.max_model_len),
        block_size=int(cache_config.block_size),
        async_scheduling=bool(scheduler_config.async_scheduling),
        enable_prefix_caching=bool(cache_config.enable_prefix_caching),
        enable_chunked_prefill=bool(scheduler_config.enable_chunked_prefill),
        enforce_eager=bool(model_config.enforce_eager),
        tensor_parallel_size=int(parallel_config.tensor_parallel_size),
        pipeline_parallel_size=int(parallel_config.pipeline_parallel_size),
        **silicon,
        **lora,
        core_ids=cores,
        executor_backend=backend,
    )
