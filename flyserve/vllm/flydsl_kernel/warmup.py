"""The warm-up: compile the dualwave kernel's variants before any CUDA graph is captured, and say
what it did (compiled, or loaded from FlyDSL's disk cache; which cached entries were this
deployment's, which stale). torch is imported lazily.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flyserve.vllm.flydsl_cache import CacheCheck, Deployment
from flyserve.vllm.flydsl_kernel.call import call_paged
from flyserve.vllm.flydsl_kernel.disk_cache import (
    CACHE_ENABLE_ENV,
    checked_cache,
    flydsl_cache_dir,
    flydsl_cache_entries,
)
from flyserve.vllm.flydsl_kernel.load import FlyDSLKernel
from flyserve.vllm.flydsl_key import KeyInputs, host_key_inputs

log = logging.getLogger("flyserve.vllm")

# Warm-up query length: two of the dualwave kernel's 256-row q-blocks, past the light kernel.
WARMUP_QUERY_LEN = 512
DTYPE_LABELS = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "fp32", "float": "fp32"}


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


def dtype_label(dtype: Any) -> str:
    """bf16 / f16 / fp32 for a torch dtype (the names `flyserve flydsl compile` lists variants by)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_LABELS.get(name, name)


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
