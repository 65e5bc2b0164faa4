"""vLLM's own call of AITER's ``unified_attention``, read from vLLM's source, against the installed aiter.

Why: on ROCm flyserve's general kernel is vLLM's ``ROCM_AITER_UNIFIED_ATTN``, and there vLLM, not
flyserve, calls aiter. vLLM 0.34 passes ``shuffled_kv_cache=`` in that call
(vllm/v1/attention/backends/rocm_aiter_unified_attn.py:332 in the 0.34.0 wheel; 0.32's call has no such
keyword): an aiter whose ``unified_attention`` lacks it starts serving and raises ``TypeError`` inside
vLLM on the first forward. The doctor checks flyserve's own calls by binding them (checks.binds); this
module does the same for vLLM's call, from the source text with ``ast``: the backend module imports
ROCm-only code, so it is never imported here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

AITER_BACKEND = "vllm/v1/attention/backends/rocm_aiter_unified_attn.py"
FUNCTION = "unified_attention"


@dataclass(frozen=True, slots=True)
class AiterCall:
    """One call of AITER's ``unified_attention`` in vLLM's source: where aiter's function is imported
    from, the call's line, its keywords and how many arguments it passes by position."""

    module: str
    line: int
    keywords: tuple[str, ...]
    positional: int


def aiter_calls(source: str) -> list[AiterCall]:
    """Every call of aiter's ``unified_attention`` in a module's source: the function imported from an
    ``aiter...`` module, called by its name or through the attribute it is stored in
    (``self.unified_attention = unified_attention``, then ``self.unified_attention(...)``).
    vLLM's own Triton ``unified_attention`` (imported from ``vllm...``) is not aiter's and is left out."""
    tree = ast.parse(source)
    local: dict[str, str] = {}  # local name -> the aiter module it came from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "aiter":
            for a in node.names:
                if a.name == FUNCTION:
                    local[a.asname or a.name] = node.module
    stored: dict[str, str] = {}  # attribute name -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in local:
            for t in node.targets:
                if isinstance(t, ast.Attribute):
                    stored[t.attr] = local[node.value.id]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        module = None
        if isinstance(f, ast.Name):
            module = local.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            module = stored.get(f.attr)
        if module is None:
            continue
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        out.append(AiterCall(module, node.lineno, keywords, len(node.args)))
    return sorted(out, key=lambda c: c.line)


def installed_backend_source() -> tuple[Path, str] | None:
    """The installed vLLM's AITER unified backend: (path, text), found without importing vLLM's
    submodules; None without vLLM or without that file."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / AITER_BACKEND.removeprefix("vllm/")
        if path.is_file():
            return path, path.read_text(encoding="utf-8")
    return None


def unbound(call: AiterCall, fn: Callable[..., Any]) -> tuple[list[str], str | None]:
    """(the call's keywords ``fn`` has no parameter for, the TypeError binding the call raises or None).
    A function taking ``**kwargs`` accepts every keyword."""
    sig = inspect.signature(fn)
    kinds = {p.kind for p in sig.parameters.values()}
    missing = (
        []
        if inspect.Parameter.VAR_KEYWORD in kinds
        else [k for k in call.keywords if k not in sig.parameters]
    )
    try:
        sig.bind(*([None] * call.positional), **dict.fromkeys(call.keywords))
    except TypeError as exc:
        return missing, str(exc)
    return missing, None


def vllm_call_problems(
    calls: list[AiterCall], resolve: Callable[[str], Callable[..., Any]]
) -> tuple[str, list[str]]:
    """("ok" | "fail", one line per call that would not bind): ``resolve(module)`` gives aiter's
    function as vLLM imports it."""
    problems = []
    for call in calls:
        fn = resolve(call.module)
        missing, error = unbound(call, fn)
        if missing or error:
            what = f"keyword(s) {', '.join(m + '=' for m in missing)} missing" if missing else error
            problems.append(f"line {call.line}: {what}")
    return ("fail" if problems else "ok"), problems


def _import_function(module: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), FUNCTION)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def assess_vllm_aiter_call(
    source: tuple[Path, str] | None = None, resolve: Callable[[str], Callable[..., Any]] | None = None
) -> tuple[Literal["ok", "warn", "fail"], str, str]:
    """The doctor's ``rocm-vllm-aiter-call`` line as (status, detail, fix): does the installed aiter take
    every keyword the installed vLLM's AITER backend passes it? ``source`` and ``resolve`` default to
    the installed vLLM's file and an import of aiter's module."""
    fix = (
        "install an aiter whose unified_attention takes these keywords (ROCm/aiter e4048607 or newer, "
        "built from source or from a ROCm vLLM image: docs/vllm.md, 'Which aiter'), or a vLLM release "
        "whose call your aiter takes"
    )
    source = source if source is not None else installed_backend_source()
    if source is None:
        return "warn", f"the installed vLLM has no {AITER_BACKEND}: vLLM's AITER call not checked", ""
    path, text = source
    try:
        calls = aiter_calls(text)
    except SyntaxError as exc:
        return "warn", f"{path}: not readable ({_short(exc)})", ""
    if not calls:
        return "warn", (f"{path.name}: no call of aiter's {FUNCTION} found: this vLLM calls AITER "
                        "differently; compare it with the installed aiter by hand"), ""  # fmt: skip
    first = calls[0]
    where = f"{path.name}:{first.line}"
    try:
        _status, problems = vllm_call_problems(calls, resolve or _import_function)
    except Exception as exc:  # noqa: BLE001 - aiter absent or broken (rocm-unified says which)
        return "warn", (f"vLLM's AITER call ({where}: {', '.join(first.keywords)}) not compared: "
                        f"{first.module}.{FUNCTION} not importable ({_short(exc)})"), fix  # fmt: skip
    if problems:
        return "fail", (f"vLLM's own call of {first.module}.{FUNCTION} ({path.name}) does not bind to the "
                        f"installed aiter: {'; '.join(problems)}; vLLM's ROCM_AITER_UNIFIED_ATTN, flyserve's "
                        "general kernel, would raise TypeError on its first forward"), fix  # fmt: skip
    return "ok", (f"vLLM's own call of {first.module}.{FUNCTION} ({where}, {len(first.keywords)} keywords) "
                  "binds to the installed aiter"), ""  # fmt: skip
