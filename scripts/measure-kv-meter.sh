#!/usr/bin/env bash
# What metering KV memory-time costs the recorder (issue #37: at most 1% of step time): `llmvisor profile` on the
# shipped engine model (8 layers, 1024 wide, dummy weights, vLLM CPU build, prefix caching on) replays 128 requests
# of the Azure 2023 conversation mix (lengths scaled to max_model_len 512), 32 in flight, 3 tenants, every prompt
# opening with one of 4 shared 128-token documents: decode-heavy steps with shared blocks. The recorder times its
# KV meter apart from the rest of its work (`kv_meter_*` in `recorder_overhead`). Writes docs/results/kv-meter.json
# (the profile's --json summary; the trace itself goes to a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
"$repo/.venv/bin/llmvisor" profile -o kv-meter.parquet --plan workload \
    --workload "$repo/src/llmvisor/data/workloads/azure-2023-conv.csv" --num-requests 128 --concurrency 32 \
    --shared-documents 4 --document-tokens 128 --max-model-len 512 --lengths scale --tenants 3 --json > summary.json
"$repo/.venv/bin/python" - "$repo/docs/results/kv-meter.json" <<'PY'
import json
import sys

summary = json.load(open("summary.json", encoding="utf-8"))
overhead = summary["recorder_overhead"]
summary["command"] = "bash scripts/measure-kv-meter.sh"
with open(sys.argv[1], "w", encoding="utf-8") as handle:
    json.dump(summary, handle, indent=2)
    handle.write("\n")
print(f"KV meter: {100 * overhead['kv_meter_fraction_of_step_time']:.3f}% of step time, "
      f"{overhead['kv_meter_time_per_step_us']:.0f} us/step over {overhead['n_steps']} steps "
      f"(recorder in all: {100 * overhead['fraction_of_step_time']:.3f}%)")
PY
