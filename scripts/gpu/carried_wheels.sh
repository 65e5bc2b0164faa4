# Sourced by the scripts/gpu/*_h200.sh benchmarks that run the sidecar on a lent machine: checks
# WHEELS and OUT, installs the carried wheels (the packages the machine lacks) with --no-index
# --no-deps into a private folder (SITE, default /tmp/site), never into the system, and puts that
# folder and the checkout on PYTHONPATH. Then checks that the sidecar imports.
WHEELS=${WHEELS:?set WHEELS to a folder of wheels}
OUT=${OUT:?set OUT to the results folder}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
python3 -c 'import fastapi, uvicorn, pydantic, opentelemetry.sdk.trace, typer, flyserve.cli, flyserve.sidecar.app; print("imports ok")'
