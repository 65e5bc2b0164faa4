"""The plan: every specialization a deployment compiles, and the wrong calls FlyDSL must refuse.

Per page size the revision takes: the warm-up batch, vLLM's serving batches (LPT on and off where
the revision has it), a short batch, and at page 64 the light kernel's batch. Pure: no process is
started here, so the plan is unit-tested without FlyDSL.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flyserve.doctor.compile.geometry import Geometry

# Serving batches: two requests, one past two 256-row q-blocks, KV longer than the query (chunked
# prefill); and a short one (every request <= 256 query tokens, the light kernel's bound).
SERVE_Q, SERVE_KV = (512, 300), (1024, 2048)
SHORT_Q, SHORT_KV = (200, 100), (1024, 2048)
BATCHES = ("warm-up", "serve", "short", "light")
LIGHT_PAGE = 64  # FlyDSL's light kernel pages only in 64-token tiles (flash_attn_interface _PAGED_TILE)


@dataclass(frozen=True, slots=True)
class Variant:
    """One specialization to compile: a batch of a serving situation through call_paged."""

    name: str
    batch: str  # warm-up | serve | short | light | wrong
    layout: str  # contiguous | vllm (vLLM 0.32's AITER cache views, strided)
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    lpt: bool
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    expect: str = "ok"  # ok | rejected
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["q_lens"], d["kv_lens"] = list(self.q_lens), list(self.kv_lens)
        return d


def plan_variants(
    geometry: Geometry,
    *,
    page_sizes: Iterable[int],
    has_causal_lpt: bool,
    wrong_calls: bool = False,
) -> list[Variant]:
    """Every specialization a deployment of ``geometry`` runs on a revision taking ``page_sizes``.

    Per page size: the warm-up batch (contiguous K/V, 512 query tokens) and vLLM's serving batch
    (its AITER cache views) for each LPT value the revision has; a short serving batch (every
    request <= 256 query tokens); at page 64 the light kernel's batch (short, contiguous K/V: the
    lab adapter's; vLLM's strided views never reach it on #1056).
    """
    lpts = (False, True) if has_causal_lpt else (False,)
    g = geometry
    base: dict[str, Any] = {"num_heads": g.num_heads, "num_kv_heads": g.num_kv_heads, "head_size": g.head_size,
                            "dtype": g.dtype}  # fmt: skip
    out: list[Variant] = []
    for page in sorted(set(page_sizes)):
        for lpt in lpts:
            tag = f"p{page}-lpt{int(lpt)}" if has_causal_lpt else f"p{page}"
            out.append(Variant(f"warm-up-{tag}", "warm-up", "contiguous", page, lpt=lpt, q_lens=(512,),
                               kv_lens=(512,), why="flyserve's warm-up batch (before graph capture)", **base))  # fmt: skip
        for lpt in lpts:
            tag = f"p{page}-lpt{int(lpt)}" if has_causal_lpt else f"p{page}"
            out.append(Variant(f"serve-{tag}", "serve", "vllm", page, lpt=lpt, q_lens=SERVE_Q, kv_lens=SERVE_KV,
                               why="a serving prefill batch on vLLM's AITER cache views", **base))  # fmt: skip
        out.append(Variant(f"short-p{page}", "short", "vllm", page, lpt=lpts[-1], q_lens=SHORT_Q, kv_lens=SHORT_KV,
                           why="a serving batch of <= 256 query tokens per request, vLLM's cache", **base))  # fmt: skip
        if page == LIGHT_PAGE:
            out.append(Variant(f"light-p{page}", "light", "contiguous", page, lpt=lpts[-1], q_lens=SHORT_Q,
                               kv_lens=SHORT_KV, why="<= 256 query tokens on contiguous K/V (lab adapter)", **base))  # fmt: skip
    if wrong_calls:
        out.extend(wrong_variants(geometry, has_causal_lpt=has_causal_lpt))
    return out


def wrong_variants(geometry: Geometry, *, has_causal_lpt: bool) -> list[Variant]:
    """Deliberately wrong calls, one fault each, that FlyDSL itself must reject: page 16 (vLLM's
    default block size), head 96, fp32, and a keyword FlyDSL does not have."""
    g = replace(geometry, dtype="bf16" if geometry.dtype == "fp32" else geometry.dtype)
    base: dict[str, Any] = {"batch": "wrong", "layout": "vllm", "num_heads": g.num_heads,
                            "num_kv_heads": g.num_kv_heads, "lpt": has_causal_lpt, "q_lens": SERVE_Q,
                            "kv_lens": SERVE_KV, "expect": "rejected"}  # fmt: skip
    scale = {"softmax_scale": round(g.head_size**-0.5, 6)}
    return [
        Variant("wrong-page16", page_size=16, head_size=g.head_size, dtype=g.dtype, why="page 16", **base),
        Variant("wrong-head96", page_size=64, head_size=96, dtype=g.dtype, why="head size 96", **base),
        Variant("wrong-fp32", page_size=64, head_size=g.head_size, dtype="fp32", why="fp32 q/k/v", **base),
        Variant(
            "wrong-extra-keyword",
            page_size=64,
            head_size=g.head_size,
            dtype=g.dtype,
            why="softmax_scale=",
            extra_kwargs=scale,
            **base,
        ),
    ]
