"""Write flyserve's vLLM touch points, read from one vLLM release's source with ``ast``, as JSON.

Run by a developer when a vLLM release appears, never at test time: the tests read the committed
records in tests/data/contracts/vllm_touchpoints/ (and compare the installed vLLM with its own
record, through ``extract`` on the installed package's directory). The source is one of the
release's files from the registry, so a record names exactly what it was read from (its name and
sha256): the source distribution (0.30-0.33), or a wheel (0.34 on: ``pip download --no-deps`` fetches
it without installing or building anything; only its Python files are read, so a CUDA wheel serves
every platform). A directory holding ``vllm/`` (an unpacked wheel, an installed vLLM) also works:

    python -m pip download --no-deps vllm==0.34.0 -d /tmp/vllm034
    python scripts/contracts/vllm_touchpoints.py /tmp/vllm034/vllm-0.34.0-*.whl \
        --uploaded 2026-11-16 > tests/data/contracts/vllm_touchpoints/0.34.0.json

scripts/contracts/vllm_upstream.py prints what such a release changes for flyserve before it is
recorded (docs/vllm.md, "Staying current").

    # after flyserve's vLLM imports change: every record, the doctor's digests, the docs table
    python scripts/contracts/vllm_touchpoints.py --refresh DIR_HOLDING_THE_RECORDED_FILES

What is kept is data about vLLM's interfaces (names, parameter lists, literal defaults, which
names a function uses), never vLLM's code. The touch points are the ``TOUCHPOINTS`` below plus
every ``vllm`` name flyserve imports (found in flyserve's own source, ``flyserve_imports``) and
the names the seed backend (vLLM pull request 53335) imports.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "flyserve-vllm-touchpoints"
FORMAT_VERSION = 1

COMPOSITE = "vllm/v1/attention/backends/composite.py"
BACKEND = "vllm/v1/attention/backend.py"
REGISTRY = "vllm/v1/attention/backends/registry.py"
WORKER_BASE = "vllm/v1/worker/worker_base.py"

ENUM_MEMBERS = ("CUSTOM", "CPU_ATTN", "TRITON_ATTN", "FLASH_ATTN", "ROCM_AITER_UNIFIED_ATTN")
"""The AttentionBackendEnum members flyserve registers over or composes (flyserve/vllm/backends.py)."""

METADATA_FIELDS = (
    "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
    "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "causal",
)  # fmt: skip
"""CommonAttentionMetadata fields the routing and the prefill builders read."""

WORKER_HOOK_NAMES = (
    "load_general_plugins", "worker_extension_cls", "__bases__", "init_worker_extension",
    "destroy_worker_extension", "set_current_vllm_config",
)  # fmt: skip
"""What WorkerWrapperBase.init_worker uses, in order of first use: whether plugins load before the
extension class is read decides whether a general plugin could set it (docs/vllm.md)."""

SEED_IMPORTS = (
    ("vllm.envs", None),
    ("vllm.config.cache", "CacheDType"),
    ("vllm.logger", "init_logger"),
    ("vllm.utils.torch_utils", "is_quantized_kv_cache"),
    ("vllm.v1.attention.backend", "AttentionType"),
    ("vllm.v1.attention.backend", "MultipleOf"),
    ("vllm.v1.attention.backends.rocm_aiter_unified_attn", "RocmAiterUnifiedAttentionBackend"),
    ("vllm.v1.attention.backends.rocm_aiter_unified_attn", "RocmAiterUnifiedAttentionImpl"),
    ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionMetadata"),
    ("vllm.platforms.rocm", "on_gfx950"),
)
"""The imports of the seed backend, vLLM PR 53335's vllm/v1/attention/backends/rocm_flydsl_attn.py
(backend ROCM_FLYDSL_DUALWAVE_ATTN; flyserve.vllm.flydsl is its flyserve form and imports less)."""

STRING_IMPORTS = (
    ("vllm.v1.attention.ops.triton_unified_attention", "unified_attention"),
    ("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
    ("vllm.v1.attention.backends.composite", None),
    ("vllm.v1.attention.backends.cpu_attn", None),
)
"""Names flyserve imports by string (importlib: flyserve/lab/kernels.py, flyserve/doctor/checks.py)."""

AHEAD_IMPORTS = (("vllm.distributed", "get_tensor_model_parallel_world_size"),)
"""Recorded ahead of flyserve's source: the data-parallel engine channel (developed beside this)
imports it, so the records need not be read again when that lands."""

# ----------------------------------------------------------------------------- reading a tree


class Tree:
    """One vLLM source tree: an sdist or a wheel read in memory, or a directory holding ``vllm/`` (an
    unpacked wheel, an installed package: read file by file, on demand)."""

    def __init__(self, files: dict[str, str] | None = None, root: Path | None = None) -> None:
        self.files = files
        self.root = root
        self._parsed: dict[str, ast.Module | None] = {}

    @classmethod
    def open(cls, path: Path) -> Tree:
        if path.is_file():
            if zipfile.is_zipfile(path):
                return cls(files=_read_wheel(path))
            if tarfile.is_tarfile(path):
                return cls(files=_read_sdist(path))
            raise SystemExit(f"{path}: neither a wheel nor an sdist")
        root = path / "vllm" if (path / "vllm" / "__init__.py").exists() else path
        if not (root / "__init__.py").exists():
            raise SystemExit(f"{path}: neither a wheel, an sdist nor a directory holding vllm/__init__.py")
        return cls(root=root)

    def text(self, rel: str) -> str | None:
        """The source of ``vllm/...`` path ``rel``, None if the tree has no such file."""
        if self.files is not None:
            return self.files.get(rel)
        assert self.root is not None
        f = self.root / rel.removeprefix("vllm/")
        return f.read_text(encoding="utf-8") if f.is_file() else None

    def parse(self, rel: str) -> ast.Module | None:
        if rel not in self._parsed:
            text = self.text(rel)
            self._parsed[rel] = ast.parse(text) if text is not None else None
        return self._parsed[rel]

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if self.text(rel) is not None:
                return rel
        return None

    def is_package_dir(self, module: str) -> bool:
        prefix = module.replace(".", "/") + "/"
        if self.files is not None:
            return any(k.startswith(prefix) for k in self.files)
        assert self.root is not None
        return (self.root / prefix.removeprefix("vllm/")).is_dir()


def _read_sdist(path: Path) -> dict[str, str]:
    files = {}
    with tarfile.open(path) as tar:
        for m in tar:
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1].startswith("vllm/") and parts[1].endswith(".py") and m.isfile():
                data = tar.extractfile(m)
                if data is not None:
                    files[parts[1]] = io.TextIOWrapper(data, encoding="utf-8").read()
    return files


def _read_wheel(path: Path) -> dict[str, str]:
    """A wheel's ``vllm/**.py``: a wheel is a zip with the package at its root (no top folder)."""
    files = {}
    with zipfile.ZipFile(path) as whl:
        for name in whl.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                files[name] = whl.read(name).decode("utf-8")
    if "vllm/__init__.py" not in files:
        raise SystemExit(f"{path}: a zip without vllm/__init__.py (not a vLLM wheel)")
    return files


def release_of(path: Path) -> str | None:
    """The release a file's name says (``vllm-0.34.0-cp38-...whl``, ``vllm-0.33.0.tar.gz``), else None."""
    name = path.name
    for suffix in (".tar.gz", ".whl"):
        if name.startswith("vllm-") and name.endswith(suffix):
            return name.removeprefix("vllm-").removesuffix(suffix).split("-", 1)[0]
    return None


def _find(body: Iterable[ast.stmt], name: str) -> ast.AST | None:
    """The last top-level def/class called ``name`` in ``body`` (the last: @overload stubs come first)."""
    hit = None
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            hit = node
    return hit


def lookup(tree: ast.Module, qualname: str) -> ast.AST | None:
    """``a.b.c``: a class's members, and also classes defined inside a function's body."""
    node: ast.AST | None = tree
    for part in qualname.split("."):
        body = getattr(node, "body", None)
        if body is None:
            return None
        node = _find(body, part)
        if node is None:
            return None
    return node


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameters as Python writes them, without annotations: ``["self", "*", "name", "x=None"]``."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = []
    for i, (arg, d) in enumerate(zip(pos, defaults, strict=True)):
        out.append(arg.arg if d is None else f"{arg.arg}={ast.unparse(d)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(arg.arg if d is None else f"{arg.arg}={ast.unparse(d)}")
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = []
    for d in fn.decorator_list:
        base = d.func if isinstance(d, ast.Call) else d
        names.append(ast.unparse(base).rsplit(".", 1)[-1])
    return sorted(n for n in names if n in ("staticmethod", "classmethod", "property", "abstractmethod"))


def _short(expr: ast.expr | None, limit: int = 100) -> str:
    text = "" if expr is None else " ".join(ast.unparse(expr).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def members(cls: ast.ClassDef) -> dict[str, Any]:
    """A class's own methods (parameter list, decorators) and class attributes (literal default)."""
    out: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(ast.unparse(d).endswith("overload") for d in node.decorator_list):
                continue
            entry: dict[str, Any] = {"params": signature(node)}
            deco = _decorators(node)
            if deco:
                entry["decorators"] = deco
            if isinstance(node, ast.AsyncFunctionDef):
                entry["async"] = True
            out[node.name] = entry
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = {"attribute": _short(node.value) if node.value is not None else None}
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = {"attribute": _short(node.value)}
    return out


def names_used(fn: ast.AST, watch: Iterable[str]) -> list[str]:
    """Which watched names (attributes, names, string constants) ``fn`` uses, in order of first use."""
    watch = set(watch)
    seen: list[tuple[int, int, str]] = []
    for node in ast.walk(fn):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        if name in watch:
            seen.append((node.lineno, node.col_offset, name))
    out: list[str] = []
    for _, _, name in sorted(seen):
        if name not in out:
            out.append(name)
    return out


def constant(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return _short(node.value)
    return None


# ----------------------------------------------------------------------------- import resolution


def _top_level_names(tree: ast.Module) -> tuple[set[str], list[tuple[int, str]], set[str]]:
    """(names bound at module level, star imports as (level, module), names a module __getattr__
    answers)."""
    bound: set[str] = set()
    stars: list[tuple[int, str]] = []
    lazy: set[str] = set()

    def visit(body: Iterable[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
                if node.name == "__getattr__":
                    lazy.update(
                        c.value
                        for c in ast.walk(node)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            bound.add(n.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                bound.add(node.target.id)  # also `x: T` under TYPE_CHECKING (with a __getattr__)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    bound.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "*":
                        stars.append((node.level, node.module or ""))
                    else:
                        bound.add(a.asname or a.name)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return bound, stars, lazy


def _absolute(level: int, module: str, package: str) -> str:
    """``from <level dots><module> import *`` inside ``package``, as an absolute module name."""
    if not level:
        return module
    parts = package.split(".")
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def resolve(tree: Tree, module: str, name: str | None, _depth: int = 0) -> dict[str, Any]:
    """How ``from module import name`` (or ``import module`` when name is None) resolves, read only."""
    rel = tree.module_file(module)
    if rel is None:
        if tree.is_package_dir(module) and name is None:
            return {"resolves": "namespace package"}
        return {"missing": f"no module {module}"}
    if name is None:
        return {"resolves": "module", "file": rel}
    if tree.module_file(f"{module}.{name}") is not None:
        return {"resolves": "submodule", "file": tree.module_file(f"{module}.{name}")}
    mod = tree.parse(rel)
    assert mod is not None
    bound, stars, lazy = _top_level_names(mod)
    if name in bound:
        return {"resolves": "defined" if _defines(mod, name) else "re-exported", "file": rel}
    if name in lazy:
        return {"resolves": "module __getattr__", "file": rel}
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    for level, star in stars:
        if _depth < 4:
            hit = resolve(tree, _absolute(level, star, package), name, _depth + 1)
            if "resolves" in hit:
                return {"resolves": "star re-export", "file": hit["file"]}
    return {"missing": f"{module} has no {name}"}


def _defines(mod: ast.Module, name: str) -> bool:
    for node in ast.walk(mod):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


# ----------------------------------------------------------------------------- flyserve's imports


@dataclass(frozen=True)
class ImportSite:
    """One ``from vllm... import name`` (name None: ``import vllm...``) in flyserve's source."""

    module: str
    name: str | None
    file: str
    line: int
    guarded: bool = field(default=False, compare=False)
    """Inside a ``try`` whose handler catches ImportError (or a parent): the code has a fallback."""

    @property
    def key(self) -> str:
        return self.module if self.name is None else f"{self.module}:{self.name}"


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = [
        ast.unparse(t) for t in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])
    ]
    return any(n in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException") for n in names)


def flyserve_imports(root: Path) -> list[ImportSite]:
    """Every vllm import in flyserve/ (module level and lazy, inside functions), with its guard."""
    sites: list[ImportSite] = []
    for path in sorted((root / "flyserve").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        mod = ast.parse(path.read_text(encoding="utf-8"))
        guarded_nodes: set[int] = set()
        for node in ast.walk(mod):
            if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                for inner in node.body:
                    guarded_nodes.update(id(n) for n in ast.walk(inner))
        for node in ast.walk(mod):
            guarded = id(node) in guarded_nodes
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    for a in node.names:
                        sites.append(ImportSite(node.module, a.name, rel, node.lineno, guarded))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "vllm" or a.name.startswith("vllm."):
                        sites.append(ImportSite(a.name, None, rel, node.lineno, guarded))
    return sites


# ----------------------------------------------------------------------------- the touch points


def _sig(rel: str, qualname: str) -> Callable[[Tree], Any]:
    def get(tree: Tree) -> Any:
        mod = tree.parse(rel)
        node = lookup(mod, qualname) if mod is not None else None
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return {"missing": f"{rel}: no function {qualname}"}
        return {"file": rel, "params": signature(node)}

    return get


def _members(rel: str, qualname: str) -> Callable[[Tree], Any]:
    def get(tree: Tree) -> Any:
        mod = tree.parse(rel)
        node = lookup(mod, qualname) if mod is not None else None
        if not isinstance(node, ast.ClassDef):
            return {"missing": f"{rel}: no class {qualname}"}
        return {"file": rel, "bases": [ast.unparse(b) for b in node.bases], "members": members(node)}

    return get


def _enum_members(tree: Tree) -> Any:
    mod = tree.parse(REGISTRY)
    node = lookup(mod, "AttentionBackendEnum") if mod is not None else None
    if not isinstance(node, ast.ClassDef):
        return {"missing": f"{REGISTRY}: no class AttentionBackendEnum"}
    have = members(node)
    return {
        "file": REGISTRY,
        "members": {m: have[m]["attribute"] if m in have else {"missing": True} for m in ENUM_MEMBERS},
    }


def _plugin_groups(tree: Tree) -> Any:
    rel = "vllm/plugins/__init__.py"
    mod = tree.parse(rel)
    if mod is None:
        return {"missing": rel}
    return {
        "file": rel,
        "DEFAULT_PLUGINS_GROUP": constant(mod, "DEFAULT_PLUGINS_GROUP"),
        "ENDPOINT_PLUGINS_GROUP": constant(mod, "ENDPOINT_PLUGINS_GROUP"),
        "load_general_plugins": _sig(rel, "load_general_plugins")(tree).get("params"),
    }


def _metadata_fields(tree: Tree) -> Any:
    mod = tree.parse(BACKEND)
    node = lookup(mod, "CommonAttentionMetadata") if mod is not None else None
    if not isinstance(node, ast.ClassDef):
        return {"missing": f"{BACKEND}: no class CommonAttentionMetadata"}
    have = members(node)
    return {"file": BACKEND, "fields": {f: ("present" if f in have else "missing") for f in METADATA_FIELDS}}


def _worker_extension(tree: Tree) -> Any:
    mod = tree.parse(WORKER_BASE)
    init = lookup(mod, "WorkerWrapperBase.init_worker") if mod is not None else None
    wrapper = lookup(mod, "WorkerWrapperBase") if mod is not None else None
    parallel = tree.parse("vllm/config/parallel.py")
    pc = lookup(parallel, "ParallelConfig") if parallel is not None else None
    field_default = members(pc).get("worker_extension_cls") if isinstance(pc, ast.ClassDef) else None
    arg_utils = tree.text("vllm/engine/arg_utils.py") or ""
    return {
        "file": WORKER_BASE,
        "ParallelConfig.worker_extension_cls": field_default or {"missing": True},
        "cli_flag --worker-extension-cls": "--worker-extension-cls" in arg_utils,
        "init_worker uses, in order": names_used(init, WORKER_HOOK_NAMES) if init is not None else None,
        "init_worker params": signature(init) if isinstance(init, ast.FunctionDef) else None,
        "WorkerWrapperBase uses": names_used(wrapper, WORKER_HOOK_NAMES) if wrapper is not None else None,
    }


CHILD_MEMBERS: dict[str, tuple[str, ...]] = {
    "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend": (
        "forward_includes_kv_cache_update", "supports_kv_cache_update_bypass", "get_supported_kernel_block_sizes", "supports_head_size",
        "get_impl_cls", "get_builder_cls", "supported_kv_cache_dtypes",
    ),
    "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionImpl": (
        "__init__", "forward", "process_weights_after_loading", "_split_kv_cache", "set_interleaved_v_cache",
    ),
    "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionMetadataBuilder": (
        "__init__", "build",
    ),
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend": (
        "forward_includes_kv_cache_update", "supports_kv_cache_update_bypass", "get_supported_kernel_block_sizes", "get_impl_cls", "get_builder_cls",
    ),
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl": (
        "__init__", "forward", "process_weights_after_loading",
    ),
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder": ("__init__", "build"),
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend": (
        "forward_includes_kv_cache_update", "supports_kv_cache_update_bypass", "get_supported_kernel_block_sizes",
    ),
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend": (
        "forward_includes_kv_cache_update", "supports_kv_cache_update_bypass", "get_supported_kernel_block_sizes",
    ),
}  # fmt: skip
"""The child backends flyserve composes or subclasses (flyserve/vllm/backends.py, flydsl.py,
cpu_prefill.py): the members it overrides, calls through ``super()`` or the composite requires."""


def _class_node(tree: Tree, path: str) -> tuple[str, ast.ClassDef] | None:
    module, _, name = path.rpartition(".")
    rel = tree.module_file(module)
    mod = tree.parse(rel) if rel else None
    node = lookup(mod, name) if mod is not None else None
    return (module, node) if isinstance(node, ast.ClassDef) else None


def _base_paths(tree: Tree, module: str, cls: ast.ClassDef) -> list[str]:
    """The bases of ``cls`` as dotted paths, through the module's own imports (Generic[...] dropped)."""
    rel = tree.module_file(module)
    mod = tree.parse(rel) if rel else None
    imported: dict[str, str] = {}
    for node in mod.body if mod is not None else []:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                imported[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for b in cls.bases:
        name = ast.unparse(b.value if isinstance(b, ast.Subscript) else b)
        if name in imported:
            out.append(imported[name])
        elif lookup(mod, name) is not None:
            out.append(f"{module}.{name}")
    return out


def inherited_member(tree: Tree, path: str, member: str, _depth: int = 0) -> dict[str, Any]:
    """``member`` as ``path`` has it, from the class itself or the nearest base that defines it."""
    found = _class_node(tree, path)
    if found is None:
        return {"missing": f"no class {path}"}
    module, cls = found
    own = members(cls)
    if member in own:
        return {**own[member], "from": path.rpartition(".")[2]}
    if _depth < 6:
        for base in _base_paths(tree, module, cls):
            hit = inherited_member(tree, base, member, _depth + 1)
            if "missing" not in hit:
                return hit
    return {"missing": f"{path} has no {member}"}


def _children(tree: Tree) -> Any:
    return {
        path: {m: inherited_member(tree, path, m) for m in names} for path, names in CHILD_MEMBERS.items()
    }


TOUCHPOINTS: dict[str, Callable[[Tree], Any]] = {
    "composite factory": _sig(COMPOSITE, "create_composite_attention_backend"),
    "routing protocol": _members(COMPOSITE, "CompositeAttentionRouting"),
    "composite impl": _members(COMPOSITE, "create_composite_attention_backend.CompositeAttentionImpl"),
    "composite builder": _members(
        COMPOSITE, "create_composite_attention_backend.CompositeAttentionMetadataBuilder"
    ),
    "composite backend": _members(COMPOSITE, "create_composite_attention_backend.CompositeAttentionBackend"),
    "register_backend": _sig(REGISTRY, "register_backend"),
    "AttentionBackendEnum": _enum_members,
    "plugin groups": _plugin_groups,
    "endpoint plugin interface": _members("vllm/plugins/endpoint_plugins/interface.py", "EndpointPlugin"),
    "collective_rpc (engine client)": _sig("vllm/engine/protocol.py", "EngineClient.collective_rpc"),
    "collective_rpc (AsyncLLM)": _sig("vllm/v1/engine/async_llm.py", "AsyncLLM.collective_rpc"),
    "collective_rpc (executor)": _sig("vllm/v1/executor/abstract.py", "Executor.collective_rpc"),
    "AttentionBackend": _members(BACKEND, "AttentionBackend"),
    "AttentionImplBase": _members(BACKEND, "AttentionImplBase"),
    "AttentionImpl": _members(BACKEND, "AttentionImpl"),
    "MLAAttentionImpl": _members(BACKEND, "MLAAttentionImpl"),
    "AttentionMetadataBuilder": _members(BACKEND, "AttentionMetadataBuilder"),
    "CommonAttentionMetadata fields": _metadata_fields,
    "WorkerWrapperBase": _members(WORKER_BASE, "WorkerWrapperBase"),
    "worker extension hook": _worker_extension,
    "child backends": _children,
}


def extract(tree: Tree, imports: Iterable[tuple[str, str | None]]) -> dict[str, Any]:
    """The touch points and the import table: everything but the record's source and digest."""
    return {
        "touchpoints": {name: get(tree) for name, get in TOUCHPOINTS.items()},
        "imports": {
            (m if n is None else f"{m}:{n}"): resolve(tree, m, n) for m, n in sorted(set(imports), key=str)
        },
        "seed imports": {(m if n is None else f"{m}:{n}"): resolve(tree, m, n) for m, n in SEED_IMPORTS},
    }


def digest(record: dict[str, Any]) -> str:
    """sha256 of the record's canonical JSON, without the digest field itself."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ----------------------------------------------------------------------------- comparing records

STRUCTURAL = frozenset({"members", "params", "fields", "file", "from", "resolves"})
"""Keys that only say where a fact lives: left out of a change's description."""


def _show(value: Any) -> str:
    if isinstance(value, dict) and "params" in value:
        return "(" + ", ".join(value["params"]) + ")"
    if isinstance(value, dict) and "attribute" in value:
        return f" = {value['attribute']}"
    if isinstance(value, dict) and "missing" in value:
        return "missing"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _label(path: tuple[str, ...]) -> str:
    """A change's name: structural keys dropped, a class path shortened to the class."""
    return ".".join(p if p.startswith("vllm") and ":" in p else p.rsplit(".", 1)[-1] if p.startswith("vllm.") else p
                    for p in path if p not in STRUCTURAL)  # fmt: skip


def changes(base: Any, other: Any, path: tuple[str, ...] = ()) -> list[str]:
    """What differs from ``base`` in ``other``, one short phrase each: ``+name(...)`` (added),
    ``-name`` (gone), ``name: before -> after``."""
    label = _label(path)
    if isinstance(base, list) and isinstance(other, list) and base != other:
        gone = [x for x in base if x not in other]
        new = [x for x in other if x not in base]
        if gone or new:
            parts = [f"-{x}" for x in gone] + [f"+{x}" for x in new]
            return [f"{label or 'parameters'}: {', '.join(map(str, parts))}"]
    if isinstance(base, dict) and isinstance(other, dict):
        if "missing" in other and "missing" not in base:
            return [f"{label or 'it'} is missing"]
        if "missing" in base and "missing" not in other:
            return [f"+{label}{_show(other)}" if label else "present"]
        out: list[str] = []
        for key in [*base, *(k for k in other if k not in base)]:
            sub = _label((*path, key))
            if key == "file" or key == "from":
                continue
            if key not in other:
                out.append(f"-{sub}")
            elif key not in base:
                out.append(f"+{sub}{_show(other[key])}")
            else:
                out.extend(changes(base[key], other[key], (*path, key)))
        return out
    if base != other:
        return [f"{label}: {_show(base)} -> {_show(other)}"]
    return []


def status(base: Any, other: Any) -> tuple[str, list[str]]:
    """("ok" | "changed" | "missing", what changed) of one touch point against the baseline's."""
    diff = changes(base, other)
    if not diff:
        return "ok", []
    if isinstance(other, dict) and "missing" in other:
        return "missing", diff
    return "changed", diff


BASELINE = "0.32.0"
"""The release the table compares against: the one flyserve's tests and e2e runs use."""

TABLE_BEGIN = "<!-- vllm-touchpoints-table: generated by scripts/contracts/vllm_touchpoints.py --table -->"
TABLE_END = "<!-- vllm-touchpoints-table: end -->"


def _cell(kind: str, diff: list[str]) -> str:
    if kind == "ok":
        return "ok"
    return f"{kind}: " + "; ".join(d.replace("|", "\\|") for d in diff)


def render_table(records: dict[str, dict[str, Any]], baseline: str = BASELINE) -> str:
    """The docs/vllm.md table: touch point x release, each cell ok / changed / missing against the
    baseline release, with what changed."""
    versions = sorted(records, key=lambda v: tuple(int(x) for x in v.split(".")))
    base = records[baseline]
    head = "| touch point | " + " | ".join(f"{v} (baseline)" if v == baseline else v for v in versions) + " |"
    lines = [TABLE_BEGIN, head, "|---" * (len(versions) + 1) + "|"]
    for name in base["touchpoints"]:
        cells = [_cell(*status(base["touchpoints"][name], records[v]["touchpoints"].get(name, {"missing": name})))
                 for v in versions]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for section, label in (
        ("imports", "names flyserve imports"),
        ("seed imports", "names the seed backend imports"),
    ):
        cells = []
        for v in versions:
            entries = records[v][section]
            missing = sorted(k for k, e in entries.items() if "missing" in e)
            cells.append(f"missing: {', '.join(missing)}" if missing else f"ok ({len(entries)})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(TABLE_END)
    return "\n".join(lines) + "\n"


def load_records(directory: Path) -> dict[str, dict[str, Any]]:
    return {f.stem: json.loads(f.read_text(encoding="utf-8")) for f in sorted(directory.glob("*.json"))}


def all_imports(root: Path) -> list[tuple[str, str | None]]:
    found = {(s.module, s.name) for s in flyserve_imports(root)}
    return sorted(found | set(STRING_IMPORTS) | set(AHEAD_IMPORTS), key=str)


RECORDS = Path("tests/data/contracts/vllm_touchpoints")
DOCTOR = Path("flyserve/doctor/vllm_versions.py")
DOCS = Path("docs/vllm.md")


def make_record(
    sdist: Path, repo_root: Path, uploaded: str = "", version: str | None = None
) -> dict[str, Any]:
    """The record of one release, read from its sdist or wheel (or a directory holding vllm/)."""
    version = version or release_of(sdist)
    if version is None:
        raise SystemExit(f"{sdist}: name the release with --version (the path does not say it)")
    source: dict[str, Any] = {"distribution": "vllm", "version": version}
    if sdist.is_file():
        source["wheel" if zipfile.is_zipfile(sdist) else "sdist"] = sdist.name
        source["sha256"] = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if uploaded:
        source["uploaded"] = uploaded
    record: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source}
    record.update(extract(Tree.open(sdist), all_imports(repo_root)))
    record["digest"] = digest(record)
    return record


def refresh(sdists: Path, repo_root: Path) -> list[str]:
    """Rewrite every committed record from the file it was read from (sdist or wheel), found in
    ``sdists`` (same sha256 required), then the digests pinned in flyserve/doctor/vllm_versions.py and
    the table in docs/vllm.md."""
    out = []
    records_dir = repo_root / RECORDS
    for path in sorted(records_dir.glob("*.json")):
        old = json.loads(path.read_text(encoding="utf-8"))
        sdist = sdists / (old["source"].get("sdist") or old["source"]["wheel"])
        if hashlib.sha256(sdist.read_bytes()).hexdigest() != old["source"]["sha256"]:
            raise SystemExit(f"{sdist.name}: not the file the record was read from (sha256 differs)")
        new = make_record(sdist, repo_root, old["source"].get("uploaded", ""), old["source"]["version"])
        path.write_text(json.dumps(new, indent=1) + "\n", encoding="utf-8")
        doctor = repo_root / DOCTOR
        text = doctor.read_text(encoding="utf-8")
        pinned = f'"{old["source"]["version"]}",\n        "{old["digest"]}"'
        if pinned not in text:
            raise SystemExit(
                f"{DOCTOR}: no RecordedRelease for {old['source']['version']} with its old digest"
            )
        doctor.write_text(
            text.replace(pinned, pinned.replace(old["digest"], new["digest"])), encoding="utf-8"
        )
        out.append(f"{path.name}: {old['digest'][:12]} -> {new['digest'][:12]}")
    docs = repo_root / DOCS
    text = docs.read_text(encoding="utf-8")
    a, b = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END) + 1
    docs.write_text(text[:a] + render_table(load_records(records_dir)) + text[b:], encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "source",
        type=Path,
        help="a vllm-X.Y.Z.tar.gz sdist, a vllm-X.Y.Z-*.whl wheel, or a directory holding vllm/; "
        "with --table, the directory of records; with --refresh, the directory of the recorded files",
    )
    p.add_argument(
        "--table", action="store_true", help="print the docs/vllm.md table of the records in source"
    )
    p.add_argument("--refresh", action="store_true",
                   help="source is a directory of the recorded files: rewrite records, digests, docs table")  # fmt: skip
    p.add_argument("--version", help="the release (default: from the sdist's or wheel's file name)")
    p.add_argument("--uploaded", default="", help="the file's upload date in the registry")
    p.add_argument("--repo-root", type=Path, default=Path(__file__).resolve().parents[2])
    args = p.parse_args(argv)
    if args.table:
        sys.stdout.write(render_table(load_records(args.source)))
        return 0
    if args.refresh:
        print("\n".join(refresh(args.source, args.repo_root)))
        return 0
    record = make_record(args.source, args.repo_root, args.uploaded, args.version)
    json.dump(record, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
