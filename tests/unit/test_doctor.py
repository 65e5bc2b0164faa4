"""`flyserve doctor` on this CPU machine (real vLLM CPU build), and its ROCm checks against the
FlyDSL fakes built from FlyDSL's real signature (no gfx950 here)."""

from __future__ import annotations

import json

import pytest
from _support import module_requires
from contract_fakes import (
    FLYDSL_REVISIONS,
    FakeFlyDSL,
    fake_aiter_unified_attention,
    load_contract,
    signature_of,
)
from typer.testing import CliRunner

from flyserve.doctor import checks

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm", "torch")  # imported when a test runs, not at collection


def by_name(rep_checks):
    return {c["name"] if isinstance(c, dict) else c.name: c for c in rep_checks}


def test_doctor_json_on_the_cpu_machine_says_why_rocm_is_unavailable(monkeypatch, tmp_path):
    from flyserve.cli import app

    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLYSERVE_ATTENTION", "1")
    res = CliRunner().invoke(app, ["doctor", "--json", "--run"])
    rep = json.loads(res.stdout)
    assert res.exit_code == (1 if rep["summary"]["fail"] else 0)
    c = by_name(rep["checks"])
    assert c["platform"]["status"] == "ok" and c["platform"]["detail"].startswith("CPU")
    assert c["rocm-pair"]["status"] == "warn" and "no ROCm GPU" in c["rocm-pair"]["detail"]
    assert "VLLM_FLYDSL_KERNELS_PATH" in c["rocm-pair"]["fix"]
    assert c["vllm"]["status"] == "ok" and c["composite-api"]["status"] == "ok"
    assert c["plugin"]["status"] == "ok" and c["state-dir"]["status"] == "ok"
    assert c["run"]["status"] == "warn" and "nothing timed" in c["run"]["detail"]
    assert rep["summary"]["fail"] == 0, [x for x in rep["checks"] if x["status"] == "fail"]


@pytest.mark.parametrize("revision", sorted(FLYDSL_REVISIONS))
def test_rocm_checks_with_flydsl_present(monkeypatch, revision):
    fake = FakeFlyDSL(revision)
    fake.install(monkeypatch)
    calls: list = []
    import sys
    import types

    monkeypatch.setitem(sys.modules, "aiter.ops.triton.unified_attention",
                        types.SimpleNamespace(unified_attention=fake_aiter_unified_attention(calls)))  # fmt: skip
    c = by_name(checks.rocm_pair_checks("gfx950"))
    assert c["rocm-unified"].status == "ok" and "binds" in c["rocm-unified"].detail
    assert "binds" in c["rocm-flydsl"].detail
    assert ("#1056" in c["rocm-flydsl"].detail) is (revision != "main-11c4174d")
    if revision == "main-11c4174d":  # copies any strided K/V view: vLLM 0.32 never runs FlyDSL with it
        assert c["rocm-flydsl"].status == "warn"
        assert "prefill path will stay off under vLLM's AITER cache layout" in c["rocm-flydsl"].detail
        assert "#1056" in c["rocm-flydsl"].fix
    else:
        assert c["rocm-flydsl"].status == "ok" and "one KV head per rank" in c["rocm-flydsl"].detail
    assert c["gpu-arch"].status == "ok"
    c = by_name(checks.rocm_pair_checks("gfx942"))
    assert c["gpu-arch"].status == "warn" and "gfx942" in c["gpu-arch"].detail


def test_a_flydsl_whose_signature_moved_fails_the_bind_check(monkeypatch):
    contract = load_contract(FLYDSL_REVISIONS["pr1056-943152de"])
    contract["parameters"] = [p for p in contract["parameters"] if p["name"] != "seqlen_k"]
    moved = signature_of(contract)

    def fn(*a, **k):
        moved.bind(*a, **k)

    fn.__signature__ = moved
    from flyserve.vllm.flydsl_kernel import detect_revision

    err = checks.binds("flydsl_dualwave", fn, detect_revision(fn))
    assert err is not None and "seqlen_k" in err


def test_missing_flydsl_fails_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "nowhere"))
    c = by_name(checks.rocm_pair_checks("gfx950"))
    assert c["rocm-flydsl"].status == "fail"
    assert "VLLM_FLYDSL_KERNELS_PATH" in c["rocm-flydsl"].detail and "git clone" in c["rocm-flydsl"].fix
    assert c["rocm-unified"].status == "fail"  # no aiter on this machine either


def test_block_size_checks(monkeypatch):
    from flyserve.vllm import device

    FakeFlyDSL("pr1056-943152de").install(monkeypatch)
    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx950")  # FlyDSL's sizes are declared on gfx950 only
    assert "vLLM picks 64" in checks.check_block_size("rocm", None).detail
    bad = checks.check_block_size("rocm", 16)
    assert bad.status == "warn" and "--block-size 64" in bad.fix
    assert checks.check_block_size("rocm", 128).status == "ok"


def test_render_is_one_line_per_check_with_fixes():
    from flyserve.doctor.cli import render

    rep = {"time": "t", "host": "h", "python": "3", "run": [], "summary": {"ok": 1, "warn": 1, "fail": 0},
           "checks": [{"name": "a", "status": "ok", "detail": "fine", "fix": ""},
                      {"name": "bb", "status": "warn", "detail": "meh", "fix": "do x"}]}  # fmt: skip
    text = render(rep)
    assert "  ok    a   fine" in text and "WARN  bb  meh" in text and "fix: do x" in text
