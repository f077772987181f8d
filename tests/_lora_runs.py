"""LoRA runs for the product tests (issue #38 item 6): synthetic steps with adapters (trace format 4) as the recorder
relays them (`llmvisor.core.relayed`: the LoRA columns in the step's named element), a LoRA model of known
coefficients, and the same steps as trace rows (`step_rows`, what the delivery process pushes and writes)."""

from __future__ import annotations

import numpy as np

from llmvisor.core.features import FEATURE_NAMES_LORA
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.relayed import NAMED_INDEX, step_rows
from llmvisor.core.synthetic import DEFAULT_COEF_S, DEFAULT_LORA_COEF_S, synthetic_trace
from llmvisor.core.trace_schema import LORA_SLICE_COLUMNS, LORA_STEP_COLUMNS

RANKS = {"adapter-r8": 8, "adapter-r64": 64}
LORA_COEF_S = {**DEFAULT_COEF_S, **DEFAULT_LORA_COEF_S, "prefill_lora_tokens": 2e-6, "decode_lora_tokens": 5e-5, "lora_steps": 1e-3,
               "lora_base_tokens": 1e-5}
"""The LoRA model's coefficients: every LoRA term nonzero, so none can hide."""


def lora_model(engine_class: str | None = None) -> StepLatencyModel:
    model = StepLatencyModel.from_coefficients([{name: LORA_COEF_S.get(name, 0.0) for name in FEATURE_NAMES_LORA}])
    if engine_class is not None:
        model.engine_fingerprint_ = {"id": engine_class}
    return model


def header_of(run_id: str, engine_class: str | None) -> dict:
    return {"columns": {"run_id": run_id, "engine_fingerprint": engine_class}, "warmup_steps": 0}


def relayed_lora_run(run_id: str, n_steps: int = 80, *, t0_s: float, seed: int = 0, step_interval_s: float = 0.27,
                     lora_ranks: dict[str, int] | None = RANKS, n_tenants: int = 3) -> list[list]:
    """Relayed steps ``[step_id, timestamp_s, latency_s, slices, None, named]`` of a synthetic run with adapters (the
    named element holding the LoRA columns); request ids unique to the run."""
    trace = synthetic_trace(n_steps, max_batch_size=8, lora_ranks=lora_ranks, lora_load_probability=0.3, n_tenants=n_tenants,
                            seed=seed, run_id=run_id)
    out = []
    for k in range(trace.n_steps):
        s = slice(int(trace.step_offsets[k]), int(trace.step_offsets[k + 1]))
        slices = [[f"{run_id}-{r}", str(t), int(p), int(c), bool(f), 0, float(c)]
                  for r, t, p, c, f in zip(trace.request_id[s], trace.tenant[s], trace.num_new_tokens[s],
                                           trace.num_context_tokens[s], trace.is_prefill[s])]
        step = [k, round(t0_s + k * step_interval_s, 6), float(trace.step_latency_s_per_step[k]), slices]
        if lora_ranks:
            step += [None, {"slice": {name: [v.item() if isinstance(v, np.generic) else v for v in trace.extra[name][s]]
                                      for name in LORA_SLICE_COLUMNS},
                            "step": {name: str(trace.extra[name][s][0]) for name in LORA_STEP_COLUMNS}}]
        out.append(step)
    return out


def without_adapters(steps: list[list]) -> list[list]:
    """The same steps with no LoRA columns: what an adapter-blind recorder relays."""
    return [step[:4] for step in steps]


def as_rows(steps: list[list], run_id: str, engine_class: str | None) -> list[list[dict]]:
    """The steps as POST /v1/steps row groups; ``engine_class`` None: rows without a fingerprint (the service's
    default model prices them)."""
    header = header_of(run_id, engine_class)
    if engine_class is None:
        del header["columns"]["engine_fingerprint"]
    return [[{k: v for k, v in row.items() if k != "is_warmup"} for row in step_rows(header, step)] for step in steps]


def adapter_of_slices(steps: list[list]) -> dict[str, str]:
    """Each request's adapter ('' the base model), from the relayed steps."""
    out = {}
    for step in steps:
        names = step[NAMED_INDEX]["slice"]["lora_name"] if len(step) > NAMED_INDEX and step[NAMED_INDEX] else [""] * len(step[3])
        for s, name in zip(step[3], names):
            out[s[0]] = name
    return out
