"""The one call of FlyDSL (``call_paged``) and the check of the K/V layout it addresses in place.

The serving backend (``flyserve.vllm.flydsl``), the warm-up, `flyserve flydsl compile` and the lab
adapter (``flyserve.lab.kernels.FlyDSLDualwave``) all go through ``call_paged``, so what the lab
times is what vLLM runs. No vLLM import here.

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
"""

from __future__ import annotations

from typing import Any

from flyserve.vllm.flydsl_kernel.load import FlyDSLKernel, FlyDSLRevision


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
