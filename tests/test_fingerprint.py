"""Engine fingerprints: a stable id, carried by traces, models and pushed steps; the service checks it and
exports each run's residual quantiles."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from _service_fixtures import bearer, db_url, keys, ledger, make_steps, model_path  # noqa: F401
from llmvisor import shipped
from llmvisor.client import columns_body
from llmvisor.core.fingerprint import (
    EngineFingerprint,
    describe_mismatch,
    fingerprint_id,
    model_config_hash,
    parse_cpuinfo,
    read_cpuinfo,
)
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import read_trace, write_trace
from llmvisor.errors import LlmvisorError
from llmvisor.service.app import create_app
from llmvisor.service.metrics import RunResidualWindows

SERVED = EngineFingerprint(
    engine="vllm", engine_version="0.32.0", model_config_hash="0123456789abcdef", dtype="bfloat16", device="cpu",
    hardware="Some CPU", threads=1, max_num_batched_tokens=2048, max_num_seqs=128, block_size=128,
    async_scheduling=False, enable_prefix_caching=True, enable_chunked_prefill=True, enforce_eager=False,
    model="engine-model", max_model_len=4096, core_ids=(0,), executor_backend="mp",
)


def test_id_is_stable_and_follows_the_identity_fields_only():
    assert EngineFingerprint.from_dict(json.loads(json.dumps(SERVED.to_dict()))).id == SERVED.id
    assert replace(SERVED, core_ids=(3,), executor_backend="uni", model="copy", max_model_len=8192).id == SERVED.id
    for change in ({"threads": 2}, {"max_num_seqs": 32}, {"block_size": 16}, {"engine_version": "0.33.0"},
                   {"enable_prefix_caching": False}, {"tensor_parallel_size": 2}, {"dtype": "float32"}):
        other = replace(SERVED, **change)
        assert other.id != SERVED.id
        assert list(other.differences(SERVED)) == list(change)
    assert "threads 2 vs 1" in describe_mismatch(replace(SERVED, threads=2).to_dict(), SERVED.to_dict())


def test_lora_settings_make_another_class_and_leave_an_engine_without_lora_as_it_was():
    # the id and record of an engine without LoRA are those of the code before LoRA was recorded (pinned here)
    assert SERVED.id == "7544e72d2d42e93e" and "enable_lora" not in SERVED.to_dict()
    lora = replace(SERVED, enable_lora=True, max_loras=2, max_lora_rank=64, max_cpu_loras=2)
    assert lora.id != SERVED.id and lora.to_dict()["max_lora_rank"] == 64
    assert EngineFingerprint.from_dict(json.loads(json.dumps(lora.to_dict()))) == lora
    for change in ({"max_loras": 4}, {"max_lora_rank": 16}, {"max_cpu_loras": 8}):
        assert list(replace(lora, **change).differences(lora)) == list(change)
    assert "enable_lora True vs None" in describe_mismatch(lora.to_dict(), SERVED.to_dict())


CPUINFO = Path(__file__).parent / "data" / "cpuinfo"


def test_two_amd_epyc_cpus_with_other_isa_flags_are_two_engine_classes():
    """The two samples (an AVX2-only Zen 3 VM and an AVX-512 one) both call themselves "AMD EPYC"; their
    fingerprints differ by the ISA flags, so a model of one never bills the other's steps."""
    avx2, avx512 = (read_cpuinfo(CPUINFO / f"amd-epyc-{name}.txt") for name in ("avx2", "avx512"))
    assert avx2.model_name == avx512.model_name == "AMD EPYC"
    assert "avx2" in avx2.flags and not any(flag.startswith(("avx512", "amx")) for flag in avx2.flags)
    assert {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"} <= set(avx512.flags) and "amx_tile" not in avx512.flags
    on_avx2 = replace(SERVED, hardware=avx2.model_name, cpu_flags=avx2.flags, cpu_capability="AVX2", gemm_backend="torch")
    on_avx512 = replace(SERVED, hardware=avx512.model_name, cpu_flags=avx512.flags, cpu_capability="AVX512", gemm_backend="onednn")
    assert on_avx2.id != on_avx512.id
    assert set(on_avx2.differences(on_avx512)) == {"cpu_flags", "cpu_capability", "gemm_backend"}
    assert on_avx2.id != replace(on_avx2, cpu_flags=avx512.flags).id  # the flags alone change the class
    assert EngineFingerprint.from_dict(json.loads(json.dumps(on_avx2.to_dict()))) == on_avx2


def test_cpuinfo_parsing_keeps_the_flags_that_matter_in_a_fixed_order():
    arm = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve2 bf16 i8mm cpuid\nCPU part\t: 0xd4f\n")
    assert arm.flags == ("asimd", "sve2", "bf16", "i8mm") and arm.model_name == "CPU"
    shuffled = parse_cpuinfo("model name : X\nflags : amx_tile avx512f sse2 avx2\n\nmodel name : Y\nflags : avx\n")
    assert shuffled == parse_cpuinfo("model name : X\nflags : avx2 avx512f amx_tile\n")
    assert shuffled.model_name == "X" and shuffled.flags == ("avx2", "avx512f", "amx_tile")
    assert read_cpuinfo(CPUINFO / "no-such-file").flags == ()


def test_gpu_name_count_and_compute_capability_are_part_of_the_class():
    gpu = replace(SERVED, device="NVIDIA H200", hardware="NVIDIA H200", threads=0, device_count=1, compute_capability="9.0")
    for change in ({"device_count": 8}, {"compute_capability": "8.0"}, {"device": "NVIDIA A100", "hardware": "NVIDIA A100"}):
        assert replace(gpu, **change).id != gpu.id


def test_a_format_1_record_keeps_its_id_and_is_another_class_than_any_format_2_one():
    """The shipped model and sweep carry a fingerprint recorded before the ISA flags: it loads with the id it
    was written with, is written back unchanged, and no engine fingerprinted today has its class."""
    shipped_model = StepLatencyModel.from_json(shipped.latency_model_path())
    old = EngineFingerprint.from_dict(shipped_model.engine_fingerprint_, source="model.json")
    assert old.fingerprint_format == 1 and old.id == shipped_model.engine_fingerprint_["id"]
    assert old.to_dict() == shipped_model.engine_fingerprint_
    sweep = read_trace(shipped.trace_path("sweep.parquet"))
    assert sweep.engine_fingerprint_ids() == [EngineFingerprint.from_dict(sweep.metadata["engine_fingerprint"]).id] == [old.id]
    today = replace(old, fingerprint_format=2, cpu_flags=read_cpuinfo(CPUINFO / "amd-epyc-avx512.txt").flags,
                    cpu_capability="AVX512", gemm_backend="onednn")
    assert today.id != old.id and replace(today, cpu_flags=(), cpu_capability="", gemm_backend="").id != old.id
    message = describe_mismatch(today.to_dict(), old.to_dict())
    assert "fingerprint_format 2 vs 1" in message and "the model's is of format 1" in message and "recalibrate" in message
    assert "cpu_flags" not in message  # fields format 1 lacks are not listed one by one


def test_a_fingerprint_record_is_checked():
    data = SERVED.to_dict()
    with pytest.raises(LlmvisorError, match="does not match its fields"):
        EngineFingerprint.from_dict({**data, "threads": 4})
    with pytest.raises(LlmvisorError, match="lacks block_size"):
        EngineFingerprint.from_dict({k: v for k, v in data.items() if k not in ("block_size", "id")})
    assert fingerprint_id(data) == fingerprint_id(SERVED) == fingerprint_id(SERVED.id) == SERVED.id
    assert fingerprint_id(None) is None


def test_model_config_hash_ignores_where_the_config_came_from():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 6}
    assert model_config_hash({**config, "_name_or_path": "/a/b", "transformers_version": "4"}) == model_config_hash(config)
    assert model_config_hash({**config, "hidden_size": 2048}) != model_config_hash(config)


def fingerprinted_trace(fingerprint: EngineFingerprint, n_steps: int = 600, seed: int = 0):
    trace = synthetic_trace(n_steps, seed=seed)
    trace.extra["engine_fingerprint"] = np.full(trace.n_slices, fingerprint.id, dtype=object)
    trace.metadata["engine_fingerprint"] = fingerprint.to_dict()
    return trace


def test_a_fitted_model_keeps_its_training_fingerprint_and_old_files_load(tmp_path):
    path = tmp_path / "trace.parquet"
    write_trace(fingerprinted_trace(SERVED), path)
    model = StepLatencyModel().fit(read_trace(path))
    assert model.engine_fingerprint_ == SERVED.to_dict()
    model.to_json(tmp_path / "model.json")
    loaded = StepLatencyModel.from_json(tmp_path / "model.json")
    assert loaded.engine_fingerprint_["id"] == SERVED.id
    old = json.loads((tmp_path / "model.json").read_text())
    del old["engine_fingerprint"]
    assert StepLatencyModel.from_dict(old).engine_fingerprint_ is None
    with pytest.raises(LlmvisorError, match="engine_fingerprint"):
        StepLatencyModel.from_dict({**old, "engine_fingerprint": "abc"})


def test_a_trace_of_two_engines_gives_a_model_no_fingerprint():
    trace = fingerprinted_trace(SERVED)
    ids = np.asarray(trace.extra["engine_fingerprint"])
    ids[: trace.n_slices // 2] = replace(SERVED, threads=2).id
    model = StepLatencyModel().fit(trace)
    assert model.engine_fingerprint_ is None
    assert len(model.fit_info_["train_engine_fingerprints"]) == 2


def test_the_fit_drops_drifted_steps_and_counts_them():
    trace = synthetic_trace(800, seed=1)
    drifted_steps = np.zeros(trace.n_steps, dtype=bool)
    drifted_steps[100:180] = True
    trace.extra["is_drifted"] = np.repeat(drifted_steps, np.diff(trace.step_offsets))
    model = StepLatencyModel(outlier_threshold=None).fit(trace)
    assert model.fit_info_["n_drifted_dropped"] == int((drifted_steps & ~trace.is_warmup_per_step).sum()) > 0
    assert not model.train_step_mask_[drifted_steps].any()


def metric_values(client, headers) -> dict:
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics", headers=headers).text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def with_fingerprint(groups, fingerprint_id_value: str):
    return [[{**row, "engine_fingerprint": fingerprint_id_value} for row in group] for group in groups]


@pytest.fixture
def fingerprinted_model_path(tmp_path):
    path = tmp_path / "model.json"
    StepLatencyModel().fit(fingerprinted_trace(SERVED, 2000)).to_json(path)
    return path


def test_the_service_holds_a_run_of_another_engine_pending_by_default(fingerprinted_model_path, db_url, keys):
    admin = bearer(keys["admin"])
    moved = with_fingerprint(make_steps("run-moved", 12, seed=1), replace(SERVED, threads=2).id)
    with TestClient(create_app(fingerprinted_model_path, db_url)) as client:
        same = with_fingerprint(make_steps("run-same", 10), SERVED.id)
        assert client.post("/v1/steps", content=columns_body(same), headers=admin).json()["steps_pending"] == 0
        assert client.post("/v1/steps", content=columns_body(moved), headers=admin).json()["steps_pending"] == 12
        values = metric_values(client, admin)
    assert values[("llmvisor_fingerprint_mismatch_steps_total", ())] == 0
    assert values[("llmvisor_pending_steps_total", ())] == 12


def test_the_service_warns_on_a_run_billed_by_the_fallback_model(fingerprinted_model_path, db_url, keys, caplog):
    admin = bearer(keys["admin"])
    other = replace(SERVED, threads=2)
    app = create_app(fingerprinted_model_path, db_url, fallback_model_path=fingerprinted_model_path)
    with TestClient(app) as client, caplog.at_level(logging.WARNING, "llmvisor.service"):
        same = with_fingerprint(make_steps("run-same", 10), SERVED.id)
        moved = with_fingerprint(make_steps("run-moved", 12, seed=1), other.id)
        assert client.post("/v1/steps", content=columns_body(same), headers=admin).status_code == 200
        assert client.post("/v1/steps", json={"steps": moved[:6]}, headers=admin).status_code == 200
        assert client.post("/v1/steps", content=columns_body(moved[6:]), headers=admin).status_code == 200
        plain = make_steps("run-plain", 5, seed=2)
        assert client.post("/v1/steps", json={"steps": plain}, headers=admin).status_code == 200
        values = metric_values(client, admin)
    assert values[("llmvisor_fingerprint_mismatch_steps_total", ())] == 12
    assert values[("llmvisor_fingerprint_mismatch_runs", ())] == 1
    assert values[("llmvisor_fingerprint_unknown_steps_total", ())] == 5
    warnings = [r.getMessage() for r in caplog.records if "ran on engine fingerprint" in r.getMessage()]
    assert len(warnings) == 1 and "run-moved" in warnings[0] and other.id in warnings[0] and SERVED.id in warnings[0]
    fallback = [r.getMessage() for r in caplog.records if "fallback model" in r.getMessage()]
    assert len(fallback) == 1 and other.id in fallback[0]


def test_the_fingerprint_is_not_part_of_the_idempotency_key(fingerprinted_model_path, db_url, keys):
    admin = bearer(keys["admin"])
    groups = make_steps("run-a", 8)
    with TestClient(create_app(fingerprinted_model_path, db_url)) as client:
        first = client.post("/v1/steps", content=columns_body(with_fingerprint(groups, SERVED.id)), headers=admin).json()
        again = client.post("/v1/steps", json={"steps": groups}, headers=admin).json()
    assert first["steps_inserted"] == 8 and again["steps_duplicate"] == 8 and again["steps_inserted"] == 0


def test_the_service_exports_each_runs_residual_quantiles(fingerprinted_model_path, db_url, keys):
    admin = bearer(keys["admin"])
    with TestClient(create_app(fingerprinted_model_path, db_url)) as client:
        groups = make_steps("run-q", 30)
        client.post("/v1/steps", json={"steps": groups}, headers=admin)
        values = metric_values(client, admin)
        stored = [client.get(f"/v1/steps/run-q/{s}", headers=admin).json() for s in range(30)]
    relative = [(s["measured_s"] - s["predicted_s"]) / s["measured_s"] for s in stored]
    for q in (0.1, 0.5, 0.9):
        exported = values[("llmvisor_run_relative_residual", (("quantile", repr(q)), ("run_id", "run-q")))]
        assert exported == pytest.approx(float(np.quantile(relative, q)), rel=1e-6)
    assert values[("llmvisor_run_relative_residual_window_steps", (("run_id", "run-q"),))] == 30


def test_residual_windows_keep_the_latest_runs_and_steps():
    windows = RunResidualWindows(max_runs=2, window_steps=3)
    windows.observe(np.array(["a", "a", "b"], dtype=object), np.array([0.1, 0.2, 0.3]))
    windows.observe(np.array(["c", "a", "a"], dtype=object), np.array([0.5, 0.9, np.nan]))
    assert windows.quantiles("b") == {}
    assert windows.quantiles("a")[0.5] == pytest.approx(0.2)
    assert windows.quantiles("c")[0.5] == pytest.approx(0.5)
    windows.observe(np.array(["a"] * 5, dtype=object), np.arange(5.0))
    assert windows.quantiles("a")[0.5] == pytest.approx(3.0)


@pytest.mark.vllm
def test_fair_scheduler_warns_on_a_model_of_another_engine(caplog):
    fair = pytest.importorskip("llmvisor.engines.vllm.fair")
    model = StepLatencyModel().fit(fingerprinted_trace(SERVED, 600))
    logging.getLogger("llmvisor").propagate = True
    with caplog.at_level(logging.WARNING):
        assert fair.check_model_fingerprint(model, SERVED) is True
        assert REGISTRY.get_sample_value("llmvisor_fair_model_fingerprint_mismatch") == 0
        assert fair.check_model_fingerprint(model, replace(SERVED, max_num_seqs=32)) is False
    assert REGISTRY.get_sample_value("llmvisor_fair_model_fingerprint_mismatch") == 1
    assert any("max_num_seqs 32 vs 128" in record.getMessage() for record in caplog.records)
    assert fair.check_model_fingerprint(None, SERVED) is None


def torch_capability_for(flags) -> str:
    """The level torch dispatches its x86 CPU kernels at on a CPU with these flags, unless ``ATEN_CPU_CAPABILITY``
    caps it (aten's ``compute_cpu_capability``: AVX512 needs avx512f, avx512bw, avx512vl, avx512dq and fma; AVX2 needs
    avx2 and fma)."""
    flags = set(flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


@pytest.mark.vllm
def test_the_cpu_facts_are_what_torch_and_vllm_decide_on_this_machine():
    """The fingerprint's CPU capability is the level torch runs at: on x86 the one this CPU's flags give (read from
    /proc/cpuinfo, not from torch), and the capped one when ``ATEN_CPU_CAPABILITY`` caps torch (the flags then say
    more than the kernels that run)."""
    pytest.importorskip("vllm")
    import torch

    import llmvisor
    from llmvisor.engines.vllm.fingerprint import cpu_capability, gemm_backend

    flags = read_cpuinfo().flags
    if platform.machine() in ("x86_64", "AMD64") and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert cpu_capability() == torch_capability_for(flags)
    probe = "from llmvisor.engines.vllm.fingerprint import cpu_capability; print('capability=' + cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(Path(llmvisor.__file__).resolve().parents[1])}
    capped = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert re.findall(r"capability=(\w*)", capped.stdout) == ["DEFAULT"], capped.stdout[-2000:] + capped.stderr[-2000:]
    assert gemm_backend(torch.float32) in ("onednn", "zentorch")
    if not {"avx512_fp16", "amx_fp16"} & set(flags):  # oneDNN has no float16 matmul here: vLLM falls back to torch
        assert gemm_backend(torch.float16) == "torch"
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert gemm_backend(torch.bfloat16) == "onednn"


@pytest.mark.vllm
def test_fair_scheduler_warns_that_the_shipped_model_is_of_an_older_fingerprint_format(caplog):
    """The shipped model (format-1 fingerprint) against an engine fingerprinted today: a mismatch, named as
    the older format, and the scheduler keeps charging with it (warned), as with any model of another engine."""
    fair = pytest.importorskip("llmvisor.engines.vllm.fair")
    shipped_model = StepLatencyModel.from_json(shipped.latency_model_path())
    old = EngineFingerprint.from_dict(shipped_model.engine_fingerprint_)
    today = replace(old, fingerprint_format=2, cpu_flags=read_cpuinfo(CPUINFO / "amd-epyc-avx512.txt").flags,
                    cpu_capability="AVX512", gemm_backend="onednn")
    logging.getLogger("llmvisor").propagate = True
    with caplog.at_level(logging.WARNING):
        assert fair.check_model_fingerprint(shipped_model, today) is False
    assert REGISTRY.get_sample_value("llmvisor_fair_model_fingerprint_mismatch") == 1
    assert any("fingerprint_format 2 vs 1" in record.getMessage() for record in caplog.records)
