"""Hypothesis strategies for valid step traces a stranger could have recorded, for any test to reuse.

`stranger_traces()` draws what varies between recordings (1–6 runs of 1 to a few thousand steps; batch sizes;
pure prefill, pure decode or mixed chunked-prefill steps; tiny to very large token counts; step times from a
linear engine, unrelated to the work, constant, or tiny/huge; trace format 1 or 2 with the sharing columns;
episode, warm-up and drift columns or none; step ids that do not start at 0 or are not dense; names with
spaces, commas, quotes and non-ASCII text; JSONL, CSV or Parquet, one file or one per run; steps written out of order) and builds the
trace from those choices with a seeded numpy generator, so traces of thousands of steps cost one draw each.
Every trace is validated by the project's own reader (`build_trace`) and written by its writer
(`write_trace`), so a generated trace is valid by the contract of docs/trace-format.md by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from llmvisor.core.features import FEATURE_NAMES, slice_feature_matrix
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.core.trace import SHARING_COLUMNS, StepTrace, build_trace, sharing_columns_from_blocks, write_trace

NAMES = ("run-0", "sweep 1", "prod,eu", 'say "hi"', "ünïcödé-東京", "0", "R", "long-" + "x" * 60)
"""Run ids and tenants as strangers name them: spaces, commas, quotes, non-ASCII, digits only."""
TOKEN_SCALES = {"tiny": (4, 8), "normal": (512, 4096), "large": (65_536, 1_000_000)}
"""(most prefill tokens of a slice, most context tokens) per scale."""
SUFFIXES = (".jsonl", ".csv", ".parquet")


@dataclass(frozen=True)
class TraceChoices:
    """What one generated trace is made of (shown by hypothesis when a property fails)."""

    run_lengths: tuple[int, ...]
    max_batch_size: int
    phases: str
    token_scale: str
    latency: str
    sharing: bool
    episodes: int | None
    warmup: str
    drifted: bool
    optional_columns: bool
    first_step_id: int
    step_stride: int
    n_tenants: int
    names: tuple[str, ...]
    suffix: str
    shuffled: bool
    seed: int
    file_per_run: bool = False


@dataclass
class GeneratedTrace:
    """A valid trace and the file form it is written in."""

    choices: TraceChoices
    trace: StepTrace

    @property
    def run_ids(self) -> list[str]:
        return self.trace.run_ids

    @property
    def measured_s(self) -> float:
        return float(self.trace.step_latency_s_per_step.sum())

    def write(self, path_without_suffix: Path, run_ids: list[str] | None = None) -> Path:
        """Write the trace (or the runs ``run_ids``) with the project's writer in this trace's format; steps are
        written out of order when the choices say so (rows of a step stay together, as streaming needs)."""
        trace = self.trace if run_ids is None else self.trace.select_runs(run_ids)
        if self.choices.shuffled and trace.n_steps > 1:
            trace = trace.take_steps(np.random.default_rng(self.choices.seed).permutation(trace.n_steps))
        path = Path(f"{path_without_suffix}{self.choices.suffix}")
        write_trace(trace, path)
        return path

    def write_files(self, folder: Path, stem: str, run_ids: list[str] | None = None) -> list[Path]:
        """The runs ``run_ids`` (default all) in one file, or one file per run when the choices say so, the
        files' formats then taking turns (JSONL, CSV, Parquet), as a stranger's recordings might come."""
        runs = self.run_ids if run_ids is None else list(run_ids)
        if not self.choices.file_per_run:
            return [self.write(folder / stem, runs)]
        first = SUFFIXES.index(self.choices.suffix)
        return [
            GeneratedTrace(replace(self.choices, suffix=SUFFIXES[(first + i) % len(SUFFIXES)]), self.trace).write(folder / f"{stem}-{i}", [run])
            for i, run in enumerate(runs)
        ]

    def step_rows(self) -> list[list[dict]]:
        """The steps as lists of row dicts (the columns the service ingests), in step order."""
        table = self.trace.to_arrow()
        names = [n for n in table.column_names if n in _SERVICE_COLUMNS]
        columns = {name: table.column(name).to_pylist() for name in names}
        offsets = self.trace.step_offsets.tolist()
        return [
            [{name: columns[name][i] for name in names} for i in range(start, stop)] for start, stop in zip(offsets[:-1], offsets[1:])
        ]


_SERVICE_COLUMNS = (
    "run_id", "step_id", "step_latency_s", "request_id", "tenant", "num_new_tokens", "num_context_tokens", "phase",
    "timestamp_s", *SHARING_COLUMNS,
)


def _run_length():
    return st.one_of(st.integers(1, 12), st.integers(13, 80), st.integers(81, 300))


@st.composite
def trace_choices(draw, max_runs: int = 6, max_long_run: int = 3000) -> TraceChoices:
    n_runs = draw(st.integers(1, max_runs))
    lengths = [draw(_run_length()) for _ in range(n_runs)]
    if draw(st.sampled_from(range(12))) == 0:  # now and then one run of thousands of steps
        lengths[draw(st.integers(0, n_runs - 1))] = draw(st.integers(501, max_long_run))
    names = draw(st.permutations(NAMES))
    return TraceChoices(
        run_lengths=tuple(lengths),
        max_batch_size=draw(st.sampled_from([1, 2, 3, 8, 16, 32])),
        phases=draw(st.sampled_from(["decode", "prefill", "mixed", "any"])),
        token_scale=draw(st.sampled_from(list(TOKEN_SCALES))),
        latency=draw(st.sampled_from(["engine", "unrelated", "constant", "tiny", "huge"])),
        sharing=draw(st.booleans()),
        episodes=draw(st.none() | st.integers(1, 60)),
        warmup=draw(st.sampled_from(["none", "first", "random", "all"])),
        drifted=draw(st.booleans()),
        optional_columns=draw(st.booleans()),
        first_step_id=draw(st.sampled_from([0, 1, 17, -1000, 2**40])),
        step_stride=draw(st.integers(1, 3)),
        n_tenants=draw(st.integers(1, 5)),
        names=tuple(names),
        suffix=draw(st.sampled_from(SUFFIXES)),
        shuffled=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
        file_per_run=draw(st.booleans()),
    )


def stranger_traces(max_runs: int = 6, max_long_run: int = 3000):
    """Valid traces (a `GeneratedTrace`) of 1–``max_runs`` runs, mostly of up to 300 steps, now and then one of up
    to ``max_long_run``."""
    return trace_choices(max_runs, max_long_run).map(build_generated_trace)


def build_generated_trace(choices: TraceChoices) -> GeneratedTrace:
    rng = np.random.default_rng(choices.seed)
    runs = [_run_columns(choices, rng, k, n_steps) for k, n_steps in enumerate(choices.run_lengths)]
    columns = {name: np.concatenate([run[name] for run in runs]) for name in runs[0]}
    trace = build_trace(columns, path="<generated>")
    return GeneratedTrace(choices=choices, trace=trace)


def _run_columns(choices: TraceChoices, rng: np.random.Generator, k: int, n_steps: int) -> dict[str, np.ndarray]:
    """One run's columns: per step a batch of slices of the chosen phases, then its step time."""
    max_new, max_context = TOKEN_SCALES[choices.token_scale]
    batch = rng.integers(1, choices.max_batch_size + 1, size=n_steps)
    offsets = np.concatenate(([0], np.cumsum(batch)))
    n = int(offsets[-1])
    step_of_slice = np.repeat(np.arange(n_steps), batch)
    slot = np.arange(n) - offsets[:-1][step_of_slice]
    if choices.phases == "decode":
        is_prefill = np.zeros(n, dtype=bool)
    elif choices.phases == "prefill":
        is_prefill = np.ones(n, dtype=bool)
    elif choices.phases == "mixed":  # a chunked prefill beside the decodes of every step (a lone slice is a prefill)
        is_prefill = (slot == 0) | (rng.random(n) < 0.1)
    else:
        kind = rng.integers(0, 3, size=n_steps)[step_of_slice]  # 0 decode-only, 1 prefill-only, 2 mixed
        is_prefill = (kind == 1) | ((kind == 2) & ((slot == 0) | (rng.random(n) < 0.3)))
    new_tokens = np.where(is_prefill, _log_uniform_int(rng, 1, max_new, n), 1)
    context = _log_uniform_int(rng, 0, max_context, n)
    context[is_prefill & (rng.random(n) < 0.5)] = 0  # whole prompts and chunks over cached context
    columns: dict[str, np.ndarray] = {}
    if choices.sharing:
        shared, effective = _sharing(rng, context, offsets)
        columns["num_shared_context_tokens"], columns["effective_context_tokens"] = shared, effective
    latency = _step_latency(choices, rng, new_tokens, context, is_prefill, columns.get("effective_context_tokens"), offsets)
    names = choices.names
    step_ids = choices.first_step_id + choices.step_stride * np.arange(n_steps, dtype=np.int64)
    columns.update(
        {
            "run_id": np.full(n, names[k], dtype=object),
            "step_id": step_ids[step_of_slice],
            "step_latency_s": latency[step_of_slice],
            "request_id": np.array([f"req-{s}" for s in slot.tolist()], dtype=object),
            "tenant": np.array([names[(s % choices.n_tenants + k) % len(names)] for s in slot.tolist()], dtype=object),
            "num_new_tokens": new_tokens.astype(np.int64),
            "num_context_tokens": context.astype(np.int64),
            "phase": np.where(is_prefill, "prefill", "decode").astype(object),
        }
    )
    if choices.episodes is not None:
        columns["episode"] = (np.arange(n_steps) // choices.episodes)[step_of_slice]
    warm = np.zeros(n_steps, dtype=bool)
    if choices.warmup == "first":
        warm[: int(rng.integers(0, max(1, n_steps // 3) + 1))] = True
    elif choices.warmup == "random":
        warm = rng.random(n_steps) < 0.2
    elif choices.warmup == "all":  # the first run is warm-up throughout, each other one by a coin toss
        warm[:] = k == 0 or rng.random() < 0.5
    if choices.warmup != "none":
        columns["is_warmup"] = warm[step_of_slice]
    if choices.drifted:
        columns["is_drifted"] = (rng.random(n_steps) < 0.05)[step_of_slice]
    if choices.optional_columns:
        start_s = 1.7e9 + 1e4 * k
        columns["timestamp_s"] = (start_s + np.cumsum(latency) - latency)[step_of_slice]
        columns["engine"] = np.full(n, "vllm", dtype=object)
        columns["engine_fingerprint"] = np.full(n, "0123456789abcdef", dtype=object)
        columns["hardware"] = np.full(n, "generated", dtype=object)
    return columns


def _log_uniform_int(rng: np.random.Generator, low: int, high: int, size: int) -> np.ndarray:
    """Integers in [low, high], spread over every order of magnitude (tiny and large counts both occur)."""
    values = np.floor(np.exp(rng.uniform(0.0, np.log(high - low + 2), size=size))).astype(np.int64) - 1 + low
    return np.clip(values, low, high)


def _sharing(rng: np.random.Generator, context: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The format-2 columns: in about half the steps, a group of two or more slices with context reads a common
    prefix (one or two blocks), computed by the project's `sharing_columns_from_blocks`."""
    shared = np.zeros(context.shape[0], dtype=np.int64)
    effective = context.astype(np.float64)
    for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        readers = np.flatnonzero(context[start:stop] > 0)
        if readers.size < 2 or rng.random() < 0.5:
            continue
        group = rng.choice(readers, size=int(rng.integers(2, readers.size + 1)), replace=False)
        prefix = int(rng.integers(1, int(context[start:stop][group].min()) + 1))
        blocks = [(prefix, group)]
        if group.size > 2 and rng.random() < 0.5:  # a longer prefix shared by part of the group
            inner = group[: group.size - 1]
            extra = int(context[start:stop][inner].min()) - prefix
            if extra > 0:
                blocks.append((int(rng.integers(1, extra + 1)), inner))
        s, e = sharing_columns_from_blocks(context[start:stop], blocks)
        shared[start:stop], effective[start:stop] = s, e
    return shared, effective


def _step_latency(choices, rng, new_tokens, context, is_prefill, effective, offsets) -> np.ndarray:
    n_steps = offsets.shape[0] - 1
    if choices.latency == "engine":
        coef = np.array([DEFAULT_COEF_S.get(name, 0.0) for name in FEATURE_NAMES])
        x = slice_feature_matrix(new_tokens, context, is_prefill, effective)
        latency = (np.add.reduceat(x @ coef, offsets[:-1]) + coef[0]) * rng.lognormal(0.0, 0.05, size=n_steps)
    elif choices.latency == "unrelated":
        latency = rng.lognormal(-4.0, 1.5, size=n_steps)
    elif choices.latency == "constant":
        latency = np.full(n_steps, 0.025)
    elif choices.latency == "tiny":
        latency = rng.uniform(1e-5, 1e-4, size=n_steps)
    else:
        latency = rng.uniform(100.0, 3600.0, size=n_steps)
    return latency.astype(np.float64)
