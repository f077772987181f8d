"""What a profiling run asks the engine to do: sweep episodes over the envelope, or a real request mix.

Sweep design. A fitted step-cost model must interpolate, so the sweep spreads its steps over the engine's
envelope: batch size up to ``max_num_seqs``, prompt and context lengths up to ``max_model_len``, per-step
token budget up to ``max_num_batched_tokens``, and pure prefill, pure decode and mixed steps. It does so with
episodes, each one point of a Latin hypercube (``scipy.stats.qmc``, optimized for centered discrepancy) in
five dimensions:

1. pool size n (1..max_num_seqs): requests submitted together;
2. longest prompt L (1..max_model_len - 1): the pool's prompts are L and n - 1 draws uniform on 1..L;
3. step token budget (log-uniform, 32..max_num_batched_tokens): caps the tokens of every step of the
   episode, so prefill chunks and mixed steps of every size occur;
4. decode steps K (2..max_decode_steps): after the pool's prefill, K steps in which the driver's scheduler
   runs a random subset of the pool's decoding requests (1..all), so decode batches of every size occur at
   contexts spread over 1..L;
5. second wave (0..min(n/2, max_num_seqs - n) requests, same prompt distribution): added halfway through the decode steps, so
   their prefill chunks share steps with the chosen decodes (mixed steps).

Shared prompt prefixes. With prefix caching (vLLM's default), requests whose prompts start alike hold the
same KV blocks, and a step's cost may depend on how much of its context is shared. So that a sharing term
is identifiable, episodes take turns (by index) at three kinds: ``none`` (random prompts, nothing shared);
``document`` (k requests over one long document: every prompt starts with the same 50-95% of the longest
prompt, which is at least a quarter of max_model_len, followed by its own question); ``system`` (a short
system prompt of 1 to 4 whole KV blocks, at most half the longest prompt, none when that is under a block, shared by a pool of at least a quarter
of max_num_seqs). The wave's prompts start with the episode's prefix too. ``shared_prefix_len`` is the
prefix's length in tokens; the driver draws its tokens per episode and repeat, so repeats neither hit
blocks cached by the previous repeat nor differ in composition.

The pool prefills under the budget first (pure prefill steps, then mixed ones as early requests start to
decode); requests still running when the episode ends are aborted. Episodes are deterministic given their
seed, so ``--repeat`` re-runs steps of identical composition. Pools are shrunk to fit the KV cache so no
request is preempted (a preemption would recompute, blurring context lengths), and to at most
``max_episode_tokens`` prompt tokens so no episode takes much longer than the rest. While prompts are
prefilled, each step runs a random number (0 up to half the budget) of the decoding requests.

LoRA plan. The same episodes, each request given one of the plan's adapters or the base model (`lora_episodes`): k of
the adapters per episode (0 to all of them) and a base-model share, so steps hold 1 up to ``--max-loras`` distinct
adapters beside base-model slices, and adapters are swapped in and out of the slots when there are more of them than
slots. The adapters are written locally with random weights (`llmvisor.profile.adapters`). While it runs, the driver
turns a third of the steps whose running requests all decode, on adapters and on the base model, into base-model decode
steps (`llmvisor.engines.vllm.driver.BASE_ONLY_DECODE_SHARE`): what tells the per-request decode price from the LoRA
path's.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from llmvisor import shipped
from llmvisor.core.workloads import DEFAULT_BLOCK_SIZE, Envelope, WorkloadRow, read_workload_csv
from llmvisor.errors import LlmvisorError

SWEEP_DIMENSIONS = ("pool_size", "longest_prompt", "token_budget", "decode_steps", "second_wave")
SHARING_KINDS = ("none", "document", "system")
MAX_SYSTEM_PROMPT_BLOCKS = 4
MIN_TOKEN_BUDGET = 32
MIN_DECODE_STEPS = 2
LENGTH_RULES = ("clip", "scale")
BASE_MODEL = -1
"""`Episode.lora_adapters` entry of a request that runs the base model (no adapter)."""
MAX_BASE_SHARE = 0.6
ARRIVALS = ("closed", "trace")


@dataclass(frozen=True)
class Episode:
    index: int
    seed: int
    prompt_lens: tuple[int, ...]
    token_budget: int
    num_decode_steps: int
    wave_prompt_lens: tuple[int, ...]
    sharing: str = "none"
    """One of `SHARING_KINDS`."""
    shared_prefix_len: int = 0
    """Tokens every prompt of the episode starts with (the same tokens)."""
    lora_adapters: tuple[int, ...] = ()
    """LoRA plan: each request's adapter (pool, then wave), an index into the plan's adapters, `BASE_MODEL` for the
    base model; empty: every request runs the base model."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens) + sum(self.wave_prompt_lens)


def sweep_episodes(
    envelope: Envelope,
    num_points: int,
    *,
    seed: int = 0,
    max_decode_steps: int = 24,
    max_episode_tokens: int = 65536,
) -> list[Episode]:
    """`num_points` space-filling episodes over the envelope (see the module docstring)."""
    from scipy.stats import qmc

    if num_points < 1:
        raise LlmvisorError(f"--points: need at least 1 sweep point (got {num_points})")
    design = qmc.LatinHypercube(d=len(SWEEP_DIMENSIONS), optimization="random-cd", seed=seed).random(num_points)
    max_prompt = envelope.max_model_len - 1
    max_decode_steps = max(MIN_DECODE_STEPS, max_decode_steps)
    low_budget = min(MIN_TOKEN_BUDGET, envelope.max_num_batched_tokens)
    episodes = []
    for index, point in enumerate(design):
        rng = np.random.default_rng([seed, index])
        sharing = SHARING_KINDS[index % len(SHARING_KINDS)]
        pool_size = 1 + min(int(point[0] * envelope.max_num_seqs), envelope.max_num_seqs - 1)
        longest = 1 + min(int(point[1] * max_prompt), max_prompt - 1)
        if sharing == "system":
            pool_size = max(pool_size, min(envelope.max_num_seqs, max(2, envelope.max_num_seqs // 4)))
        elif sharing == "document":
            longest = max(longest, max_prompt // 4)
        budget = int(round(math.exp(math.log(low_budget) + point[2] * math.log(envelope.max_num_batched_tokens / low_budget))))
        decode_steps = MIN_DECODE_STEPS + min(int(point[3] * (max_decode_steps - MIN_DECODE_STEPS + 1)), max_decode_steps - MIN_DECODE_STEPS)
        wave_size = min(int(point[4] * (pool_size // 2 + 1)), pool_size // 2, envelope.max_num_seqs - pool_size)
        pool = [longest] + rng.integers(1, longest + 1, pool_size - 1).tolist()
        wave = rng.integers(1, longest + 1, wave_size).tolist()
        shared_prefix_len = _shared_prefix_len(sharing, longest, envelope.block_size or DEFAULT_BLOCK_SIZE, rng)
        if shared_prefix_len:
            pool = [longest] + [shared_prefix_len + int(n) for n in rng.integers(1, longest - shared_prefix_len + 1, pool_size - 1)]
            wave = [shared_prefix_len + int(n) for n in rng.integers(1, longest - shared_prefix_len + 1, wave_size)]
        pool, wave = _fit_kv_cache(pool, wave, envelope, decode_steps)
        while len(pool) > 1 and sum(pool) + sum(wave) > max_episode_tokens:
            (wave if wave else pool).pop()
        episodes.append(
            Episode(
                index=index,
                seed=int(rng.integers(0, 2**31 - 1)),
                prompt_lens=tuple(int(x) for x in pool),
                token_budget=max(1, min(budget, envelope.max_num_batched_tokens)),
                num_decode_steps=decode_steps,
                wave_prompt_lens=tuple(int(x) for x in wave),
                sharing=sharing,
                shared_prefix_len=shared_prefix_len,
            )
        )
    return episodes


def lora_episodes(episodes: list[Episode], num_adapters: int, *, seed: int = 0) -> list[Episode]:
    """The LoRA plan: the sweep's episodes, each request given an adapter or the base model.

    Episode by episode (its own random stream from ``seed`` and its index), k distinct adapters are drawn, k uniform
    on 0..``num_adapters`` (k = 0: a base-model episode), and a base-model share uniform on 0..`MAX_BASE_SHARE`; each
    request runs the base model with that probability, else the next of the k adapters in a shuffled round-robin, so
    every one of them runs when the episode has requests enough. Steps then hold 1 up to ``--max-loras`` distinct
    adapters (vLLM's scheduler holds back a request whose adapter finds no free slot) beside base-model slices, and
    an episode with more adapters than slots, or the next episode's other adapters, force swaps: slot loads, and disk
    reads once more adapters than ``max_cpu_loras`` (vLLM's default: ``max_loras``) have run."""
    if num_adapters < 1:
        raise LlmvisorError(f"LoRA plan: need at least 1 adapter (got {num_adapters})")
    out = []
    for episode in episodes:
        rng = np.random.default_rng([seed, 3, episode.index])
        n_requests = len(episode.prompt_lens) + len(episode.wave_prompt_lens)
        k = int(rng.integers(0, num_adapters + 1))
        chosen = rng.permutation(num_adapters)[:k].tolist()
        base_share = float(rng.uniform(0, MAX_BASE_SHARE)) if k else 1.0
        adapters, turn = [], 0
        for _ in range(n_requests):
            if not chosen or rng.random() < base_share:
                adapters.append(BASE_MODEL)
            else:
                adapters.append(int(chosen[turn % k]))
                turn += 1
        out.append(replace(episode, lora_adapters=tuple(adapters)))
    return out


def _shared_prefix_len(sharing: str, longest: int, block_size: int, rng: np.random.Generator) -> int:
    """Tokens of the prefix every prompt starts with; each prompt keeps at least one token of its own."""
    if sharing == "document":
        return min(int(round(longest * rng.uniform(0.5, 0.95))), longest - 1)
    if sharing == "system":
        blocks = int(rng.integers(1, MAX_SYSTEM_PROMPT_BLOCKS + 1))
        return min(blocks, longest // 2 // block_size) * block_size
    return 0


def _fit_kv_cache(pool: list[int], wave: list[int], envelope: Envelope, decode_steps: int) -> tuple[list, list]:
    """Drop the last requests until every request's whole context fits in the KV cache at once."""
    if envelope.kv_cache_tokens is None:
        return pool, wave
    margin = decode_steps + 2 * envelope.max_num_batched_tokens // max(1, envelope.max_num_seqs) + 256

    def need(lengths):
        return sum(length + margin for length in lengths)

    while wave and need(pool + wave) > envelope.kv_cache_tokens:
        wave = wave[:-1]
    while len(pool) > 1 and need(pool) > envelope.kv_cache_tokens:
        pool = pool[:-1]
    return pool, wave


# ---------------------------------------------------------------------------------------------------------
# Workload replay


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    tenant: str
    prompt_len: int
    output_len: int
    arrival_s: float | None
    source: str
    document: int | None = None
    """Shared document whose tokens the prompt starts with (None: the prompt shares nothing on purpose)."""
    document_tokens: int = 0
    """Tokens of that document at the start of the prompt (part of ``prompt_len``)."""


@dataclass
class WorkloadPlan:
    requests: list[WorkloadRequest]
    metadata: dict = field(default_factory=dict)


def workload_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def build_workload(
    paths: list[str],
    envelope: Envelope,
    *,
    num_requests: int,
    start_row: int = 0,
    length_rule: str = "clip",
    tenants: int = 1,
    arrival: str = "closed",
    time_scale: float = 1.0,
    shared_documents: int = 0,
    document_tokens: int = 0,
) -> WorkloadPlan:
    """Turn one or more workload CSVs into the requests to replay, with the rules stated in metadata.

    Rows: ``num_requests`` per file, consecutive from ``start_row``. Several files are interleaved
    round-robin (closed loop) or merged by arrival time (trace arrivals), one tenant per file, named after
    the file. A single file gets ``tenants`` tenants, ``<name>-t<k>`` assigned round-robin (or the file's
    name when ``tenants`` is 1).

    With ``shared_documents`` K > 0, request k's prompt starts with document k mod K, ``document_tokens``
    tokens shared by every request on that document (retrieval over a few documents, a long system prompt),
    followed by the row's own prompt; the total is clipped like any prompt, the document keeping at most all
    but one of its tokens. With prefix caching those requests read the same KV blocks.
    """
    if not paths:
        raise LlmvisorError("--workload: give at least one workload CSV")
    if length_rule not in LENGTH_RULES:
        raise LlmvisorError(f"--lengths: unknown rule {length_rule!r}; expected one of {', '.join(LENGTH_RULES)}")
    if arrival not in ARRIVALS:
        raise LlmvisorError(f"--arrival: unknown arrival process {arrival!r}; expected one of {', '.join(ARRIVALS)}")
    if num_requests < 1:
        raise LlmvisorError(f"--num-requests: need at least 1 request (got {num_requests})")
    if tenants < 1:
        raise LlmvisorError(f"--tenants: need at least 1 tenant (got {tenants})")
    if not time_scale > 0:
        raise LlmvisorError(f"--time-scale: must be > 0 (got {time_scale})")
    if shared_documents < 0 or document_tokens < 0:
        raise LlmvisorError("--shared-documents, --document-tokens: must be >= 0")
    if (shared_documents > 0) != (document_tokens > 0):
        raise LlmvisorError("--shared-documents and --document-tokens go together (both > 0, or neither)")
    names = [workload_name(path) for path in paths]
    if len(set(names)) != len(names):
        raise LlmvisorError("--workload: workload files must have distinct names (tenants are named after them)")

    per_file: list[list[WorkloadRequest]] = []
    scale_factors = {}
    clipped = 0
    for path, name in zip(paths, names):
        rows = read_workload_csv(path)[start_row : start_row + num_requests]
        if not rows:
            raise LlmvisorError(f"{path}: no rows from row {start_row} on")
        if arrival == "trace" and rows[0].arrival_s is None:
            raise LlmvisorError(f"{path}: header: --arrival trace needs an arrived_at column")
        factor = _scale_factor(rows, envelope.max_model_len) if length_rule == "scale" else 1.0
        scale_factors[name] = factor
        first_arrival = rows[0].arrival_s or 0.0
        requests = []
        for k, row in enumerate(rows):
            prompt, output = fit_lengths(row.prompt_len + document_tokens, row.output_len, envelope.max_model_len, factor)
            wanted = (round_length((row.prompt_len + document_tokens) * factor), round_length(row.output_len * factor))
            clipped += (prompt, output) != wanted
            document = (start_row + k) % shared_documents if shared_documents else None
            own_document_tokens = min(document_tokens, prompt - 1) if shared_documents else 0
            if len(paths) > 1:
                tenant = name
            elif tenants == 1:
                tenant = name
            else:
                tenant = f"{name}-t{k % tenants}"
            arrival_s = None
            if arrival == "trace":
                arrival_s = (row.arrival_s - first_arrival) * time_scale
            requests.append(
                WorkloadRequest(f"{name}-{start_row + k:06d}", tenant, prompt, output, arrival_s, name, document, own_document_tokens)
            )
        per_file.append(requests)

    if arrival == "trace":
        merged = sorted((r for requests in per_file for r in requests), key=lambda r: (r.arrival_s, r.request_id))
    else:
        merged = [r for group in _round_robin(per_file) for r in group]

    if length_rule == "clip":
        length_text = (
            f"clip: prompt = min(P, {envelope.max_model_len - 1}); output = min(O, max_model_len - prompt) "
            f"with max_model_len = {envelope.max_model_len}"
        )
    else:
        length_text = (
            "scale: both lengths times s = min(1, max_model_len / p99(P + O)) per workload file, rounded "
            f"(at least 1), then clipped as for 'clip' (max_model_len = {envelope.max_model_len})"
        )
    if len(paths) > 1:
        tenant_text = "one tenant per workload file, named after the file"
    elif tenants == 1:
        tenant_text = f"one tenant, named after the workload file ({names[0]})"
    else:
        tenant_text = f"{tenants} tenants <name>-t<k>, assigned round-robin in row order"
    if arrival == "closed":
        arrival_text = "closed loop: a fixed number of requests in flight, a new one submitted as one finishes"
        if len(paths) > 1:
            arrival_text += "; files interleaved round-robin"
    else:
        arrival_text = f"trace arrivals: arrived_at (from the first selected row) times {time_scale}"
    metadata = {
        "workloads": [
            {"path": shipped.portable_path(path), "name": name, "rows": f"{start_row}..{start_row + len(reqs) - 1}", "n_requests": len(reqs)}
            for path, name, reqs in zip(paths, names, per_file)
        ],
        "length_rule": length_text,
        "length_scale_factors": scale_factors,
        "n_requests_clipped": int(clipped),
        "tenant_rule": tenant_text,
        "arrival": arrival_text,
        "sharing": (
            f"request k's prompt starts with shared document k mod {shared_documents} ({document_tokens} tokens, the same "
            "tokens for every request on it), then the row's own prompt"
            if shared_documents
            else "none on purpose: every prompt is its own random tokens"
        ),
    }
    return WorkloadPlan(merged, metadata)


def _round_robin(groups: list[list]) -> list[list]:
    out = []
    for k in range(max(len(g) for g in groups)):
        out.append([g[k] for g in groups if k < len(g)])
    return out


def round_length(value: float) -> int:
    return max(1, int(round(value)))


def _scale_factor(rows: list[WorkloadRow], max_model_len: int) -> float:
    totals = np.array([row.prompt_len + row.output_len for row in rows], dtype=float)
    return float(min(1.0, max_model_len / np.percentile(totals, 99)))


def fit_lengths(prompt_len: int, output_len: int, max_model_len: int, factor: float = 1.0) -> tuple[int, int]:
    """Scale by `factor`, then clip so the prompt is shorter than max_model_len and prompt + output fits."""
    prompt = min(round_length(prompt_len * factor), max_model_len - 1)
    output = min(round_length(output_len * factor), max_model_len - prompt)
    return prompt, output


def episode_dict(episode: Episode) -> dict:
    return asdict(episode)
