"""A profile measures its own drift: the same small canary episode runs before the sweep, every few episodes
and after it; each run of it repeats the same steps (same prompts lengths, same decode subsets), so a change
in their times is the machine changing (another process, frequency, thermal), not the workload.

Rule (`canary_drift`): per step position of the canary, the baseline is the median time over all its runs;
a run's drift is the median over positions of time / baseline − 1. A run drifts when |drift| exceeds the cut:
``threshold`` (default 10%; the noise floor of identical steps on a shared 2-core machine is about 3% at the
median), or ``SPREAD_FACTOR`` robust standard deviations of the runs' drifts (1.4826 × their median absolute
deviation) when that is larger. The second term is why: drift is a change of the machine's state during the
profile (another process, frequency, thermal), which leaves the steps beside it out of line with the rest;
on a machine whose speed swings back and forth by more than the threshold all the time, every canary is off
by about as much, no stretch of the profile is out of line with the others, and dropping the canaries past
10% would drop most of the profile at random without making the rest any steadier. Every step between a
drifted canary run and its neighbouring runs (the sweep episodes it brackets, and the canary's own steps) is
flagged ``is_drifted``; the fit leaves them out and counts them (``fit_info_["n_drifted_dropped"]``).
"""

from __future__ import annotations

import re

import numpy as np

from llmvisor.core.trace import StepTrace
from llmvisor.profile.plans import Envelope, Episode

CANARY_INDEX_BASE = 100_000
CANARY_SEED = 20_251_201
DEFAULT_DRIFT_THRESHOLD = 0.10
SPREAD_FACTOR = 3.0
CANARY_REQUEST = re.compile(r"^sweep-e(\d+)-r(\d+)-")


def canary_episode(envelope: Envelope, occurrence: int) -> Episode:
    """The fixed canary: four 64-token prompts prefilled in one step, then eight decode steps with the same
    seeded decode subsets every time (only the index, hence the request ids, differs)."""
    n_prompts = max(1, min(4, envelope.max_num_seqs))
    prompt_len = max(8, min(64, envelope.max_model_len // 4))
    budget = max(n_prompts * prompt_len, min(512, envelope.max_num_batched_tokens))
    return Episode(
        index=CANARY_INDEX_BASE + occurrence,
        seed=CANARY_SEED,
        prompt_lens=(prompt_len,) * n_prompts,
        token_budget=min(budget, envelope.max_num_batched_tokens),
        num_decode_steps=8,
        wave_prompt_lens=(),
    )


def with_canaries(episodes: list[Episode], envelope: Envelope, every: int) -> list[Episode]:
    """The sweep's episodes with a canary before the first, after every ``every`` episodes and after the last."""
    if every <= 0 or not episodes:
        return list(episodes)
    out: list[Episode] = []
    occurrence = 0
    for k, episode in enumerate(episodes):
        if k % every == 0:
            out.append(canary_episode(envelope, occurrence))
            occurrence += 1
        out.append(episode)
    out.append(canary_episode(envelope, occurrence))
    return out


def is_canary_episode(episode: Episode) -> bool:
    return episode.index >= CANARY_INDEX_BASE


def canary_run_per_step(trace: StepTrace) -> np.ndarray:
    """Per step, the canary run (occurrence × repeat, as a sortable key) whose requests it runs, or -1."""
    keys = np.full(trace.n_steps, -1, dtype=np.int64)
    first_requests = trace.request_id[trace.step_starts]
    for k, request in enumerate(first_requests):
        match = CANARY_REQUEST.match(str(request))
        if match and int(match.group(1)) >= CANARY_INDEX_BASE:
            keys[k] = int(match.group(2)) * 1_000_000 + int(match.group(1)) - CANARY_INDEX_BASE
    return keys


def canary_matrix(trace: StepTrace) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(the canary run per step, the runs in order, their step times: a run per row, cut to the shortest run)."""
    runs = canary_run_per_step(trace)
    order = list(dict.fromkeys(runs[runs >= 0].tolist()))
    latency = trace.step_latency_s_per_step
    series = [latency[runs == key] for key in order]
    length = min((len(s) for s in series), default=0)
    return runs, order, np.vstack([s[:length] for s in series]) if series else np.zeros((0, 0))


def median_ratio_drift(matrix: np.ndarray) -> np.ndarray:
    """Per row (a run of the canary, or a profile's median run), the median over step positions of its time over
    the median row's, less 1: how much slower (> 0) or faster the machine ran it."""
    return np.median(matrix / np.median(matrix, axis=0), axis=1) - 1.0


def canary_drift(trace: StepTrace, threshold: float = DEFAULT_DRIFT_THRESHOLD) -> tuple[np.ndarray, dict]:
    """(is_drifted per step, a summary for the trace metadata) by the rule in the module docstring."""
    runs, order, matrix = canary_matrix(trace)
    summary: dict = {
        "rule": f"canary runs compared step by step with the median run; |median ratio - 1| > the cut drifts, the cut being "
        f"{threshold:g} or {SPREAD_FACTOR:g} x 1.4826 x the runs' median absolute deviation if larger; "
        "the steps from the canary run before a drifted one to the one after it are flagged is_drifted",
        "threshold": threshold,
        "n_canary_runs": len(order),
    }
    drifted = np.zeros(trace.n_steps, dtype=bool)
    if len(order) < 2:
        summary.update({"canaries": [], "n_drifted_canaries": 0, "n_drifted_steps": 0, "max_abs_drift": None})
        return drifted, summary
    length = matrix.shape[1]
    drift = median_ratio_drift(matrix)
    spread = float(1.4826 * np.median(np.abs(drift - np.median(drift))))
    cut = max(threshold, SPREAD_FACTOR * spread)
    first_step = [int(np.flatnonzero(runs == key)[0]) for key in order]
    last_step = [int(np.flatnonzero(runs == key)[-1]) for key in order]
    canaries = []
    for k, key in enumerate(order):
        is_drifted = bool(abs(drift[k]) > cut)
        canaries.append({"run": int(key), "first_step_id": int(trace.step_id_per_step[first_step[k]]), "drift": float(drift[k]), "drifted": is_drifted})
        if is_drifted:
            start = last_step[k - 1] + 1 if k > 0 else 0
            end = first_step[k + 1] if k + 1 < len(order) else trace.n_steps
            drifted[start:end] = True
    summary.update(
        {
            "canary_steps_compared": int(length),
            "spread": spread,
            "cut": cut,
            "canaries": canaries,
            "n_drifted_canaries": int(sum(c["drifted"] for c in canaries)),
            "n_drifted_steps": int(drifted.sum()),
            "max_abs_drift": float(np.max(np.abs(drift))),
            "drift_p50": float(np.median(np.abs(drift))),
        }
    )
    return drifted, summary


def mark_drifted(trace: StepTrace, drifted_steps: np.ndarray) -> None:
    """Write the ``is_drifted`` column (per row, from the per-step flags)."""
    trace.extra["is_drifted"] = np.repeat(np.asarray(drifted_steps, dtype=bool), np.diff(trace.step_offsets))


def canary_profile_s(trace: StepTrace) -> np.ndarray | None:
    """Per canary step position, the median time over the trace's canary runs (None when it ran no canary)."""
    _, order, matrix = canary_matrix(trace)
    return np.median(matrix, axis=0) if order else None


def profile_level_drift(traces: list[StepTrace], threshold: float = DEFAULT_DRIFT_THRESHOLD) -> tuple[list[bool], dict]:
    """Across profiles of one engine (separate engine starts), whether each profile's machine level differs
    from the others': the canary rule one level up. Each profile's canary (per position, its median run) is
    compared with the median profile; a profile whose median ratio is more than ``threshold`` off drifts as a
    whole (its own canaries only see changes within it). With two profiles that differ by more than about
    twice the threshold both drift (no majority says which was right); a third settles it."""
    profiles = [canary_profile_s(trace) for trace in traces]
    summary: dict = {"rule": f"each profile's median canary run compared step by step with the median profile's; "
                     f"|median ratio - 1| > {threshold:g} drops the whole profile", "threshold": threshold}
    if len(traces) < 2 or any(p is None for p in profiles):
        summary.update({"levels": [0.0] * len(traces), "drifted": [False] * len(traces)})
        return [False] * len(traces), summary
    length = min(len(p) for p in profiles)
    matrix = np.vstack([p[:length] for p in profiles])
    levels = median_ratio_drift(matrix)
    drifted = [bool(abs(level) > threshold) for level in levels]
    summary.update({"levels": [float(level) for level in levels], "drifted": drifted})
    return drifted, summary
