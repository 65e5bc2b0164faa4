"""Loading FlyDSL's ``flydsl_flash_attn_func`` and reading which revision it is.

The installed revision is detected from the real function (``inspect.signature``: is
``causal_lpt`` a parameter), from its module's page-size constant, the KV layouts and paged paths
its source names, and the checkout's commit where it is a git clone (``flydsl_tree``), once, at
load. The label says what was read, never "or older": FlyDSL main past 11c4174d (page 64 only,
``linear3d``, paged FP8, paged ``bias``, no ``causal_lpt``) reads as what it is.

No vLLM or torch import here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.vllm import flydsl_tree
from flyserve.vllm.flydsl_kernel.limits import DUALWAVE_PAGE_SIZES, PAGED_TILE

KERNELS_PATH_ENV = "VLLM_FLYDSL_KERNELS_PATH"
MODULE_ENV = "FLYSERVE_FLYDSL_MODULE"
DEFAULT_MODULE = "kernels.attention.flash_attn_interface"
FUNCTION_NAME = "flydsl_flash_attn_func"
LPT_PARAM = "causal_lpt"
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


def kernel_block_sizes(revision: FlyDSLRevision | None) -> tuple[int, ...]:
    """The KV block sizes the composite declares to vLLM (64 and, where accepted, 128)."""
    return revision.page_sizes if revision is not None else (PAGED_TILE,)
