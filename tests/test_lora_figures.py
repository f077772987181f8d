"""docs/attribution.md's held-out figures for LoRA engines come from docs/results/lora.json, which
`python scripts/measure-lora.py` wrote from real vLLM runs: the table, every verdict word ("beats", "within CI",
"worse") and the chosen work form are rebuilt here from the JSON, and the verdicts from its own figures by the stated
rule, so the doc cannot say more than the measurement did."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure_lora():
    spec = importlib.util.spec_from_file_location("measure_lora", REPO / "scripts" / "measure-lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_json_is_a_held_out_lora_run_and_its_verdicts_follow_from_its_figures():
    script = measure_lora()
    result = json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8"))
    assert result["command"].startswith("python scripts/measure-lora.py")
    adapters = result["lora"]["adapters"]
    assert len(adapters) >= 3 and {8, 16, 64} <= {a["rank"] for a in adapters}
    assert result["lora"]["max_loras"] < len(adapters)  # swaps forced
    assert set(result["train_runs"]).isdisjoint(result["test_runs"]) and result["test_runs"]
    assert {r["run_id"] for r in result["runs"] if r["role"] == "test"} == set(result["test_runs"])
    assert result["n_test_adapter_steps"] > 0
    assert result["n_test_adapter_steps"] < result["figures"]["all"]["llmvisor"]["all"]["n_steps"]  # base-only steps too
    for group in script.GROUPS:
        for other in ("adapter_blind", "token_count"):
            for phase in script.PHASES:
                figures = result["figures"][group]
                assert result["verdicts"][group][f"llmvisor vs {other}"][phase] == script.verdict(figures["llmvisor"][phase], figures[other][phase])
    assert result["lora_work"]["chosen"] in ("tokens", "rank_tokens", "both")


def test_the_doc_quotes_the_json():
    script = measure_lora()
    result = json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8"))
    text = (REPO / "docs" / "attribution.md").read_text(encoding="utf-8")
    assert script.markdown_table(result) in text
    doc = " ".join(text.split())
    figures, verdicts, engine = result["figures"], result["verdicts"], result["engine"]
    adapters = [str(a["rank"]) for a in result["lora"]["adapters"]]
    scores = {form: f"{v['cv_mean_squared_rel_err']:.4f}" for form, v in result["lora_work"]["candidates"].items()}
    # a value per segment: one, as the fit kept "a single segment"
    coef = {name: " and ".join(dict.fromkeys(f"{1e6 * v:.0f} µs" for v in values)) for name, values in result["coef_s"].items()}
    assert result["boundary_new_tokens"] is None and all(len(values) == 1 for values in result["coef_s"].values())
    aware = result["boundary_search"]["llmvisor"]
    assert aware["boundary_new_tokens"] is None and aware["search_chose"] == "none"
    floor = {run: {q: f"{100 * result['noise_floor'][run][q]:.0f}%" for q in ("p50", "p90")} for run in ("train", "test")}
    rows = [row for row in result["decode_by_batch"] if row["n_steps"] >= 30]

    def span(model):
        errors = [100 * row[f"{model}_signed_err_p50"] for row in rows]
        return f"{min(errors):+.1f}% to {max(errors):+.1f}%"

    quoted = [
        *script.verdict_sentences(result),
        f"{len(adapters)} adapters of ranks {', '.join(adapters[:-1])} and {adapters[-1]}",
        f"{result['lora']['max_loras']} LoRA slots",
        f"{len(result['runs'])} runs ({len([r for r in result['runs'] if r['role'] == 'train'])} fitted, {len(result['test_runs'])} held out)",
        f"{figures['all']['llmvisor']['all']['n_steps']:,} held-out steps judged (warm-up excluded), "
        f"{result['n_test_adapter_steps']:,} of them with an adapter",
        f"the JSON's `engine.cpu_capability` {engine['cpu_capability']}, `engine.gemm_backend` {engine['gemm_backend']}",
        f"the fit chose the per-token work form `{result['lora_work']['chosen']}`",
        f"{scores['tokens']} for tokens run with an adapter, {scores['rank_tokens']} for rank × tokens, {scores['both']} for both",
        "and a single segment (the boundary search, decode counts included, placed none)",
        f"{coef['prefill_lora_tokens']} per prefill token run with an adapter against {coef['prefill_new_tokens']} per prefill token",
        f"{coef['decode_lora_tokens']} per decode token with an adapter, {coef['lora_adapters']} per distinct adapter and "
        f"{coef['lora_slot_loads']} per slot load (disk reads not priced apart: {coef['lora_disk_loads']}); "
        f"the LoRA path {coef['lora_steps']} per step with an adapter and {coef['lora_base_tokens']} per base-model token in such a step",
        f"differ by {floor['train']['p50']} at the median and {floor['train']['p90']} at p90 on the training runs "
        f"({floor['test']['p50']} and {floor['test']['p90']} on the held-out ones",
        f"counts with at least 30 held-out steps, {rows[0]['requests']} to {rows[-1]['requests']} requests), the LoRA-aware model is off by "
        f"{span('llmvisor')} at the median, the adapter-blind one by {span('adapter_blind')}",
        f"({rows[0]['measured_ms_p50']:.2f} ms at the median with {rows[0]['requests']}, {rows[-1]['measured_ms_p50']:.2f} ms with {rows[-1]['requests']})",
        f"{figures['adapter']['llmvisor']['decode']['n_steps']:,} of the {figures['all']['llmvisor']['decode']['n_steps']:,} held-out "
        "decode steps ran an adapter",
        f"its prefill p90 beats token_count's ({100 * figures['all']['llmvisor']['prefill']['rel_err_p90']:.1f}% against "
        f"{100 * figures['all']['token_count']['prefill']['rel_err_p90']:.1f}%)",
    ]
    if result["machine"]["caveat"]:
        quoted.append(f"load average reached {result['machine']['load_average_peak']:g} on {result['machine']['cores']} cores")
    assert [q for q in quoted if q not in doc] == []
    # the words: "no AVX-512"; "undercharges small steps and overcharges large ones" (adapter-blind); "steadily ... no jump
    # between two counts"; the peak load "a 15-minute average" while "the 1-minute average stayed near 1"; "about 10 minutes"
    assert "avx512f" not in engine["cpu_flags"] and engine["cpu_capability"] != "AVX512"
    assert rows[0]["adapter_blind_signed_err_p50"] < 0 < rows[-1]["adapter_blind_signed_err_p50"]
    medians = [row["measured_ms_p50"] for row in rows]
    assert [row["requests"] for row in rows] == list(range(rows[0]["requests"], rows[-1]["requests"] + 1))
    assert all(1 < b / a < 1.35 for a, b in zip(medians, medians[1:]))
    loads = [r[key] for r in result["runs"] for key in ("load_average_before", "load_average_after")]
    assert result["machine"]["load_average_peak"] == max(load[2] for load in loads) and max(load[0] for load in loads) < 1.5
    assert 8 * 60 < sum(r["wall_time_s"] for r in result["runs"]) < 12 * 60
    # the words the prose uses are the JSON's verdicts
    adapter_steps = verdicts["adapter"]
    assert adapter_steps["llmvisor vs adapter_blind"] == {"prefill": "beats", "decode": "beats", "all": "beats"}  # "in every phase"
    assert adapter_steps["llmvisor vs token_count"] == {"prefill": "beats", "decode": "beats", "all": "beats"}
    assert verdicts["all"]["llmvisor vs token_count"]["prefill"] == "beats"


def test_the_doc_says_what_tells_l9_from_the_decode_price_as_the_json_does():
    """The paragraph on what identifies l9: its counts and fits rebuilt from lora.json's ``lora_path_identification``,
    the batches' own l9 from both lora-shapley files, and each claim in words checked against the figures it rests on."""
    result = json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8"))
    games = [json.loads((REPO / "docs" / "results" / name).read_text(encoding="utf-8")) for name in ("lora-shapley.json", "lora-shapley-repeat.json")]
    doc = " ".join((REPO / "docs" / "attribution.md").read_text(encoding="utf-8").split())
    path = result["lora_path_identification"]
    assert path["boundary_new_tokens"] == result["boundary_new_tokens"] and path["segment"] == "all"
    assert path["fits"]["per_segment"] == {"decode_requests_s": result["coef_s"]["decode_requests"][0],
                                           "lora_steps_s": result["coef_s"]["lora_steps"][0],
                                           "lora_base_tokens_s": result["coef_s"]["lora_base_tokens"][0]}
    by = {row["requests"]: row for row in path["decode_steps_by_count"]}

    def count(kind, counts):
        return sum(by[n][kind]["n_steps"] for n in counts if n in by)

    small = range(2, 9)
    fits = {name: {k: f"{1e3 * v:.2f}" for k, v in terms.items()} for name, terms in path["fits"].items()}
    own = [g["batch_terms_check"]["terms"]["lora_base_tokens_s"] for g in games]
    term = path["single_decode_term"]
    least = min(by[n]["base_only"]["n_steps"] for n in small)
    quoted = [
        f"{count('base_only', small):,} base-model decode steps at 2 to 8 requests against {count('with_adapter', small):,} with an adapter "
        f"(at least {least} at every count), and {by[1]['base_only']['n_steps']:,} of a single base-model request",
        f"The fit gives d4 = {fits['per_segment']['decode_requests_s']} ms per request and l9 = {fits['per_segment']['lora_base_tokens_s']} ms "
        "per base-model token",
        f"refitted without the single-request base-model decode steps, l9 is {fits['without_single_base_decode']['lora_base_tokens_s']} ms",
        f"a price per decode-only step of one request, tried beside the model, comes out {1e3 * term['single_decode_step_s']:.2f} ms",
        f"The batches' own l9 in the two runs above, {1e3 * own[0]:.2f} ms and {1e3 * own[1]:.2f} ms, is the profiled one's within a few percent",
    ]
    assert [q for q in quoted if q not in doc] == []
    # "within a few percent"; "this one does not" run a lone request slower than two; a third of the eligible steps is
    # what the plan asks (`BASE_ONLY_DECODE_SHARE`)
    l9 = path["fits"]["per_segment"]["lora_base_tokens_s"]
    assert all(abs(o / l9 - 1) < 0.1 for o in own)
    assert by[1]["base_only"]["measured_ms_p50"] < by[2]["base_only"]["measured_ms_p50"] and term["single_decode_step_s"] == 0
    from llmvisor.engines.vllm.driver import BASE_ONLY_DECODE_SHARE

    assert BASE_ONLY_DECODE_SHARE == 1 / 3 and "runs a third of the steps whose running requests all decode" in doc


def test_a_recorded_command_names_no_folder_of_the_machine_and_still_runs():
    """A path of the machine becomes its option's placeholder: ``--analyse-only`` without its ``--work`` would re-analyse
    nothing, so dropping the pair (as the recorder once did) wrote a command that cannot run."""
    portable = measure_lora().portable_args
    argv = ["--analyse-only", "--work", "/tmp/llmvisor-lora-x", "-o", "/home/someone/lora.json", "--points", "20", "--train-seeds", "0,1"]
    assert portable(argv) == ["--analyse-only", "--work", "WORK", "-o", "OUTPUT", "--points", "20", "--train-seeds", "0,1"]
    assert portable(["--engine-model", "/srv/models/x"]) == ["--engine-model", "ENGINE_MODEL"]
    assert portable(["/abs/alone"]) == ["PATH"]
