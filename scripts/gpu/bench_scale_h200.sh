#!/usr/bin/env bash
# Runs benchmarks/bench_scale.py (8 engines x 8 ranks, 100 rank restarts, side by
# side with 2 ranks) on a lent machine whose 16 CPU cores nothing else shares, so its p99s say what
# the sidecar does rather than what an oversubscribed 2-core VM's scheduler does. No GPU is used.
#
# Usage, from the repository root on that machine:
#   [BENCH_ARGS="--restart-every 1.2"] WHEELS=<folder of cp312 wheels> OUT=<results folder> bash scripts/gpu/bench_scale_h200.sh
# WHEELS holds the packages the machine lacks (fastapi, starlette, uvicorn, pydantic and its set,
# opentelemetry api/sdk/semconv/otlp-http, watchfiles, grafana-foundation-sdk, prometheus_client
# 0.26); they are installed with --no-index --no-deps into a private folder, never into the system.
set -euo pipefail
source "$(dirname "$0")/carried_wheels.sh"
{
  echo "# $(date -u +%FT%TZ) $(uname -m), $(nproc) cores, $(python3 --version)"
  python3 -c 'import fastapi, uvicorn, pydantic, prometheus_client as p; from importlib.metadata import version as v; print(*(f"{n} {v(n)}" for n in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "typer")))'
  python3 benchmarks/bench_scale.py ${BENCH_ARGS:-}
  echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | tee "$OUT/bench-scale.txt"
