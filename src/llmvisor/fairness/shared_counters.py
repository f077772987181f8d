"""VTC counters shared by the replicas of a pool through Redis, with bounded staleness and a local fallback.

Each replica (one `FairShare`, i.e. one engine) keeps its counters locally, as without sharing; the engine loop
only ever touches that local state. A background thread flushes the replica's batched changes to Redis every
``flush_interval_s`` and reads back every tenant's pool-wide counter in the same round trip, so the local view
is the pool's counters at most one interval (plus a round trip) old, plus this replica's own changes since.

**Data model.** One hash per pool, ``llmvisor:fair:{POOL}:counters``: tenant -> counter (cost units per unit
weight, as `VirtualTokenCounter.counter`; every replica must run the same weights). Per replica a key
``llmvisor:fair:{POOL}:applied:REPLICA`` holds the number of the last batch applied (expires after a day). The
braces make POOL a Redis Cluster hash tag, so one pool's keys live on one shard.

**Changes as operations.** A replica changes a counter in two ways: a charge adds to it, and VTC's lift raises
a returning tenant to a floor. Both are ``x -> max(x + add, floor)`` (a charge has no floor, a lift adds 0),
and these compose into the same form, so a batch holds one ``(add, floor)`` per tenant however many changes it
gathered. A Lua script applies a batch atomically: ``HINCRBYFLOAT`` the add, then raise to the floor if below.

**The lift across replicas.** Backlogs are per replica (each engine knows its own queue), counters are
pool-wide: a tenant whose queue on this replica was empty is lifted to the lowest local-view counter among the
tenants backlogged on this replica (or to the last one that emptied), as VTC does. The lift reaches Redis as a
floor, never as an added amount: two replicas lifting the same tenant at once raise it once, and a lift
computed on a stale snapshot never lowers a counter that other replicas' charges have moved past it.

**Exactly once.** A batch is numbered; the script applies it only if its number is above the replica's last
applied one, and a failed flush is retried with the same batch (changes made meanwhile wait for the next), so a
batch whose reply was lost (timeout after Redis applied it) is not applied twice.

**Redis unreachable.** Charging goes on locally (the engine loop never waits for Redis); the outage is logged
and exported (``llmvisor_fair_shared_up`` 0, ``llmvisor_fair_shared_outages_total``). The thread retries with
jittered exponential backoff; on reconnect the changes batched during the outage are applied, so no charge is
lost or counted twice. Counters in Redis survive a Redis restart only with Redis persistence (AOF) on.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from llmvisor.errors import LlmvisorError, plain
from llmvisor.extras import is_importable, require

logger = logging.getLogger(__name__)

NO_FLOOR = -math.inf
APPLIED_TTL_S = 86_400
MAX_BACKOFF_S = 1.0

Op = tuple[float, float]
"""``(add, floor)``: the change ``x -> max(x + add, floor)``."""

APPLY_BATCH = """
local batch = tonumber(ARGV[1])
if batch > 0 and batch > tonumber(redis.call('GET', KEYS[2]) or '0') then
  for i = 3, #ARGV, 3 do
    local value = redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
    if ARGV[i + 2] ~= '' and tonumber(value) < tonumber(ARGV[i + 2]) then
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    end
  end
  redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
end
return redis.call('HGETALL', KEYS[1])
"""
"""KEYS: the pool's counter hash, this replica's applied-batch key. ARGV: batch number (0: only read), the
applied key's expiry, then (tenant, add, floor or '') per tenant. Returns every tenant's counter."""


def compose(first: Op, then: Op) -> Op:
    """The operation doing ``first`` and then ``then``."""
    return first[0] + then[0], max(first[1] + then[0], then[1])


def apply(op: Op | None, value: float) -> float:
    return value if op is None else max(value + op[0], op[1])


@dataclass(frozen=True)
class SharedCountersConfig:
    """Where the pool's counters live: ``shared_counters = {url = "redis://127.0.0.1:6379/0", pool = "pool-a"}``."""

    url: str
    pool: str
    flush_interval_s: float = 0.1
    socket_timeout_s: float = 0.25
    metrics_port: int | None = None
    """Serve this process's metrics (the default Prometheus registry) on 127.0.0.1:PORT; None: do not."""

    @classmethod
    def from_value(cls, value, source: str) -> SharedCountersConfig:
        key = "shared_counters"
        if not isinstance(value, Mapping):
            raise LlmvisorError(f"{source}: {key} must be a table {{url, pool, flush_interval_s}} (got {plain(value)!r})")
        known = {"url", "pool", "flush_interval_s", "socket_timeout_s", "metrics_port"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise LlmvisorError(f"{source}: unknown {key} key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = sorted({"url", "pool"} - set(value))
        if missing:
            raise LlmvisorError(f"{source}: {key} needs {' and '.join(missing)}")
        url, pool = value["url"], value["pool"]
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise LlmvisorError(f"{source}: {key}.url must be a redis://, rediss:// or unix:// URL (got {plain(url)!r})")
        if not isinstance(pool, str) or not pool or any(c in pool for c in "{}\n "):
            raise LlmvisorError(f"{source}: {key}.pool must be a non-empty name without spaces or braces (got {plain(pool)!r})")
        seconds = {}
        for name in ("flush_interval_s", "socket_timeout_s"):
            if name in value:
                number = value[name]
                if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
                    raise LlmvisorError(f"{source}: {key}.{name} must be a positive number of seconds (got {plain(number)!r})")
                seconds[name] = float(number)
        port = value.get("metrics_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise LlmvisorError(f"{source}: {key}.metrics_port must be a TCP port number (got {plain(port)!r})")
        return cls(url=url, pool=pool, metrics_port=port, **seconds)

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "pool": self.pool,
            "flush_interval_s": self.flush_interval_s,
            "socket_timeout_s": self.socket_timeout_s,
            "metrics_port": self.metrics_port,
        }


class SharedMetrics:
    """The Prometheus series of the shared counters, per pool, in the default registry (one set per process)."""

    _instance: SharedMetrics | None = None
    _lock = threading.Lock()

    def __init__(self):
        import prometheus_client

        self.up = prometheus_client.Gauge("llmvisor_fair_shared_up", "1 while the pool's Redis answers, 0 while counters are local only.", ["pool"])
        self.outages = prometheus_client.Counter("llmvisor_fair_shared_outages", "Times Redis became unreachable.", ["pool"])
        self.flushes = prometheus_client.Counter("llmvisor_fair_shared_flushes", "Successful flushes (batch applied and counters read).", ["pool"])
        self.failures = prometheus_client.Counter("llmvisor_fair_shared_flush_failures", "Failed flush attempts.", ["pool"])
        self.snapshot_age = prometheus_client.Gauge(
            "llmvisor_fair_shared_snapshot_age_seconds", "Age of the pool counters last read from Redis.", ["pool"]
        )

    @classmethod
    def get(cls) -> SharedMetrics | None:
        """None without prometheus_client (metrics are then only in `SharedCounters.status`)."""
        with cls._lock:
            if cls._instance is None and is_importable("prometheus_client"):
                cls._instance = cls()
            return cls._instance


class SharedCounters:
    """One replica's side of the pool's counters: local changes batched for Redis, Redis snapshots merged in.

    Engine-loop side (cheap, never waits on I/O): `charge`, `lift`, `value`, `refresh`. Redis side: `tick`,
    run by the background thread `start` launches (tests call it directly with a fake ``clock``).
    """

    def __init__(self, config: SharedCountersConfig, *, clock: Callable[[], float] = time.monotonic, client=None):
        require("shared fairness counters (shared_counters)", "vllm", modules=("redis",))
        import redis
        from redis.backoff import ExponentialWithJitterBackoff
        from redis.retry import Retry

        self.config = config
        self.clock = clock
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.counters_key = f"llmvisor:fair:{{{config.pool}}}:counters"
        self.applied_key = f"llmvisor:fair:{{{config.pool}}}:applied:{self.replica}"
        timeout_s = config.socket_timeout_s
        try:
            self.client = client or redis.Redis.from_url(
                config.url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(ExponentialWithJitterBackoff(cap=timeout_s, base=0.005), retries=1),
                client_name=f"llmvisor-fair-{self.replica}",
            )
        except ValueError as error:
            raise LlmvisorError(f"fairness config: shared_counters.url {config.url!r} is not a Redis URL ({error})") from None
        self.script = self.client.register_script(APPLY_BATCH)
        self.redis_errors = (redis.RedisError, OSError)
        self.backoff = ExponentialWithJitterBackoff(cap=MAX_BACKOFF_S, base=config.flush_interval_s)
        self.metrics = SharedMetrics.get()
        self._lock = threading.Lock()
        # guarded by _lock: the view is apply(pending, apply(in_flight, shared))
        self._pending: dict[str, Op] = {}
        self._in_flight: dict[str, Op] | None = None
        self._shared: dict[str, float] = {}
        self._version = 0
        self._applied_version = 0
        # Redis side, only the flushing thread
        self._batch = 0
        self._in_flight_batch = 0
        self.connected: bool | None = None
        self.num_flushes = 0
        self.num_failures = 0
        self.num_outages = 0
        self.last_success_s: float | None = None
        self.next_due_s = clock()
        self.last_error = ""
        self._failures_in_row = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.metrics is not None:
            self.metrics.snapshot_age.labels(config.pool).set(math.nan)

    # ------------------------------------------------------------------------------------------------
    # engine loop side

    def _record(self, tenant: str, op: Op) -> None:
        with self._lock:
            previous = self._pending.get(tenant)
            self._pending[tenant] = op if previous is None else compose(previous, op)

    def charge(self, tenant: str, amount: float) -> None:
        """``amount`` (already divided by the tenant's weight) was added to the tenant's local counter."""
        self._record(tenant, (amount, NO_FLOOR))

    def lift(self, tenant: str, floor: float) -> None:
        """The tenant's local counter was raised to ``floor`` (VTC's lift)."""
        self._record(tenant, (0.0, floor))

    def value(self, tenant: str) -> float:
        """The tenant's counter in this replica's view: the last snapshot plus this replica's unconfirmed changes."""
        with self._lock:
            return self._view(tenant)

    def _view(self, tenant: str) -> float:
        in_flight = self._in_flight.get(tenant) if self._in_flight else None
        return apply(self._pending.get(tenant), apply(in_flight, self._shared.get(tenant, 0.0)))

    def refresh(self, counters: MutableMapping[str, float]) -> bool:
        """Rewrite ``counters`` (the local counters) from the newest snapshot, if one arrived since the last call."""
        if self._version == self._applied_version:
            return False
        with self._lock:
            self._applied_version = self._version
            for tenant in counters:
                counters[tenant] = self._view(tenant)
        return True

    # ------------------------------------------------------------------------------------------------
    # Redis side

    def tick(self) -> bool | None:
        """Flush if due: the batch out, every counter back. True: flushed; False: failed; None: not due."""
        now_s = self.clock()
        if self.metrics is not None and self.last_success_s is not None:
            self.metrics.snapshot_age.labels(self.config.pool).set(now_s - self.last_success_s)
        if now_s < self.next_due_s:
            return None
        return self.flush(now_s)

    def flush(self, now_s: float | None = None) -> bool:
        """Send the batch (a failed one again, as it was) and read every counter; after a retried batch, the
        changes gathered meanwhile go at once in a second round trip."""
        now_s = self.clock() if now_s is None else now_s
        retried = self._in_flight is not None
        if not self._send(now_s):
            return False
        if retried and self._pending:
            return self._send(now_s)
        return True

    def _send(self, now_s: float) -> bool:
        with self._lock:
            if self._in_flight is None and self._pending:
                self._in_flight, self._pending = self._pending, {}
                self._batch += 1
                self._in_flight_batch = self._batch
            batch = dict(self._in_flight) if self._in_flight else {}
        args: list = [self._in_flight_batch if batch else 0, APPLIED_TTL_S]
        for tenant, (add, floor) in batch.items():
            args += [tenant, repr(add), "" if floor == NO_FLOOR else repr(floor)]
        try:
            reply = self.script(keys=[self.counters_key, self.applied_key], args=args)
        except self.redis_errors as error:
            self._failed(now_s, error)
            return False
        shared = {reply[i].decode(): float(reply[i + 1]) for i in range(0, len(reply), 2)}
        with self._lock:
            self._shared = shared
            self._in_flight = None
            self._version += 1
        self._succeeded(now_s)
        return True

    def _succeeded(self, now_s: float) -> None:
        if self.connected is False:
            logger.warning(
                "llmvisor: shared fairness counters: Redis for pool %r is back after %d failed flushes; "
                "the changes batched meanwhile are applied",
                self.config.pool,
                self._failures_in_row,
            )
        self.connected = True
        self._failures_in_row = 0
        self.num_flushes += 1
        self.last_success_s = now_s
        self.next_due_s = now_s + self.config.flush_interval_s
        if self.metrics is not None:
            pool = self.config.pool
            self.metrics.up.labels(pool).set(1)
            self.metrics.flushes.labels(pool).inc()
            self.metrics.snapshot_age.labels(pool).set(0.0)

    def _failed(self, now_s: float, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        self.num_failures += 1
        self._failures_in_row += 1
        if self.connected is not False:
            self.num_outages += 1
            logger.warning(
                "llmvisor: shared fairness counters: Redis for pool %r unreachable (%s); charging goes on with local "
                "counters and the changes are applied when it is back",
                self.config.pool,
                self.last_error,
            )
            if self.metrics is not None:
                self.metrics.outages.labels(self.config.pool).inc()
        self.connected = False
        self.next_due_s = now_s + max(self.config.flush_interval_s, self.backoff.compute(self._failures_in_row))
        if self.metrics is not None:
            self.metrics.up.labels(self.config.pool).set(0)
            self.metrics.failures.labels(self.config.pool).inc()

    # ------------------------------------------------------------------------------------------------
    # thread

    def start(self) -> SharedCounters:
        if self.config.metrics_port is not None and self.metrics is not None:
            import prometheus_client

            prometheus_client.start_http_server(self.config.metrics_port, addr="127.0.0.1")
        self._thread = threading.Thread(target=self._run, name=f"llmvisor-fair-shared-{self.config.pool}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the thread must outlive anything unexpected; the engine goes on with local counters
                logger.exception("llmvisor: shared fairness counters: flush failed unexpectedly")
                self.next_due_s = self.clock() + self.config.flush_interval_s
            self._stop.wait(max(0.0, min(self.next_due_s - self.clock(), self.config.flush_interval_s)))

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread after one last flush attempt (changes still unflushed after it are lost to the pool)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # stuck in a Redis call: flushing from here too could send a batch twice
                logger.warning("llmvisor: shared fairness counters: flushing thread did not stop; last changes not flushed")
                return
            self._thread = None
            self.flush()
        self.client.close()

    def status(self) -> dict:
        with self._lock:
            unflushed = len(self._pending.keys() | (self._in_flight or {}).keys())
        return {
            "pool": self.config.pool,
            "replica": self.replica,
            "connected": self.connected,
            "num_flushes": self.num_flushes,
            "num_failures": self.num_failures,
            "num_outages": self.num_outages,
            "snapshot_age_s": None if self.last_success_s is None else self.clock() - self.last_success_s,
            "unflushed_tenants": unflushed,
            "last_error": self.last_error,
        }
