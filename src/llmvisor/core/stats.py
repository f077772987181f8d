"""Quantiles and the bootstrap, written once for every summary llmvisor reports (numpy only).

**Quantiles** are numpy's default (linear interpolation between order statistics), read as percentiles:
``quantile_summary`` is the one dictionary of them that every report writes ({"n", "p50", ...}).

**The bootstrap** is one percentile-method interval over resampled *units* (`bootstrap_interval`): each
resample draws as many units as there are, with replacement, and a statistic is computed from how many times
each unit was drawn. Observations that are alike are kept in one unit, so the interval does not understate
the spread. `bootstrap_quantile_ci` takes the units in one of two ways, because the data differ:

- ``resample="groups"``: each distinct label of ``groups`` is a unit (validation: the requests of one batch
  share its measurements). Few values (hundreds), so each resample's percentiles are computed exactly.
- ``resample="blocks"``: contiguous blocks of steps that never straddle a change of ``groups`` (a run) are the
  units (held-out evaluation: neighbouring steps are alike, and a trace can hold 10 M steps). Each resample's
  percentiles are read off a histogram, so memory does not grow with n (Carlstein's non-overlapping block
  bootstrap; ``scipy.stats.bootstrap`` resamples single observations only, hence this).

The draws are in law the same either way (multinomial counts of n units); ``draw`` names how they are taken
from the generator, "indices" (n uniform indices, counted) or "counts" (a multinomial draw), and each caller
keeps the one its shipped intervals were computed with, so that re-running a command reproduces its shipped
file bit for bit: validation's batch intervals draw indices, the block bootstrap and validation's class
biases draw counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np

__all__ = ["bootstrap_interval", "bootstrap_quantile_ci", "percentile_interval", "quantile_summary", "resample_counts"]

MAX_BOOTSTRAP_BLOCKS = 2048
BOOTSTRAP_BINS = 2048
RESAMPLE_CHUNK = 100
STEP_CHUNK = 1 << 18
EDGE_SAMPLE = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# Quantiles


def quantile_summary(
    values: Iterable[float] | np.ndarray,
    qs: Iterable[float] = (50, 90, 99),
    *,
    names: Iterable[str] | None = None,
    mean: bool = False,
    maximum: bool = False,
    empty: float | None | str = None,
) -> dict:
    """``{"n", ["mean"], "p50", ..., ["max"]}`` of ``values`` (``qs`` in percent; ``names`` the keys, "p{q}" by
    default). With no values every figure is ``empty`` (None or nan), or only "n" when ``empty="omit"``."""
    values = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    qs = tuple(qs)
    keys = tuple(names) if names is not None else tuple(f"p{q:g}" for q in qs)
    if values.size == 0:
        if empty == "omit":
            return {"n": 0}
        return {"n": 0, **({"mean": empty} if mean else {}), **dict.fromkeys(keys, empty), **({"max": empty} if maximum else {})}
    out: dict = {"n": int(values.size)}
    if mean:
        out["mean"] = float(values.mean())
    out.update({key: float(v) for key, v in zip(keys, np.percentile(values, qs))})
    if maximum:
        out["max"] = float(values.max())
    return out


# ---------------------------------------------------------------------------------------------------------
# The bootstrap


def resample_counts(n_units: int, n_resamples: int, seed, *, draw: str = "counts", chunk: int = RESAMPLE_CHUNK) -> Iterator[np.ndarray]:
    """``n_resamples`` resamples of ``n_units`` units with replacement, ``chunk`` at a time: (k, n_units) float
    arrays of how many times each unit is drawn. ``draw``: "counts" or "indices" (module docstring)."""
    rng = np.random.default_rng(seed)
    uniform = np.full(n_units, 1 / n_units)
    for start in range(0, n_resamples, chunk):
        k = min(n_resamples, start + chunk) - start
        if draw == "counts":
            yield rng.multinomial(n_units, uniform, size=k).astype(np.float64)
        elif draw == "indices":
            drawn = rng.integers(0, n_units, (k, n_units))
            yield np.bincount((drawn + n_units * np.arange(k)[:, None]).ravel(), minlength=k * n_units).reshape(k, n_units).astype(np.float64)
        else:
            raise ValueError(f"unknown draw {draw!r}")


def percentile_interval(resampled: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile-method bounds per column of ``resampled`` (resamples × statistics); NaN entries (a statistic
    a resample does not define) are left out, and a column with none defined gets NaN bounds."""
    tail = round((1 - confidence) / 2 * 100, 10)
    resampled = np.asarray(resampled, dtype=np.float64)
    low, high = np.full(resampled.shape[1], np.nan), np.full(resampled.shape[1], np.nan)
    for k in range(resampled.shape[1]):
        column = resampled[:, k]
        column = column[~np.isnan(column)]
        if column.size:
            low[k], high[k] = np.percentile(column, [tail, 100 - tail])
    return low, high


def bootstrap_interval(
    statistic: Callable[[np.ndarray], np.ndarray],
    n_units: int,
    *,
    n_resamples: int = 1000,
    seed=0,
    confidence: float = 0.95,
    draw: str = "counts",
    chunk: int = RESAMPLE_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """The bootstrap: ``statistic(counts)`` maps a (k, n_units) array of draw counts to (k, m) resampled values
    (NaN where a resample does not define one); returns the percentile-method (low, high), m each."""
    resampled = np.concatenate([np.asarray(statistic(counts), dtype=np.float64).reshape(counts.shape[0], -1)
                                for counts in resample_counts(n_units, n_resamples, seed, draw=draw, chunk=chunk)])
    return percentile_interval(resampled, confidence)


def bootstrap_quantile_ci(
    values: np.ndarray,
    percentiles: tuple[float, ...],
    *,
    n_resamples: int = 1000,
    seed: int = 0,
    groups: np.ndarray | None = None,
    resample: str = "blocks",
    block_steps: int | None = None,
    confidence: float = 0.95,
    max_blocks: int = MAX_BOOTSTRAP_BLOCKS,
    n_bins: int = BOOTSTRAP_BINS,
) -> dict:
    """Percentile-method intervals of ``values``' percentiles, resampling units (module docstring).

    ``resample="groups"``: each label of ``groups`` a unit, exact percentiles (``draw="indices"``).
    ``resample="blocks"``: steps are cut, in their given order, into contiguous blocks that never straddle a
    change of ``groups`` (the run): ``block_steps`` each, by default ``max(ceil(n^(1/3)), ceil(n / max_blocks))``.
    Each block is summarised by a histogram over ``n_bins`` bins whose edges are quantiles of (a strided sample
    of at most ``EDGE_SAMPLE`` of) the values, so each bin holds about n / n_bins of them; a resample's
    histogram is its block counts times those histograms, computed ``RESAMPLE_CHUNK`` resamples at a time,
    and the steps are read ``STEP_CHUNK`` at a time. Beyond the input, peak memory is about
    8·(blocks·bins + RESAMPLE_CHUNK·(blocks + 2·bins) + 4·STEP_CHUNK + EDGE_SAMPLE) bytes, blocks ≤
    max_blocks + number of runs: about 60 MiB at the defaults whatever n is, where resampling steps takes
    8·n·n_resamples bytes (80 GB at 10 M steps). A resampled percentile is read off its histogram by linear
    interpolation inside the bin it falls in, so it is exact to within one bin (about 1/n_bins of the
    probability mass). Deterministic for a given ``seed``.

    Returns ``{"ci": {percentile: [low, high]}, "block_steps": int, "n_blocks": int}`` (``block_steps`` 0 and
    ``n_blocks`` the number of groups when resampling groups).
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    if n == 0 or n_resamples <= 0:
        return {"ci": {}, "block_steps": 0, "n_blocks": 0}
    if resample == "groups":
        _, unit = np.unique(np.asarray(groups), return_inverse=True)
        n_units = int(unit.max()) + 1

        def statistic(counts: np.ndarray) -> np.ndarray:
            return np.stack([np.percentile(np.repeat(values, row.astype(np.int64)[unit]), percentiles) for row in counts])

        low, high = bootstrap_interval(statistic, n_units, n_resamples=n_resamples, seed=seed, confidence=confidence, draw="indices")
        return {"ci": {q: [float(lo), float(hi)] for q, lo, hi in zip(percentiles, low, high)}, "block_steps": 0, "n_blocks": n_units}
    if resample != "blocks":
        raise ValueError(f"unknown resample {resample!r}")
    if block_steps is None:
        block_steps = max(math.ceil(n ** (1 / 3)), math.ceil(n / max_blocks))
    block_steps = max(1, int(block_steps))
    segment_starts = _segment_starts(None if groups is None else np.asarray(groups), n)
    segment_lengths = np.diff(np.append(segment_starts, n))
    blocks_per_segment = -(-segment_lengths // block_steps)
    segment_first_block = np.concatenate([[0], np.cumsum(blocks_per_segment)[:-1]])
    n_blocks = int(blocks_per_segment.sum())

    sample = values[np.linspace(0, n - 1, min(n, EDGE_SAMPLE)).astype(np.int64)]
    edges = np.unique(np.quantile(sample, np.linspace(0, 1, n_bins + 1)))
    edges[0], edges[-1] = min(edges[0], values.min()), max(edges[-1], values.max())
    if edges.size == 1:
        edges = np.array([edges[0], edges[0]])
    n_edges_bins = edges.size - 1
    histograms = np.zeros(n_blocks * n_edges_bins, dtype=np.float64)
    for start in range(0, n, STEP_CHUNK):
        stop = min(n, start + STEP_CHUNK)
        bins = np.clip(np.searchsorted(edges, values[start:stop], side="right") - 1, 0, n_edges_bins - 1)
        blocks = _block_ids(start, stop, block_steps, segment_starts, segment_first_block)
        first, last = int(blocks[0]), int(blocks[-1]) + 1
        span = (last - first) * n_edges_bins
        histograms[first * n_edges_bins : last * n_edges_bins] += np.bincount((blocks - first) * n_edges_bins + bins, minlength=span)
    histograms = histograms.reshape(n_blocks, n_edges_bins)
    levels = np.asarray(percentiles, dtype=np.float64) / 100

    def binned_percentiles(counts: np.ndarray) -> np.ndarray:
        hist = counts @ histograms
        cumulative = np.cumsum(hist, axis=1)
        rows = np.arange(counts.shape[0])
        out = np.empty((counts.shape[0], levels.size))
        for k, level in enumerate(levels):
            target = level * cumulative[:, -1]
            b = np.minimum((cumulative < target[:, None]).sum(axis=1), n_edges_bins - 1)
            below = cumulative[rows, b] - hist[rows, b]
            inside = np.divide(target - below, hist[rows, b], out=np.zeros(counts.shape[0]), where=hist[rows, b] > 0)
            out[:, k] = edges[b] + np.clip(inside, 0, 1) * (edges[b + 1] - edges[b])
        return out

    low, high = bootstrap_interval(binned_percentiles, n_blocks, n_resamples=n_resamples, seed=seed, confidence=confidence, draw="counts")
    return {
        "ci": {q: [float(lo), float(hi)] for q, lo, hi in zip(percentiles, low, high)},
        "block_steps": block_steps,
        "n_blocks": n_blocks,
    }


def _block_ids(start: int, stop: int, block_steps: int, segment_starts: np.ndarray, segment_first_block: np.ndarray) -> np.ndarray:
    index = np.arange(start, stop)
    segment = np.searchsorted(segment_starts, index, side="right") - 1
    return segment_first_block[segment] + (index - segment_starts[segment]) // block_steps


def _segment_starts(groups: np.ndarray | None, n: int) -> np.ndarray:
    """First index of every stretch of equal ``groups`` labels (a run), found chunk by chunk."""
    if groups is None:
        return np.zeros(1, dtype=np.int64)
    starts = [np.zeros(1, dtype=np.int64)]
    for start in range(0, n - 1, STEP_CHUNK):
        stop = min(n, start + STEP_CHUNK + 1)
        changed = groups[start + 1 : stop] != groups[start : stop - 1]
        starts.append(start + 1 + np.flatnonzero(changed))
    return np.concatenate(starts)


# ---------------------------------------------------------------------------------------------------------
# The noise floor

NOISE_FLOOR_DEFINITION = (
    "per-measurement relative noise: |t_j - mean(t)| * sqrt(k / (k - 1)) / scale over groups of k >= 2 independent "
    "measurements of the same thing (for a pair, |t1 - t2| / (sqrt(2) * scale)); scale is the group's mean unless given"
)


def replicate_noise_floor(
    groups: Iterable[Iterable[float]],
    scales: Iterable[float] | None = None,
    *,
    clusters: Iterable | None = None,
    percentiles: tuple[float, ...] = (50, 90, 99),
    n_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict | None:
    """The one noise floor llmvisor reports (profile, eval, validate): how far one measurement strays from the
    truth it measures, relative to ``scale`` (the group's mean, or e.g. the batch's step time for a Shapley value).

    Each group holds k ≥ 2 independent measurements of one quantity; a deviation from the group mean is scaled by
    √(k/(k−1)) so that it estimates one measurement's error, whatever k (a pair's half-difference understates it by
    √2). Groups with fewer than two measurements are left out. Percentiles of the absolute deviations, with a
    bootstrap interval resampling groups (the measurements of one group share its mean), or ``clusters`` (one label
    per group: groups that share a label, e.g. the requests of one batch, are resampled together). None when no
    group has two.
    """
    scales = None if scales is None else list(scales)
    clusters = None if clusters is None else list(clusters)
    deviations: list[float] = []
    labels: list[int] = []
    n_groups = 0
    for g, values in enumerate(groups):
        t = np.asarray(list(values), dtype=np.float64)
        if t.size < 2:
            continue
        scale = float(t.mean()) if scales is None else float(scales[g])
        if not scale > 0:
            continue
        deviations.extend((np.abs(t - t.mean()) * math.sqrt(t.size / (t.size - 1)) / scale).tolist())
        labels.extend([n_groups if clusters is None else clusters[g]] * t.size)
        n_groups += 1
    if not n_groups:
        return None
    deviations_arr = np.asarray(deviations)
    out = quantile_summary(deviations_arr, percentiles)
    ci = bootstrap_quantile_ci(deviations_arr, percentiles, n_resamples=n_resamples, seed=seed,
                               groups=np.asarray(labels), resample="groups", confidence=confidence)["ci"]
    out.update(n_groups=n_groups, n_measurements=out.pop("n"),
               interval={f"p{q:g}": ci.get(q) for q in percentiles}, confidence=confidence, definition=NOISE_FLOOR_DEFINITION)
    return out
