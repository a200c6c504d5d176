#!/usr/bin/env bash
# Run every whole-relay benchmark; --quick runs the short versions (< 5 minutes in total).
# Figures are printed as "RESULT name=value" lines; progress notes go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ARGS=("$@")
start=$(date +%s)
for b in ingest fanout replay memory growth; do
  echo "## bench/$b.py ${ARGS[*]:-}" >&2
  t0=$(date +%s)
  "$PY" "bench/$b.py" "${ARGS[@]}"
  echo "RESULT ${b}_bench_seconds=$(( $(date +%s) - t0 ))"
done
echo "RESULT all_bench_seconds=$(( $(date +%s) - start ))"
