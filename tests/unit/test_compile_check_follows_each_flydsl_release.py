"""`flyserve flydsl compile` observes flydsl 0.4.2 and 0.5.0 by their own names, refuses a release
that moved them again with a message naming its version, and never calls a failed setup served.

The fake ``flydsl.compiler.jit_function`` modules carry exactly the names each release has (read
from the wheels: 0.4.2 ``JitFunction._build_full_cache_key`` / ``JitCacheManager.load_all``; 0.5.0
module-level ``_artifact_cache_key`` / ``_disk_cache_key`` and ``JitCacheManager.get``), so the
hooks are checked against the shapes the live run (tests/integration) exercises for real.
"""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from flyserve.doctor import compile as cc
from flyserve.doctor import compile_child
from flyserve.doctor.compile import runs as compile_runs
from flyserve.vllm import flydsl_cache as fc
from flyserve.vllm import flydsl_key
from flyserve.vllm.flydsl_layout import BUILD_FOLDERS, FUNCTION_FOLDERS, detect_layout, layout_of_entry


class _Compiler:
    @classmethod
    def compile(cls, module: Any, **kw: Any) -> Any:
        return module


def fake_050() -> types.ModuleType:
    """flydsl 0.5.0's jit_function surface: artifact key, disk key, a manager looked up by key."""
    jf = types.ModuleType("flydsl.compiler.jit_function")

    def _artifact_cache_key(asm: str, cfg: Any, backend: Any, **kw: Any) -> str:
        return hashlib.sha256(asm.encode()).hexdigest()

    def _disk_cache_key(artifact_key: str) -> str:
        return hashlib.sha256(f"toolchain\n{artifact_key}".encode()).hexdigest()

    class JitCacheManager:
        def __init__(self, cache_dir: Path) -> None:
            self.cache_dir = cache_dir

        def get(self, cache_key: str) -> None:
            return None

    jf._artifact_cache_key, jf._disk_cache_key = _artifact_cache_key, _disk_cache_key
    jf.JitCacheManager, jf.MlirCompiler = JitCacheManager, _Compiler
    return jf


def fake_042() -> types.ModuleType:
    jf = types.ModuleType("flydsl.compiler.jit_function")

    class JitFunction:
        def _build_full_cache_key(self, *a: Any, **kw: Any) -> tuple:
            return ()

        @staticmethod
        def _cache_key_to_str(key: Any) -> str:
            return str(key)

    class JitCacheManager:
        def load_all(self) -> int:
            return 0

    jf.JitFunction, jf.JitCacheManager, jf.MlirCompiler = JitFunction, JitCacheManager, _Compiler
    return jf


def install(monkeypatch: Any, jf: types.ModuleType) -> None:
    pkg, sub = types.ModuleType("flydsl"), types.ModuleType("flydsl.compiler")
    pkg.compiler, sub.jit_function = sub, jf
    for name, mod in (("flydsl", pkg), ("flydsl.compiler", sub), ("flydsl.compiler.jit_function", jf)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_each_release_is_told_apart_by_what_it_has():
    assert detect_layout(fake_042()) is BUILD_FOLDERS
    assert detect_layout(fake_050()) is FUNCTION_FOLDERS
    assert detect_layout(types.ModuleType("later")) is None
    assert layout_of_entry(f"launch_x_{'0' * 32}/{'a' * 16}.pkl") is BUILD_FOLDERS
    assert layout_of_entry(f"launch_x/{'a' * 64}.pkl") is FUNCTION_FOLDERS
    assert layout_of_entry(f"launch_x/{'a' * 16}.pkl") is None


def test_050_keys_name_the_file_flydsl_reads(monkeypatch, tmp_path):
    jf = fake_050()
    install(monkeypatch, jf)
    obs = compile_child.Observer()
    obs.install()
    backend = types.SimpleNamespace(target=types.SimpleNamespace(arch="gfx950"))
    art = jf._artifact_cache_key("module text", None, backend)
    disk = jf._disk_cache_key(art)  # what FlyDSL computes between the two
    jf.JitCacheManager(tmp_path / "launch_flash_attn_dualwave_swp").get(disk)
    assert obs.cache_entries == [{"path": f"launch_flash_attn_dualwave_swp/{disk}.pkl", "arch": "gfx950"}]
    assert f"artifact {art} (target gfx950)" in obs.cache_keys
    assert layout_of_entry(obs.cache_entries[0]["path"]) is FUNCTION_FOLDERS


def test_042_hooks_still_follow_its_names(monkeypatch):
    jf = fake_042()
    install(monkeypatch, jf)
    compile_child.Observer().install()
    assert jf.JitFunction._build_full_cache_key.__name__ == "key_observed"


def test_a_release_without_either_set_of_names_is_refused_naming_its_version(monkeypatch):
    install(monkeypatch, types.ModuleType("flydsl.compiler.jit_function"))
    monkeypatch.setattr(flydsl_key, "flydsl_version", lambda: "0.6.0")
    with pytest.raises(
        compile_child.ObserverUnsupported, match=r"flydsl 0\.6\.0 has neither .* changed again"
    ):
        compile_child.Observer().install()


def test_the_command_stops_once_on_an_unobservable_flydsl(monkeypatch):
    info = {"revision": {"label": "x"}, "key": {"unsupported": "flydsl 0.6.0 has neither ..."}}
    monkeypatch.setattr(compile_runs, "run_child", lambda payload, env: (info, 0, "", 0.1))
    with pytest.raises(cc.CompileCheckError, match="flydsl 0.6.0"):
        cc.read_revision({})


def test_a_failed_setup_is_never_reported_served():
    v = cc.plan_variants(cc.Geometry(4, 1, 128, "bf16"), page_sizes=(64,), has_causal_lpt=True)[0]
    child = {"outcome": "setup-failed", "error_type": "AttributeError", "message": "no _build_full_cache_key"}
    status, summary = cc.judge(v, child, rc=0, stderr_tail="", cached=False)
    row = cc.VariantResult(v, status, summary, child, 1.0).as_dict()
    assert status == "fail" and cc.served_note(row) == "unknown: setup failed"
    ok = {**row, "outcome": "returned", "vllm_layout_problem": None}
    assert cc.served_note(ok) == "yes"


def test_a_050_cache_is_checked_and_listed_with_its_key_inputs(tmp_path):
    from flydsl_cache_fakes import FUNCTION, write_entry

    cache = tmp_path / "cache"
    rel = f"{FUNCTION}/{'b' * 64}.pkl"
    write_entry(cache / FUNCTION, f"{'b' * 64}.pkl")
    key = flydsl_key.KeyInputs("0.5.0", "function-folders", "c" * 64, "kernels")
    assert fc.record_entries(cache, [(rel, "gfx950", {"name": "warm-up-p64-lpt0"})], key=key) == 1
    check = fc.check_cache_dir(cache)
    assert check.entries == (rel,) and check.built[rel] == key
    assert check.stale(key) == {}
    assert check.stale(flydsl_key.KeyInputs("0.5.0", "function-folders", "d" * 64)) == {rel: "another ROCm"}
    assert check.stale(flydsl_key.KeyInputs("0.5.1", "function-folders", "c" * 64)) == {rel: "another flydsl"}


def test_the_report_prints_the_key_inputs_and_explains_run_only_misses():
    key = {"flydsl": "0.5.0", "layout": "function-folders", "bitcode": "2be9ea11b5b6" + "0" * 52,
           "kernels": "k", "bitcode_files": 51, "bitcode_matches_flydsl": True, "bitcode_in_key": True}  # fmt: skip
    line = cc.key_line(key)
    assert "flydsl 0.5.0 (tested)" in line and "bitcode 2be9ea11b5b6" in line and "51 .bc files" in line
    assert "not a warm start" in line
    old = cc.key_line({**key, "flydsl": "0.4.2", "layout": "build-folders", "bitcode_in_key": False})
    assert "not in the key" in old and "not a warm start" not in old
    rep = {"time": "t", "flydsl_version": "0.5.0", "target": "gfx950", "kernels_path": "FlyDSL-x",
           "revision": {"label": "l"}, "key": key, "run_only": True,
           "geometry": {"num_heads": 4, "num_kv_heads": 1, "head_size": 128, "dtype": "bf16", "source": ""},
           "variants": [], "summary": {"ok": 0, "fail": 3},
           "cache": {"describe": "d", "stale": 2}}  # fmt: skip
    assert "run-only misses: 2 entries there were built with another flydsl or another ROCm" in cc.render(rep)
