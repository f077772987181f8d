"""The KV memory-time meter (llmvisor.core.kv_memory.KvMeter) over event sequences it was not written for: hypothesis
draws pools that change at random times (holders come, grow, share a document, leave, get skipped by a step,
abort), and steps that drain random subsets of the holders. Expected values are computed here block by block in
exact fractions, not as the meter accumulates them."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmvisor.core.kv_memory import MAX_UNHELD_SEGMENT_NS, KvMemoryError, KvMeter, snapshot

POOL = 24


@st.composite
def histories(draw):
    """A list of events: ("pool", dt_ns, {holder: block ids}, idle), ("drain", dt_ns, [holders]) or ("forget", 0,
    holder). As in the engine, a request is forgotten (aborted) only once it holds nothing, and is not seen again."""
    events = []
    names = [f"r{i}" for i in range(8)]
    retired: set[str] = set()
    holding: set[str] = set()
    for _ in range(draw(st.integers(1, 25))):
        live = [n for n in names if n not in retired]
        if not live:
            break
        kind = draw(st.sampled_from(["pool", "pool", "drain", "forget"]))
        if kind == "pool":
            holders = {}
            for name in draw(st.lists(st.sampled_from(live), unique=True, max_size=6)):
                holders[name] = draw(st.lists(st.integers(0, POOL - 1), unique=True, min_size=1, max_size=8))
            held = {b for ids in holders.values() for b in ids}
            idle = draw(st.integers(0, POOL - len(held)))
            events.append(("pool", draw(st.integers(0, 3_000_000_000)), holders, idle))
            holding = set(holders)
        elif kind == "drain":
            events.append(("drain", draw(st.integers(0, 3_000_000_000)), draw(st.lists(st.sampled_from(live), unique=True, max_size=5))))
        else:
            idle_names = [n for n in live if n not in holding]
            if idle_names:
                name = draw(st.sampled_from(idle_names))
                retired.add(name)
                events.append(("forget", 0, name))
    return events


def run(events):
    """The meter over the events, and the exact expectations: per holder the exact block-ns since its last drained
    slice, per step the pool over its interval."""
    meter = KvMeter(POOL, 0)
    now = 0
    state = snapshot({}, pool_blocks=POOL, idle_cached_blocks=0)
    exact: dict[str, Fraction] = {}  # exact block-ns not yet billed, per holder
    steps = []
    gone: set[str] = set()
    for event in events:
        kind, dt = event[0], event[1]
        segment = dt if state.held_blocks else min(dt, MAX_UNHELD_SEGMENT_NS)
        for holder, share in zip(state.holders, state.effective_blocks):
            exact[holder] = exact.get(holder, Fraction(0)) + share * segment
        now += dt
        if kind == "pool":
            holders, idle = event[2], event[3]
            state = snapshot(holders, pool_blocks=POOL, idle_cached_blocks=idle)
            meter.observe(now, {h: float(e) for h, e in zip(state.holders, state.effective_blocks)}, state.held_blocks, idle)
        elif kind == "drain":
            meter.observe(now, {h: float(e) for h, e in zip(state.holders, state.effective_blocks)}, state.held_blocks,
                          state.idle_cached_blocks)
            requests = event[2]
            billed, step = meter.drain(requests)
            expected = [exact.pop(r, Fraction(0)) for r in requests]
            for r in requests:
                gone.discard(r)
            steps.append((requests, billed, expected, step))
        else:
            meter.forget(event[2])
            gone.add(event[2])
    return meter, steps


@settings(max_examples=300, deadline=None)
@given(histories())
@example([("pool", 5, {"a": [0, 1, 2], "b": [0, 1]}, 3), ("pool", 7, {"b": [0, 1, 4]}, 0), ("drain", 3, ["a"]),
          ("drain", 11, ["b"])])
def test_each_step_adds_up_exactly_and_each_slice_is_within_one_block_ns_per_step_of_its_exact_share(events):
    _, steps = run(events)
    for _, billed, _, step in steps:
        assert all(isinstance(v, int) and v >= 0 for v in billed)
        # per step: the slices' block-ns less what they carried in, plus what others carry out, idle and free
        # are the pool over the interval, exactly
        assert (sum(billed) - step.carried_in_block_ns + step.carried_out_block_ns + step.idle_cached_block_ns
                + step.free_block_ns) == POOL * step.interval_ns
        assert step.free_block_ns >= 0 and step.carried_in_block_ns <= sum(billed)


@settings(max_examples=300, deadline=None)
@given(histories())
def test_no_holder_is_billed_more_than_one_block_ns_per_drain_away_from_its_exact_share(events):
    _, steps = run(events)
    for k, (requests, billed, expected, _) in enumerate(steps):
        for request, got, want in zip(requests, billed, expected):
            # each drain rounds once (largest remainder); a carried value crossed at most k + 1 drains
            assert abs(got - want) <= k + 1, (request, got, float(want))


def test_a_request_skipped_by_a_step_carries_its_blocks_to_its_next_slice():
    meter = KvMeter(10, 0)
    meter.observe(0, {"a": 2.0, "b": 3.0}, 5, 1)
    meter.observe(100, {"a": 2.0, "b": 3.0}, 5, 1)
    billed, step = meter.drain(["a"])  # b held its 3 blocks but ran no tokens
    assert billed == [200]
    assert (step.interval_ns, step.carried_in_block_ns, step.carried_out_block_ns) == (100, 0, 300)
    assert (step.idle_cached_block_ns, step.free_block_ns) == (100, 400)
    meter.observe(150, {"a": 2.0, "b": 3.0}, 5, 1)
    billed, step = meter.drain(["a", "b"])
    assert billed == [100, 300 + 150]
    assert step.carried_in_block_ns == 300 and step.carried_out_block_ns == 0
    assert meter.num_carried == 0


def test_an_aborted_request_is_carried_out_and_never_billed():
    meter = KvMeter(4, 0)
    meter.observe(0, {"a": 1.0, "b": 1.0}, 2, 0)
    meter.observe(10, {"b": 1.0}, 1, 0)  # a aborted between steps
    meter.forget("a")
    billed, step = meter.drain(["b"])
    assert billed == [10] and step.carried_out_block_ns == 10
    billed, step = meter.drain(["a"])
    assert billed == [0] and step.carried_in_block_ns == 0
    assert meter.num_carried == 0


def test_a_shared_document_is_split_equally_among_its_readers():
    meter = KvMeter(8, 0)
    pool = snapshot({"a": [0, 1, 2], "b": [0, 1, 3], "c": [0, 4]}, pool_blocks=8, idle_cached_blocks=0)
    meter.observe(0, {h: float(e) for h, e in zip(pool.holders, pool.effective_blocks)}, pool.held_blocks, 0)
    meter.observe(6, {}, 0, 0)
    billed, _ = meter.drain(["a", "b", "c"])
    # block 0: three readers, 2 ns each; block 1: two, 3 ns each; private blocks 6 ns each
    assert billed == [2 + 3 + 6, 2 + 3 + 6, 2 + 6]


def test_a_long_idle_engine_counts_at_most_the_stated_unheld_stretch():
    meter = KvMeter(1000, 0)
    meter.observe(0, {}, 0, 10)
    meter.observe(5 * MAX_UNHELD_SEGMENT_NS, {"a": 1.0}, 1, 10)
    meter.observe(5 * MAX_UNHELD_SEGMENT_NS + 7, {}, 0, 10)
    billed, step = meter.drain(["a"])
    assert billed == [7] and step.interval_ns == MAX_UNHELD_SEGMENT_NS + 7
    assert 1000 * step.interval_ns < 2**63


@pytest.mark.parametrize(("holders", "held", "idle", "message"), [
    ({"a": 2.0}, 3, 0, "sum to 2, not the 3 blocks held"),
    ({"a": 2.0}, 2, 9, "not within the pool's 10"),
    ({}, 0, -1, "not within the pool"),
])
def test_a_reading_that_cannot_be_is_refused_naming_why(holders, held, idle, message):
    meter = KvMeter(10, 0)
    with pytest.raises(KvMemoryError, match=message):
        meter.observe(1, holders, held, idle)
