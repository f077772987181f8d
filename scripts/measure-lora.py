"""Does the LoRA-aware latency model beat the adapter-blind one on a real engine (issue #38 item 5, first "Done when")?

Profiles a real vLLM engine (CPU build, in this process's venv) with `llmvisor profile --plan lora` once per seed:
adapters written locally (ranks 8, 16, 64, 8 by default), base-model requests mixed in, half as many LoRA slots as
adapters (forced swaps). The runs of ``--train-seeds`` are fitted, the runs of ``--test-seeds`` judged: held out by
run, with the project's held-out evaluation (`llmvisor.evaluation.heldout.evaluate`, what ``llmvisor eval`` runs):

- ``llmvisor``: the latency model with its LoRA terms, the per-token work form chosen by its own cross-validation;
- ``adapter_blind``: the same model, features and rules without the LoRA terms (`AdapterBlindModel`);
- ``token_count``: VTC's token count, a line per phase.

|relative error| p50/p90/p99 with block-bootstrap 95% intervals, per phase (prefill: a step with any prefill slice;
decode), on the test steps that ran an adapter and on all test steps. Verdict per phase at p90 on adapter steps:
"beats" when the LoRA-aware p90 is lower and the two 95% intervals do not overlap, "within CI" when they overlap,
"worse" when it is higher and they do not. The machine's load average is sampled before and after each run and
recorded, with a caveat when it exceeded the core count. Writes a JSON figure file (default docs/results/lora.json).

    python scripts/measure-lora.py [-o docs/results/lora.json] [--engine-model DIR] [--points 24] [--work DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llmvisor.core.features import FEATURE_NAMES_LORA, LORA_FEATURE_NAMES, LoraCoef, step_feature_matrix, step_new_tokens
from llmvisor.core.model import group_k_fold, time_block_groups
from llmvisor.core.trace import read_traces
from llmvisor.evaluation.heldout import evaluate, lora_groups, steady_steps
from llmvisor.profile.drift import canary_run_per_step

MODELS = ("llmvisor", "adapter_blind", "token_count")
GROUPS = ("adapter", "all")
PHASES = ("prefill", "decode", "all")
VERDICT_RULE = ("at p90 on the test steps that ran an adapter: 'beats' when the LoRA-aware model's p90 is lower and the "
                "two 95% bootstrap intervals do not overlap, 'within CI' when they overlap, 'worse' when it is higher and "
                "they do not")
REPO = Path(__file__).resolve().parent.parent
QUARTER_SHAPE = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "float32"}
"""``--engine-shape quarter`` (the default): the shipped engine model (8 layers, 1024 wide, bf16) at a quarter of its
width, 2 layers, as the test suite's engine (its config says float32; vLLM casts that to bf16 on x86 CPUs unless
``--dtype float32`` is given, so it runs in bf16: the JSON's ``engine.dtype``). Chosen by measuring on the shared 2-core machine: the shipped
shape's LoRA profile ran about a minute per episode (14 minutes estimated for one run of 12 episodes, at a load average
of 10 to 18), too slow for several runs in 15 minutes; the tests' tiny Llama (2 layers, 128 wide) ran fast but its
steps of a few milliseconds are mostly Python overhead and scheduling jitter; this shape, one engine thread, runs a
run of 16 to 20 episodes in 2 to 4 minutes with steps of 10 to 100 ms, and its LoRA terms (tens of microseconds per
adapter token, milliseconds per load) are of the size of its per-token base terms."""


def engine_model_dir(shape: str, work: Path) -> Path | None:
    """The engine model folder of ``shape`` (None: the shipped engine model, the profile's default)."""
    if shape == "shipped":
        return None
    from llmvisor import shipped

    config = json.loads((shipped.engine_model_dir() / "config.json").read_text(encoding="utf-8"))
    folder = work / "engine-model-quarter"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, **QUARTER_SHAPE}), encoding="utf-8")
    return folder


def profile_command(args, seed: int, output: Path) -> list[str]:
    command = [
        "profile", "--plan", "lora", "-o", str(output), "--run-id", f"lora-seed{seed}", "--seed", str(seed),
        "--points", str(args.points), "--max-decode-steps", str(args.max_decode_steps),
        "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs), "--lora-ranks", args.lora_ranks, "--lora-modules", args.lora_modules,
        "--kv-cache-gib", "1", "--threads", str(args.threads), "--canary-every", str(args.canary_every), "--json",
    ]  # fmt: skip
    if args.engine_model_dir:
        command += ["--engine-model", str(args.engine_model_dir)]
    return command


def portable_args(argv: list[str]) -> list[str]:
    """The script's arguments with each path of this machine (an absolute path) written as its option's placeholder
    (``--work /tmp/x`` as ``--work WORK``): the command stays one that runs (``--analyse-only`` needs its ``--work``)
    and names no machine's folder."""
    out: list[str] = []
    for arg in argv:
        if os.path.isabs(arg):
            option = out[-1] if out and out[-1].startswith("-") else ""
            out.append("OUTPUT" if option == "-o" else option.lstrip("-").replace("-", "_").upper() or "PATH")
            continue
        out.append(shlex.quote(arg))
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def metrics(summary: dict) -> dict:
    keep = ("n_steps", "rel_err_p50", "rel_err_p50_ci95", "rel_err_p90", "rel_err_p90_ci95", "rel_err_p99", "rel_err_p99_ci95",
            "signed_err_p50", "mean_measured_s")
    return {k: summary[k] for k in keep if k in summary}


def verdict(ours: dict, theirs: dict) -> str | None:
    """`VERDICT_RULE` on two error summaries of the same steps."""
    if not ours.get("rel_err_p90_ci95") or not theirs.get("rel_err_p90_ci95"):
        return None
    (low, high), (their_low, their_high) = ours["rel_err_p90_ci95"], theirs["rel_err_p90_ci95"]
    if high < their_low:
        return "beats"
    if low > their_high:
        return "worse"
    return "within CI"


def percent(metrics: dict, key: str) -> str:
    ci = metrics.get(f"{key}_ci95")
    return f"{100 * metrics[key]:.1f}%" + (f" [{100 * ci[0]:.1f}%, {100 * ci[1]:.1f}%]" if ci else "")


def markdown_table(result: dict) -> str:
    """The figures as the docs show them: a row per group of steps, phase and model."""
    lines = ["| steps | phase | model | steps judged | p50 [95% CI] | p90 [95% CI] | p99 [95% CI] |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for group, label in (("adapter", "with an adapter"), ("all", "all")):
        for phase in PHASES:
            for name in MODELS:
                m = result["figures"][group][name][phase]
                if not m.get("n_steps"):
                    continue
                lines.append(f"| {label} | {phase} | {name} | {m['n_steps']:,} | {percent(m, 'rel_err_p50')} | "
                             f"{percent(m, 'rel_err_p90')} | {percent(m, 'rel_err_p99')} |")
    return "\n".join(lines)


def verdict_sentences(result: dict) -> list[str]:
    """One sentence per phase: the LoRA-aware model's p90 against the adapter-blind one's on adapter steps."""
    out = []
    for phase in PHASES:
        ours, theirs = (result["figures"]["adapter"][name][phase] for name in ("llmvisor", "adapter_blind"))
        word = result["verdicts"]["adapter"]["llmvisor vs adapter_blind"][phase]
        if word is None:
            continue
        out.append(f"{phase}: LoRA-aware p90 {percent(ours, 'rel_err_p90')} vs adapter-blind {percent(theirs, 'rel_err_p90')}: {word}")
    return out


def decode_errors_by_batch(test, predictions: dict) -> list[dict]:
    """Held-out decode-only steps that ran an adapter, per number of requests in the step (the steps `evaluate` judges):
    how many, their median measured time and each model's median signed relative error (predicted − measured) /
    measured, from ``predictions`` (`evaluate`'s, per model)."""
    measured = test.step_latency_s_per_step
    size = np.diff(test.step_offsets)
    keep = steady_steps(test) & ~test.is_prefill_per_step & lora_groups(test)["adapter"]
    signed = {name: (predicted - measured) / measured for name, predicted in predictions.items()}
    return [{"requests": int(n), "n_steps": int((keep & (size == n)).sum()),
             "measured_ms_p50": round(1e3 * float(np.median(measured[keep & (size == n)])), 2),
             **{f"{name}_signed_err_p50": round(float(np.median(err[keep & (size == n)])), 4) for name, err in signed.items()}}
            for n in sorted(set(size[keep].tolist()))]


def boundary_choice(model) -> dict:
    """How a fitted model chose its segment boundary (`StepLatencyModel`'s ``fit_info_["boundary_search"]``): the search's
    choice, then the best decode-count candidate it tried (its paired cross-validated gain over that choice and the gain's
    standard error; taken when the gain is the larger), and its outlier rule."""
    search = model.fit_info_["boundary_search"]
    counts = search.get("decode_counts") or {}
    tried = {k: v for k, v in counts.get("candidates", {}).items() if "gain" in v}
    best = max(tried, key=lambda k: tried[k]["gain"], default=None)
    keys = ("gain", "gain_standard_error", "n_readmitted_above", "n_outliers_dropped", "borrowed_features")
    return {"boundary_new_tokens": model.boundary_, "search_chose": counts.get("against", search.get("chosen")),
            "decode_count_rule": counts.get("rule"),
            "best_decode_count": None if best is None else {"count": tried[best]["boundary_new_tokens"], **{k: tried[best][k] for k in keys}},
            "n_outliers_dropped": model.fit_info_["n_outliers_dropped"], "outlier_rule": model.fit_info_["outlier_rule"]}


PATH_NOTE = (
    "why the memory-bound segment's l9 (lora_base_tokens) is what it is. In a decode step, base-model tokens are base-model "
    "requests, so in a step with an adapter l9 is told from the per-request decode term d4 (decode_requests) only by the "
    "decode steps without an adapter (d4 alone): decode_steps_by_count counts, per number of requests, the fit's own training "
    "steps of that segment that ran the decode phase only, without and with an adapter, with their median time "
    "(n_base_decode_from_canaries: how many of those without one the drift canaries ran). fits: the "
    "fitted model (per_segment); the same fit with that segment taking l9 from the other, as it takes the terms it does not hold "
    "(borrowed_l9); and the fitted model refitted without the single-sequence decode steps that ran no adapter "
    "(without_single_base_decode). cross_validated: per_segment against borrowed_l9 on the training runs, folds by run, the "
    "fit's steps, boundary and segment plan, paired on the held-out steps (gain: the mean of borrowed_l9's squared relative "
    "error less per_segment's, standard error over time blocks), and the part of that gain the single-sequence decode steps "
    "without an adapter make; held_out: the same on the test runs' steady steps. single_decode_term: the engine's slower "
    "single-request decode step as a term beside the model's features (a price per decode-only step of one request, "
    "fitted as the model is, not one of its features), its terms and held-out error on the test runs against the fitted "
    "model's (gain: the fitted model's mean squared relative error less the term's), and both models' p90 |relative error| "
    "on the test runs' decode steps with and without an adapter (no intervals)")


def lora_path_identification(train, model, test) -> dict:
    """`PATH_NOTE`: the LoRA path's per-base-token term in the memory-bound segment of a fitted LoRA-aware ``model``, what
    its training steps tell it from, and how the fit and its held-out error change when that segment borrows it, and with a
    term for single-request decode steps."""
    x, y, load = step_feature_matrix(train), train.step_latency_s_per_step, step_new_tokens(train)
    keep, boundary = model.train_step_mask_, model.boundary_
    d4, l8, l9 = FEATURE_NAMES_LORA.index("decode_requests"), int(LoraCoef.L8), int(LoraCoef.L9)
    weight = 1.0 / y
    aw, bw = x * weight[:, None], y * weight
    own = None if boundary is None else model._segment_plan(x, load, keep, boundary)
    borrowed = None if boundary is None else (own[0] & (np.arange(own[0].size) != l9), own[1])

    def decode_shape(trace, features, step_load):
        requests = features[:, d4]
        decode = ~trace.is_prefill_per_step & (True if boundary is None else step_load < boundary)
        return requests, decode & (features[:, l8] == 0), decode & (features[:, l8] > 0)

    def terms(coef) -> dict:
        return {"decode_requests_s": float(coef[0, d4]), "lora_steps_s": float(coef[0, l8]), "lora_base_tokens_s": float(coef[0, l9])}

    requests, base, adapter = decode_shape(train, x, load)
    by_count = [{"requests": int(n),
                 **{name: {"n_steps": int((keep & mask & (requests == n)).sum()),
                           "measured_ms_p50": round(1e3 * float(np.median(y[keep & mask & (requests == n)])), 2) if (keep & mask & (requests == n)).any() else None}
                    for name, mask in (("base_only", base), ("with_adapter", adapter))}}
                for n in sorted(set(requests[keep & (base | adapter)].astype(int).tolist()))]
    single = keep & base & (requests == 1)
    fits = {"per_segment": model.coef_, "without_single_base_decode": model._fit_segments(aw, bw, load, boundary, keep & ~single, own=own)}
    if borrowed is not None:
        fits["borrowed_l9"] = model._fit_segments(aw, bw, load, boundary, keep, own=borrowed)

    def paired(predicted: dict, measured, judged, single_steps, blocks, *, worse="borrowed_l9", better="per_segment") -> dict:
        errors = {name: ((p[judged] - measured[judged]) / measured[judged]) ** 2 for name, p in predicted.items()}
        gain = errors[worse] - errors[better]
        by_block = np.bincount(np.unique(blocks[judged], return_inverse=True)[1].reshape(-1), weights=gain - gain.mean())
        return {"n_judged": int(judged.sum()),
                **{f"{name}_mean_squared_rel_err": float(e.mean()) for name, e in errors.items()},
                "gain": float(gain.mean()), "gain_standard_error": float(np.sqrt(np.sum(by_block**2)) / gain.size),
                "n_single_base_decode": int(single_steps[judged].sum()),
                "gain_from_single_base_decode": float(gain[single_steps[judged]].sum() / gain.size)}

    xt, yt, load_t = step_feature_matrix(test), test.step_latency_s_per_step, step_new_tokens(test)
    steady = steady_steps(test)
    requests_t, base_t, _ = decode_shape(test, xt, load_t)
    cross_validated = held_out = None  # borrowing l9 from the other segment: there is none without a boundary
    if borrowed is not None:
        groups, grouping = model.fold_groups(train, keep)
        tests = [np.isin(np.arange(train.n_steps), np.flatnonzero(keep)[t]) for t in group_k_fold(groups, model.cv_folds)]
        predicted = {name: np.zeros(train.n_steps) for name in ("per_segment", "borrowed_l9")}
        for held in tests:
            for name, plan in (("per_segment", own), ("borrowed_l9", borrowed)):
                coef = model._fit_segments(aw, bw, load, boundary, keep & ~held, own=plan)
                predicted[name][held] = model._predict_rows(coef, boundary, x[held], load[held])
        blocks = np.full(train.n_steps, -1)
        blocks[keep] = time_block_groups(train, keep)
        cross_validated = {"fold_grouping": grouping, "n_folds": len(tests),
                           **paired(predicted, y, np.any(tests, axis=0), single, blocks)}
        held_out = paired({name: model._predict_rows(fits[name], boundary, xt, load_t) for name in ("per_segment", "borrowed_l9")},
                          yt, steady, steady & base_t & (requests_t == 1), time_block_groups(test, np.ones(test.n_steps, dtype=bool)))
    # the engine's slower single-request decode step as a term of its own, beside the model (not one of its features): a
    # price per decode-only step of one request, fitted and judged as the model is
    probe = copy.copy(model)
    probe.identified_ = np.r_[model.identified_, True]

    def with_single(trace, features):
        return np.c_[features, (np.diff(trace.step_offsets) == 1) & ~trace.is_prefill_per_step]

    coef_single = probe._fit_segments(with_single(train, x) * weight[:, None], bw, load, boundary, keep,
                                      own=None if own is None else (np.r_[own[0], True], np.r_[own[1], True]))
    test_blocks = time_block_groups(test, np.ones(test.n_steps, dtype=bool))
    predicted_t = {"per_segment": model._predict_rows(model.coef_, boundary, xt, load_t),
                   "single_decode_term": probe._predict_rows(coef_single, boundary, with_single(test, xt), load_t)}
    rel = {name: np.abs(p - yt) / yt for name, p in predicted_t.items()}
    decode_t = steady & ~test.is_prefill_per_step
    adapter_t = lora_groups(test)["adapter"]
    single_term = {**terms(coef_single), "single_decode_step_s": float(coef_single[0, -1]),
                   "held_out": {**paired(predicted_t, yt, steady, steady & base_t & (requests_t == 1), test_blocks,
                                         worse="per_segment", better="single_decode_term"),
                                "decode_rel_err_p90": {name: {"with_adapter": float(np.percentile(r[decode_t & adapter_t], 90)),
                                                              "base_only": float(np.percentile(r[decode_t & ~adapter_t], 90))}
                                                       for name, r in rel.items()}}}
    return {"segment": model.segment_names_[0], "boundary_new_tokens": boundary, "decode_steps_by_count": by_count,
            "n_base_decode_from_canaries": int((keep & base & (canary_run_per_step(train) >= 0)).sum()),
            "fits": {name: terms(coef) for name, coef in fits.items()},
            "n_single_base_decode_left_out": int(single.sum()), "n_fit_steps": int(keep.sum()),
            "cross_validated": cross_validated, "held_out": held_out, "single_decode_term": single_term, "note": PATH_NOTE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=REPO / "docs" / "results" / "lora.json")
    parser.add_argument("--engine-shape", choices=("quarter", "shipped"), default="quarter", help="see QUARTER_SHAPE")
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--canary-every", type=int, default=4, help="drift canaries (llmvisor profile --canary-every): on a "
                        "shared machine a canary every 8 episodes of 16 flagged a whole run as drifted, which the fit then drops")
    parser.add_argument("--max-decode-steps", type=int, default=12)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--lora-ranks", default="8,16,64,8")
    parser.add_argument("--lora-modules", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-seeds", default="0,1,2")
    parser.add_argument("--test-seeds", default="3,4")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--work", type=Path, default=None, help="keep the traces here (default: a temporary folder)")
    parser.add_argument("--analyse-only", action="store_true", help="re-analyse the traces already in --work; profile nothing")
    args = parser.parse_args()
    train_seeds = [int(s) for s in args.train_seeds.split(",")]
    test_seeds = [int(s) for s in args.test_seeds.split(",")]
    if set(train_seeds) & set(test_seeds):
        raise SystemExit("--train-seeds and --test-seeds must differ (held out by run)")

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="llmvisor-lora-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        args.engine_model_dir = engine_model_dir(args.engine_shape, work)
        runs, paths, loads = [], {}, []
        for seed in train_seeds + test_seeds:
            output = work / f"lora-seed{seed}.parquet"
            command = profile_command(args, seed, output)
            if args.analyse_only:
                paths[seed] = output
                continue
            before = load_average()
            run_started = time.time()
            result = subprocess.run([sys.executable, "-m", "llmvisor.cli", *command], capture_output=True, text=True)
            if result.returncode != 0:
                sys.stderr.write(result.stderr[-5000:])
                raise SystemExit(f"profile with seed {seed} failed ({result.returncode})")
            summary = json.loads(result.stdout)
            after = load_average()
            loads += [before, after]
            paths[seed] = output
            shown = [a if not os.path.exists(a) else Path(a).name for a in command]
            runs.append({
                "run_id": summary["run_id"], "seed": seed, "role": "train" if seed in train_seeds else "test",
                "command": "llmvisor " + " ".join(shlex.quote(a) for a in shown),
                "n_steps": summary["n_steps"], "n_warmup_steps": summary["n_warmup_steps"],
                "wall_time_s": round(time.time() - run_started, 1), "load_average_before": before, "load_average_after": after,
            })
            print(f"seed {seed}: {summary['n_steps']} steps in {time.time() - run_started:.0f} s (load {before} -> {after})", file=sys.stderr)
        runs_file = work / "runs.json"
        if args.analyse_only:
            runs, loads = json.loads(runs_file.read_text(encoding="utf-8")) if runs_file.exists() else [], []
            loads = [[*r["load_average_before"], *r["load_average_after"]] for r in runs if "load_average_before" in r]
        else:
            runs_file.write_text(json.dumps(runs, indent=1), encoding="utf-8")
        train = read_traces([paths[s] for s in train_seeds])
        test = read_traces([paths[s] for s in test_seeds])
        engine = train.metadata.get("engine") or {}
        fingerprint = train.metadata.get("engine_fingerprint") or {}
        lora_settings = train.metadata.get("lora") or {}
    result = evaluate(train, test, model_names=MODELS, n_bootstrap=args.bootstrap)
    aware = result["fitted"]["llmvisor"]
    figures = {
        "adapter": {name: {phase: metrics(result["by_lora"]["adapter"][name][phase]) for phase in PHASES} for name in MODELS},
        "all": {name: {phase: metrics(result["models"][name][phase]) for phase in PHASES} for name in MODELS},
    }
    verdicts = {
        group: {
            f"llmvisor vs {other}": {phase: verdict(figures[group]["llmvisor"][phase], figures[group][other][phase]) for phase in PHASES}
            for other in ("adapter_blind", "token_count")
        }
        for group in GROUPS
    }
    coef = {name: [float(row[k]) for row in aware.coef_] for k, name in enumerate(FEATURE_NAMES_LORA)}
    decode_by_batch = decode_errors_by_batch(test, {name: result["predictions"][name] for name in ("llmvisor", "adapter_blind")})
    cores = os.cpu_count()
    peak = max((max(load) for load in loads), default=None)
    out = {
        "command": " ".join(["python scripts/measure-lora.py", *portable_args(sys.argv[1:])]),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "what": "held-out step-latency error on a real vLLM engine with LoRA adapters: the LoRA-aware model vs the "
                "adapter-blind model (same features and rules without the LoRA terms) vs token count, split by run",
        "engine": {
            "shape": args.engine_shape,
            "shape_note": ("the shipped engine model at a quarter of its width, 2 layers (config float32, run in engine.dtype; dummy weights)"
                           if args.engine_shape == "quarter" else "the shipped engine model (8 layers, 1024 wide, bf16, dummy weights)"),
            "engine_version": engine.get("engine_version"),
            "dtype": engine.get("dtype"),
            "max_model_len": engine.get("max_model_len"),
            "max_num_batched_tokens": engine.get("max_num_batched_tokens"),
            "max_num_seqs": engine.get("max_num_seqs"),
            "threads": args.threads,
            "enable_prefix_caching": engine.get("enable_prefix_caching"),
            "hardware": engine.get("hardware"),
            **{k: fingerprint.get(k) for k in ("cpu_capability", "gemm_backend", "cpu_flags")},
        },
        "lora": lora_settings,
        "plan": {"points": args.points, "max_decode_steps": args.max_decode_steps,
                 "design": "llmvisor profile --plan lora: the sweep's episodes, each request on one of the adapters or the base "
                           "model (llmvisor.profile.plans.lora_episodes)"},
        "runs": runs,
        "train_runs": result["train_runs"],
        "test_runs": result["test_runs"],
        "n_train_steps": result["n_train_steps"],
        "n_test_steps": result["n_test_steps"],
        "n_test_adapter_steps": figures["adapter"]["llmvisor"]["all"].get("n_steps", 0),
        "bootstrap": result["bootstrap"],
        "phases": "prefill: a step with any prefill slice; decode: the others; all: both",
        "figures": figures,
        "verdict_rule": VERDICT_RULE,
        "verdicts": verdicts,
        "decode_by_batch": decode_by_batch,
        "decode_by_batch_note": ("held-out decode-only steps that ran an adapter, by requests in the step: median measured "
                                 "time and each model's median signed relative error (predicted - measured) / measured"),
        "lora_work": aware.fit_info_.get("lora_work"),
        "coef_s": coef,
        "coef_note": "the LoRA-aware model's coefficients, seconds per unit of each feature, one per segment (steps with "
                     "fewer total new tokens than boundary_new_tokens use the first); LoRA terms: " + ", ".join(LORA_FEATURE_NAMES),
        "boundary_new_tokens": aware.boundary_,
        "boundary_search": {"llmvisor": boundary_choice(aware), "adapter_blind": boundary_choice(result["fitted"]["adapter_blind"].model_)},
        "lora_path_identification": lora_path_identification(train, aware, test),
        "noise_floor": result["noise_floor"],
        "machine": {
            "cores": cores,
            "load_average_peak": peak,
            "caveat": (f"the machine was shared while measuring: the 1/5/15-minute load average reached {peak:g} on {cores} cores, "
                       "so other processes took CPU time from some steps; step times carry that noise (see noise_floor, "
                       "re-measured identical steps)") if peak is not None and peak > cores else None,
        },
        "wall_time_s": round(time.time() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2, default=lambda v: v.item() if isinstance(v, np.generic) else str(v)) + "\n", encoding="utf-8")
    print(markdown_table(out), file=sys.stderr)
    print("\n".join(verdict_sentences(out)), file=sys.stderr)
    print(f"lora work form: {out['lora_work'] and out['lora_work'].get('chosen')}; wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
