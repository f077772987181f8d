"""Controlled decode steps whose members run LoRA adapters, on the real engine (vLLM CPU build, tiny Llama)."""

from __future__ import annotations

import pytest

from _tiny_llama import IN_PROCESS_ENGINE_THREADS, write_tiny_llama

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TINY_FIELDS = {"num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0, "vocab_size": 1000}


def test_decode_batch_with_adapters_runs_each_member_on_its_adapter_without_loads_in_measured_steps(tmp_path):
    import json

    from llmvisor.engines.vllm.controlled import ControlledEngine, LoraAdapter
    from llmvisor.errors import LlmvisorError
    from llmvisor.profile.adapters import write_adapters

    model_dir = write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)
    config = json.loads((model_dir / "config.json").read_text())
    written = write_adapters(tmp_path / "adapters", config, [8, 16, 8])
    a, b, c = (LoraAdapter(x.path.name, str(x.path)) for x in written)
    with ControlledEngine(model_dir, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8, kv_cache_gib=1, num_threads=IN_PROCESS_ENGINE_THREADS,
                          trace_path=tmp_path / "steps.jsonl", max_loras=2, max_lora_rank=16) as engine:
        assert engine.describe()["max_loras"] == 2
        batch = engine.prepare_decode([40, 50, 60, 70], max_decode_steps=4, adapters=[a, None, b, b])
        for members in ([0, 1, 2, 3], [1], [0, 2], [2, 3], [0, 1, 2, 3]):
            step = engine.decode_step(batch, members)
            assert step.matches, step.reason
            assert [s.lora_name for s in step.recorded] == [[a.name, "", b.name, b.name][i] for i in members]
            assert [s.num_context_tokens for s in step.recorded] == [[40, 50, 60, 70][i] for i in members]  # warm: rewound
        with pytest.raises(LlmvisorError, match="max_loras 2"):
            engine.prepare_decode([40, 50, 60], max_decode_steps=4, adapters=[a, b, c])
        with pytest.raises(LlmvisorError, match="one per request"):
            engine.prepare_decode([40, 50], max_decode_steps=4, adapters=[a])
        # An adapter new to the slots (c) is loaded while its batch is prepared, not in the first measured step
        # (a step whose record shows a load would not match).
        batch = engine.prepare_decode([40, 50], max_decode_steps=4, adapters=[c, None])
        assert engine.decode_step(batch, [0, 1]).matches


def test_a_step_whose_record_shows_a_slot_load_does_not_match(tmp_path):
    """The recorder's rows of a step that loaded an adapter (``step_lora_loads``) make the step a mismatch, with the
    adapter named; the same step without the load matches (rows written as the recorder writes them, no engine)."""
    import json

    from llmvisor.engines.vllm.controlled import ControlledEngine, Slice

    trace = tmp_path / "steps.jsonl"
    (tmp_path / "config.json").write_text("{}")
    engine = ControlledEngine(tmp_path, trace_path=trace)  # not started: only its reading of the recorder's rows
    intended = {"d1": Slice(1, 40, False, 0, "lora-0-r8"), "d2": Slice(1, 50, False)}

    def rows(step_id: int, loads: str) -> str:
        return "".join(json.dumps({"step_id": step_id, "step_latency_s": 0.01, "request_id": rid, "num_new_tokens": 1,
                                   "num_context_tokens": s.num_context_tokens, "phase": "decode", "lora_name": s.lora_name,
                                   "step_lora_loads": loads}) + "\n" for rid, s in intended.items())

    trace.write_text(rows(1, '["lora-0-r8"]'))
    step = engine._compare(intended, engine._read_new_steps())
    assert not step.matches and "lora-0-r8" in step.reason and "loaded" in step.reason
    with trace.open("a") as handle:
        handle.write(rows(2, "[]"))
    assert engine._compare(intended, engine._read_new_steps()).matches
    wrong = {**intended, "d2": Slice(1, 50, False, 0, "lora-1-r64")}  # the recorded adapter must be the intended one
    with trace.open("a") as handle:
        handle.write(rows(3, "[]"))
    assert not engine._compare(wrong, engine._read_new_steps()).matches
