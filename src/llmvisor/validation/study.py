"""Validate per-request shares against a measured per-request truth: exact Shapley values of real steps.

A fitted model pricing whole steps well does not show that it splits them well. For a batch B of 2 to 5
requests, the engine is made to run every non-empty subset S ⊆ B as one step of its own (each slice with
the same new and context tokens as in B), each K times, median kept: T(S), with T(∅) = 0. From those:

- the **exact Shapley value** φ_i = Σ_{S ⊆ B∖i} |S|!(n−|S|−1)!/n! · (T(S ∪ i) − T(S)): the only split of
  T(B) that is efficient, symmetric and additive across games, and the measured counterpart of what the
  ``shapley`` attribution rule computes from the model;
- the **leave-one-out** marginal cost T(B) − T(B∖i), whose sum misses T(B) by the shared cost (reported).

Every request's share under each attribution rule (predicted from the model alone, and scaled to the
measured T(B)), a token-proportional share and an equal split are compared with φ_i (and LOO_i); errors
are fractions of the measured step time T(B). Quantiles come with batch-clustered bootstrap intervals
(requests of one batch share its measurements, so batches, not requests, are resampled).

The **noise floor**: some batches are measured twice, independently (their decode requests prefilled
again); |φ⁽¹⁾ − φ⁽²⁾| / (√2·T(B)) estimates how far one measured Shapley value is from the true one, the
error a perfect predictor would still show. Step-level spread over the K repeats is reported as well.

This module is engine-agnostic: measuring goes through any object with ``prefill_step(lengths)``,
``prepare_decode(contexts, max_decode_steps=...)``, ``decode_step(batch, members)`` and ``release(batch)``
(`llmvisor.engines.vllm.controlled.ControlledEngine` on vLLM). Measurements are appended to a JSONL
journal as they are taken; a re-run with the same journal measures only what is missing.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from llmvisor.errors import LlmvisorError

RESULT_FORMAT = "llmvisor.validation"
RESULT_FORMAT_VERSION = 1
JOURNAL_FORMAT = "llmvisor.validation.journal"
PHASES = ("prefill", "decode")
WORKLOAD_FILES = ("azure-2023-conv.csv", "azure-2023-code.csv", "arxiv-summarization.csv")
GOAL = {"median_max": 0.05, "p90_max": 0.10, "p90_improvement_vs_token_proportional_min": 2.0}
HEADLINE_METHOD = "shapley"
BASELINES = ("token_proportional", "equal_split")


# ----------------------------------------------------------------------------------------------------------
# Cooperative-game arithmetic on measured subset costs


def subset_masks(n: int) -> np.ndarray:
    """Bit masks of every subset of n players, 0 (empty) to 2**n − 1 (everyone); bit i = player i."""
    return np.arange(1 << n, dtype=np.int64)


def popcount(masks: np.ndarray) -> np.ndarray:
    masks = np.asarray(masks, dtype=np.int64)
    return np.array([int(m).bit_count() for m in masks.ravel()], dtype=np.int64).reshape(masks.shape)


def _check_game(cost: np.ndarray) -> int:
    cost = np.asarray(cost, dtype=np.float64)
    n = int(round(math.log2(cost.shape[0]))) if cost.shape[0] else -1
    if n < 1 or cost.shape[0] != 1 << n:
        raise ValueError(f"a game over n players needs 2**n subset costs (got {cost.shape[0]})")
    if cost[0] != 0:
        raise ValueError("the cost of the empty subset must be 0")
    return n


def exact_shapley(cost: np.ndarray) -> np.ndarray:
    """Exact Shapley values from the cost of every subset (``cost[mask]``, ``cost[0] == 0``).

    φ_i = Σ_{S ∌ i} |S|!·(n−|S|−1)!/n! · (v(S ∪ {i}) − v(S)). They sum to v(everyone).
    """
    cost = np.asarray(cost, dtype=np.float64)
    n = _check_game(cost)
    masks = subset_masks(n)
    sizes = popcount(masks)
    weight = np.array([math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) if s < n else 0.0 for s in range(n + 1)])
    phi = np.empty(n)
    for i in range(n):
        without = masks[(masks >> i) & 1 == 0]
        phi[i] = float(np.sum(weight[sizes[without]] * (cost[without | (1 << i)] - cost[without])))
    return phi


def leave_one_out(cost: np.ndarray) -> np.ndarray:
    """Leave-one-out marginal cost of each player: v(everyone) − v(everyone but i)."""
    cost = np.asarray(cost, dtype=np.float64)
    n = _check_game(cost)
    full = (1 << n) - 1
    return np.array([cost[full] - cost[full ^ (1 << i)] for i in range(n)])


def additive_fit(cost: np.ndarray) -> dict:
    """Least-squares fit of the additive game v(S) = b + Σ_{i∈S} f_i to the measured non-empty subsets.

    Its Shapley values are f_i + b/n (own terms plus an equal split of the shared cost: the form the
    ``shapley`` rule assumes). The residual says how far the measured game is from any such form.
    """
    cost = np.asarray(cost, dtype=np.float64)
    n = _check_game(cost)
    masks = subset_masks(n)[1:]
    x = np.column_stack([np.ones(masks.size)] + [((masks >> i) & 1).astype(np.float64) for i in range(n)])
    coef, *_ = np.linalg.lstsq(x, cost[1:], rcond=None)
    residual = cost[1:] - x @ coef
    full = cost[-1]
    return {
        "intercept_s": float(coef[0]),
        "own_s": coef[1:].tolist(),
        "shapley_s": (coef[1:] + coef[0] / n).tolist(),
        "rms_residual_fraction": float(np.sqrt(np.mean(residual**2)) / full) if full > 0 else float("nan"),
        "max_residual_fraction": float(np.max(np.abs(residual)) / full) if full > 0 else float("nan"),
    }


# ----------------------------------------------------------------------------------------------------------
# Batches


@dataclass(frozen=True)
class BatchSpec:
    """One batch to validate: each request's new tokens and (nominal) context tokens, all of one phase."""

    index: int
    phase: str
    kind: str
    """"workload" (lengths drawn from a real mix) or "adversarial" (one long request among short ones)."""
    source: str
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


def default_workloads_dir() -> Path | None:
    """``../shared/data/workloads`` next to the project (from the working directory or this source tree)."""
    candidates = [Path.cwd() / ".." / "shared" / "data" / "workloads", Path.cwd() / "shared" / "data" / "workloads"]
    candidates += [parent / "shared" / "data" / "workloads" for parent in Path(__file__).resolve().parents]
    for candidate in candidates:
        if all((candidate / name).is_file() for name in WORKLOAD_FILES):
            return candidate.resolve()
    return None


def read_length_mixes(directory: str | os.PathLike) -> list[LengthMix]:
    """The three real mixes (Azure conversation, Azure code, arXiv summarization) from their CSVs."""
    mixes = []
    for name in WORKLOAD_FILES:
        path = Path(directory) / name
        if not path.is_file():
            raise LlmvisorError(f"{path}: workload file missing (expected {', '.join(WORKLOAD_FILES)} in {directory})")
        prompts, outputs = [], []
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = {"num_prefill_tokens", "num_decode_tokens"} - set(reader.fieldnames or ())
            if missing:
                raise LlmvisorError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
            for line, row in enumerate(reader, start=2):
                try:
                    prompts.append(int(float(row["num_prefill_tokens"])))
                    outputs.append(int(float(row["num_decode_tokens"])))
                except (TypeError, ValueError):
                    raise LlmvisorError(f"{path}: line {line}: token counts must be numbers") from None
        prompt, output = np.array(prompts), np.array(outputs)
        keep = (prompt >= 1) & (output >= 0)
        mixes.append(LengthMix(name.removesuffix(".csv"), prompt[keep], output[keep]))
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
    every = int(round(1 / adversarial_fraction)) if adversarial_fraction > 0 else 0
    batches = []
    for index in range(n_batches):
        phase = PHASES[index % 2]
        within = index // 2
        size = sizes[within % len(sizes)]
        mix = mixes[within % len(mixes)]
        adversarial = every > 0 and within % every == every - 1
        rows = rng.integers(0, mix.prompt_tokens.size, size)
        if phase == "decode":
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
                kind="adversarial" if adversarial else "workload",
                source="adversarial" if adversarial else mix.name,
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


# ----------------------------------------------------------------------------------------------------------
# Journal: one JSON line per measured subset step, so a run can resume


@dataclass
class Measurement:
    batch_key: str
    round: int
    subset: int
    """Bit mask over the batch's requests (bit i = request i)."""
    repeat: int
    step_latency_s: float
    num_context_tokens: list[int]
    """Recorded context of each member (in batch order), as the step ran."""
    interference: bool = False
    """Kept although the interference guard flagged its batch-round (after every redo was flagged too)."""


class Journal:
    """Append-only JSONL of measurements; reading it back tells a resumed run what is already measured."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.measurements: dict[tuple[str, int, int], list[Measurement]] = {}
        self.n_rejected = 0
        self.interference: list[dict] = []
        self.canary_s: list[float] = []
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            # A line cut short by a crash: drop it (its measurement is simply taken again), so appends stay whole.
            with open(self.path, "r+b") as handle:
                handle.truncate(complete)
        for line_number, line in enumerate(data[:complete].decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise LlmvisorError(f"{self.path}: line {line_number}: not valid JSON") from None
            try:
                self._ingest(row)
            except (KeyError, TypeError, ValueError):
                raise LlmvisorError(f"{self.path}: line {line_number}: malformed {row.get('type', 'row')}") from None

    def _ingest(self, row: dict) -> None:
        kind = row.get("type")
        if kind == "rejected":
            self.n_rejected += 1
        elif kind == "interference":
            self.interference.append(row)
            self.canary_s.extend(float(t) for t in row.get("canary_s", []))
        elif kind == "canaries":
            self.canary_s.extend(float(t) for t in row.get("canary_s", []))
        elif kind == "measurement":
            m = Measurement(
                str(row["batch_key"]), int(row["round"]), int(row["subset"]), int(row["repeat"]),
                float(row["step_latency_s"]), [int(c) for c in row["num_context_tokens"]], bool(row.get("interference", False)),
            )
            self.measurements.setdefault((m.batch_key, m.round, m.subset), []).append(m)

    def get(self, batch: BatchSpec, round_: int, subset: int) -> list[Measurement]:
        return self.measurements.get((batch.key, round_, subset), [])

    def _append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()

    def log(self, row: dict) -> None:
        """An informational line (canaries, discarded batch-rounds), kept for the record."""
        self._append(row)
        self._ingest(row)

    def write_header(self, header: dict) -> None:
        """The first line of a new journal: what it was measured under."""
        self._append({"type": "header", "format": JOURNAL_FORMAT, **header})

    def add(self, m: Measurement) -> None:
        self.log({"type": "measurement", **asdict(m)})

    def reject(self, batch: BatchSpec, subset: int, reason: str) -> None:
        self.log({"type": "rejected", "batch_key": batch.key, "subset": subset, "reason": reason})


def missing_measurements(batches: Iterable[BatchSpec], journal: Journal, repeat: int) -> dict[tuple[int, int], list[int]]:
    """(batch index, round) → subset masks, one entry per repeat still to measure."""
    todo: dict[tuple[int, int], list[int]] = {}
    for batch in batches:
        for round_ in range(batch.rounds):
            masks = []
            for subset in range(1, 1 << batch.size):
                masks += [subset] * max(0, repeat - len(journal.get(batch, round_, subset)))
            if masks:
                todo[(batch.index, round_)] = masks
    return todo


def _members(subset: int, n: int) -> list[int]:
    return [i for i in range(n) if subset >> i & 1]


@dataclass
class InterferenceGuard:
    """Detects other work on the machine by re-timing a fixed reference step (a *canary*) between steps.

    On a shared machine another process can slow every step for seconds at a time; medians of K repeats
    do not remove that when it lasts longer than a few steps. The measurer's ``canary_step()`` runs before
    and after every (batch, round) and after every ``every`` subset steps. If any canary of a batch-round is
    slower than ``1 + tolerance`` times the baseline (the median of the last ``window`` canaries that
    passed, started from ``calibration`` canaries), that batch-round's measurements are discarded (logged
    in the journal), the guard waits until ``quiet_needed`` canaries in a row pass, and the batch-round is
    measured again; after ``max_redos`` redos it is kept and flagged.
    """

    tolerance: float = 0.25
    every: int = 8
    calibration: int = 7
    window: int = 25
    quiet_needed: int = 3
    max_redos: int = 4
    max_wait_s: float = 600.0
    poll_s: float = 2.0
    accepted_s: list[float] = field(default_factory=list)
    all_s: list[float] = field(default_factory=list)

    @property
    def baseline_s(self) -> float:
        return float(np.median(self.accepted_s[-self.window :]))

    def _canary(self, measurer) -> float:
        step = measurer.canary_step()
        if not step.matches:
            raise LlmvisorError(f"canary step did not run as intended: {step.reason}")
        t = float(step.step_latency_s)
        self.all_s.append(t)
        return t

    def calibrate(self, measurer) -> None:
        times = sorted(self._canary(measurer) for _ in range(self.calibration))
        # The lower half: a calibration caught in interference would otherwise pass everything.
        self.accepted_s = times[: max(1, (len(times) + 1) // 2)]

    def check(self, measurer) -> tuple[bool, float]:
        t = self._canary(measurer)
        ok = t <= (1 + self.tolerance) * self.baseline_s
        if ok:
            self.accepted_s.append(t)
        return ok, t

    def wait_quiet(self, measurer, sleep: Callable[[float], None]) -> bool:
        """Poll canaries until ``quiet_needed`` pass in a row; False if ``max_wait_s`` passed first."""
        waited, streak = 0.0, 0
        while waited < self.max_wait_s:
            ok, _ = self.check(measurer)
            streak = streak + 1 if ok else 0
            if streak >= self.quiet_needed:
                return True
            sleep(self.poll_s)
            waited += self.poll_s
        return False


def measure(
    measurer,
    batches: list[BatchSpec],
    journal: Journal,
    *,
    repeat: int,
    max_attempts: int = 3,
    warm_up_steps: int = 1,
    seed: int = 0,
    guard: InterferenceGuard | None = None,
    on_step: Callable[[int], None] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> dict:
    """Measure every missing (batch, round, subset, repeat) on ``measurer``, appending to ``journal``.

    Within a batch and round, subsets run in a seeded random order, so slow drifts of the machine (and, for
    decode, contexts growing by one token per run) spread evenly over subsets. A step whose recorded
    composition differs from the intended one is logged as rejected and run again (``max_attempts``).
    A batch-round's measurements reach the journal together once it is done (and, with a ``guard``, found
    free of interference), so a crash loses at most one batch-round. ``on_step(n)`` reports progress (n < 0
    when a discarded batch-round is taken back). Returns counts of what was measured now.
    """
    import time

    if repeat < 1:
        raise LlmvisorError(f"--repeat: must be at least 1 (got {repeat})")
    sleep = sleep or time.sleep
    progress = on_step or (lambda n: None)
    by_index = {b.index: b for b in batches}
    todo = missing_measurements(batches, journal, repeat)
    counts = {"measured_now": 0, "rejected_now": 0, "discarded_batch_rounds": 0, "flagged_batch_rounds": 0}
    counts["reused"] = sum(
        min(repeat, len(journal.get(b, r, s))) for b in batches for r in range(b.rounds) for s in range(1, 1 << b.size)
    )
    if guard is not None and todo and not guard.accepted_s:
        guard.calibrate(measurer)
        journal.log({"type": "canaries", "calibration": True, "canary_s": guard.all_s[:], "baseline_s": guard.baseline_s})
    for (index, round_), masks in todo.items():
        batch = by_index[index]
        rng = np.random.default_rng([seed, index, round_, len(masks)])
        order = [masks[i] for i in rng.permutation(len(masks))]
        for redo in range(guard.max_redos + 1 if guard else 1):
            taken, canaries, clean = _measure_batch_round(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress, counts)
            if clean or redo == (guard.max_redos if guard else 0):
                break
            counts["discarded_batch_rounds"] += 1
            journal.log({"type": "interference", "batch_key": batch.key, "round": round_, "canary_s": canaries,
                         "baseline_s": guard.baseline_s, "tolerance": guard.tolerance, "discarded_steps": len(taken)})
            progress(-len(taken))
            guard.wait_quiet(measurer, sleep)
        if not clean:
            counts["flagged_batch_rounds"] += 1
        if guard is not None:
            journal.log({"type": "canaries", "batch_key": batch.key, "round": round_, "canary_s": canaries, "baseline_s": guard.baseline_s})
        for m in taken:
            m.repeat = len(journal.get(batch, m.round, m.subset))
            m.interference = not clean
            journal.add(m)
        counts["measured_now"] += len(taken)
    return counts


def _measure_batch_round(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress, counts):
    """One pass over a batch-round's subset steps; returns (measurements, canary times, no interference)."""
    full = (1 << batch.size) - 1
    taken: list[Measurement] = []
    canaries: list[float] = []
    clean = True

    def canary() -> None:
        nonlocal clean
        if guard is not None:
            ok, t = guard.check(measurer)
            canaries.append(t)
            clean &= ok

    canary()
    if batch.phase == "decode":
        runs_per_request = max(sum(1 for m in order if m >> i & 1) for i in range(batch.size))
        handle = measurer.prepare_decode(
            list(batch.num_context_tokens), max_decode_steps=runs_per_request + warm_up_steps + 4 * max_attempts
        )
        run = lambda subset: measurer.decode_step(handle, _members(subset, batch.size))  # noqa: E731
    else:
        handle = None
        run = lambda subset: measurer.prefill_step([batch.num_new_tokens[i] for i in _members(subset, batch.size)])  # noqa: E731
    try:
        for _ in range(warm_up_steps):
            run(full)
        for j, subset in enumerate(order):
            for _attempt in range(max_attempts):
                step = run(subset)
                if step.matches:
                    taken.append(
                        Measurement(batch.key, round_, subset, 0, float(step.step_latency_s), [int(s.num_context_tokens) for s in step.recorded])
                    )
                    break
                journal.reject(batch, subset, step.reason)
                counts["rejected_now"] += 1
            else:
                raise LlmvisorError(
                    f"batch {batch.index}: subset {_members(subset, batch.size)} did not run as the intended step "
                    f"in {max_attempts} attempts (last: {step.reason})"
                )
            progress(1)
            if guard is not None and (j + 1) % guard.every == 0 and j + 1 < len(order):
                canary()
        canary()
    finally:
        if handle is not None:
            measurer.release(handle)
    return taken, canaries, clean


# ----------------------------------------------------------------------------------------------------------
# Analysis


def _weighted_quantiles(values: np.ndarray, counts: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return np.percentile(np.repeat(values, counts), qs)


def quantiles_with_ci(
    errors: np.ndarray, groups: np.ndarray, *, qs=(50, 90, 99), n_bootstrap: int = 1000, seed: int = 0
) -> dict:
    """Quantiles of ``errors`` and their bootstrap 95% intervals, resampling whole groups (batches)."""
    errors = np.asarray(errors, dtype=np.float64)
    out: dict = {"n": int(errors.size)}
    if errors.size == 0:
        for q in qs:
            out[f"p{q}"] = None
            out[f"p{q}_ci95"] = None
        return out
    qs_arr = np.asarray(qs, dtype=np.float64)
    point = np.percentile(errors, qs_arr)
    _, group_index = np.unique(np.asarray(groups), return_inverse=True)
    n_groups = int(group_index.max()) + 1
    rng = np.random.default_rng(seed)
    boot = np.empty((n_bootstrap, qs_arr.size))
    for b in range(n_bootstrap):
        draws = np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups)
        boot[b] = _weighted_quantiles(errors, draws[group_index], qs_arr)
    low, high = np.percentile(boot, [2.5, 97.5], axis=0) if n_bootstrap else (point, point)
    for k, q in enumerate(qs):
        out[f"p{q}"] = float(point[k])
        out[f"p{q}_ci95"] = [float(low[k]), float(high[k])]
    out["mean"] = float(errors.mean())
    return out


def _model_shares(model, new: np.ndarray, context: np.ndarray, is_prefill: np.ndarray, measured_s: float) -> dict[str, np.ndarray]:
    from llmvisor.core.attribution import RULES, attribute_arrays

    offsets = np.array([0, new.size])
    shares = {}
    for rule in RULES:
        scaled = attribute_arrays(model, new, context, is_prefill, offsets, np.array([measured_s]), rule)
        shares[rule] = scaled.share_s
        if rule != "paper":
            shares[f"{rule}_predicted"] = attribute_arrays(model, new, context, is_prefill, offsets, None, rule).share_s
    return shares


def model_subset_costs(model, new: np.ndarray, context: np.ndarray, is_prefill: np.ndarray) -> np.ndarray:
    """The model's predicted time of every subset of a batch (index = bit mask; 0 for the empty set): the
    cost game whose Shapley value the attribution rule is (``llmvisor.core.attribution.subset_costs_s``)."""
    from llmvisor.core.attribution import subset_costs_s

    return subset_costs_s(model, new, context, is_prefill)


def analyse_batch(batch: BatchSpec, journal: Journal, model, repeat: int) -> dict | None:
    """Measured game, Shapley and LOO values, and every method's shares for one fully measured batch."""
    n = batch.size
    rounds = []
    for round_ in range(batch.rounds):
        cost = np.zeros(1 << n)
        spread = []
        flagged = False
        contexts: list[list[int]] = [[] for _ in range(n)]
        for subset in range(1, 1 << n):
            taken = journal.get(batch, round_, subset)[:repeat]
            if len(taken) < repeat:
                return None
            times = np.array([m.step_latency_s for m in taken])
            flagged |= any(m.interference for m in taken)
            cost[subset] = float(np.median(times))
            if times.size >= 2:
                spread.extend(np.abs(times - cost[subset]) / cost[subset])
            for m in taken:
                for i, c in zip(_members(subset, n), m.num_context_tokens):
                    contexts[i].append(c)
        rounds.append({"cost": cost, "spread": spread, "contexts": contexts, "flagged": flagged})
    first = rounds[0]
    cost = first["cost"]
    measured_s = float(cost[-1])
    phi = exact_shapley(cost)
    loo = leave_one_out(cost)
    new = np.array(batch.num_new_tokens, dtype=np.float64)
    nominal = np.array(batch.num_context_tokens, dtype=np.float64)
    context = np.array([np.mean(c) for c in first["contexts"]]) if batch.phase == "decode" else nominal
    is_prefill = np.full(n, batch.phase == "prefill")
    shares = _model_shares(model, new, np.rint(context), is_prefill, measured_s)
    model_cost = model_subset_costs(model, new, np.rint(context), is_prefill)
    model_phi = exact_shapley(model_cost)
    shares["model_exact_shapley"] = model_phi * (measured_s / model_phi.sum()) if model_phi.sum() > 0 else np.full(n, measured_s / n)
    weights = new if batch.phase == "prefill" else np.ones(n)
    shares["token_proportional"] = measured_s * weights / weights.sum()
    shares["equal_split"] = np.full(n, measured_s / n)
    kv = new + context
    shares["kv_tokens_proportional"] = measured_s * kv / kv.sum()
    fit = additive_fit(cost)
    shares["measured_additive_fit"] = np.asarray(fit["shapley_s"])
    out = {
        "index": batch.index,
        "phase": batch.phase,
        "kind": batch.kind,
        "source": batch.source,
        "size": n,
        "num_new_tokens": list(batch.num_new_tokens),
        "nominal_context_tokens": list(batch.num_context_tokens),
        "num_context_tokens": context.tolist(),
        "context_drift_tokens": float(max((max(c) - min(c)) for c in first["contexts"])),
        "measured_step_s": measured_s,
        "subset_step_s": [r["cost"][1:].tolist() for r in rounds],
        "model_subset_step_s": model_cost[1:].tolist(),
        "shapley_s": phi.tolist(),
        "loo_s": loo.tolist(),
        "loo_sum_gap_fraction": float((loo.sum() - measured_s) / measured_s),
        "shares_s": {k: np.asarray(v, dtype=np.float64).tolist() for k, v in shares.items()},
        "additive_fit": fit,
        "step_spread": first["spread"],
        "interference_flagged": any(r["flagged"] for r in rounds),
    }
    if len(rounds) > 1:
        out["shapley_replicate_s"] = exact_shapley(rounds[1]["cost"]).tolist()
        out["measured_step_replicate_s"] = float(rounds[1]["cost"][-1])
    return out


INTERACTION_TERMS = {
    "max_tokens": "max over the subset of the request's length (decode: context; prefill: new tokens)",
    "size_x_max_tokens": "|S| · max length: every request padded to the longest (attention padding)",
    "pairs": "|S|·(|S| − 1)/2: a cost growing with the number of request pairs",
    "total_tokens_squared": "(Σ length)²: a cost convex in the step's total tokens",
}


def _term(name: str, lengths: np.ndarray) -> float:
    if name == "max_tokens":
        return float(lengths.max())
    if name == "size_x_max_tokens":
        return float(lengths.size * lengths.max())
    if name == "pairs":
        return lengths.size * (lengths.size - 1) / 2
    if name == "total_tokens_squared":
        return float(lengths.sum()) ** 2
    raise KeyError(name)


def interaction_diagnostics(records: list[dict]) -> dict:
    """Which non-additive cost, if any, the measured games hold beyond the additive form, per phase.

    Pooled over batches of 3 or more requests: each batch keeps its own additive game (b + Σ f_i, fixed
    effects), and one coefficient per candidate term (``INTERACTION_TERMS``) is fitted on what the additive
    games leave (Frisch–Waugh). Reported: the coefficient (seconds per unit), its standard error and t, and
    the share of the additive residual it explains; a term that explains little leaves nothing to fix.
    """
    out: dict = {}
    for phase in PHASES:
        batches = [r for r in records if r["phase"] == phase and r["size"] >= 3]
        if not batches:
            continue
        residuals, projected = [], {name: [] for name in INTERACTION_TERMS}
        for r in batches:
            n = r["size"]
            lengths = np.asarray(r["num_context_tokens"] if phase == "decode" else r["num_new_tokens"], dtype=np.float64)
            masks = subset_masks(n)[1:]
            x = np.column_stack([np.ones(masks.size)] + [((masks >> i) & 1).astype(np.float64) for i in range(n)])
            pinv = np.linalg.pinv(x)
            y = np.asarray(r["subset_step_s"][0])
            residuals.append(y - x @ (pinv @ y))
            for name in INTERACTION_TERMS:
                z = np.array([_term(name, lengths[[i for i in range(n) if m >> i & 1]]) for m in masks])
                projected[name].append(z - x @ (pinv @ z))
        res = np.concatenate(residuals)
        dof = res.size - sum(r["size"] + 1 for r in batches)
        terms = {}
        for name, pieces in projected.items():
            z = np.concatenate(pieces)
            zz = float(z @ z)
            if zz <= 0:
                continue
            coef = float(res @ z) / zz
            left = res - coef * z
            sigma2 = float(left @ left) / max(dof - 1, 1)
            explained = 1 - float(left @ left) / float(res @ res) if float(res @ res) > 0 else 0.0
            terms[name] = {
                "coef": coef,
                "std_err": math.sqrt(sigma2 / zz),
                "t": coef / math.sqrt(sigma2 / zz) if sigma2 > 0 else None,
                "explained_fraction_of_additive_residual": explained,
                "description": INTERACTION_TERMS[name],
            }
        out[phase] = {
            "n_batches": len(batches),
            "additive_residual_rms_s": float(np.sqrt(np.mean(res**2))),
            "additive_residual_rms_fraction": float(np.sqrt(np.mean(np.concatenate([rr / r["measured_step_s"] for rr, r in zip(residuals, batches)]) ** 2))),
            "terms": terms,
        }
    return out


def _error_table(records: list[dict], target: str, methods: list[str], n_bootstrap: int, seed: int) -> dict:
    out = {}
    for method in methods:
        errors, groups = [], []
        for r in records:
            truth = np.asarray(r[f"{target}_s"])
            share = np.asarray(r["shares_s"][method])
            errors.extend(np.abs(share - truth) / r["measured_step_s"])
            groups.extend([r["index"]] * r["size"])
        out[method] = quantiles_with_ci(np.array(errors), np.array(groups), n_bootstrap=n_bootstrap, seed=seed)
    return out


def _plain_quantiles(values: Iterable[float], qs=(10, 50, 90, 99)) -> dict:
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        return {"n": 0}
    out = {"n": int(values.size), "mean": float(values.mean())}
    out.update({f"p{q}": float(np.percentile(values, q)) for q in qs})
    return out


def summarize(records: list[dict], *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Error quantiles per phase (and per kind) for every method against measured Shapley and LOO values."""
    if not records:
        return {}
    methods = list(records[0]["shares_s"])
    summary: dict = {"errors": {}, "errors_by_kind": {}, "improvement_vs_token_proportional": {}, "loo_sum_gap_fraction": {},
                     "noise_floor": {"step": {}, "shapley": {}}, "additivity": {}, "goal": dict(GOAL), "goal_met": {}}
    for phase in PHASES:
        phase_records = [r for r in records if r["phase"] == phase]
        if not phase_records:
            continue
        errors = {target: _error_table(phase_records, target, methods, n_bootstrap, seed) for target in ("shapley", "loo")}
        summary["errors"][phase] = errors
        summary["errors_by_kind"][phase] = {
            kind: _error_table([r for r in phase_records if r["kind"] == kind], "shapley", methods, 0, seed)
            for kind in sorted({r["kind"] for r in phase_records})
        }
        token_p90 = errors["shapley"]["token_proportional"]["p90"]
        summary["improvement_vs_token_proportional"][phase] = {
            m: (token_p90 / v["p90"] if v["p90"] else None) for m, v in errors["shapley"].items()
        }
        summary["loo_sum_gap_fraction"][phase] = _plain_quantiles(r["loo_sum_gap_fraction"] for r in phase_records)
        summary["noise_floor"]["step"][phase] = _plain_quantiles(x for r in phase_records for x in r["step_spread"])
        replicated = [r for r in phase_records if "shapley_replicate_s" in r]
        floor_errors, floor_groups = [], []
        for r in replicated:
            diff = np.abs(np.asarray(r["shapley_s"]) - np.asarray(r["shapley_replicate_s"])) / (math.sqrt(2) * r["measured_step_s"])
            floor_errors.extend(diff)
            floor_groups.extend([r["index"]] * r["size"])
        summary["noise_floor"]["shapley"][phase] = {
            "n_batches": len(replicated),
            **quantiles_with_ci(np.array(floor_errors), np.array(floor_groups), n_bootstrap=n_bootstrap, seed=seed),
            "full_step_rel_diff": _plain_quantiles(
                abs(r["measured_step_s"] - r["measured_step_replicate_s"]) / r["measured_step_s"] for r in replicated
            ),
        }
        summary["additivity"][phase] = {
            "rms_residual_fraction": _plain_quantiles(r["additive_fit"]["rms_residual_fraction"] for r in phase_records),
            "max_residual_fraction": _plain_quantiles(r["additive_fit"]["max_residual_fraction"] for r in phase_records),
            "intercept_fraction_of_step": _plain_quantiles(r["additive_fit"]["intercept_s"] / r["measured_step_s"] for r in phase_records),
            "model_subset_rel_err": _plain_quantiles(
                abs(p - m) / m for r in phase_records for p, m in zip(r["model_subset_step_s"], r["subset_step_s"][0])
            ),
        }
        head = errors["shapley"][HEADLINE_METHOD]
        improvement = summary["improvement_vs_token_proportional"][phase][HEADLINE_METHOD]
        summary["goal_met"][phase] = {
            "median": head["p50"] <= GOAL["median_max"],
            "p90": head["p90"] <= GOAL["p90_max"],
            "vs_token_proportional": improvement is not None and improvement >= GOAL["p90_improvement_vs_token_proportional_min"],
        }
    summary["interactions"] = interaction_diagnostics(records)
    summary["n_batches"] = {p: sum(r["phase"] == p for r in records) for p in PHASES}
    summary["n_requests"] = {p: sum(r["size"] for r in records if r["phase"] == p) for p in PHASES}
    summary["methods"] = methods
    return summary


METHOD_NOTES = {
    "shapley": "llmvisor default: own terms + equal split of the intercept, scaled to the measured step time",
    "shapley_predicted": "the same from the model alone (shares sum to the predicted step time)",
    "proportional": "llmvisor: own terms only, scaled to the measured step time",
    "proportional_predicted": "the same, scaled to the predicted step time",
    "paper": "llmvisor paper reading: own terms only, intercept and residual unattributed",
    "model_exact_shapley": "exact Shapley value of the model's own game (every subset priced, in its own segment), scaled",
    "token_proportional": "the measured step split by tokens (VTC-style; equals equal_split for decode steps)",
    "equal_split": "the measured step split equally",
    "kv_tokens_proportional": "the measured step split by new + context tokens",
    "measured_additive_fit": "not a method: Shapley of the best additive game fitted to the measured subsets (the limit of any own-terms + shared-intercept rule)",
}


def rounded(value, digits: int = 6):
    """A JSON-ready copy with floats to ``digits`` significant digits (far below the measurement noise)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def dumps_result(result: dict) -> str:
    """The result as JSON text: indented, except one compact line per batch record (keeps the file small)."""
    result = rounded(result)
    head = {k: val for k, val in result.items() if k != "batches"}
    batches = result.get("batches", [])
    text = json.dumps(head, indent=1, allow_nan=False)
    lines = ",\n".join("  " + json.dumps(b, separators=(",", ":"), allow_nan=False) for b in batches)
    return text[:-2] + ',\n "batches": [\n' + lines + "\n ]\n}\n"


def _guard_rule(guard: InterferenceGuard | None = None) -> str:
    g = guard or InterferenceGuard()
    return (
        f"a fixed canary step (128-token prefill) before and after every batch-round and after every {g.every} subset steps; "
        f"a batch-round with a canary over {1 + g.tolerance:g} × the baseline (median of the last {g.window} passing canaries) "
        f"is discarded and measured again once {g.quiet_needed} canaries in a row pass (at most {g.max_redos} redos, then kept and flagged)"
    )


def build_result(batches: list[BatchSpec], journal: Journal, model, *, repeat: int, n_bootstrap: int = 1000, seed: int = 0, settings: dict | None = None) -> dict:
    """The full validation result (JSON-ready): settings, per-batch records, summary."""
    records = [r for r in (analyse_batch(b, journal, model, repeat) for b in batches) if r is not None]
    return {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "settings": dict(settings or {}),
        "method_notes": METHOD_NOTES,
        "n_batches_planned": len(batches),
        "n_batches_measured": len(records),
        "n_steps_rejected": journal.n_rejected,
        "interference": {
            "rule": _guard_rule(),
            "n_batch_rounds_discarded": len(journal.interference),
            "n_batches_flagged": sum(1 for r in records if r.get("interference_flagged")),
            "canary_s": _plain_quantiles(journal.canary_s),
        },
        "summary": summarize(records, n_bootstrap=n_bootstrap, seed=seed),
        "batches": records,
    }


# ----------------------------------------------------------------------------------------------------------
# Report


REPORT_METHODS = ("shapley", "shapley_predicted", "proportional", "paper", "token_proportional", "equal_split")
_COLORS = {
    "shapley": "#1f77b4",
    "shapley_predicted": "#17becf",
    "proportional": "#9467bd",
    "paper": "#ff7f0e",
    "token_proportional": "#d62728",
    "equal_split": "#7f7f7f",
    "model_exact_shapley": "#2ca02c",
    "kv_tokens_proportional": "#8c564b",
}


def _fractions(records: list[dict], method: str, target: str = "shapley") -> tuple[np.ndarray, np.ndarray]:
    truth, share = [], []
    for r in records:
        truth.extend(np.asarray(r[f"{target}_s"]) / r["measured_step_s"])
        share.extend(np.asarray(r["shares_s"][method]) / r["measured_step_s"])
    return np.array(truth), np.array(share)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _summary_table(summary: dict, target: str = "shapley") -> str:
    import html

    methods = [m for m in summary.get("methods", []) if m != "measured_additive_fit"] + ["measured_additive_fit"]
    rows = []
    for phase, tables in summary.get("errors", {}).items():
        for method in methods:
            m = tables[target].get(method)
            if not m:
                continue
            cells = [method, phase, str(m["n"])]
            for q in (50, 90, 99):
                ci = m.get(f"p{q}_ci95")
                cells.append(_pct(m[f"p{q}"]) + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else ""))
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("method", "phase", "requests", "p50 [95% CI]", "p90 [95% CI]", "p99 [95% CI]"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def report_sections(validation: dict) -> list[tuple[str, str]]:
    """HTML sections for the report: summary tables, share-vs-Shapley scatter, error CDFs per rule."""
    import html

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmvisor.report.html import img_tag, figure_png_base64

    records = validation.get("batches", [])
    summary = validation.get("summary") or {}
    if not records or not summary:
        return [("Validation against measured Shapley values", "<p>No validation result.</p>")]
    settings = validation.get("settings", {})
    floor = summary.get("noise_floor", {})
    notes = validation.get("method_notes", METHOD_NOTES)
    intro = (
        f"<p>{validation['n_batches_measured']} batches ({summary['n_batches'].get('prefill', 0)} prefill, "
        f"{summary['n_batches'].get('decode', 0)} decode; sizes {settings.get('min_batch', 2)}–{settings.get('max_batch', '?')}) were run "
        f"on {html.escape(str(settings.get('engine', 'the engine')))} as controlled steps: every non-empty subset of each batch as a step of its own, "
        f"{settings.get('repeat', '?')} times, median kept. Each request's exact Shapley value of the measured game is the ground truth. "
        "Errors are |share − measured Shapley| as a fraction of the measured step time; intervals are bootstrap 95% over batches.</p>"
    )
    gap_parts = [
        f"{phase}: median {_pct(g.get('p50'))} (p10 {_pct(g.get('p10'))}, p90 {_pct(g.get('p90'))})"
        for phase, g in summary.get("loo_sum_gap_fraction", {}).items()
        if g.get("n")
    ]
    floor_parts = [
        f"{phase}: p50 {_pct(f.get('p50'))}, p90 {_pct(f.get('p90'))}, p99 {_pct(f.get('p99'))} ({f.get('n_batches', 0)} batches measured twice)"
        for phase, f in floor.get("shapley", {}).items()
        if f.get("n")
    ]
    notes_html = "<ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in notes.items()) + "</ul>"
    sections = [
        (
            "Validation: shares vs measured Shapley values",
            intro
            + _summary_table(summary)
            + f"<p>Leave-one-out marginal costs sum to T(B) − Σ LOO short of the step by (Σ LOO − T) / T = {'; '.join(gap_parts)}.</p>"
            + f"<p>Noise floor of a measured Shapley value (two independent measurements, |Δφ| / (√2·T)): {'; '.join(floor_parts) or 'not measured'}.</p>"
            + f"<p class='note'>Methods:</p>{notes_html}",
        ),
        ("Validation: shares vs leave-one-out marginal cost", _summary_table(summary, "loo")),
    ]

    phases = [p for p in PHASES if any(r["phase"] == p for r in records)]
    methods = [m for m in REPORT_METHODS if m in records[0]["shares_s"]]
    figure, axes = plt.subplots(len(phases), len(methods), figsize=(3.0 * len(methods), 3.0 * len(phases)), squeeze=False)
    for row, phase in enumerate(phases):
        phase_records = [r for r in records if r["phase"] == phase]
        for col, method in enumerate(methods):
            axis = axes[row][col]
            truth, share = _fractions(phase_records, method)
            adversarial = np.concatenate([[r["kind"] == "adversarial"] * r["size"] for r in phase_records])
            axis.scatter(truth[~adversarial], share[~adversarial], s=7, alpha=0.6, color=_COLORS.get(method), label="workload")
            axis.scatter(truth[adversarial], share[adversarial], s=12, alpha=0.8, marker="x", color="black", label="adversarial")
            high = max(float(truth.max()), float(share.max()), 0.05) * 1.05
            axis.plot([0, high], [0, high], color="black", linewidth=0.7)
            axis.set_xlim(0, high)
            axis.set_ylim(0, high)
            axis.set_title(f"{method} ({phase})", fontsize=8)
            axis.tick_params(labelsize=7)
            if col == 0:
                axis.set_ylabel("share / measured step", fontsize=8)
            if row == len(phases) - 1:
                axis.set_xlabel("measured Shapley / step", fontsize=8)
            if row == 0 and col == 0:
                axis.legend(fontsize=6)
    scatter = img_tag(figure_png_base64(figure), "share vs measured Shapley value per method and phase")

    figure, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
    for axis, phase in zip(axes[0], phases):
        phase_records = [r for r in records if r["phase"] == phase]
        drawn: dict[str, np.ndarray] = {}
        for method in methods + ["model_exact_shapley"]:
            if method not in phase_records[0]["shares_s"]:
                continue
            truth, share = _fractions(phase_records, method)
            errors = np.sort(np.abs(share - truth))
            same = next((name for name, e in drawn.items() if e.shape == errors.shape and np.allclose(e, errors, rtol=0, atol=1e-9)), None)
            if same is not None:  # identical curve (e.g. token_proportional = equal_split for decode): say so, draw once
                axis.plot([], [], color=_COLORS.get(method), label=f"{method} (= {same})")
                continue
            drawn[method] = errors
            width = 2.2 if method == HEADLINE_METHOD else 1.2
            axis.plot(errors * 100, np.linspace(0, 1, errors.size), label=method, color=_COLORS.get(method), linewidth=width)
        f = floor.get("shapley", {}).get(phase, {})
        for q, style in (("p50", ":"), ("p90", "--")):
            if f.get(q) is not None:
                axis.axvline(f[q] * 100, color="gray", linestyle=style, linewidth=1, label=f"noise floor {q}")
        axis.axvline(GOAL["p90_max"] * 100, color="green", linestyle="-.", linewidth=0.8, label="goal p90")
        axis.set_xscale("symlog", linthresh=1)
        axis.set_xlim(left=0)
        axis.set_xlabel("|share − measured Shapley| / step time (%)")
        axis.set_ylabel("fraction of requests")
        axis.set_title(f"error CDF, {phase}")
        axis.legend(fontsize=7)
    cdf = img_tag(figure_png_base64(figure), "error CDF per method with the noise floor")
    sections.append(("Validation: share vs measured Shapley (each point a request)", scatter))
    sections.append(("Validation: error CDF per rule", cdf))
    return sections


def markdown_summary(validation: dict) -> str:
    """The result's headline tables in Markdown (what docs/validation.md quotes), so the figures are regenerable."""
    summary = validation["summary"]
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}%"  # noqa: E731

    def cell(m: dict, q: int) -> str:
        ci = m.get(f"p{q}_ci95")
        return pct(m[f"p{q}"]) + (f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else "")

    lines = []
    for target, title in (("shapley", "measured Shapley value"), ("loo", "leave-one-out marginal cost")):
        lines += [f"|share − {title}| / measured step time:", "",
                  "| phase | method | requests | p50 [95% CI] | p90 [95% CI] | p99 [95% CI] | p90 gain vs token_proportional |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for phase, tables in summary["errors"].items():
            token_p90 = tables[target]["token_proportional"]["p90"]
            for method in ("shapley", "shapley_predicted", "proportional", "proportional_predicted", "paper", "token_proportional",
                           "equal_split", "kv_tokens_proportional", "measured_additive_fit"):
                m = tables[target].get(method)
                if not m:
                    continue
                gain = token_p90 / m["p90"] if m["p90"] else None
                lines.append(f"| {phase} | {method} | {m['n']} | {cell(m, 50)} | {cell(m, 90)} | {cell(m, 99)} | "
                             f"{'–' if gain is None else f'{gain:.2f}×'} |")
        lines.append("")
    lines += ["| phase | kind | requests | shapley p90 | token_proportional p90 | equal_split p90 | measured_additive_fit p90 |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for phase, kinds in summary["errors_by_kind"].items():
        for kind, t in kinds.items():
            lines.append(f"| {phase} | {kind} | {t['shapley']['n']} | {pct(t['shapley']['p90'])} | {pct(t['token_proportional']['p90'])} | "
                         f"{pct(t['equal_split']['p90'])} | {pct(t['measured_additive_fit']['p90'])} |")
    lines += ["", "| phase | noise floor of a measured Shapley value p50 / p90 / p99 | step repeat spread p50 / p90 / p99 | (Σ LOO − T) / T p10 / p50 / p90 |",
              "| --- | ---: | ---: | ---: |"]
    for phase in summary["errors"]:
        f = summary["noise_floor"]["shapley"][phase]
        st = summary["noise_floor"]["step"][phase]
        g = summary["loo_sum_gap_fraction"][phase]
        lines.append(f"| {phase} | {cell(f, 50)} / {cell(f, 90)} / {cell(f, 99)} ({f['n_batches']} batches) | "
                     f"{pct(st['p50'])} / {pct(st['p90'])} / {pct(st['p99'])} | {pct(g['p10'])} / {pct(g['p50'])} / {pct(g['p90'])} |")
    lines += ["", "| phase | additive fit RMS residual p50 / p90 | shared cost (additive fit) share of step p10 / p50 / p90 | model's subset-step error p50 / p90 |",
              "| --- | ---: | ---: | ---: |"]
    for phase, a in summary["additivity"].items():
        lines.append(f"| {phase} | {pct(a['rms_residual_fraction']['p50'])} / {pct(a['rms_residual_fraction']['p90'])} | "
                     f"{pct(a['intercept_fraction_of_step']['p10'])} / {pct(a['intercept_fraction_of_step']['p50'])} / {pct(a['intercept_fraction_of_step']['p90'])} | "
                     f"{pct(a['model_subset_rel_err']['p50'])} / {pct(a['model_subset_rel_err']['p90'])} |")
    lines += ["", "| phase | candidate non-additive term | coefficient (s per unit) | t | share of the additive residual explained |",
              "| --- | --- | ---: | ---: | ---: |"]
    for phase, d in summary.get("interactions", {}).items():
        for name, t in d["terms"].items():
            lines.append(f"| {phase} | {name} | {t['coef']:.3g} ± {t['std_err']:.2g} | {t['t']:.1f} | {pct(t['explained_fraction_of_additive_residual'])} |")
    return "\n".join(lines) + "\n"
