"""What a second reader of a shared KV block costs, measured warm and cold on the same batches in one run.

The two shipped sharing journals price a shared read 3x apart: fitted on each journal's own steps, a second reader of a
block saves 70-82% of a decode context token's price in the coalitions journal (measured cold) and 21-25% in the
sharing run (measured warm, pairs layout; docs/results/ground-truth.json, ``*_pricing``). This measures one pairs-layout
plan (each document read by a short and a long reader, beside requests of their own context) with both methods on one
in-process vLLM engine, batch by batch, alternating which method goes first (as scripts/measure-validation-speed.py
does), and fits each method's steps with llmvisor's fit (`StepLatencyModel`, its defaults): the saving e / (d2 + e)
per method, with a 95% interval from resampling whole batches (request sets). A difference says the measuring method
changes the game of a shared read; no difference says the two journals' engines differ for another reason (layout,
``--max-num-seqs``).

    python scripts/measure-shared-read.py [-o docs/results/shared-read.json] [--batches 12] [--coalitions-per-request 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.coalitions import coalition_steps, coalition_steps_trace, shared_read_saving
from llmvisor.validation.measurement import InterferenceGuard, Journal, measure_sampled
from llmvisor.validation.plans import Envelope, SampledKind, draw_coalition_batches, read_length_mixes

REPO = Path(__file__).resolve().parents[1]
METHODS = ("cold", "warm")


def _speed_script():
    """scripts/measure-validation-speed.py, for its machine notes (one copy of them)."""
    spec = importlib.util.spec_from_file_location("measure_validation_speed", REPO / "scripts" / "measure-validation-speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saving_with_interval(trace, *, n_bootstrap: int, seed: int) -> dict:
    """The fit's shared-read saving on every step, and a 95% interval from refitting on request sets drawn with
    replacement (a batch's steps stay together)."""
    model = StepLatencyModel().fit(trace)
    runs = trace.run_id_per_step
    names = sorted(set(runs.tolist()))
    steps_of = {name: np.flatnonzero(runs == name) for name in names}
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_bootstrap):
        chosen = rng.choice(len(names), len(names))
        draws.append(shared_read_saving(StepLatencyModel().fit(trace.take_steps(np.concatenate([steps_of[names[i]] for i in chosen]))))[0])
    coef = model.to_dict()["segments"]
    return {"shared_read_saving": shared_read_saving(model), "boundary_new_tokens": model.to_dict()["boundary_new_tokens"],
            "segments_coef_s": [{k: v for k, v in s["coef_s"].items() if v} for s in coef],
            "bootstrap_first_segment_ci95": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))] if draws else None,
            "n_steps": trace.n_steps, "n_request_sets": len(names)}


def draw_plan(*, batches: int, sizes: tuple[int, ...], coalitions_per_request: float, max_num_seqs: int, seed: int) -> list:
    """The pairs-layout mixed-sharing plan this measures (drawn again from a result's ``plan`` to re-analyse it)."""
    return draw_coalition_batches(read_length_mixes(shipped.workloads_dir()), Envelope(4096, 2048, max_num_seqs), n_batches=batches,
                                  coalitions_per_request=coalitions_per_request, sizes=sizes,
                                  kinds=(SampledKind.MIXED_SHARING_DECODE.value,), sharing_layout="pairs", replicate_share=0.25,
                                  chunk=32, seed=seed)


def offsets_fit(plan, journal, indices, *, n_bootstrap: int, seed: int) -> dict:
    """The same saving from the steps with an intercept per batch-round (chunk of coalitions measured together), so
    that the machine's load drifting between batch-rounds (another job's spells) is not read as the price of context:
    step time = chunk offset + d4·requests + d2·Σ context + e·Σ effective context, NNLS with weights 1/time (noise
    relative to the step); interval over request sets drawn with replacement."""
    from scipy.optimize import nnls

    rows: dict[int, list] = {}  # request set → (chunk label, requests, context tokens, effective context tokens, step time)
    for c in coalition_steps(plan, journal, indices, disturbed=True):
        rows.setdefault(c.batch.index, []).append((f"{c.batch.index}/{c.batch_round}", c.members.size, c.context.sum(), c.effective.sum(),
                                                   c.measurement.step_latency_s))

    def saving(chosen: list[int]) -> tuple[float, list[float]]:
        picked = [r for i in chosen for r in rows[i]]
        labels = sorted({r[0] for r in picked})
        column = {label: j for j, label in enumerate(labels)}
        x = np.zeros((len(picked), len(labels) + 3))
        for row, r in enumerate(picked):
            x[row, column[r[0]]] = 1.0
            x[row, len(labels):] = r[1:4]
        y = np.array([r[4] for r in picked])
        coef, _ = nnls(x / y[:, None], np.ones(y.size))
        d4, d2, e = coef[len(labels):]
        return (e / (d2 + e) if d2 + e > 0 else 0.0), [float(d4), float(d2), float(e)]

    sets = sorted(rows)
    point, terms = saving(sets)
    rng = np.random.default_rng(seed)
    draws = [saving([sets[i] for i in rng.choice(len(sets), len(sets))])[0] for _ in range(n_bootstrap)]
    return {"shared_read_saving": float(point), "decode_requests_s": terms[0], "decode_context_tokens_s": terms[1],
            "effective_context_tokens_s": terms[2], "n_steps": sum(map(len, rows.values())),
            "ci95": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))] if draws else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=REPO / "docs" / "results" / "shared-read.json")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--sizes", default="16")
    parser.add_argument("--coalitions-per-request", type=float, default=8.0)
    parser.add_argument("--engine-model", type=Path, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=int, default=6)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--bootstrap", type=int, default=200)
    args = parser.parse_args()

    from llmvisor.engines.vllm.controlled import ControlledEngine

    envelope = Envelope(4096, 2048, args.max_num_seqs)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    plan = draw_plan(batches=args.batches, sizes=sizes, coalitions_per_request=args.coalitions_per_request,
                     max_num_seqs=args.max_num_seqs, seed=args.seed)
    loads = []
    wall = dict.fromkeys(METHODS, 0.0)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    stem = args.output.name.removesuffix(".json")
    # kept beside the result, so a later analysis (chunk offsets against the machine's drift, say) needs no new run
    journals = {m: Journal(args.output.with_name(f"{stem}.{m}.journal.jsonl")) for m in METHODS}
    for journal in journals.values():
        if journal.measurements:
            raise SystemExit(f"{journal.path} already holds measurements: choose another --output")
    # the guard flags but redoes nothing and does not wait (as measure-validation-speed.py): both methods see the same
    # spells of load batch by batch, and the fit keeps every step, so load adds noise to both and favours neither
    guards = {m: InterferenceGuard(max_redos=0, max_wait_s=60.0) for m in METHODS}
    started = time.perf_counter()
    with ControlledEngine(args.engine_model or shipped.engine_model_dir(), max_model_len=envelope.max_model_len,
                          max_num_batched_tokens=envelope.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          kv_cache_gib=args.kv_cache_gib, seed=args.seed, run_id="shared-read") as engine:
        facts = {k: v for k, v in engine.describe().items() if k != "decode_contexts"}
        engine.warm_up(prefill_lengths=[64, 64], decode_contexts=[256, 512], n_steps=3)
        for k, batch in enumerate(plan):
            for method in METHODS if k % 2 == 0 else METHODS[::-1]:
                engine.warm = method == "warm"
                loads.append(os.getloadavg()[0])
                t0 = time.perf_counter()
                measure_sampled(engine, [batch], journals[method], repeat=1, seed=args.seed, guard=guards[method])
                wall[method] += time.perf_counter() - t0
            print(f"batch {k + 1}/{len(plan)} measured both ways ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    indices = {b.index for b in plan}
    fits = {m: saving_with_interval(coalition_steps_trace(plan, journals[m], indices, disturbed=True), n_bootstrap=args.bootstrap, seed=args.seed)
            for m in METHODS}
    for m in METHODS:
        fits[m]["with_chunk_offsets"] = offsets_fit(plan, journals[m], indices, n_bootstrap=args.bootstrap, seed=args.seed)
        fits[m].update(wall_s=round(wall[m], 1), measurements_flagged_by_guard=sum(x.interference for ms in journals[m].measurements.values() for x in ms))
    result = {
        "command": "python scripts/measure-shared-read.py",
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _speed_script().machine_notes(),
        "engine": facts,
        "plan": {"design": "coalitions", "kinds": [SampledKind.MIXED_SHARING_DECODE.value], "sharing_layout": "pairs", "sizes": list(sizes),
                 "batches": len(plan), "coalitions_per_request": args.coalitions_per_request, "seed": args.seed,
                 "shared_prefix_tokens": sorted({int(t) for b in plan for t in b.shared_prefix_tokens if t})},
        "load_average_1min_min_max": [round(min(loads), 2), round(max(loads), 2)],
        "what": "shared_read_saving: per segment of llmvisor's fit on each method's steps, e / (d2 + e), the share of a decode "
                "context token's price a second reader of its KV block does not pay; interval: 95% over request sets drawn "
                "with replacement",
        "methods": fits,
        "journals": {m: journals[m].path.name for m in METHODS},
    }
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.output}: " + "; ".join(f"{m} saving {fits[m]['shared_read_saving']} {fits[m]['bootstrap_first_segment_ci95']}, "
                                            f"with chunk offsets {fits[m]['with_chunk_offsets']['shared_read_saving']:.3f} "
                                            f"{fits[m]['with_chunk_offsets']['ci95']}" for m in METHODS), file=sys.stderr)


if __name__ == "__main__":
    main()
