"""How long a profiling sweep will take, estimated from its first measured episodes, and its progress lines.

A sweep's episodes differ widely in cost (a pool of long prompts against a few decode steps), and one machine
can be 70 times slower than another on the same plan (vLLM's CPU build without oneDNN), so neither a fixed
figure nor episodes per second says how long a sweep takes. `SweepClock` knows each episode's plan before it
runs: its prompt tokens and its steps (prefill chunks under the episode's token budget, plus its decode
steps). Once three episodes are measured it fits an episode's seconds as a fixed cost plus a cost per prompt
token plus a cost per step (non-negative least squares over the measured episodes) and prices the episodes
left; before that, it scales the time so far by the work left, a prompt token and a step counting alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import nnls

MIN_EPISODES_FOR_FIT = 3
LINE_EVERY_S = 30.0
"""`SweepProgress` prints a line after the first episode, then at most every this many seconds, and at the end."""


def episode_work(episode) -> tuple[float, float]:
    """(prompt tokens, steps) an episode of `llmvisor.profile.plans` asks for."""
    tokens = float(episode.num_prompt_tokens)
    steps = math.ceil(tokens / max(1, episode.token_budget)) + float(episode.num_decode_steps)
    return tokens, float(steps)


def format_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class SweepClock:
    """The measured seconds of a sweep's episodes, in order, and the estimate of the time left."""

    def __init__(self, work: Sequence[tuple[float, float]]):
        self.work = np.asarray(work, dtype=np.float64).reshape(-1, 2)
        self.seconds: list[float] = []

    @classmethod
    def for_episodes(cls, episodes, repeat: int = 1) -> SweepClock:
        return cls([episode_work(e) for e in episodes] * repeat)

    @property
    def n_done(self) -> int:
        return len(self.seconds)

    @property
    def n_total(self) -> int:
        return int(self.work.shape[0])

    @property
    def elapsed_s(self) -> float:
        return float(sum(self.seconds))

    def record(self, seconds: float) -> None:
        self.seconds.append(float(seconds))

    def remaining_s(self) -> float | None:
        """Seconds the episodes not yet measured should take; None before the first one is measured."""
        done = self.n_done
        if done == 0:
            return None
        left = self.work[done:]
        if left.shape[0] == 0:
            return 0.0
        measured = np.asarray(self.seconds)
        if done >= MIN_EPISODES_FOR_FIT:
            design = np.column_stack([np.ones(done), self.work[:done]])
            coef, _ = nnls(design, measured)
            if np.any(coef > 0):
                return float((np.column_stack([np.ones(left.shape[0]), left]) @ coef).sum())
        done_units = float(self.work[:done].sum())
        return float(measured.sum() * left.sum() / done_units) if done_units > 0 else float(measured.mean() * left.shape[0])

    def line(self, label: str = "sweep") -> str:
        remaining = self.remaining_s()
        text = f"{label}: episode {self.n_done} of {self.n_total} done after {format_duration(self.elapsed_s)}"
        if remaining is None or self.n_done == self.n_total:
            return text
        how = "fitted on" if self.n_done >= MIN_EPISODES_FOR_FIT else "scaled from"
        return (f"{text}; about {format_duration(remaining)} left (about {format_duration(self.elapsed_s + remaining)} "
                f"in all), {how} the {self.n_done} episode{'s' if self.n_done > 1 else ''} measured")


class SweepProgress:
    """Prints `SweepClock.line` after the first episode, then at most every ``every_s`` of sweep time, and after
    the last, through ``print_line`` (a console's print: lines land in a log as on a terminal)."""

    def __init__(self, clock: SweepClock, print_line: Callable[[str], None], *, every_s: float = LINE_EVERY_S, label: str = "sweep"):
        self.clock = clock
        self.print_line = print_line
        self.every_s = every_s
        self.label = label
        self._last_line_at_s: float | None = None

    def episode_done(self, seconds: float) -> None:
        self.clock.record(seconds)
        now = self.clock.elapsed_s
        if self._last_line_at_s is None or now - self._last_line_at_s >= self.every_s or self.clock.n_done == self.clock.n_total:
            self._last_line_at_s = now
            self.print_line(self.clock.line(self.label))
