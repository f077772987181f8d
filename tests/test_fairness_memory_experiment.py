"""The memory-bound fairness experiment's analysis on runs built by hand (KV memory from the trace's version-3
columns, shares, sharing incentive against alone on 1/n, goals, the doc's tables and figure), and the lengths it draws
from the shipped mixes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.core.trace import TraceWriter
from llmvisor.engines.vllm.fair_experiment import mix_arrival_schedule, mix_lengths
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.memory_experiment import (
    RESULT_FILE,
    memory_goals,
    memory_tenants,
    partition_engine,
    run_memory_experiment,
    sharing_incentive,
)
from llmvisor.fairness.memory_report import markdown_summary, plot_memory

POOL = 10
INTERVAL_NS = 100_000_000


def write_run(folder, *, policy: str, tenants: dict[str, tuple[int, int, int]], preemptions=(), t0_wall=1000.0) -> dict:
    """A run of 60 steps 0.1 s apart (0.08 s each): per tenant one request decoding throughout, as (context tokens,
    blocks held, output tokens per step)."""
    folder.mkdir(parents=True)
    trace_path = folder / "trace.jsonl"
    names = list(tenants)
    held = sum(blocks for _, blocks, _ in tenants.values())
    with TraceWriter(trace_path) as writer:
        for k in range(60):
            writer.write_step([
                {"run_id": policy, "step_id": k, "step_latency_s": 0.08, "request_id": f"{tenant}-0-abcdefgh", "tenant": tenant,
                 "num_new_tokens": 1, "num_context_tokens": context + k, "phase": "decode", "timestamp_s": t0_wall + 0.1 * k,
                 "kv_block_ns": blocks * INTERVAL_NS, "kv_interval_ns": INTERVAL_NS, "kv_idle_block_ns": 0,
                 "kv_free_block_ns": (POOL - held) * INTERVAL_NS, "kv_carried_in_block_ns": 0, "kv_carried_out_block_ns": 0,
                 "kv_pool_blocks": POOL, "kv_block_bytes": 4096}
                for tenant, (context, blocks, _) in tenants.items()
            ])
    step_return = [0.1 * k + 0.08 for k in range(60)]
    requests = [{"request_id": f"{t}-0", "tenant": t, "arrival_s": 0.0, "submitted_s": 0.0, "first_token_s": 0.08,
                 "finish_s": 5.0, "output_tokens": 60} for t in names]
    requests += [{"request_id": f"{t}-1", "tenant": t, "arrival_s": 0.5, "submitted_s": 0.5, "first_token_s": None,
                  "finish_s": None, "output_tokens": 0} for t in names]
    run = {
        "policy": policy, "name": policy, "tenants": names, "trace": str(trace_path), "first_step": 0, "t0_wall_s": t0_wall,
        "end_s": 6.0, "requests": requests, "step_return_s": step_return,
        "step_output_tokens": [[tenants[t][2] for t in names] for _ in range(60)],
        "engine_start_s": 1.0, "num_arrivals": 2 * len(names), "waiting_at_end": len(names), "recorder_overhead": {},
        "engine": {"model": "/x/engine", "max_num_seqs": 24}, "workload": {"tenants": [{"name": t} for t in names], "duration_s": 6.0, "seed": 0},
        "kv_pool_blocks": POOL, "block_size": 128, "enable_prefix_caching": True, "preemptions": [list(p) for p in preemptions],
    }
    (folder / "result.json").write_text(json.dumps(run))
    return run


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.json"
    StepLatencyModel.from_coefficients([dict(DEFAULT_COEF_S)]).to_json(path)
    return path


def test_memory_shares_come_from_the_traces_block_ns_over_the_pool_and_wall_time(tmp_path, model_path):
    from llmvisor.fairness.experiment import analyse_run
    from llmvisor.fairness.memory_experiment import memory_figures

    run = write_run(tmp_path / "drf", policy="drf", tenants={"hog": (1500, 6, 1), "code": (100, 1, 1)},
                    preemptions=[(0.5, "hog"), (2.5, "hog"), (3.5, "code"), (5.5, "hog")])
    summary = analyse_run(run, StepLatencyModel.from_json(model_path), window_s=1.0, warmup_s=1.0)["summary"]
    memory = memory_figures(run, summary, window_s=1.0, warmup_s=1.0)
    assert summary["interval_s"] == [1.0, 6.0]
    assert memory["memory_share"] == pytest.approx({"hog": 0.6, "code": 0.1})  # 6 and 1 of 10 blocks, every step
    assert memory["pool_block_ns"] == POOL * INTERVAL_NS * 50  # steps 10..59
    assert all(w["memory_share"] == pytest.approx({"hog": 0.6, "code": 0.1}) for w in memory["windows"]) and len(memory["windows"]) == 5
    assert sum(memory["time_share"].values()) == pytest.approx(1.0)
    assert memory["time_share"]["hog"] > memory["time_share"]["code"]  # its decodes read 15x the context
    for tenant in ("hog", "code"):
        assert memory["dominant_share"][tenant] == max(memory["time_share"][tenant], memory["memory_share"][tenant])
    assert memory["preemptions"] == {"hog": 2, "code": 1}  # 0.5 s is before the interval
    assert memory["latency_s"]["hog"]["p50"] == pytest.approx(5.0) and memory["in_engine_s"]["hog"]["p99"] == pytest.approx(5.0)


def summary_of(output_tokens: dict[str, float], seconds: float = 10.0, busy: float = 1.0) -> dict:
    return {"interval_s": [0.0, seconds], "output_tokens": output_tokens, "requests_finished": dict.fromkeys(output_tokens, 1),
            "engine_busy_fraction": busy}


def test_sharing_incentive_compares_with_alone_on_a_third_and_the_goal_needs_drf_met_and_a_baseline_not():
    alone = {t: {"on_share_output_tokens_per_s": r, "on_share_output_tokens_per_wall_s": r / 2}
             for t, r in {"hog": 10.0, "chat": 20.0, "code": 5.0}.items()}
    fair = sharing_incentive(summary_of({"hog": 100.0, "chat": 300.0, "code": 50.0}), alone, 3)
    assert fair["ratio"] == pytest.approx({"hog": 1.0, "chat": 1.5, "code": 1.0})
    assert fair["ratio_wall_clock"] == pytest.approx({"hog": 2.0, "chat": 3.0, "code": 2.0})
    # throughput is per second of engine time: the same tokens in half the engine time are twice the rate
    assert sharing_incentive(summary_of({"hog": 50.0, "chat": 150.0, "code": 25.0}, busy=0.5), alone, 3)["ratio"] == fair["ratio"]
    assert fair["all_met"] and fair["service_max_min"] == pytest.approx(1.5)
    unfair = sharing_incentive(summary_of({"hog": 300.0, "chat": 100.0, "code": 49.0}), alone, 3)
    assert unfair["met"] == {"hog": True, "chat": False, "code": False} and not unfair["all_met"]
    goals = memory_goals({"drf": {"sharing_incentive": fair}, "attributed": {"sharing_incentive": unfair},
                          "fcfs": {"sharing_incentive": fair}})
    assert goals["met"] is True and goals["baselines_missing_it"] == ["attributed"]
    assert memory_goals({"drf": {"sharing_incentive": unfair}, "fcfs": {"sharing_incentive": unfair}})["met"] is False
    assert memory_goals({"drf": {"sharing_incentive": fair}, "fcfs": {"sharing_incentive": fair}})["met"] is False
    assert memory_goals({"drf": {}})["met"] is None


def test_a_tenant_alone_gets_a_third_of_the_seats_and_pool_and_the_same_requests(tmp_path):
    engine, pool = partition_engine({"max_num_seqs": 24, "max_model_len": 2048}, 48, 3)
    assert engine == {"max_num_seqs": 8, "max_model_len": 2048} and pool == 16
    tenants = memory_tenants(rate_rps=3.0, length_scale=0.5)
    assert [t["mix"] for t in tenants] == ["arxiv-summarization", "azure-2023-conv", "azure-2023-code"]
    workload = {"tenants": tenants, "duration_s": 20.0, "seed": 7}
    together = mix_arrival_schedule(workload, 2048)
    alone = mix_arrival_schedule({**workload, "only_tenant": "chat"}, 2048)
    assert alone == [r for r in together if r["tenant"] == "chat"] and alone
    assert all(r["prompt_tokens"] + r["output_tokens"] <= 2048 and r["prompt_tokens"] < 2048 for r in together)
    lengths = np.array(mix_lengths("arxiv-summarization", 0.5, 2048))
    assert 1200 < np.median(lengths[:, 0]) < 1500  # the mix's median prompt (2,730) halved
    with pytest.raises(LlmvisorError, match="--length-scale"):
        memory_tenants(rate_rps=3.0, length_scale=1.5)


def test_the_command_analyses_saved_runs_into_the_json_the_doc_tables_and_the_figure(tmp_path, model_path):
    out = tmp_path / "experiment"
    shared = {"hog": (1500, 6, 1), "code": (100, 1, 2)}
    write_run(out / "fcfs", policy="fcfs", tenants={"hog": (1500, 8, 1), "code": (100, 1, 1)})
    write_run(out / "drf", policy="drf", tenants=shared)
    write_run(out / "alone-hog", policy="fcfs", tenants={"hog": (1500, 3, 1)})
    write_run(out / "alone-code", policy="fcfs", tenants={"code": (100, 1, 2)})
    workload = {"tenants": [{"name": "hog"}, {"name": "code"}], "duration_s": 6.0, "seed": 0}
    result = run_memory_experiment(out, latency_model_path=model_path, engine_dir=tmp_path / "engine", engine={"max_num_seqs": 24},
                                   kv_pool_blocks=POOL, policies=["fcfs", "drf"], workload=workload, window_s=1.0, warmup_s=1.0,
                                   analyse_only=True)
    assert json.loads((out / RESULT_FILE).read_text()) == json.loads(json.dumps(result))
    assert (out / "fairness-memory.png").stat().st_size > 10_000
    # alone on 1/2: 1 output token per step of 0.08 s for hog, 2 for code (per wall second: per 0.1 s), halved
    assert result["alone"]["hog"]["on_share_output_tokens_per_s"] == pytest.approx(6.25)
    assert result["alone"]["code"]["on_share_output_tokens_per_s"] == pytest.approx(12.5)
    assert result["alone"]["code"]["on_share_output_tokens_per_wall_s"] == pytest.approx(10.0)
    fcfs, drf = result["policies"]["fcfs"]["sharing_incentive"], result["policies"]["drf"]["sharing_incentive"]
    assert fcfs["ratio"] == pytest.approx({"hog": 2.0, "code": 1.0}) and fcfs["all_met"]
    assert drf["ratio"] == pytest.approx({"hog": 2.0, "code": 2.0})
    assert result["goals"]["met"] is False  # DRF met it, but so did FCFS
    text = markdown_summary(result)
    assert "| DRF | yes | 1.00 |" in text and "| alone on 1/2 | hog / code | 6.2 / 12.5 | 1 |" in text
    plot_memory(result)
