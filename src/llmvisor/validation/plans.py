"""What the validation measures: batches of 2 to 8 requests (every subset measured) and serving-size batches of
16–64 (`SampledBatchSpec`: the prefixes of sampled orders measured), their lengths drawn from real request mixes.

Each batch is one phase (all prefill or all decode) and fits the engine's limits (`Envelope`); its
``key`` names it in the measurement journal, so a resumed run recognises what it already measured.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.core.workloads import read_workload_csv
from llmvisor.errors import LlmvisorError
from llmvisor.validation.game import sample_orders, subsets_to_measure


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


PHASES = tuple(Phase)


class BatchKind(StrEnum):
    WORKLOAD = "workload"
    """Lengths drawn from a real mix."""
    ADVERSARIAL = "adversarial"
    """One long request among short ones."""


@dataclass(frozen=True)
class BatchSpec:
    """One batch to validate: each request's new tokens and (nominal) context tokens, all of one phase."""

    index: int
    phase: str
    kind: str
    """A `BatchKind`."""
    source: str
    """The mix the lengths were drawn from, or "adversarial"."""
    num_new_tokens: tuple[int, ...]
    num_context_tokens: tuple[int, ...]
    rounds: int = 1
    """Independent measurement rounds; 2 measures the noise floor of the measured Shapley values."""

    @property
    def size(self) -> int:
        return len(self.num_new_tokens)

    @property
    def key(self) -> str:
        lengths = ",".join(map(str, self.num_new_tokens)) + "|" + ",".join(map(str, self.num_context_tokens))
        return f"{self.index}:{self.phase}:{lengths}"

    def as_dict(self) -> dict:
        data = asdict(self)
        data["num_new_tokens"] = list(self.num_new_tokens)
        data["num_context_tokens"] = list(self.num_context_tokens)
        return data


@dataclass(frozen=True)
class Envelope:
    """The engine's limits that batches must respect."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass
class LengthMix:
    """A real request-length mix: prompt and output lengths of one workload file."""

    name: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


def read_length_mixes(directory: str | os.PathLike | None = None) -> list[LengthMix]:
    """The three real mixes (Azure conversation, Azure code, arXiv summarization); default: the shipped ones."""
    directory = Path(directory) if directory is not None else shipped.workloads_dir()
    mixes = []
    for name in shipped.WORKLOAD_FILES:
        path = directory / name
        if not path.is_file():
            raise LlmvisorError(f"{path}: workload file missing (expected {', '.join(shipped.WORKLOAD_FILES)} in {directory})")
        rows = read_workload_csv(path, min_output_tokens=0)
        prompt = np.array([row.prompt_len for row in rows])
        output = np.array([row.output_len for row in rows])
        mixes.append(LengthMix(name.removesuffix(".csv"), prompt, output))
    return mixes


def draw_batches(
    mixes: list[LengthMix],
    envelope: Envelope,
    *,
    n_batches: int,
    max_batch: int,
    min_batch: int = 2,
    adversarial_fraction: float = 0.2,
    replicate_every: int = 4,
    decode_headroom: int = 256,
    max_prefill_tokens: int | None = None,
    seed: int = 0,
) -> tuple[list[BatchSpec], dict]:
    """Draw validation batches from real length mixes, scaled to the engine's limits; returns (batches, rules).

    Phases alternate (prefill, decode, ...), batch sizes cycle through min_batch..max_batch, mixes cycle,
    and every ``1/adversarial_fraction``-th batch of a phase is adversarial. Scaling (stated in the result):

    - decode: a request is caught mid-generation, context c = P + U·O (U uniform), times
      s = min(1, (max_model_len − headroom) / p99(P + O)) per mix, so contexts span the model's range;
    - prefill: whole prompts (context 0) times s = min(1, prefill_tokens / p99(P)) per mix; a batch whose
      total exceeds ``prefill_tokens`` (the step budget) is scaled down as a whole to fit.
    """
    if n_batches < 1:
        raise LlmvisorError(f"--batches: must be at least 1 (got {n_batches})")
    if not 2 <= min_batch <= max_batch:
        raise LlmvisorError(f"--max-batch: must be at least {min_batch} (got {max_batch})")
    if max_batch > 8:
        raise LlmvisorError(f"--max-batch: at most 8 (2**n − 1 subsets are measured per batch; got {max_batch})")
    if max_batch > envelope.max_num_seqs:
        raise LlmvisorError(f"--max-batch: the engine runs at most {envelope.max_num_seqs} requests per step (got {max_batch})")
    if not 0 <= adversarial_fraction <= 1:
        raise LlmvisorError(f"adversarial fraction must be in [0, 1] (got {adversarial_fraction})")
    rng = np.random.default_rng(seed)
    prefill_tokens = int(max_prefill_tokens or envelope.max_num_batched_tokens)
    prefill_tokens = min(prefill_tokens, envelope.max_num_batched_tokens, envelope.max_model_len - 1)
    max_context = envelope.max_model_len - decode_headroom
    if max_context < 64 or prefill_tokens < 8 * max_batch:
        raise LlmvisorError(f"engine limits too small to validate on ({envelope})")
    decode_scale = {m.name: min(1.0, max_context / float(np.percentile(m.prompt_tokens + m.output_tokens, 99))) for m in mixes}
    prefill_scale = {m.name: min(1.0, prefill_tokens / float(np.percentile(m.prompt_tokens, 99))) for m in mixes}
    sizes = list(range(min_batch, max_batch + 1))
    every = round(1 / adversarial_fraction) if adversarial_fraction > 0 else 0
    batches = []
    for index in range(n_batches):
        phase = PHASES[index % 2]
        within = index // 2
        size = sizes[within % len(sizes)]
        mix = mixes[within % len(mixes)]
        adversarial = every > 0 and within % every == every - 1
        rows = rng.integers(0, mix.prompt_tokens.size, size)
        if phase == Phase.DECODE:
            raw = mix.prompt_tokens[rows] + np.floor(rng.random(size) * (mix.output_tokens[rows] + 1))
            context = np.clip(np.rint(raw * decode_scale[mix.name]), 1, max_context).astype(int)
            if adversarial:
                context = np.clip(rng.integers(16, 129, size), 1, max_context)
                context[0] = int(max_context * rng.uniform(0.85, 1.0))
                rng.shuffle(context)
            new = np.ones(size, dtype=int)
        else:
            prompt = np.clip(np.rint(mix.prompt_tokens[rows] * prefill_scale[mix.name]), 1, prefill_tokens).astype(int)
            if adversarial:
                prompt = rng.integers(8, 65, size)
                prompt[0] = int((prefill_tokens - prompt[1:].sum()) * rng.uniform(0.8, 1.0))
                rng.shuffle(prompt)
            if prompt.sum() > prefill_tokens:
                prompt = np.maximum(1, np.floor(prompt * prefill_tokens / prompt.sum())).astype(int)
            new, context = prompt, np.zeros(size, dtype=int)
        rounds = 2 if replicate_every and index % (2 * replicate_every) in (0, 1) else 1
        batches.append(
            BatchSpec(
                index=index,
                phase=phase,
                kind=BatchKind.ADVERSARIAL if adversarial else BatchKind.WORKLOAD,
                source=BatchKind.ADVERSARIAL.value if adversarial else mix.name,
                num_new_tokens=tuple(int(v) for v in new),
                num_context_tokens=tuple(int(v) for v in context),
                rounds=rounds,
            )
        )
    rules = {
        "decode": f"context = P + U·O (U uniform), times s = min(1, {max_context} / p99(P + O)) per mix, "
        f"rounded, in [1, {max_context}] (max_model_len {envelope.max_model_len} minus {decode_headroom} for the steps to run)",
        "prefill": f"whole prompts, context 0, times s = min(1, {prefill_tokens} / p99(P)) per mix, rounded; a batch over "
        f"{prefill_tokens} tokens in total scaled down as a whole to fit one step",
        "adversarial": "every "
        + (f"{every}th batch of a phase: one long request (decode: context 0.85–1.0 × {max_context}; prefill: 0.8–1.0 of the "
        f"step's remaining budget) among short ones (decode: contexts 16–128; prefill: prompts 8–64)" if every else "none"),
        "replicates": f"batches with index mod {2 * replicate_every} in (0, 1) measured twice, independently" if replicate_every else "none",
        "scale_factors": {"decode": decode_scale, "prefill": prefill_scale},
        "sizes": sizes,
        "seed": seed,
    }
    return batches, rules


class SampledKind(StrEnum):
    """Serving-size batches (16–64 requests), whose Shapley values are estimated from sampled orders."""

    DECODE = "decode"
    """Pure decode: every request runs one token over its own context."""
    PREFILL = "prefill"
    """Pure prefill: whole prompts, context 0."""
    MIXED = "mixed"
    """One prefill chunk over cached context (request 0) co-batched with decodes: the steps chunked prefill makes."""
    SHARED_PREFIX_DECODE = "shared_prefix_decode"
    """Decodes whose contexts share a cached prefix (a common system prompt or document): the engine holds the
    prefix's KV blocks once, and a step of two or more of them reads those blocks as shared KV."""


SAMPLED_KINDS = tuple(SampledKind)
SAMPLED_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class SampledBatchSpec:
    """A serving-size batch and the orders whose prefixes are measured (each prefix a subset, each subset once)."""

    index: int
    kind: str
    """A `SampledKind`."""
    source: str
    num_new_tokens: tuple[int, ...]
    num_context_tokens: tuple[int, ...]
    is_prefill: tuple[bool, ...]
    shared_prefix_tokens: tuple[int, ...]
    """Leading context tokens shared with the other requests of the batch (0: the context is the request's own)."""
    orders: tuple[tuple[int, ...], ...]
    antithetic: bool = True
    rounds: int = 1

    @property
    def size(self) -> int:
        return len(self.num_new_tokens)

    @property
    def phase(self) -> str:
        return self.kind

    @property
    def key(self) -> str:
        lengths = ",".join(map(str, self.num_new_tokens)) + "|" + ",".join(map(str, self.num_context_tokens))
        shared = ",".join(map(str, self.shared_prefix_tokens)) if any(self.shared_prefix_tokens) else ""
        return f"sampled{self.index}:{self.kind}:{lengths}" + (f"|{shared}" if shared else "")

    def subsets(self) -> list[int]:
        """Every distinct non-empty subset the orders' prefixes visit, the full batch included."""
        return subsets_to_measure(np.array(self.orders, dtype=np.int64))


def draw_sampled_batches(
    mixes: list[LengthMix],
    envelope: Envelope,
    *,
    n_batches: int,
    n_orders: int,
    sizes: tuple[int, ...] = SAMPLED_SIZES,
    kinds: tuple[str, ...] = (SampledKind.DECODE, SampledKind.PREFILL, SampledKind.MIXED),
    decode_headroom: int = 256,
    antithetic: bool = True,
    seed: int = 0,
) -> list[SampledBatchSpec]:
    """Serving-size batches from real length mixes; kinds and sizes cycle, lengths scaled as in `draw_batches`.

    - decode: contexts P + U·O scaled to the model's length, one new token each;
    - prefill: whole prompts sharing the step's token budget (scaled down as a whole to fit);
    - mixed: request 0 is a prefill chunk over cached context (a prompt caught mid-prefill: its cached part is
      context, the next chunk fills the step budget left by the decodes), the others decode as above;
    - shared_prefix_decode: decode contexts p + (own part), the first p tokens (0.25–0.5 of the longest context:
      a shared document or system prompt many KV blocks long) shared by every request, the own parts drawn as
      decode contexts scaled into what is left.
    """
    if n_batches < 1:
        raise LlmvisorError(f"--batches: must be at least 1 (got {n_batches})")
    if n_orders < 2 or (antithetic and n_orders % 2):
        raise LlmvisorError(f"--orders: at least 2{', and even (orders come with their reverses)' if antithetic else ''} (got {n_orders})")
    too_big = [s for s in sizes if s > envelope.max_num_seqs]
    if too_big or min(sizes, default=0) < 2:
        raise LlmvisorError(f"sampled batch sizes must be 2 to max_num_seqs {envelope.max_num_seqs} (got {list(sizes)})")
    rng = np.random.default_rng(seed)
    max_context = envelope.max_model_len - decode_headroom
    budget = min(envelope.max_num_batched_tokens, envelope.max_model_len - 1)
    batches = []
    for index in range(n_batches):
        kind = SampledKind(kinds[index % len(kinds)])
        size = sizes[(index // len(kinds)) % len(sizes)]
        mix = mixes[index % len(mixes)]
        scale = min(1.0, max_context / float(np.percentile(mix.prompt_tokens + mix.output_tokens, 99)))
        rows = rng.integers(0, mix.prompt_tokens.size, size)
        contexts = mix.prompt_tokens[rows] + np.floor(rng.random(size) * (mix.output_tokens[rows] + 1))
        context = np.clip(np.rint(contexts * scale), 1, max_context).astype(int)
        new = np.ones(size, dtype=int)
        prefill = np.zeros(size, dtype=bool)
        shared = np.zeros(size, dtype=int)
        if kind == SampledKind.PREFILL:
            prompt = np.clip(mix.prompt_tokens[rows], 1, budget).astype(int)
            if prompt.sum() > budget:
                prompt = np.maximum(1, np.floor(prompt * budget / prompt.sum())).astype(int)
            new, context, prefill = prompt, np.zeros(size, dtype=int), np.ones(size, dtype=bool)
        elif kind == SampledKind.MIXED:
            cached = int(min(max_context // 2, np.rint(mix.prompt_tokens[rows[0]] * scale * rng.uniform(0.2, 0.8))))
            chunk = int(max(1, min(budget - (size - 1), max_context - cached)))
            new[0], context[0], prefill[0] = chunk, cached, True
        elif kind == SampledKind.SHARED_PREFIX_DECODE:
            prefix = int(max_context * rng.uniform(0.25, 0.5))
            own = np.clip(np.rint(contexts * scale * (max_context - prefix) / max_context), 1, max_context - prefix).astype(int)
            context, shared[:] = prefix + own, prefix
        batches.append(SampledBatchSpec(
            index=index, kind=kind.value, source=mix.name,
            num_new_tokens=tuple(int(v) for v in new), num_context_tokens=tuple(int(v) for v in context),
            is_prefill=tuple(bool(v) for v in prefill), shared_prefix_tokens=tuple(int(v) for v in shared),
            orders=tuple(tuple(int(i) for i in row) for row in sample_orders(size, n_orders, rng, antithetic=antithetic)),
            antithetic=antithetic,
        ))
    return batches


def sampled_run_budget_s(batches: list[SampledBatchSpec], step_s, *, repeat: int) -> float:
    """Seconds of controlled steps a sampled plan needs: Σ over its distinct subsets of ``step_s(batch, subset)`` × repeat.

    Warm-up, canaries and re-preparing decode contexts come on top; ``step_s`` is a step-time estimate (a fitted
    latency model, or the journal's measured times).
    """
    return repeat * sum(step_s(b, s) for b in batches for s in b.subsets())
