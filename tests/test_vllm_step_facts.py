"""The recorder's engine-free parts: step timing from scheduler calls, and shared-KV context columns."""

from __future__ import annotations

import math
from operator import attrgetter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.engines.vllm.kv_sharing import shared_context_tokens
from llmvisor.engines.vllm.step_clock import StepClock


def test_serial_clock_times_schedule_return_to_next_scheduler_call():
    clock = StepClock(overlapped=False)
    # vLLM's step(): S(1) exec U(1)
    clock.scheduler_called(0.0)
    clock.scheduled(1, 1.0)
    clock.scheduler_called(4.0)
    assert clock.output_arrived(1, 4.0) == (1.0, 3.0)
    # batch queue, forward pass in the engine thread: S(2) exec(2) U(1') S(3) exec(3) U(2) ...
    clock.scheduled(2, 5.0)
    clock.scheduler_called(7.0)  # U of an earlier, empty step
    assert clock.output_arrived(99, 7.0) is None
    clock.scheduler_called(7.5)
    clock.scheduled(3, 8.0)
    clock.scheduler_called(12.0)
    assert clock.output_arrived(2, 12.0) == (5.0, 2.0)
    clock.scheduler_called(13.0)
    assert clock.output_arrived(3, 13.0) == (8.0, 4.0)


def test_overlapped_clock_times_consecutive_output_arrivals_and_skips_idle_gaps():
    clock = StepClock(overlapped=True)
    clock.scheduled(1, 0.0)
    clock.scheduled(2, 0.5)  # queued behind step 1
    clock.scheduler_called(3.0)
    assert clock.output_arrived(1, 3.0) == (0.0, 3.0)
    clock.scheduled(3, 3.2)
    clock.scheduler_called(5.0)
    assert clock.output_arrived(2, 5.0) == (3.0, 2.0)
    clock.scheduler_called(6.0)
    assert clock.output_arrived(3, 6.0) == (5.0, 1.0)
    clock.scheduled(4, 20.0)  # the engine was idle from 6 to 20
    assert clock.output_arrived(4, 21.5) == (20.0, 1.5)


def brute_force(blocks: list[list[int]], contexts: list[int], block_size: int):
    """The definition, block by block over every slice."""
    context_blocks = [b[: math.ceil(c / block_size)] for b, c in zip(blocks, contexts)]
    holders: dict[int, int] = {}
    for ids in context_blocks:
        for block in set(ids):
            holders[block] = holders.get(block, 0) + 1
    shared, effective = [], []
    for ids, c in zip(context_blocks, contexts):
        tokens = [min(block_size, c - j * block_size) for j in range(len(ids))]
        shared.append(sum(t for t, b in zip(tokens, ids) if holders[b] > 1))
        effective.append(sum(t / holders[b] for t, b in zip(tokens, ids)))
    return shared, effective


def run(blocks, contexts, block_size):
    asked = []

    def context_blocks(i):
        asked.append(i)
        return [SimpleNamespace(block_id=b) for b in blocks[i]]

    first = [b[0] if c > 0 else None for b, c in zip(blocks, contexts)]
    return shared_context_tokens(first, context_blocks, contexts, block_size, attrgetter("block_id")), asked


def test_shared_prefix_of_three_and_of_two_and_a_loner():
    # A, B, C share block 10; A and B also 11 and 12; D shares nothing; E has no context (fresh prefill)
    blocks = [[10, 11, 12, 13], [10, 11, 12, 14, 15], [10, 20], [30, 31], [40]]
    contexts = [100, 130, 40, 50, 0]
    (shared, effective), asked = run(blocks, contexts, 32)
    assert shared == [96, 96, 32, 0, 0]
    assert effective == pytest.approx([32 / 3 + 64 / 2 + 4, 32 / 3 + 64 / 2 + 34, 32 / 3 + 8, 50, 0])
    assert sorted(asked) == [0, 1, 2]


def test_nothing_shared_asks_for_no_block_lists():
    (shared, effective), asked = run([[1, 2], [3], [4, 5, 6]], [40, 7, 90], 32)
    assert shared == [0, 0, 0] and effective == [40.0, 7.0, 90.0] and asked == []


def test_a_shared_block_outside_one_slices_context_counts_only_the_slices_that_read_it():
    # B's context covers only its first block; the second block is A's context alone
    (shared, effective), _ = run([[1, 2, 3], [1, 2]], [80, 20], 32)
    assert shared == [32, 20]
    assert effective == pytest.approx([16 + 48, 10])


@st.composite
def prefix_trees(draw):
    """Block lists that share prefixes, as prefix caching makes them (a block is shared along its chain)."""
    block_size = draw(st.sampled_from([16, 32, 128]))
    n = draw(st.integers(1, 8))
    next_id = iter(range(1, 10_000))
    blocks: list[list[int]] = []
    for _ in range(n):
        if blocks and draw(st.booleans()):
            parent = draw(st.sampled_from(blocks))
            prefix = parent[: draw(st.integers(0, len(parent)))]
        else:
            prefix = []
        own = [next(next_id) for _ in range(draw(st.integers(0 if prefix else 1, 4)))]
        blocks.append(prefix + own)
    contexts = [draw(st.integers(0, len(b) * block_size)) for b in blocks]
    return blocks, contexts, block_size


@settings(max_examples=200, deadline=None)
@given(prefix_trees())
def test_grouped_walk_matches_the_definition(case):
    blocks, contexts, block_size = case
    (shared, effective), _ = run(blocks, contexts, block_size)
    expected_shared, expected_effective = brute_force(blocks, contexts, block_size)
    assert shared == expected_shared
    assert effective == pytest.approx(expected_effective)
    assert all(0 <= s <= c and e <= c + 1e-9 for s, e, c in zip(shared, effective, contexts))
