"""What the validation measures: batches of 2 to 8 requests, their lengths drawn from real request mixes.

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
