#!/usr/bin/env bash
# Reproduce results/flydsl/ (about 10 minutes on 2 cores). Needs scripts/flydsl-compile-setup.sh first.
# usage: results/flydsl/run.sh [all|warm-start]
set -uo pipefail
cd "$(dirname "$0")/../.."
source .flydsl/env.sh
OUT=results/flydsl
CFG=tests/data/hf_configs/llama-3.1-8b-instruct.json
if [ "${1:-all}" = all ]; then
for rev in 943152de 11c4174d; do
  flyserve flydsl compile --model-config $CFG --tp 8 --wrong-calls --kernels-path .flydsl/FlyDSL-$rev \
    --json-out $OUT/$rev.json > $OUT/$rev.txt
done
# more than one KV head per rank (TP 2: 4): compiles, but flyserve keeps the path off on vLLM's cache
flyserve flydsl compile --model-config $CFG --tp 2 --page-size 64 --batch serve \
  --kernels-path .flydsl/FlyDSL-943152de --json-out $OUT/943152de-tp2-serve.json > $OUT/943152de-tp2-serve.txt
# one code object kept for the unit tests of the metadata reader
rm -rf "$OUT/code-objects.tmp"
flyserve flydsl compile --model-config $CFG --tp 8 --page-size 64 --batch warm-up \
  --kernels-path .flydsl/FlyDSL-943152de --save-objects "$OUT/code-objects.tmp" > /dev/null
mkdir -p $OUT/code-objects
cp "$OUT/code-objects.tmp/warm-up-p64-lpt1.0.hsaco" $OUT/code-objects/943152de-warm-up-p64-lpt1.0.hsaco
rm -rf "$OUT/code-objects.tmp"
fi
# warm start: the warm-up's kernels into a FlyDSL cache, then the serving batches in FlyDSL's
# run-only mode (a cache miss raises), then the same on an empty cache (must fail)
CACHE=$(mktemp -d)
EMPTY=$(mktemp -d)
{
  echo "\$ flyserve flydsl compile --model-config $CFG --tp 8 --batch warm-up --cache-dir \$CACHE"
  flyserve flydsl compile --model-config $CFG --tp 8 --batch warm-up --cache-dir "$CACHE" --kernels-path .flydsl/FlyDSL-943152de
  echo; echo "\$ find \$CACHE -name '*.pkl'"
  (cd "$CACHE" && find . -name '*.pkl' -printf '%P %s bytes\n' | sort)
  echo; echo "\$ flyserve flydsl compile --model-config $CFG --tp 8 --batch serve --batch short --wrong-calls --cache-dir \$CACHE --run-only"
  flyserve flydsl compile --model-config $CFG --tp 8 --batch serve --batch short --wrong-calls --cache-dir "$CACHE" --run-only --kernels-path .flydsl/FlyDSL-943152de
  echo "(exit $?)"
  echo; echo "\$ find \$CACHE -name '*.pkl' | wc -l   # nothing new written"
  find "$CACHE" -name '*.pkl' | wc -l
  echo; echo "\$ flyserve flydsl compile --model-config $CFG --tp 8 --page-size 64 --batch serve --cache-dir \$EMPTY --run-only   # control: an empty cache"
  flyserve flydsl compile --model-config $CFG --tp 8 --page-size 64 --batch serve --cache-dir "$EMPTY" --run-only --kernels-path .flydsl/FlyDSL-943152de
  echo "(exit $?)"
} > $OUT/warm-start.txt 2>&1
sed -i "s|$CACHE|\$CACHE|g; s|$EMPTY|\$EMPTY|g; s|$PWD/||g" $OUT/warm-start.txt
rm -rf "$CACHE" "$EMPTY"
