"""Profiling plans and trace summaries, without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from llmvisor import shipped
from llmvisor.core.trace import trace_from_rows
from llmvisor.core.workloads import read_workload_csv
from llmvisor.errors import LlmvisorError
from llmvisor.profile.plans import BASE_MODEL, Envelope, build_workload, fit_lengths, lora_episodes, sweep_episodes
from llmvisor.profile.stats import coverage, mark_warmup_window, noise_floor

ENVELOPE = Envelope(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32, kv_cache_tokens=200_000)


def test_sweep_episodes_fill_the_envelope_and_stay_inside_it():
    episodes = sweep_episodes(ENVELOPE, 40, seed=3)
    assert episodes == sweep_episodes(ENVELOPE, 40, seed=3)
    for episode in episodes:
        assert 1 <= len(episode.prompt_lens) + len(episode.wave_prompt_lens) <= ENVELOPE.max_num_seqs
        assert all(1 <= n < ENVELOPE.max_model_len for n in episode.prompt_lens + episode.wave_prompt_lens)
        assert 1 <= episode.token_budget <= ENVELOPE.max_num_batched_tokens
        assert sum(n + 300 for n in episode.prompt_lens + episode.wave_prompt_lens) <= ENVELOPE.kv_cache_tokens
    pools = [len(e.prompt_lens) for e in episodes]
    longest = [max(e.prompt_lens) for e in episodes]
    budgets = [e.token_budget for e in episodes]
    assert min(pools) <= 4 and max(pools) >= 28
    assert min(longest) <= 400 and max(longest) >= 3600
    assert min(budgets) <= 64 and max(budgets) >= 1500
    assert any(e.wave_prompt_lens for e in episodes)


def test_the_lora_plan_gives_each_request_an_adapter_or_the_base_model_in_every_mix():
    sweep = sweep_episodes(ENVELOPE, 60, seed=3)
    episodes = lora_episodes(sweep, 4, seed=3)
    assert episodes == lora_episodes(sweep, 4, seed=3) and episodes != lora_episodes(sweep, 4, seed=4)
    kinds = set()
    for plain, episode in zip(sweep, episodes):
        assert episode.prompt_lens == plain.prompt_lens and episode.wave_prompt_lens == plain.wave_prompt_lens
        adapters = episode.lora_adapters
        assert len(adapters) == len(episode.prompt_lens) + len(episode.wave_prompt_lens)
        assert set(adapters) <= {BASE_MODEL, 0, 1, 2, 3}
        used = set(adapters) - {BASE_MODEL}
        kinds.add((len(used), BASE_MODEL in adapters))
        counts = [adapters.count(a) for a in used]
        assert not counts or max(counts) - min(counts) <= 1  # round-robin over the episode's adapters
    distinct = {n for n, _ in kinds}
    assert {0, 1, 4} <= distinct and len(distinct) == 5  # base-only episodes up to every adapter at once
    assert any(n and base for n, base in kinds) and any(n and not base for n, base in kinds)  # base mixed in, or not
    with pytest.raises(LlmvisorError, match="at least 1 adapter"):
        lora_episodes(sweep, 0)


def test_fit_lengths_clips_to_max_model_len():
    assert fit_lengths(100, 20, 4096) == (100, 20)
    assert fit_lengths(9000, 20, 4096) == (4095, 1)
    assert fit_lengths(4000, 500, 4096) == (4000, 96)
    assert fit_lengths(8000, 400, 4096, factor=0.5) == (4000, 96)


def write_csv(path, text):
    path.write_text(text)
    return str(path)


def test_build_workload_rules(tmp_path):
    a = write_csv(tmp_path / "conv.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n1.5,9000,3\n3.0,20,2\n")
    b = write_csv(tmp_path / "code.csv", "num_prefill_tokens,num_decode_tokens\n100,1\n200,2\n")
    plan = build_workload([a, b], ENVELOPE, num_requests=2)
    assert [r.tenant for r in plan.requests] == ["conv", "code", "conv", "code"]
    assert plan.requests[2].prompt_len == 4095 and plan.requests[2].output_len == 1
    assert plan.metadata["n_requests_clipped"] == 1 and "clip" in plan.metadata["length_rule"]

    single = build_workload([a], ENVELOPE, num_requests=3, tenants=2, arrival="trace", time_scale=2.0)
    assert [r.tenant for r in single.requests] == ["conv-t0", "conv-t1", "conv-t0"]
    assert [r.arrival_s for r in single.requests] == [0.0, 3.0, 6.0]

    scaled = build_workload([a], ENVELOPE, num_requests=3, length_rule="scale")
    assert all(r.prompt_len + r.output_len <= 4096 for r in scaled.requests)
    assert scaled.metadata["length_scale_factors"]["conv"] < 1

    with pytest.raises(LlmvisorError, match="arrived_at"):
        build_workload([b], ENVELOPE, num_requests=2, arrival="trace")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prompt,output\n1,2\n", "missing column"),
        ("num_prefill_tokens,num_decode_tokens\n10,abc\n", "line 2: num_decode_tokens"),
        ("num_prefill_tokens,num_decode_tokens\n0,3\n", "line 2: num_prefill_tokens"),
        ("num_prefill_tokens,num_decode_tokens\n", "no requests"),
    ],
)
def test_bad_workload_csv_is_named(tmp_path, text, message):
    path = write_csv(tmp_path / "bad.csv", text)
    with pytest.raises(LlmvisorError, match=message) as error:
        read_workload_csv(path)
    assert path in str(error.value)


def test_missing_workload_file(tmp_path):
    with pytest.raises(LlmvisorError, match="no such workload file"):
        read_workload_csv(str(tmp_path / "nope.csv"))


def step_rows(step_id, latency, slices, warmup=False):
    return [
        {
            "run_id": "r",
            "step_id": step_id,
            "step_latency_s": latency,
            "request_id": f"q{k}",
            "tenant": "t",
            "num_new_tokens": p,
            "num_context_tokens": c,
            "phase": "prefill" if p > 1 else "decode",
            "is_warmup": warmup,
        }
        for k, (p, c) in enumerate(slices)
    ]


def test_noise_floor_groups_identical_steps_and_skips_warmup():
    rows = (
        step_rows(0, 5.0, [(1, 10)], warmup=True)
        + step_rows(1, 1.0, [(1, 10)])
        + step_rows(2, 1.1, [(1, 10)])
        + step_rows(3, 1.2, [(1, 10)])
        + step_rows(4, 2.0, [(100, 0), (1, 5)])
        + step_rows(5, 2.0, [(1, 5), (100, 0)])
        + step_rows(6, 9.0, [(7, 0)])
    )
    floor = noise_floor(trace_from_rows(rows))
    assert floor["n_groups"] == 2 and floor["n_steps"] == 5
    # the one floor: deviation from the group mean scaled by sqrt(k / (k - 1)), not |t - median| / median
    assert floor["p99"] == pytest.approx(0.1 * np.sqrt(3 / 2) / 1.1)
    assert floor["p50"] == pytest.approx(0.0, abs=1e-12) and floor["interval"]["p99"][1] == pytest.approx(floor["p99"])
    assert noise_floor(trace_from_rows(step_rows(0, 1.0, [(1, 1)]))) is None

    summary = coverage(trace_from_rows(rows), {"max_num_seqs": 4, "max_num_batched_tokens": 128, "max_model_len": 256})
    assert summary["n_steps"] == 6
    assert summary["step_kinds"] == {"pure_prefill": 1, "pure_decode": 3, "mixed": 2}
    assert summary["envelope_reached"]["batch_size / max_num_seqs"] == 0.5


def test_mark_warmup_window_marks_steps_by_start_time():
    rows = []
    for step_id, start in enumerate([100.0, 100.5, 101.0, 103.0]):
        for row in step_rows(step_id, 1.0, [(1, 10), (1, 20)], warmup=step_id == 0):
            rows.append(row | {"timestamp_s": start})
    trace = trace_from_rows(rows)
    assert mark_warmup_window(trace, 0) == 1
    assert mark_warmup_window(trace, 1.0) == 2
    assert mark_warmup_window(trace, 2.5) == 3
    assert trace.extra["is_warmup"].tolist() == [True] * 6 + [False] * 2


def test_zero_output_rows_are_refused_for_replay_but_kept_in_a_length_mix(tmp_path):
    path = write_csv(tmp_path / "mix.csv", "num_prefill_tokens,num_decode_tokens\n10,0\n20,3\n")
    with pytest.raises(LlmvisorError, match="line 2: num_decode_tokens: expected a whole number >= 1"):
        read_workload_csv(path)
    rows = read_workload_csv(path, min_output_tokens=0)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(10, 0), (20, 3)]


def test_sweep_has_document_system_and_unshared_episodes_whose_prompts_fit_their_prefix():
    envelope = Envelope(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32, kv_cache_tokens=400_000, block_size=128)
    episodes = sweep_episodes(envelope, 30, seed=5)
    by_kind = {kind: [e for e in episodes if e.sharing == kind] for kind in ("none", "document", "system")}
    assert all(len(group) == 10 for group in by_kind.values())
    for episode in by_kind["none"]:
        assert episode.shared_prefix_len == 0
    for episode in episodes:
        prompts = episode.prompt_lens + episode.wave_prompt_lens
        assert all(episode.shared_prefix_len < n < envelope.max_model_len for n in prompts)
    for episode in by_kind["document"]:
        longest = max(episode.prompt_lens)
        assert longest >= (envelope.max_model_len - 1) // 4
        assert 0.5 * longest - 1 <= episode.shared_prefix_len <= 0.95 * longest + 1
    for episode in by_kind["system"]:
        assert episode.shared_prefix_len % 128 == 0 and 128 <= episode.shared_prefix_len <= 4 * 128
        assert episode.shared_prefix_len <= max(episode.prompt_lens) // 2
        assert len(episode.prompt_lens) >= 8
    # a sharing term needs sharers and shared fractions that vary
    sharers = {len(e.prompt_lens) for e in by_kind["document"] + by_kind["system"]}
    fractions = [e.shared_prefix_len / max(e.prompt_lens) for e in by_kind["document"] + by_kind["system"]]
    assert len(sharers) >= 5 and min(fractions) < 0.3 and max(fractions) > 0.8


def test_system_prompt_of_a_short_longest_prompt_is_at_most_half_of_it():
    envelope = Envelope(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=32)
    episodes = sweep_episodes(envelope, 9, seed=1)
    for episode in episodes:
        assert all(episode.shared_prefix_len < n < 64 for n in episode.prompt_lens + episode.wave_prompt_lens)
        if episode.sharing == "system":
            assert episode.shared_prefix_len in (0, 32) and episode.shared_prefix_len <= max(episode.prompt_lens) // 2


def test_shared_documents_prefix_prompts_round_robin_and_stay_within_the_envelope():
    envelope = Envelope(max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=32)
    conv = str(shipped.workloads_dir() / "azure-2023-conv.csv")
    plan = build_workload([conv], envelope, num_requests=30, shared_documents=3, document_tokens=1024)
    assert [r.document for r in plan.requests[:6]] == [0, 1, 2, 0, 1, 2]
    for request in plan.requests:
        assert request.prompt_len + request.output_len <= envelope.max_model_len
        assert 0 < request.document_tokens <= min(1024, request.prompt_len - 1)
    assert "shared document" in plan.metadata["sharing"]
    plain = build_workload([conv], envelope, num_requests=30)
    assert all(r.document is None and r.document_tokens == 0 for r in plain.requests)
    assert plain.metadata["sharing"].startswith("none")


@pytest.mark.parametrize("documents, tokens", [(2, 0), (0, 128), (-1, 5)])
def test_shared_documents_need_both_settings(documents, tokens):
    envelope = Envelope(max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=32)
    with pytest.raises(LlmvisorError, match="--shared-documents"):
        build_workload([str(shipped.workloads_dir() / "azure-2023-conv.csv")], envelope, num_requests=5, shared_documents=documents, document_tokens=tokens)
