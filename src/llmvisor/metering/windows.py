"""Window aggregates: a run instance's steps attributed at the edge and summed per window of step start.

Why: storing every co-batched step centrally does not scale (issue #22); a bill needs per tenant and request
sums, and the trust checks need the step ids covered. `WindowAggregator` buffers one window's steps and, when
the window closes, attributes them with the active model of the run's engine class (one cost game:
`llmvisor.core.attribution.attribute_arrays`, the same call the service's per-step ingest makes) and rounds each
step's shares to integer nanoseconds with `llmvisor.core.rounding.apportion_ns`, the ledger's own rule. So a
window's Σ attributed equals its Σ measured to the nanosecond, and a tenant's total over windows equals the
total per-step ingest would store for the same steps, exactly.

A window whose class has no model is *pending*: measured time and tokens kept, nothing attributed
(``attributed_ns`` 0), ``model_version`` None. The delivery process sends no pending window: with
``unattributed_steps=True`` the aggregator hands such a window back as its raw steps (`UnattributedWindow`),
which the delivery process sends per step, so the service attributes them with the model it picks, or stores
them pending and attributes them, exactly, when a model of the class is activated.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from llmvisor.core.attribution import attribute_arrays
from llmvisor.core.features import LoraSlices, lora_slices
from llmvisor.core.lora_trace import decode_adapters
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.rounding import apportion_ns
from llmvisor.core.tokens import TOKEN_SPLIT, add_counts, token_split
from llmvisor.errors import LlmvisorError, unknown_name

DEFAULT_WINDOW_S = 1.0
WINDOW_FORMAT = 3
"""The newest window format: 2 carries KV memory-time (`KvWindow`, trace format 3's columns summed), 1 does not;
3 carries each request's LoRA adapter (``RequestWindow.lora_name``, trace format 4), with or without KV. A window is
written as format 1 when its steps carry no KV figures and no adapter, byte for byte as before (its digest
unchanged), and as format 2 when they carry KV figures but no adapter."""
READABLE_WINDOW_FORMATS = (1, 2, 3)
LORA_FIELD = "lora_name"
"""A request's adapter in a format-3 window: the trace's ``lora_name``, empty for the base model."""
MAX_NAME_CHARS = 512

ModelSource = Callable[[], "tuple[StepLatencyModel, int] | None"]
"""Returns the active (model, registry version) of the run's engine class, or None (the window is pending)."""
OnClose = Callable[["WindowAggregate", np.ndarray], None]
"""Called with each window as it closes and its steps' relative residuals (measured − predicted) / predicted
(none for a pending window), e.g. `llmvisor.metering.prometheus.EdgeMetrics.record_window`."""


class WindowError(LlmvisorError):
    """A window aggregate that cannot be read: the message names the field and the reason."""


@dataclass
class RequestWindow:
    """One request's part of a window: its attributed share and the measured time of the steps it ran in."""

    request_id: str
    tenant: str
    attributed_ns: int
    measured_ns: int
    num_new_tokens: int
    num_steps: int
    first_timestamp_us: int
    last_timestamp_us: int
    num_uncached_prompt_tokens: int | None = None
    """The split of ``num_new_tokens`` (ledger schema 6, `llmvisor.ledger.schema.TOKEN_SPLIT_COLUMNS`): prefill
    slices' tokens, the prefix-cache hit (the ``num_cached_prompt_tokens`` slice fact, 0 where absent) and decode
    slices' tokens. None: an edge that did not send the split (stored as unknown, NULL)."""
    num_cached_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    kv_block_ns: int | None = None
    """Window format 2: the KV block-nanoseconds of the request's slices in the window (trace format 3's
    ``kv_block_ns`` summed); None in format 1."""
    lora_name: str | None = None
    """Window format 3: the LoRA adapter the request ran with ('' the base model); None in formats 1 and 2."""


@dataclass
class KvWindow:
    """A window's KV pool figures (format 2): trace format 3's step columns summed over the window's steps, and the
    run's pool size and block bytes. With the requests' ``kv_block_ns`` they add up exactly:
    Σ requests − carried_in + carried_out + idle + free = pool_blocks × interval_ns."""

    interval_ns: int
    idle_block_ns: int
    free_block_ns: int
    carried_in_block_ns: int
    carried_out_block_ns: int
    pool_blocks: int
    block_bytes: int


KV_STEP_FIELDS = ("interval_ns", "idle_block_ns", "free_block_ns", "carried_in_block_ns", "carried_out_block_ns")
"""`KvWindow`'s per-step sums, in the order of a relayed step's KV element (`llmvisor.core.trace_schema.KV_STEP_COLUMNS`)."""


@dataclass
class ResidualStats:
    """Measured − predicted step time over the window's attributed steps, in seconds: enough for drift
    (mean, spread, extremes) and to merge windows."""

    count: int = 0
    sum_s: float = 0.0
    sum_sq_s2: float = 0.0
    min_s: float | None = None
    max_s: float | None = None


@dataclass
class WindowAggregate:
    """Per run instance and window ``[window_start_us, window_end_us)`` of step start."""

    run_id: str
    engine_class: str
    window_start_us: int
    window_end_us: int
    model_version: int | None
    pending: bool
    num_steps: int
    measured_ns: int
    attributed_ns: int
    step_ranges: list[list[int]]
    requests: list[RequestWindow]
    residual: ResidualStats = field(default_factory=ResidualStats)
    format: int = 1
    kv: KvWindow | None = None
    """KV memory-time (format 2, or 3 with KV), None otherwise."""

    def tenant_totals(self) -> dict[str, dict[str, int]]:
        """Per tenant: attributed and measured ns, slices (a request's steps) and new tokens."""
        return self._totals(lambda r: r.tenant)

    def tenant_adapter_totals(self) -> dict[tuple[str, str | None], dict[str, int]]:
        """`tenant_totals` per (tenant, adapter): the adapter None for the base model and in formats 1 and 2."""
        return self._totals(lambda r: (r.tenant, r.lora_name or None))

    def _totals(self, key) -> dict:
        out: dict = {}
        for r in self.requests:
            t = out.setdefault(key(r), {"attributed_ns": 0, "measured_ns": 0, "num_slices": 0, "num_new_tokens": 0,
                                          **dict.fromkeys(TOKEN_SPLIT, 0)})
            t["attributed_ns"] += r.attributed_ns
            t["measured_ns"] += r.measured_ns
            t["num_slices"] += r.num_steps
            t["num_new_tokens"] += r.num_new_tokens
            for name in TOKEN_SPLIT:
                t[name] = add_counts(t[name], getattr(r, name))
        return out

    def tenant_kv_block_ns(self, *, by_adapter: bool = False) -> dict:
        """Per tenant (per (tenant, adapter) with ``by_adapter``, as `tenant_adapter_totals`): the KV block-nanoseconds
        of its requests in the window (empty without KV figures)."""
        out: dict = {}
        if self.kv is None:
            return out
        for r in self.requests:
            key = (r.tenant, r.lora_name or None) if by_adapter else r.tenant
            out[key] = out.get(key, 0) + int(r.kv_block_ns or 0)
        return out

    def step_ids(self) -> np.ndarray:
        return np.concatenate([np.arange(a, b + 1, dtype=np.int64) for a, b in self.step_ranges]) if self.step_ranges else np.zeros(0, np.int64)

    def to_json(self) -> dict:
        """What `dataclasses.asdict` gives (the same keys, order and values: the stored idempotency digests
        depend on it), built directly: asdict's recursive deep copy was a fifth of the service's time per window."""
        out = {}
        for name in _WINDOW_FIELDS:
            value = getattr(self, name)
            if name == "step_ranges":
                value = [list(r) for r in value]
            elif name == "requests":
                fields_ = _request_fields(kv=self.kv is not None, lora=self.format >= 3)
                value = [{f: getattr(q, f) for f in fields_} for q in value]
            elif name == "residual":
                value = {f: getattr(value, f) for f in _RESIDUAL_FIELDS}
            elif name == "kv":
                if value is None:  # format 1: no key, so its digest is what it always was
                    continue
                value = {f: getattr(value, f) for f in _KV_FIELDS}
            out[name] = value
        return out

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    def content_sha256(self) -> bytes:
        """The idempotency digest: an identical re-send has the same one."""
        return hashlib.sha256(self.canonical_bytes()).digest()

    def first_step_sha256(self) -> bytes:
        """The canonical JSON's digest without the run id: for a run's first window (covering step 0) the digest a
        re-send of the run under another run id repeats (the ledger's ``run_digests``)."""
        anonymous = {name: value for name, value in self.to_json().items() if name != "run_id"}
        return hashlib.sha256(b"run-v1\x1e" + json.dumps(anonymous, sort_keys=True, separators=(",", ":")).encode()).digest()

    @classmethod
    def from_json(cls, data: object, *, where: str = "window") -> WindowAggregate:
        """Read and check one aggregate; a `WindowError` names the field (``where.field``) and the reason."""
        if not isinstance(data, dict):
            raise WindowError(f"{where}: must be an object")
        r = _Reader(data, where, known=_WINDOW_KEYS)
        fmt = r.integer("format", low=1, default=1)
        if fmt not in READABLE_WINDOW_FORMATS:
            raise WindowError(f"{where}.format: unknown window format {fmt}; this llmvisor reads "
                              f"{', '.join(map(str, READABLE_WINDOW_FORMATS))}")
        start, end = r.integer("window_start_us", low=0), r.integer("window_end_us", low=0)
        if end <= start:
            raise WindowError(f"{where}.window_end_us: must be after window_start_us ({end} <= {start})")
        pending = r.boolean("pending")
        version = r.integer("model_version", low=1, optional=True)
        if pending != (version is None):
            raise WindowError(f"{where}.model_version: a pending window has none, an attributed one has one")
        ranges = r.ranges("step_ranges")
        num_steps = r.integer("num_steps", low=1)
        if sum(b - a + 1 for a, b in ranges) != num_steps:
            raise WindowError(f"{where}.step_ranges: cover {sum(b - a + 1 for a, b in ranges)} steps, num_steps says {num_steps}")
        measured, attributed = r.integer("measured_ns", low=0), r.integer("attributed_ns", low=0)
        requests_raw = r.get("requests", list)
        if not requests_raw:
            raise WindowError(f"{where}.requests: must list at least one request")
        has_kv = fmt == 2 or (fmt >= 3 and data.get("kv") is not None)
        requests = [_request_from_json(item, f"{where}.requests[{k}]", kv=has_kv, lora=fmt >= 3) for k, item in enumerate(requests_raw)]
        keys = [(q.request_id, q.tenant) for q in requests]
        if len(set(keys)) != len(keys):
            raise WindowError(f"{where}.requests: a (request_id, tenant) is listed twice")
        total_attributed = sum(q.attributed_ns for q in requests)
        if total_attributed != attributed:
            raise WindowError(f"{where}.attributed_ns: {attributed} but the requests' sum is {total_attributed}")
        if attributed != (0 if pending else measured):
            raise WindowError(
                f"{where}.attributed_ns: must equal measured_ns ({measured}) exactly"
                + (" (a pending window attributes nothing: 0)" if pending else "")
            )
        if any(q.measured_ns > measured for q in requests):
            raise WindowError(f"{where}.requests: a request's measured_ns exceeds the window's")
        residual = _residual_from_json(r.get("residual", dict), f"{where}.residual")
        kv = None
        if has_kv:
            kv = _kv_from_json(r.get("kv", dict), f"{where}.kv", requests)
        elif "kv" in data and fmt < 3:
            raise WindowError(f"{where}.kv: a format-1 window carries no KV figures (format 2 does)")
        return cls(
            run_id=r.name("run_id"), engine_class=r.name("engine_class", allow_empty=True), window_start_us=start, window_end_us=end,
            model_version=version, pending=pending, num_steps=num_steps, measured_ns=measured, attributed_ns=attributed,
            step_ranges=ranges, requests=requests, residual=residual, format=fmt, kv=kv,
        )


_WINDOW_FIELDS = tuple(f.name for f in fields(WindowAggregate))
_REQUEST_FIELDS = tuple(f.name for f in fields(RequestWindow))


def _request_fields(*, kv: bool, lora: bool) -> tuple[str, ...]:
    """A request's keys in a window with (format 2 or 3) or without KV figures, with (format 3) or without adapters."""
    return tuple(name for name in _REQUEST_FIELDS if (kv or name != "kv_block_ns") and (lora or name != LORA_FIELD))


_RESIDUAL_FIELDS = tuple(f.name for f in fields(ResidualStats))
_KV_FIELDS = tuple(f.name for f in fields(KvWindow))
_WINDOW_KEYS, _RESIDUAL_KEYS = frozenset(_WINDOW_FIELDS), frozenset(_RESIDUAL_FIELDS)


class _Reader:
    def __init__(self, data: dict, where: str, *, known: frozenset[str]):
        """Refuses a key not in ``known`` (naming the closest known one): a misspelled optional field read as absent
        would bill wrongly without a word."""
        self.data, self.where = data, where
        if not data.keys() <= known:
            raise WindowError(f"{where}: {unknown_name(data, sorted(known))}")

    def get(self, name: str, kind: type, *, optional: bool = False, default=None):
        if name not in self.data or self.data[name] is None:
            if optional or default is not None:
                return default
            raise WindowError(f"{self.where}.{name}: missing")
        value = self.data[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise WindowError(f"{self.where}.{name}: must be an integer, not {value!r:.60}")
        if kind is not int and not isinstance(value, kind):
            raise WindowError(f"{self.where}.{name}: must be {kind.__name__}, not {type(value).__name__}")
        return value

    def integer(self, name: str, *, low: int, optional: bool = False, default=None) -> int | None:
        value = self.get(name, int, optional=optional, default=default)
        if value is not None and not low <= value < 2**63:
            raise WindowError(f"{self.where}.{name}: {value} is out of range (at least {low}, below 2**63)")
        return value

    def boolean(self, name: str) -> bool:
        return self.get(name, bool)

    def name(self, name: str, *, allow_empty: bool = False) -> str:
        value = self.get(name, str)
        if (not value and not allow_empty) or len(value) > MAX_NAME_CHARS:
            raise WindowError(f"{self.where}.{name}: must be 1 to {MAX_NAME_CHARS} characters")
        return value

    def ranges(self, name: str) -> list[list[int]]:
        raw = self.get(name, list)
        out: list[list[int]] = []
        for k, item in enumerate(raw):
            if (not isinstance(item, list) or len(item) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63 for v in item) or item[1] < item[0]):
                raise WindowError(f"{self.where}.{name}[{k}]: must be [first, last] step ids, 0 <= first <= last")
            if out and item[0] <= out[-1][1] + 1:
                raise WindowError(f"{self.where}.{name}[{k}]: ranges must be sorted, disjoint and not adjacent")
            out.append([item[0], item[1]])
        if not out:
            raise WindowError(f"{self.where}.{name}: must list at least one range")
        return out


def _request_from_json(data: object, where: str, *, kv: bool = False, lora: bool = False) -> RequestWindow:
    if not isinstance(data, dict):
        raise WindowError(f"{where}: must be an object")
    r = _Reader(data, where, known=frozenset(_request_fields(kv=kv, lora=lora)))
    first, last = r.integer("first_timestamp_us", low=0), r.integer("last_timestamp_us", low=0)
    if last < first:
        raise WindowError(f"{where}.last_timestamp_us: before first_timestamp_us")
    split = {name: r.integer(name, low=0, optional=True) for name in TOKEN_SPLIT}
    given = [name for name, value in split.items() if value is not None]
    if given and len(given) != len(TOKEN_SPLIT):
        missing = next(name for name in TOKEN_SPLIT if split[name] is None)
        raise WindowError(f"{where}.{missing}: missing (the token split is given whole or not at all)")
    new_tokens = r.integer("num_new_tokens", low=0)
    if given and split["num_uncached_prompt_tokens"] + split["num_output_tokens"] != new_tokens:
        raise WindowError(f"{where}.num_output_tokens: num_uncached_prompt_tokens + num_output_tokens must equal "
                          f"num_new_tokens ({new_tokens})")
    return RequestWindow(
        request_id=r.name("request_id"), tenant=r.name("tenant"), attributed_ns=r.integer("attributed_ns", low=0),
        measured_ns=r.integer("measured_ns", low=0), num_new_tokens=new_tokens,
        num_steps=r.integer("num_steps", low=1), first_timestamp_us=first, last_timestamp_us=last, **split,
        kv_block_ns=r.integer("kv_block_ns", low=0) if kv else None,
        lora_name=r.name(LORA_FIELD, allow_empty=True) if lora else None,
    )


def _kv_from_json(data: dict, where: str, requests: list[RequestWindow]) -> KvWindow:
    r = _Reader(data, where, known=frozenset(_KV_FIELDS))
    kv = KvWindow(**{name: r.integer(name, low=1 if name == "block_bytes" else 0) for name in _KV_FIELDS})
    held = sum(q.kv_block_ns for q in requests)
    if kv.carried_in_block_ns > held:
        raise WindowError(f"{where}.carried_in_block_ns: {kv.carried_in_block_ns}, more than the requests hold ({held})")
    total = held - kv.carried_in_block_ns + kv.carried_out_block_ns + kv.idle_block_ns + kv.free_block_ns
    if total != kv.pool_blocks * kv.interval_ns:
        raise WindowError(f"{where}: KV memory does not add up: the requests' {held} − carried in + carried out + idle + "
                          f"free = {total} block-ns, but pool_blocks × interval_ns = {kv.pool_blocks * kv.interval_ns}")
    return kv


def _residual_from_json(data: dict, where: str) -> ResidualStats:
    out = ResidualStats(count=_Reader(data, where, known=_RESIDUAL_KEYS).integer("count", low=0, default=0))
    for name in ("sum_s", "sum_sq_s2", "min_s", "max_s"):
        value = data.get(name)
        if value is None:
            if name in ("sum_s", "sum_sq_s2") and out.count:
                raise WindowError(f"{where}.{name}: missing")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise WindowError(f"{where}.{name}: must be a finite number")
        setattr(out, name, float(value))
    return out


@dataclass
class UnattributedWindow:
    """A window closed while its class had no model at the edge: its relayed steps
    (``[step_id, timestamp_s, step_latency_s, slices]``) as they came, to be sent per step."""

    run_id: str
    engine_class: str
    window_start_us: int
    window_end_us: int
    steps: list[list]


class WindowAggregator:
    """Steps of one run instance in, closed `WindowAggregate` s out.

    ``add`` takes a relayed step (``step_id, timestamp_s, step_latency_s`` and slices ``[request_id, tenant,
    num_new_tokens, num_context_tokens, is_prefill, num_shared_context_tokens, effective_context_tokens]``, and an
    optional eighth item, ``num_cached_prompt_tokens``: 0 where absent) and
    returns the windows it closed (a step of a later window closes the earlier ones; ``close_due`` closes a window
    once the clock is past its end by ``grace_s``, for an idle engine; ``close`` closes the last). Step ids at or
    below the last one added are re-sends and skipped; a step dated before the open window (clocks are not
    monotonic), or in a window already closed (a step that arrived after `close_due` closed its window), is
    counted in the open window or the next one, so no window is sent twice with different content.
    ``first_step_id`` and ``floor_us`` resume a run another aggregator began (a delivery process replacing one
    that died): steps below ``first_step_id`` are in windows already sent, and no window starts before ``floor_us``;
    `resume_after` adds what the service and the spool hold (steps skipped, a floor past their last window).

    ``unattributed_steps``: a window closed while ``model_source`` has no model comes back as an
    `UnattributedWindow` (its raw steps) instead of a pending `WindowAggregate`. ``on_close`` (optional,
    `OnClose`) sees each attributed or pending window as it closes.

    KV memory-time (trace format 3): with ``kv_pool_blocks`` and ``kv_block_bytes`` (the run's, from its header)
    and steps that carry their KV element and slices their ``kv_block_ns``, windows are format 2 (`KvWindow`); a
    window with any step without them is format 1.

    LoRA adapters (trace format 4): ``add``'s ``named`` is the relayed step's named element (`llmvisor.core.relayed`);
    its LoRA columns price each adapter's terms exactly as per-step ingest does, and a window where some request ran
    an adapter is format 3 (each request's ``lora_name``).
    """

    def __init__(self, run_id: str, engine_class: str, model_source: ModelSource, *, window_s: float = DEFAULT_WINDOW_S,
                 grace_s: float = 0.5, unattributed_steps: bool = False, first_step_id: int | None = None, floor_us: int = 0,
                 on_close: OnClose | None = None, kv_pool_blocks: int | None = None, kv_block_bytes: int | None = None):
        if not window_s > 0 or not math.isfinite(window_s):
            raise LlmvisorError(f"window_s: must be a positive number of seconds, not {window_s!r}")
        self.run_id, self.engine_class, self.model_source, self.on_close = run_id, engine_class, model_source, on_close
        self.unattributed_steps = unattributed_steps
        self.kv_run = (int(kv_pool_blocks), int(kv_block_bytes)) if kv_pool_blocks is not None and kv_block_bytes else None
        self.window_us = max(int(round(window_s * 1e6)), 1)
        self.grace_us = int(round(grace_s * 1e6))
        self.last_step_id: int | None = None if first_step_id is None else first_step_id - 1
        self.closed_until_us = int(floor_us)
        """No window starts before this: the end of the last window closed (or the resumed floor)."""
        self._start_us: int | None = None
        self._steps: list[tuple] = []  # (id, window-clamped start µs, latency, slices, timestamp_s, KV element, named element)
        self._held: list[list[int]] = []
        self._held_firsts: list[int] = []
        self.skipped_held = 0
        """Steps skipped because `resume_after` said they are held already."""

    def resume_after(self, held: Iterable[Sequence[int]], floor_us: int) -> None:
        """Resume a run whose steps in the ``held`` ranges ``[first, last]`` are stored or spooled already (by a
        delivery process that died): those steps are skipped, never aggregated again, and no window starts
        before ``floor_us`` (where the last window held ends), so every window from here has a key nobody sent
        and holds only steps nobody sent. Call before the first `add`."""
        if self._steps:
            raise LlmvisorError("resume_after: call it before the first step")
        self._held = union_ranges(held)
        self._held_firsts = [a for a, _ in self._held]
        self.closed_until_us = max(self.closed_until_us, int(floor_us))

    def _is_held(self, step_id: int) -> bool:
        k = bisect.bisect_right(self._held_firsts, step_id) - 1
        return k >= 0 and step_id <= self._held[k][1]

    @property
    def open_window_start_us(self) -> int | None:
        return self._start_us

    @property
    def open_steps(self) -> int:
        return len(self._steps)

    def first_open_step_id(self) -> int | None:
        return self._steps[0][0] if self._steps else None

    def add(self, step_id: int, timestamp_s: float, step_latency_s: float, slices: list,
            kv: Sequence[int] | None = None, named: dict | None = None) -> list[WindowAggregate | UnattributedWindow]:
        if self.last_step_id is not None and step_id <= self.last_step_id:
            return []
        self.last_step_id = step_id
        if self._held and self._is_held(step_id):
            self.skipped_held += 1
            return []
        timestamp_us = int(round(timestamp_s * 1e6))
        start_us = max(timestamp_us // self.window_us * self.window_us, self.closed_until_us)
        closed = []
        if self._start_us is not None and start_us > self._start_us:
            closed.append(self._close())
        if self._start_us is None:
            self._start_us = start_us
        self._steps.append((step_id, max(timestamp_us, self._start_us), float(step_latency_s), slices, timestamp_s, kv, named))
        return closed

    def close_due(self, now_s: float) -> list[WindowAggregate | UnattributedWindow]:
        if self._start_us is not None and now_s * 1e6 >= self._start_us + self.window_us + self.grace_us:
            return [self._close()]
        return []

    def close(self) -> list[WindowAggregate | UnattributedWindow]:
        return [self._close()] if self._steps else []

    def _close(self) -> WindowAggregate | UnattributedWindow:
        steps, start_us = self._steps, self._start_us
        self._steps, self._start_us = [], None
        self.closed_until_us = start_us + self.window_us
        model = self.model_source()
        if model is None and self.unattributed_steps:
            return UnattributedWindow(self.run_id, self.engine_class, start_us, start_us + self.window_us,
                                      [_relayed(s) for s in steps])
        window, relative = _aggregate(self.run_id, self.engine_class, start_us, start_us + self.window_us, steps, model,
                                      kv_run=self.kv_run)
        if self.on_close is not None:
            self.on_close(window, relative)
        return window


def _relayed(step: tuple) -> list:
    """A buffered step as the relayed step it came as (`llmvisor.core.relayed`): its KV and named elements where given."""
    out = [step[0], step[4], step[2], step[3]]
    named = step[6] if len(step) > 6 else None
    if named:
        return out + [step[5], named]
    return out + ([step[5]] if step[5] is not None else [])


def _window_lora(steps: list, offsets: np.ndarray, num_new_tokens: np.ndarray) -> tuple[LoraSlices | None, list[str] | None]:
    """The window's `LoraSlices` and each slice's adapter name ('' the base model), from its steps' named elements
    (trace format 4's LoRA columns); (None, None) where no slice ran an adapter, so such a window is priced and
    written as before. A step without the columns ran the base model only."""
    names: list[str] = []
    ranks: list[int] = []
    loads: list[frozenset] = []
    disk_loads: list[frozenset] = []
    for s in steps:
        named = s[6] if len(s) > 6 and s[6] else {}
        per_slice, per_step = named.get("slice") or {}, named.get("step") or {}
        n = len(s[3])
        if "lora_name" in per_slice:
            names += [str(v) for v in per_slice["lora_name"]]
            ranks += [int(v) for v in per_slice["lora_rank"]]
        else:
            names += [""] * n
            ranks += [0] * n
        loads.append(decode_adapters(per_step.get("step_lora_loads", "[]")) or frozenset())
        disk_loads.append(decode_adapters(per_step.get("step_lora_disk_loads", "[]")) or frozenset())
    if not any(names):
        return None, None
    return lora_slices(names, ranks, offsets, loads, disk_loads, num_new_tokens=num_new_tokens), names


def union_ranges(ranges: Iterable[Sequence[int]]) -> list[list[int]]:
    """Step-id ranges ``[first, last]`` (inclusive, in any order, overlapping or not) as sorted, disjoint ranges
    with no two adjacent; a `LlmvisorError` for one that is not two integers ``first <= last``."""
    out: list[list[int]] = []
    checked = []
    for item in ranges:
        if (len(item) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in item) or item[1] < item[0]):
            raise LlmvisorError(f"step range {list(item)!r:.80}: must be [first, last] step ids, first <= last")
        checked.append((int(item[0]), int(item[1])))
    for first, last in sorted(checked):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return out


def aggregate_window(run_id: str, engine_class: str, start_us: int, end_us: int, steps: list[tuple[int, int, float, list]],
                     model: tuple[StepLatencyModel, int] | None, *, kv_run: tuple[int, int] | None = None) -> WindowAggregate:
    """One window of ``(step_id, timestamp_us, step_latency_s, slices[, timestamp_s, KV element, named element])`` attributed with
    ``model`` (None: pending); ``kv_run``: the run's (pool blocks, block bytes), for format 2."""
    return _aggregate(run_id, engine_class, start_us, end_us, steps, model, kv_run=kv_run)[0]


def _aggregate(run_id: str, engine_class: str, start_us: int, end_us: int, steps: list[tuple[int, int, float, list]],
               model: tuple[StepLatencyModel, int] | None, *, kv_run: tuple[int, int] | None = None
               ) -> tuple[WindowAggregate, np.ndarray]:
    """`aggregate_window`, and its steps' relative residuals (measured − predicted) / predicted (empty: pending)."""
    sizes = np.fromiter((len(s[3]) for s in steps), dtype=np.int64, count=len(steps))
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    slices = [x for s in steps for x in s[3]]
    request = [str(x[0]) for x in slices]
    tenant = [str(x[1]) for x in slices]
    new = np.fromiter((x[2] for x in slices), dtype=np.float64, count=len(slices))
    context = np.fromiter((x[3] for x in slices), dtype=np.float64, count=len(slices))
    prefill = np.fromiter((bool(x[4]) for x in slices), dtype=bool, count=len(slices))
    effective = None
    if slices and all(len(x) > 6 and x[6] is not None for x in slices):
        effective = np.fromiter((x[6] for x in slices), dtype=np.float64, count=len(slices))
    latency_s = np.fromiter((s[2] for s in steps), dtype=np.float64, count=len(steps))
    timestamp_us = np.fromiter((s[1] for s in steps), dtype=np.int64, count=len(steps))
    measured_ns = np.rint(latency_s * 1e9).astype(np.int64)
    residual = ResidualStats()
    relative = np.zeros(0, dtype=np.float64)
    lora, lora_names = _window_lora(steps, offsets, new)
    if model is None:
        attributed_ns = np.zeros(len(slices), dtype=np.int64)
    else:
        # the call per-step ingest makes (`llmvisor.core.attribution.attribute`): adapters priced by a LoRA model only
        attribution = attribute_arrays(model[0], new, context, prefill, offsets, latency_s, effective_context_tokens=effective,
                                       lora=lora if model[0].is_lora_ else None)
        attributed_ns = apportion_ns(attribution.share_s, offsets, measured_ns)
        r = latency_s - attribution.predicted_step_s
        residual = ResidualStats(int(r.size), float(r.sum()), float((r * r).sum()), float(r.min()), float(r.max()))
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = r / attribution.predicted_step_s
    cached = np.fromiter((int(x[7] or 0) if len(x) > 7 else 0 for x in slices), dtype=np.int64, count=len(slices))
    uncached, cached, output = token_split(new.astype(np.int64), prefill, cached)
    slice_measured = np.repeat(measured_ns, sizes)
    slice_ts = np.repeat(timestamp_us, sizes)
    # per (request, tenant): sums over its slices, its first slice's start and its last's, by numpy over groups
    # (a Python loop per slice was a quarter of a window's cost at the edge)
    group_of: dict[tuple[str, str], int] = {}
    group = np.fromiter((group_of.setdefault(key, len(group_of)) for key in zip(request, tenant)), dtype=np.int64,
                        count=len(slices))
    keys = list(group_of)
    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=len(keys))
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)

    def by_group(values: np.ndarray) -> list[int]:
        return np.add.reduceat(values.astype(np.int64)[order], firsts).tolist() if keys else []

    sums = [by_group(v) for v in (attributed_ns, slice_measured, new)]
    kv = None
    kv_per_group: list = [None] * len(keys)
    if (kv_run is not None and steps and all(len(s) > 5 and s[5] is not None for s in steps)
            and all(len(x) > 8 for x in slices)):
        per_step = np.asarray([list(s[5]) for s in steps], dtype=np.int64).sum(axis=0).tolist()
        kv = KvWindow(*per_step, pool_blocks=kv_run[0], block_bytes=kv_run[1])
        kv_per_group = by_group(np.fromiter((x[8] for x in slices), dtype=np.int64, count=len(slices)))
    split = [by_group(v) for v in (uncached, cached, output)]
    group_lora: list = [None] * len(keys)
    if lora_names is not None:  # a request runs one adapter: its first slice's
        first_slice = order[firsts] if keys else np.zeros(0, np.int64)
        group_lora = [lora_names[k] for k in first_slice.tolist()]
    sorted_ts = slice_ts[order]
    first_ts = sorted_ts[firsts].tolist() if keys else []
    last_ts = sorted_ts[firsts + counts - 1].tolist() if keys else []
    num_steps = counts.tolist()
    step_ids = [s[0] for s in steps]
    ranges: list[list[int]] = []
    for step_id in step_ids:
        if ranges and step_id == ranges[-1][1] + 1:
            ranges[-1][1] = step_id
        else:
            ranges.append([step_id, step_id])
    total_measured = int(measured_ns.sum())
    window = WindowAggregate(
        run_id=run_id, engine_class=engine_class, window_start_us=start_us, window_end_us=end_us,
        model_version=None if model is None else int(model[1]), pending=model is None, num_steps=len(steps),
        measured_ns=total_measured, attributed_ns=0 if model is None else int(attributed_ns.sum()), step_ranges=ranges,
        requests=[RequestWindow(q, t, sums[0][g], sums[1][g], sums[2][g], num_steps[g], first_ts[g], max(first_ts[g], last_ts[g]),
                                split[0][g], split[1][g], split[2][g], kv_per_group[g], group_lora[g])
                  for g, (q, t) in sorted(enumerate(keys), key=lambda item: item[1])],
        residual=residual, format=3 if lora_names is not None else 1 if kv is None else 2, kv=kv,
    )
    return window, relative
