"""A FlyDSL cache folder someone else could have written is never handed to FlyDSL.

FlyDSL unpickles every entry of a function folder at a build's first call (jit_function.py
``load_all``), so whoever can write the folder runs code in the server. Each bad folder below is
refused three ways: by the check itself (with the reason), by `flyserve flydsl compile --cache-dir`
(exit 2, the path and the reason), and by the serving warm-up, which points FlyDSL at a fresh
private folder, logs one line naming the folder and the reason, and returns normally. A planted
payload (a pickle that makes a directory when loaded) never runs. The fake FlyDSL
(flydsl_cache_fakes.FakeFlyDSLCache) loads what it is pointed at exactly as FlyDSL does.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from flydsl_cache_fakes import (
    ENTRY,
    FUNCTION,
    FakeFlyDSLCache,
    artifact_bytes,
    module_text,
    planted_bytes,
    write_entry,
)
from typer.testing import CliRunner

from flyserve.doctor import compile as cc
from flyserve.vllm import flydsl_cache as fc
from flyserve.vllm import flydsl_kernel as fk
from flyserve.vllm.flydsl_cache import entries as cache_entries
from flyserve.vllm.flydsl_kernel import disk_cache

REAL_ARTIFACT = (
    Path(__file__).resolve().parents[1] / "data" / "flydsl_cache" / "compiled-artifact-flydsl-0.4.2.pkl"
)
STRANGER = 4242  # a uid that is neither this user nor root
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another uid needs root (CI runs as root)"
)
GEOMETRY = ["--num-heads", "4", "--num-kv-heads", "1", "--head-size", "128"]


def good_cache(base: Path) -> Path:
    """A cache as FlyDSL leaves it after the warm-up compiled both LPT builds."""
    cache = base / "cache"
    cache.mkdir(mode=0o755)
    for lpt in (0, 1):
        write_entry(cache / f"{FUNCTION}_lpt{lpt}")
    return cache


def folder(cache: Path) -> Path:
    return cache / f"{FUNCTION}_lpt0"


# ----------------------------------------------------------------------------- the bad folders


def world_writable(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    cache.chmod(0o777)
    return cache, "the cache directory is group- or world-writable (mode 0777)"


def group_writable(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    cache.chmod(0o775)
    return cache, "the cache directory is group- or world-writable (mode 0775)"


def owned_by_another_uid(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    os.chown(cache, STRANGER, STRANGER)
    return cache, f"the cache directory is owned by uid {STRANGER}"


def symlinked_dir(base: Path) -> tuple[Path, str]:
    real = good_cache(base)
    link = base / "link"
    link.symlink_to(real, target_is_directory=True)
    return link, "the cache directory is a symlink"


def parent_world_writable(base: Path) -> tuple[Path, str]:
    parent = base / "open-parent"
    parent.mkdir()
    cache = good_cache(parent)
    parent.chmod(0o777)  # no sticky bit: anyone may rename the cache away and put another in its place
    return cache, f"{parent} (above the cache directory) is group- or world-writable without the sticky bit"


def fifo_entry(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    os.mkfifo(folder(cache) / "0123456789abcdef.lock")
    return cache, f"{FUNCTION}_lpt0/0123456789abcdef.lock is not a regular file (a FIFO)"


def symlink_entry(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    elsewhere = base / "elsewhere.pkl"
    elsewhere.write_bytes(artifact_bytes())
    (folder(cache) / "0123456789abcdef.pkl").symlink_to(elsewhere)
    return cache, f"{FUNCTION}_lpt0/0123456789abcdef.pkl is not a regular file (a symlink)"


def entry_of_another_uid(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    os.chown(folder(cache) / ENTRY, STRANGER, STRANGER)
    return cache, f"{FUNCTION}_lpt0/{ENTRY} is owned by uid {STRANGER}"


def group_writable_entry(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    (folder(cache) / ENTRY).chmod(0o664)
    return cache, f"{FUNCTION}_lpt0/{ENTRY} is group- or world-writable (mode 0664)"


def oversized_entry(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    with open(folder(cache) / "0123456789abcdef.pkl", "wb") as fh:
        fh.truncate(fc.MAX_ENTRY_BYTES + 1)  # sparse: no disk used
    return cache, f"{FUNCTION}_lpt0/0123456789abcdef.pkl is larger than {fc.MAX_ENTRY_BYTES} bytes"


def planted_wrong_arch(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    write_entry(folder(cache), "0123456789abcdef.pkl", artifact_bytes("gfx942"))
    return cache, f"entry {FUNCTION}_lpt0/0123456789abcdef.pkl is compiled for gfx942, not gfx950"


def planted_payload(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    write_entry(folder(cache), "0123456789abcdef.pkl", planted_bytes(base / "payload-ran"))
    return cache, f"{FUNCTION}_lpt0/0123456789abcdef.pkl is not a FlyDSL cache entry"


def entry_changed_since_listed(base: Path) -> tuple[Path, str]:
    cache = good_cache(base)
    rel = f"{FUNCTION}_lpt0/{ENTRY}"
    fc.record_entries(cache, [(rel, "gfx950", {"name": "warm-up-p64-lpt0", "num_heads": 4, "num_kv_heads": 1,
                                               "head_size": 128, "dtype": "bf16", "page_size": 64})])  # fmt: skip
    write_entry(folder(cache), ENTRY, artifact_bytes(entry="launch_something_else"))
    return cache, f"entry {rel} changed since `flyserve flydsl compile` listed it"


def missing_under_a_shared_dir(base: Path) -> tuple[Path, str]:
    shared = base / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)  # /tmp's mode: a stranger could make the folder before FlyDSL does
    return shared / "cache", f"does not exist yet and {shared}, where it would be made, is group- or world-"


BAD: list[Callable[[Path], tuple[Path, str]]] = [
    world_writable,
    group_writable,
    pytest.param(owned_by_another_uid, marks=ROOT_ONLY),
    symlinked_dir,
    parent_world_writable,
    fifo_entry,
    symlink_entry,
    pytest.param(entry_of_another_uid, marks=ROOT_ONLY),
    group_writable_entry,
    oversized_entry,
    planted_wrong_arch,
    planted_payload,
    entry_changed_since_listed,
    missing_under_a_shared_dir,
]  # type: ignore[list-item]


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A private place to build caches in (tmp_path's parents are this user's, /tmp is sticky)."""
    d = tmp_path / "base"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def no_flydsl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlyDSL's cache switches as a fresh server has them (restored afterwards, whatever the code set)."""
    for name in (fk.CACHE_DIR_ENV, fk.CACHE_ENABLE_ENV, fk.RUN_ONLY_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("make", BAD)
def test_the_check_refuses_with_the_reason(base, make):
    cache, reason = make(base)
    with pytest.raises(fc.CacheRefused) as exc:
        fc.check_cache_dir(cache)
    assert reason in exc.value.reason and exc.value.path == str(cache)
    assert not (base / "payload-ran").exists()  # reading an entry never runs it


@pytest.mark.slow  # 1.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("make", BAD)
def test_compile_refuses_the_cache_dir_naming_path_and_reason(base, make, monkeypatch):
    from flyserve.cli import app

    monkeypatch.delenv("VLLM_FLYDSL_KERNELS_PATH", raising=False)
    cache, reason = make(base)
    res = CliRunner().invoke(app, ["flydsl", "compile", *GEOMETRY, "--cache-dir", str(cache)])
    assert res.exit_code == 2, res.output
    assert f"--cache-dir {cache} refused: " in res.output and reason in res.output
    assert "VLLM_FLYDSL_KERNELS_PATH" not in res.output  # refused before anything else was looked at
    assert not (base / "payload-ran").exists()


def warm_up_args(torch, **over):
    args = {"dtype": torch.bfloat16, "device": "cpu", "num_heads": 4, "num_kv_heads": 1, "head_size": 128,
            "page_size": 64, "is_capturing": lambda: False}  # fmt: skip
    return {**args, **over}


@pytest.mark.parametrize("make", BAD)
def test_warm_up_never_points_flydsl_at_a_bad_cache_and_keeps_serving(base, make, monkeypatch, caplog,
                                                                      no_flydsl_env):  # fmt: skip
    from _support import require_module

    torch = require_module("torch")
    cache, reason = make(base)
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    fake = FakeFlyDSLCache()
    kernel = fk.FlyDSLKernel(fake, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        assert fk.warm_up(kernel, **warm_up_args(torch)) == [False, True]  # returns: serving goes on
    bad = {str(cache), os.path.realpath(cache)}
    assert fake.pointed_at and not bad & set(fake.pointed_at)
    private = fake.pointed_at[0]
    assert os.path.basename(private).startswith(fk.PRIVATE_CACHE_PREFIX)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and os.stat(private).st_uid == os.geteuid()
    assert fake.compiled == [True, True]  # compiled afresh, nothing taken from the bad cache
    assert not (base / "payload-ran").exists()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith(f"flyserve: FlyDSL cache {cache} not loaded: ") and reason in line
    assert f"FlyDSL compiles into {private} instead" in line


def test_without_the_check_the_fake_flydsl_runs_the_planted_payload(base, monkeypatch, no_flydsl_env):
    """The fake loads as FlyDSL does: the refusals above are what stands between a payload and the server."""
    cache, _ = planted_payload(base)
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    FakeFlyDSLCache()(None, None, None, causal_lpt=False)
    assert (base / "payload-ran").is_dir()


# ----------------------------------------------------------------------------- what passes


def test_a_cache_as_flydsl_writes_it_is_loaded_and_counted(base, monkeypatch, caplog, no_flydsl_env):
    from _support import require_module

    torch = require_module("torch")
    cache = base / "cache"  # not made yet: FlyDSL makes it (its parent is private)
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    fake = FakeFlyDSLCache()
    kernel = fk.FlyDSLKernel(fake, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, **warm_up_args(torch))
    assert fake.pointed_at == [str(cache), str(cache)] and fake.compiled == [True, True]
    assert "compiled 2 kernel(s)" in caplog.text and "WARNING" not in caplog.text
    caplog.clear()
    fake = FakeFlyDSLCache()
    kernel = fk.FlyDSLKernel(fake, kernel.revision)
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, **warm_up_args(torch))
    assert fake.pointed_at == [str(cache), str(cache)] and fake.compiled == [False, False]
    assert (
        f"loaded from FlyDSL's cache {cache}" in caplog.text
        and "nothing compiled (2 cached kernel(s) there; checked: all 2 for gfx950: 0 listed for this "
        "deployment's variants, 0 for other variants (not counted), 2 not listed by `flyserve flydsl compile`)"
        in caplog.text
    )


def variant(name: str, **over) -> dict:
    v = {"name": name, "num_heads": 4, "num_kv_heads": 1, "head_size": 128, "dtype": "bf16", "page_size": 64,
         "lpt": False}  # fmt: skip
    return {**v, **over}


def test_entries_for_other_variants_are_not_counted_as_this_deployments(
    base, monkeypatch, caplog, no_flydsl_env
):
    from _support import require_module

    torch = require_module("torch")
    cache = good_cache(base)
    fc.record_entries(cache, [
        (f"{FUNCTION}_lpt0/{ENTRY}", "gfx950", variant("warm-up-p64-lpt0")),
        (f"{FUNCTION}_lpt1/{ENTRY}", "gfx950", variant("warm-up-p64-lpt1", num_heads=8, lpt=True)),
    ])  # fmt: skip
    check = fc.check_cache_dir(cache)
    this = fc.Deployment(4, 1, 128, "bf16", (64,))
    assert check.counts(this) == {"entries": 2, "for_this_deployment": 1, "other_variants": 1, "unlisted": 0}
    assert check.counts(fc.Deployment(4, 1, 128, "bf16", (128,)))["for_this_deployment"] == 0  # page 128
    assert check.counts(fc.Deployment(4, 1, 128, "f16", (64,)))["for_this_deployment"] == 0
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    kernel = fk.FlyDSLKernel(FakeFlyDSLCache(), fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, **warm_up_args(torch))
    assert "1 listed for this deployment's variants, 1 for other variants (not counted), 0 not" in caplog.text


def test_the_manifest_is_flyserves_own_json_beside_flydsls_folders(base):
    cache = good_cache(base)
    rel = f"{FUNCTION}_lpt0/{ENTRY}"
    assert fc.record_entries(cache, [(rel, "gfx950", variant("warm-up-p64-lpt0")),
                                     (rel, "gfx950", variant("serve-p64-lpt0")),
                                     (f"{FUNCTION}_lpt0/ffffffffffffffff.pkl", "gfx950", variant("gone")),
                                     ("../../etc/passwd", "gfx950", variant("escape"))]) == 1  # fmt: skip
    doc = json.loads((cache / fc.MANIFEST_NAME).read_text())
    assert doc["format"] == fc.MANIFEST_FORMAT and list(doc["entries"]) == [rel]
    assert [v["name"] for v in doc["entries"][rel]["variants"]] == ["warm-up-p64-lpt0", "serve-p64-lpt0"]
    assert stat.S_IMODE((cache / fc.MANIFEST_NAME).stat().st_mode) == 0o644
    (cache / fc.MANIFEST_NAME).write_text('{"format": "something else"}')
    with pytest.raises(fc.CacheRefused, match="flyserve-cache.json: not a flyserve-flydsl-cache"):
        fc.check_cache_dir(cache)


def test_a_missing_cache_under_a_private_parent_and_a_cache_in_a_sticky_dir_pass(base):
    assert fc.check_cache_dir(base / "not-yet" / "cache").entries == ()
    shared = base / "tmp-like"
    shared.mkdir()
    cache = good_cache(shared)
    shared.chmod(0o1777)  # sticky: only the cache's owner can rename or remove it
    assert len(fc.check_cache_dir(cache).entries) == 2


def test_flydsls_own_pickle_of_an_artifact_is_read_without_flydsl():
    """The committed entry was written by flydsl 0.4.2's CompiledArtifact (a module with the target
    rocdl-attach-target gives); the reader takes it, and the same bytes claim no other arch."""
    state = fc.artifact_state(REAL_ARTIFACT.read_bytes())
    assert state is not None and fc.artifact_problem(state, "gfx950") is None
    assert fc.artifact_problem(state, "gfx942") == "compiled for gfx950, not gfx942"


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"link_libs": ["/tmp/evil.so"]}, "link libraries"),
        ({"processor_refs": ["os:system"]}, "post-load processors are not FlyDSL's"),
        ({"ir_zlib": b"not zlib"}, "no compiled module"),
        ({"entry": None}, "no compiled module"),
        ({"ir_zlib": __import__("zlib").compress(b"module {}")}, "a module with no ROCm target"),
    ],
)
def test_an_artifact_that_flydsl_would_not_have_cached_is_refused(state, problem):
    parsed = fc.artifact_state(artifact_bytes(**state))
    assert parsed is not None and problem in fc.artifact_problem(parsed, "gfx950")


def test_an_ir_text_for_gfx950_does_not_vouch_for_the_ir_zlib_flydsl_loads():
    """flydsl 0.4.2 loads ir_zlib whenever it is there (CompiledArtifact.__setstate__), main reads
    ir_text: an entry with a gfx950 ir_text beside an ir_zlib of another module is refused, one with
    the two the same passes."""
    import zlib

    other = zlib.compress(module_text("gfx942").encode())
    planted = fc.artifact_state(artifact_bytes(ir_text=module_text("gfx950"), ir_zlib=other))
    assert planted is not None
    assert "ir_text and ir_zlib are different modules" in fc.artifact_problem(planted, "gfx950")
    assert fc.artifact_problem(planted, "gfx942") is not None
    broken = fc.artifact_state(artifact_bytes(ir_text=module_text("gfx950"), ir_zlib=b"not zlib"))
    assert fc.artifact_problem(broken, "gfx950") == "not a FlyDSL artifact (no compiled module)"
    same = fc.artifact_state(artifact_bytes(ir_text=module_text("gfx950")))  # ir_zlib: the same module
    assert fc.artifact_problem(same, "gfx950") is None
    # an entry from before 0.4.2: ir_text alone (the key renamed in the pickle, same length)
    text_only = fc.artifact_state(artifact_bytes(ir_text=module_text()).replace(b"ir_zlib", b"ir_zlia"))
    assert text_only is not None and fc.artifact_problem(text_only, "gfx950") is None


def test_a_compressed_module_past_the_cap_is_not_inflated(monkeypatch):
    import zlib

    monkeypatch.setattr(cache_entries, "MAX_IR_BYTES", 1 << 16)
    state = fc.artifact_state(artifact_bytes(ir_zlib=zlib.compress(b" " * (1 << 20))))
    assert fc.artifact_problem(state, "gfx950") == "not a FlyDSL artifact (no compiled module)"


def test_run_only_reads_the_cache_even_with_the_cache_switched_off(monkeypatch, tmp_path, no_flydsl_env):
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(fk.CACHE_ENABLE_ENV, "0")
    assert fk.flydsl_cache_dir() is None
    monkeypatch.setenv(fk.RUN_ONLY_ENV, "1")  # FlyDSL: need_cache = enable_cache or run_only
    assert fk.flydsl_cache_dir() == str(tmp_path)


def test_a_check_that_breaks_still_keeps_flydsl_off_the_folder(base, monkeypatch, caplog, no_flydsl_env):
    cache = good_cache(base)
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))

    def broken(root):
        raise RuntimeError("boom")

    monkeypatch.setattr(disk_cache, "check_cache_dir", broken)
    with caplog.at_level(logging.WARNING, logger="flyserve.vllm"):
        assert fk.checked_cache() is None
    assert os.environ[fk.CACHE_DIR_ENV] != str(cache)
    assert "not loaded: it could not be checked (RuntimeError)" in caplog.text


def test_the_lab_adapter_checks_the_cache_before_flydsls_first_call(base, monkeypatch, caplog, no_flydsl_env):
    from flyserve.lab import kernels as lk

    cache, reason = planted_payload(base)
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    kernel = fk.FlyDSLKernel(FakeFlyDSLCache(), fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    monkeypatch.setattr(fk, "load_flydsl_kernel", lambda: kernel)
    with caplog.at_level(logging.WARNING, logger="flyserve.vllm"):
        lk.FlyDSLDualwave().load()
    assert os.environ[fk.CACHE_DIR_ENV] != str(cache) and reason in caplog.text


# ----------------------------------------------------------------------------- the compile report


def test_compile_lists_what_it_built_and_reports_the_split(base):
    cache = good_cache(base)
    write_entry(cache / f"{FUNCTION}_lpt9")  # an entry this run did not make: not listed

    def result(name: str, lpt: int, **over) -> cc.VariantResult:
        v = cc.Variant(name, "warm-up", "contiguous", 64, 4, 1, 128, "bf16", bool(lpt), **over)
        entries = [{"path": f"{FUNCTION}_lpt{lpt}/{ENTRY}", "arch": "gfx950"}]
        return cc.VariantResult(v, "ok", "", {"cache_entries": entries}, 1.0)

    results = [result("warm-up-p64-lpt0", 0), result("warm-up-p64-lpt1", 1)]
    eight_heads = cc.deployment_of(cc.Geometry(8, 1, 128, "bf16"), [64])
    this_run = cc.deployment_of(cc.Geometry(4, 1, 128, "bf16"), [64])
    cache_rep = cc.cache_after_run(str(cache), results, eight_heads)
    assert cache_rep["entries"] == 3 and cache_rep["for_this_deployment"] == 0  # listed, for 4 heads
    cache_rep = cc.cache_after_run(str(cache), results, this_run)
    assert {k: cache_rep[k] for k in ("for_this_deployment", "other_variants", "unlisted")} == {
        "for_this_deployment": 2, "other_variants": 0, "unlisted": 1}  # fmt: skip
    rep = {"summary": {"ok": 2, "fail": 0}, "cache": cache_rep}
    assert not cc.failed(rep)
    assert cc.cache_line(cache_rep).startswith("FlyDSL cache: all 3 for gfx950: 2 listed for this deploy")

    write_entry(folder(cache), "0123456789abcdef.pkl", artifact_bytes("gfx942"))  # planted after the run
    cache_rep = cc.cache_after_run(str(cache), results, this_run)
    assert "compiled for gfx942, not gfx950" in cache_rep["refused"]
    assert cc.failed({"summary": {"ok": 2, "fail": 0}, "cache": cache_rep})
    assert "refused, the server would not load it" in cc.cache_line(cache_rep)


def test_the_child_names_the_cache_file_of_each_key():
    import hashlib

    from flyserve.doctor.compile_child import cache_entry

    class GPUTarget:  # FlyDSL's key part ("_target_", GPUTarget(backend='rocm', arch=..., warp_size=64))
        arch = "gfx950"

    key = (("_env_", ()), ("_target_", GPUTarget()), ("Q", ("tensor", "bf16")))
    text = str(key)
    name = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert cache_entry(f"{FUNCTION}_abc", text, key) == {
        "path": f"{FUNCTION}_abc/{name}.pkl",
        "arch": "gfx950",
    }
