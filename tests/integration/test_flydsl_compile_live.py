"""`flyserve flydsl compile` with FlyDSL's real compiler (flydsl 0.4.2 and 0.5.0), for gfx950, on
this CPU, for both pinned FlyDSL revisions.

Runs wherever scripts/flydsl-compile-setup.sh made .flydsl/ (or $FLYSERVE_FLYDSL_ROOT): a venv per
flydsl release with CPU torch (.flydsl/venv for 0.4.2, .flydsl/venv-0.5.0 with FLYDSL_VERSION=0.5.0),
the FlyDSL trees .flydsl/FlyDSL-943152de and FlyDSL-11c4174d (copies of the vendored
third_party/flydsl/<rev>/ unless a FlyDSL git directory was given), a ROCM_PATH with the device
bitcode and ld.lld. CI (.ci/run) runs the setup for both releases (CI_VERSIONS), so under
FLYSERVE_CI a missing tree, bitcode, lld or venv FAILS (a release taken out of CI_VERSIONS would be
skipped by name; docs/vllm.md, "Compile check in CI"). Elsewhere anything missing skips, saying
which setup makes it.

Two checks:
* the warm start end to end (75-280 s per flydsl on 2 shared cores, FlyDSL 943152de, page 64): the
  warm-up's two LPT variants compile into a FlyDSL cache; then, in FlyDSL's run-only mode
  (FLYDSL_RUNTIME_RUN_ONLY=1: a cache miss raises instead of compiling), the serving batches on
  vLLM's strided cache views load from it - the strides are not in the cache key, the warm-up's
  compile covers serving - and the deliberately wrong calls are rejected by FlyDSL with its own
  messages;
* every variant a deployment runs, under flydsl 0.5.0 (what `pip install 'flyserve[rocm]'`
  resolves to), for both revisions: Llama-3.1-8B at TP 8 with --wrong-calls, the command of
  results/flydsl/README.md, each code object's facts equal to the ones recorded there (15
  variants on 943152de, 8 on 11c4174d; 137-201 s and 54-107 s measured here, docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _support import _missing, require_flydsl_checkout, under_ci

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("FLYSERVE_FLYDSL_ROOT") or REPO / ".flydsl")
REVISIONS = {  # the pinned two (scripts/flydsl-compile-setup.sh FLYDSL_REVS, third_party/flydsl/)
    "943152de": "943152de799bf9983ab2028629c6e523abd199a7",
    "11c4174d": "11c4174d82b7491c2d08d5828a254183f2a8b959",
}
TREES = {rev: require_flydsl_checkout(ROOT, rev) for rev in REVISIONS}
TREE = TREES["943152de"]
ROCM = ROOT / "rocm"
if not (ROCM / "amdgcn" / "bitcode" / "ockl.bc").exists() or not (ROCM / "llvm" / "bin" / "ld.lld").exists():
    _missing(
        "ROCM_PATH for the compiler",
        "run scripts/flydsl-compile-setup.sh",
        "no ockl.bc or ld.lld under rocm/",
    )

GEOMETRY = ["--num-heads", "4", "--num-kv-heads", "1", "--head-size", "128", "--page-size", "64"]
LLAMA_TP8 = ["--model-config", "tests/data/hf_configs/llama-3.1-8b-instruct.json", "--tp", "8"]
RESULTS = REPO / "results" / "flydsl"
# The code-object facts that must equal results/flydsl/<rev>.json's (recorded with flydsl 0.4.2;
# 0.5.0 builds the same code objects)
FACTS = ("symbol", "target", "code_object_bytes", "vgprs", "agprs", "sgprs", "lds_bytes", "scratch_bytes",
         "vgpr_spills", "sgpr_spills", "wavefront_size")  # fmt: skip

VENVS = {"0.4.2": ROOT / "venv" / "bin" / "python", "0.5.0": ROOT / "venv-0.5.0" / "bin" / "python"}
CI_VERSIONS = ("0.4.2", "0.5.0")  # the venvs .ci/run sets up: under FLYSERVE_CI these must exist


def venv_python(version: str) -> Path:
    """The venv of one flydsl release, or fail (under CI, for CI_VERSIONS) / skip by name."""
    py = VENVS[version]
    if not py.exists():
        setup = f"FLYDSL_VERSION={version} scripts/flydsl-compile-setup.sh"
        if under_ci() and version not in CI_VERSIONS:
            pytest.skip(
                f"no flydsl {version} venv: CI sets up {', '.join(CI_VERSIONS)} only (.ci/run); {setup}"
            )
        _missing(f"the flydsl {version} compile venv", f"run {setup}", f"no {py.relative_to(ROOT.parent)}")
    return py


@pytest.fixture(params=sorted(VENVS))
def flydsl_python(request) -> Path:
    return venv_python(request.param)


def compile_check(
    py: Path, *args: str, tree: Path = TREE, geometry: list[str] = GEOMETRY, timeout: float = 400
) -> tuple[int, dict, str]:
    env = {
        **os.environ,
        "VLLM_FLYDSL_KERNELS_PATH": str(tree),
        "ROCM_PATH": str(ROCM),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run([str(py), "-m", "flyserve.cli", "flydsl", "compile", *geometry, *args, "--json"],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, check=False)  # fmt: skip
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.timeout(900)
def test_warm_up_compiles_into_the_cache_and_serving_then_only_loads(tmp_path, flydsl_python):
    cache = tmp_path / "flydsl-cache"
    # two children at once writing one FlyDSL cache (its per-key file lock and atomic replace)
    rc, rep, err = compile_check(
        flydsl_python, "--batch", "warm-up", "--cache-dir", str(cache), "--jobs", "2"
    )
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


# --jobs: 943152de's 15 variants two at a time, 11c4174d's 8 one at a time (the default): the
# report, code-object facts included, is the recorded one either way.
JOBS = {"943152de": "2", "11c4174d": "1"}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("revision", sorted(REVISIONS))
def test_every_variant_compiles_under_flydsl_050_as_recorded(revision):
    """The deployment's whole set (results/flydsl/README.md's command), flydsl 0.5.0, one revision."""
    py = venv_python("0.5.0")
    tree = TREES[revision]
    rc, rep, err = compile_check(py, "--wrong-calls", "--jobs", JOBS[revision], tree=tree, geometry=LLAMA_TP8,
                                 timeout=1500)  # fmt: skip
    assert rc == 0, err[-4000:]
    assert rep["flydsl_version"] == "0.5.0" and rep["key"]["layout"] == "function-folders"
    if (tree / "PROVENANCE.json").is_file() and not (tree / ".git").exists():  # the vendored copy
        assert rep["revision"]["commit"] == REVISIONS[revision]
    recorded = json.loads((RESULTS / f"{revision}.json").read_text())["variants"]
    assert [r["variant"]["name"] for r in rep["variants"]] == [r["variant"]["name"] for r in recorded]
    for got, want in zip(rep["variants"], recorded, strict=True):
        name = got["variant"]["name"]
        assert got["status"] == "ok" and got["outcome"] == want["outcome"], (name, got["summary"])
        assert [{f: k[f] for f in FACTS} for k in got["kernels"]] == [
            {f: k[f] for f in FACTS} for k in want["kernels"]
        ], name
