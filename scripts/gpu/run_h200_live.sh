#!/usr/bin/env bash
# Second device call: the device-only tests (tests/gpu), then `flyserve replay --live` on the three
# concurrency-8 seed workloads (every distinct step shape timed on the GPU, contexts rounded up to
# 256 tokens), under the seed's gfx950 profile and the calibrated h200 profile.
# Usage: bash scripts/gpu/run_h200_live.sh   (carry .device and .whl, as run_h200.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
tar -xJf .device/vllm-kernels.tar.xz -C /tmp/site || exit 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
python3 -m pytest -q tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tail -n 25 | tee "$OUT/gpu-tests.log"
echo "tests: $(( $(date +%s) - T0 )) s"
python3 -c "from flyserve.lab import bench; bench.warm_gpu()"
python3 -m flyserve.lab replay --live -w seed-8k-c8 -w seed-32k-c8 -w seed-60k-c8 -p gfx950 -p config/profiles/h200.yaml \
    --json > "$OUT/replay-live.json" 2> "$OUT/replay-live.err"
echo "rc=$? live: $(( $(date +%s) - T0 )) s"
tail -n 5 "$OUT/replay-live.err"
python3 -c "
import json; d=json.load(open('$OUT/replay-live.json'))
for r in d['results']: print(r['trace'], r['profile'], round(r['routed_over_oracle'], 4), round(r['unified_over_oracle'], 3), round(r['oracle_s'] * 1e3, 1), r['reasons'])
"
