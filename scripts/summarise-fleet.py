"""Write docs/results/scale.json from the `llmvisor load --engines N --json` outputs of scripts/measure-fleet.sh:
the runs, the per-step costs they measured, and those costs scaled to fleets of 1,000 and 10,000 replicas.

    python scripts/summarise-fleet.py OUTPUT RUN.json [RUN.json ...]   (runs in order of fleet size)
"""

import json
import math
import os
import sys
from pathlib import Path

TABLES = ("steps_bytes", "slice_batches_bytes", "usage_per_second_bytes")
ASSUMPTIONS = {
    "service_cores_per_process": 1.0,  # one Python process uses at most about one core (the GIL)
    "postgres_server_cores": 16,
    "postgres_target_utilisation": 0.5,
}


def main(output: Path, run_files: list[Path]) -> None:
    runs = [json.loads(path.read_text())["runs"][0] for path in run_files]
    # The service's cost per step at the pusher's own batch size (the smallest fleet, about 10 steps a POST) and
    # at the largest batches seen (the largest fleet, whose POSTs waited and carried more); PostgreSQL's from the
    # largest run (the most steps measured).
    small, large = runs[0], runs[-1]
    per_step = {
        "service_cpu_s_small_batches": small["service_cpu_s_per_step"],
        "steps_per_post_small_batches": small["mean_steps_per_post"],
        "service_cpu_s_large_batches": large["service_cpu_s_per_step"],
        "steps_per_post_large_batches": large["mean_steps_per_post"],
        "postgres_cpu_s": large["postgres_per_step"]["cpu_s"],
        "wal_bytes": large["postgres_per_step"]["wal_bytes"],
        "table_bytes": sum(large["postgres_per_step"][name] for name in TABLES),
    }
    postgres_server_capacity_cores = ASSUMPTIONS["postgres_server_cores"] * ASSUMPTIONS["postgres_target_utilisation"]
    extrapolation = {}
    for replicas in (1000, 10000):
        steps_per_s = replicas * small["settings"]["steps_per_s_per_engine"]
        service_small = steps_per_s * per_step["service_cpu_s_small_batches"]
        service_large = steps_per_s * per_step["service_cpu_s_large_batches"]
        postgres_cores = steps_per_s * per_step["postgres_cpu_s"]
        extrapolation[str(replicas)] = {
            "steps_per_s": steps_per_s,
            "service_cores_small_batches": service_small,
            "service_processes_small_batches": math.ceil(service_small / ASSUMPTIONS["service_cores_per_process"]),
            "service_cores_large_batches": service_large,
            "service_processes_large_batches": math.ceil(service_large / ASSUMPTIONS["service_cores_per_process"]),
            "postgres_cores": postgres_cores,
            "postgres_servers": math.ceil(postgres_cores / postgres_server_capacity_cores),
            "wal_mb_per_s": steps_per_s * per_step["wal_bytes"] / 1e6,
            "storage_gb_per_day": steps_per_s * per_step["table_bytes"] * 86400 / 1e9,
        }
    result = {
        "command": "bash scripts/measure-fleet.sh",
        "machine": {"cpus": os.cpu_count()},
        "runs": runs,
        "per_step": per_step,
        "assumptions": ASSUMPTIONS,
        "extrapolation": extrapolation,
    }
    output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
