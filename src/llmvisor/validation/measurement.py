"""Measuring the subset games on an engine, resumably, with a guard against other work on the machine.

For a batch B, the engine runs every non-empty subset S ⊆ B as one step of its own (each request with the
same new and context tokens as in B), ``repeat`` times: T(S). Measurements are appended to a JSONL journal
(`Journal`) as each batch-round finishes; a re-run with the same journal measures only what is missing.

The engine is anything that satisfies `Measurer` (on vLLM: `llmvisor.engines.vllm.controlled.ControlledEngine`);
this module imports no engine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from llmvisor.errors import LlmvisorError
from llmvisor.validation.game import members, prefix_masks
from llmvisor.validation.plans import BatchSpec, Phase, SampledBatchSpec, SampledKind

JOURNAL_FORMAT = "llmvisor.validation.journal"


class RecordedSlice(Protocol):
    """One request's part of a step as the engine recorded it (a ``num_shared_context_tokens``, the trace's
    shared-KV column, is read too where the slice has one)."""

    @property
    def num_context_tokens(self) -> int: ...


class StepResult(Protocol):
    """One controlled step: its time, what actually ran, and whether that was the intended batch."""

    @property
    def step_latency_s(self) -> float: ...

    @property
    def recorded(self) -> Sequence[RecordedSlice]:
        """The requests that ran, in the order they were asked for."""

    @property
    def matches(self) -> bool:
        """True when exactly the intended requests ran, with the intended tokens, as one engine step."""

    @property
    def reason(self) -> str:
        """Why the step did not match (empty when it did)."""


@runtime_checkable
class Measurer(Protocol):
    """What `measure` needs from an engine: run a chosen batch as exactly one step and time it.

    A decode batch is first prefilled to its contexts (``prepare_decode``, returning an opaque handle); then
    any subset of it (``members``: indices into the contexts) runs as one decode step, each run growing a
    member's context by one token, until ``release``. ``canary_step`` runs a fixed reference step (a small
    prefill) and must leave a held decode batch held. A measurer whose ``holds_contexts`` is true leaves every member
    at its prepared context instead (`HeldContexts` then prepares a batch once for all its batch-rounds).
    """

    def prefill_step(self, prompt_lengths: list[int]) -> StepResult: ...

    def canary_step(self) -> StepResult: ...

    def prepare_decode(self, context_lengths: list[int], *, max_decode_steps: int) -> Any: ...

    def decode_step(self, batch: Any, members: list[int]) -> StepResult: ...

    def release(self, batch: Any) -> None: ...


class HeldContexts:
    """The decode (or mixed) batch the measurer holds, kept across batch-rounds while the next round needs the same
    contexts (the batch's other chunks, its replicate round, the other batches of its pool), where the measurer's
    ``holds_contexts`` says decode steps leave them as prepared; otherwise prepared afresh and released per round."""

    def __init__(self, measurer: Measurer) -> None:
        self.measurer = measurer
        self.keep = bool(getattr(measurer, "holds_contexts", False))
        self.key: tuple | None = None
        self.handle: Any = None
        self.n_prepared = 0

    def acquire(self, key: tuple, prepare: Callable[[], Any]) -> Any:
        if self.keep and self.handle is not None and key == self.key:
            return self.handle
        self.release()
        self.handle, self.key = prepare(), key
        self.n_prepared += 1
        return self.handle

    def round_done(self) -> None:
        if not self.keep:
            self.release()

    def release(self) -> None:
        if self.handle is not None:
            handle, self.handle, self.key = self.handle, None, None
            self.measurer.release(handle)


class MixedMeasurer(Measurer, Protocol):
    """A measurer that also runs mixed steps: a prefill chunk (member 0: ``chunk_tokens`` new over ``cached_tokens``
    of cached context) co-batched with held decodes. Every run of member 0 must run the same chunk over the same
    cached context (the measurer re-presents it); decodes grow by one token per run, as in ``decode_step``."""

    def prepare_mixed(self, chunk_tokens: int, cached_tokens: int, decode_contexts: list[int], *, max_decode_steps: int) -> Any: ...

    def mixed_step(self, batch: Any, members: list[int]) -> StepResult: ...


class SharedPrefixMeasurer(Measurer, Protocol):
    """A measurer that also holds decode batches whose contexts share a cached prefix: the prompts share their first
    ``shared_prefix_tokens`` tokens and the engine holds those KV blocks once. ``decode_step`` on such a batch must
    run a step in which the blocks are really shared among the step's members (two or more of them), else not match."""

    def prepare_shared_decode(self, context_lengths: list[int], shared_prefix_tokens: int, *, max_decode_steps: int) -> Any: ...


class GroupedPrefixMeasurer(Measurer, Protocol):
    """A measurer that holds decode batches in several prefix groups: request i's prompt starts with its group's
    prefix of ``shared_prefix_tokens[i]`` tokens (group −1: its own context); the engine holds each group's blocks once,
    and a step shares a group's blocks only among that group's members in it (two or more)."""

    def prepare_grouped_decode(self, context_lengths: list[int], shared_prefix_tokens: list[int], prefix_groups: list[int], *,
                               max_decode_steps: int) -> Any: ...


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
    num_shared_context_tokens: list[int] | None = None
    """Recorded context tokens of each member in KV blocks another member of the step read too (None: none shared)."""


class Journal:
    """Append-only JSONL of measurements; reading it back tells a resumed run what is already measured."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.measurements: dict[tuple[str, int, int], list[Measurement]] = {}
        self.n_rejected = 0
        self.interference: list[dict] = []
        self.canary_s: list[float] = []
        self.round_timing: list[dict] = []
        """Where each batch-round's wall time went (`_measure_batch_round`), for rounds journaled with it."""
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
            self.round_timing.extend(dict(t) for t in row.get("timing", []))
        elif kind == "measurement":
            m = Measurement(
                str(row["batch_key"]), int(row["round"]), int(row["subset"]), int(row["repeat"]),
                float(row["step_latency_s"]), [int(c) for c in row["num_context_tokens"]], bool(row.get("interference", False)),
                [int(c) for c in row["num_shared_context_tokens"]] if row.get("num_shared_context_tokens") is not None else None,
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
        self.log({"type": "measurement", **{k: v for k, v in asdict(m).items() if v is not None}})

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


def missing_sampled_steps(batches: Iterable[SampledBatchSpec], journal: Journal, repeat: int) -> int:
    """Subset steps of sampled batches still to measure (each distinct prefix ``repeat`` times)."""
    return sum(
        max(0, repeat - len(journal.get(b, r, s))) for b in batches for r in range(b.rounds) for s in b.subsets(r)
    )


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
    carry_s: float = 0.5
    """0: every batch-round runs its opening canary (the rule before carrying, and for results measured under it)."""
    carried: tuple[bool, float] | None = None
    """(passed, when: ``time.perf_counter()``) of the canary that closed the last batch-round or ended a wait: a
    batch-round that begins within ``carry_s`` of it opens with it instead of running another back to back."""

    @property
    def baseline_s(self) -> float:
        return float(np.median(self.accepted_s[-self.window :]))

    def _canary(self, measurer: Measurer) -> float:
        step = measurer.canary_step()
        if not step.matches:
            raise LlmvisorError(f"canary step did not run as intended: {step.reason}")
        t = float(step.step_latency_s)
        self.all_s.append(t)
        return t

    def calibrate(self, measurer: Measurer) -> None:
        times = sorted(self._canary(measurer) for _ in range(self.calibration))
        # The lower half: a calibration caught in interference would otherwise pass everything.
        self.accepted_s = times[: max(1, (len(times) + 1) // 2)]

    def check(self, measurer: Measurer) -> tuple[bool, float]:
        t = self._canary(measurer)
        ok = t <= (1 + self.tolerance) * self.baseline_s
        if ok:
            self.accepted_s.append(t)
        return ok, t

    def opening(self) -> bool | None:
        """Whether the canary carried from just before passed (None: none to carry; run one); used once."""
        carried, self.carried = self.carried, None
        if carried is None or self.carry_s <= 0 or time.perf_counter() - carried[1] > self.carry_s:
            return None
        return carried[0]

    def closed(self, ok: bool) -> None:
        """The canary just run closed a batch-round (or a wait): the next batch-round may open with it."""
        self.carried = (ok, time.perf_counter())

    def wait_quiet(self, measurer: Measurer, sleep: Callable[[float], None]) -> bool:
        """Poll canaries until ``quiet_needed`` pass in a row; False if ``max_wait_s`` passed first."""
        waited, streak = 0.0, 0
        self.carried = None
        while waited < self.max_wait_s:
            ok, _ = self.check(measurer)
            streak = streak + 1 if ok else 0
            if streak >= self.quiet_needed:
                self.closed(True)
                return True
            sleep(self.poll_s)
            waited += self.poll_s
        return False


def measure(
    measurer: Measurer,
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
    check_repeat(repeat)
    by_index = {b.index: b for b in batches}
    todo = missing_measurements(batches, journal, repeat)
    sleep, progress, counts = _begin(measurer, journal, guard, bool(todo), on_step, sleep)
    counts["reused"] = sum(
        min(repeat, len(journal.get(b, r, s))) for b in batches for r in range(b.rounds) for s in range(1, 1 << b.size)
    )
    held = HeldContexts(measurer)
    try:
        for (index, round_), masks in todo.items():
            batch = by_index[index]
            rng = np.random.default_rng([seed, index, round_, len(masks)])
            order = [masks[i] for i in rng.permutation(len(masks))]
            _measure_guarded(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress, counts, sleep, held)
    finally:
        held.release()
    counts["preparations"] = held.n_prepared
    return counts


def check_repeat(repeat: int) -> None:
    if repeat < 1:
        raise LlmvisorError(f"--repeat: must be at least 1 (got {repeat})")


SAME_MACHINE_MAX_RATIO = 3.0
"""How much slower or faster than in a journal's earlier runs the canary may run before `check_same_machine` refuses."""


def check_same_machine(journal: Journal, baseline_s: float, *, max_ratio: float = SAME_MACHINE_MAX_RATIO) -> None:
    """Refuse to add to a journal measured on a machine this one is not: the guard's new baseline canary (the lower
    half of its calibration) against the median of every canary the journal holds. Interference slows a canary for
    seconds, not a whole calibration's lower half; a host without the earlier one's vector units (a bf16 matmul
    emulated) or another engine build moves it many times over, and its steps would join batches measured elsewhere."""
    earlier = journal.canary_s
    if len(earlier) < 5 or not baseline_s > 0:
        return
    reference = float(np.median(earlier))
    ratio = baseline_s / reference
    if 1 / max_ratio <= ratio <= max_ratio:
        return
    how = f"{ratio:.1f}× slower" if ratio > 1 else f"{1 / ratio:.1f}× faster"
    raise LlmvisorError(
        f"{journal.path}: the canary step runs {how} here ({baseline_s:.3g} s) than in the journal's earlier runs "
        f"({reference:.3g} s, median of {len(earlier)}): another machine or engine build. A journal holds one machine's "
        "measurements; measure into a new one (another -o RESULT.json)")


def _begin(measurer: Measurer, journal: Journal, guard: InterferenceGuard | None, anything_to_measure: bool,
           on_step: Callable[[int], None] | None, sleep: Callable[[float], None] | None) -> tuple[Callable, Callable, dict]:
    """What both measuring loops start with: the guard's baseline canaries (journaled, once, if anything is to be
    measured), the sleep and progress callbacks, and the counts they return."""
    if guard is not None and anything_to_measure and not guard.accepted_s:
        guard.calibrate(measurer)
        check_same_machine(journal, guard.baseline_s)
        journal.log({"type": "canaries", "calibration": True, "canary_s": guard.all_s[:], "baseline_s": guard.baseline_s})
    counts = {"measured_now": 0, "rejected_now": 0, "discarded_batch_rounds": 0, "flagged_batch_rounds": 0, "reused": 0}
    return sleep or time.sleep, on_step or (lambda n: None), counts


def _measure_guarded(measurer, batch, round_: int, order: list[int], journal: Journal, max_attempts: int, warm_up_steps: int,
                     guard: InterferenceGuard | None, progress, counts: dict, sleep, held: HeldContexts) -> None:
    """One batch-round's steps (``order``: subset masks), redone while the guard sees interference; then journaled."""
    spent: list[dict] = []
    for redo in range(guard.max_redos + 1 if guard else 1):
        timing: dict = {}
        taken, canaries, clean = _measure_batch_round(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress,
                                                      counts, timing, held)
        spent.append({k: round(v, 4) for k, v in timing.items()})
        if clean or redo == (guard.max_redos if guard else 0):
            break
        counts["discarded_batch_rounds"] += 1
        journal.log({"type": "interference", "batch_key": batch.key, "round": round_, "canary_s": canaries,
                     "baseline_s": guard.baseline_s, "tolerance": guard.tolerance, "discarded_steps": len(taken)})
        progress(-len(taken))
        waited = time.perf_counter()
        guard.wait_quiet(measurer, sleep)
        spent[-1]["wait_after_s"] = round(time.perf_counter() - waited, 4)
    if not clean:
        counts["flagged_batch_rounds"] += 1
    if guard is not None:
        journal.log({"type": "canaries", "batch_key": batch.key, "round": round_, "canary_s": canaries, "baseline_s": guard.baseline_s,
                     "timing": spent})
    for m in taken:
        m.repeat = len(journal.get(batch, m.round, m.subset))
        m.interference = not clean
        journal.add(m)
    counts["measured_now"] += len(taken)


def measure_sampled(
    measurer: Measurer,
    batches: list[SampledBatchSpec],
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
    """Measure serving-size batches order by order: each prefix of each sampled order is a controlled step.

    Prefixes are subsets, so the journal (keyed by subset) measures a subset shared by several orders (the full
    batch, at least) once. One order at a time is one guarded batch-round (a decode batch is prepared afresh
    per order, so a context grows by at most ``size × repeat`` tokens while it is measured). Mixed batches need
    a measurer with ``prepare_mixed`` / ``mixed_step``, shared-prefix decode batches one with ``prepare_shared_decode``.
    """
    check_repeat(repeat)
    for batch in batches:
        if batch.kind == SampledKind.MIXED_SHARING_DECODE and not hasattr(measurer, "prepare_grouped_decode"):
            raise LlmvisorError(f"batch {batch.index}: mixed-sharing decode batches need a measurer with prepare_grouped_decode "
                                f"({type(measurer).__name__} has none)")
        if batch.kind == SampledKind.SHARED_PREFIX_DECODE:
            common_prefix_tokens(batch)
            if not hasattr(measurer, "prepare_shared_decode"):
                raise LlmvisorError(f"batch {batch.index}: shared-prefix decode batches need a measurer with prepare_shared_decode "
                                    f"({type(measurer).__name__} has none)")
        if batch.kind == SampledKind.MIXED and not hasattr(measurer, "mixed_step"):
            raise LlmvisorError(f"batch {batch.index}: mixed steps need a measurer with prepare_mixed/mixed_step "
                                f"({type(measurer).__name__} has none)")
    sleep, progress, counts = _begin(measurer, journal, guard, True, on_step, sleep)
    held = HeldContexts(measurer)
    try:
        _measure_sampled_batches(measurer, batches, journal, repeat, max_attempts, warm_up_steps, seed, guard, progress, counts, sleep, held)
    finally:
        held.release()
    counts["preparations"] = held.n_prepared
    return counts


def _measure_sampled_batches(measurer, batches, journal, repeat, max_attempts, warm_up_steps, seed, guard, progress, counts, sleep,
                             held: HeldContexts) -> None:
    for batch in batches:
        if batch.coalitions:
            # the coalitions design: each chunk of coalitions (pairs together) is one guarded batch-round
            for round_ in range(batch.rounds):
                for k, chunk in enumerate(batch.chunks(round_)):
                    todo = []
                    for subset in chunk:
                        have = len(journal.get(batch, round_, subset))
                        counts["reused"] += min(have, repeat)
                        todo += [subset] * max(0, repeat - have)
                    if not todo:
                        continue
                    rng = np.random.default_rng([seed, batch.index, round_, k, 7])
                    order = [todo[i] for i in rng.permutation(len(todo))]
                    _measure_guarded(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress, counts, sleep, held)
            continue
        masks = prefix_masks(np.array(batch.orders, dtype=np.int64))
        for round_ in range(batch.rounds):
            for k, prefixes in enumerate(masks):
                todo = []
                for subset in dict.fromkeys(int(m) for m in prefixes):
                    have = len(journal.get(batch, round_, subset))
                    counts["reused"] += min(have, repeat)
                    todo += [subset] * max(0, repeat - have)
                if not todo:
                    continue
                rng = np.random.default_rng([seed, batch.index, round_, k])
                order = [todo[i] for i in rng.permutation(len(todo))]
                _measure_guarded(measurer, batch, round_, order, journal, max_attempts, warm_up_steps, guard, progress, counts, sleep, held)


def common_prefix_tokens(batch: SampledBatchSpec) -> int:
    """The one prefix length a shared-prefix decode batch's requests share (every request shares it)."""
    return _one_prefix(batch.index, batch.shared_prefix_tokens)


def _one_prefix(index: int, prefix_tokens) -> int:
    lengths = set(prefix_tokens)
    if len(lengths) != 1 or 0 in lengths:
        raise LlmvisorError(f"batch {index}: a shared-prefix decode batch needs one prefix shared by every request "
                            f"(got prefix lengths {sorted(lengths)})")
    return lengths.pop()


def _measure_batch_round(
    measurer: Measurer,
    batch: BatchSpec,
    round_: int,
    order: list[int],
    journal: Journal,
    max_attempts: int,
    warm_up_steps: int,
    guard: InterferenceGuard | None,
    progress: Callable[[int], None],
    counts: dict,
    timing: dict,
    held: HeldContexts,
) -> tuple[list[Measurement], list[float], bool]:
    """One pass over a batch-round's subset steps; returns (measurements, canary times, no interference) and puts in
    ``timing`` where its wall time went: preparing (prefill of the held contexts, a canary), all of it, and the
    measured steps' own time."""
    full = (1 << batch.size) - 1
    taken: list[Measurement] = []
    canaries: list[float] = []
    clean = True
    begun = time.perf_counter()

    def canary() -> bool:
        nonlocal clean
        ok, t = guard.check(measurer)
        canaries.append(t)
        clean &= ok
        return ok

    if guard is not None:
        carried = guard.opening()  # the canary that closed the previous batch-round, if it ran just now
        if carried is None:
            canary()
        else:
            clean &= carried
    prepared = held.n_prepared
    pooled = bool(getattr(batch, "pool_index", ()))
    contexts = list(batch.pool_context_tokens) if pooled else list(batch.num_context_tokens)
    shared_prefix = list(batch.pool_shared_prefix_tokens) if pooled else list(getattr(batch, "shared_prefix_tokens", ()))
    groups = list(batch.pool_groups) if pooled else list(getattr(batch, "groups", ()))

    def held_members(subset: int) -> list[int]:
        """The step's requests as positions in what is held (a pool's, or the batch's own)."""
        return batch.pool_members(members(subset, batch.size)) if pooled else members(subset, batch.size)

    runs_per_request = max(sum(1 for m in order if m >> i & 1) for i in range(batch.size))
    steps = runs_per_request + warm_up_steps + 4 * max_attempts
    if batch.phase in (SampledKind.MIXED_SHARING_DECODE, SampledKind.SHARED_PREFIX_DECODE, Phase.DECODE):
        def prepare():
            if batch.phase == SampledKind.MIXED_SHARING_DECODE:
                return measurer.prepare_grouped_decode(contexts, shared_prefix, groups, max_decode_steps=steps)
            if batch.phase == SampledKind.SHARED_PREFIX_DECODE:
                return measurer.prepare_shared_decode(contexts, _one_prefix(batch.index, shared_prefix), max_decode_steps=steps)
            return measurer.prepare_decode(contexts, max_decode_steps=steps)

        # a pool's batches share its held contexts; any other batch (a replicate batch too) is prepared for itself
        handle = held.acquire(("pool", tuple(contexts), tuple(shared_prefix), tuple(groups)) if pooled else (batch.key,), prepare)

        def run(subset):
            return measurer.decode_step(handle, held_members(subset))
    elif batch.phase == SampledKind.MIXED:
        handle = held.acquire(
            (batch.key,),
            lambda: measurer.prepare_mixed(batch.num_new_tokens[0], batch.num_context_tokens[0], list(batch.num_context_tokens[1:]),
                                           max_decode_steps=steps))

        def run(subset):
            return measurer.mixed_step(handle, members(subset, batch.size))
    else:
        held.release()  # a prefill batch's steps run with nothing held, as they always did
        handle = None

        def run(subset):
            return measurer.prefill_step([batch.num_new_tokens[i] for i in members(subset, batch.size)])
    timing["prepare_s"] = time.perf_counter() - begun
    try:
        # a batch held from the previous batch-round ran its steps just now; a fresh one (or a prefill batch) warms up
        for _ in range(warm_up_steps if handle is None or held.n_prepared != prepared else 0):
            run(full)
        for j, subset in enumerate(order):
            for _attempt in range(max_attempts):
                step = run(subset)
                if step.matches:
                    shared = [int(getattr(s, "num_shared_context_tokens", 0)) for s in step.recorded]
                    taken.append(
                        Measurement(batch.key, round_, subset, 0, float(step.step_latency_s), [int(s.num_context_tokens) for s in step.recorded],
                                    num_shared_context_tokens=shared if any(shared) else None)
                    )
                    break
                journal.reject(batch, subset, step.reason)
                counts["rejected_now"] += 1
            else:
                raise LlmvisorError(
                    f"batch {batch.index}: subset {members(subset, batch.size)} did not run as the intended step "
                    f"in {max_attempts} attempts (last: {step.reason})"
                )
            progress(1)
            if guard is not None and (j + 1) % guard.every == 0 and j + 1 < len(order):
                canary()
        if guard is not None:
            guard.closed(canary())
    finally:
        if handle is not None:
            held.round_done()
    timing["round_wall_s"] = time.perf_counter() - begun
    timing["steps_s"] = sum(m.step_latency_s for m in taken)
    return taken, canaries, clean


def guard_rule(guard: InterferenceGuard | None = None) -> str:
    g = guard or InterferenceGuard()
    return (
        "a fixed canary step (128-token prefill) before and after every batch-round"
        + (f" (the one closing a batch-round also opens the next when that begins within {g.carry_s:g} s)" if g.carry_s > 0 else "")
        + f" and after every {g.every} subset steps; "
        f"a batch-round with a canary over {1 + g.tolerance:g} × the baseline (median of the last {g.window} passing canaries) "
        f"is discarded and measured again once {g.quiet_needed} canaries in a row pass (at most {g.max_redos} redos, then kept and flagged)"
    )
