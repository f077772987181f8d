"""The piecewise per-phase step-latency model, a scikit-learn-style estimator."""

from __future__ import annotations

import heapq
import inspect
import json
import numbers
import os
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import scipy.optimize
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from llmvisor.core.features import (
    FEATURE_NAMES,
    FEATURE_NAMES_LORA,
    FEATURE_NAMES_LORA_V3,
    FEATURE_NAMES_V1,
    LORA_FEATURE_NAMES,
    LORA_WORK_FORMS,
    N_FEATURES,
    Coef,
    LoraCoef,
    has_lora_columns,
    shared_context_saving_per_step,
    step_feature_matrix,
    step_new_tokens,
)
from llmvisor.core.files import replaced_atomically
from llmvisor.core.fingerprint import METADATA_KEY as FINGERPRINT_METADATA_KEY
from llmvisor.core.trace import StepTrace
from llmvisor.errors import LlmvisorError, ModelError, NotFittedError, unknown_name

MODEL_FORMAT = "llmvisor.step_latency_model"
MODEL_FORMAT_VERSION = 4
"""Version 2 added the feature ``effective_context_tokens``; version-1 files are read with it held at 0 (not
identified), which predicts what they always did. Version 3 added the LoRA features (``LORA_FEATURE_NAMES``), version
4 the LoRA path's (``lora_steps``, ``lora_base_tokens``; a version-3 file is read with them held at 0, as a version-1
file is): a model fitted on a trace with the LoRA columns writes version 4, any other still writes version 2, the
same file as before LoRA (``BASE_MODEL_FORMAT_VERSION``)."""
BASE_MODEL_FORMAT_VERSION = 2
"""The version a model without LoRA features writes."""
READABLE_FORMAT_VERSIONS = {1: FEATURE_NAMES_V1, 2: FEATURE_NAMES, 3: FEATURE_NAMES_LORA_V3, 4: FEATURE_NAMES_LORA}
LORA_ONLY_PARAMS = ("lora_work",)
"""Hyper-parameters that matter only to a LoRA model: a model without LoRA features leaves them out of its file, so
the file is the one written before they existed."""
MODEL_FILE_KEYS = ("format", "format_version", "params", "feature_names", "boundary_new_tokens", "segments",
                   "identified_features", "rank", "engine_fingerprint", "fit_info")
"""The keys of a model file (`StepLatencyModel.to_dict`); any other is refused, naming the closest one."""
"""Each model file version this llmvisor reads, with its feature list."""
SEGMENT_NAMES = ("memory_bound", "compute_bound")
EPISODE_COLUMN = "episode"
"""Optional trace column naming the episode a step belongs to; the boundary search keeps an episode in one fold.
The recorder does not write it: without it, a single run's folds are time blocks (`time_block_groups`)."""


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and bool(np.isfinite(value))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


PARAMETER_CONSTRAINTS: dict[str, tuple] = {
    "segments": (lambda v: v in ("auto", "none") or (_is_real(v) and v > 0), "'auto', 'none' or a number of tokens > 0"),
    "positive": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "weights": (lambda v: v in ("relative", "none"), "'relative' or 'none'"),
    "outlier_threshold": (lambda v: v is None or (_is_real(v) and v > 0), "None or a number > 0"),
    "drop_warmup": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "cv_folds": (lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
    "n_boundary_candidates": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "min_steps_per_segment": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "lora_work": (lambda v: isinstance(v, str) and v in ("auto", *LORA_WORK_FORMS), "'auto', " + ", ".join(map(repr, LORA_WORK_FORMS))),
}
"""Every hyper-parameter of ``StepLatencyModel``: (accepts value, what is accepted). ``fit`` checks them all."""


def composition_groups(trace: StepTrace) -> np.ndarray:
    """Per step, an integer id shared by exactly the steps of identical composition: the same multiset of
    (num_new_tokens, num_context_tokens, phase) slices. A 64-bit multiset hash (the wrapping sum of each
    slice's mixed hash, so slice order does not matter and nothing is sorted): two different compositions
    share an id with probability ~2⁻⁶⁴ per pair."""
    if trace.n_steps == 0:
        return np.zeros(0, dtype=np.intp)
    with np.errstate(over="ignore"):
        key = _mix64(trace.num_new_tokens.astype(np.uint64))
        key = _mix64(key ^ trace.num_context_tokens.astype(np.uint64))
        key = _mix64(key ^ trace.is_prefill.astype(np.uint64))
        step_hash = np.add.reduceat(key, trace.step_starts) ^ _mix64(trace.batch_size_per_step.astype(np.uint64))
    return np.unique(step_hash, return_inverse=True)[1].astype(np.intp)


def request_stretches(trace: StepTrace) -> np.ndarray:
    """Per step, the contiguous stretch of the recording it falls in: a new stretch starts, in the trace's step order
    (the recorder's), at each step that shares no request with the step before it. Consecutive steps of the same
    requests (a decode run one token further each step: nearly identical) are thus one stretch."""
    n = trace.n_steps
    if n == 0:
        return np.zeros(0, dtype=np.intp)
    request = np.unique(trace.request_id, return_inverse=True)[1].reshape(-1)
    step_of_slice = np.repeat(np.arange(n), trace.batch_size_per_step)
    continues = np.zeros(n, dtype=bool)  # step k shares a request with step k - 1
    last_step = np.full(int(request.max()) + 1, -2)
    for k, r in zip(step_of_slice.tolist(), request.tolist()):
        continues[k] |= last_step[r] == k - 1
        last_step[r] = k
    continues[0] = True
    return (np.cumsum(~continues)).astype(np.intp)


def time_block_groups(trace: StepTrace, steps: np.ndarray) -> np.ndarray:
    """Per selected step, its fold group within one run: contiguous stretches of shared requests
    (`request_stretches`), joined with every other stretch that holds a step of identical composition
    (`composition_groups`: a repeated sweep's second pass), as connected components. Neither near-identical
    neighbours nor identical repeats can then sit on both sides of a fold."""
    stretch = request_stretches(trace)[steps]
    composition = composition_groups(trace)[steps]
    if stretch.size == 0:
        return stretch
    n_stretch = int(stretch.max()) + 1
    size = n_stretch + int(composition.max()) + 1
    graph = coo_matrix((np.ones(stretch.size), (stretch, n_stretch + composition)), shape=(size, size))
    component = connected_components(graph, directed=False)[1]
    return np.unique(component[stretch], return_inverse=True)[1].astype(np.intp).reshape(-1)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the output (wrapping uint64 arithmetic)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) ^ (x >> np.uint64(30))
    x = (x * np.uint64(0xBF58476D1CE4E5B9)) ^ (x >> np.uint64(27))
    x = (x * np.uint64(0x94D049BB133111EB)) ^ (x >> np.uint64(31))
    return x


def group_k_fold(groups: np.ndarray, n_folds: int) -> list[np.ndarray]:
    """Test masks of ``min(n_folds, number of groups)`` folds that never split a group, with scikit-learn
    ``GroupKFold``'s fold sizes: groups are taken largest first, each into the currently lightest fold.

    Every fold holds at least one group; with fewer than two groups there is no fold to score on and the list
    is empty. Among groups of equal size, the folds the greedy rule hands out are given in the groups' order of
    first appearance (same sizes per fold), so neighbouring steps of a recording mostly share a fold.
    """
    groups = np.asarray(groups).reshape(-1)
    if groups.size == 0:
        return []
    _, first, inverse, counts = np.unique(groups, return_index=True, return_inverse=True, return_counts=True)
    k = min(n_folds, counts.size)
    if k < 2:
        return []
    order = np.lexsort((first, -counts))
    sizes = counts[order]
    fold_of_sorted = np.empty(order.size, dtype=np.intp)
    lightest = [(0, fold) for fold in range(k)]  # (steps, fold): a heap's minimum is np.argmin's first lightest
    for i, size in enumerate(sizes.tolist()):
        load, fold = lightest[0]
        heapq.heapreplace(lightest, (load + size, fold))
        fold_of_sorted[i] = fold
    size_class = np.cumsum(np.r_[True, sizes[1:] != sizes[:-1]])
    fold_of_group = np.empty(order.size, dtype=np.intp)
    fold_of_group[order] = fold_of_sorted[np.lexsort((fold_of_sorted, size_class))]
    fold = fold_of_group[inverse.reshape(-1)]
    return [fold == i for i in range(k)]


@dataclass(frozen=True)
class _Solved:
    coef: np.ndarray
    identified: np.ndarray


def _solve(aw: np.ndarray, bw: np.ndarray, *, positive: bool, identified: np.ndarray) -> np.ndarray:
    """Least squares (or NNLS) of ``aw @ coef ≈ bw`` over the identified columns.

    Rows arrive already weighted (see ``StepLatencyModel.weights``). Columns are scaled to unit RMS first
    (the fit does not depend on it; conditioning does), and NNLS runs on the Gram matrix's square root,
    which gives the same solution as on the full matrix at a fraction of the cost.
    """
    coef = np.zeros(aw.shape[1])
    # a column all zero in these rows says nothing of its coefficient (NNLS would leave it anywhere): held at 0
    columns = np.flatnonzero(identified & np.any(aw != 0, axis=0))
    if columns.size == 0 or aw.shape[0] == 0:
        return coef
    a = aw[:, columns]
    col_scale = np.sqrt(np.einsum("ij,ij->j", a, a) / a.shape[0])
    col_scale[col_scale == 0] = 1.0
    if positive:
        gram = (a.T @ a) / np.outer(col_scale, col_scale)
        rhs = (a.T @ bw) / col_scale
        eigenvalues, eigenvectors = scipy.linalg.eigh(gram)
        keep = eigenvalues > eigenvalues.max() * 1e-12
        root = np.sqrt(eigenvalues[keep])
        r = (eigenvectors[:, keep] * root).T
        t = (eigenvectors[:, keep].T @ rhs) / root
        solution, _ = scipy.optimize.nnls(r, t, maxiter=50 * columns.size)
    else:
        solution = np.linalg.lstsq(a / col_scale, bw, rcond=None)[0]
    coef[columns] = solution / col_scale
    return coef


def training_fingerprint(trace: StepTrace) -> dict | None:
    """The engine fingerprint a model fitted on ``trace`` is calibrated to: the metadata's full record when the
    steps carry its id (or no id at all), ``{"id": ...}`` when they carry one id without the record, None when
    they come from several engines or carry none."""
    ids = trace.engine_fingerprint_ids()
    recorded = trace.metadata.get(FINGERPRINT_METADATA_KEY)
    if isinstance(recorded, dict) and recorded.get("id") and (ids == [recorded["id"]]):
        return dict(recorded)
    if len(ids) == 1:
        return {"id": ids[0]}
    return None


class StepLatencyModel:
    """Predicts an engine step's latency as a shared intercept plus one additive term per request slice.

    T = b + Σ_prefill (a1·p + a2·c + a3·p² + a5·p·c + a4) + Σ_decode (d2·c + d4) + Σ_all e·ĉ, with p the tokens a
    request runs in the step, c the tokens already in its KV cache and ĉ its effective context (c with each KV
    block shared with other slices of the step divided among its readers; c in a v1 trace). Optionally piecewise: steps whose load (total
    new tokens) is below ``boundary_`` use the memory-bound coefficient set, the others the compute-bound set.

    Parameters
    ----------
    segments : "auto", "none" or a number
        "auto" chooses the boundary by cross-validation among "no boundary" and candidates on the step load
        (``n_boundary_candidates`` load quantiles plus as many log-spaced values between the 5th and 99th
        percentile, since most steps are light decode steps), then each count of decode sequences a decode-only
        step ran, with the outlier rule applied with that boundary's own fit (`_search_decode_counts`: a jump in decode
        step cost at a count of sequences, which the one-segment outlier rule would drop); "none" fits one set; a number
        fixes the boundary (in new tokens per step).
    positive : bool
        Nonnegative least squares (scipy NNLS), so every slice's term and so every share is ≥ 0. False gives
        plain least squares, the paper's variant.
    weights : "relative" or "none"
        "relative" minimises squared relative error (residual ÷ measured step time).
    outlier_threshold : float or None
        Steps slower than the initial fit by more than median + k·MAD of the relative residuals (k this value,
        MAD scaled to σ) are dropped before the final fit; only the slow tail, since interference on a shared
        machine only ever slows a step. None keeps every step. Counted in ``fit_info_``.
    drop_warmup : bool
        Drop steps marked ``is_warmup`` in the trace (counted in ``fit_info_``).
    cv_folds : int
        Folds of the boundary search. A fold never splits a group of steps: the run when the training data
        holds several runs, else the episode (column ``episode``) when the trace has one, else a time block
        (`time_block_groups`: contiguous stretches of steps sharing requests, joined with any stretch holding a step
        of identical composition), so neither neighbouring near-identical steps nor a repeated sweep's identical
        steps are ever in train and test at once. Groups go to
        folds as scikit-learn's ``GroupKFold`` puts them (``group_k_fold``); fewer groups make fewer folds, and
        with one group the boundary is "none", the reason in ``fit_info_["boundary_search"]["reason"]``. The
        grouping used is ``fit_info_["boundary_search"]["fold_grouping"]``.
    n_boundary_candidates : int
        Load quantiles (and as many log-spaced values) tried as boundaries by ``segments="auto"``.
    min_steps_per_segment : int
        A candidate boundary is skipped when either side has fewer steps (or cannot identify every feature; a decode-count
        candidate may have one side fit only the features it holds in this many steps, taking the others from the other
        side: `_segment_plan`).
    lora_work : "auto", "tokens", "rank_tokens" or "both"
        Only for a trace with the LoRA columns: the form of the per-token LoRA work (`llmvisor.core.features`).
        "tokens" prices the tokens run with any adapter (vLLM pads each adapter to ``--max-lora-rank``),
        "rank_tokens" rank × tokens, "both" both. "auto" chooses by cross-validation on the folds the boundary
        search uses (by run when there are several), with one segment (or the fixed boundary): the lowest mean
        squared relative error (scores under 1e-18, relative errors of 1e-9, are rounding and count as equal;
        between equal single forms "tokens"), "both" only when it beats the better single form by more than one
        standard error. The features of the forms not chosen are held at 0; the scores are in ``fit_info_["lora_work"]``.

    Attributes
    ----------
    coef_ : ndarray of shape (n_segments, N_FEATURES) or (n_segments, N_FEATURES_LORA)
        Coefficients per segment, in seconds per unit of each feature in ``feature_names_``: ``FEATURE_NAMES``, or
        ``FEATURE_NAMES_LORA`` for a model fitted on a trace with the LoRA columns (``is_lora_``).
    boundary_ : float or None
        Steps with total new tokens < boundary_ use segment 0 (memory-bound), the others segment 1.
    identified_ : ndarray of bool
        Features the training data could identify; the others are held at 0 (e.g. ``prefill_new_x_context_tokens``
        without any chunked prefill, ``effective_context_tokens`` without any shared context: without sharing
        it equals the sum of the per-request context columns; ``lora_disk_loads`` when every slot load read the
        adapter from disk) or the fit did not choose (a LoRA work form other than ``lora_work``'s).
    fit_info_ : dict
        Steps used, dropped by each rule, the boundary search's cross-validated scores, training runs.
    train_step_mask_ : ndarray of bool
        Which steps of the training trace the final fit used (not saved with the model).

    Notes
    -----
    The scikit-learn estimator contract holds without importing scikit-learn (the core install leaves it out):
    hyper-parameters are stored unchanged by ``__init__`` and read back by ``get_params`` from its signature
    (as ``sklearn.base.BaseEstimator`` does), learned attributes end in ``_``, ``fit`` returns self, so
    ``sklearn.base.clone`` and ``GridSearchCV`` work; a ``StepTrace`` is the X (its samples are its steps)
    and ``score`` is minus the median absolute relative error of the step predictions.

    This is NNLS (or OLS) on per-step sums of per-slice features, wrapped as a predictor. The segment of a step
    is chosen by its own load and the same coefficients price every slice of that step; attribution prices
    each subset of a step in the subset's own segment (see ``llmvisor.core.attribution``).
    """

    def __init__(
        self,
        *,
        segments: str | float = "auto",
        positive: bool = True,
        weights: str = "relative",
        outlier_threshold: float | None = 5.0,
        drop_warmup: bool = True,
        cv_folds: int = 5,
        n_boundary_candidates: int = 9,
        min_steps_per_segment: int = 40,
        lora_work: str = "auto",
    ):
        self.segments = segments
        self.positive = positive
        self.weights = weights
        self.outlier_threshold = outlier_threshold
        self.drop_warmup = drop_warmup
        self.cv_folds = cv_folds
        self.n_boundary_candidates = n_boundary_candidates
        self.min_steps_per_segment = min_steps_per_segment
        self.lora_work = lora_work

    # ---------------------------------------------------------------------------------------------------
    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return sorted(name for name, p in signature.parameters.items() if name != "self" and p.kind == p.KEYWORD_ONLY)

    def get_params(self, deep: bool = True) -> dict:
        """The hyper-parameters, by name (``deep`` is accepted for scikit-learn; there are no sub-estimators)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params) -> StepLatencyModel:
        """Set hyper-parameters by name (checked by the next ``fit``); returns self."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise LlmvisorError(f"StepLatencyModel has no parameter {name!r}; parameters: {', '.join(valid)}")
            setattr(self, name, value)
        return self

    def __sklearn_tags__(self):
        """scikit-learn's description of this estimator: a regressor whose X is a ``StepTrace`` (no array
        checks) and whose targets come from X (y not required). Only scikit-learn calls it."""
        from sklearn.utils import InputTags, RegressorTags, Tags, TargetTags

        return Tags(
            estimator_type="regressor",
            target_tags=TargetTags(required=False),
            regressor_tags=RegressorTags(),
            input_tags=InputTags(two_d_array=False),
            no_validation=True,
        )

    def check_params(self) -> None:
        """Check every hyper-parameter against ``PARAMETER_CONSTRAINTS``: one line naming the first bad one."""
        for name in self._param_names():
            accepts, expected = PARAMETER_CONSTRAINTS[name]
            value = getattr(self, name)
            if not accepts(value):
                raise LlmvisorError(f"StepLatencyModel parameter {name} must be {expected}, got {value!r}")

    def _row_weights(self, y: np.ndarray) -> np.ndarray:
        """Relative weighting divides each step's residual by its measured time, so a 10 ms decode step
        counts as much as a 1 s prefill step (the errors we report are relative)."""
        return 1.0 / y if self.weights == "relative" else np.ones_like(y)

    def _fit_segments(self, aw, bw, load, boundary, rows=None, identified=None, own=None) -> np.ndarray:
        """Coefficients per segment. ``own`` (a `_segment_plan`): per segment, the features it fits itself; the
        others it takes from the segment that fits them all, which is fitted first."""
        rows = np.ones(bw.shape[0], dtype=bool) if rows is None else rows
        identified = self.identified_ if identified is None else identified
        if boundary is None:
            return _solve(aw[rows], bw[rows], positive=self.positive, identified=identified)[None, :]
        coef = np.zeros((2, aw.shape[1]))
        masks = (rows & (load < boundary), rows & (load >= boundary))
        own = (identified, identified) if own is None else own
        order = sorted((0, 1), key=lambda segment: not np.array_equal(own[segment], identified))
        for segment in order:
            mask, borrowed = masks[segment], identified & ~own[segment]
            other = coef[1 - segment]
            target = bw[mask] - aw[mask][:, borrowed] @ other[borrowed] if borrowed.any() else bw[mask]
            coef[segment] = _solve(aw[mask], target, positive=self.positive, identified=identified & own[segment])
            coef[segment, borrowed] = other[borrowed]
        return coef

    @staticmethod
    def _predict_rows(coef: np.ndarray, boundary, x: np.ndarray, load: np.ndarray) -> np.ndarray:
        if boundary is None:
            return x @ coef[0]
        segment = (load >= boundary).astype(np.intp)
        return np.einsum("ij,ij->i", x, coef[segment])

    @staticmethod
    def fold_groups(trace: StepTrace, steps: np.ndarray | None = None) -> tuple[np.ndarray, str]:
        """Per step (of those ``steps`` selects, default all), the group the boundary search's folds keep whole,
        and the grouping's name, chosen by what the selected steps hold (a run left with only warm-up steps
        does not count as a run)."""
        steps = np.ones(trace.n_steps, dtype=bool) if steps is None else np.asarray(steps, dtype=bool)
        runs = trace.run_id_per_step[steps]
        if len(set(runs.tolist())) >= 2:
            return np.unique(runs, return_inverse=True)[1], "run"
        if EPISODE_COLUMN in trace.extra and steps.any():
            episodes = np.asarray(trace.extra[EPISODE_COLUMN])[trace.step_starts[steps]].astype(str)
            return np.unique(episodes, return_inverse=True)[1], EPISODE_COLUMN
        return time_block_groups(trace, steps), "time_block"

    def _segment_is_estimable(self, x: np.ndarray, mask: np.ndarray) -> bool:
        if mask.sum() < self.min_steps_per_segment:
            return False
        sub = x[mask][:, self.identified_]
        sub = sub / np.maximum(np.abs(sub).max(axis=0), 1e-300)
        return np.linalg.matrix_rank(sub) == int(self.identified_.sum())

    def fit(self, trace: StepTrace, y: None = None) -> StepLatencyModel:
        """Learn the coefficients (and the boundary) from a training trace's steps; returns self.

        The targets are the trace's own ``step_latency_s``; ``y`` exists for scikit-learn and must be None.
        """
        self.check_params()
        if y is not None:
            raise LlmvisorError("StepLatencyModel.fit: the targets are the trace's step_latency_s; pass y=None")
        if not isinstance(trace, StepTrace):
            raise LlmvisorError(f"StepLatencyModel.fit: expected a StepTrace, got {type(trace).__name__}")
        if trace.n_steps == 0:
            raise LlmvisorError(f"{', '.join(trace.sources) or '<memory>'}: cannot fit on a trace with no steps")
        x = step_feature_matrix(trace)
        y = trace.step_latency_s_per_step
        load = step_new_tokens(trace)
        runs = trace.run_id_per_step
        keep = np.ones(trace.n_steps, dtype=bool)
        n_warmup = 0
        if self.drop_warmup:
            warm = trace.is_warmup_per_step
            n_warmup = int(warm.sum())
            keep &= ~warm
        drifted = keep & trace.is_drifted_per_step
        n_drifted = int(drifted.sum())
        keep &= ~drifted
        self.identified_ = np.abs(x[keep]).sum(axis=0) > 0
        saving = shared_context_saving_per_step(x[keep])
        self.identified_[Coef.E] &= bool(np.any(saving > 1e-9 * np.maximum(x[keep][:, Coef.E], 1.0)))
        is_lora = x.shape[1] > N_FEATURES
        if is_lora:  # a disk load is also a slot load: its extra price is identified only beside slot loads not from disk
            memory_loads = x[keep][:, LoraCoef.L6] - x[keep][:, LoraCoef.L7]
            self.identified_[LoraCoef.L7] &= bool(np.any(memory_loads > 1e-9))
            # the LoRA path's set-up (1 per step with an adapter) is told from the per-adapter term only where a step
            # runs two adapters or more, and from the intercept only beside steps without one: else l5 and b carry it
            path = x[keep][:, LoraCoef.L8]
            self.identified_[LoraCoef.L8] &= bool(np.any(x[keep][:, LoraCoef.L5] - path > 1e-9)) and bool(np.any(path == 0))
        if not keep.any() or keep.sum() < self.identified_.sum():
            raise LlmvisorError(
                f"{', '.join(trace.sources) or '<memory>'}: too few steps to fit ({int(keep.sum())} of {trace.n_steps} left "
                f"after dropping {n_warmup} warm-up and {n_drifted} drifted steps)"
            )

        cleaned = keep.copy()  # before the outlier rule: what the decode-count candidates trim with their own fit
        outliers, outlier_cut = self._slow_outliers(x, y, load, keep, None)
        n_outliers = int(outliers.sum())
        keep &= ~outliers
        outlier_fit = "one-segment"

        x_fit, y_fit, load_fit = x[keep], y[keep], load[keep]
        groups, grouping = self.fold_groups(trace, keep)
        names = FEATURE_NAMES_LORA if is_lora else FEATURE_NAMES
        unidentified = [n for n, ok in zip(names, self.identified_) if not ok]
        lora_work = self._choose_lora_work(x_fit, y_fit, load_fit, groups, grouping) if is_lora else None
        if lora_work is not None:
            self.identified_ &= ~np.isin(np.array(names), lora_work["held_at_zero"])
        search = self._search_boundary(x_fit, y_fit, load_fit, groups, grouping)
        self.boundary_ = search["chosen"]
        own = None
        if self.segments == "auto":
            counts = self._search_decode_counts(trace, x, y, load, cleaned, keep, self.boundary_, names)
            search["report"]["decode_counts"] = counts["report"]
            if counts["chosen"] is not None:
                chosen = counts["chosen"]
                self.boundary_, own, keep = chosen["boundary"], chosen["own"], chosen["keep"]
                n_outliers, outlier_cut = int((cleaned & ~keep).sum()), chosen["outlier_cut"]
                outlier_fit = f"two-segment (boundary {self.boundary_:g})"
                search["report"]["chosen"] = f"decode count {self.boundary_:g}"
                x_fit, y_fit, load_fit = x[keep], y[keep], load[keep]
        self.train_step_mask_ = keep
        w = self._row_weights(y_fit)
        self.coef_ = self._fit_segments(x_fit * w[:, None], y_fit * w, load_fit, self.boundary_, own=own)
        self.feature_names_ = names
        self.rank_ = int(np.linalg.matrix_rank(x_fit[:, self.identified_] / np.maximum(np.abs(x_fit[:, self.identified_]).max(axis=0), 1e-300)))
        self.n_features_in_ = len(names)
        residual = (y_fit - self._predict_rows(self.coef_, self.boundary_, x_fit, load_fit)) / y_fit
        self.engine_fingerprint_ = training_fingerprint(trace)
        self.fit_info_ = {
            "n_steps_total": int(trace.n_steps),
            "n_steps_used": int(keep.sum()),
            "n_warmup_dropped": n_warmup,
            "n_drifted_dropped": n_drifted,
            "n_outliers_dropped": n_outliers,
            "outlier_rule": None
            if outlier_cut is None
            else f"relative residual of an initial {outlier_fit} fit > median + {self.outlier_threshold}·MAD = {outlier_cut:.4g}",
            "train_runs": list(dict.fromkeys(runs.tolist())),
            "train_engine_fingerprints": trace.engine_fingerprint_ids(),
            "unidentified_features": unidentified,
            "train_rel_err_p50": float(np.percentile(np.abs(residual), 50)),
            "train_rel_err_p90": float(np.percentile(np.abs(residual), 90)),
            "boundary_search": search["report"],
        }
        if lora_work is not None:
            self.fit_info_["lora_work"] = lora_work
        return self

    def _slow_outliers(self, x, y, load, keep, boundary, own=None) -> tuple[np.ndarray, float | None]:
        """The steps of ``keep`` the outlier rule drops (``outlier_threshold``), judged against an initial fit with
        the given segments, and the rule's cut; none (and None) without a threshold."""
        if self.outlier_threshold is None:
            return np.zeros_like(keep), None
        w = self._row_weights(y)
        first = self._fit_segments(x * w[:, None], y * w, load, boundary, keep, own=own)
        predicted = np.maximum(self._predict_rows(first, boundary, x, load), 1e-12)
        relative = (y - predicted) / predicted
        median = np.median(relative[keep])
        mad = 1.4826 * np.median(np.abs(relative[keep] - median))
        cut = float(median + self.outlier_threshold * mad)
        return keep & (relative > cut), cut

    def _segment_plan(self, x, load, rows, boundary) -> tuple[np.ndarray, np.ndarray] | None:
        """Per segment of ``boundary`` (over the steps ``rows`` selects), the identified features it fits itself; None
        when it cannot be fitted. A segment of too few steps cannot. Where both segments identify every feature, both fit
        them all. Else one must, and the other fits those it holds in at least ``min_steps_per_segment`` steps (full
        rank) and takes the rest from the first: a segment of only decode steps keeps the prefill terms of the segment
        that holds the prefill steps, rather than leave them unidentified."""
        masks = (rows & (load < boundary), rows & (load >= boundary))
        if min(int(m.sum()) for m in masks) < self.min_steps_per_segment:
            return None
        estimable = [self._segment_is_estimable(x, m) for m in masks]
        if all(estimable):
            return self.identified_, self.identified_
        if not any(estimable):
            return None
        own = [self.identified_.copy(), self.identified_.copy()]
        partial = estimable.index(False)
        mask = masks[partial]
        own[partial] &= np.count_nonzero(x[mask], axis=0) >= self.min_steps_per_segment
        sub = x[mask][:, own[partial]]
        sub = sub / np.maximum(np.abs(sub).max(axis=0), 1e-300)
        if not own[partial].any() or np.linalg.matrix_rank(sub) < int(own[partial].sum()):
            return None
        return own[0], own[1]

    def _search_decode_counts(self, trace, x, y, load, cleaned, kept, boundary, names) -> dict:
        """Boundaries at each count of decode sequences a decode-only step ran (its load), beside the boundary search's
        choice ``boundary``. A jump in step cost at such a count makes a one-segment fit call every step above it slow,
        so the outlier rule, judged against that fit, drops them (the steps that would show the jump) before the search.
        Each of these candidates therefore applies the outlier rule with its own two-segment fit (`_segment_plan`) to the
        steps ``cleaned`` (before that rule), as does the choice with its own (``kept``, the steps the one-segment rule
        kept, when it is 'none'). A candidate is tried only where its rule readmits at least ``min_steps_per_segment``
        decode-only steps at or above it that the choice's dropped (else the choice sees those steps, and the search has decided). A
        tried one is compared with the choice on the search's folds, paired on the held-out steps either keeps: the mean over them of the choice's squared relative error less the candidate's, its standard
        error over time blocks (`time_block_groups`: neighbouring steps are not independent). The candidate of the largest
        gain is taken if that is more than one standard error, as the search keeps 'none' unless its best beats it by more."""
        decode_only = ~trace.is_prefill_per_step & cleaned
        candidates = [float(c) for c in np.unique(load[decode_only]) if c > load[cleaned].min()]
        report = {
            "rule": "each count of decode sequences in a decode-only step (its load) as a boundary, the outlier rule applied with "
                    "that boundary's two-segment fit, tried where that readmits at least min_steps_per_segment decode-only steps at or "
                    "above it that the search's choice, its outlier rule applied with its own fit, dropped; the one of the largest gain in cross-validated squared relative error over "
                    "the search's choice, paired on the held-out steps either keeps, is taken if that gain is more than one standard "
                    "error (over time blocks)",
            "against": "none" if boundary is None else f"{boundary:g}",
            "candidates": {},
        }
        groups, _ = self.fold_groups(trace, cleaned)
        tests = [np.isin(np.arange(trace.n_steps), np.flatnonzero(cleaned)[test]) for test in group_k_fold(groups, self.cv_folds)]
        if not candidates or not tests:
            reason = "no decode-only steps of two counts" if not candidates else "no fold to score on"
            return {"chosen": None, "report": {**report, "chosen": None, "reason": reason}}
        if boundary is not None:  # the choice too applies the outlier rule with its own segments' fit
            kept = cleaned & ~self._slow_outliers(x, y, load, cleaned, boundary)[0]
        w = self._row_weights(y)
        aw, bw = x * w[:, None], y * w
        base = blocks = None
        best = None
        for count in candidates:
            key = f"{count:g}"
            above = decode_only & (load >= count)
            if (above & ~kept).sum() < self.min_steps_per_segment:  # nothing its rule could readmit: no fit needed
                report["candidates"][key] = {"boundary_new_tokens": count, "skipped": "the choice dropped too few decode-only steps at or above it"}
                continue
            own = self._segment_plan(x, load, cleaned, count)
            if own is None:
                report["candidates"][key] = {"boundary_new_tokens": count, "skipped": "a segment has too few or rank-deficient steps"}
                continue
            outliers, cut = self._slow_outliers(x, y, load, cleaned, count, own)
            keep = cleaned & ~outliers
            readmitted = int((keep & ~kept & above).sum())
            own = self._segment_plan(x, load, keep, count) if readmitted >= self.min_steps_per_segment else None
            if own is None:
                reason = ("its outlier rule readmits too few decode-only steps at or above it" if readmitted < self.min_steps_per_segment
                          else "a segment has too few or rank-deficient steps")
                report["candidates"][key] = {"boundary_new_tokens": count, "n_readmitted_above": readmitted, "skipped": reason}
                continue
            if base is None:  # the choice's held-out predictions, and the time blocks, once
                base = np.zeros(trace.n_steps)
                for test in tests:
                    coef = self._fit_segments(aw, bw, load, boundary, kept & ~test)
                    base[test] = self._predict_rows(coef, boundary, x[test], load[test])
                blocks = np.full(trace.n_steps, -1)
                blocks[cleaned] = time_block_groups(trace, cleaned)
            predicted = np.zeros(trace.n_steps)
            for test in tests:
                coef = self._fit_segments(aw, bw, load, count, keep & ~test, own=own)
                predicted[test] = self._predict_rows(coef, count, x[test], load[test])
            judged = np.any(tests, axis=0) & (keep | kept)
            ours = ((predicted[judged] - y[judged]) / y[judged]) ** 2
            theirs = ((base[judged] - y[judged]) / y[judged]) ** 2
            gain = theirs - ours
            by_block = np.bincount(np.unique(blocks[judged], return_inverse=True)[1].reshape(-1), weights=gain - gain.mean())
            score = {
                "boundary_new_tokens": count,
                "n_outliers_dropped": int((cleaned & ~keep).sum()),
                "n_readmitted_above": readmitted,
                "n_judged": int(judged.sum()),
                "cv_mean_squared_rel_err": float(ours.mean()),
                "against_cv_mean_squared_rel_err": float(theirs.mean()),
                "gain": float(gain.mean()),
                "gain_standard_error": float(np.sqrt(np.sum(by_block**2)) / gain.size),
                "borrowed_features": {segment: [n for n, mine, all_ in zip(names, part, self.identified_) if all_ and not mine]
                                      for segment, part in zip(SEGMENT_NAMES, own)},
            }
            report["candidates"][key] = score
            if best is None or score["gain"] > best[0]["gain"]:
                best = (score, {"boundary": count, "own": own, "keep": keep, "outlier_cut": cut}, key)
        if best is None or best[0]["gain"] <= best[0]["gain_standard_error"]:
            return {"chosen": None, "report": {**report, "chosen": None}}
        return {"chosen": best[1], "report": {**report, "chosen": best[2]}}

    def _choose_lora_work(self, x, y, load, groups, grouping: str) -> dict:
        """The per-token LoRA work form (``lora_work``): its report, with the features it holds at 0."""
        per_token = LORA_WORK_FORMS["both"]
        if not self.identified_[list(per_token)].any():
            return {"mode": "none", "chosen": None, "reason": "no slice ran an adapter", "held_at_zero": []}

        def held(form: str) -> list[str]:
            return [FEATURE_NAMES_LORA[k] for k in per_token if k not in LORA_WORK_FORMS[form]]

        if self.lora_work != "auto":
            return {"mode": "fixed", "chosen": self.lora_work, "held_at_zero": held(self.lora_work)}
        report = {
            "mode": "auto",
            "rule": "lowest cross-validated mean squared relative error (below 1e-18 counted as equal: rounding); 'both' kept only if it "
                    "beats the better single form by more than one standard error; between equal single forms 'tokens'",
            "fold_grouping": grouping,
        }
        folds = group_k_fold(groups, self.cv_folds)
        boundary = float(self.segments) if _is_real(self.segments) else None
        w = self._row_weights(y)
        aw, bw = x * w[:, None], y * w
        scores = {}
        for form in LORA_WORK_FORMS:
            identified = self.identified_ & ~np.isin(np.array(FEATURE_NAMES_LORA), held(form))
            fold_scores = []
            for test in folds:
                coef = self._fit_segments(aw, bw, load, boundary, ~test, identified)
                predicted = self._predict_rows(coef, boundary, x[test], load[test])
                fold_scores.append(float(np.mean(((predicted - y[test]) / y[test]) ** 2)))
            if fold_scores:
                scores[form] = {"cv_mean_squared_rel_err": float(np.mean(fold_scores)),
                                "cv_standard_error": float(np.std(fold_scores) / np.sqrt(len(fold_scores)))}
        if not scores:
            reason = "no fold to score on (fewer than two groups): both forms kept, NNLS weighs them"
            return {**report, "n_folds": 0, "candidates": {}, "chosen": "both", "reason": reason, "held_at_zero": held("both")}
        # relative errors under 1e-9 are rounding: scores below its square are equal (a noise-free trace)
        score = {form: max(v["cv_mean_squared_rel_err"], 1e-18) for form, v in scores.items()}
        single = min(("tokens", "rank_tokens"), key=score.__getitem__)
        chosen = single
        if score["both"] + scores["both"]["cv_standard_error"] < score[single]:
            chosen = "both"
        return {**report, "n_folds": len(folds), "candidates": scores, "chosen": chosen, "held_at_zero": held(chosen)}

    def _search_boundary(self, x, y, load, groups, grouping: str) -> dict:
        if self.segments == "none":
            return {"chosen": None, "report": {"mode": "none"}}
        if isinstance(self.segments, (int, float)) and not isinstance(self.segments, bool):
            return {"chosen": float(self.segments), "report": {"mode": "fixed"}}
        low, high = np.quantile(load, [0.05, 0.99])
        grid = np.concatenate(
            [
                np.quantile(load, np.linspace(0.1, 0.9, self.n_boundary_candidates)),
                np.geomspace(max(low, 1.0), max(high, 1.0), self.n_boundary_candidates),
            ]
        )
        candidates: list[float | None] = [None] + sorted({float(np.round(v)) for v in grid if v > load.min()})
        folds = group_k_fold(groups, self.cv_folds)
        n_groups = int(np.unique(groups).size)
        report = {
            "mode": "auto",
            "rule": "lowest cross-validated mean squared relative error; 'none' kept unless a boundary beats it by more than one standard error",
            "n_folds": len(folds),
            "fold_grouping": grouping,
            "n_groups": n_groups,
        }
        if not folds:
            reason = (
                f"no boundary could be cross-validated: the {y.size} training step(s) form {n_groups} {grouping.replace('_', '-')} group(s) "
                "and a fold needs another group to train on"
            )
            return {"chosen": None, "report": {**report, "candidates": {}, "chosen": "none", "reason": reason}}
        w = self._row_weights(y)
        aw, bw = x * w[:, None], y * w
        scores: dict[str, dict] = {}
        for boundary in candidates:
            key = "none" if boundary is None else f"{boundary:g}"
            if boundary is not None and not all(
                self._segment_is_estimable(x, mask) for mask in (load < boundary, load >= boundary)
            ):
                scores[key] = {"boundary_new_tokens": boundary, "skipped": "a segment has too few or rank-deficient steps"}
                continue
            fold_scores = []
            for test in folds:
                if not test.any() or test.all():
                    continue
                coef = self._fit_segments(aw, bw, load, boundary, ~test)
                predicted = self._predict_rows(coef, boundary, x[test], load[test])
                fold_scores.append(float(np.mean(((predicted - y[test]) / y[test]) ** 2)))
            if not fold_scores:
                continue
            scores[key] = {
                "boundary_new_tokens": boundary,
                "cv_mean_squared_rel_err": float(np.mean(fold_scores)),
                "cv_standard_error": float(np.std(fold_scores) / np.sqrt(len(fold_scores))),
            }
        scored = {k: v for k, v in scores.items() if "cv_mean_squared_rel_err" in v}
        if not scored:
            reason = "no boundary candidate could be scored on the folds"
            return {"chosen": None, "report": {**report, "candidates": scores, "chosen": "none", "reason": reason}}
        best_key = min(scored, key=lambda k: scored[k]["cv_mean_squared_rel_err"])
        best = scored[best_key]
        chosen_key = best_key
        if "none" in scored and scored["none"]["cv_mean_squared_rel_err"] <= best["cv_mean_squared_rel_err"] + best["cv_standard_error"]:
            chosen_key = "none"
        return {"chosen": scored[chosen_key]["boundary_new_tokens"], "report": {**report, "candidates": scores, "chosen": chosen_key}}

    # ---------------------------------------------------------------------------------------------------
    def check_is_fitted(self) -> None:
        """Raise ``NotFittedError`` (one line) unless the model was fitted or loaded."""
        if not hasattr(self, "coef_"):
            raise NotFittedError("this StepLatencyModel is not fitted yet; call fit(trace) or load a model file")

    def segment_of_steps(self, load: np.ndarray) -> np.ndarray:
        self.check_is_fitted()
        if self.boundary_ is None:
            return np.zeros(np.shape(load), dtype=np.intp)
        return (np.asarray(load) >= self.boundary_).astype(np.intp)

    def predict(self, trace: StepTrace) -> np.ndarray:
        """Predicted latency of every step of ``trace``, in seconds."""
        self.check_is_fitted()
        x = step_feature_matrix(trace, with_lora=self.is_lora_ and has_lora_columns(trace))  # no LoRA columns: features 0
        return self._predict_rows(self.coef_[:, : x.shape[1]], self.boundary_, x, step_new_tokens(trace))

    def score(self, trace: StepTrace, y: None = None) -> float:
        """Minus the median absolute relative error of the predicted step times (higher is better, as
        scikit-learn's model selection expects); warm-up steps are left out when ``drop_warmup``."""
        if y is not None:
            raise LlmvisorError("StepLatencyModel.score: the targets are the trace's step_latency_s; pass y=None")
        measured = trace.step_latency_s_per_step
        used = ~trace.is_warmup_per_step if self.drop_warmup else np.ones(trace.n_steps, dtype=bool)
        if not used.any():
            raise LlmvisorError("StepLatencyModel.score: no steps to score (every step is warm-up)")
        relative = np.abs(self.predict(trace)[used] - measured[used]) / measured[used]
        return -float(np.median(relative))

    @property
    def is_lora_(self) -> bool:
        """Whether the model prices LoRA adapters (fitted on a trace with the LoRA columns, or read from a file of
        format version 3 or 4)."""
        self.check_is_fitted()
        return self.coef_.shape[1] > N_FEATURES

    @property
    def segment_names_(self) -> tuple[str, ...]:
        self.check_is_fitted()
        return ("all",) if self.boundary_ is None else SEGMENT_NAMES

    # ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self.check_is_fitted()
        names = FEATURE_NAMES_LORA if self.is_lora_ else FEATURE_NAMES
        params = self.get_params()
        if not self.is_lora_:
            params = {k: v for k, v in params.items() if k not in LORA_ONLY_PARAMS}
        return {
            "format": MODEL_FORMAT,
            "format_version": MODEL_FORMAT_VERSION if self.is_lora_ else BASE_MODEL_FORMAT_VERSION,
            "params": params,
            "feature_names": list(names),
            "boundary_new_tokens": self.boundary_,
            "segments": [
                {"name": name, "coef_s": dict(zip(names, map(float, coef)))}
                for name, coef in zip(self.segment_names_, self.coef_)
            ],
            "identified_features": [n for n, ok in zip(names, self.identified_) if ok],
            "rank": self.rank_,
            "engine_fingerprint": getattr(self, "engine_fingerprint_", None),
            "fit_info": self.fit_info_,
        }

    def to_json(self, path: str | os.PathLike) -> None:
        with replaced_atomically(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "<memory>") -> StepLatencyModel:
        if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
            raise ModelError(f"{source}: not an llmvisor model file (format {data.get('format') if isinstance(data, dict) else None!r})")
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
            readable = ", ".join(map(str, READABLE_FORMAT_VERSIONS))
            raise ModelError(f"{source}: model format version {version!r} is not supported (this llmvisor reads {readable})")
        unknown = unknown_name(data, MODEL_FILE_KEYS, kind="key")
        if unknown:
            raise ModelError(f"{source}: {unknown}")
        try:
            names = data["feature_names"]
            # The feature list first: the segments' coefficients are named by it, so a wrong list is the reason to give.
            if list(names) not in (list(v) for v in READABLE_FORMAT_VERSIONS.values()):
                raise ModelError(f"{source}: feature_names {names} differ from this version's {list(FEATURE_NAMES)}")
            for k, segment in enumerate(data["segments"]):
                unknown = unknown_name(segment, ("name", "coef_s"), kind="key") if isinstance(segment, dict) else None
                unknown = unknown or (unknown_name(segment["coef_s"], names, kind="feature")
                                      if isinstance(segment, dict) and isinstance(segment.get("coef_s"), dict) else None)
                if unknown:
                    raise ModelError(f"{source}: segments[{k}]: {unknown}")
            model = cls(**data.get("params", {}))
            model.boundary_ = None if data["boundary_new_tokens"] is None else float(data["boundary_new_tokens"])
            known = FEATURE_NAMES_LORA if list(names) in (list(FEATURE_NAMES_LORA), list(FEATURE_NAMES_LORA_V3)) else FEATURE_NAMES
            model.coef_ = np.array([[float(s["coef_s"][n]) if n in names else 0.0 for n in known] for s in data["segments"]])
            model.coef_ = model.coef_.reshape(-1, len(known))
            expected = 1 if model.boundary_ is None else 2
            if model.coef_.shape[0] != expected:
                raise ModelError(f"{source}: segments: expected {expected} coefficient sets, got {model.coef_.shape[0]}")
            if not np.all(np.isfinite(model.coef_)):
                raise ModelError(f"{source}: segments: coefficients must be finite")
            model.identified_ = np.array([n in data.get("identified_features", names) and n in names for n in known])
            model.rank_ = int(data.get("rank", 0))
            model.fit_info_ = dict(data.get("fit_info", {}))
            fingerprint = data.get("engine_fingerprint")
            if fingerprint is not None and not (isinstance(fingerprint, dict) and isinstance(fingerprint.get("id"), str)):
                raise ModelError(f"{source}: engine_fingerprint must be null or an object with an id")
            model.engine_fingerprint_ = fingerprint
            model.feature_names_ = known
            model.n_features_in_ = len(known)
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, ModelError):
                raise
            raise ModelError(f"{source}: malformed model file ({type(error).__name__}: {error})") from None
        return model

    @classmethod
    def from_coefficients(cls, coef_s: list[dict], boundary_new_tokens: float | None = None) -> StepLatencyModel:
        """A model with known coefficients (one dict of seconds per feature for each segment), checked as a
        model file is: for tests, and for users who take coefficients from elsewhere. Features added since
        format version 1 (``effective_context_tokens``) are 0 unless given; a LoRA feature given in any segment makes
        a LoRA model (format version 4), its other LoRA features 0."""
        names = ("all",) if boundary_new_tokens is None else SEGMENT_NAMES
        is_lora = any(isinstance(coef, dict) and set(coef) & set(LORA_FEATURE_NAMES) for coef in coef_s)
        features = FEATURE_NAMES_LORA if is_lora else FEATURE_NAMES
        added = [name for name in features if name not in FEATURE_NAMES_V1]
        coef_s = [{**dict.fromkeys(added, 0.0), **coef} if isinstance(coef, dict) else coef for coef in coef_s]
        return cls.from_dict(
            {
                "format": MODEL_FORMAT,
                "format_version": MODEL_FORMAT_VERSION if is_lora else BASE_MODEL_FORMAT_VERSION,
                "params": {},
                "feature_names": list(features),
                "boundary_new_tokens": boundary_new_tokens,
                "segments": [{"name": name, "coef_s": coef} for name, coef in zip(names, coef_s)],
            }
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> StepLatencyModel:
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ModelError(f"{path}: no such model file") from None
        except IsADirectoryError:
            raise ModelError(f"{path}: is a folder, not a model file") from None
        except OSError as error:
            raise ModelError(f"{path}: cannot read the model file ({error.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ModelError(f"{path}: not valid JSON ({error})") from None
        return cls.from_dict(data, source=str(path))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"StepLatencyModel({params})"
