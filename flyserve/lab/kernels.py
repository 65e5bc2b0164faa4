"""Attention kernels behind one call signature, so calibrate and live replay time them alike.

    kernel(q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
           max_seqlen_q, max_seqlen_k, scale, causal) -> None      # writes ``out``

* q, out: [num_tokens, num_heads, head_size]; k_cache, v_cache: [num_blocks, block_size,
  num_kv_heads, head_size] (vLLM's paged layout); cu_seqlens_q: int32 [num_seqs + 1];
  seqused_k: int32 [num_seqs], each row's context length INCLUDING its query tokens;
  block_table: int32 [num_seqs, max_blocks_per_seq]; max_seqlen_q / max_seqlen_k: host ints
  (passing them as ints is what keeps the call free of device reads).

Adapters, each calling the real kernel exactly as vLLM's backend does (the arguments that are
not part of the signature take the values vLLM passes for a plain causal decoder layer: no
sliding window, no soft-cap, no sinks, unquantised KV):

* ``triton_unified``: vLLM's Triton unified attention (TRITON_ATTN), with the 3D split-softmax
  buffers TritonAttentionMetadataBuilder allocates (seq_threshold_3D = 128 // num_kv_heads,
  16 segments), so small decode batches take the same kernel they take in vLLM.
* ``fa3``: vLLM's FlashAttention-3 varlen (FLASH_ATTN, ``fa_version=3``), paged.
* ``aiter_unified``: aiter's Triton unified attention (ROCM_AITER_UNIFIED_ATTN).
* ``flydsl_dualwave``: FlyDSL's ``flydsl_flash_attn_func`` on its paged ABI (gfx950 dualwave).
* ``torch_ref``: a float32 reference in plain torch (CPU or GPU), for correctness.

torch and the kernel modules are imported lazily, on first use.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class KernelUnavailable(RuntimeError):
    """The kernel's module is not importable here (no vLLM / aiter / FlyDSL, or no GPU)."""


class AttentionKernel(Protocol):
    name: str

    def __call__(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        out: Any,
        cu_seqlens_q: Any,
        seqused_k: Any,
        block_table: Any,
        max_seqlen_q: int,
        max_seqlen_k: int,
        scale: float,
        causal: bool,
    ) -> None: ...


def _import(module: str, attr: str, *, what: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken extension raising anything
        raise KernelUnavailable(f"{what}: cannot import {module} ({type(exc).__name__}: {exc})") from exc
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise KernelUnavailable(f"{what}: {module} has no {attr}") from None


# ----------------------------------------------------------------------------- vLLM Triton unified

MIN_LAUNCH_GRID_SIZE_2D = 128  # vllm/v1/attention/backends/triton_attn.py
NUM_PAR_SOFTMAX_SEGMENTS = 16


class TritonUnifiedAttention:
    """vLLM's TRITON_ATTN kernel, ``vllm.v1.attention.ops.triton_unified_attention.unified_attention``."""

    name = "triton_unified"
    module = "vllm.v1.attention.ops.triton_unified_attention"

    def __init__(self) -> None:
        self._fn: Any = None
        self._buffers: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def load(self) -> TritonUnifiedAttention:
        if self._fn is None:
            self._fn = _import(self.module, "unified_attention", what="vLLM Triton unified attention")
        return self

    def _segments(self, q: Any, k_cache: Any) -> tuple[Any, ...]:
        """The builder's persistent 3D-kernel buffers, made once per (device, heads, head size)."""
        import torch

        num_heads, head_size = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        key = (q.device, num_heads, num_kv_heads, head_size)
        buf = self._buffers.get(key)
        if buf is None:
            thr = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
            padded = 1 << (head_size - 1).bit_length()
            f32 = torch.float32
            seg = NUM_PAR_SOFTMAX_SEGMENTS
            buf = (
                thr,
                torch.empty((thr, num_heads, seg, padded), dtype=f32, device=q.device),
                torch.empty((thr, num_heads, seg), dtype=f32, device=q.device),
                torch.empty((thr, num_heads, seg), dtype=f32, device=q.device),
                torch.ones((1,), dtype=f32, device=q.device),
            )
            self._buffers[key] = buf
        return buf

    def __call__(self, q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, scale, causal) -> None:  # fmt: skip
        fn = self.load()._fn
        thr, segm_out, segm_max, segm_expsum, one = self._segments(q, k_cache)
        descale = one.expand((seqused_k.shape[0], k_cache.shape[2]))
        fn(
            q=q,
            k=k_cache,
            v=v_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=causal,
            alibi_slopes=None,
            window_size=(-1, -1),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            seq_threshold_3D=thr,
            num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=segm_out,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_expsum,
            sinks=None,
            output_scale=None,
        )


# ----------------------------------------------------------------------------- vLLM FA3


class FlashAttention3:
    """vLLM's FLASH_ATTN kernel: ``vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)``."""

    name = "fa3"
    module = "vllm.vllm_flash_attn"

    def __init__(self) -> None:
        self._fn: Any = None

    def load(self) -> FlashAttention3:
        if self._fn is None:
            self._fn = _import(self.module, "flash_attn_varlen_func", what="vLLM FlashAttention-3")
        return self

    def __call__(self, q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, scale, causal) -> None:  # fmt: skip
        fn = self.load()._fn
        fn(
            q=q,
            k=k_cache,
            v=v_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=causal,
            alibi_slopes=None,
            window_size=[-1, -1],
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=None,
            fa_version=3,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            num_splits=0,
        )


# ----------------------------------------------------------------------------- aiter (gfx950)


class AiterUnifiedAttention:
    """aiter's ``aiter.ops.triton.unified_attention.unified_attention`` (ROCM_AITER_UNIFIED_ATTN)."""

    name = "aiter_unified"
    module = "aiter.ops.triton.unified_attention"

    def __init__(self) -> None:
        self._fn: Any = None
        self._one: dict[Any, Any] = {}

    def load(self) -> AiterUnifiedAttention:
        if self._fn is None:
            self._fn = _import(self.module, "unified_attention", what="aiter unified attention")
        return self

    def __call__(self, q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, scale, causal) -> None:  # fmt: skip
        fn = self.load()._fn
        if not causal:
            raise ValueError(
                "aiter unified attention is causal-only (vLLM falls back to Triton for non-causal)"
            )
        one = self._one.get(q.device)
        if one is None:
            import torch

            one = self._one[q.device] = torch.ones((1,), dtype=torch.float32, device=q.device)
        fn(
            q=q,
            k=k_cache,
            v=v_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            alibi_slopes=None,
            window_size=(-1, -1),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=one,
            v_descale=one,
            sinks=None,
            output_scale=None,
        )


# ----------------------------------------------------------------------------- FlyDSL dualwave (gfx950)


class FlyDSLDualwave:
    """FlyDSL's ``flydsl_flash_attn_func`` through flyserve's one call site
    (``flyserve.vllm.flydsl_kernel.call_paged``, the same call the serving backend makes): packed
    varlen q, vLLM-style block_table + seqlen_k + cu_seqlens_kv, ``linear`` KV layout.

    That API takes no softmax scale (it uses 1/sqrt(head_size)) and is causal on this path, so
    any other scale or a non-causal call is refused rather than silently computing something else.
    ``lpt`` is the ordering to time (passed only where the installed FlyDSL has ``causal_lpt``).
    """

    name = "flydsl_dualwave"

    def __init__(self, lpt: bool = True) -> None:
        self._kernel: Any = None
        self.lpt = lpt

    def load(self) -> FlyDSLDualwave:
        if self._kernel is None:
            from flyserve.vllm.flydsl_kernel import FlyDSLUnavailable, checked_cache, load_flydsl_kernel

            try:
                self._kernel = load_flydsl_kernel()
            except FlyDSLUnavailable as exc:
                raise KernelUnavailable(f"FlyDSL dualwave: {exc}") from exc
            checked_cache()  # before FlyDSL's first call opens its cache folder: a bad one is not loaded
        return self

    def __call__(self, q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, scale, causal) -> None:  # fmt: skip
        import torch

        from flyserve.vllm.flydsl_kernel import call_paged

        kernel = self.load()._kernel
        head_size = q.shape[-1]
        if not math.isclose(scale, 1.0 / math.sqrt(head_size), rel_tol=1e-6):
            raise ValueError(f"flydsl_flash_attn_func uses softmax scale 1/sqrt({head_size}); got {scale}")
        if not causal:
            raise ValueError("flyserve calls FlyDSL's paged path causal only")
        cu_kv = torch.zeros(seqused_k.numel() + 1, dtype=torch.int32, device=seqused_k.device)
        torch.cumsum(seqused_k, 0, dtype=torch.int32, out=cu_kv[1:])
        call_paged(
            kernel, q, k_cache, v_cache, out,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_kv, seqlen_k=seqused_k, block_table=block_table,
            max_seqlen_q=int(max_seqlen_q), max_seqlen_kv=int(max_seqlen_k),
            num_kv_heads=int(k_cache.shape[2]), lpt=self.lpt,
        )  # fmt: skip


# ----------------------------------------------------------------------------- torch reference


def _gather_kv(cache: Any, blocks: Any, n: int) -> Any:
    """[n, kv_heads, head] for one row: its first n cached tokens through the block table."""
    bs = cache.shape[1]
    nb = -(-n // bs)
    return cache[blocks[:nb].long()].reshape(nb * bs, cache.shape[2], cache.shape[3])[:n]


def reference_row(q_row: Any, k: Any, v: Any, ctx: int, positions: Any, scale: float, causal: bool) -> Any:
    """Attention of the query tokens at ``positions`` (indices into the row's query) in float32.

    q_row: [q_len, H, D]; k, v: [ctx, Hkv, D]. Token i of the query sits at absolute position
    ctx - q_len + i and, when causal, sees keys 0 .. that position.
    """
    import torch

    q_len, num_heads, _ = q_row.shape
    group = num_heads // k.shape[1]
    qs = q_row[positions].float()  # [m, H, D]
    kf = k.float().repeat_interleave(group, dim=1)  # [ctx, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", qs, kf) * scale
    if causal:
        qpos = (ctx - q_len + positions.to(scores.device)).view(1, -1, 1)
        kpos = torch.arange(ctx, device=scores.device).view(1, 1, -1)
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", p, vf)


class TorchReference:
    """Plain-torch paged attention (float32 math). Slow; for correctness only."""

    name = "torch_ref"

    def load(self) -> TorchReference:
        return self

    def __call__(self, q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, scale, causal) -> None:  # fmt: skip
        import torch

        qsl = cu_seqlens_q.tolist()
        ctxs = seqused_k.tolist()
        for i, ctx in enumerate(ctxs):
            a, b = qsl[i], qsl[i + 1]
            if b == a:
                continue
            k = _gather_kv(k_cache, block_table[i], ctx)
            v = _gather_kv(v_cache, block_table[i], ctx)
            pos = torch.arange(b - a, device=q.device)
            out[a:b] = reference_row(q[a:b], k, v, ctx, pos, scale, causal).to(out.dtype)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class KernelPair:
    """The two paths of one platform's composite backend."""

    platform: str
    unified: str
    prefill: str


PAIRS: dict[str, KernelPair] = {
    "cuda": KernelPair("cuda", "triton_unified", "fa3"),
    "rocm": KernelPair("rocm", "aiter_unified", "flydsl_dualwave"),
}

_FACTORIES = {
    "triton_unified": TritonUnifiedAttention,
    "fa3": FlashAttention3,
    "aiter_unified": AiterUnifiedAttention,
    "flydsl_dualwave": FlyDSLDualwave,
    "torch_ref": TorchReference,
}


def kernel_names() -> Sequence[str]:
    return tuple(_FACTORIES)


def get_kernel(name: str, *, load: bool = True) -> Any:
    """A kernel adapter by name; ``load=True`` imports its module now (KernelUnavailable if absent)."""
    try:
        k = _FACTORIES[name]()
    except KeyError:
        raise KernelUnavailable(f"unknown kernel {name!r} (known: {', '.join(_FACTORIES)})") from None
    return k.load() if load else k
