"""Fakes of kernel entry points built from committed signature descriptions (tests/data/contracts).

A fake has exactly the real function's parameters (names, kinds, defaults, as read from the
library's source at a pinned commit): it binds its arguments with ``inspect.Signature.bind``, so
an unknown keyword, a missing required one or a keyword-only argument passed by position raises
the same ``TypeError`` Python raises for the real function. The FlyDSL fake also enforces the
preconditions its paged path raises on (tests/data/contracts/flydsl_paged_preconditions.json)
and writes ``out`` with a float32 torch reference, so a call that maps an argument wrongly
(seq_lens for a prefix sum, say) computes the wrong numbers.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONTRACTS = Path(__file__).resolve().parents[1] / "data" / "contracts"
FLYDSL_REVISIONS = {
    "main-11c4174d": "flydsl_flash_attn_func-main-11c4174d.json",
    "pr1056-943152de": "flydsl_flash_attn_func-pr1056-943152de.json",
}
AITER_CONTRACT = "aiter_unified_attention-main-e4048607.json"


def load_contract(name: str) -> dict:
    return json.loads((CONTRACTS / name).read_text())


def signature_of(contract: dict) -> inspect.Signature:
    params = []
    for p in contract["parameters"]:
        kind = getattr(inspect.Parameter, p["kind"])
        default = inspect.Parameter.empty if p.get("required", True) else p.get("default")
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            default = inspect.Parameter.empty
        params.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(params)


def fake_function(contract: dict, body: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """A function with the contract's signature; ``body`` gets the bound arguments (defaults applied)
    and, under the key ``"__passed__"``, the keyword names the caller actually passed."""
    sig = signature_of(contract)

    def fn(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)  # TypeError exactly where Python would raise one
        bound.apply_defaults()
        return body({**bound.arguments, "__passed__": frozenset(kwargs)})

    fn.__signature__ = sig  # type: ignore[attr-defined]
    fn.__name__ = contract["function"]
    return fn


class PreconditionError(ValueError):
    """The real function raises (ValueError / NotImplementedError) on this call."""


class FakeFlyDSL:
    """A fake ``kernels.attention.flash_attn_interface`` module for one FlyDSL revision."""

    def __init__(self, revision: str, *, compute: bool = True) -> None:
        self.revision = revision
        self.contract = load_contract(FLYDSL_REVISIONS[revision])
        self.pre = load_contract("flydsl_paged_preconditions.json")
        self.rev = self.pre["revisions"][revision]
        self.compute = compute
        self.calls: list[dict[str, Any]] = []
        self.fail: BaseException | None = None
        self.copied: list[bool] = []  # per call: would the real kernel have copied K/V whole
        self.fn = fake_function(self.contract, self._body)
        self.fn.__module__ = "kernels.attention.flash_attn_interface"

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("kernels.attention.flash_attn_interface")
        mod.flydsl_flash_attn_func = self.fn
        mod.__file__ = f"<fake FlyDSL {self.revision}>"
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
        sizes = tuple(self.rev["page_sizes"])
        if len(sizes) > 1:
            mod._PAGED_PAGE_SIZES = sizes
        else:
            mod._PAGED_PAGE_SIZE = sizes[0]
        if self.rev["strided_kv_in_place"]:
            mod._paged_kv_row_stride = _row_stride
        return mod

    def install(self, monkeypatch: Any) -> None:
        """Make ``kernels.attention.flash_attn_interface`` import as this fake."""
        pkg = _package("kernels")
        sub = _package("kernels.attention")
        monkeypatch.setitem(sys.modules, "kernels", pkg)
        monkeypatch.setitem(sys.modules, "kernels.attention", sub)
        monkeypatch.setitem(sys.modules, "kernels.attention.flash_attn_interface", self.module())
        monkeypatch.delenv("VLLM_FLYDSL_KERNELS_PATH", raising=False)
        monkeypatch.delenv("FLYSERVE_FLYDSL_MODULE", raising=False)

    # ------------------------------------------------------------------ the paged path's checks

    def _body(self, a: dict[str, Any]) -> Any:
        if self.fail is not None:
            raise self.fail
        q, k, v = a["q"], a["k"], a["v"]
        paged = a["block_table"] is not None or a["seqlen_k"] is not None
        if not (q.dtype == k.dtype == v.dtype):
            raise PreconditionError("q/k/v must share dtype")
        dtype = str(q.dtype).removeprefix("torch.")
        if dtype not in self.pre["paged"]["dtypes"]:
            raise PreconditionError(f"dtype {dtype} not supported on the paged path")
        if not paged:
            raise PreconditionError("flyserve only uses the native paged-KV path")
        if a["block_table"] is None or a["seqlen_k"] is None:
            raise PreconditionError("native paged KV (vllm) requires block_table and seqlen_k")
        if a["kv_cache_layout"] not in self.pre["paged"]["kv_cache_layouts"]:
            raise PreconditionError(f"kv_cache_layout {a['kv_cache_layout']!r}")
        if a["kv_cache_layout"] == "linear" and k.dim() != 4:
            raise PreconditionError(f"linear paged K/V must be 4D, got {k.dim()}D")
        varlen = a["cu_seqlens_q"] is not None
        if not varlen:
            raise PreconditionError("flyserve uses the varlen paged path (cu_seqlens_q)")
        if a["cu_seqlens_kv"] is None:
            raise PreconditionError("varlen paged KV requires cu_seqlens_kv")
        if a["max_seqlen_q"] is None:
            raise PreconditionError("varlen paged KV requires max_seqlen_q")
        if a["num_kv_splits"] > 1:
            raise PreconditionError("varlen paged KV does not support split-K")
        if q.dim() != 3:
            raise PreconditionError(f"varlen paged q must be 3D [total_q,H,D], got {q.dim()}D")
        _, num_heads, head_dim = q.shape
        page_size, num_kv_heads_k, k_head_dim = int(k.shape[1]), int(k.shape[2]), int(k.shape[3])
        if page_size not in self.rev["page_sizes"]:
            raise PreconditionError(
                f"native paged KV supports page_size in {self.rev['page_sizes']}, got {page_size}"
            )
        if head_dim not in self.pre["paged"]["head_dims"]:
            raise PreconditionError(f"native paged KV supports head_dim=64 or 128, got {head_dim}")
        if k_head_dim != head_dim:
            raise PreconditionError("paged K head_dim must match q head_dim")
        nkv = a["num_kv_heads"] if a["num_kv_heads"] is not None else num_kv_heads_k
        if num_heads % nkv:
            raise PreconditionError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({nkv})")
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            if a[name] is not None and type(a[name]) is not int:
                raise PreconditionError(f"{name} must be a host int (flyserve), got {type(a[name]).__name__}")
        skv = a["max_seqlen_kv"]
        if (
            skv is not None
            and -(-skv // self.pre["paged"]["tile"]) > self.pre["paged"]["max_kv_tiles_per_split"]
        ):
            raise PreconditionError(f"paged KV length {skv} exceeds the block-table LDS window")
        out = a["out"]
        if out is None or tuple(out.shape) != tuple(q.shape) or not out.is_contiguous():
            raise PreconditionError("out must be given, q's 3-D shape, contiguous (flyserve)")
        dense = k.is_contiguous() and v.is_contiguous()
        in_place = dense or (
            self.rev["strided_kv_in_place"]
            and _row_stride(k, v, page_size, num_kv_heads_k, head_dim) is not None
        )
        self.copied.append(not in_place)
        self.calls.append(a)
        if self.compute:
            _reference_into(out, q, k, v, a)
        return out


def _package(name: str) -> types.ModuleType:
    """An empty package module with a spec (importlib.util.find_spec, which transformers calls on
    'kernels', raises on a module without one)."""
    mod = types.ModuleType(name)
    mod.__path__ = []  # type: ignore[attr-defined]
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return mod


def _row_stride(k: Any, v: Any, page_size: int, num_kv_heads: int, head_dim: int) -> int | None:
    """The rule of PR #1056's _paged_kv_row_stride, as data: a stride the kernel takes, or None."""
    if tuple(k.stride()) != tuple(v.stride()):
        return None
    block_s, row_s, head_s, elem_s = (int(s) for s in k.stride())
    if elem_s != 1 or row_s < num_kv_heads * head_dim or block_s != page_size * row_s:
        return None
    if num_kv_heads > 1 and head_s != head_dim:
        return None
    return None if row_s == num_kv_heads * head_dim else row_s


def _reference_into(out: Any, q: Any, k: Any, v: Any, a: dict[str, Any]) -> None:
    """Causal paged attention in float32 (1/sqrt(D) scale, as the kernel), checking cu_seqlens_kv."""
    import torch

    from flyserve.lab.kernels import TorchReference

    seq = a["seqlen_k"]
    cu_kv = a["cu_seqlens_kv"]
    expect = torch.zeros(seq.numel() + 1, dtype=torch.int64)
    expect[1:] = torch.cumsum(seq.cpu().long(), 0)
    if cu_kv.cpu().long().tolist() != expect.tolist():
        raise PreconditionError(
            f"cu_seqlens_kv {cu_kv.tolist()} is not the prefix sum of seqlen_k {seq.tolist()}"
        )
    TorchReference()(
        q,
        k,
        v,
        out,
        a["cu_seqlens_q"],
        seq,
        a["block_table"],
        a["max_seqlen_q"],
        a["max_seqlen_kv"],
        q.shape[-1] ** -0.5,
        True,
    )


def fake_aiter_unified_attention(calls: list[dict[str, Any]]) -> Callable[..., Any]:
    """aiter's unified_attention with its real signature; records the bound arguments."""
    contract = load_contract(AITER_CONTRACT)

    def body(a: dict[str, Any]) -> None:
        if not a["causal"]:
            raise AssertionError("Only causal attention is supported")  # the real function asserts
        calls.append(a)

    return fake_function(contract, body)
