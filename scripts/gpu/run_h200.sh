#!/usr/bin/env bash
# Everything the lab measures on the lent H200, in one device call (see docs/performance.md):
#   calibrate (both block sizes) -> replay the six seed workloads -> check the cost model live
#   -> instrumentation overhead loop. Results land in $OUT (copied into results/gpu/ afterwards).
# Needs, carried with the working tree: .device/vllm-kernels.tar.xz (scripts/gpu/
# vllm-device-bundle.sh) and .whl/ (pydantic, opentelemetry, prometheus_client wheels: the
# device image lacks them).
# Usage: bash scripts/gpu/run_h200.sh [full|quick]
set -uo pipefail
MODE=${1:-full}
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
tar -xJf .device/vllm-kernels.tar.xz -C /tmp/site || exit 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
export PYTHONPATH=/tmp/site:$PWD
REPO=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$MODE" = quick ]; then GRID=quick; PAIRS=2; else GRID=default; PAIRS=30; fi
T0=$(date +%s)
( cd "$OUT" && python3 -m flyserve.lab calibrate --out-profile h200.yaml --out-costs h200.json \
    --grid "$GRID" --block-size 16 --block-size 128 --block-m 128 --partial /tmp/h200.partial.jsonl ) \
    2>&1 | tail -n 30 | tee "$OUT/calibrate.log"
echo "calibrate: $(( $(date +%s) - T0 )) s"
[ -f "$OUT/h200.yaml" ] || { echo "calibrate wrote no profile"; exit 12; }
python3 "$REPO/scripts/gpu/h200_lab.py" "$OUT" $([ "$MODE" = quick ] && echo quick) 2>&1 | tee "$OUT/lab.log"
echo "lab: $(( $(date +%s) - T0 )) s"
python3 "$REPO/scripts/gpu/overhead_loop.py" "$OUT/overhead.json" "$PAIRS" 2>&1 | tee -a "$OUT/lab.log"
echo "total: $(( $(date +%s) - T0 )) s"
