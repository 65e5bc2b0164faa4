#!/usr/bin/env bash
# Runs benchmarks/bench_sidecar_streams.py on a lent machine (e.g. the H200 box's 16 CPU cores)
# where nothing else competes for the CPUs, so its p99s say whether 100 streams keep
# /dispatch-stats "within 2x of idle".
#
# Usage, from the repository root on that machine:
#   [BENCH_ARGS="--duration 3"] WHEELS=<folder of cp312 wheels> OUT=<results folder> bash scripts/gpu/bench_sidecar_streams_h200.sh [RUNS]
# WHEELS holds the packages the machine lacks (fastapi, starlette, uvicorn, h11, anyio, sniffio,
# pydantic and its set, opentelemetry api/sdk/semconv, watchfiles, click, typer, uvloop, ...);
# they are installed with --no-index --no-deps into a private folder, never into the system.
set -euo pipefail
RUNS=${1:-3}
source "$(dirname "$0")/carried_wheels.sh"
{
  echo "# $(date -u +%FT%TZ) $(uname -m), $(nproc) cores, $(python3 --version)"
  python3 -c 'import fastapi, uvicorn, pydantic; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)'
  for i in $(seq 1 "$RUNS"); do
    echo "## run $i of $RUNS"
    python3 benchmarks/bench_sidecar_streams.py --clients 100 ${BENCH_ARGS:-}
  done
} 2>&1 | tee "$OUT/sidecar-streams.txt"
