"""Warm measuring on the real vLLM engine measures the planned step: each decode step rewound to the planned contexts,
a batch prepared once for all its batch-rounds, and own contexts found in the prefix cache when a later batch needs
them. The cold method (``warm=False``, the earlier one) is run beside it: its contexts grow and it prepares per round,
so each check below tells the two apart."""

from __future__ import annotations

import numpy as np
import pytest

from _tiny_llama import IN_PROCESS_ENGINE_THREADS, write_tiny_llama
from llmvisor.validation.measurement import InterferenceGuard, Journal, measure_sampled
from llmvisor.validation.plans import SampledBatchSpec, complementary_masks
from test_controlled_sampled import _steps

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0, "vocab_size": 1000}
CONTEXTS = (130, 17, 127, 255, 300, 64)
GROUPED = dict(contexts=(300, 310, 200, 420, 260, 150), prefixes=(140, 140, 0, 160, 160, 0), groups=(0, 0, -1, 1, 1, -1))
LATER = (300, 200, 140, 260, 129, 64)
LATER_GROUPED = dict(contexts=(310, 250, 100, 400, 180, 90), prefixes=(160, 160, 0, 144, 144, 0), groups=(0, 0, -1, 1, 1, -1))


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
    with ControlledEngine(model_dir, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_gib=1, num_threads=IN_PROCESS_ENGINE_THREADS,
                          trace_path=trace, warm=warm) as engine:
        counts = measure_sampled(engine, batches, journal, repeat=1, guard=InterferenceGuard(tolerance=10.0, calibration=3, max_redos=0, max_wait_s=0.0))
        # Later batches: the whole blocks the measured batches computed are found in the prefix cache.
        prefilled = {}
        for name, prepare in (("own", lambda: engine.prepare_decode(list(LATER), max_decode_steps=4)),
                              ("grouped", lambda: engine.prepare_grouped_decode(list(LATER_GROUPED["contexts"]), list(LATER_GROUPED["prefixes"]),
                                                                                list(LATER_GROUPED["groups"]), max_decode_steps=4))):
            before = len(_steps(trace))
            handle = prepare()
            prefilled[name] = [sum(r["num_new_tokens"] for s in _steps(trace)[before:] for r in s if r["request_id"] == rid)
                               for rid in handle.request_ids]
            engine.release(handle)
        block = engine.block_size
    return batches, journal, counts, prefilled, block


def _ranks(lengths) -> list[int]:
    """Each length's rank, longest first (ties by position)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order.index(i) for i in range(len(lengths))]


def _computed_by_rank(batches: list[list[int]]) -> dict[int, int]:
    """The longest context computed at each rank over these batches (what the session's sequence of that rank holds)."""
    longest: dict[int, int] = {}
    for lengths in batches:
        for rank, c in zip(_ranks(lengths), lengths):
            longest[rank] = max(longest.get(rank, 0), c)
    return longest


def _uncached(c: int, computed: int, block: int) -> int:
    """Tokens a prompt of ``c`` computes when the first ``computed`` of its tokens were computed before."""
    return c - min(computed // block, (c - 1) // block) * block


@pytest.mark.vllm
def test_warm_measuring_runs_each_coalition_at_its_planned_contexts_and_prepares_each_batch_once(tmp_path):
    pytest.importorskip("vllm")
    batches, journal, counts, prefilled, block = _measure(tmp_path, warm=True)
    n_rounds = sum(len(b.chunks(r)) for b in batches for r in range(b.rounds))
    assert counts["rejected_now"] == 0 and counts["measured_now"] == sum(len(b.subsets(r)) for b in batches for r in range(b.rounds))
    assert counts["preparations"] == len(batches) < n_rounds  # one preparation per batch, all its rounds and chunks
    for batch in batches:
        for round_ in range(batch.rounds):
            for subset in batch.subsets(round_):
                (m,) = journal.get(batch, round_, subset)
                planned = [c for i, c in enumerate(batch.num_context_tokens) if subset >> i & 1]
                assert m.num_context_tokens == planned  # no growth, however many steps the batch ran
    # Own contexts of the later batch: computed only past the whole blocks the earlier own contexts of the same length
    # rank computed (a reader of a prefix group has a prompt of its own).
    own_grouped = [c for c, g in zip(GROUPED["contexts"], GROUPED["groups"]) if g < 0]
    computed = _computed_by_rank([list(CONTEXTS), own_grouped])
    assert prefilled["own"] == [_uncached(c, computed[r], block) for c, r in zip(LATER, _ranks(LATER))]
    assert sum(prefilled["own"]) < sum(LATER)
    # A later grouped batch: own contexts by rank as above; each group's longest reader finds what the longest reader
    # of the earlier group of its rank computed (groups ranked by their longest reader: 420 then 310 before, 400 then
    # 310 now); the group's other readers find its prefix and compute their own part.
    computed = _computed_by_rank([list(CONTEXTS), own_grouped, list(LATER)])
    contexts, prefixes, groups = (list(LATER_GROUPED[k]) for k in ("contexts", "prefixes", "groups"))
    own = [i for i, g in enumerate(groups) if g < 0]
    own_rank = dict(zip(own, _ranks([contexts[i] for i in own])))
    lead_before = {1: 420, 0: 310}  # this batch's group: the longest reader its rank's earlier group computed
    leads = {g: max((i for i in range(6) if groups[i] == g), key=contexts.__getitem__) for g in lead_before}
    expected = [_uncached(c, computed[own_rank[i]], block) if g < 0 else
                _uncached(c, lead_before[g], block) if leads[g] == i else c - p // block * block
                for i, (c, p, g) in enumerate(zip(contexts, prefixes, groups))]
    assert prefilled["grouped"] == expected and sum(prefilled["grouped"]) < sum(contexts) / 2


@pytest.mark.vllm
def test_cold_measuring_grows_contexts_and_prepares_per_round(tmp_path):
    """The earlier method, which the warm one replaces: what the warm test above rules out does happen here."""
    pytest.importorskip("vllm")
    batches, journal, counts, prefilled, block = _measure(tmp_path, warm=False)
    n_rounds = sum(len(b.chunks(r)) for b in batches for r in range(b.rounds))
    # every batch-round prepared again, and so is a round the guard discarded (the machine is shared)
    assert counts["rejected_now"] == 0 and counts["preparations"] == n_rounds + counts["discarded_batch_rounds"]
    growth = [got - base for b in batches for ms in (journal.get(b, r, s) for r in range(b.rounds) for s in b.subsets(r))
              for m in ms for got, base in zip(m.num_context_tokens, [c for i, c in enumerate(b.num_context_tokens) if m.subset >> i & 1])]
    assert min(growth) >= 0 and max(growth) > 0
    # fresh prompts: nothing found in the prefix cache (a group's other readers find only its prefix, which its first
    # reader computed in the same preparation)
    assert prefilled["own"] == list(LATER)
    first = {g: i for i, g in reversed(list(enumerate(LATER_GROUPED["groups"])))}
    assert prefilled["grouped"] == [c if g < 0 or first[g] == i else c - p // block * block
                                    for i, (c, p, g) in enumerate(zip(*LATER_GROUPED.values()))]


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
