"""The KV memory-time rule (llmvisor.core.kv_memory) on pools it was not written for: hypothesis draws holders and
the blocks they reference; the expected shares are counted block by block here, not holder by holder as the
module does."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.kv_memory import (
    KvMemoryError,
    apportion_block_ns,
    gib_seconds,
    interval_usage,
    kv_block_bytes,
    snapshot,
)


@st.composite
def pools(draw):
    pool_blocks = draw(st.integers(1, 60))
    block_ids = list(range(pool_blocks))
    n_holders = draw(st.integers(0, 12))
    holders = {}
    for i in range(n_holders):
        holders[f"req-{i}"] = draw(st.lists(st.sampled_from(block_ids), unique=True, max_size=pool_blocks))
    held = {b for ids in holders.values() for b in ids}
    idle = draw(st.integers(0, pool_blocks - len(held)))
    interval_ns = draw(st.integers(0, 5_000_000_000))
    return holders, pool_blocks, idle, interval_ns


def expected_by_block(holders: dict, interval_ns: int) -> dict:
    """Block by block: each held block's interval_ns split equally among the holders that list it."""
    out = {h: Fraction(0) for h in holders}
    every_block = {b for ids in holders.values() for b in ids}
    for block in every_block:
        readers = [h for h, ids in holders.items() if block in ids]
        for h in readers:
            out[h] += Fraction(interval_ns, len(readers))
    return out


@settings(max_examples=300, deadline=None)
@given(pools())
def test_holders_idle_and_free_add_up_to_the_pool_and_each_holder_is_within_one_block_ns(drawn):
    holders, pool_blocks, idle, interval_ns = drawn
    usage = interval_usage(snapshot(holders, pool_blocks=pool_blocks, idle_cached_blocks=idle), interval_ns)
    assert usage.pool_block_ns == pool_blocks * interval_ns
    assert int(usage.block_ns.sum()) + usage.idle_cached_block_ns + usage.free_block_ns == pool_blocks * interval_ns
    assert usage.free_block_ns >= 0 and (usage.block_ns >= 0).all()
    expected = expected_by_block(holders, interval_ns)
    for holder, got in zip(usage.holders, usage.block_ns.tolist()):
        assert abs(got - expected[holder]) < 1, (holder, got, expected[holder])


@settings(max_examples=100, deadline=None)
@given(pools())
def test_a_trace_files_float_shares_give_the_same_block_ns_within_one(drawn):
    holders, pool_blocks, idle, interval_ns = drawn
    pool = snapshot(holders, pool_blocks=pool_blocks, idle_cached_blocks=idle)
    exact = apportion_block_ns(pool.effective_blocks, pool.held_blocks, interval_ns)
    floats = apportion_block_ns([float(v) for v in pool.effective_blocks], pool.held_blocks, interval_ns)
    assert int(floats.sum()) == int(exact.sum()) == pool.held_blocks * interval_ns
    assert np.abs(floats - exact).max(initial=0) <= 1


def test_a_shared_document_is_split_equally_and_a_private_block_is_its_holders():
    # a and b read one 4-block document; a also has 2 blocks of its own; c holds 1 block alone
    holders = {"a": [0, 1, 2, 3, 10, 11], "b": [0, 1, 2, 3], "c": [20]}
    usage = interval_usage(snapshot(holders, pool_blocks=30, idle_cached_blocks=5), 1_000)
    assert usage.block_ns.tolist() == [4_000, 2_000, 1_000]
    assert (usage.idle_cached_block_ns, usage.free_block_ns) == (5_000, (30 - 7 - 5) * 1_000)


def test_an_odd_split_hands_out_every_nanosecond_once():
    usage = interval_usage(snapshot({"a": [0], "b": [0], "c": [0]}, pool_blocks=1, idle_cached_blocks=0), 10)
    assert sorted(usage.block_ns.tolist()) == [3, 3, 4] and usage.block_ns.sum() == 10


@pytest.mark.parametrize(
    "holders, pool, idle, message",
    [
        ({"a": [0, 1]}, 1, 0, "2 held \\+ 0 idle cached blocks, more than the pool's 1"),
        ({"a": [0]}, 4, 4, "1 held \\+ 4 idle cached blocks, more than the pool's 4"),
        ({"a": [3, 3]}, 8, 0, "holder 'a' lists a block more than once"),
        ({"a": [0]}, 8, -1, "must be >= 0"),
    ],
)
def test_an_impossible_pool_is_refused_naming_why(holders, pool, idle, message):
    with pytest.raises(KvMemoryError, match=message):
        snapshot(holders, pool_blocks=pool, idle_cached_blocks=idle)


def test_shares_that_do_not_add_up_to_the_held_blocks_are_refused():
    with pytest.raises(KvMemoryError, match="sum to 2.5, not the 3 blocks held"):
        apportion_block_ns([1.0, 1.5], 3, 100)
    with pytest.raises(KvMemoryError, match="negative"):
        apportion_block_ns([Fraction(-1), Fraction(2)], 1, 100)


def test_block_bytes_of_a_known_model():
    # Llama-2-7B in fp16 keeps 0.5 MiB of KV per token (2 × 32 layers × 4096 hidden × 2 bytes): 8 MiB per 16-token block
    assert kv_block_bytes(num_layers=32, num_kv_heads=32, head_size=128, dtype_bytes=2, block_size=16) == 8 << 20
    # an MLA model keeps one latent per token (kv_factor 1)
    assert kv_block_bytes(num_layers=2, num_kv_heads=1, head_size=576, dtype_bytes=2, block_size=64, kv_factor=1) == 147_456
    with pytest.raises(KvMemoryError, match="head_size: expected a positive integer, got 0"):
        kv_block_bytes(num_layers=2, num_kv_heads=1, head_size=0, dtype_bytes=2, block_size=64)
    assert gib_seconds([1_000_000_000], 1 << 30).tolist() == [1.0]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from("abcde"), st.lists(st.integers(0, 9), unique=True, max_size=6), max_size=5))
def test_the_equal_split_is_the_shapley_value_of_the_holding_game(holders):
    """docs/attribution.md's claim: with v(S) = the blocks any member of S references (what S alone would keep), each
    holder's Shapley value, brute-forced over every order of arrival, is its 1/k-per-block share."""
    from itertools import permutations
    from math import factorial

    names = list(holders)
    shapley = {h: Fraction(0) for h in names}
    for order in permutations(names):
        kept: set[int] = set()
        for h in order:
            shapley[h] += len(set(holders[h]) - kept)
            kept |= set(holders[h])
    pool = snapshot(holders, pool_blocks=10, idle_cached_blocks=0)
    assert dict(zip(pool.holders, pool.effective_blocks)) == {h: v / factorial(len(names)) for h, v in shapley.items()}
