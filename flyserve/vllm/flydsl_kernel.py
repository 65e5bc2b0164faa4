"""FlyDSL's ``flydsl_flash_attn_func``: loading it, knowing which revision it is, and the one call.

This is the only place in flyserve that calls FlyDSL. The serving backend (``flyserve.vllm.flydsl``)
and the lab adapter (``flyserve.lab.kernels.FlyDSLDualwave``) both go through ``call_paged``, so
what the lab times is what vLLM runs. No vLLM import here; torch is imported lazily.

The interface, read from FlyDSL's source (``kernels/attention/flash_attn_interface.py``; the
descriptions are committed in tests/data/contracts/ with the commit each was read from):

* three positional tensors then keyword-only parameters, no ``**kwargs``: an unknown keyword is a
  ``TypeError`` on the first prefill batch;
* no softmax-scale parameter: the kernel uses 1/sqrt(head_dim), so a layer with another scale is
  statically ineligible (``flyserve.vllm.eligibility``, reason ``unsupported``);
* the native paged-KV path needs ``block_table`` and ``seqlen_k``, and with packed varlen Q
  (``cu_seqlens_q``) also ``cu_seqlens_kv``, ``max_seqlen_q`` and ``cross_seqlen``;
* page size 64 on ``main`` 11c4174d (2026-08-21); 64 or 128 on pull request #1056 (943152de,
  2026-08-22), which also adds ``causal_lpt`` and addresses strided K/V views in place;
* a paged batch with ``max_seqlen_q <= 256`` at page 64 takes the "paged light" kernel, which has
  no LPT flag: a warm-up must use a longer query to compile the dualwave LPT variants.

The installed revision is detected from the real function (``inspect.signature``: is
``causal_lpt`` a parameter) and from its module's page-size constant, once, at load.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.vllm.eligibility import PrefillKernelSpec

log = logging.getLogger("flyserve.vllm")

KERNELS_PATH_ENV = "VLLM_FLYDSL_KERNELS_PATH"
MODULE_ENV = "FLYSERVE_FLYDSL_MODULE"
DEFAULT_MODULE = "kernels.attention.flash_attn_interface"
FUNCTION_NAME = "flydsl_flash_attn_func"
LPT_PARAM = "causal_lpt"
HEAD_SIZES = (64, 128)
# What static eligibility checks for the FlyDSL path (dtypes: bf16/f16; the scale check is generic).
FLYDSL_SPEC = PrefillKernelSpec("flydsl-dualwave", head_sizes=HEAD_SIZES)
# The paged path walks KV in 64-token tiles (flash_attn_interface._PAGED_TILE).
PAGED_TILE = 64
# flash_attn_interface._VARLEN_LIGHT_MAX_SEQ: at page 64, a paged batch whose max_seqlen_q is at
# most this goes to the "paged light" kernel on gfx950 (no LPT flag).
LIGHT_MAX_QUERY = 256
# Warm-up query length: two of the dualwave kernel's 256-row q-blocks, past the light kernel.
WARMUP_QUERY_LEN = 512
# 2048 KV tiles staged in LDS per split (flash_attn_interface._PAGED_BT_LDS_SIZE), num_kv_splits=1.
MAX_KV_LEN = 2048 * PAGED_TILE
INSTALL_HINT = (
    f"set {KERNELS_PATH_ENV} to a FlyDSL source checkout (git clone https://github.com/ROCm/FlyDSL; "
    "its kernels/ package is not in the flydsl wheel)"
)


class FlyDSLUnavailable(ImportError):
    """flydsl_flash_attn_func could not be imported; the message says where it was looked for."""


@dataclass(frozen=True, slots=True)
class FlyDSLRevision:
    """What the installed FlyDSL accepts, read from the real function and its module."""

    has_causal_lpt: bool
    page_sizes: tuple[int, ...]
    strided_kv: bool  # K/V views with a wider row are addressed in place (no per-call copy)
    module_file: str

    @property
    def label(self) -> str:
        """Short name for logs and /dispatch-stats."""
        if self.has_causal_lpt:
            return f"causal_lpt, pages {'/'.join(map(str, self.page_sizes))} (FlyDSL PR #1056 or newer)"
        return f"no causal_lpt, pages {'/'.join(map(str, self.page_sizes))} (FlyDSL main 11c4174d or older)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "causal_lpt": self.has_causal_lpt,
            "page_sizes": list(self.page_sizes),
            "strided_kv": self.strided_kv,
            "label": self.label,
        }


@dataclass(frozen=True, slots=True)
class FlyDSLKernel:
    """The loaded function and its revision."""

    fn: Callable[..., Any]
    revision: FlyDSLRevision


def detect_revision(fn: Callable[..., Any]) -> FlyDSLRevision:
    """Read the revision off the real function: its parameters, and its module's page constants."""
    params = inspect.signature(fn).parameters
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    sizes = getattr(mod, "_PAGED_PAGE_SIZES", None)  # PR #1056: (64, 128)
    if sizes is None:
        one = getattr(mod, "_PAGED_PAGE_SIZE", PAGED_TILE)  # main 11c4174d: 64
        sizes = (int(one),)
    return FlyDSLRevision(
        has_causal_lpt=LPT_PARAM in params,
        page_sizes=tuple(int(s) for s in sizes),
        strided_kv=hasattr(mod, "_paged_kv_row_stride"),
        module_file=str(getattr(mod, "__file__", "") or ""),
    )


def load_flydsl_kernel() -> FlyDSLKernel:
    """``flydsl_flash_attn_func`` from $VLLM_FLYDSL_KERNELS_PATH (a FlyDSL checkout), with its revision.

    The checkout is on ``sys.path`` only for the import (as in the seed: a checkout root's
    generic top-level names must not shadow other imports afterwards).
    """
    root = os.environ.get(KERNELS_PATH_ENV)
    name = os.environ.get(MODULE_ENV) or DEFAULT_MODULE
    added = False
    if root:
        if not os.path.isdir(os.path.join(root, "kernels", "attention")) and not os.environ.get(MODULE_ENV):
            raise FlyDSLUnavailable(f"{KERNELS_PATH_ENV}={root!r} has no kernels/attention/ directory")
        if root not in sys.path:
            sys.path.insert(0, root)
            added = True
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # ImportError, or a kernel module failing at import on this machine
        raise FlyDSLUnavailable(
            f"{FUNCTION_NAME} not importable from {name} ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc
    finally:
        if added and root in sys.path:
            sys.path.remove(root)
    fn = getattr(mod, FUNCTION_NAME, None)
    if fn is None:
        raise FlyDSLUnavailable(f"{name} has no {FUNCTION_NAME}; {INSTALL_HINT}")
    return FlyDSLKernel(fn=fn, revision=detect_revision(fn))


def try_load() -> tuple[FlyDSLKernel | None, str | None]:
    """(kernel, None), or (None, why not): never raises."""
    try:
        return load_flydsl_kernel(), None
    except FlyDSLUnavailable as exc:
        return None, str(exc)


def call_paged(
    kernel: FlyDSLKernel,
    query: Any,
    key_cache: Any,
    value_cache: Any,
    out: Any,
    *,
    cu_seqlens_q: Any,
    cu_seqlens_kv: Any,
    seqlen_k: Any,
    block_table: Any,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    num_kv_heads: int,
    lpt: bool,
) -> None:
    """One causal batch on FlyDSL's native paged-KV varlen path; writes ``out``.

    query, out: [num_tokens, num_heads, head_size] (3-D, as vLLM's attention layer passes them);
    key_cache, value_cache: [num_blocks, page_size, num_kv_heads, head_size] ("linear" layout,
    strided views allowed where the revision addresses them in place); cu_seqlens_q /
    cu_seqlens_kv: int32 [num_seqs + 1]; seqlen_k: int32 [num_seqs], each row's KV length
    including its query; max lengths: host ints (the kernel never reads them back).
    ``lpt`` is passed as ``causal_lpt`` only where the installed revision has it.
    """
    # Two spelled-out calls rather than a kwargs dict: this runs once per layer per prefill step.
    # Measured (benchmarks/test_bench_flydsl_call.py, 2-core VM, median): direct call 0.48 us, this
    # call site 0.75 us, the same call through a kwargs dict 1.36 us.
    if kernel.revision.has_causal_lpt:
        kernel.fn(
            query, key_cache, value_cache,
            causal=True, num_kv_heads=num_kv_heads, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, cross_seqlen=True, block_table=block_table,
            seqlen_k=seqlen_k, kv_cache_layout="linear", num_kv_splits=1, out=out, causal_lpt=lpt,
        )  # fmt: skip
    else:
        kernel.fn(
            query, key_cache, value_cache,
            causal=True, num_kv_heads=num_kv_heads, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, cross_seqlen=True, block_table=block_table,
            seqlen_k=seqlen_k, kv_cache_layout="linear", num_kv_splits=1, out=out,
        )  # fmt: skip


def kv_layout_problem(key_cache: Any, value_cache: Any, revision: FlyDSLRevision) -> str | None:
    """Why FlyDSL would copy this K/V cache on every call (None: it addresses it in place).

    The kernel computes ``page_base + token * row_stride + head * head_dim``: the head stride is
    fixed to head_dim (read only with more than one KV head) and pages must be ``page_size``
    rows apart. A cache it cannot address is copied whole with ``.contiguous()`` on each call
    (main 11c4174d copies any non-contiguous view); that is a per-layer cache copy per batch, so
    such a layout keeps the prefill path off instead.
    """
    if key_cache.dim() != 4:
        return f"K cache is {key_cache.dim()}-D, the linear paged layout is 4-D"
    _, page_size, num_kv_heads, head_size = (int(s) for s in key_cache.shape)
    if page_size not in revision.page_sizes:
        return f"page size {page_size} (this FlyDSL takes {list(revision.page_sizes)}; start with --block-size 64)"
    if tuple(key_cache.stride()) != tuple(value_cache.stride()):
        return f"K strides {tuple(key_cache.stride())} differ from V strides {tuple(value_cache.stride())}"
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        return None
    if not revision.strided_kv:
        return "K/V are strided views and this FlyDSL revision copies them on every call"
    block_s, row_s, head_s, elem_s = (int(s) for s in key_cache.stride())
    if elem_s != 1 or row_s < num_kv_heads * head_size or block_s != page_size * row_s:
        return f"K/V strides {tuple(key_cache.stride())}: pages are not page_size rows apart"
    if num_kv_heads > 1 and head_s != head_size:
        return f"K/V head stride {head_s} is not head_size {head_size} with {num_kv_heads} KV heads per rank"
    return None


def warm_up(
    kernel: FlyDSLKernel,
    *,
    dtype: Any,
    device: Any,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    page_size: int,
    is_capturing: Callable[[], bool],
) -> list[bool]:
    """Compile the dualwave kernel's variants before any CUDA graph is captured.

    The batch is one request of ``WARMUP_QUERY_LEN`` (512) query tokens: past the paged light
    kernel (<= 256), so the dualwave kernel - the one with the LPT flag - is what compiles.
    Both LPT variants where the revision has the flag, else the one kernel. Returns the LPT
    values compiled. Raises whatever the kernel raises (the caller opens the circuit).
    """
    import torch

    if is_capturing():
        raise RuntimeError("FlyDSL warm-up must run before CUDA-graph capture, not during it")
    n = WARMUP_QUERY_LEN
    blocks = -(-n // page_size)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype=dtype, device=device)

    q = rand(n, num_heads, head_size)
    k = rand(blocks, page_size, num_kv_heads, head_size)
    v = rand(blocks, page_size, num_kv_heads, head_size)
    out = torch.empty_like(q)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    seqlen_k = torch.tensor([n], dtype=torch.int32, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    variants = [False, True] if kernel.revision.has_causal_lpt else [False]
    for lpt in variants:
        call_paged(
            kernel, q, k, v, out,
            cu_seqlens_q=cu, cu_seqlens_kv=cu, seqlen_k=seqlen_k, block_table=table,
            max_seqlen_q=n, max_seqlen_kv=n, num_kv_heads=num_kv_heads, lpt=lpt,
        )  # fmt: skip
    return variants


def kernel_block_sizes(revision: FlyDSLRevision | None) -> tuple[int, ...]:
    """The KV block sizes the composite declares to vLLM (64 and, where accepted, 128)."""
    return revision.page_sizes if revision is not None else (PAGED_TILE,)
