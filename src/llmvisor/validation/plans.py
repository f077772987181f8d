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
from llmvisor.core.workloads import Envelope, read_workload_csv
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
    MIXED_SHARING_DECODE = "mixed_sharing_decode"
    """Decodes in 2–3 prefix groups of different sizes (each group's contexts share that group's prefix) beside
    requests of their own context: which blocks a step shares depends on which readers of each group it holds, so
    a wrong sharing rule shows as a bias between the classes of one batch."""


SAMPLED_KINDS = tuple(k for k in SampledKind if k != SampledKind.MIXED_SHARING_DECODE)
"""The kinds the prefixes design draws (`draw_sampled_batches`); the coalitions design draws every kind."""
COALITION_KINDS = tuple(SampledKind)
SAMPLED_SIZES = (16, 32, 64)
SHARED_KINDS = (SampledKind.SHARED_PREFIX_DECODE, SampledKind.MIXED_SHARING_DECODE)
"""Decode kinds whose requests read shared prefix blocks."""


class Design(StrEnum):
    """Which coalitions of a serving-size batch are measured."""

    PREFIXES = "prefixes"
    """The prefixes of sampled orders (nested coalitions: what permutation sampling needs)."""
    COALITIONS = "coalitions"
    """Random complementary coalitions, each request in about half (what the regression estimator needs)."""


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
    prefix_groups: tuple[int, ...] = ()
    """Per request, the prefix group it shares its prefix with (−1: a context of its own); empty: one group of all
    requests with a nonzero ``shared_prefix_tokens``."""
    coalitions: tuple[int, ...] = ()
    """With the coalitions design: the measured coalitions (bit masks, the full batch first, then complementary
    pairs); empty: the orders' prefixes are measured."""
    replicated: tuple[int, ...] = ()
    """Coalitions measured again, independently, in round 1 (the replicate noise of this batch)."""
    chunk: int = 32
    """Coalitions per batch-round of the coalitions design (a decode batch is prepared afresh per chunk)."""
    pool_index: tuple[int, ...] = ()
    """With a pool (`draw_coalition_pools`): each request's position in the pool whose contexts are held while this
    batch is measured (ascending); empty: the batch is its own pool."""
    pool_context_tokens: tuple[int, ...] = ()
    """The pool's contexts, prefilled once and held for every batch drawn from it."""
    pool_shared_prefix_tokens: tuple[int, ...] = ()
    pool_groups: tuple[int, ...] = ()
    tenants: tuple[int, ...] = ()
    """With the tenants design (`draw_tenant_batches`): each request's tenant (0 … T − 1); the coalitions are then the
    2**T − 1 unions of whole tenants (each listed once per repeat), so the tenants' game is measured exactly."""
    tenant_roles: tuple[str, ...] = ()
    """Per tenant, its `TenantRole`."""

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
        key = f"sampled{self.index}:{self.kind}:{lengths}" + (f"|{shared}" if shared else "")
        if self.prefix_groups:
            key += "|g" + ",".join(map(str, self.prefix_groups))
        if self.pool_index:
            key += "|pool" + ",".join(map(str, self.pool_index))
        if self.tenants:
            key += "|t" + ",".join(map(str, self.tenants))
        if self.coalitions:
            key = "coalitions-" + key
        return key

    def pool_members(self, members: list[int]) -> list[int]:
        """Positions in the held pool of the batch's ``members`` (the members themselves without a pool)."""
        return [self.pool_index[i] for i in members] if self.pool_index else list(members)

    @property
    def design(self) -> str:
        return Design.COALITIONS.value if self.coalitions else Design.PREFIXES.value

    @property
    def groups(self) -> tuple[int, ...]:
        """Per request, its prefix group (−1: own context)."""
        if self.prefix_groups:
            return self.prefix_groups
        return tuple(0 if p else -1 for p in self.shared_prefix_tokens)

    def subsets(self, round_: int = 0) -> list[int]:
        """Every distinct non-empty subset measured in ``round_``, the full batch included (round 0)."""
        if self.coalitions:
            return list(self.coalitions) if round_ == 0 else list(self.replicated)
        return subsets_to_measure(np.array(self.orders, dtype=np.int64))

    def chunks(self, round_: int = 0) -> list[list[int]]:
        """The batch-rounds the coalitions of ``round_`` are measured in (complementary pairs kept together)."""
        masks = self.subsets(round_)
        size = max(2, self.chunk)
        return [masks[i : i + size] for i in range(0, len(masks), size)]


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
    if SampledKind.MIXED_SHARING_DECODE in kinds:
        raise LlmvisorError("mixed-sharing decode batches are measured on coalitions only (--design coalitions)")
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


def draw_prefix_groups(size: int, rng: np.random.Generator, *, exact: bool = False) -> list[int]:
    """Per request, its prefix group (−1: own context): 2–3 groups of different sizes and at least one request of its
    own (a serving-size batch: 3 groups of about 30%, 20% and 10% of it when it has 16 or more; an exact one: groups of
    3 and 2), shuffled."""
    if exact or size < 16:
        if size < 6:
            raise LlmvisorError(f"a mixed-sharing batch needs at least 6 requests (got {size})")
        sizes = [3, 2]
    else:
        sizes = [max(4, round(0.3 * size)), max(3, round(0.2 * size)), max(2, round(0.1 * size))]
    groups = [g for g, count in enumerate(sizes) for _ in range(count)]
    groups += [-1] * (size - len(groups))
    return [int(g) for g in rng.permutation(groups)]


class SharingLayout(StrEnum):
    """How the readers of a serving-size mixed-sharing batch are laid out over its shared documents."""

    GROUPS = "groups"
    """2–3 prefix groups of about 30%, 20% and 10% of the batch (`draw_prefix_groups`), own parts drawn from the mix."""
    PAIRS = "pairs"
    """Documents read in pairs (3 of every 16 requests), each by one short question (16–64 own tokens) and one long
    continuation (half to all of the model length the document leaves), the rest own contexts from the mix: the
    readers of one document differ most, so rules that split a document by position or by context length bill them
    unlike the equal split, and the sharing check can tell them apart."""


SHORT_QUESTION_TOKENS = (16, 64)
"""Own tokens of a pair's short reader (a question about the shared document)."""


def draw_reader_pairs(size: int, rng: np.random.Generator) -> list[int]:
    """Per request, its document (−1: own context) in the `SharingLayout.PAIRS` layout, shuffled."""
    n_pairs = max(1, round(3 * size / 16))
    if 2 * n_pairs >= size:
        raise LlmvisorError(f"a mixed-sharing batch in pairs needs at least {2 * n_pairs + 1} requests (got {size})")
    groups = [g for g in range(n_pairs) for _ in range(2)] + [-1] * (size - 2 * n_pairs)
    return [int(g) for g in rng.permutation(groups)]


def complementary_masks(n: int, m: int, rng: np.random.Generator) -> list[int]:
    """The full batch and (m − 1) // 2 distinct complementary pairs (S, B∖S), each request in S with probability ½."""
    full = (1 << n) - 1
    k = min((m - 1) // 2, (1 << (n - 1)) - 1)
    pairs: list[int] = []
    seen: set[int] = set()
    while len(pairs) < k:
        bits = rng.random(n) < 0.5
        s = int(sum(1 << i for i in range(n) if bits[i]))
        if 0 < s < full and min(s, full ^ s) not in seen:
            seen.add(min(s, full ^ s))
            pairs.append(s)
    return [full] + [c for p in pairs for c in (p, full ^ p)]


def draw_coalition_batches(
    mixes: list[LengthMix],
    envelope: Envelope,
    *,
    n_batches: int,
    coalitions_per_request: float = 4.0,
    sizes: tuple[int, ...] = SAMPLED_SIZES,
    kinds: tuple[str, ...] = (SampledKind.DECODE, SampledKind.SHARED_PREFIX_DECODE, SampledKind.MIXED_SHARING_DECODE),
    replicate_share: float = 0.25,
    exact_sharing_batches: int = 0,
    exact_sharing_sizes: tuple[int, ...] = (6, 7),
    chunk: int = 32,
    decode_headroom: int = 256,
    pools: int = 0,
    pool_coalitions_per_request: float | None = None,
    pool_chunk: int | None = None,
    sharing_layout: str = SharingLayout.GROUPS,
    seed: int = 0,
) -> list[SampledBatchSpec]:
    """Serving-size batches measured on random complementary coalitions (``coalitions_per_request`` × n + 1 of them,
    the full batch included), lengths as `draw_sampled_batches`; kinds and sizes cycle. Every batch measures the
    first ``replicate_share`` of its coalitions (whole chunks' worth, pairs together) again in round 1, so each size and
    kind has its replicate noise. Mixed-sharing decode batches hold 2–3 prefix groups (`draw_prefix_groups`), each
    group's prefix 0.1–0.3 of the model's length, different per group. ``exact_sharing_batches`` more mixed-sharing
    batches of ``exact_sharing_sizes`` (cycled) measure every subset, twice: their Shapley values are exact.
    ``pool_chunk`` (default ``chunk``): coalitions per batch-round of the pools' batches; a longer round spends one
    preparation of the held contexts on more steps, and each context grows by the steps it runs in the round.
    ``sharing_layout`` (`SharingLayout`) lays out the serving-size mixed-sharing batches' readers (the exact ones keep
    their groups of 3 and 2)."""
    if sharing_layout not in tuple(SharingLayout):
        raise LlmvisorError(f"--sharing-layout: {sharing_layout!r} is not one of {', '.join(SharingLayout)}")
    if sharing_layout == SharingLayout.PAIRS and pools:  # a pool's smaller batches keep groups of 2 or more readers
        raise LlmvisorError("--sharing-layout pairs: not with --pools")
    if n_batches < 0 or exact_sharing_batches < 0:
        raise LlmvisorError("--sampled-batches / --exact-sharing-batches: 0 or more")
    if coalitions_per_request < 1:
        raise LlmvisorError(f"--coalitions-per-request: at least 1 (got {coalitions_per_request})")
    if pool_chunk is not None and pool_chunk < 2:
        raise LlmvisorError(f"--pool-chunk: at least 2 (got {pool_chunk})")
    if not 0 <= replicate_share <= 1:
        raise LlmvisorError(f"--replicate-share: in [0, 1] (got {replicate_share})")
    too_big = [s for s in (*sizes, *exact_sharing_sizes) if s > envelope.max_num_seqs]
    if too_big or min(sizes, default=2) < 2:
        raise LlmvisorError(f"batch sizes must be 2 to max_num_seqs {envelope.max_num_seqs} (got {list(sizes)})")
    base = draw_sampled_batches(mixes, envelope, n_batches=max(1, n_batches), n_orders=2, sizes=sizes,
                                kinds=tuple(SampledKind.SHARED_PREFIX_DECODE if k == SampledKind.MIXED_SHARING_DECODE else k for k in kinds),
                                decode_headroom=decode_headroom, seed=seed)[:n_batches]
    rng = np.random.default_rng([seed, 1964])
    max_context = envelope.max_model_len - decode_headroom
    out = []

    def sharing_batch(index: int, template: SampledBatchSpec | None, size: int, exact: bool, rng=rng) -> SampledBatchSpec:
        pairs = sharing_layout == SharingLayout.PAIRS and not exact
        groups = draw_reader_pairs(size, rng) if pairs else draw_prefix_groups(size, rng, exact=exact)
        n_groups = max(groups) + 1
        prefixes = [int(max_context * f) for f in rng.permutation(np.linspace(0.1, 0.3, n_groups))]
        mix = mixes[index % len(mixes)]
        scale = min(1.0, max_context / float(np.percentile(mix.prompt_tokens + mix.output_tokens, 99)))
        rows = rng.integers(0, mix.prompt_tokens.size, size)
        raw = (mix.prompt_tokens[rows] + np.floor(rng.random(size) * (mix.output_tokens[rows] + 1))) * scale
        shared = np.array([prefixes[g] if g >= 0 else 0 for g in groups])
        own = np.clip(np.rint(raw * (max_context - shared) / max_context), 1, max_context - shared).astype(int)
        if pairs:  # in each pair, one short question and one long continuation, in random order
            for g in range(n_groups):
                short, long = rng.permutation(np.flatnonzero(np.array(groups) == g))
                own[short] = rng.integers(SHORT_QUESTION_TOKENS[0], SHORT_QUESTION_TOKENS[1] + 1)
                left = max_context - prefixes[g]
                own[long] = int(rng.integers(left // 2, left + 1))
        context = shared + own
        masks = list(range((1 << size) - 1, 0, -1)) if exact else complementary_masks(size, int(coalitions_per_request * size) + 1, rng)
        return SampledBatchSpec(
            index=index, kind=SampledKind.MIXED_SHARING_DECODE.value, source=mix.name if template is None else template.source,
            num_new_tokens=(1,) * size, num_context_tokens=tuple(int(v) for v in context), is_prefill=(False,) * size,
            shared_prefix_tokens=tuple(int(v) for v in shared), orders=(), antithetic=False, rounds=2 if exact or replicate_share else 1,
            prefix_groups=tuple(groups), coalitions=tuple(masks), replicated=tuple(masks) if exact else (), chunk=chunk,
        )

    for index, template in enumerate(base):
        kind = SampledKind(kinds[index % len(kinds)])
        if kind == SampledKind.MIXED_SHARING_DECODE:
            batch = sharing_batch(index, template, template.size, exact=False)
        else:
            masks = complementary_masks(template.size, int(coalitions_per_request * template.size) + 1, rng)
            batch = SampledBatchSpec(**{**template.__dict__, "orders": (), "antithetic": False, "coalitions": tuple(masks),
                                        "chunk": chunk})
        n_rep = int(round(replicate_share * len(batch.coalitions) / 2)) * 2
        replicated = batch.replicated or tuple(batch.coalitions[1 : 1 + n_rep])
        out.append(SampledBatchSpec(**{**batch.__dict__, "replicated": replicated, "rounds": 2 if replicated else 1}))
    exact = [sharing_batch(n_batches + j, None, exact_sharing_sizes[j % len(exact_sharing_sizes)], exact=True)
             for j in range(exact_sharing_batches)]
    pooled = draw_coalition_pools(mixes, envelope, n_pools=pools, first_index=n_batches + exact_sharing_batches,
                                  coalitions_per_request=pool_coalitions_per_request or coalitions_per_request, sizes=sizes,
                                  kinds=kinds, replicate_share=replicate_share, chunk=pool_chunk or chunk,
                                  decode_headroom=decode_headroom, seed=seed, sharing_batch=sharing_batch) if pools else []
    return exact + out + pooled  # the exact ones first: cheap, and what the sharing check needs


def _with_replicates(batch: SampledBatchSpec, replicate_share: float) -> SampledBatchSpec:
    n_rep = int(round(replicate_share * len(batch.coalitions) / 2)) * 2
    replicated = tuple(batch.coalitions[1 : 1 + n_rep])
    return SampledBatchSpec(**{**batch.__dict__, "replicated": replicated, "rounds": 2 if replicated else 1})


def pool_subset(n: int, groups: list[int], size: int, rng: np.random.Generator) -> list[int]:
    """``size`` of a pool's ``n`` positions, ascending: at random, or (a pool in prefix ``groups``) stratified by group,
    each group at least 2 readers (so its blocks can be shared) and at least one request of its own context kept."""
    if not groups or all(g < 0 for g in groups):
        return sorted(int(i) for i in rng.choice(n, size, replace=False))
    arr = np.array(groups)
    counts = {g: max(2, int(round(size * int((arr == g).sum()) / n))) for g in sorted(set(groups) - {-1})}
    while sum(counts.values()) > size - 1:
        counts[max(counts, key=lambda g: counts[g])] -= 1
    counts[-1] = size - sum(counts.values())
    picked = [int(i) for g, k in counts.items() for i in rng.choice(np.flatnonzero(arr == g), k, replace=False)]
    return sorted(picked)


def draw_coalition_pools(
    mixes: list[LengthMix],
    envelope: Envelope,
    *,
    n_pools: int,
    first_index: int,
    coalitions_per_request: float,
    sizes: tuple[int, ...],
    kinds: tuple[str, ...],
    replicate_share: float,
    chunk: int,
    decode_headroom: int,
    seed: int,
    sharing_batch,
) -> list[SampledBatchSpec]:
    """Pools of serving-size batches that share one prefill: a pool is a batch of the largest size (kinds cycle, lengths
    drawn as `draw_sampled_batches`' or, mixed sharing, `draw_coalition_batches`'), then max ÷ s batches of each
    smaller size s, each a random subset of the pool's requests (stratified by prefix group). The pool's contexts are
    prefilled once and held while all of its batches are measured: a held request runs only in the steps that name it,
    so each batch is a game of its own requests, at a fraction of the prefill. Batches of one pool share requests
    (their estimates' noise is independent: every step is measured afresh). Drawn from streams of their own, so adding
    pools leaves every other batch of the plan as it was."""
    largest = max(sizes)
    rng = np.random.default_rng([seed, 1964, 7])
    templates = draw_sampled_batches(
        mixes, envelope, n_batches=n_pools, n_orders=2, sizes=(largest,),
        kinds=tuple(SampledKind.SHARED_PREFIX_DECODE if k == SampledKind.MIXED_SHARING_DECODE else k for k in kinds),
        decode_headroom=decode_headroom, seed=[seed, 1964, 8])
    out: list[SampledBatchSpec] = []
    index = first_index
    for j, template in enumerate(templates):
        kind = SampledKind(kinds[j % len(kinds)])
        if kind == SampledKind.MIXED_SHARING_DECODE:
            pool = sharing_batch(index, template, largest, exact=False, rng=rng)
        else:
            pool = SampledBatchSpec(**{**template.__dict__, "index": index, "orders": (), "antithetic": False, "chunk": chunk})
        pool_fields = {"pool_context_tokens": pool.num_context_tokens, "pool_shared_prefix_tokens": pool.shared_prefix_tokens,
                       "pool_groups": pool.prefix_groups}
        masks = complementary_masks(largest, int(coalitions_per_request * largest) + 1, rng)
        out.append(_with_replicates(SampledBatchSpec(**{**pool.__dict__, "coalitions": tuple(masks), "chunk": chunk,
                                                        "pool_index": tuple(range(largest)), **pool_fields}), replicate_share))
        index += 1
        for size in sorted((s for s in set(sizes) if s < largest), reverse=True):
            for _ in range(largest // size):
                picked = pool_subset(largest, list(pool.prefix_groups), size, rng)
                masks = complementary_masks(size, int(coalitions_per_request * size) + 1, rng)
                sub = SampledBatchSpec(
                    index=index, kind=pool.kind, source=pool.source, num_new_tokens=(1,) * size,
                    num_context_tokens=tuple(pool.num_context_tokens[i] for i in picked), is_prefill=(False,) * size,
                    shared_prefix_tokens=tuple(pool.shared_prefix_tokens[i] for i in picked), orders=(), antithetic=False,
                    prefix_groups=tuple(pool.prefix_groups[i] for i in picked) if pool.prefix_groups else (),
                    coalitions=tuple(masks), chunk=chunk, pool_index=tuple(picked), **pool_fields)
                out.append(_with_replicates(sub, replicate_share))
                index += 1
    return out


def sampled_run_budget_s(batches: list[SampledBatchSpec], step_s, *, repeat: int) -> float:
    """Seconds of controlled steps a sampled plan needs: Σ over its distinct subsets of ``step_s(batch, subset)`` × repeat.

    Warm-up, canaries and re-preparing decode contexts come on top; ``step_s`` is a step-time estimate (a fitted
    latency model, or the journal's measured times).
    """
    return repeat * sum(step_s(b, s) for b in batches for r in range(b.rounds) for s in b.subsets(r))


def sampled_plan(mixes: list[LengthMix], envelope: Envelope, sampled: dict, *, seed: int) -> list[SampledBatchSpec]:
    """The serving-size batches a result's ``settings.sampled`` describes (either design), drawn again."""
    kinds, sizes = tuple(sampled["kinds"]), tuple(sampled["sizes"])
    if sampled.get("design", Design.PREFIXES) == Design.COALITIONS:
        return draw_coalition_batches(
            mixes, envelope, n_batches=sampled["batches"], coalitions_per_request=sampled["coalitions_per_request"], sizes=sizes,
            kinds=kinds, replicate_share=sampled["replicate_share"], exact_sharing_batches=sampled.get("exact_sharing_batches", 0),
            exact_sharing_sizes=tuple(sampled.get("exact_sharing_sizes", (6, 7))), chunk=sampled.get("chunk", 32),
            pools=sampled.get("pools", 0), pool_coalitions_per_request=sampled.get("pool_coalitions_per_request"),
            pool_chunk=sampled.get("pool_chunk"), sharing_layout=sampled.get("sharing_layout", SharingLayout.GROUPS), seed=seed)
    return draw_sampled_batches(mixes, envelope, n_batches=sampled["batches"], n_orders=sampled["orders"], sizes=sizes, kinds=kinds,
                                antithetic=sampled.get("antithetic", True), seed=seed)


class TenantRole(StrEnum):
    """What a tenant of a tenants-design batch stands for: the unequal tenants a platform bills side by side."""

    HEAVY = "heavy"
    """Most of the batch (half or more: three quarters beside one other tenant), lengths as the mix draws them."""
    LIGHT = "light"
    """An eighth of the batch (one request at least), with short requests (a quarter of the mix's)."""
    SHARING = "sharing"
    """A quarter of the batch, every request reading one shared document (a prefix group): decode batches only."""
    MEDIUM = "medium"
    """The rest, lengths as the mix draws them."""


TENANT_COUNTS = (2, 3, 4)
TENANT_PHASES = (Phase.DECODE.value, Phase.PREFILL.value)
TENANT_LENGTH_FACTOR = {TenantRole.HEAVY: 1.0, TenantRole.LIGHT: 0.25, TenantRole.SHARING: 1.0, TenantRole.MEDIUM: 1.0}


def tenant_roles(count: int, phase: str) -> tuple[str, ...]:
    """The roles of ``count`` tenants (2 to 4): heavy and light, then one sharing a document (a medium one in prefill
    batches, where a shared document is a prefix-cache hit rather than shared KV), then a medium one."""
    if count not in TENANT_COUNTS:
        raise LlmvisorError(f"tenants per batch: one of {', '.join(map(str, TENANT_COUNTS))} (got {count})")
    third = TenantRole.SHARING if phase == Phase.DECODE else TenantRole.MEDIUM
    return tuple(r.value for r in (TenantRole.HEAVY, TenantRole.LIGHT, third, TenantRole.MEDIUM)[:count])


def tenant_request_counts(size: int, roles: tuple[str, ...]) -> list[int]:
    """Requests per tenant: light an eighth (≥ 1), sharing a quarter (≥ 2), medium an eighth (≥ 1), heavy the rest
    (half the batch or more)."""
    share = {TenantRole.LIGHT: 1 / 8, TenantRole.SHARING: 1 / 4, TenantRole.MEDIUM: 1 / 8}
    least = {TenantRole.LIGHT: 1, TenantRole.SHARING: 2, TenantRole.MEDIUM: 1}
    counts = [0 if r == TenantRole.HEAVY else max(least[r], round(share[r] * size)) for r in roles]
    counts[roles.index(TenantRole.HEAVY)] = size - sum(counts)
    if min(counts) < 1 or counts[roles.index(TenantRole.HEAVY)] < size / 2:
        raise LlmvisorError(f"a batch of {size} requests is too small for tenants {', '.join(roles)}")
    return counts


def tenant_coalition_masks(tenants: tuple[int, ...] | list[int]) -> list[int]:
    """Request-level bit mask of each non-empty coalition of tenants, the full batch first (tenant masks 2**T − 1 … 1):
    a coalition of tenants is all their requests together."""
    count = max(tenants) + 1
    of = [sum(1 << i for i, t in enumerate(tenants) if t == k) for k in range(count)]
    return [sum(of[k] for k in range(count) if c >> k & 1) for c in range((1 << count) - 1, 0, -1)]


def draw_tenant_batches(
    mixes: list[LengthMix],
    envelope: Envelope,
    *,
    n_batches: int,
    sizes: tuple[int, ...] = SAMPLED_SIZES,
    tenant_counts: tuple[int, ...] = TENANT_COUNTS,
    phases: tuple[str, ...] = TENANT_PHASES,
    repeat: int = 6,
    rounds: int = 2,
    decode_headroom: int = 256,
    max_prefill_tokens: int | None = None,
    seed: int = 0,
) -> list[SampledBatchSpec]:
    """Serving-size batches of 2–4 unequal tenants (`TenantRole`) whose tenants' game is measured exactly: every one of
    the 2**T − 1 coalitions of tenants (all their requests together) ``repeat`` times in one batch-round, and the whole
    again in each of ``rounds`` independent rounds (decode contexts prepared afresh), so a tenant's measured Shapley
    value has an interval from the repeats. Sizes cycle fastest, then tenant counts, then phases; lengths from the
    real mixes as `draw_batches` scales them (decode: contexts P + U·O; prefill: whole prompts, a batch over the step
    budget scaled down as a whole), times the role's factor. The sharing tenant's requests share one document of
    0.1–0.3 of the model's length (a prefix group: a mixed-sharing decode batch)."""
    if n_batches < 0:
        raise LlmvisorError(f"--tenant-batches: 0 or more (got {n_batches})")
    if repeat < 1 or rounds < 1:
        raise LlmvisorError(f"--tenant-repeat and rounds: at least 1 (got {repeat}, {rounds})")
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise LlmvisorError(f"tenant phases: {', '.join(PHASES)} (got {list(phases)})")
    too_big = [s for s in sizes if s > envelope.max_num_seqs or s < 2 * max(tenant_counts)]
    if too_big:
        raise LlmvisorError(f"tenant batch sizes must be {2 * max(tenant_counts)} to max_num_seqs {envelope.max_num_seqs} (got {too_big})")
    max_context = envelope.max_model_len - decode_headroom
    if repeat * (1 << (max(tenant_counts) - 1)) + 16 > decode_headroom:
        raise LlmvisorError(f"--tenant-repeat {repeat}: a request of {max(tenant_counts)} tenants runs in {repeat * (1 << (max(tenant_counts) - 1))} "
                            f"steps per round, beyond the {decode_headroom} tokens of decode headroom")
    budget = min(int(max_prefill_tokens or envelope.max_num_batched_tokens), envelope.max_num_batched_tokens, envelope.max_model_len - 1)
    rng = np.random.default_rng([seed, 39])
    out = []
    for index in range(n_batches):
        size = sizes[index % len(sizes)]
        count = tenant_counts[(index // len(sizes)) % len(tenant_counts)]
        phase = phases[(index // (len(sizes) * len(tenant_counts))) % len(phases)]
        mix = mixes[index % len(mixes)]
        roles = tenant_roles(count, phase)
        tenants = np.array([t for t, k in enumerate(tenant_request_counts(size, roles)) for _ in range(k)])
        tenants = rng.permutation(tenants)
        factor = np.array([TENANT_LENGTH_FACTOR[TenantRole(roles[t])] for t in tenants])
        rows = rng.integers(0, mix.prompt_tokens.size, size)
        groups = np.full(size, -1)
        shared = np.zeros(size, dtype=int)
        if phase == Phase.DECODE:
            scale = min(1.0, max_context / float(np.percentile(mix.prompt_tokens + mix.output_tokens, 99)))
            raw = (mix.prompt_tokens[rows] + np.floor(rng.random(size) * (mix.output_tokens[rows] + 1))) * scale * factor
            if TenantRole.SHARING in roles:
                reader = tenants == roles.index(TenantRole.SHARING)
                groups[reader] = 0
                shared[reader] = int(max_context * rng.uniform(0.1, 0.3))
            own = np.clip(np.rint(raw * (max_context - shared) / max_context), 1, max_context - shared).astype(int)
            context, new, prefill = shared + own, np.ones(size, dtype=int), np.zeros(size, dtype=bool)
        else:
            scale = min(1.0, budget / float(np.percentile(mix.prompt_tokens, 99)))
            prompt = np.clip(np.rint(mix.prompt_tokens[rows] * scale * factor), 1, budget).astype(int)
            if prompt.sum() > budget:
                prompt = np.maximum(1, np.floor(prompt * budget / prompt.sum())).astype(int)
            new, context, prefill = prompt, np.zeros(size, dtype=int), np.ones(size, dtype=bool)
        masks = tuple(tenant_coalition_masks(tenants.tolist())) * repeat
        sharing = bool(groups.max() >= 0)
        out.append(SampledBatchSpec(
            index=index, kind=(SampledKind.MIXED_SHARING_DECODE if sharing else SampledKind(phase)).value, source=mix.name,
            num_new_tokens=tuple(int(v) for v in new), num_context_tokens=tuple(int(v) for v in context),
            is_prefill=tuple(bool(v) for v in prefill), shared_prefix_tokens=tuple(int(v) for v in shared), orders=(),
            antithetic=False, rounds=rounds, prefix_groups=tuple(int(g) for g in groups) if sharing else (),
            coalitions=masks, replicated=masks if rounds > 1 else (), chunk=len(masks),
            tenants=tuple(int(t) for t in tenants), tenant_roles=roles))
    return out


def tenant_plan(mixes: list[LengthMix], envelope: Envelope, tenants: dict, *, seed: int) -> list[SampledBatchSpec]:
    """The tenant batches a result's ``settings.tenants`` describes, drawn again."""
    return draw_tenant_batches(mixes, envelope, n_batches=tenants["batches"], sizes=tuple(tenants["sizes"]),
                               tenant_counts=tuple(tenants["tenant_counts"]), phases=tuple(tenants["phases"]),
                               repeat=tenants["repeat"], rounds=tenants["rounds"], max_prefill_tokens=tenants.get("max_prefill_tokens"),
                               seed=seed)
