"""Write docs/results/scale.json from the outputs of scripts/measure-fleet.sh: the aggregate-mode runs
(`llmvisor load --engines N --mode aggregate --json`), the audits of the largest one (`llmvisor audit --json`), the
steps-mode runs (measured again, or kept from the file being replaced), the goals at 1,000 engines, the per-step
costs, and those costs scaled to fleets of 1,000 and 10,000 replicas.

    python scripts/summarise-fleet.py OUTPUT --audit-engines N --audits AUDIT.json ... --steps-runs [RUN.json ...] \
        --compare-runs [RUN.json ...] -- RUN.json ...
"""

import argparse
import json
import math
import os
from pathlib import Path

STEPS_TABLES = ("steps", "slice_batches", "usage_per_second")
ASSUMPTIONS = {
    "service_cores_per_process": 1.0,  # one Python process uses at most about one core (the GIL)
    "postgres_server_cores": 16,
    "postgres_target_utilisation": 0.5,
}
GOALS = {"engines": 1000, "postgres_bytes_per_step": 30.0, "staleness_over_window_s": 1.0}


def finite_or_null(value):
    """NaN (a figure nothing was measured for, e.g. staleness when no probe was answered) written as null: NaN is not
    JSON, and strict readers (jq, browsers) refuse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_or_null(item) for item in value]
    return value


def steps_run(run: dict) -> dict:
    """A steps-mode run with the keys every run of the file carries (runs measured before the aggregate mode
    existed lack some: they are derived from what those runs measured, nothing is re-measured)."""
    run = json.loads(json.dumps(run))
    run["settings"].setdefault("mode", "steps")
    run["settings"].setdefault("window_s", None)
    run.setdefault("steps_covered_per_s", run["accepted_steps_per_s"])
    run.setdefault("archive_bytes_per_step", None)
    if "window_s" in run and "measured_s" not in run:
        run["measured_s"] = run.pop("window_s")
    pg = run["postgres_per_step"]
    pg.setdefault("table_bytes", sum(pg[f"{name}_bytes"] for name in STEPS_TABLES))
    return run


def plan(steps_per_s: float, per_step: dict) -> dict:
    capacity = ASSUMPTIONS["postgres_server_cores"] * ASSUMPTIONS["postgres_target_utilisation"]
    service_small = steps_per_s * per_step["service_cpu_s_small_fleet"]
    service_large = steps_per_s * per_step["service_cpu_s_large_fleet"]
    postgres_cores = steps_per_s * per_step["postgres_cpu_s"]
    out = {
        "steps_per_s": steps_per_s,
        "service_cores_small_fleet": service_small,
        "service_processes_small_fleet": math.ceil(service_small / ASSUMPTIONS["service_cores_per_process"]),
        "service_cores_large_fleet": service_large,
        "service_processes_large_fleet": math.ceil(service_large / ASSUMPTIONS["service_cores_per_process"]),
        "postgres_cores": postgres_cores,
        "postgres_servers": math.ceil(postgres_cores / capacity),
        "wal_mb_per_s": steps_per_s * per_step["wal_bytes"] / 1e6,
        "tables_gb_per_day": steps_per_s * per_step["table_bytes"] * 86400 / 1e9,
    }
    if per_step.get("archive_bytes") is not None:
        out["archive_gb_per_day"] = steps_per_s * per_step["archive_bytes"] * 86400 / 1e9
    return out


def per_step_of(runs: list[dict]) -> dict:
    """The service's CPU per step in the smallest fleet (not saturated) and the largest; PostgreSQL's and the
    bytes from the largest (the most steps measured)."""
    small, large = runs[0], runs[-1]
    pg = large["postgres_per_step"]
    out = {
        "service_cpu_s_small_fleet": small["service_cpu_s_per_step"],
        "steps_per_post_small_fleet": small["mean_steps_per_post"],
        "service_cpu_s_large_fleet": large["service_cpu_s_per_step"],
        "steps_per_post_large_fleet": large["mean_steps_per_post"],
        "postgres_cpu_s": pg["cpu_s"],
        "wal_bytes": pg["wal_bytes"],
        "table_bytes": pg["table_bytes"],
        "archive_bytes": large["archive_bytes_per_step"],
    }
    if large.get("aggregate"):
        out["engine_cpu_s"] = large["aggregate"]["engine_cpu_s_per_step"]["total"]
        out["engine_cpu_share_of_step"] = out["engine_cpu_s"] * large["settings"]["steps_per_s_per_engine"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--audit-engines", type=int, required=True)
    parser.add_argument("--audits", type=Path, nargs="*", default=[])
    parser.add_argument("--steps-runs", type=Path, nargs="*", default=[])
    parser.add_argument("--compare-runs", type=Path, nargs="*", default=[],
                        help="aggregate runs of another service configuration (request totals kept), kept beside the runs")
    args = parser.parse_args()
    aggregate = [json.loads(path.read_text())["runs"][0] for path in args.runs]
    if args.steps_runs:
        steps, steps_measured = [steps_run(json.loads(p.read_text())["runs"][0]) for p in args.steps_runs], "in this run of the script"
    else:
        previous = json.loads(args.output.read_text()) if args.output.exists() else {"runs": []}
        steps = [steps_run(run) for run in previous["runs"] if run["settings"].get("mode", "steps") == "steps"]
        steps_measured = previous.get("steps_runs_measured", "by an earlier run of the script (per-step delivery only), kept as measured")
    audits = [json.loads(path.read_text()) for path in args.audits]
    audited = next(run for run in aggregate if run["settings"]["engines"] == args.audit_engines)
    at_goal = next((run for run in aggregate if run["settings"]["engines"] == GOALS["engines"]), None)
    goals = None
    if at_goal is not None:
        pg = at_goal["postgres_per_step"]
        staleness_goal = at_goal["settings"]["window_s"] + GOALS["staleness_over_window_s"]
        goals = {
            "engines": GOALS["engines"],
            "steps_offered": at_goal["aggregate"]["steps_offered"],
            "steps_uncovered_at_end": at_goal["aggregate"]["steps_uncovered_at_end"],
            "steps_late": at_goal["aggregate"]["steps_late"],
            "every_step_covered_in_time": at_goal["aggregate"]["steps_uncovered_at_end"] == 0 and at_goal["aggregate"]["steps_late"] == 0,
            "staleness_p99_s": at_goal["staleness_s"]["p99"],
            "staleness_goal_s": staleness_goal,
            "staleness_met": at_goal["staleness_s"]["p99"] <= staleness_goal and at_goal["staleness_probes_timed_out"] == 0,
            "postgres_bytes_per_step": pg["wal_bytes"] + pg["table_bytes"],
            "postgres_goal_bytes_per_step": GOALS["postgres_bytes_per_step"],
            "postgres_met": pg["wal_bytes"] + pg["table_bytes"] <= GOALS["postgres_bytes_per_step"],
            "audit_exact": bool(audits) and all(a["ok"] for a in audits) and args.audit_engines == GOALS["engines"],
            # what the bytes goal leaves for each request that finishes (one row per finished request, the idea)
            "goal_bytes_per_finished_request": GOALS["postgres_bytes_per_step"] / at_goal["aggregate"]["finished_requests_per_step"],
        }
    per_step = {"aggregate": per_step_of(aggregate), "steps": per_step_of(steps) if steps else None}
    extrapolation = {
        mode: {str(replicas): plan(replicas * aggregate[0]["settings"]["steps_per_s_per_engine"], figures) for replicas in (1000, 10000)}
        for mode, figures in per_step.items() if figures is not None
    }
    result = {
        "command": "bash scripts/measure-fleet.sh",
        "machine": {"cpus": os.cpu_count()},
        "runs": aggregate + steps,
        "comparison_runs": [json.loads(path.read_text())["runs"][0] for path in args.compare_runs],
        "steps_runs_measured": steps_measured,
        "audit": {
            "engines": args.audit_engines,
            "period_s": [audits[0]["start_us"] / 1e6, audits[0]["end_us"] / 1e6] if audits else None,
            "run_period_s": audited["aggregate"]["period_s"],
            "tenants": [{key: a[key] for key in ("tenant", "ok", "reattributed_ns", "usage_ns", "billed_windows_ns", "difference_ns",
                                                  "audited_steps", "window_steps", "windows_checked", "num_mismatched_windows",
                                                  "missing_steps", "unbilled_steps")} for a in audits],
            "all_exact": bool(audits) and all(a["ok"] for a in audits),
        },
        "goals": goals,
        "per_step": per_step,
        "assumptions": ASSUMPTIONS,
        "extrapolation": extrapolation,
    }
    args.output.write_text(json.dumps(finite_or_null(result), indent=2, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
