"""Static eligibility: can this layer group's configuration run on the prefill kernel at all?

The seed (vLLM PR 53335) checks these per batch; none of them changes while serving, so here
they are checked once, when vLLM builds the routing for a group of layers, and a group that
fails is reported (reason ``unsupported``) on every prefill batch instead of being re-checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class PrefillKernelSpec:
    """What the causal prefill kernel accepts. ``head_sizes`` empty means any.

    ``max_kv_len``: the longest KV (``max_seq_len``) the kernel takes, 0 for no limit. A limit of
    the kernel, not an operator threshold: checked per batch by the routing, whatever the
    ``max_seq_len`` threshold says, so a longer batch takes unified instead of raising.
    """

    name: str
    head_sizes: tuple[int, ...] = ()
    dtypes: tuple[str, ...] = HALF_DTYPES
    max_kv_len: int = 0


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layer_problems(layer: Any, spec: PrefillKernelSpec) -> list[str]:
    """Why one attention layer cannot use the prefill kernel ([] if it can).

    ``layer`` is vLLM's Attention module; its ``impl`` (the composite's, which copies the general
    impl's fields) carries the settings. Missing attributes count as 'not used'.
    """
    impl = getattr(layer, "impl", layer)
    general = getattr(impl, "general_impl", impl)
    out: list[str] = []
    head_size = getattr(impl, "head_size", None) or getattr(layer, "head_size", None)
    if spec.head_sizes and head_size not in spec.head_sizes:
        out.append(f"head size {head_size} (kernel takes {list(spec.head_sizes)})")
    scale = getattr(impl, "scale", None)
    if scale is not None and head_size and not math.isclose(float(scale), head_size**-0.5, rel_tol=1e-6):
        out.append(f"softmax scale {float(scale):.6g} is not head_size**-0.5")
    if getattr(general, "alibi_slopes", None) is not None:
        out.append("alibi slopes")
    if getattr(general, "sinks", None) is not None:
        out.append("attention sinks")
    cap = getattr(general, "logits_soft_cap", None)
    if cap:
        out.append(f"logits soft-cap {cap}")
    window = getattr(general, "sliding_window", None)
    if window is not None and window not in (-1, (-1, -1)):
        out.append(f"sliding window {window}")
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype not in ("auto", "bfloat16", "float16"):
        out.append(f"quantised KV cache ({kv_dtype})")
    return out


def group_problems(layers: Iterable[Any], model_dtype: Any, spec: PrefillKernelSpec) -> list[str]:
    """Every distinct problem of a layer group (model dtype first); [] when it is eligible."""
    out: list[str] = []
    name = _dtype_name(model_dtype)
    if spec.dtypes and name not in spec.dtypes:
        out.append(f"dtype {name} (kernel takes {list(spec.dtypes)})")
    for layer in layers:
        for p in layer_problems(layer, spec):
            if p not in out:
                out.append(p)
    return out
