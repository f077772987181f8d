"""Mixed and shared-prefix decode steps on the real vLLM engine: each runs as intended, and the recorder's
shared-KV columns show the shared prefix exactly when two or more of its readers run together."""

from __future__ import annotations

import json

import pytest

from _tiny_llama import IN_PROCESS_ENGINE_THREADS, write_tiny_llama

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0, "vocab_size": 1000}


def _steps(trace) -> list[list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step_id"], []).append(row)
    return list(steps.values())


@pytest.mark.vllm
def test_mixed_and_shared_prefix_decode_steps_run_as_intended(tmp_path):
    pytest.importorskip("vllm")
    from llmvisor.engines.vllm.controlled import ControlledEngine, Slice

    model_dir = write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)
    trace = tmp_path / "steps.jsonl"
    with ControlledEngine(model_dir, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8, kv_cache_gib=1, num_threads=IN_PROCESS_ENGINE_THREADS, trace_path=trace) as engine:
        block = engine.block_size
        # A chunk of 100 new tokens over 70 cached ones (not a whole number of blocks), next to two decodes.
        mixed = engine.prepare_mixed(100, 70, [40, 90], max_decode_steps=10)
        for _ in range(2):  # the second run finds the cached context's whole blocks in the prefix cache
            step = engine.mixed_step(mixed, [0, 1, 2])
            assert step.matches, step.reason
            assert step.recorded[0] == Slice(100, 70, True) and [s.num_new_tokens for s in step.recorded[1:]] == [1, 1]
        step = engine.mixed_step(mixed, [0])
        assert step.matches and step.recorded == [Slice(100, 70, True)], step.reason
        step = engine.mixed_step(mixed, [2])  # its two runs above were rewound: still at the planned context
        assert step.matches and step.recorded == [Slice(1, 90, False)], step.reason
        canary = engine.canary_step()  # the held decodes stay held
        assert canary.matches, canary.reason
        engine.release(mixed)

        # Three decodes sharing a prefix of 1.5 blocks: its whole block is shared when two or more run together.
        prefix = block + block // 2
        shared = engine.prepare_shared_decode([prefix + 20, prefix + 60, prefix + 35], prefix, max_decode_steps=10)
        whole = block
        step = engine.decode_step(shared, [0, 2])
        assert step.matches, step.reason
        assert [s.num_shared_context_tokens for s in step.recorded] == [whole, whole]
        step = engine.decode_step(shared, [1])
        assert step.matches and step.recorded[0].num_shared_context_tokens == 0, step.reason
        engine.release(shared)

        # Unique prompts never share: a plain decode batch records no shared context.
        contexts = [block + 60, 2 * block + 10]
        plain = engine.prepare_decode(contexts, max_decode_steps=4)
        step = engine.decode_step(plain, [0, 1])
        assert step.matches and all(s.num_shared_context_tokens == 0 for s in step.recorded), step.reason
        engine.release(plain)
        # Prepared again (the next order of a sampled batch), its prompts' whole blocks come from the prefix cache.
        before = len(_steps(trace))
        again = engine.prepare_decode(contexts, max_decode_steps=4)
        prefilled = sum(r["num_new_tokens"] for s in _steps(trace)[before:] for r in s)
        assert prefilled == sum(c - c // block * block for c in contexts)
        step = engine.decode_step(again, [0, 1])
        assert step.matches and all(s.num_shared_context_tokens == 0 for s in step.recorded), step.reason
        engine.release(again)

    steps = _steps(trace)
    mixed_steps = [s for s in steps if {r["phase"] for r in s} == {"prefill", "decode"}]
    assert len(mixed_steps) == 2
    for s in mixed_steps:
        chunk = next(r for r in s if r["phase"] == "prefill")
        assert (chunk["num_new_tokens"], chunk["num_context_tokens"]) == (100, 70)
    decode_steps = [s for s in steps if {r["phase"] for r in s} == {"decode"}]
    shared_steps = [s for s in decode_steps if any(r["num_shared_context_tokens"] for r in s)]
    assert len(shared_steps) == 1 and len(shared_steps[0]) == 2
    for r in shared_steps[0]:
        assert r["num_shared_context_tokens"] == whole
        assert r["effective_context_tokens"] == pytest.approx(r["num_context_tokens"] - whole / 2)
