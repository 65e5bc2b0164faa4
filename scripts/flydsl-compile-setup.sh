#!/usr/bin/env bash
# Set up FlyDSL's gfx950 compiler on an x86-64 Debian/Ubuntu CPU machine (an image builder, a laptop, CI
# with the extra) for `flyserve flydsl compile`. Everything goes under .flydsl/ (ignored by git):
#   .flydsl/venv/            torch 2.13.0 (CPU), numpy, flydsl 0.4.2, flyserve (editable, no extras)
#   .flydsl/venv-<version>/  the same with another flydsl (FLYDSL_VERSION=0.5.0: .flydsl/venv-0.5.0)
#   .flydsl/FlyDSL-<rev>/    each FlyDSL revision's kernels/ package (the flydsl wheel lacks it): a copy of
#                            third_party/flydsl/<rev>/ (vendored in this repository: the files flyserve's
#                            call imports, with PROVENANCE.json; checked by sha256 before use), or with
#                            FLYDSL_GIT, or for a revision not vendored, `git archive` of the whole tree
#   .flydsl/rocm/            ROCM_PATH for the compiler: amdgcn/bitcode (Debian's rocm-device-libs,
#                            unpacked with dpkg -x, not installed) and llvm/bin/ld.lld (Debian's lld-22)
#   .flydsl/env.sh           the environment `flyserve flydsl compile` needs (source it); with
#                            FLYDSL_VERSION set to another version, .flydsl/env-<version>.sh
# Usage: scripts/flydsl-compile-setup.sh [FLYDSL_GIT]
#   FLYDSL_GIT (argument or environment): a git directory or clone of ROCm/FlyDSL holding the revisions,
#   for whole trees; without it, the vendored copy is used where third_party/flydsl/ has the revision
#   (no network: CI cannot reach github.com), else https://github.com/ROCm/FlyDSL is cloned (bare)
#   into .flydsl/FlyDSL.git. A tree already under .flydsl/ is kept as it is.
#   FLYDSL_REVS (environment): the revisions, default "943152de 11c4174d" (PR #1056 and main 2026-08-21).
#   FLYDSL_VERSION (environment): the flydsl wheel, default 0.4.2; flyserve is tested with 0.4.2 and 0.5.0.
#     The trees, the bitcode and lld are shared by every venv.
#   TORCH_INDEX_URL (environment): where to get the CPU build of torch, if pip would pick another.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.flydsl
PY=${PYTHON:-python3}
REVS=${FLYDSL_REVS:-943152de 11c4174d}
GITDIR=${1:-${FLYDSL_GIT:-}}
DEFAULT_FLYDSL=0.4.2
FLYDSL=${FLYDSL_VERSION:-$DEFAULT_FLYDSL}
case "$FLYDSL" in 0.4.2|0.5.0) ;; *) printf 'FLYDSL_VERSION=%s: flyserve is tested with 0.4.2 and 0.5.0\n' "$FLYDSL" >&2; exit 2;; esac
if [ "$FLYDSL" = "$DEFAULT_FLYDSL" ]; then VENV=$ROOT/venv ENVSH=$ROOT/env.sh; else VENV=$ROOT/venv-$FLYDSL ENVSH=$ROOT/env-$FLYDSL.sh; fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
say() { printf '\033[1m[flydsl-setup]\033[0m %s\n' "$*"; }
mkdir -p "$ROOT"

[ -x "$VENV/bin/python" ] || { say "creating .flydsl/${VENV##*/}"; $PY -m venv "$VENV"; }
pip() { "$VENV/bin/python" -m pip "$@"; }
if ! "$VENV/bin/python" -c 'import flydsl, torch, numpy' 2>/dev/null; then
  say "installing torch 2.13.0 (CPU), numpy, flydsl $FLYDSL"
  # The CPU build of torch is enough (nothing runs on a GPU). Where pip would otherwise fetch the
  # CUDA build, set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
  pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  pip install -q numpy "flydsl==$FLYDSL"
fi
pip show -q flyserve >/dev/null 2>&1 || { say "installing flyserve (editable)"; pip install -q -e .; }

# A vendored copy is used only if every file its PROVENANCE.json lists has its sha256 and its commit
# is the revision asked for: one that does not match is refused, not used (flyserve would label it
# with a commit it is not). Prints what is wrong; status 1 then.
vendored_problem() {
  PYTHONPATH=$PWD "$VENV/bin/python" - "$1" "$2" <<'PY'
import sys
from flyserve.vllm.flydsl_tree import provenance_problem
record, why = provenance_problem(sys.argv[1])
if why is None and not record["commit"].startswith(sys.argv[2]):
    why = f"its commit is {record['commit']}, not {sys.argv[2]}"
if why:
    print(why)
    sys.exit(1)
PY
}
for rev in $REVS; do
  vendored=third_party/flydsl/${rev:0:8}
  if [ ! -d "$ROOT/FlyDSL-$rev/kernels/attention" ] && [ -z "$GITDIR" ] && [ -f "$vendored/PROVENANCE.json" ]; then
    if ! why=$(vendored_problem "$vendored" "$rev"); then
      printf '%s: %s; refusing it (scripts/flydsl_vendor.py rewrites it from a FlyDSL clone)\n' "$vendored" "$why" >&2
      exit 1
    fi
    say "FlyDSL $rev -> .flydsl/FlyDSL-$rev (copy of $vendored, vendored: the files flyserve's call imports)"
    rm -rf "$ROOT/FlyDSL-$rev.part"
    cp -R "$vendored" "$ROOT/FlyDSL-$rev.part"
    rm -rf "$ROOT/FlyDSL-$rev"  # an interrupted earlier run's partial tree: mv would nest the copy in it
    mv "$ROOT/FlyDSL-$rev.part" "$ROOT/FlyDSL-$rev"
  fi
  if [ ! -d "$ROOT/FlyDSL-$rev/kernels/attention" ]; then
    if [ -z "$GITDIR" ]; then
      GITDIR=$ROOT/FlyDSL.git
      [ -d "$GITDIR" ] || { say "cloning ROCm/FlyDSL"; git clone -q --bare https://github.com/ROCm/FlyDSL "$GITDIR"; }
    fi
    say "FlyDSL $rev -> .flydsl/FlyDSL-$rev"
    mkdir -p "$ROOT/FlyDSL-$rev"
    git --git-dir "$(git -C "$GITDIR" rev-parse --absolute-git-dir 2>/dev/null || echo "$GITDIR")" archive "$rev" | tar -x -C "$ROOT/FlyDSL-$rev"
  fi
done

# MLIR's ROCDL serializer links the kernel with $ROCM_PATH/amdgcn/bitcode/ockl.bc (the kernel calls
# __ockl_get_num_groups) and runs $ROCM_PATH/llvm/bin/ld.lld to make the HSA code object.
BC=$ROOT/debs/x/usr/lib/x86_64-linux-gnu/amdgcn/bitcode
if [ ! -f "$BC/ockl.bc" ]; then
  say "unpacking Debian's rocm-device-libs (dpkg -x, not installed)"
  mkdir -p "$ROOT/debs"
  (cd "$ROOT/debs" && { apt-get download rocm-device-libs 2>/dev/null || { $SUDO apt-get update -qq && apt-get download rocm-device-libs; }; })
  dpkg -x "$ROOT"/debs/rocm-device-libs_*.deb "$ROOT/debs/x"
fi
LLD=/usr/lib/llvm-22/bin/ld.lld
if [ ! -x "$LLD" ]; then
  say "installing Debian's lld-22"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q --no-install-recommends lld-22 llvm-22 >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -q --no-install-recommends lld-22 llvm-22 >/dev/null; }
fi
mkdir -p "$ROOT/rocm/amdgcn" "$ROOT/rocm/llvm/bin"
ln -sfn "$BC" "$ROOT/rocm/amdgcn/bitcode"
ln -sfn "$LLD" "$ROOT/rocm/llvm/bin/ld.lld"
[ -x /usr/lib/llvm-22/bin/llvm-readelf ] && ln -sfn /usr/lib/llvm-22/bin/llvm-readelf "$ROOT/rocm/llvm/bin/llvm-readelf"

first=${REVS%% *}
cat > "$ENVSH" <<ENV
# source .flydsl/env.sh: the environment for \`flyserve flydsl compile\` (written by scripts/flydsl-compile-setup.sh)
export ROCM_PATH=$ROOT/rocm
export VLLM_FLYDSL_KERNELS_PATH=\${VLLM_FLYDSL_KERNELS_PATH:-$ROOT/FlyDSL-$first}
export PATH=$VENV/bin:\$PATH
ENV
"$VENV/bin/python" -c 'import flydsl, torch; print("flydsl", flydsl.__version__, "| torch", torch.__version__)'
say "done: source .flydsl/$(basename "$ENVSH"); FlyDSL trees: $(cd "$ROOT" && ls -d FlyDSL-* | grep -v '\.git$' | tr '\n' ' ')"
