#!/usr/bin/env bash
# The per-step host budget on the lent H200 (docs/performance.md section 10), in one device call:
# scripts/gpu/overhead_loop.py on this checkout ("after"), then the same loop on an older checkout
# of flyserve ("before", optional), each 30 interleaved rounds. Results land in $OUT.
# Needs: the vLLM kernel bundle (scripts/gpu/vllm-device-bundle.sh) and the wheels the device
# image lacks (pydantic, pydantic_core, annotated-types, typing-inspection, typing_extensions,
# opentelemetry-api/-sdk/-semantic-conventions; docs/performance.md section 8 says how).
# Then the select()/np.diff table alone (--host-only), HOST_RUNS times per checkout, alternating.
# Usage: bash scripts/gpu/run_h200_step_budget.sh BUNDLE.tar.xz WHEEL_DIR [BEFORE_CHECKOUT] [PAIRS] [HOST_RUNS]
set -uo pipefail
BUNDLE=$1
WHEELS=$2
BEFORE=${3:+$(cd "$3" && pwd)}
PAIRS=${4:-30}
HOST_RUNS=${5:-2}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
tar -xJf "$BUNDLE" -C /tmp/site || exit 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 11
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/device.txt"
T0=$(date +%s)
(cd "$HERE" && PYTHONPATH=/tmp/site:$HERE python3 scripts/gpu/overhead_loop.py "$OUT/step-budget-after.json" "$PAIRS") 2>&1 | tee "$OUT/step-budget.log"
echo "after: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/step-budget.log"
if [ -n "$BEFORE" ]; then
  (cd "$BEFORE" && PYTHONPATH=/tmp/site:$BEFORE python3 "$HERE/scripts/gpu/overhead_loop.py" "$OUT/step-budget-before.json" "$PAIRS") 2>&1 | tee -a "$OUT/step-budget.log"
  echo "before: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/step-budget.log"
fi
for i in $(seq 1 "$HOST_RUNS"); do
  (cd "$HERE" && PYTHONPATH=/tmp/site:$HERE python3 scripts/gpu/overhead_loop.py "$OUT/select-host-after-$i.json" --host-only) 2>&1 | tee -a "$OUT/select-host.log"
  if [ -n "$BEFORE" ]; then
    (cd "$BEFORE" && PYTHONPATH=/tmp/site:$BEFORE python3 "$HERE/scripts/gpu/overhead_loop.py" "$OUT/select-host-before-$i.json" --host-only) 2>&1 | tee -a "$OUT/select-host.log"
  fi
done
echo "total: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/step-budget.log"
