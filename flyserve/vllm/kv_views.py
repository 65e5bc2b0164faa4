"""The per-layer KV cache tensor vLLM's AITER unified backend hands a layer, as a meta tensor, so the
K/V views FlyDSL would get can be checked before any memory exists.

Under the default layout each layer's cache is a contiguous ``(blocks, kv_heads, page, 2*head_size)``.
vLLM 0.30 to 0.34 (``vllm/v1/kv_cache_layout.py``, read from each recorded release) resolve one
physical layout for the model: the logical
shape stays ``[L, B, H, N, C]`` and ``KVCacheLayout.layer_view_order`` permutes its strides; the
AITER unified backend (and so flyserve's FlyDSL backend, its subclass) declares ``LBHNC`` (the default
layout, preferred) and ``LHBNC`` (heads outside blocks), ``supported_kv_cache_layouts`` in
``rocm_aiter_unified_attn.py``. Its ``_split_kv_cache`` (line 212) is unchanged on gfx950:
``kv.transpose(1, 2).split(head_size, -1)``; the ``unbind(0)`` branch is gfx1250's shuffled layout.
Under ``LHBNC`` a block's rows stay ``page_size`` apart but heads are a whole layer's blocks apart,
so with more than one KV head per rank FlyDSL would copy the cache.
"""

from __future__ import annotations

from typing import Any

IDENTITY = (0, 1, 2, 3)
BLOCKS = 2  # two blocks: enough for every stride to show, no memory on the meta device


def layer_view_order(layout_name: str | None) -> tuple[int, ...]:
    """The physical order of the per-layer (B, H, N, C) view for a resolved vLLM layout name
    (vLLM's own enum where it has one; the identity for a vLLM without the enum or an unresolved name)."""
    if not layout_name:
        return IDENTITY
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:  # a vLLM without the enum (older than 0.30): one layout
        return IDENTITY
    try:
        return tuple(KVCacheLayout[layout_name].layer_view_order)
    except KeyError:
        return IDENTITY


def resolved_layout_name(vllm_config: Any) -> str | None:
    """The KV cache layout vLLM resolved for this model (0.30 to 0.34: ``cache_config.kv_cache_layout``)."""
    cache_config = getattr(vllm_config, "cache_config", None)
    name = getattr(cache_config, "kv_cache_layout", None)
    return name if isinstance(name, str) else None


def aiter_layer_cache(
    num_kv_heads: int, page_size: int, head_size: int, order: tuple[int, ...] = IDENTITY
) -> Any:
    """A meta (B, H, N, 2*head_size) tensor with the strides ``order`` gives (physical axis order)."""
    import torch

    logical = (BLOCKS, num_kv_heads, page_size, 2 * head_size)
    physical = torch.empty(tuple(logical[i] for i in order), dtype=torch.bfloat16, device="meta")
    inverse = tuple(order.index(i) for i in range(len(order)))
    return physical.permute(inverse)


def split_like_aiter(kv: Any, head_size: int) -> tuple[Any, Any]:
    """vLLM's AITER unified ``_split_kv_cache`` outside gfx1250's shuffled layout (0.30 to 0.34)."""
    return kv.transpose(1, 2).split(head_size, dim=-1)
