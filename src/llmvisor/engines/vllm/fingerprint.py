"""The `EngineFingerprint` of a running vLLM engine, read from its ``VllmConfig`` (in the scheduler's process)."""

from __future__ import annotations

import os

import vllm

from llmvisor.core.fingerprint import EngineFingerprint, model_config_hash


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


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
    if is_cpu:
        threads = len(cores) if backend == "mp" else torch.get_num_threads()
        device = "cpu"
        hardware_name = hardware or cpu_model_name()
    else:
        threads = 0
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else str(current_platform.device_name)
        hardware_name = hardware or device
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
        core_ids=cores,
        executor_backend=backend,
    )
