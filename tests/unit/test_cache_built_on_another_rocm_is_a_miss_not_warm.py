"""A FlyDSL 0.5.0 cache built with one ROCm device bitcode is a miss on a host with another, and
flyserve says so: the warm-up's tally, the cache check's counts and `flyserve doctor`'s flydsl row.

flydsl 0.5.0 names each entry ``{function}/{sha256(flydsl_key + "\\n" + artifact_key)}.pkl`` and
``flydsl_key`` ends with ``rocm-bitcode:<sha256 of every amdgcn/bitcode/*.bc, name + NUL + bytes>``
(compiler/jit_function.py 198-317, 552-554; compiler/backends/rocm.py 23-32, 201-211). The fake
below files entries exactly so, with real-format artifacts (flydsl_cache_fakes.artifact_bytes), so
the bitcode decides hit or miss as it does in FlyDSL; no FlyDSL is needed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from _support import require_module
from flydsl_cache_fakes import FUNCTION, artifact_bytes, write_entry

from flyserve.vllm import flydsl_cache as fc
from flyserve.vllm import flydsl_kernel as fk
from flyserve.vllm import flydsl_key
from flyserve.vllm.flydsl_layout import FUNCTION_FOLDERS

WARM = {"num_heads": 2, "num_kv_heads": 1, "head_size": 64, "page_size": 64}


def rocm(tmp_path: Path, name: str, ockl: bytes) -> Path:
    """A ROCM_PATH with two device-library files, as FlyDSL reads them."""
    bc = tmp_path / name / "amdgcn" / "bitcode"
    bc.mkdir(parents=True)
    (bc / "ockl.bc").write_bytes(ockl)
    (bc / "ocml.bc").write_bytes(b"ocml bitcode")
    return tmp_path / name


class FakeFlyDSL05:
    """``flydsl_flash_attn_func`` with flydsl 0.5.0's disk cache: the entry's name hashes the
    toolchain (version + device bitcode of $ROCM_PATH) with the artifact key (one per LPT value)."""

    def __init__(self) -> None:
        self.compiled: list[bool] = []

    def __call__(self, q: Any, k: Any, v: Any, **kw: Any) -> None:
        root = Path(os.environ[fk.CACHE_DIR_ENV]) / FUNCTION
        toolchain = f"flydsl:0.5.0-...-rocm-bitcode:{flydsl_key.bitcode_fingerprint(os.environ['ROCM_PATH'])}"
        artifact = hashlib.sha256(f"lpt={kw.get('causal_lpt')}".encode()).hexdigest()
        name = hashlib.sha256(f"{toolchain}\n{artifact}".encode()).hexdigest() + ".pkl"
        hit = (root / name).exists()
        if not hit:
            write_entry(root, name, artifact_bytes())
        self.compiled.append(not hit)


@pytest.fixture
def host_050(monkeypatch):
    """This host runs flydsl 0.5.0 (its layout detected as FUNCTION_FOLDERS), no native module here."""
    monkeypatch.setattr(flydsl_key, "flydsl_version", lambda: "0.5.0")
    monkeypatch.setattr(flydsl_key, "installed_layout", lambda: FUNCTION_FOLDERS)


def test_fingerprint_is_flydsls_hash_of_names_and_bytes(tmp_path):
    root = rocm(tmp_path, "a", b"ockl A")
    want = hashlib.sha256(b"ockl.bc\0ockl A" + b"ocml.bc\0ocml bitcode").hexdigest()  # name order
    assert flydsl_key.bitcode_fingerprint(root) == want
    (root / "amdgcn" / "bitcode" / "ockl.bc").write_bytes(b"ockl B")
    assert flydsl_key.bitcode_fingerprint(root) != want  # one byte of the library changes the key
    assert flydsl_key.bitcode_fingerprint(tmp_path / "none") == flydsl_key.EMPTY_SHA256


def build_cache(tmp_path: Path, monkeypatch: Any, rocm_root: Path) -> tuple[Path, FakeFlyDSL05]:
    """What `flyserve flydsl compile --cache-dir` leaves: both LPT entries, listed with their key inputs."""
    torch = require_module("torch")
    cache = tmp_path / "cache"
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    monkeypatch.delenv(fk.CACHE_ENABLE_ENV, raising=False)
    monkeypatch.setenv("ROCM_PATH", str(rocm_root))
    fake = FakeFlyDSL05()
    kernel = fk.FlyDSLKernel(fake, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    fk.warm_up(kernel, dtype=torch.bfloat16, device="cpu", is_capturing=lambda: False, **WARM)
    built = flydsl_key.host_key_inputs(kernels="fake")
    assert built.bitcode == flydsl_key.bitcode_fingerprint(rocm_root)
    rows = [(rel, "gfx950", {"name": f"warm-up-p64-lpt{i}", "num_heads": 2, "num_kv_heads": 1, "head_size": 64,
                             "dtype": "bf16", "page_size": 64, "lpt": bool(i)})
            for i, rel in enumerate(sorted(fk.flydsl_cache_entries()))]  # fmt: skip
    assert fc.record_entries(cache, rows, key=built) == 2
    return cache, fake


def test_a_host_with_other_bitcode_misses_and_says_stale_not_warm(tmp_path, monkeypatch, caplog, host_050):
    torch = require_module("torch")
    cache, fake = build_cache(tmp_path, monkeypatch, rocm(tmp_path, "debian", b"Debian 5.2.3 ockl"))
    assert fake.compiled == [True, True]
    kernel = fk.FlyDSLKernel(fake, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))

    monkeypatch.setenv("ROCM_PATH", str(rocm(tmp_path, "opt-rocm", b"ROCm 7 ockl")))  # the serving host
    host = flydsl_key.host_key_inputs()
    check = fc.check_cache_dir(cache)
    assert len(check.entries) == 2 and set(check.stale(host).values()) == {"another ROCm"}
    counts = check.counts(fc.Deployment(2, 1, 64, "bf16", (64,)), host)
    assert counts["stale_rocm"] == 2 and counts["for_this_deployment"] == 0  # listed for it, but no hit
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, dtype=torch.bfloat16, device="cpu", is_capturing=lambda: False, **WARM)
    assert fake.compiled[2:] == [True, True]  # FlyDSL missed both
    assert (
        "0 variants from cache, 2 compiled, 2 stale entries from another flydsl or another ROCm"
        in caplog.text
    )
    assert "2 stale (0 from another flydsl, 2 from another ROCm: never a hit here)" in caplog.text

    caplog.clear()  # the next start on that host: its own entries are warm, the builder's still stale
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, dtype=torch.bfloat16, device="cpu", is_capturing=lambda: False, **WARM)
    assert fake.compiled[4:] == [False, False]
    assert "2 variants from cache, 0 compiled, 2 stale entries" in caplog.text


def test_the_same_bitcode_is_warm(tmp_path, monkeypatch, caplog, host_050):
    torch = require_module("torch")
    root = rocm(tmp_path, "opt-rocm", b"ROCm 7 ockl")
    cache, fake = build_cache(tmp_path, monkeypatch, root)
    kernel = fk.FlyDSLKernel(fake, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, dtype=torch.bfloat16, device="cpu", is_capturing=lambda: False, **WARM)
    assert fake.compiled[2:] == [False, False]
    assert "2 variants from cache, 0 compiled, 0 stale entries" in caplog.text
    host = flydsl_key.host_key_inputs()
    assert (
        fc.check_cache_dir(cache).counts(fc.Deployment(2, 1, 64, "bf16", (64,)), host)["for_this_deployment"]
        == 2
    )


def test_a_042_cache_under_050_is_stale_from_another_flydsl(tmp_path, host_050, monkeypatch):
    cache = tmp_path / "cache"
    write_entry(cache / f"{FUNCTION}_{'a' * 32}", "3a4665933b24458b.pkl")  # flydsl 0.4.2's layout
    monkeypatch.setenv("ROCM_PATH", str(rocm(tmp_path, "r", b"x")))
    check = fc.check_cache_dir(cache)  # read and checked like any entry, not refused
    assert check.stale(flydsl_key.host_key_inputs()) == {
        f"{FUNCTION}_{'a' * 32}/3a4665933b24458b.pkl": "another flydsl"
    }


def test_doctor_compares_the_cache_with_this_hosts_rocm(tmp_path, monkeypatch, host_050):
    from flyserve.doctor.flydsl_row import flydsl_status

    build_cache(tmp_path, monkeypatch, rocm(tmp_path, "debian", b"Debian 5.2.3 ockl"))
    built = flydsl_key.short(flydsl_key.bitcode_fingerprint(tmp_path / "debian"))
    monkeypatch.setenv("ROCM_PATH", str(rocm(tmp_path, "opt-rocm", b"ROCm 7 ockl")))
    status, detail, fix = flydsl_status()
    assert status == "warn" and "flydsl 0.5.0 (tested)" in detail and "function-folders" in detail
    assert "2 entries, 0 usable here, 2 stale (0 from another flydsl, 2 from another ROCm" in detail
    assert f"built with bitcode {built}" in detail and "rebuild the cache on this image" in fix
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "debian"))
    status, detail, fix = flydsl_status()
    assert status == "ok" and "2 usable here, 0 stale" in detail


def test_doctor_names_an_untested_flydsl(monkeypatch):
    from flyserve.doctor.flydsl_row import flydsl_status

    monkeypatch.setattr(flydsl_key, "flydsl_version", lambda: "0.6.0")
    monkeypatch.setattr(flydsl_key, "installed_layout", lambda: None)
    status, detail, fix = flydsl_status()
    assert status == "warn" and "flydsl 0.6.0 (not tested" in detail and "<0.6" in fix
