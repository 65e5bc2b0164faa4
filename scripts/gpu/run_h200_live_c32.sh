#!/usr/bin/env bash
# Third device call: `flyserve replay --live` on the three concurrency-32 seed workloads, one
# process per workload (smallest first) so a time-out keeps what finished.
# Usage: bash scripts/gpu/run_h200_live_c32.sh   (carry .device and .whl, as run_h200.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
tar -xJf .device/vllm-kernels.tar.xz -C /tmp/site || exit 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
for w in seed-8k-c32 seed-32k-c32 seed-60k-c32; do
  python3 -m flyserve.lab replay --live -w "$w" -p gfx950 -p config/profiles/h200.yaml --json \
      > "$OUT/replay-live-$w.json" 2>> "$OUT/replay-live-c32.err"
  echo "$w rc=$? at $(( $(date +%s) - T0 )) s"
  python3 -c "
import json; d=json.load(open('$OUT/replay-live-$w.json'))
for r in d['results']: print(r['trace'], r['profile'], round(r['routed_over_oracle'], 4), round(r['unified_over_oracle'], 3), round(r['oracle_s'] * 1e3, 1), r['reasons'])
"
done
