"""Measured Shapley on mixed-adapter decode batches vs the LoRA rule and two wrong rules (issue #38 item 5, second "Done when").

Starts a real vLLM engine (CPU build, in-process, `llmvisor.engines.vllm.controlled.ControlledEngine`, warm decode
contexts) with LoRA on, the engine shape of scripts/measure-lora.py (whose fitted LoRA-aware model,
docs/results/lora.json ``coef_s``, gives the rules' shares), and two adapters written locally (ranks 8 and 64, the
fitted run's target modules). ``max_loras`` is the number of adapters, so both are loaded into their slots while the
batch is prepared and stay resident: no measured step loads an adapter (a step whose record shows a load is redone),
so the slot-load term is not what this measures: it measures who pays the per-adapter kernels term (l5) and the
LoRA path (l8, l9: what a step with an adapter costs its base-model tokens).

One decode batch is held: three base-model "subjects", an adapter request of each adapter, and two base-model
stand-ins with the adapter requests' contexts. The mixed game is {subjects, adapter requests}, the control game
{subjects, stand-ins}; each round runs every nonempty subset of both games as one decode step (62 steps, random
order), until ``--budget-s`` or ``--rounds``. `llmvisor.validation.lora.compare_rules` does the check (its docstring
says how); the result, with settings, subset means, noise and the machine's load average, goes to a JSON figure file.

    python scripts/measure-lora-shapley.py [-o docs/results/lora-shapley.json] [--budget-s 480] [--rounds 200]
    python scripts/measure-lora-shapley.py --reprice    # no engine: the model-derived rule_shares_s again
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llmvisor.core.game import segment_of
from llmvisor.core.model import StepLatencyModel
from llmvisor.engines.vllm.controlled import ControlledEngine, LoraAdapter
from llmvisor.profile.adapters import write_adapters
from llmvisor.validation.game import members
from llmvisor.validation.lora import (
    RULES,
    batch_lora_terms,
    compare_rules,
    noise_floor,
    rule_differences,
    split_rounds,
    step_shares,
    with_batch_lora_terms,
)

REPO = Path(__file__).resolve().parent.parent
SUBJECTS = [0, 1, 2]


def measure_lora_module():
    """scripts/measure-lora.py (its engine shape), imported by path: its file name is not a module name."""
    spec = importlib.util.spec_from_file_location("measure_lora", REPO / "scripts" / "measure-lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fitted_model(model_json: str) -> tuple[StepLatencyModel, dict]:
    """The LoRA-aware model of a measure-lora.py figure file (its ``coef_s``, a value per segment, and its boundary), and
    the file."""
    fitted = json.loads(Path(model_json).read_text(encoding="utf-8"))
    coef = fitted["coef_s"]
    segments = [{k: v[i] for k, v in coef.items()} for i in range(len(coef["intercept"]))]
    return StepLatencyModel.from_coefficients(segments, fitted.get("boundary_new_tokens")), fitted


def model_record(model: StepLatencyModel, fitted: dict, batch_size: int) -> dict:
    """The fitted model's LoRA terms that price the games: those of the segment of the whole batch (one token a request),
    which holds every subset's too (a smaller load)."""
    segment = segment_of(model.boundary_, float(batch_size))
    coef = fitted["coef_s"]
    return {"source": "docs/results/lora.json coef_s (the LoRA-aware model fitted by scripts/measure-lora.py)",
            "segment": model.segment_names_[segment], "boundary_new_tokens": model.boundary_,
            "l5_lora_adapters_s": coef["lora_adapters"][segment], "decode_lora_tokens_s": coef["decode_lora_tokens"][segment],
            **{f"{k}_{name}_s": coef[name][segment] for k, name in (("l8", "lora_steps"), ("l9", "lora_base_tokens")) if name in coef}}


def rule_shares(model: StepLatencyModel, games: dict) -> dict:
    """Each rule's share (seconds) of each request of each game's whole batch, from the fitted model."""
    return {g: {rule: step_shares(model, contexts=spec["contexts"], names=spec["names"], ranks=spec["ranks"], rule=rule).tolist()
                for rule in RULES} for g, spec in games.items()}


def ms(value_s: float) -> str:
    return f"{1e3 * value_s:.2f} ms"


def interval_ms(values_s) -> str:
    return f"[{1e3 * values_s[0]:.2f}, {1e3 * values_s[1]:.2f}] ms"


def doc_sentences(result: dict) -> list[str]:
    """The sentences docs/attribution.md quotes from the figure file (tests/test_lora_shapley_figures.py ties them)."""
    check, rules = result["check"], result["check"]["rules"]
    mixed, control = result["subset_mean_s"]["mixed"], result["subset_mean_s"]["control"]
    adapters = result["adapters"]
    floor = result["noise_floor"]
    return [
        f"{check['rounds']} rounds, {result['n_steps_measured']:,} measured decode steps ({result['n_steps_redone']} redone)",
        f"adapters of ranks {adapters[0]['rank']} and {adapters[1]['rank']}",
        f"the whole mixed batch ran in {ms(mixed[-1])} on average, the control batch in {ms(control[-1])}",
        f"measured D = {ms(check['D_s'])}, 95% interval {interval_ms(check['D_ci95_s'])}",
        f"per subject d = {', '.join(ms(v) for v in check['d_s'])}",
        f"the stated rule's D is {ms(rules['stated']['D_s'])}: {rules['stated']['verdict']}",
        f"the wrong rule's D is {ms(rules['wrong']['D_s'])}: {rules['wrong']['verdict']}",
        *([f"the base-pays-none rule's D is {ms(rules['base_pays_none']['D_s'])}: {rules['base_pays_none']['verdict']}"]
          if "base_pays_none" in rules else []),
        f"the adapter requests' measured Shapley values: {ms(check['phi_mixed_s'][3])} (rank {adapters[0]['rank']}) and "
        f"{ms(check['phi_mixed_s'][4])} (rank {adapters[1]['rank']}), their base-model stand-ins' {ms(check['phi_control_s'][3])} and "
        f"{ms(check['phi_control_s'][4])}",
        f"a step of the rank-{adapters[0]['rank']} adapter request alone ran {ms(mixed[8])} against {ms(control[8])} for its "
        f"base-model stand-in alone; with the three subjects added, {ms(mixed[15])} against {ms(control[15])}",
        *(f"the {rule} rule gives the whole mixed batch's subjects {', '.join(ms(v) for v in result['rule_shares_s']['mixed'][rule][:3])} "
          f"and its adapter requests {', '.join(ms(v) for v in result['rule_shares_s']['mixed'][rule][3:])}"
          for rule in result["rule_shares_s"]["mixed"]),
        f"against measured subjects' {', '.join(ms(v) for v in check['phi_mixed_s'][:3])}",
        f"repeats of one subset differ by {100 * floor['mixed']['rel_sd_p50']:.0f}% (mixed) and "
        f"{100 * floor['control']['rel_sd_p50']:.0f}% (control) relative standard deviation at the median",
        f"load average up to {result['machine']['load_average_peak']:g} on {result['machine']['cores']} cores",
        *batch_sentences(result),
    ]


RULE_NAMES = {"stated": "the stated rule", "wrong": "the wrong rule", "base_pays_none": "the base-pays-none rule"}


def batch_sentences(result: dict) -> list[str]:
    """The doc's sentences on the check priced with the batch's own LoRA terms (none for a file without it)."""
    batch = result.get("batch_terms_check")
    if not batch:
        return []
    terms, check = batch["terms"], batch["check"]
    return [
        f"fitted on the odd-numbered rounds, the batch's own LoRA terms are {ms(terms['lora_steps_s'])} per step with an adapter, "
        f"{ms(terms['adapter_request_s'])} per adapter request and {ms(terms['lora_base_tokens_s'])} per base-model token "
        f"(residual {ms(terms['residual_rms_s'])} root mean square over {terms['n_subsets']} subsets)",
        f"judged on the {check['rounds']} even-numbered rounds: measured D = {ms(check['D_s'])}, 95% interval {interval_ms(check['D_ci95_s'])}",
        *(f"{RULE_NAMES[rule]}'s D is {ms(r['D_s'])}: {r['verdict']}" for rule, r in check["rules"].items()),
    ]


def analyse(model: StepLatencyModel, mixed_s: np.ndarray, control_s: np.ndarray, game_specs: dict, seed: int) -> tuple[dict, dict]:
    """The check with the profiled model's LoRA terms (every round), and with the batch's own (fitted on the odd rounds,
    judged on the even ones: `llmvisor.validation.lora.batch_lora_terms`)."""
    predicted = rule_differences(model, SUBJECTS, game_specs["mixed"], game_specs["control"])
    check = compare_rules(mixed_s, control_s, SUBJECTS, predicted, seed=seed)
    fit, judge = split_rounds(mixed_s.shape[0])
    terms = batch_lora_terms(np.nanmean(mixed_s[fit], axis=0), np.nanmean(control_s[fit], axis=0), game_specs["mixed"]["names"])
    batch_model = with_batch_lora_terms(model, terms)
    batch_predicted = rule_differences(batch_model, SUBJECTS, game_specs["mixed"], game_specs["control"])
    batch = {"priced_on_rounds": "1st, 3rd, 5th, ... (odd-numbered)", "judged_on_rounds": "2nd, 4th, ... (even-numbered)",
             "terms": terms, "check": compare_rules(mixed_s[judge], control_s[judge], SUBJECTS, batch_predicted, seed=seed)}
    return check, batch


def rounds_path(output) -> Path:
    """The measured rounds kept beside the figure file (``NAME.rounds.json.gz``), for re-analysis without the engine."""
    output = Path(output)
    return output.with_name(output.name.removesuffix(".json") + ".rounds.json.gz")


def write_rounds(path: Path, mixed_s: np.ndarray, control_s: np.ndarray) -> None:
    """Every round's subset step times (seconds, to 100 ns; null where not measured), gzipped."""
    body = {g: [[None if not np.isfinite(v) else round(float(v), 7) for v in row] for row in rows]
            for g, rows in (("mixed", mixed_s), ("control", control_s))}
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump({"what": "per round, each subset's measured decode step time in seconds (index = bit mask of players)", **body}, handle)


def read_rounds(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        body = json.load(handle)
    return tuple(np.array([[np.nan if v is None else v for v in row] for row in body[g]], dtype=np.float64) for g in ("mixed", "control"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", default=str(REPO / "docs" / "results" / "lora-shapley.json"))
    parser.add_argument("--model-json", default=str(REPO / "docs" / "results" / "lora.json"),
                        help="the figure file whose coef_s (and engine settings) give the fitted LoRA-aware model")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop measuring rounds after this many seconds")
    parser.add_argument("--rounds", type=int, default=200, help="at most this many rounds")
    parser.add_argument("--contexts", default="64,128,192,96,160",
                        help="subjects' three contexts, then the two adapter requests' (the stand-ins' too)")
    parser.add_argument("--ranks", default="8,64", help="the two adapters' ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reprice", action="store_true",
                        help="no engine: recompute the model-derived rule_shares_s of the existing --output from --model-json")
    args = parser.parse_args()
    started = time.time()
    model, fitted = fitted_model(args.model_json)
    if args.reprice:
        result = json.loads(Path(args.output).read_text(encoding="utf-8"))
        games = {g: {k: v for k, v in spec.items() if k != "players"} for g, spec in result["games"].items()}
        result["rule_shares_s"] = rule_shares(model, games)
        result["model"] = model_record(model, fitted, len(games["mixed"]["contexts"]))
        result["repriced"] = "rule_shares_s recomputed (no engine) by: python scripts/measure-lora-shapley.py --reprice"
        if result.get("rounds_file"):  # the checks again from the kept rounds
            mixed_s, control_s = read_rounds(Path(args.output).with_name(result["rounds_file"]))
            result["check"], result["batch_terms_check"] = analyse(model, mixed_s, control_s, games, result["check"]["bootstrap"]["seed"])
            # the subset means the check's Shapley values are of: the kept rounds' (stored to 100 ns)
            result["subset_mean_s"] = {"mixed": np.nanmean(mixed_s, axis=0).tolist(), "control": np.nanmean(control_s, axis=0).tolist()}
            result["repriced"] += "; check, batch_terms_check and subset_mean_s recomputed from rounds_file"
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        return
    contexts = [int(x) for x in args.contexts.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    if len(contexts) != 5 or len(ranks) != 2:
        sys.exit("--contexts: five numbers; --ranks: two")
    engine_facts = fitted["engine"]
    target_modules = fitted["lora"]["adapters"][0]["target_modules"]
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="llmvisor-lora-shapley-") as work:
        work = Path(work)
        model_dir = measure_lora_module().engine_model_dir(engine_facts["shape"], work)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        adapters = write_adapters(work / "adapters", config, ranks, target_modules=target_modules, seed=args.seed)
        lora = [LoraAdapter(a.path.name, str(a.path)) for a in adapters]
        batch_adapters = [None, None, None, lora[0], lora[1], None, None]
        batch_contexts = contexts + contexts[3:]
        games = {"mixed": [0, 1, 2, 3, 4], "control": [0, 1, 2, 5, 6]}
        n = 5
        costs = {g: [] for g in games}
        mismatched = 0
        loads = [load_average()]
        with ControlledEngine(model_dir, max_model_len=engine_facts["max_model_len"], max_num_batched_tokens=engine_facts["max_num_batched_tokens"],
                              max_num_seqs=engine_facts["max_num_seqs"], kv_cache_gib=1, num_threads=engine_facts["threads"], seed=args.seed,
                              max_loras=len(lora), max_lora_rank=max(ranks)) as engine:
            batch = engine.prepare_decode(batch_contexts, max_decode_steps=4, adapters=batch_adapters)
            for _ in range(3):  # warm-up: first runs of a shape are slow
                for players in games.values():
                    engine.decode_step(batch, players)
            measure_started = time.time()
            while len(costs["mixed"]) < args.rounds and time.time() - measure_started < args.budget_s:
                row = {g: np.full(1 << n, np.nan) for g in games}
                for g in games:
                    row[g][0] = 0.0
                order = [(g, mask) for g in games for mask in range(1, 1 << n)]
                for k in rng.permutation(len(order)):
                    g, mask = order[k]
                    players = [games[g][i] for i in members(mask, n)]
                    for _ in range(3):
                        step = engine.decode_step(batch, players)
                        if step.matches:
                            row[g][mask] = step.step_latency_s
                            break
                        mismatched += 1
                        print(f"redo {g} {mask}: {step.reason}", file=sys.stderr)
                for g in games:
                    costs[g].append(row[g])
                if len(costs["mixed"]) % 10 == 0:
                    loads.append(load_average())
                    print(f"round {len(costs['mixed'])} ({time.time() - measure_started:.0f} s, load {loads[-1]})", file=sys.stderr)
            measuring_s = time.time() - measure_started
            loads.append(load_average())
            settings = engine.describe()
    mixed_s, control_s = np.array(costs["mixed"]), np.array(costs["control"])
    names = ["", "", "", lora[0].name, lora[1].name]
    game_specs = {"mixed": {"contexts": contexts, "names": names, "ranks": [0, 0, 0, *ranks]},
                  "control": {"contexts": contexts, "names": [""] * 5, "ranks": [0] * 5}}
    check, batch_check = analyse(model, mixed_s, control_s, game_specs, args.seed)
    write_rounds(rounds_path(args.output), mixed_s, control_s)
    peak = max(max(x) for x in loads)
    cores = os.cpu_count()
    result = {
        "command": " ".join(["python scripts/measure-lora-shapley.py", *measure_lora_module().portable_args(sys.argv[1:])]),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "what": ("measured Shapley values on mixed-adapter decode batches on a real vLLM engine vs the LoRA attribution rule "
                 "(per-adapter term to that adapter's requests, the LoRA path's set-up to the step's adapter requests, its "
                 "kernels over a base-model request's tokens A/(A+1) to that request) and two wrong rules: 'wrong' (the "
                 "per-step adapter terms split over every request of the step) and 'base_pays_none' (the LoRA path charged "
                 "to the adapter requests whole); see llmvisor.validation.lora"),
        "engine": settings,
        "engine_shape": engine_facts["shape"],
        "model": model_record(model, fitted, n),
        "adapters": [{"name": a.path.name, "rank": a.rank, "target_modules": list(a.target_modules)} for a in adapters],
        "slots": (f"max_loras = max_cpu_loras = {len(lora)} = the adapters of the batch: both are loaded while the batch is "
                  "prepared and stay resident; a measured step whose record shows a slot load is redone, so no measured step "
                  "includes a load and the slot-load term (l6) is not what this measures"),
        "games": {g: {**game_specs[g], "players": ["subject", "subject", "subject",
                                                   *(["adapter request"] * 2 if g == "mixed" else ["base stand-in"] * 2)]}
                  for g in game_specs},
        "design": ("one held decode batch (warm: every member rewound to its context after each step); each round runs every "
                   "nonempty subset of the mixed and the control game once as one decode step, in random order; "
                   "subset cost = mean over rounds; exact Shapley of the means"),
        "rule_shares_s": rule_shares(model, game_specs),
        "subset_mean_s": {"mixed": np.nanmean(mixed_s, axis=0).tolist(), "control": np.nanmean(control_s, axis=0).tolist()},
        "n_steps_measured": int(np.isfinite(mixed_s[:, 1:]).sum() + np.isfinite(control_s[:, 1:]).sum()),
        "n_steps_redone": mismatched,
        "measuring_s": round(measuring_s, 1),
        "check": check,
        "batch_terms_check": batch_check,
        "rounds_file": rounds_path(args.output).name,
        "noise_floor": {g: noise_floor(c) for g, c in (("mixed", mixed_s), ("control", control_s))},
        "machine": {"cores": cores, "load_average": loads, "load_average_peak": peak,
                    "caveat": (f"the machine was shared while measuring (1/5/15-minute load average up to {peak:g} on {cores} cores): "
                               "other processes took CPU time from some steps; see noise_floor") if peak > (cores or 1) else ""},
        "wall_time_s": round(time.time() - started, 1),
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"verdict": check["verdict"], "D_s": check["D_s"], "D_ci95_s": check["D_ci95_s"],
                      "rounds": check["rounds"], "batch_terms": batch_check["terms"],
                      "batch_terms_verdict": batch_check["check"]["verdict"], "batch_terms_D_ci95_s": batch_check["check"]["D_ci95_s"]}, indent=1))


if __name__ == "__main__":
    main()
