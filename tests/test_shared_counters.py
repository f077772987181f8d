"""VTC counters shared by replicas through Redis: the batching and merging rules (fake clock, real Redis), two
`FairShare` replicas converging, and charging through a Redis outage with exact reconciliation afterwards."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _redis import REDIS_BINARY, SKIP_REASON, RedisServer
from llmvisor import extras
from llmvisor.errors import LlmvisorError, MissingExtraError
from llmvisor.extras import is_importable
from llmvisor.fairness.policy import FairnessConfig, FairShare
from llmvisor.fairness.shared_counters import NO_FLOOR, SharedCounters, SharedCountersConfig, apply, compose

FLUSH_INTERVAL_S = 0.05


class FakeClock:
    def __init__(self, now_s: float = 0.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def redis_server(tmp_path):
    if not is_importable("redis"):
        pytest.skip("needs redis-py, part of the [vllm] extra (pip install -e '.[vllm]')")
    if REDIS_BINARY is None:
        pytest.skip(SKIP_REASON)
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture
def pool() -> str:
    return f"pool-{uuid.uuid4().hex[:8]}"


def pool_counters(server: RedisServer, pool: str) -> dict[str, float]:
    import redis

    with redis.Redis.from_url(server.url) as client:
        return {k.decode(): float(v) for k, v in client.hgetall(f"llmvisor:fair:{{{pool}}}:counters").items()}


def metric(name: str, pool: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"pool": pool}) or 0.0


def replica(server: RedisServer, pool: str, clock: FakeClock) -> SharedCounters:
    return SharedCounters(SharedCountersConfig(url=server.url, pool=pool, flush_interval_s=0.1), clock=clock)


# ------------------------------------------------------------------------------------------------------
# configuration


def test_config_reads_shared_counters_and_defaults_to_local():
    assert FairnessConfig.from_dict({}).shared_counters is None
    config = FairnessConfig.from_dict({"cost": "tokens", "shared_counters": {"url": "redis://127.0.0.1:6379/0", "pool": "pool-a"}})
    assert config.shared_counters == SharedCountersConfig(url="redis://127.0.0.1:6379/0", pool="pool-a", flush_interval_s=0.1)
    again = FairnessConfig.from_dict(config.as_dict())
    assert again.shared_counters == config.shared_counters


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("redis://x", "shared_counters must be a table"),
        ({"url": "redis://x"}, "shared_counters needs pool"),
        ({"url": "http://x", "pool": "a"}, "shared_counters.url must be a redis://"),
        ({"url": "redis://x", "pool": "a b"}, "shared_counters.pool must be a non-empty name"),
        ({"url": "redis://x", "pool": "a", "flush_interval_s": 0}, "shared_counters.flush_interval_s must be a positive number"),
        ({"url": "redis://x", "pool": "a", "flush": 1}, "unknown shared_counters key(s) flush"),
        ({"url": "redis://x", "pool": "a", "metrics_port": 70000}, "shared_counters.metrics_port must be a TCP port"),
    ],
)
def test_config_rejects_bad_shared_counters_in_one_line(value, message):
    with pytest.raises(LlmvisorError) as error:
        FairnessConfig.from_dict({"shared_counters": value}, source="fair.toml")
    assert str(error.value).startswith("fair.toml: ") and message in str(error.value) and "\n" not in str(error.value)


def test_without_redis_py_the_error_names_the_extra(monkeypatch):
    real = extras.is_importable
    monkeypatch.setattr(extras, "is_importable", lambda module: module != "redis" and real(module))
    with pytest.raises(MissingExtraError) as error:
        FairShare(FairnessConfig.from_dict({"cost": "tokens", "shared_counters": {"url": "redis://127.0.0.1:1/0", "pool": "p"}}))
    assert "[vllm] extra (missing: redis)" in str(error.value)


def test_an_unusable_url_is_one_line_naming_the_key():
    if not is_importable("redis"):
        pytest.skip("needs redis-py, part of the [vllm] extra (pip install -e '.[vllm]')")
    with pytest.raises(LlmvisorError, match=r"^fairness config: shared_counters.url 'redis://host:port/0' is not a Redis URL"):
        SharedCounters(SharedCountersConfig(url="redis://host:port/0", pool="p"))


# ------------------------------------------------------------------------------------------------------
# the operations a batch carries

ops = st.tuples(st.integers(-50, 50).map(float), st.one_of(st.just(NO_FLOOR), st.integers(-100, 100).map(float)))


@given(st.integers(-100, 100).map(float), st.lists(ops, max_size=8))
def test_composed_batch_does_what_its_changes_do_one_by_one(start, changes):
    one_by_one = start
    composed = None
    for op in changes:
        one_by_one = apply(op, one_by_one)
        composed = op if composed is None else compose(composed, op)
    assert apply(composed, start) == one_by_one


# ------------------------------------------------------------------------------------------------------
# batching and merging, fake clock, real Redis


def test_changes_are_batched_until_the_interval_and_reach_the_other_replica(redis_server, pool):
    clock_a, clock_b = FakeClock(), FakeClock()
    a, b = replica(redis_server, pool, clock_a), replica(redis_server, pool, clock_b)
    try:
        assert a.tick() is True and b.tick() is True  # first flush is due at once: reads an empty pool
        a.charge("x", 3.0)
        a.charge("x", 4.0)
        a.lift("y", 10.0)
        clock_a.now_s = 0.05
        assert a.tick() is None and pool_counters(redis_server, pool) == {}
        assert a.value("x") == 7.0 and b.value("x") == 0.0  # local changes are seen locally at once
        clock_a.now_s = 0.1
        assert a.tick() is True
        assert pool_counters(redis_server, pool) == {"x": 7.0, "y": 10.0}
        b.charge("x", 1.0)
        assert b.value("x") == 1.0
        clock_b.now_s = 0.1
        assert b.tick() is True
        assert b.value("x") == 8.0 and b.value("y") == 10.0
        counters = {"x": 0.0, "z": 0.0}
        assert b.refresh(counters) and counters == {"x": 8.0, "z": 0.0}
        assert not b.refresh(counters)  # nothing new since
        assert a.status()["num_flushes"] == 2 and a.status()["unflushed_tenants"] == 0
    finally:
        a.close()
        b.close()


def test_a_lift_is_a_floor_so_concurrent_or_stale_lifts_do_not_stack(redis_server, pool):
    clocks = [FakeClock(), FakeClock(), FakeClock()]
    a, b, c = (replica(redis_server, pool, clock) for clock in clocks)
    try:
        c.charge("t", 50.0)
        c.flush()
        a.lift("t", 30.0)  # computed on a stale view (a has not seen c's 50): must not lower or add
        assert a.flush() and a.value("t") == 50.0
        a.lift("t", 80.0)
        b.lift("t", 80.0)  # both replicas lift the same tenant at once: raised once
        a.flush()
        b.flush()
        assert pool_counters(redis_server, pool)["t"] == 80.0
        b.charge("t", 5.0)
        b.lift("t", 90.0)
        b.charge("t", 1.0)  # one batch: max(80 + 5, 90) + 1
        b.flush()
        assert pool_counters(redis_server, pool)["t"] == 91.0 and b.value("t") == 91.0
    finally:
        for shared in (a, b, c):
            shared.close()


def test_a_batch_whose_reply_was_lost_is_applied_once(redis_server, pool):
    import redis

    a = replica(redis_server, pool, FakeClock())
    script = a.script

    def apply_then_lose_reply(**kwargs):
        script(**kwargs)
        a.script = script
        raise redis.TimeoutError("reply lost (test)")

    a.script = apply_then_lose_reply
    outages_before = metric("llmvisor_fair_shared_outages_total", pool)
    try:
        a.charge("x", 5.0)
        assert a.flush() is False and a.connected is False
        assert pool_counters(redis_server, pool) == {"x": 5.0}  # Redis applied it; the replica does not know
        assert a.value("x") == 5.0
        a.charge("x", 2.0)  # goes in a second batch: merged into the retried one, it would be skipped with it
        assert a.flush() is True and a.status()["unflushed_tenants"] == 0
        assert pool_counters(redis_server, pool) == {"x": 7.0} and a.value("x") == 7.0
        assert metric("llmvisor_fair_shared_outages_total", pool) == outages_before + 1
        assert metric("llmvisor_fair_shared_up", pool) == 1.0
    finally:
        a.close()


def test_outage_backs_off_keeps_changes_and_applies_them_on_return(redis_server, pool):
    clock = FakeClock()
    a = replica(redis_server, pool, clock)
    try:
        a.charge("x", 1.0)
        assert a.tick() is True
        redis_server.stop()
        for step in range(1, 6):
            a.charge("x", 1.0)
            a.lift("y", float(step))
            clock.now_s = a.next_due_s
            assert a.tick() is False
            assert clock.now_s + 0.1 <= a.next_due_s <= clock.now_s + 1.0  # jittered backoff, capped at 1 s
        assert a.tick() is None  # not due again before the backoff ends
        assert a.value("x") == 6.0 and a.value("y") == 5.0
        assert metric("llmvisor_fair_shared_up", pool) == 0.0 and a.status()["num_failures"] == 5
        assert a.status()["unflushed_tenants"] == 2
        redis_server.start()
        clock.now_s = a.next_due_s
        assert a.tick() is True and a.connected is True
        assert pool_counters(redis_server, pool) == {"x": 6.0, "y": 5.0}
    finally:
        a.close()


# ------------------------------------------------------------------------------------------------------
# two FairShare replicas, background threads, real time


def shared_config(server: RedisServer, pool: str, **extra) -> FairnessConfig:
    return FairnessConfig.from_dict(
        {"cost": "tokens", "shared_counters": {"url": server.url, "pool": pool, "flush_interval_s": FLUSH_INTERVAL_S}, **extra}
    )


def charge_decodes(fair: FairShare, tokens: dict[str, int]) -> float:
    """Charge one step of decode slices (token cost: 2 per token); returns how long the call took (s)."""
    tenants = list(tokens)
    n = len(tenants)
    started = time.perf_counter()
    fair.charge_step(
        tenants, np.array([tokens[t] for t in tenants], dtype=np.float64), np.full(n, 100.0), np.zeros(n, bool), np.ones(n, bool), 0.01, time.monotonic()
    )
    return time.perf_counter() - started


def expected_counters(replicas: list[FairShare]) -> dict[str, float]:
    """No lift happens in these runs, so each pool counter is the replicas' local charges summed, over the weight."""
    total: dict[str, float] = {}
    for fair in replicas:
        for tenant, served in fair.vtc.served.items():
            total[tenant] = total.get(tenant, 0.0) + served / fair.vtc.weight(tenant)
    return total


def view(fair: FairShare, tenant: str) -> float:
    """The replica's counter for ``tenant``: its local one, or the pool's for a tenant it has not seen yet."""
    return fair.vtc.counter[tenant] if tenant in fair.vtc.counter else fair.shared.value(tenant)


def wait_until_converged(replicas: list[FairShare], expected: dict[str, float], timeout_s: float = 10.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all({t: view(fair, t) for t in expected} == expected for fair in replicas):
            return time.monotonic() - started
        for fair in replicas:
            fair.shared.refresh(fair.vtc.counter)  # what the engine does at each step
        time.sleep(0.002)
    views = [dict(fair.vtc.counter) for fair in replicas]
    raise AssertionError(f"replicas did not converge to {expected} within {timeout_s} s: {views}")


def summary_us(seconds: list[float]) -> str:
    us = np.asarray(seconds) * 1e6
    return f"p50 {np.percentile(us, 50):.0f} us, p99 {np.percentile(us, 99):.0f} us, max {us.max():.0f} us over {us.size} calls"


def test_two_replicas_converge_and_their_counters_sum_the_local_charges(redis_server, pool):
    config = shared_config(redis_server, pool, weights={"heavy": 2.0})
    replicas = [FairShare(config), FairShare(config)]
    rng = np.random.default_rng(0)
    try:
        for _ in range(200):
            for fair in replicas:
                charge_decodes(fair, {t: int(rng.integers(1, 20)) for t in ("heavy", "light", "other") if rng.random() < 0.7})
            time.sleep(0.001)
        expected = expected_counters(replicas)
        converged_s = wait_until_converged(replicas, expected)
        print(f"\ntwo replicas converged {1000 * converged_s:.1f} ms after the last charge (flush interval {1000 * FLUSH_INTERVAL_S:.0f} ms)")
        assert pool_counters(redis_server, pool) == expected
        assert converged_s < 20 * FLUSH_INTERVAL_S  # two flushes are enough; slack for a loaded machine
        assert all(fair.shared.status()["connected"] for fair in replicas)
    finally:
        for fair in replicas:
            fair.close()


def test_the_lift_uses_the_pool_counters_and_does_not_stack_across_replicas(redis_server, pool):
    config = shared_config(redis_server, pool)
    a, b = FairShare(config), FairShare(config)
    try:
        a.arrive("p")
        a.arrive("q")
        b.arrive("p")
        charge_decodes(a, {"p": 50, "q": 60})  # p: 100, q: 120 in the pool
        wait_until_converged([a, b], {"p": 100.0, "q": 120.0})
        a.arrive("new")  # lifted to min(p, q) = 100 on a
        b.arrive("new")  # lifted to p = 100 on b (only p is backlogged there)
        assert a.vtc.counter["new"] == 100.0 and b.vtc.counter["new"] == 100.0
        charge_decodes(b, {"new": 1})
        wait_until_converged([a, b], {"p": 100.0, "q": 120.0, "new": 102.0})
        assert pool_counters(redis_server, pool)["new"] == 102.0
        b.arrive("q")  # first seen on b: starts from the pool's counter, above the floor (p's 100)
        assert b.vtc.counter["q"] == 120.0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("outage", ["stopped", "hung"])
def test_charging_goes_on_through_an_outage_and_reconciles_exactly(redis_server, pool, outage):
    """``stopped``: Redis exits (connections refused); ``hung``: SIGSTOP (the socket takes bytes, nothing answers,
    requests time out and may run when it resumes; batch numbers keep those from counting twice)."""
    config = shared_config(redis_server, pool)
    replicas = [FairShare(config), FairShare(config)]
    rng = np.random.default_rng(1)
    up_s: list[float] = []
    down_s: list[float] = []

    def run(n_steps: int, times: list[float]) -> None:
        for _ in range(n_steps):
            for fair in replicas:
                times.append(charge_decodes(fair, {t: int(rng.integers(1, 9)) for t in ("a", "b")}))
            time.sleep(0.002)

    try:
        run(100, up_s)
        redis_server.stop() if outage == "stopped" else redis_server.pause()
        run(100, down_s)
        deadline = time.monotonic() + 10.0
        while not all(fair.shared.connected is False for fair in replicas) and time.monotonic() < deadline:
            run(10, down_s)
        run(100, down_s)
        assert all(fair.shared.connected is False for fair in replicas)
        assert metric("llmvisor_fair_shared_up", pool) == 0.0 and metric("llmvisor_fair_shared_outages_total", pool) >= 2
        local = [dict(fair.vtc.counter) for fair in replicas]
        assert local[0] != local[1]  # each replica counts alone meanwhile
        redis_server.start() if outage == "stopped" else redis_server.resume()
        expected = expected_counters(replicas)
        reconciled_s = wait_until_converged(replicas, expected)
        run(20, up_s)
        expected = expected_counters(replicas)
        wait_until_converged(replicas, expected)
        assert pool_counters(redis_server, pool) == expected
        print(
            f"\n[{outage}] charge_step with Redis up: {summary_us(up_s)}; down: {summary_us(down_s)}; "
            f"reconciled {1000 * reconciled_s:.0f} ms after Redis returned"
        )
    finally:
        for fair in replicas:
            fair.close()
