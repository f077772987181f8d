"""Warm measuring on the real vLLM engine measures the planned step: each decode step rewound to the planned contexts,
a batch prepared once for all its batch-rounds, and own contexts found in the prefix cache when a later batch needs
them. The cold method (``warm=False``, the earlier one) is run beside it: its contexts grow and it prepares per round,
so each check below tells the two apart."""

from __future__ import annotations

import numpy as np
import pytest

from _tiny_llama import write_tiny_llama
from llmvisor.validation.measurement import InterferenceGuard, Journal, measure_sampled
from llmvisor.validation.plans import SampledBatchSpec, complementary_masks
from test_controlled_sampled import _steps

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0, "vocab_size": 1000}
CONTEXTS = (130, 17, 127, 255, 300, 64)
GROUPED = dict(contexts=(300, 310, 200, 420, 260, 150), prefixes=(140, 140, 0, 160, 160, 0), groups=(0, 0, -1, 1, 1, -1))


def _batches() -> list[SampledBatchSpec]:
    masks = complementary_masks(6, 13, np.random.default_rng(3))
    common = dict(source="test", num_new_tokens=(1,) * 6, is_prefill=(False,) * 6, orders=(), antithetic=False, rounds=2,
                  coalitions=tuple(masks), replicated=tuple(masks[1:5]), chunk=4)
    return [
        SampledBatchSpec(index=0, kind="decode", num_context_tokens=CONTEXTS, shared_prefix_tokens=(0,) * 6, **common),
        SampledBatchSpec(index=1, kind="mixed_sharing_decode", num_context_tokens=GROUPED["contexts"],
                         shared_prefix_tokens=GROUPED["prefixes"], prefix_groups=GROUPED["groups"], **common),
    ]


def _measure(tmp_path, warm: bool):
    from llmvisor.engines.vllm.controlled import ControlledEngine

    model_dir = write_tiny_llama(tmp_path / f"tiny-{warm}", **TINY_FIELDS)
    trace = tmp_path / f"steps-{warm}.jsonl"
    journal = Journal(tmp_path / f"j-{warm}.jsonl")
    batches = _batches()
    with ControlledEngine(model_dir, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_gib=1,
                          trace_path=trace, warm=warm) as engine:
        counts = measure_sampled(engine, batches, journal, repeat=1, guard=InterferenceGuard(tolerance=10.0, calibration=3, max_redos=0, max_wait_s=0.0))
        # A later batch at the same positions: the whole blocks the first batch computed are found in the prefix cache.
        before = len(_steps(trace))
        later = (300, 200, 140, 260, 129, 64)
        handle = engine.prepare_decode(list(later), max_decode_steps=4)
        prefilled = [sum(r["num_new_tokens"] for s in _steps(trace)[before:] for r in s if r["request_id"] == rid) for rid in handle.request_ids]
        engine.release(handle)
        block = engine.block_size
    return batches, journal, counts, prefilled, later, block


@pytest.mark.vllm
def test_warm_measuring_runs_each_coalition_at_its_planned_contexts_and_prepares_each_batch_once(tmp_path):
    pytest.importorskip("vllm")
    batches, journal, counts, prefilled, later, block = _measure(tmp_path, warm=True)
    n_rounds = sum(len(b.chunks(r)) for b in batches for r in range(b.rounds))
    assert counts["rejected_now"] == 0 and counts["measured_now"] == sum(len(b.subsets(r)) for b in batches for r in range(b.rounds))
    assert counts["preparations"] == len(batches) < n_rounds  # one preparation per batch, all its rounds and chunks
    for batch in batches:
        for round_ in range(batch.rounds):
            for subset in batch.subsets(round_):
                (m,) = journal.get(batch, round_, subset)
                planned = [c for i, c in enumerate(batch.num_context_tokens) if subset >> i & 1]
                assert m.num_context_tokens == planned  # no growth, however many steps the batch ran
    # Own contexts of the later batch: computed only past the whole blocks the same position's earlier own contexts
    # computed (a reader of a prefix group has a prompt of its own).
    computed = [max(a, g if group < 0 else 0) for a, g, group in zip(CONTEXTS, GROUPED["contexts"], GROUPED["groups"])]
    expected = [c - min(a // block, (c - 1) // block) * block for a, c in zip(computed, later)]
    assert prefilled == expected and sum(prefilled) < sum(later)


@pytest.mark.vllm
def test_cold_measuring_grows_contexts_and_prepares_per_round(tmp_path):
    """The earlier method, which the warm one replaces: what the warm test above rules out does happen here."""
    pytest.importorskip("vllm")
    batches, journal, counts, prefilled, later, block = _measure(tmp_path, warm=False)
    n_rounds = sum(len(b.chunks(r)) for b in batches for r in range(b.rounds))
    # every batch-round prepared again, and so is a round the guard discarded (the machine is shared)
    assert counts["rejected_now"] == 0 and counts["preparations"] == n_rounds + counts["discarded_batch_rounds"]
    growth = [got - base for b in batches for ms in (journal.get(b, r, s) for r in range(b.rounds) for s in b.subsets(r))
              for m in ms for got, base in zip(m.num_context_tokens, [c for i, c in enumerate(b.num_context_tokens) if m.subset >> i & 1])]
    assert min(growth) >= 0 and max(growth) > 0
    assert prefilled == list(later)  # fresh prompts: nothing found in the prefix cache


class _Held:
    def __init__(self, holds: bool):
        self.holds_contexts = holds
        self.released: list[str] = []

    def release(self, handle) -> None:
        self.released.append(handle)


def test_held_contexts_keep_a_batch_only_where_the_measurer_leaves_contexts_as_prepared():
    from llmvisor.validation.measurement import HeldContexts

    for holds, prepared, released in ((True, ["a", "b"], ["a", "b"]), (False, ["a", "a", "b"], ["a", "a", "b"])):
        measurer, made = _Held(holds), []
        held = HeldContexts(measurer)
        for key in ("a", "a", "b"):  # two batch-rounds of one batch, then another batch
            held.acquire((key,), lambda key=key, made=made: made.append(key) or key)
            held.round_done()
        held.release()
        assert made == prepared and measurer.released == released and held.n_prepared == len(prepared)
