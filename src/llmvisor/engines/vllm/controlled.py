"""Controlled steps on a real vLLM engine: make a chosen batch run as exactly one engine step, and time it.

The validation needs the measured time T(S) of every subset S of a batch; this engine satisfies its
`llmvisor.validation.measurement.Measurer` protocol. This module makes each such step happen on vLLM,
in-process, and times it the way the step recorder does (`RecordingScheduler`: from ``schedule()``
returning to ``update_from_output()`` being entered), because it *is* the recorder: `ControlledScheduler`
subclasses it and only adds a filter on which running requests may be scheduled.

- Prefill steps: fresh prompts of the chosen lengths (fresh random token ids, so no cache hit: context 0)
  are submitted together with ``max_tokens=1`` and a token budget that fits them all; one engine step runs
  them all and finishes them.
- Decode steps: the batch's requests are first prefilled (once) to their chosen contexts, only the requests
  still in prefill being allowed to run, so none decodes early. Then any subset runs as a decode step of
  its own by allowing only its requests. A held decode batch stays held through prefill steps (e.g. the
  interference guard's canary, `canary_step`).
- Warm measuring (``warm=True``, the default): after each decode step every member is rewound to its prepared
  context (`_rewind`: the step's sampled token dropped and ``num_computed_tokens`` set back, which the model
  runner follows on the member's next step as it does when output tokens are discarded), so every step of a
  batch reads exactly the planned contexts however many steps run, and the batch is prepared once for all its
  batch-rounds. Own contexts are prefixes of per-session token sequences, one per length rank (the k-th longest own
  context of every batch is a prefix of sequence k, `_ranked_prompts`), and so is each prefix group's longest reader
  (a sequence per group rank; its group's shared prefix is that sequence's start), so preparing a batch finds what
  earlier batches computed in the prefix cache and computes only the rest: a session prefills about the longest
  contexts once, not every batch's. ``warm=False`` is the earlier method (each run grows a member's context by one
  token; fresh prompts; the measuring loop prepares the batch again for every batch-round), kept to measure what warm
  gains.
- Mixed steps (`prepare_mixed`, `mixed_step`): a prefill chunk over cached context co-batched with held
  decodes, the step chunked prefill makes. Each run of the chunk is a fresh request whose prompt starts with
  the batch's cached part: its first ``cached_tokens`` are computed in preparation steps of its own (the
  step's token budget capped so that exactly that much is computed, counting what the prefix cache already
  holds: after the first run, the part's whole blocks), then the controlled step runs its next
  ``chunk_tokens`` together with the chosen decodes.
- Shared-prefix decode steps (``prepare_decode(..., shared_prefix_tokens=p)``): the batch's prompts share their
  first p tokens; the first request is prefilled alone, so the others' prefills hit its cached blocks and
  the batch holds those blocks once. A step of two or more members reads them as shared KV, and the
  recorder's shared-KV columns (``num_shared_context_tokens``) must show it.
- Prefix caching is on (vLLM's default). Prompts are random token ids, reused only where a cache hit is meant
  (a shared prefix, a mixed chunk's cached part, a decode batch prepared again for its next order), so nothing
  hits the cache by accident; if it did, the recorded context (and shared-KV columns) would differ from the
  intended ones and the step would not match. Async scheduling stays off: each controlled step must be one engine step,
  scheduled only after the previous one's output was processed.
- LoRA decode batches (``ControlledEngine(..., max_loras=k)``, ``prepare_decode(..., adapters=[...])``): each member
  runs the adapter given for it (a `LoraAdapter`, None: the base model). ``max_loras`` slots must hold every adapter
  of a batch, so all are loaded into their slots while the batch is prepared and none inside a measured step: a
  measured step whose recorder row shows a slot load does not match (the slot-load term is not what such steps
  measure). The recorded adapter of each slice must be the intended one.
- Finished requests are retired by an empty, unrecorded step, so that cleanup is not timed inside the next
  controlled step.

Every step's rows are read back from the trace file the recorder writes (flushed every step) and compared
with the intended composition: the same requests, each with the intended new, context and shared context
tokens and phase, and nothing else. A step that does not match is reported as such (``MeasuredStep.matches``); the
caller redoes it. This module is the only part of the validation that imports vLLM.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from llmvisor.core.lora_trace import decode_adapters
from llmvisor.engines.settings import dtype_kwargs
from llmvisor.engines.vllm import settings as recorder_settings
from llmvisor.engines.vllm.driver import freeze_startup_objects
from llmvisor.errors import LlmvisorError

DEFAULT_KV_CACHE_GIB = 2
LOADS_KEY = "\0lora-loads"
"""Not a request id: the entry `_read_new_steps` adds to a step whose recorder row shows LoRA slot loads."""
DEFAULT_MAX_NUM_SEQS = 16


@dataclass(frozen=True)
class Slice:
    """One request's part of a step: tokens it runs, tokens already in its KV cache, and its phase."""

    num_new_tokens: int
    num_context_tokens: int
    is_prefill: bool
    num_shared_context_tokens: int = 0
    """Context tokens in KV blocks another slice of the step reads too (the trace's shared-KV column)."""
    lora_name: str = ""
    """The LoRA adapter the slice ran (the trace's ``lora_name``; empty: the base model)."""

    def as_dict(self) -> dict:
        return {"num_new_tokens": self.num_new_tokens, "num_context_tokens": self.num_context_tokens, "is_prefill": self.is_prefill,
                "num_shared_context_tokens": self.num_shared_context_tokens,
                **({"lora_name": self.lora_name} if self.lora_name else {})}


@dataclass
class MeasuredStep:
    """One engine step as the recorder saw it, next to what was intended."""

    step_latency_s: float
    intended: list[Slice]
    recorded: list[Slice]
    n_engine_steps: int
    """Engine steps that ran tokens for this call: 1 when the intended batch ran as one step."""
    reason: str = ""

    @property
    def matches(self) -> bool:
        return not self.reason


def pin_threads(num_threads: int | None) -> int:
    """Set the engine's OpenMP/torch threads the way `llmvisor profile --threads` does (see ``driver.py``).

    ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` before vLLM starts; None leaves the environment's
    setting. Profiling and validation runs with the same count time comparable steps. Returns torch's count.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise LlmvisorError(f"--threads: must be at least 1 (got {num_threads})")
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return int(torch.get_num_threads())


def _scheduler_class():
    from llmvisor.engines.vllm.recorder import RecordingScheduler

    class ControlledScheduler(RecordingScheduler):
        """The step recorder, plus a filter: only running requests in ``allowed_request_ids`` get tokens.

        ``allowed_request_ids = None`` schedules as vLLM does. Requests held back stay in ``running`` (their
        KV cache kept); the filter is set by the driver between steps, in the same process.
        """

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.allowed_request_ids: set[str] | None = None

        def schedule(self, *args, **kwargs):
            allowed = self.allowed_request_ids
            if allowed is None:
                return super().schedule(*args, **kwargs)
            held = [r for r in self.running if r.request_id not in allowed]
            self.running = [r for r in self.running if r.request_id in allowed]
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.running = self.running + held

    return ControlledScheduler


def scheduler_class():
    """The scheduler class to pass as ``scheduler_cls`` (built lazily so importing this module is cheap)."""
    global _SCHEDULER_CLASS
    if _SCHEDULER_CLASS is None:
        _SCHEDULER_CLASS = _scheduler_class()
    return _SCHEDULER_CLASS


_SCHEDULER_CLASS = None


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter a decode batch member runs: its name (vLLM's ``lora_name``) and folder (``lora_path``)."""

    name: str
    path: str


@dataclass
class DecodeBatch:
    """Requests prefilled to chosen contexts, held in the engine for decode steps of any subset."""

    request_ids: list[str]
    context_tokens: list[int]
    """Current context of each request (grows by one each time it runs a decode)."""
    nominal_context_tokens: list[int] = field(default_factory=list)
    shared_context_tokens: list[int] = field(default_factory=list)
    """Per request, the context tokens in blocks shared with the batch's other shared-prefix requests (whole
    blocks of the common prefix; 0 for a request of its own): what a step of two or more of them records."""
    prefix_groups: list[int] = field(default_factory=list)
    """Per request, its prefix group (−1: own context); empty: one group of every request with shared blocks."""
    lora_names: list[str] = field(default_factory=list)
    """Per request, the LoRA adapter it runs (empty: the base model); an empty list: every request the base model."""

    def intended(self, members: list[int]) -> dict[str, Slice]:
        """Each member's decode slice in a step of ``members``: its shared blocks count only when another
        member of the step (of its prefix group) reads them too."""
        shared = self.shared_context_tokens or [0] * len(self.request_ids)
        groups = self.prefix_groups or [0 if c > 0 else -1 for c in shared]
        readers: dict[int, int] = {}
        for i in members:
            if shared[i] > 0 and groups[i] >= 0:
                readers[groups[i]] = readers.get(groups[i], 0) + 1
        names = self.lora_names or [""] * len(self.request_ids)
        return {self.request_ids[i]: Slice(1, self.context_tokens[i], False,
                                           shared[i] if readers.get(groups[i], 0) >= 2 and groups[i] >= 0 else 0, names[i])
                for i in members}


@dataclass
class MixedBatch:
    """Held decodes plus the prefill chunk (member 0) re-presented on every run: ``chunk_tokens`` new over
    ``cached_tokens`` of context, the context computed afresh (or found in the prefix cache) before each run."""

    decodes: DecodeBatch
    chunk_tokens: int
    cached_tokens: int
    cached_prompt: list[int]


@dataclass
class EngineLimits:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


class ControlledEngine:
    """An in-process vLLM engine on a model folder (a bare ``config.json`` runs with dummy weights).

    Use as a context manager. ``prefill_step(lengths)`` and ``decode_step(batch, members)`` each run one
    controlled step and return a `MeasuredStep`; ``prepare_decode(contexts)`` makes a `DecodeBatch` and
    ``release(batch)`` frees it. ``trace_path`` keeps the recorder's rows of every step (JSONL).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
        trace_path: str | os.PathLike | None = None,
        num_threads: int | None = None,
        seed: int = 0,
        run_id: str = "controlled",
        warm: bool = True,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        dtype: str = "auto",
    ) -> None:
        """``dtype``: vLLM's ``--dtype`` (`llmvisor.engines.settings.dtype_kwargs`: ``auto`` passes nothing).
        ``max_loras`` > 0 starts the engine with LoRA (``enable_lora``, that many slots, ``max_cpu_loras`` the same,
        adapters up to ``max_lora_rank``) for decode batches whose members run adapters."""
        config = Path(model_dir) / "config.json"
        if not config.is_file():
            raise LlmvisorError(f"{model_dir}: no config.json (need a Hugging Face model folder or a bare config.json)")
        self.model_dir = str(model_dir)
        self._requested = dict(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        self.kv_cache_gib = kv_cache_gib
        self.num_threads = num_threads
        self._tmp: tempfile.TemporaryDirectory | None = None
        if trace_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmvisor-controlled-")
            trace_path = os.path.join(self._tmp.name, "steps.jsonl")
        self.trace_path = str(trace_path)
        self.run_id = run_id
        self._rng = random.Random(seed)
        self._counter = 0
        self._decode_prompts: tuple[tuple, list[dict]] | None = None
        """The last decode batch's (contexts, shared prefix) and prompts: preparing it again reuses them."""
        self._held: set[str] = set()
        self.warm = warm
        if max_loras < 0 or (max_loras and max_lora_rank < 1):
            raise LlmvisorError(f"max_loras {max_loras}, max_lora_rank {max_lora_rank}: need max_loras >= 0 and a rank >= 1")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self._lora_ids: dict[str, int] = {}
        self._slots: list[list[int]] = []
        """Warm: per length rank, the token sequence whose prefixes are the own contexts of that rank."""
        self._group_slots: list[list[int]] = []
        """Warm: per group rank, the sequence whose prefixes are that group's shared prefix and its longest reader's context."""
        self._trace_offset = 0
        self.llm = None
        self.engine = None
        self.scheduler = None
        self.limits: EngineLimits | None = None
        self.vllm_version = ""

    # ------------------------------------------------------------------------------------------------
    def __enter__(self) -> ControlledEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        self.threads = pin_threads(self.num_threads)
        os.environ[recorder_settings.ENV_TRACE_PATH] = self.trace_path
        os.environ[recorder_settings.ENV_RUN_ID] = self.run_id
        os.environ[recorder_settings.ENV_UNIQUE_RUN_ID] = "0"
        os.environ[recorder_settings.ENV_WARMUP_STEPS] = "0"
        os.environ[recorder_settings.ENV_FLUSH_EVERY_STEPS] = "1"
        os.environ.pop(recorder_settings.ENV_CONFIG, None)
        Path(self.trace_path).parent.mkdir(parents=True, exist_ok=True)
        self._trace_offset = os.path.getsize(self.trace_path) if os.path.exists(self.trace_path) else 0

        import vllm
        from vllm import LLM

        self.vllm_version = vllm.__version__
        kwargs = {k: v for k, v in self._requested.items() if v is not None}
        kwargs.update(dtype_kwargs(self.dtype))
        if self.max_loras:
            kwargs.update(enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_loras)
        self.llm = LLM(
            model=self.model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            distributed_executor_backend="uni",
            async_scheduling=False,
            scheduler_cls=scheduler_class(),
            seed=0,
            **kwargs,
        )
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        if not hasattr(self.scheduler, "allowed_request_ids"):
            raise LlmvisorError("vLLM did not use the controlled scheduler (is the engine running out of process?)")
        config = self.scheduler.scheduler_config
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        self.limits = EngineLimits(
            max_model_len=int(self.scheduler.max_model_len),
            max_num_batched_tokens=int(config.max_num_batched_tokens),
            max_num_seqs=int(config.max_num_seqs),
        )
        freeze_startup_objects()

    def describe(self) -> dict:
        """Engine facts for the result's settings."""
        from llmvisor.engines.vllm.recorder import describe_hardware

        config = self.engine.vllm_config
        return {
            "engine": f"vllm {self.vllm_version}",
            "engine_model": os.path.basename(os.path.normpath(self.model_dir)),
            "weights": "dummy (random), load_format='dummy'",
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.limits.max_model_len,
            "max_num_batched_tokens": self.limits.max_num_batched_tokens,
            "max_num_seqs": self.limits.max_num_seqs,
            "kv_cache_gib": self.kv_cache_gib,
            "enable_prefix_caching": True,
            "async_scheduling": False,
            "torch_threads": self.threads,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "hardware": describe_hardware(),
            **({"enable_lora": True, "max_loras": self.max_loras, "max_cpu_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank} if self.max_loras else {}),
            "step_timing": "RecordingScheduler: schedule() returned -> update_from_output() entered",
            "decode_contexts": ("warm: held at the planned context (each decode step rewound), prepared once per batch, "
                                "own contexts from the session's prefix-cached sequences") if self.warm else
                               "cold: grow one token per run, fresh prompts, prepared again per batch-round",
        }

    @property
    def holds_contexts(self) -> bool:
        """True when decode steps leave a held batch at its prepared contexts (one preparation serves every batch-round)."""
        return self.warm

    def new_session_prompts(self) -> None:
        """Forget the per-rank own and group sequences (and the last batch's prompts): later batches draw fresh prompts, as
        after an engine start (a benchmark starts each repeat from a cache that holds nothing of the previous one)."""
        self._slots = []
        self._group_slots = []
        self._decode_prompts = None

    def close(self) -> None:
        if self.llm is not None:
            self._abort_all()
            try:
                self.scheduler.flush_trace()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            try:
                self.engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
            self.llm = self.engine = self.scheduler = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------------------------------------
    def _new_id(self, tag: str) -> str:
        self._counter += 1
        return f"{tag}{self._counter}"

    def _token_ids(self, length: int) -> list[int]:
        high = max(self.vocab_size, 4)
        return [self._rng.randrange(3, high) for _ in range(length)]

    def _prompt(self, length: int, prefix: list[int] | None = None) -> dict:
        """Random token ids (so no two prompts share a cached block by chance), after ``prefix`` if given."""
        prefix = prefix or []
        return {"prompt_token_ids": list(prefix[:length]) + self._token_ids(length - min(length, len(prefix)))}

    def _session_prefix(self, sequences: list[list[int]], rank: int, length: int) -> list[int]:
        """The first ``length`` tokens of session sequence ``rank`` (random ids, grown as needed)."""
        while len(sequences) <= rank:
            sequences.append([])
        sequence = sequences[rank]
        if len(sequence) < length:
            sequence += self._token_ids(length - len(sequence))
        return sequence[:length]

    def _ranked_prompts(self, lengths: list[int]) -> list[dict]:
        """Warm: own contexts, the k-th longest (ties by position) the first tokens of the session's k-th own sequence.
        Ranks are distinct, so no two requests of a batch share a block; a later batch's k-th longest own context finds
        the whole blocks the longest earlier one of that rank computed in the prefix cache. Ranked rather than by
        position, a session's sequences grow to about the longest contexts once, where by position each would grow to
        whatever long context any batch happened to put there."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        prompts: list[dict] = [{}] * len(lengths)
        for rank, i in enumerate(order):
            prompts[i] = {"prompt_token_ids": self._session_prefix(self._slots, rank, lengths[i])}
        return prompts

    def _group_prompts(self, rank: int, lengths: list[int], prefix_tokens: int) -> list[dict]:
        """Warm: one prefix group's prompts. The group's shared prefix and its longest reader's whole context are the
        start of the session's group sequence ``rank`` (found in the prefix cache when an earlier batch's group of that
        rank computed them); the other readers continue the prefix with fresh random ids, so they share nothing past it."""
        lead = max(range(len(lengths)), key=lambda i: lengths[i])
        sequence = self._session_prefix(self._group_slots, rank, lengths[lead])
        return [{"prompt_token_ids": sequence[:n]} if i == lead else self._prompt(n, sequence[:prefix_tokens])
                for i, n in enumerate(lengths)]

    def _sampling(self, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Warm: a held request runs thousands of steps; cumulative outputs would copy its growing token list every step.
        kind = RequestOutputKind.DELTA if self.warm else RequestOutputKind.CUMULATIVE
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0, output_kind=kind)

    def _check_lengths(self, lengths: list[int], *, what: str) -> None:
        limits = self.limits
        if not lengths or len(lengths) > limits.max_num_seqs:
            raise LlmvisorError(f"{what}: batch of {len(lengths)} requests; the engine runs 1 to {limits.max_num_seqs}")
        for n in lengths:
            if n < 1 or n >= limits.max_model_len:
                raise LlmvisorError(f"{what}: length {n} outside 1..{limits.max_model_len - 1} (max_model_len {limits.max_model_len})")

    def _read_new_steps(self) -> list[tuple[float, dict[str, Slice]]]:
        """The steps the recorder wrote since the last call: (step_latency_s, {request_id: Slice})."""
        if not os.path.exists(self.trace_path):
            return []
        with open(self.trace_path, "rb") as handle:
            handle.seek(self._trace_offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._trace_offset += end
        steps: dict[int, tuple[float, dict[str, Slice]]] = {}
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            latency, slices = steps.setdefault(int(row["step_id"]), (float(row["step_latency_s"]), {}))
            slices[row["request_id"]] = Slice(
                int(row["num_new_tokens"]), int(row["num_context_tokens"]), row["phase"] == "prefill", int(row.get("num_shared_context_tokens") or 0),
                str(row.get("lora_name") or ""),
            )
            if decode_adapters(row.get("step_lora_loads")):
                slices[LOADS_KEY] = Slice(0, 0, False, lora_name=",".join(sorted(decode_adapters(row["step_lora_loads"]))))
        return [steps[k] for k in sorted(steps)]

    def _step(self) -> None:
        self.engine.step()
        self.scheduler.flush_trace()

    def _compare(self, intended: dict[str, Slice], steps: list[tuple[float, dict[str, Slice]]]) -> MeasuredStep:
        order = list(intended)
        if not steps:
            return MeasuredStep(float("nan"), [intended[r] for r in order], [], 0, "no step ran")
        latency, recorded = steps[0]
        recorded = dict(recorded)
        loads = recorded.pop(LOADS_KEY, None)
        reason = ""
        if loads is not None:
            reason = f"LoRA adapter(s) {loads.lora_name} were loaded into a slot inside the step"
        elif len(steps) != 1:
            reason = f"the batch ran as {len(steps)} steps"
        elif set(recorded) != set(intended):
            reason = f"step ran {sorted(recorded)} instead of {sorted(intended)}"
        else:
            wrong = [r for r in order if recorded[r] != intended[r]]
            if wrong:
                reason = "; ".join(f"{r}: ran {recorded[r]} instead of {intended[r]}" for r in wrong)
        return MeasuredStep(
            latency,
            [intended[r] for r in order],
            [recorded.get(r, Slice(0, 0, False)) for r in order],
            len(steps),
            reason,
        )

    def _abort_all(self) -> None:
        ids = list(self.scheduler.requests)
        if ids:
            self.engine.abort_request(ids, internal=True)
        self._held = set()
        self._flush_finished()
        self._read_new_steps()

    # ------------------------------------------------------------------------------------------------
    def _flush_finished(self) -> None:
        """Run empty steps until finished requests are retired from the worker's batch.

        vLLM tells the worker which requests finished in the *next* step; that cleanup would otherwise be
        timed inside the following controlled step. An empty step (nothing scheduled: held requests stay
        held) does it outside any measured window and is not recorded.
        """
        for _ in range(4):
            if not self.scheduler.finished_req_ids:
                return
            self.scheduler.allowed_request_ids = set()
            self._step()

    def _run_only(self, request_ids) -> list[tuple[float, dict[str, Slice]]]:
        """One engine step that may schedule only ``request_ids``; the steps recorded while it ran."""
        self._read_new_steps()
        self.scheduler.allowed_request_ids = set(request_ids)
        try:
            self._step()
        finally:
            self.scheduler.allowed_request_ids = set()
        return self._read_new_steps()

    def _abort_unheld(self) -> None:
        stray = [rid for rid in self.scheduler.requests if rid not in self._held]
        if stray:
            self.engine.abort_request(stray, internal=True)
            self._flush_finished()

    def prefill_step(self, prompt_lengths: list[int]) -> MeasuredStep:
        """Run fresh prompts of these lengths as one prefill step (context 0 each) and time it.

        A held decode batch (`prepare_decode`) stays held: it neither runs nor is disturbed.
        """
        self._check_lengths(prompt_lengths, what="prefill step")
        if sum(prompt_lengths) > self.limits.max_num_batched_tokens:
            raise LlmvisorError(
                f"prefill step of {sum(prompt_lengths)} tokens exceeds max_num_batched_tokens {self.limits.max_num_batched_tokens}"
            )
        self._abort_unheld()
        self._read_new_steps()
        self.scheduler.allowed_request_ids = set()  # new requests are admitted from the waiting queue; held ones wait
        intended: dict[str, Slice] = {}
        params = self._sampling(1)
        for length in prompt_lengths:
            rid = self.engine.add_request(self._new_id("p"), self._prompt(length), params)
            intended[rid] = Slice(length, 0, True)
        requests = self.scheduler.requests
        for _ in range(4):
            if not any(rid in requests for rid in intended):
                break
            self._step()
        steps = self._read_new_steps()
        self._abort_unheld()
        self._flush_finished()
        return self._compare(intended, steps)

    def canary_step(self) -> MeasuredStep:
        """A fixed reference step (a 128-token prefill), repeated between controlled steps to detect interference."""
        return self.prefill_step([min(128, self.limits.max_num_batched_tokens, self.limits.max_model_len - 1)])

    def prepare_decode(self, context_lengths: list[int], *, max_decode_steps: int, shared_prefix_tokens: int = 0,
                       adapters: list[LoraAdapter | None] | None = None) -> DecodeBatch:
        """Prefill one request per context length, each to exactly that context, for decode steps.

        Only requests still in prefill may run while preparing, so none decodes (and grows) early.
        ``max_decode_steps`` bounds how many decode steps any request will run (its ``max_tokens``).
        The same contexts prepared again right after (the last batch's) get the same prompts, so the prefill finds their whole blocks in the
        prefix cache (a batch measured order by order is prepared once per order at little cost); the requests of
        one batch never share a block unless asked to.
        With ``shared_prefix_tokens`` p > 0 the prompts share their first p tokens: the first request is
        prefilled alone, the others then find its whole blocks of the prefix in the prefix cache.
        ``adapters``: per request, the LoRA adapter it runs (None: the base model); needs an engine started with
        ``max_loras`` of at least the batch's distinct adapters, so all stay in their slots through its steps.
        """
        lora_requests = self._lora_requests(adapters, len(context_lengths))
        self._check_lengths(context_lengths, what="decode batch")
        too_long = [c for c in context_lengths if c + max_decode_steps + 1 > self.limits.max_model_len]
        if too_long:
            raise LlmvisorError(f"decode contexts {too_long} + {max_decode_steps} steps exceed max_model_len {self.limits.max_model_len}")
        if shared_prefix_tokens < 0 or (shared_prefix_tokens and shared_prefix_tokens > min(context_lengths)):
            raise LlmvisorError(f"shared prefix of {shared_prefix_tokens} tokens: must be 0 to the shortest context {min(context_lengths)}")
        if 0 < shared_prefix_tokens < self.block_size and len(context_lengths) > 1:
            raise LlmvisorError(f"shared prefix of {shared_prefix_tokens} tokens fills no whole KV block ({self.block_size} tokens): "
                                "nothing would be shared")
        if self.engine.has_unfinished_requests():
            self._abort_all()
        self._held = set()
        key = (self.warm, tuple(context_lengths), shared_prefix_tokens)
        if self.warm and not shared_prefix_tokens:
            prompts = self._ranked_prompts(list(context_lengths))
        else:
            if self._decode_prompts is None or self._decode_prompts[0] != key:  # one prefix group of every request
                self._decode_prompts = (key, self._grouped_prompts(list(context_lengths), {0: shared_prefix_tokens}, [0] * len(context_lengths)))
            prompts = self._decode_prompts[1]
        params = self._sampling(max_decode_steps + 1)
        waves = [list(range(len(context_lengths)))]
        if shared_prefix_tokens and len(context_lengths) > 1:
            waves = [waves[0][:1], waves[0][1:]]
        ids = []
        for wave in waves:
            added = [self.engine.add_request(self._new_id("d"), prompts[i], params, lora_request=lora_requests[i]) for i in wave]
            self._prefill(added, max(context_lengths[i] for i in wave))
            ids += added
        self.scheduler.allowed_request_ids = set()
        self._held = set(ids)
        self._read_new_steps()
        requests = self.scheduler.requests
        actual = [requests[rid].num_computed_tokens for rid in ids]
        if actual != list(context_lengths):
            raise LlmvisorError(f"decode batch prefilled to contexts {actual} instead of {list(context_lengths)}")
        whole_blocks = shared_prefix_tokens // self.block_size * self.block_size if len(ids) > 1 else 0
        return DecodeBatch(ids, list(actual), list(context_lengths), [whole_blocks if shared_prefix_tokens else 0] * len(ids),
                           lora_names=[r.lora_name if r else "" for r in lora_requests] if adapters else [])

    def _lora_requests(self, adapters: list[LoraAdapter | None] | None, n: int) -> list:
        """vLLM ``LoRARequest`` per request (None: the base model), one integer id per adapter name for the session."""
        if not adapters:
            return [None] * n
        if len(adapters) != n:
            raise LlmvisorError(f"decode batch: {len(adapters)} adapters for {n} requests (one per request, None: base model)")
        distinct = {a.name for a in adapters if a is not None}
        if len(distinct) > self.max_loras:
            raise LlmvisorError(f"decode batch runs {len(distinct)} LoRA adapters; the engine has max_loras {self.max_loras} "
                                "(start it with max_loras of at least the batch's adapters, so none is loaded inside a step)")
        from vllm.lora.request import LoRARequest

        return [None if a is None else LoRARequest(a.name, self._lora_ids.setdefault(a.name, len(self._lora_ids) + 1), a.path)
                for a in adapters]

    def _prefill(self, ids: list[str], longest: int) -> None:
        """Run steps of only the still-prefilling ``ids`` until every one has computed its whole prompt."""
        requests = self.scheduler.requests
        for _ in range(len(ids) * (longest // 16 + 4)):
            pending = {
                rid
                for rid in ids
                if rid not in requests or requests[rid].num_computed_tokens < requests[rid].num_prompt_tokens
            }
            if not pending:
                return
            self.scheduler.allowed_request_ids = pending
            self._step()
        raise LlmvisorError("decode batch did not finish its prefill")

    def decode_step(self, batch: DecodeBatch, members: list[int]) -> MeasuredStep:
        """Run the requests ``members`` (indices into the batch) as one decode step and time it."""
        if not members:
            raise LlmvisorError("a decode step needs at least one request")
        intended = batch.intended(members)
        steps = self._run_only(intended)
        if self.warm:
            self._rewind(batch, members)
        self._update_contexts(batch)
        return self._compare(intended, steps)

    def _rewind(self, batch: DecodeBatch, members: list[int]) -> None:
        """Set each member back to its prepared context after a decode step: drop the token(s) it sampled since and
        set ``num_computed_tokens`` back. The KV written for the dropped position is written again, identically, by the
        member's next step (same input token, same context); its block stays allocated to it. The model runner trims
        its copy of the request's output tokens when the next step it runs in reports fewer of them (vLLM's own path
        for discarded output tokens), so the next step runs the same position over the same context."""
        requests = self.scheduler.requests
        hashed = int(getattr(self.scheduler, "hash_block_size", None) or self.block_size)
        for i in members:
            request = requests.get(batch.request_ids[i])
            if request is None:
                continue
            extra = request.num_computed_tokens - batch.nominal_context_tokens[i]
            if extra <= 0:
                continue
            try:
                request.num_computed_tokens -= extra
                del request._output_token_ids[-extra:]
                del request._all_token_ids[-extra:]
                del request.block_hashes[request.num_tokens // hashed:]
            except AttributeError as error:
                raise LlmvisorError(f"this vLLM build's requests cannot be rewound ({error}); measure with warm=False") from None

    def _update_contexts(self, batch: DecodeBatch) -> None:
        requests = self.scheduler.requests
        for i, rid in enumerate(batch.request_ids):
            if rid in requests:
                batch.context_tokens[i] = requests[rid].num_computed_tokens

    def prepare_shared_decode(self, context_lengths: list[int], shared_prefix_tokens: int, *, max_decode_steps: int) -> DecodeBatch:
        """A decode batch whose prompts share their first ``shared_prefix_tokens`` tokens (`prepare_decode`)."""
        return self.prepare_decode(context_lengths, max_decode_steps=max_decode_steps, shared_prefix_tokens=shared_prefix_tokens)

    def prepare_grouped_decode(self, context_lengths: list[int], shared_prefix_tokens: list[int], prefix_groups: list[int], *,
                               max_decode_steps: int) -> DecodeBatch:
        """A decode batch in prefix groups: request i's prompt starts with its group's prefix of
        ``shared_prefix_tokens[i]`` tokens (group −1: a context of its own). One request of each group is prefilled
        first (with the own-context ones), the rest after, so they find their group's whole blocks in the prefix cache."""
        self._check_lengths(context_lengths, what="decode batch")
        n = len(context_lengths)
        if len(shared_prefix_tokens) != n or len(prefix_groups) != n:
            raise LlmvisorError("grouped decode batch: one prefix length and one group per request")
        too_long = [c for c in context_lengths if c + max_decode_steps + 1 > self.limits.max_model_len]
        if too_long:
            raise LlmvisorError(f"decode contexts {too_long} + {max_decode_steps} steps exceed max_model_len {self.limits.max_model_len}")
        prefix_of: dict[int, int] = {}
        for c, p, g in zip(context_lengths, shared_prefix_tokens, prefix_groups, strict=True):
            if g < 0:
                continue
            if prefix_of.setdefault(g, p) != p or not self.block_size <= p <= c:
                raise LlmvisorError(f"prefix group {g}: one prefix of at least a KV block ({self.block_size} tokens) "
                                    f"and at most each context, per group (got {p} for a context of {c})")
        if self.engine.has_unfinished_requests():
            self._abort_all()
        self._held = set()
        key = (self.warm, tuple(context_lengths), tuple(shared_prefix_tokens), tuple(prefix_groups))
        if self._decode_prompts is None or self._decode_prompts[0] != key:
            self._decode_prompts = (key, self._grouped_prompts(list(context_lengths), prefix_of, list(prefix_groups)))
        prompts = self._decode_prompts[1]
        params = self._sampling(max_decode_steps + 1)
        first: list[int] = []
        seen: set[int] = set()
        for i, g in enumerate(prefix_groups):
            if g < 0 or g not in seen:
                first.append(i)
                seen.add(g)
        later = [i for i in range(n) if i not in set(first)]
        ids: list[str | None] = [None] * n
        for wave in (first, later):
            if not wave:
                continue
            added = [self.engine.add_request(self._new_id("d"), prompts[i], params) for i in wave]
            self._prefill(added, max(context_lengths[i] for i in wave))
            for i, rid in zip(wave, added, strict=True):
                ids[i] = rid
        self.scheduler.allowed_request_ids = set()
        self._held = set(ids)
        self._read_new_steps()
        requests = self.scheduler.requests
        actual = [requests[rid].num_computed_tokens for rid in ids]
        if actual != list(context_lengths):
            raise LlmvisorError(f"decode batch prefilled to contexts {actual} instead of {list(context_lengths)}")
        members_of = {g: sum(1 for h in prefix_groups if h == g) for g in prefix_of}
        shared = [p // self.block_size * self.block_size if g >= 0 and members_of[g] > 1 else 0
                  for p, g in zip(shared_prefix_tokens, prefix_groups, strict=True)]
        return DecodeBatch(list(ids), list(actual), list(context_lengths), shared, list(prefix_groups))

    def _grouped_prompts(self, lengths: list[int], prefix_of: dict[int, int], groups: list[int]) -> list[dict]:
        """Prompts of a grouped decode batch: warm, own contexts by rank (`_ranked_prompts`) and groups by the rank of
        their longest reader (`_group_prompts`); cold, fresh random ids after a fresh prefix per group."""
        if not self.warm:
            prefixes = {g: self._token_ids(p) for g, p in sorted(prefix_of.items())}
            return [self._prompt(n, prefixes.get(g)) for n, g in zip(lengths, groups, strict=True)]
        prompts: list[dict] = [{}] * len(lengths)
        own = [i for i, g in enumerate(groups) if g < 0]
        for i, prompt in zip(own, self._ranked_prompts([lengths[i] for i in own]), strict=True):
            prompts[i] = prompt
        readers = {g: [i for i, h in enumerate(groups) if h == g] for g in prefix_of}
        by_lead = sorted(readers, key=lambda g: (-max(lengths[i] for i in readers[g]), min(readers[g])))
        for rank, g in enumerate(by_lead):
            for i, prompt in zip(readers[g], self._group_prompts(rank, [lengths[i] for i in readers[g]], prefix_of[g]), strict=True):
                prompts[i] = prompt
        return prompts

    def prepare_mixed(self, chunk_tokens: int, cached_tokens: int, decode_contexts: list[int], *, max_decode_steps: int) -> MixedBatch:
        """Hold decodes at ``decode_contexts`` for mixed steps whose member 0 is a prefill chunk of ``chunk_tokens``
        new tokens over ``cached_tokens`` of context (members 1.. are the decodes)."""
        limits = self.limits
        if chunk_tokens < 1 or cached_tokens < 0 or cached_tokens + chunk_tokens + 1 > limits.max_model_len:
            raise LlmvisorError(f"mixed step: chunk of {chunk_tokens} over {cached_tokens} cached tokens does not fit max_model_len {limits.max_model_len}")
        if chunk_tokens + len(decode_contexts) > limits.max_num_batched_tokens:
            raise LlmvisorError(f"mixed step of {chunk_tokens} + {len(decode_contexts)} tokens exceeds max_num_batched_tokens {limits.max_num_batched_tokens}")
        if len(decode_contexts) + 1 > limits.max_num_seqs:
            raise LlmvisorError(f"mixed step: {len(decode_contexts) + 1} requests; the engine runs 1 to {limits.max_num_seqs}")
        decodes = self.prepare_decode(decode_contexts, max_decode_steps=max_decode_steps) if decode_contexts else DecodeBatch([], [], [])
        return MixedBatch(decodes, chunk_tokens, cached_tokens, self._token_ids(cached_tokens))

    def _prefill_context(self, rid: str, cached_tokens: int) -> None:
        """Compute exactly the first ``cached_tokens`` of a waiting request's prompt (a prefix-cache hit counted),
        running it alone with the step's token budget capped at what is left."""
        request = self.scheduler.requests[rid]
        computed = int(self.scheduler.kv_cache_manager.get_computed_blocks(request)[1])
        original = self.scheduler.max_num_scheduled_tokens
        try:
            for _ in range(cached_tokens // 16 + 4):
                if computed >= cached_tokens:
                    return
                self.scheduler.max_num_scheduled_tokens = min(original, cached_tokens - computed)
                self.scheduler.allowed_request_ids = {rid}
                self._step()
                computed = self.scheduler.requests[rid].num_computed_tokens
        finally:
            self.scheduler.max_num_scheduled_tokens = original
            self.scheduler.allowed_request_ids = set()

    def mixed_step(self, batch: MixedBatch, members: list[int]) -> MeasuredStep:
        """Run ``members`` of a mixed batch as one step (0: the prefill chunk, i ≥ 1: decode i − 1) and time it."""
        if not members:
            raise LlmvisorError("a mixed step needs at least one request")
        decodes = [i - 1 for i in members if i > 0]
        intended = batch.decodes.intended(decodes)
        chunk_id = None
        self._read_new_steps()
        if 0 in members:
            chunk_id = self.engine.add_request(
                self._new_id("m"), self._prompt(batch.cached_tokens + batch.chunk_tokens, batch.cached_prompt), self._sampling(1)
            )
            self._prefill_context(chunk_id, batch.cached_tokens)
            intended = {chunk_id: Slice(batch.chunk_tokens, batch.cached_tokens, True), **intended}
        steps = self._run_only(intended)
        if self.warm:
            self._rewind(batch.decodes, decodes)
        self._update_contexts(batch.decodes)
        self._abort_unheld()
        self._flush_finished()
        self._read_new_steps()
        return self._compare(intended, steps)

    def release(self, batch: DecodeBatch | MixedBatch) -> None:
        """Abort a decode (or mixed) batch's requests, freeing their KV cache."""
        self._held = set()
        self._abort_all()

    def warm_up(self, *, prefill_lengths: list[int], decode_contexts: list[int], n_steps: int = 3) -> None:
        """Run a few throw-away steps of the shapes to come (first runs of a shape are slow)."""
        for _ in range(n_steps):
            self.prefill_step(prefill_lengths)
        batch = self.prepare_decode(decode_contexts, max_decode_steps=4 * n_steps)
        for _ in range(n_steps):
            self.decode_step(batch, list(range(len(decode_contexts))))
            self.decode_step(batch, [0])
        self.release(batch)
        self._read_new_steps()
