"""How fast `llmvisor validate` measures coalition steps, warm (the default) against the earlier cold method, in one run.

One in-process vLLM engine (the shipped engine model, the coalitions journal's settings) measures the same small
coalitions plan (serving-size decode and mixed-sharing decode batches, random complementary coalitions, a quarter
measured again in round 1) with each method, batch by batch, alternating which goes first (so that both see the
same spells of load from other jobs):

- cold: `ControlledEngine(warm=False)`: fresh prompts; each batch-round (chunk of 32 coalitions) prepares the batch
  again (its whole blocks found in the prefix cache, the rest recomputed), and every run of a request grows its context
  by one token;
- warm: each decode step rewound to the planned contexts, so a batch is prepared once for all its batch-rounds; own
  contexts are prefixes of the session's per-rank sequences, prefix groups' prefixes and longest readers of its
  per-group-rank ones (a later batch finds what an earlier one computed).

Both start each repeat with prompts nothing in the prefix cache holds, use the same interference guard, and time the
whole measuring calls (preparation, canaries, the loop; not the engine start, given separately). The engine work each
method spent outside its measured steps (prefill tokens computed to prepare contexts, canaries left out) does not
depend on the machine's load.
The machine is shared, so the figures are indicative; the ratios within one run are what count. Also written: whether
the two methods measure the same steps, as the relative difference of the same coalition's step time between them
against the difference between two measurements by one method (another repeat, or the plan's round-1 replicate).

    python scripts/measure-validation-speed.py [-o docs/results/validation-speed.json] [--repeats 2] [--batches 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.validation.measurement import InterferenceGuard, Journal, measure_sampled
from llmvisor.validation.plans import Envelope, SampledKind, draw_coalition_batches, read_length_mixes

REPO = Path(__file__).resolve().parents[1]
PREVIOUS_STEPS_PER_S = 4.5
"""The shipped coalitions journal's throughput (`summary.measurement_cost` of validation-coalitions.json), cold."""
METHODS = ("cold", "warm")


CANARY_TOKENS = 128
"""The guard's canary: a 128-token prefill (`ControlledEngine.canary_step`)."""


def engine_work(trace: Path, offset: int) -> dict:
    """Engine steps the recorder wrote after ``offset`` and the prefill tokens they computed (measured decode steps
    compute none: what is counted is preparation and canaries)."""
    with open(trace, "rb") as handle:
        handle.seek(offset)
        rows = [json.loads(line) for line in handle.read().splitlines() if line.strip()]
    return {"engine_steps": len({r["step_id"] for r in rows}),
            "prefill_tokens": int(sum(r["num_new_tokens"] for r in rows if r["phase"] == "prefill"))}


def machine_notes() -> dict:
    from llmvisor.engines.vllm.recorder import describe_hardware

    flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace") if Path("/proc/cpuinfo").exists() else ""
    return {"hardware": describe_hardware(), "cpus": os.cpu_count(), "avx512": "avx512" in flags, "python": platform.python_version(),
            "shared": "a 2-core machine shared with other jobs while measured: load averages below; figures indicative, "
                      "ratios within the run are what count"}


def relative_differences(a: dict, b: dict) -> np.ndarray:
    """(b − a) / a over the coalitions both hold."""
    common = sorted(set(a) & set(b))
    return np.array([b[k] / a[k] - 1 for k in common])


def spread(values: np.ndarray) -> dict:
    x = np.abs(values)
    return {"n": int(x.size), "abs_p50": float(np.percentile(x, 50)) if x.size else None,
            "abs_p90": float(np.percentile(x, 90)) if x.size else None, "median": float(np.median(values)) if x.size else None}


def median_ci95(values: np.ndarray, seed: int = 0) -> list[float]:
    """Bootstrap 95% interval of the median (a shift between methods; the mean of ratios is ruled by a few spikes)."""
    rng = np.random.default_rng(seed)
    medians = [np.median(values[rng.integers(0, values.size, values.size)]) for _ in range(2000)]
    return [float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))]


def step_times(journal: Journal, round_: int, plan: list | None = None) -> dict:
    """(batch key, coalition) → step time; with ``plan``, divided by the median step time of the coalition's batch-round
    (its chunk of coalitions, the same in both methods): what is left is the coalition's cost relative to its chunk's,
    free of the machine's load level while that chunk ran (on a shared machine it moved several-fold over a run)."""
    raw = {(k[0], k[2]): ms[0].step_latency_s for k, ms in journal.measurements.items() if k[1] == round_ and ms}
    if plan is None:
        return raw
    out = {}
    for batch in plan:
        for chunk in batch.chunks(round_):
            times = {s: raw[(batch.key, s)] for s in chunk if (batch.key, s) in raw}
            if len(times) >= 4:
                level = float(np.median(list(times.values())))
                out.update({(batch.key, s): t / level for s, t in times.items()})
    return out


def contexts_grew(journal: Journal, plan: list) -> dict:
    """How far recorded contexts lay above the planned ones (tokens): cold grows them, warm must not."""
    planned = {b.key: b.num_context_tokens for b in plan}
    growth = [got - planned[m.batch_key][i] for ms in journal.measurements.values() for m in ms
              for i, got in zip([j for j in range(len(planned[m.batch_key])) if m.subset >> j & 1], m.num_context_tokens)]
    return {"max": int(max(growth)), "mean": float(np.mean(growth))}


def command_line(argv: list[str]) -> str:
    """The command as run, its arguments quoted (a result made with flags says so; the bare command is the defaults)."""
    return " ".join(["python scripts/measure-validation-speed.py", *map(shlex.quote, argv)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=REPO / "docs" / "results" / "validation-speed.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, default=2, help="serving-size batches in the plan (kinds and sizes cycle)")
    parser.add_argument("--sizes", default="16,32")
    parser.add_argument("--coalitions-per-request", type=float, default=20.0, help="as the sharing run (default 20)")
    parser.add_argument("--engine-model", type=Path, default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guard-max-redos", type=int, default=0,
                        help="redos of a batch-round the guard flags (0: canaries run and flag, nothing is redone, so that "
                             "interference from other jobs does not decide which method waits longer)")
    args = parser.parse_args()

    from llmvisor.engines.vllm.controlled import ControlledEngine

    sizes = tuple(int(s) for s in args.sizes.split(","))
    envelope = Envelope(args.max_model_len, args.max_num_batched_tokens, args.max_num_seqs)
    mixes = read_length_mixes(shipped.workloads_dir())
    kinds = (SampledKind.DECODE.value, SampledKind.MIXED_SHARING_DECODE.value)
    plan = draw_coalition_batches(mixes, envelope, n_batches=args.batches, coalitions_per_request=args.coalitions_per_request,
                                  sizes=sizes, kinds=kinds, replicate_share=0.25, chunk=32, seed=args.seed)
    n_plan_steps = sum(len(b.subsets(r)) for b in plan for r in range(b.rounds))
    engine_dir = args.engine_model or shipped.engine_model_dir()
    runs: list[dict] = []
    times: dict[tuple[str, int], dict] = {}
    replicate: dict[str, list[np.ndarray]] = {m: [] for m in METHODS}
    normalised: dict[tuple[str, int], dict] = {}
    replicate_normalised: dict[str, list[np.ndarray]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="llmvisor-speed-") as tmp:
        started = time.perf_counter()
        trace = Path(tmp) / "steps.jsonl"
        engine = ControlledEngine(engine_dir, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib, seed=args.seed, run_id="validation-speed",
                                  trace_path=trace)
        with engine:
            engine_start_s = time.perf_counter() - started
            facts = {k: v for k, v in engine.describe().items() if k != "decode_contexts"}
            engine.warm_up(prefill_lengths=[64, 64], decode_contexts=[256, 512], n_steps=3)
            for rep in range(args.repeats):
                engine.new_session_prompts()
                journals = {m: Journal(Path(tmp) / f"{m}-{rep}.jsonl") for m in METHODS}
                guards = {m: InterferenceGuard(max_redos=args.guard_max_redos, max_wait_s=60.0) for m in METHODS}
                tally = {m: {"wall_s": 0.0, "preparations": 0, "discarded": 0, "flagged": 0, "rejected": 0, "loads": [],
                             "prefill_tokens": 0, "engine_steps": 0} for m in METHODS}
                for k, batch in enumerate(plan):
                    # batch by batch, alternating which method goes first, so both see the same spells of load
                    for method in METHODS if (rep + k) % 2 == 0 else METHODS[::-1]:
                        engine.warm = method == "warm"
                        t = tally[method]
                        t["loads"].append(os.getloadavg()[0])
                        offset = trace.stat().st_size if trace.exists() else 0
                        t0 = time.perf_counter()
                        counts = measure_sampled(engine, [batch], journals[method], repeat=1, seed=args.seed, guard=guards[method])
                        t["wall_s"] += time.perf_counter() - t0
                        work = engine_work(trace, offset)
                        t["prefill_tokens"] += work["prefill_tokens"]
                        t["engine_steps"] += work["engine_steps"]
                        t["preparations"] += counts.get("preparations", 0)
                        t["discarded"] += counts.get("discarded_batch_rounds", 0)
                        t["flagged"] += counts.get("flagged_batch_rounds", 0)
                        t["rejected"] += counts.get("rejected_now", 0)
                        t["loads"].append(os.getloadavg()[0])
                for method in METHODS:
                    journal, guard, t = journals[method], guards[method], tally[method]
                    n_steps = sum(len(ms) for ms in journal.measurements.values())
                    rounds = journal.round_timing
                    wall_s = t["wall_s"]
                    runs.append({
                        "method": method, "repeat": rep, "measured_steps": n_steps, "wall_s": round(wall_s, 2),
                        "steps_per_s": n_steps / wall_s,
                        "steps_per_s_with_engine_start": n_steps / (wall_s + engine_start_s),
                        "step_time_s": round(sum(m.step_latency_s for ms in journal.measurements.values() for m in ms), 3),
                        "prepare_s": round(sum(r.get("prepare_s", 0.0) for r in rounds), 3),
                        "rounds_wall_s": round(sum(r.get("round_wall_s", 0.0) for r in rounds), 3),
                        "guard_wait_s": round(sum(r.get("wait_after_s", 0.0) for r in rounds), 3),
                        "canaries": len(guard.all_s), "canary_time_s": round(sum(guard.all_s), 3),
                        "preparations": t["preparations"], "discarded_batch_rounds": t["discarded"], "flagged_batch_rounds": t["flagged"],
                        "rejected_steps": t["rejected"],
                        "engine_steps": t["engine_steps"],
                        "prefill_tokens_outside_measured_steps": t["prefill_tokens"] - CANARY_TOKENS * len(guard.all_s),
                        "context_growth_tokens": contexts_grew(journal, plan),
                        "load_average_1min_min_max": [round(min(t["loads"]), 2), round(max(t["loads"]), 2)],
                    })
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                    times[(method, rep)] = step_times(journal, 0)
                    normalised[(method, rep)] = step_times(journal, 0, plan)
                    replicate[method].append(relative_differences(step_times(journal, 0), step_times(journal, 1)))
                    replicate_normalised[method].append(relative_differences(step_times(journal, 0, plan), step_times(journal, 1, plan)))

    ratios = []
    for rep in range(args.repeats):
        by = {r["method"]: r for r in runs if r["repeat"] == rep}
        ratios.append(by["warm"]["steps_per_s"] / by["cold"]["steps_per_s"])
    steps_per_s = {m: float(np.median([r["steps_per_s"] for r in runs if r["method"] == m])) for m in METHODS}
    def compare(t: dict, rep_diffs: dict) -> dict:
        warm_vs_cold = np.concatenate([relative_differences(t[("cold", r)], t[("warm", r)]) for r in range(args.repeats)])
        same = {m: np.concatenate([relative_differences(t[(m, r)], t[(m, r + 1)]) for r in range(args.repeats - 1)])
                for m in METHODS} if args.repeats > 1 else {}
        floor = np.concatenate([*rep_diffs["cold"], *rep_diffs["warm"], *same.values()])
        out = {"warm_vs_cold": {**spread(warm_vs_cold), "median_ci95": median_ci95(warm_vs_cold)},
               "same_method_other_repeat": {m: spread(v) for m, v in same.items()},
               "replicate_round": {m: spread(np.concatenate(v)) for m, v in rep_diffs.items()},
               "noise_floor": spread(floor)}
        out["within_noise_floor"] = bool(out["warm_vs_cold"]["abs_p50"] <= 1.25 * out["noise_floor"]["abs_p50"]
                                         and out["warm_vs_cold"]["abs_p90"] <= 1.25 * out["noise_floor"]["abs_p90"])
        return out

    result = {
        "command": command_line(sys.argv[1:]),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_notes(),
        "engine": {**facts, "engine_start_s": round(engine_start_s, 1)},
        "plan": {"design": "coalitions", "kinds": list(kinds), "sizes": list(sizes), "batches": len(plan),
                 "batch_sizes": [b.size for b in plan], "coalitions_per_request": args.coalitions_per_request, "replicate_share": 0.25,
                 "chunk": 32, "seed": args.seed, "steps_per_method_and_repeat": n_plan_steps, "guard_max_redos": args.guard_max_redos,
                 "contexts_tokens": [int(sum(b.num_context_tokens)) for b in plan]},
        "repeats": args.repeats,
        "runs": runs,
        "steps_spent": {m: int(sum(r["measured_steps"] for r in runs if r["method"] == m)) for m in METHODS},
        "steps_per_s": steps_per_s,
        "ratio_warm_over_cold": {"per_repeat": ratios, "median": float(np.median(ratios)), "min": float(min(ratios)), "max": float(max(ratios))},
        "preparation_prefill_tokens": {m: int(sum(r["prefill_tokens_outside_measured_steps"] for r in runs if r["method"] == m))
                                       for m in METHODS},
        "previous_steps_per_s": PREVIOUS_STEPS_PER_S,
        "warm_over_previous": steps_per_s["warm"] / PREVIOUS_STEPS_PER_S,
        "equivalence": {
            "what": "relative difference of one coalition's step time (round 0) between methods, against the difference "
                    "between two measurements by one method (another repeat, or the plan's round-1 replicate); 'within_noise_floor': "
                    "warm against cold no more than 1.25× the noise floor at p50 and p90",
            "relative_to_chunk": {"what": "each step time divided by the median of its batch-round (chunk of coalitions), "
                                          "which takes out the machine's load level while the chunk ran",
                                  **compare(normalised, replicate_normalised)},
            "raw": compare(times, replicate),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.output}: cold {steps_per_s['cold']:.2f} steps/s, warm {steps_per_s['warm']:.2f} steps/s, "
          f"ratio {np.median(ratios):.2f}× [{min(ratios):.2f}, {max(ratios):.2f}]", file=sys.stderr)


if __name__ == "__main__":
    main()
