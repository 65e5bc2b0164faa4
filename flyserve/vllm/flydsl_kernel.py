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
  (``cu_seqlens_q``) also ``cu_seqlens_kv`` and ``max_seqlen_q``; ``cross_seqlen`` defaults to
  None, which the paged varlen path reads as True (bottom-right masking): flyserve passes True
  anyway, so the call does not lean on that default;
* page size 64 on ``main`` 11c4174d (2026-08-21); 64 or 128 on pull request #1056 (943152de,
  2026-08-22), which also adds ``causal_lpt`` and addresses strided K/V views in place;
* the "paged light" kernel (no LPT flag) takes a paged batch only when ``max_seqlen_q <= 256``, the
  page is 64 and K/V are contiguous (#1056 also requires ``stride_kv_n is None``,
  flash_attn_interface.py:582; main copies strided K/V first). vLLM's AITER cache hands strided
  views, so with #1056 every serving batch, even one of <= 256 query tokens, takes the dualwave
  kernel; only contiguous K/V (the lab adapter) reach the light one. A warm-up with a longer query
  compiles the dualwave LPT variants either way. The K/V strides are a run-time argument of the
  compiled kernel (FlyDSL's JIT marks every non-unit stride dynamic, so they are not in its cache
  key): the warm-up's contiguous batch compiles exactly what serving on vLLM's strided cache runs.
  Shown by FlyDSL's own compiler on a CPU (`flyserve flydsl compile`, results/flydsl/): the serving
  batch's cache key equals the warm-up's and a run-only reload finds it.

The installed revision is detected from the real function (``inspect.signature``: is
``causal_lpt`` a parameter), from its module's page-size constant, the KV layouts and paged paths
its source names, and the checkout's commit where it is a git clone (``flydsl_tree``), once, at
load. The label says what was read, never "or older": FlyDSL main past 11c4174d (page 64 only,
``linear3d``, paged FP8, paged ``bias``, no ``causal_lpt``) reads as what it is.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.vllm import flydsl_tree
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.flydsl_cache import CacheCheck, CacheRefused, Deployment, check_cache_dir
from flyserve.vllm.flydsl_key import KeyInputs, host_key_inputs

log = logging.getLogger("flyserve.vllm")

KERNELS_PATH_ENV = "VLLM_FLYDSL_KERNELS_PATH"
MODULE_ENV = "FLYSERVE_FLYDSL_MODULE"
DEFAULT_MODULE = "kernels.attention.flash_attn_interface"
FUNCTION_NAME = "flydsl_flash_attn_func"
LPT_PARAM = "causal_lpt"
HEAD_SIZES = (64, 128)
# The page sizes the dualwave path runs (64; 128 from #1056). The module's private page-size constant
# is intersected with these: FlyDSL's open PR #1055 sets _PAGED_PAGE_SIZES = (16, 64) for the
# paged path as a whole, and 16 must never be declared to vLLM for dualwave.
DUALWAVE_PAGE_SIZES = (64, 128)
# The paged path walks KV in 64-token tiles (flash_attn_interface._PAGED_TILE).
PAGED_TILE = 64
# flash_attn_interface._VARLEN_LIGHT_MAX_SEQ: at page 64 with contiguous K/V, a paged batch whose
# max_seqlen_q is at most this goes to the "paged light" kernel on gfx950 (no LPT flag). vLLM's
# strided cache views never do on #1056 (results/flydsl/943152de.txt, short-p64: dualwave).
LIGHT_MAX_QUERY = 256
# Warm-up query length: two of the dualwave kernel's 256-row q-blocks, past the light kernel.
WARMUP_QUERY_LEN = 512
# 2048 KV tiles staged in LDS per split (flash_attn_interface._PAGED_BT_LDS_SIZE), num_kv_splits=1
# (varlen paged has no split-K): a longer max_seqlen_kv raises NotImplementedError. 131072 tokens
# at every page size: #1056 (943152de, lines 527-537) counts 64-token tiles, not pages (a 128 page
# is two tiles); main 11c4174d counts pages, and its only page size is 64.
MAX_KV_LEN = 2048 * PAGED_TILE
# What the routing checks for the FlyDSL path: static eligibility (dtypes bf16/f16; the scale check
# is generic) and, per batch, the kernel's KV limit (reason context_too_long).
FLYDSL_SPEC = PrefillKernelSpec("flydsl-dualwave", head_sizes=HEAD_SIZES, max_kv_len=MAX_KV_LEN)
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
    kv_layouts: tuple[str, ...] = ()  # the paged KV layouts the module names (linear, linear3d, vectorized)
    paged_fp8: bool = False  # the module has a paged FP8 builder
    commit: str | None = None  # the checkout's commit, where it is a git clone

    @property
    def label(self) -> str:
        """Short name for logs and /dispatch-stats: what was read off the tree, nothing inferred."""
        parts = [
            "causal_lpt (the keyword FlyDSL #1056 added)" if self.has_causal_lpt else "no causal_lpt",
            f"pages {'/'.join(map(str, self.page_sizes)) or 'none dualwave runs'}",
            "strided K/V in place" if self.strided_kv else "strided K/V copied",
        ]
        if "linear3d" in self.kv_layouts:
            parts.append("linear3d")
        if self.paged_fp8:
            parts.append("paged fp8")
        parts.append(f"commit {self.commit[:8]}" if self.commit else "commit unknown (not a git checkout)")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "causal_lpt": self.has_causal_lpt,
            "page_sizes": list(self.page_sizes),
            "strided_kv": self.strided_kv,
            "kv_layouts": list(self.kv_layouts),
            "paged_fp8": self.paged_fp8,
            "commit": self.commit,
            "label": self.label,
        }


@dataclass(frozen=True, slots=True)
class FlyDSLKernel:
    """The loaded function and its revision."""

    fn: Callable[..., Any]
    revision: FlyDSLRevision


def detect_revision(fn: Callable[..., Any]) -> FlyDSLRevision:
    """Read the revision off the real function: its parameters, and its module's page constants
    (only those dualwave runs: ``page_sizes`` may be empty, and then the path stays off)."""
    params = inspect.signature(fn).parameters
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    sizes = getattr(mod, "_PAGED_PAGE_SIZES", None)  # PR #1056: (64, 128)
    if sizes is None:
        one = getattr(mod, "_PAGED_PAGE_SIZE", PAGED_TILE)  # main 11c4174d: 64
        sizes = (int(one),)
    module_file = str(getattr(mod, "__file__", "") or "")
    root = flydsl_tree.checkout_root(module_file) if module_file else None
    return FlyDSLRevision(
        has_causal_lpt=LPT_PARAM in params,
        page_sizes=tuple(p for p in sorted({int(s) for s in sizes}) if p in DUALWAVE_PAGE_SIZES),
        strided_kv=hasattr(mod, "_paged_kv_row_stride"),
        module_file=module_file,
        kv_layouts=flydsl_tree.named_layouts(flydsl_tree.module_source(mod)),
        paged_fp8=hasattr(mod, "_build_paged_fp8"),
        commit=flydsl_tree.checkout_commit(root) if root is not None else None,
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

    The batch (``warm_up_batch``) is one request of ``WARMUP_QUERY_LEN`` (512) query tokens: past
    the paged light kernel (<= 256), so the dualwave kernel - the one with the LPT flag - is what
    compiles. With FlyDSL's disk cache holding these specializations (built on a CPU by
    `flyserve flydsl compile --cache-dir`), nothing compiles: the log line says which happened.
    Both LPT variants where the revision has the flag, else the one kernel. Returns the LPT
    values compiled. Raises whatever the kernel raises (the caller opens the circuit).

    Before the first call FlyDSL's cache folder is checked (``checked_cache``): a folder that fails
    is not loaded - FlyDSL is pointed at a fresh private one - and the warm-up goes on.
    """
    if is_capturing():
        raise RuntimeError("FlyDSL warm-up must run before CUDA-graph capture, not during it")
    q, k, v, out, batch = warm_up_batch(
        dtype=dtype, device=device, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, page_size=page_size,
    )  # fmt: skip
    variants = [False, True] if kernel.revision.has_causal_lpt else [False]
    deployment = Deployment(num_heads, num_kv_heads, head_size, dtype_label(dtype), (page_size,))
    check = checked_cache()
    host = host_key_inputs() if check is not None and check.entries else None
    cache = flydsl_cache_entries()
    t0 = time.perf_counter()
    compiled = 0
    for lpt in variants:
        before = flydsl_cache_entries()
        call_paged(kernel, q, k, v, out, num_kv_heads=num_kv_heads, lpt=lpt, **batch)
        after = flydsl_cache_entries()
        compiled += before is None or after is None or bool(after - before)  # a new entry: it compiled
    seconds = time.perf_counter() - t0
    source = warm_up_source(
        cache, flydsl_cache_entries(), seconds, check=check, deployment=deployment, host=host
    )
    log.info("flyserve: FlyDSL warm-up %s; %s", source, variant_counts(len(variants), compiled, check, host))
    return variants


def variant_counts(variants: int, compiled: int, check: CacheCheck | None, host: KeyInputs | None) -> str:
    """The warm-up's tally: variants a call took from the cache (it wrote no entry), variants it
    compiled, and the folder's entries that can never be a hit here (another flydsl's layout or
    release, another ROCm's bitcode): those are not warm kernels, whatever the folder holds."""
    stale = len(check.stale(host)) if check is not None and host is not None else 0
    return (
        f"{variants - compiled} variants from cache, {compiled} compiled, {stale} stale entries from "
        "another flydsl or another ROCm"
    )


def warm_up_batch(
    *, dtype: Any, device: Any, num_heads: int, num_kv_heads: int, head_size: int, page_size: int
) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """The warm-up's batch: (q, k, v, out, the rest of call_paged's keywords but lpt/num_kv_heads).

    One request of ``WARMUP_QUERY_LEN`` (512) query tokens on contiguous K/V. Also what
    `flyserve flydsl compile` compiles as the warm-up variant, so the check and the server agree.
    """
    import torch

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
    batch = {
        "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "seqlen_k": seqlen_k, "block_table": table,
        "max_seqlen_q": n, "max_seqlen_kv": n,
    }  # fmt: skip
    return q, k, v, out, batch


def kernel_block_sizes(revision: FlyDSLRevision | None) -> tuple[int, ...]:
    """The KV block sizes the composite declares to vLLM (64 and, where accepted, 128)."""
    return revision.page_sizes if revision is not None else (PAGED_TILE,)


# FlyDSL's disk cache (flydsl 0.4.2 and 0.5.0 utils/env.py RuntimeEnvManager): on by default, one folder
# per JIT function (0.4.2: and build) under the cache dir, one ``<key hash>.pkl`` per compiled
# specialization (compiler/jit_function.py JitCacheManager; both layouts: flydsl_layout.py; what
# loading one runs: flydsl_cache.py).
# A warm-up that adds no file compiled nothing. FlyDSL reads these variables on every access and
# opens a JIT function's cache folder at its first call: setting them before the warm-up's first
# call decides where that build's kernels are read from.
CACHE_DIR_ENV = "FLYDSL_RUNTIME_CACHE_DIR"
CACHE_ENABLE_ENV = "FLYDSL_RUNTIME_ENABLE_CACHE"
RUN_ONLY_ENV = "FLYDSL_RUNTIME_RUN_ONLY"  # reads the disk cache even with the cache switched off
PRIVATE_CACHE_PREFIX = "flyserve-flydsl-cache-"


def _env_flag(name: str, default: bool) -> bool:
    """A FlyDSL OptBool: only 1/true/yes/on are true; unset is the default."""
    raw = os.environ.get(name)
    return default if raw is None else raw.lower() in ("1", "true", "yes", "on")


def flydsl_cache_dir() -> str | None:
    """Where FlyDSL reads and writes compiled kernels in this process (None: its cache is off)."""
    if not _env_flag(CACHE_ENABLE_ENV, True) and not _env_flag(RUN_ONLY_ENV, False):
        return None
    root = os.environ.get(CACHE_DIR_ENV)
    if root is None:
        return os.path.join(os.path.expanduser("~"), ".flydsl", "cache")
    return root or None  # set but empty: FlyDSL keeps no disk cache


def flydsl_cache_entries() -> frozenset[str] | None:
    """The compiled specializations in FlyDSL's disk cache now (None: the cache is off)."""
    root = flydsl_cache_dir()
    if root is None:
        return None
    try:
        return frozenset(
            f"{d.name}/{f.name}"
            for d in os.scandir(root)
            if d.is_dir()
            for f in os.scandir(d.path)
            if f.name.endswith(".pkl")
        )
    except OSError:  # no cache folder yet
        return frozenset()


DTYPE_LABELS = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "fp32", "float": "fp32"}


def dtype_label(dtype: Any) -> str:
    """bf16 / f16 / fp32 for a torch dtype (the names `flyserve flydsl compile` lists variants by)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_LABELS.get(name, name)


def checked_cache() -> CacheCheck | None:
    """FlyDSL's cache folder for this process, checked (flydsl_cache.check_cache_dir) before FlyDSL
    opens it. A folder that fails is never handed to FlyDSL: it is pointed at a fresh private folder
    instead (``use_private_cache``) and one warning names the folder and the reason. Never raises:
    a bad cache costs a compile, not the server. None: no disk cache, or the one refused."""
    root = flydsl_cache_dir()
    if root is None:
        return None
    try:
        return check_cache_dir(root)
    except CacheRefused as exc:
        reason = exc.reason
    except Exception as exc:  # noqa: BLE001 - a check that breaks refuses; serving goes on
        reason = f"it could not be checked ({type(exc).__name__})"
    log.warning(
        "flyserve: FlyDSL cache %s not loaded: %s; FlyDSL compiles into %s instead (docs/vllm.md, "
        "\"The cache is code\")",
        root, reason, use_private_cache(),
    )  # fmt: skip
    return None


def use_private_cache() -> str:
    """Point FlyDSL at a new folder only this user can write (mkdtemp: 0700); where that cannot be
    made, at no disk cache (an empty cache dir). Returns what it was pointed at, for the log."""
    try:
        private = tempfile.mkdtemp(prefix=PRIVATE_CACHE_PREFIX)
    except OSError:
        os.environ[CACHE_DIR_ENV] = ""
        return "no disk cache (no private folder could be made)"
    os.environ[CACHE_DIR_ENV] = private
    return private


def warm_up_source(
    before: frozenset[str] | None,
    after: frozenset[str] | None,
    seconds: float,
    *,
    check: CacheCheck | None = None,
    deployment: Deployment | None = None,
    host: KeyInputs | None = None,
) -> str:
    """What the warm-up did, for the log: compiled, or loaded from FlyDSL's cache; with the cache's
    check, which of the entries were there for this deployment's variants (the others are not
    counted as its warm kernels) and, given this host's key inputs, which are stale."""
    if before is None or after is None:
        return f"compiled in {seconds:.1f} s (FlyDSL's disk cache is off: {CACHE_ENABLE_ENV})"
    checked = f"; checked: {check.describe(deployment, host)}" if check is not None and check.entries else ""
    new = len(after - before)
    if new:
        return (
            f"compiled {new} kernel(s) in {seconds:.1f} s, written to FlyDSL's cache {flydsl_cache_dir()}"
            + (f" (it held {len(before)} before{checked})" if checked else "")
        )
    return (
        f"loaded from FlyDSL's cache {flydsl_cache_dir()} in {seconds:.1f} s: nothing compiled "
        f"({len(after)} cached kernel(s) there{checked})"
    )
