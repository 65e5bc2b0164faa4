"""`flyserve flydsl compile` with FlyDSL's real compiler (flydsl 0.4.2, and 0.5.0 where its venv is),
for gfx950, on this CPU.

Runs wherever scripts/flydsl-compile-setup.sh made .flydsl/ (or $FLYSERVE_FLYDSL_ROOT): a venv with
flydsl + CPU torch, FlyDSL checkouts, a ROCM_PATH with the device bitcode and ld.lld. The 0.4.2 venv
(.flydsl/venv) is required; the 0.5.0 one (.flydsl/venv-0.5.0, FLYDSL_VERSION=0.5.0 with the same
script) runs the same test where it exists and is skipped by name where it does not. CI has no
FlyDSL checkout: there this module SKIPS, by name, the one documented exception to FLYSERVE_CI's
"a missing dependency fails" (tests/_support.py, require_flydsl_checkout). With a checkout present
and the rest missing it fails under CI.

One run shows the warm start end to end (about a minute on 2 cores): the warm-up's two LPT
variants compile into a FlyDSL cache; then, in FlyDSL's run-only mode (FLYDSL_RUNTIME_RUN_ONLY=1:
a cache miss raises instead of compiling), the serving batches on vLLM's strided cache views load
from it - the strides are not in the cache key, the warm-up's compile covers serving - and the
deliberately wrong calls are rejected by FlyDSL with its own messages.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _support import _missing, require_flydsl_checkout

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("FLYSERVE_FLYDSL_ROOT") or REPO / ".flydsl")
TREE = require_flydsl_checkout(ROOT, "943152de")
PY = ROOT / "venv" / "bin" / "python"
ROCM = ROOT / "rocm"
if not PY.exists():
    _missing(
        "the FlyDSL compile venv", "run scripts/flydsl-compile-setup.sh", f"no {PY.relative_to(ROOT.parent)}"
    )
if not (ROCM / "amdgcn" / "bitcode" / "ockl.bc").exists() or not (ROCM / "llvm" / "bin" / "ld.lld").exists():
    _missing(
        "ROCM_PATH for the compiler",
        "run scripts/flydsl-compile-setup.sh",
        "no ockl.bc or ld.lld under rocm/",
    )

GEOMETRY = ["--num-heads", "4", "--num-kv-heads", "1", "--head-size", "128", "--page-size", "64"]


VENVS = {"0.4.2": PY, "0.5.0": ROOT / "venv-0.5.0" / "bin" / "python"}


@pytest.fixture(params=sorted(VENVS))
def flydsl_python(request) -> Path:
    """The venv of one flydsl release (0.5.0's is optional: FLYDSL_VERSION=0.5.0 setup makes it)."""
    py = VENVS[request.param]
    if not py.exists():
        pytest.skip(
            f"no flydsl {request.param} venv: FLYDSL_VERSION={request.param} scripts/flydsl-compile-setup.sh"
        )
    return py


def compile_check(py: Path, *args: str, timeout: float = 400) -> tuple[int, dict, str]:
    env = {
        **os.environ,
        "VLLM_FLYDSL_KERNELS_PATH": str(TREE),
        "ROCM_PATH": str(ROCM),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run([str(py), "-m", "flyserve.cli", "flydsl", "compile", *GEOMETRY, *args, "--json"],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, check=False)  # fmt: skip
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.timeout(900)
def test_warm_up_compiles_into_the_cache_and_serving_then_only_loads(tmp_path, flydsl_python):
    cache = tmp_path / "flydsl-cache"
    rc, rep, err = compile_check(flydsl_python, "--batch", "warm-up", "--cache-dir", str(cache))
    assert rc == 0, err
    assert rep["revision"]["causal_lpt"] is True and rep["flydsl_version"]
    key = rep["key"]  # the key's machine-dependent inputs, as this flydsl reads them
    assert key["flydsl"] == rep["flydsl_version"] and key["layout"] in ("build-folders", "function-folders")
    assert key["bitcode_in_key"] is (key["layout"] == "function-folders")
    assert key["bitcode_matches_flydsl"] in (None, True)  # flyserve's fingerprint is FlyDSL's own
    rows = {r["variant"]["name"]: r for r in rep["variants"]}
    assert sorted(rows) == ["warm-up-p64-lpt0", "warm-up-p64-lpt1"]
    for r in rows.values():
        assert r["status"] == "ok" and r["compiles"] == 1, r["summary"]
        (k,) = r["kernels"]
        assert k["symbol"] == "flash_attn_dualwave_swp_gfx950_kernel_0" and k["target"].endswith("gfx950")
        assert k["vgprs"] > 0 and k["lds_bytes"] > 0 and k["vgpr_spills"] == 0
    # LPT is a compile-time switch: two different code objects
    assert rows["warm-up-p64-lpt0"]["kernels"][0]["code_object_bytes"] != rows["warm-up-p64-lpt1"]["kernels"][0][
        "code_object_bytes"]  # fmt: skip
    pkl = sorted(p.name for p in cache.glob("*/*.pkl"))
    assert len(pkl) == 2, pkl

    rc, rep, err = compile_check(flydsl_python, "--batch", "serve", "--batch", "short", "--wrong-calls", "--cache-dir", str(cache),
                                 "--run-only")  # fmt: skip
    assert rc == 0, err
    served = [r for r in rep["variants"] if r["variant"]["batch"] in ("serve", "short")]
    assert [r["variant"]["name"] for r in served] == ["serve-p64-lpt0", "serve-p64-lpt1", "short-p64"]
    for r in served:
        assert (
            r["status"] == "ok"
            and r["compiles"] == 0
            and r["summary"].startswith("loaded from FlyDSL's cache")
        )
        assert r["vllm_layout_problem"] is None  # one KV head per rank: flyserve serves these in place
    # the serving batches' cache keys (strided K/V, two requests) are the warm-up's (contiguous, one)
    warm_keys = {k for r in rows.values() for k in r["cache_keys"]}
    assert {k for r in served for k in r["cache_keys"]} <= warm_keys
    assert sorted(p.name for p in cache.glob("*/*.pkl")) == pkl  # nothing new written
    wrong = {r["variant"]["name"]: r for r in rep["variants"] if r["variant"]["batch"] == "wrong"}
    assert all(r["status"] == "ok" and r["outcome"] == "raised" for r in wrong.values())
    assert "got 16" in wrong["wrong-page16"]["message"]
    assert "unexpected keyword argument 'softmax_scale'" in wrong["wrong-extra-keyword"]["message"]
