"""Run vLLM in this process and drive it through a profiling plan, recording every step.

The engine core and the worker run in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="uni"``), with async scheduling off so steps do not overlap, and prefix caching
as the settings say (on by default, as in vLLM: sweep episodes with shared prompt prefixes need it). The driver steps
the engine itself (``LLMEngine.add_request`` / ``step``) and steers the scheduler between steps through
`ProfilingScheduler`: a per-step token budget and the number of decoding requests that run. Prompts are
random token ids, so a folder with only a ``config.json`` runs with dummy weights and no tokenizer.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import time
from collections.abc import Callable

import numpy as np

from llmvisor.engines.settings import EngineSettings
from llmvisor.errors import LlmvisorError
from llmvisor.profile.adapters import Adapter, adapter_name
from llmvisor.profile.plans import BASE_MODEL, Envelope, Episode, WorkloadPlan

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
BASE_ONLY_DECODE_SHARE = 1 / 3
"""With LoRA: the share of the steps whose running requests all decode, on the base model and on adapters, that run
the base-model ones alone (`ProfilingScheduler`'s ``base_only``); a third keeps most steps as the plan drew them."""


def check_model_dir(model: str) -> bool:
    """Validate a model folder; True when it holds weights, False when it is a bare config (dummy weights)."""
    if not os.path.isdir(model):
        raise LlmvisorError(f"{model}: model folder does not exist")
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise LlmvisorError(f"{config_path}: no config.json in the model folder")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise LlmvisorError(f"{config_path}: not a readable JSON model config ({error})") from None
    if not isinstance(config, dict) or "architectures" not in config:
        raise LlmvisorError(f"{config_path}: architectures: missing; not a Hugging Face model config")
    return any(glob.glob(os.path.join(model, pattern)) for pattern in WEIGHT_PATTERNS)


def configure_environment(settings: EngineSettings) -> None:
    """Environment vLLM reads at start-up; must run before vLLM (and torch) is imported to take full effect."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
    if settings.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(settings.threads)


def freeze_startup_objects() -> None:
    """Move everything alive now out of the garbage collector's reach.

    A full collection scans every object vLLM and torch created at start-up: measured at up to 0.7 s, inside
    engine steps, in an in-process driver. vLLM's own engine-core process does the same after start-up."""
    gc.collect()
    gc.freeze()


class ProfiledEngine:
    """An in-process vLLM engine with the profiling scheduler, recording to ``trace_path``."""

    def __init__(self, settings: EngineSettings, *, trace_path: str, run_id: str, warmup_steps: int, enable_prefix_caching: bool | None = None,
                 adapters: list[Adapter] = ()):
        """``adapters``: the LoRA plan's adapters (an engine with ``max_loras`` > 0), named by `adapter_name`."""
        has_weights = check_model_dir(settings.model)
        configure_environment(settings)
        os.environ["LLMVISOR_TRACE_PATH"] = trace_path
        os.environ["LLMVISOR_RUN_ID"] = run_id
        os.environ["LLMVISOR_UNIQUE_RUN_ID"] = "0"  # the profile command makes its run ids itself
        os.environ["LLMVISOR_WARMUP_STEPS"] = str(warmup_steps)
        os.environ.setdefault("LLMVISOR_MODEL_NAME", os.path.basename(os.path.normpath(settings.model)))

        import torch

        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        from vllm import LLM

        from llmvisor.engines.vllm.profiling import ProfilingScheduler

        self.settings = settings
        self.has_weights = has_weights
        self.llm = LLM(**settings.llm_kwargs(has_weights=has_weights, enable_prefix_caching=enable_prefix_caching, scheduler_cls=ProfilingScheduler))
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        vllm_config = self.engine.vllm_config
        cache = vllm_config.cache_config
        self.kv_cache_tokens = int(cache.num_gpu_blocks * cache.block_size)
        self.block_size = int(cache.block_size)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.torch_threads = torch.get_num_threads()
        self._rng = np.random.default_rng(settings.seed)
        self._live: set[str] = set()
        from vllm.lora.request import LoRARequest

        self.lora_requests = [LoRARequest(adapter_name(k, a.rank), k + 1, str(a.path)) for k, a in enumerate(adapters)]
        freeze_startup_objects()

    @property
    def envelope(self) -> Envelope:
        return Envelope(
            max_model_len=self.settings.max_model_len,
            max_num_batched_tokens=self.settings.max_num_batched_tokens,
            max_num_seqs=self.settings.max_num_seqs,
            kv_cache_tokens=self.kv_cache_tokens,
            block_size=self.block_size,
        )

    def describe(self) -> dict:
        import vllm

        return {
            "engine": "vllm",
            "engine_version": vllm.__version__,
            **self.settings.as_dict(),
            "model": os.path.basename(os.path.normpath(self.settings.model)),
            "weights": "from the model folder" if self.has_weights else "dummy (random), load_format='dummy'",
            "dtype": self.dtype,
            "kv_cache_tokens": self.kv_cache_tokens,
            "block_size": self.block_size,
            "enable_prefix_caching": bool(self.engine.vllm_config.cache_config.enable_prefix_caching),
            "async_scheduling": bool(self.engine.vllm_config.scheduler_config.async_scheduling),
            "distributed_executor_backend": self.settings.executor,
            "torch_threads": self.torch_threads,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "hardware": self.scheduler._constant_columns["hardware"],
        }

    # -----------------------------------------------------------------------------------------------------

    def random_tokens(self, length: int) -> list[int]:
        return self._rng.integers(100, max(101, self.vocab_size - 1), length).tolist()

    def add(self, request_id: str, prompt_len: int, max_tokens: int, tenant: str, prefix: list[int] = (), adapter: int = BASE_MODEL) -> None:
        """Submit a request of ``prompt_len`` tokens: ``prefix``, then random tokens; run with LoRA adapter number
        ``adapter`` of the engine's, or the base model."""
        from vllm import SamplingParams

        prompt = list(prefix[:prompt_len]) + self.random_tokens(prompt_len - min(len(prefix), prompt_len))
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args={"tenant": tenant}
        )
        lora_request = None if adapter == BASE_MODEL else self.lora_requests[adapter]
        if lora_request is not None:
            params.extra_args["tenant"] = lora_request.lora_name  # each adapter is its own tenant's
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora_request)
        self._live.add(request_id)

    def step(self) -> list[str]:
        """Run one engine step; the ids of requests that finished in it."""
        finished = [output.request_id for output in self.engine.step() if output.finished]
        self._live.difference_update(finished)
        return finished

    def abort_all(self) -> None:
        if self._live:
            self.engine.abort_request(sorted(self._live))
            self._live.clear()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def _prefilling(self) -> bool:
        return len(self.scheduler.waiting) > 0 or self._prefill_chunks()

    def _decoding_by_adapter(self) -> tuple[int, int]:
        """Running decoding requests on the base model, and on an adapter."""
        decoding = [r for r in self.scheduler.running if not r.is_prefill_chunk]
        base = sum(1 for r in decoding if r.lora_request is None)
        return base, len(decoding) - base

    def _prefill_chunks(self) -> bool:
        return any(r.is_prefill_chunk for r in self.scheduler.running)

    # -----------------------------------------------------------------------------------------------------

    def run_episode(self, episode: Episode, repeat_index: int) -> None:
        """One sweep episode (`llmvisor.profile.plans`); identical steps on every repeat.

        While prompts are being prefilled, each step runs a random number of the decoding requests, at most
        half the token budget, so prefill keeps progressing and steps range from pure prefill to mixed.
        """
        scheduler = self.scheduler
        rng = np.random.default_rng(episode.seed)
        scheduler.set_controls(token_budget=episode.token_budget, decode_batch_size=None, seed=episode.seed)
        max_len = self.settings.max_model_len
        prefix = f"sweep-e{episode.index:04d}-r{repeat_index}"
        shared = np.random.default_rng([episode.seed, 1, repeat_index]).integers(100, max(101, self.vocab_size - 1), episode.shared_prefix_len).tolist()
        adapters = episode.lora_adapters or (BASE_MODEL,) * (len(episode.prompt_lens) + len(episode.wave_prompt_lens))
        for k, prompt_len in enumerate(episode.prompt_lens):
            self.add(f"{prefix}-{k:03d}", prompt_len, max_len - prompt_len, "sweep", shared, adapters[k])
        max_steps = 4 * (episode.num_prompt_tokens // max(1, episode.token_budget) + len(episode.prompt_lens)) + 64
        self._prefill_phase(rng, episode.token_budget, max_steps)
        wave_at = episode.num_decode_steps // 2
        for step in range(episode.num_decode_steps):
            if step == wave_at:
                for k, prompt_len in enumerate(episode.wave_prompt_lens):
                    self.add(f"{prefix}-w{k:03d}", prompt_len, max_len - prompt_len, "sweep", shared, adapters[len(episode.prompt_lens) + k])
            self._step_with_decode_subset(rng, episode.token_budget)
            if not self.num_live:
                break
        self._prefill_phase(rng, episode.token_budget, max_steps)
        self.abort_all()
        scheduler.set_controls(token_budget=None, decode_batch_size=None)

    def _prefill_phase(self, rng: np.random.Generator, token_budget: int, max_steps: int) -> None:
        for _ in range(max_steps):
            if not (self._prefilling() and self.num_live):
                return
            self._step_with_decode_subset(rng, token_budget)

    def _step_with_decode_subset(self, rng: np.random.Generator, token_budget: int) -> None:
        """With LoRA, a step whose running requests all decode, some of them on an adapter and some on the base model,
        is a base-model decode step (`BASE_ONLY_DECODE_SHARE` of them: `ProfilingScheduler`'s ``base_only``) of 1 up to
        all the base-model ones; the draw is made only then, so a plan without adapters runs as before."""
        base, on_adapter = self._decoding_by_adapter()
        if base and on_adapter and not self._prefill_chunks() and rng.random() < BASE_ONLY_DECODE_SHARE:
            self.scheduler.set_controls(decode_batch_size=int(rng.integers(1, base + 1)), base_only=True)
            self.step()
            return
        decoding = base + on_adapter
        if self._prefilling():
            size = int(rng.integers(0, min(decoding, token_budget // 2) + 1))
        else:
            size = int(rng.integers(1, decoding + 1)) if decoding else None
        self.scheduler.set_controls(decode_batch_size=size)
        self.step()

    def run_workload(
        self,
        plan: WorkloadPlan,
        *,
        arrival: str,
        concurrency: int,
        repeat_index: int,
        deadline_s: float | None,
        on_finished: Callable[[int], None],
    ) -> dict:
        """Replay the plan's requests; returns counts of submitted, finished and aborted requests."""
        self.scheduler.set_controls(token_budget=None, decode_batch_size=None)
        pending = list(plan.requests)
        position = 0
        submitted = finished = 0
        started = time.perf_counter()
        timed_out = False
        while position < len(pending) or self.num_live:
            now = time.perf_counter() - started
            if deadline_s is not None and now > deadline_s:
                timed_out = True
                break
            if arrival == "closed":
                while position < len(pending) and self.num_live < concurrency:
                    self._submit(pending[position], repeat_index)
                    position += 1
                    submitted += 1
            else:
                while position < len(pending) and pending[position].arrival_s <= now:
                    self._submit(pending[position], repeat_index)
                    position += 1
                    submitted += 1
                if not self.num_live:
                    wait = pending[position].arrival_s - now
                    time.sleep(min(max(wait, 0.0), 0.5))
                    continue
            done = len(self.step())
            finished += done
            if done:
                on_finished(done)
        aborted = self.num_live
        self.abort_all()
        return {"submitted": submitted, "finished": finished, "aborted": aborted, "timed_out": timed_out}

    def _submit(self, request, repeat_index: int) -> None:
        suffix = f"-r{repeat_index}" if repeat_index else ""
        prefix = self._document(request.document, request.document_tokens, repeat_index) if request.document is not None else ()
        self.add(request.request_id + suffix, request.prompt_len, request.output_len, request.tenant, prefix)

    def _document(self, document: int, num_tokens: int, repeat_index: int) -> list[int]:
        """A shared document's tokens: the same for every request on it within a repeat, new in each repeat
        (so a repeat does not start from the previous one's cached blocks)."""
        tokens = np.random.default_rng([self.settings.seed, 2, repeat_index, document]).integers(100, max(101, self.vocab_size - 1), num_tokens)
        return tokens.tolist()

    # -----------------------------------------------------------------------------------------------------

    def finish_recording(self) -> dict:
        """Write the steps not yet written; the recorder's overhead figures."""
        self.scheduler.flush_trace()
        overhead = self.scheduler.recorder_overhead().as_dict()
        fractions = np.asarray(self.scheduler.overhead_s_per_step) / np.maximum(np.asarray(self.scheduler.latency_s_per_step), 1e-12)
        if fractions.size:
            overhead["step_fraction_p50"] = float(np.percentile(fractions, 50))
            overhead["step_fraction_p99"] = float(np.percentile(fractions, 99))
        return overhead

    def close(self) -> None:
        engine_core = self.engine.engine_core
        try:
            engine_core.shutdown()
        except Exception:  # noqa: BLE001 - shutting down a half-started engine must not hide the real error
            pass
