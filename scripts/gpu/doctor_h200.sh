#!/usr/bin/env bash
# `flyserve doctor --run` on the lent H200: the CUDA pair (TRITON_ATTN + FLASH_ATTN) from the vLLM
# 0.26 kernel bundle (scripts/gpu/vllm-device-bundle.sh), one device call. Writes doctor.json,
# doctor.txt and nvidia-smi.txt to $OUT (committed under results/gpu/<date>/).
# Run from a folder holding flyserve/ and config/ (a copy of the checkout):
#   bash scripts/gpu/doctor_h200.sh BUNDLE.tar.xz WHEEL_DIR
# WHEEL_DIR: pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions (cp312),
# which the device image lacks.
set -uo pipefail
BUNDLE=${1:?vllm kernel bundle}
WHL=${2:?wheel folder}
export PYTHONUNBUFFERED=1
SITE=/tmp/site
mkdir -p "$SITE"
tar -xJf "$BUNDLE" -C "$SITE" || exit 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl || exit 11
# flyserve's vllm.general_plugins entry point, written as `pip install` would write it (hatchling,
# flyserve's build backend, is not on the device image and nothing can be fetched there).
D="$SITE/flyserve-0.1.0.dist-info"
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: flyserve\nVersion: 0.1.0\n' > "$D/METADATA"
printf '[vllm.general_plugins]\nflyserve = flyserve.vllm.plugin:register\n' > "$D/entry_points.txt"
export PYTHONPATH="$SITE:$PWD"
export FLYSERVE_ATTENTION=1 FLYSERVE_PROFILE=h200 FLYSERVE_STATE_DIR=/tmp/flyserve-state
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/nvidia-smi.txt"
python3 -m flyserve.doctor --run --json > "$OUT/doctor.json" 2> "$OUT/doctor.stderr"
echo "doctor exit status: $?"
python3 -c "
import json, sys
from flyserve.doctor.cli import render
print(render(json.load(open(sys.argv[1]))))" "$OUT/doctor.json" | tee "$OUT/doctor.txt"
# the same with the block size FlyDSL needs, to see vLLM 0.26 answer it (text only)
python3 -m flyserve.doctor --block-size 64 2>/dev/null | grep -E "kv-block-size|fail" | tee -a "$OUT/doctor.txt"
tail -n 20 "$OUT/doctor.stderr"
