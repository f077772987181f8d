#!/usr/bin/env bash
# Record the step traces shipped in src/llmvisor/data/traces/ (see its README.md for what they hold).
# Runs on the CPU build of vLLM with vLLM's defaults (prefix caching on); about 35 minutes on a 2-core machine. Other heavy jobs distort the timings,
# so /tmp/llmvisor-quiet.lock asks the machine's other users to hold theirs while this runs (and this script
# waits while someone else holds it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-src/llmvisor/data/traces}
WORKLOADS=${WORKLOADS:-src/llmvisor/data/workloads}
ENGINE=(--max-model-len 4096 --max-num-batched-tokens 2048 --max-num-seqs 32 --kv-cache-gib 4 --threads 2)
WHAT=${1:-all}  # all | sweep | workloads
LOCK=/tmp/llmvisor-quiet.lock
ME="record-traces $$"
while [[ -e $LOCK ]]; do echo "waiting for the machine: $(cat "$LOCK")"; sleep 20; done
echo "$ME $(date -u)" > "$LOCK"
trap 'grep -qs "^$ME " "$LOCK" && rm -f "$LOCK"' EXIT

if [[ $WHAT == all || $WHAT == sweep ]]; then
"$PYTHON" -m llmvisor.cli profile --plan sweep -o "$OUT/sweep.parquet" --run-id sweep-v2 \
  --points 40 --repeat 2 --max-decode-steps 64 --warmup-seconds 240 --canary-every 4 --seed 0 "${ENGINE[@]}"
fi
[[ $WHAT == all || $WHAT == workloads ]] || exit 0
"$PYTHON" -m llmvisor.cli profile --plan workload -o "$OUT/azure-conv.parquet" --run-id azure-conv-v2 \
  --workload "$WORKLOADS/azure-2023-conv.csv" --num-requests 160 --concurrency 16 --max-seconds 240 "${ENGINE[@]}"
"$PYTHON" -m llmvisor.cli profile --plan workload -o "$OUT/azure-code.parquet" --run-id azure-code-v2 \
  --workload "$WORKLOADS/azure-2023-code.csv" --num-requests 120 --concurrency 16 --max-seconds 240 "${ENGINE[@]}"
"$PYTHON" -m llmvisor.cli profile --plan workload -o "$OUT/arxiv-summarization.parquet" --run-id arxiv-summarization-v2 \
  --workload "$WORKLOADS/arxiv-summarization.csv" --num-requests 100 --concurrency 16 --max-seconds 240 "${ENGINE[@]}"
"$PYTHON" -m llmvisor.cli profile --plan workload -o "$OUT/multi-tenant.parquet" --run-id multi-tenant-v2 \
  --workload "$WORKLOADS/azure-2023-conv.csv" --workload "$WORKLOADS/azure-2023-code.csv" \
  --workload "$WORKLOADS/arxiv-summarization.csv" --start-row 1000 --num-requests 50 --concurrency 16 \
  --max-seconds 240 "${ENGINE[@]}"
"$PYTHON" -m llmvisor.cli profile --plan workload -o "$OUT/shared-documents.parquet" --run-id shared-documents-v2 \
  --workload "$WORKLOADS/azure-2023-conv.csv" --start-row 2000 --num-requests 160 --shared-documents 4 \
  --document-tokens 1536 --concurrency 16 --max-seconds 240 "${ENGINE[@]}"
