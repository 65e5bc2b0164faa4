"""The CPU "prefill specialist": causal attention over vLLM's paged CPU KV cache with torch SDPA.

Why it exists: on a CPU machine (CI, the demo) the composite needs two genuinely different
kernels so that routing is real and the two paths can be compared numerically. The general
path is vLLM's own CPU attention (``cpu_attention_with_kv_cache``); this one gathers each
request's K/V blocks from the same cache and runs ``torch.nn.functional.scaled_dot_product_attention``
per request with a bottom-right causal mask.

The CPU cache stores keys (and, with AMX, values) in ISA-specific packed layouts inside each
(block, kv-head) tile. Rather than hard-coding them, the layout is *measured* once per
(isa, block size, head size, dtype): probe tokens whose values encode their (token, dim) are
written with vLLM's own ``cpu_attn_reshape_and_cache`` and the resulting positions become a
gather index. Any layout vLLM's writer uses is read back correctly, or the probe fails loudly.

It shares the general path's metadata builder, so a batch it fails on can be re-run on the
general path unchanged (the circuit breaker does that).

Test hooks (environment, read once per process):
  FLYSERVE_CPU_COMPARE=<path>        also run the general kernel on every batch this path runs and
                                     append {"max_abs": ..., "ref_max": ...} per layer call (JSONL)
  FLYSERVE_CPU_PREFILL_FAIL_AT=<n>   raise on the n-th forward of this path (circuit-breaker tests)
  FLYSERVE_CPU_PREFILL_FAIL_FILE=<p> raise on every forward of this path while file <p> exists
  FLYSERVE_CPU_PREFILL_WARMUP_FAIL=<msg>  the start-up warm-up raises <msg>: the path's circuit opens
                                     and the server runs on the general kernel (as a FlyDSL warm-up
                                     failure does on ROCm; flyserve.vllm.breaker.warm_up_failed)
  FLYSERVE_CPU_PREFILL_UNAVAILABLE=<why>  the path is declared unavailable at start (as a missing
                                     FlyDSL is on ROCm): every layer group reports 'unsupported'
  FLYSERVE_CPU_PREFILL_REPEAT=<n>    a planted slowdown: this path computes each batch n times (1..64;
                                     the output is the last, identical, result). `flyserve demo
                                     --autopilot` sets it: in the engine the two CPU kernels measure
                                     alike, so without it there is nothing for a trial to find
                                     (docs/autopilot.md, "The demo on a real vLLM")
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from flyserve.policy import PREFILL
from flyserve.vllm.breaker import trip
from flyserve.vllm.env_numbers import env_number

COMPARE_ENV = "FLYSERVE_CPU_COMPARE"
FAIL_AT_ENV = "FLYSERVE_CPU_PREFILL_FAIL_AT"
FAIL_FILE_ENV = "FLYSERVE_CPU_PREFILL_FAIL_FILE"
WARMUP_FAIL_ENV = "FLYSERVE_CPU_PREFILL_WARMUP_FAIL"
UNAVAILABLE_ENV = "FLYSERVE_CPU_PREFILL_UNAVAILABLE"
REPEAT_ENV = "FLYSERVE_CPU_PREFILL_REPEAT"
MAX_REPEAT = 64
KERNEL_NAME = "cpu-sdpa-prefill"


def _encode_probe(n: int, digit: int, dtype: torch.dtype) -> torch.Tensor:
    """Values 1..64 encoding base-64 digit ``digit`` of 0..n-1 (exact in bf16/fp16)."""
    idx = torch.arange(n)
    return ((idx // (64**digit)) % 64 + 1).to(dtype)


@functools.lru_cache(maxsize=32)
def cache_layout(
    isa: str, block_size: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices (key_map, value_map), each [block_size, head_size] of flat positions within
    one (block, kv-head) tile, measured from vLLM's cache writer for this ISA."""
    bs, hd = block_size, head_size
    digits = 2  # 64**2 = 4096 > max(bs, hd)
    coords: dict[str, list[torch.Tensor]] = {"kt": [], "kd": [], "vt": [], "vd": []}
    slots = torch.arange(bs, dtype=torch.int64)
    for which in ("t", "d"):
        for digit in range(digits):
            kv = torch.zeros(1, 1, bs, 2 * hd, dtype=dtype)
            kc, vc = kv.view(1, 1, bs * 2, hd).chunk(2, dim=2)
            if which == "t":
                src = _encode_probe(bs, digit, dtype).view(bs, 1, 1).expand(bs, 1, hd).contiguous()
            else:
                src = _encode_probe(hd, digit, dtype).view(1, 1, hd).expand(bs, 1, hd).contiguous()
            ops.cpu_attn_reshape_and_cache(
                src, src.clone(), kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
            )
            coords["k" + which].append(kc[0, 0].reshape(-1).to(torch.int64) - 1)
            coords["v" + which].append(vc[0, 0].reshape(-1).to(torch.int64) - 1)
    maps = []
    for kind in ("k", "v"):
        t = sum(c * (64**i) for i, c in enumerate(coords[kind + "t"]))
        d = sum(c * (64**i) for i, c in enumerate(coords[kind + "d"]))
        pos = torch.arange(bs * hd)
        m = torch.full((bs, hd), -1, dtype=torch.int64)
        ok = (t >= 0) & (t < bs) & (d >= 0) & (d < hd)
        m[t[ok], d[ok]] = pos[ok]
        if int(ok.sum()) != bs * hd or bool((m < 0).any()):
            raise RuntimeError(
                f"cannot read the CPU KV cache layout for isa={isa} block_size={bs} head_size={hd} {dtype}"
            )
        maps.append(m)
    return maps[0], maps[1]


class _Compare:
    """FLYSERVE_CPU_COMPARE: per-call max |prefill - general| (test hook; I/O only when enabled)."""

    def __init__(self, path: str) -> None:
        self.path = path.replace("{pid}", str(os.getpid()))
        self.lock = threading.Lock()

    def write(self, rec: dict[str, Any]) -> None:
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


_COMPARE = _Compare(os.environ[COMPARE_ENV]) if os.environ.get(COMPARE_ENV) else None
_FAIL_AT = env_number(FAIL_AT_ENV, 0, int, ok=lambda n: n >= 0, expect="an integer >= 0")
_REPEAT = env_number(
    REPEAT_ENV, 1, int, ok=lambda n: 1 <= n <= MAX_REPEAT, expect=f"an integer from 1 to {MAX_REPEAT}"
)
_FAIL_FILE = os.environ.get(FAIL_FILE_ENV) or None


class CpuPrefillImpl(CPUAttentionBackendImpl):
    """Causal prefill with torch SDPA over the paged cache; the general CPU kernel as fallback."""

    _calls = 0

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Start-up warm-up: one small causal SDPA call (no cache needed); a failure opens the circuit."""
        super().process_weights_after_loading(act_dtype)
        try:
            injected = os.environ.get(WARMUP_FAIL_ENV)
            if injected:
                raise RuntimeError(f"injected warm-up failure ({WARMUP_FAIL_ENV}={injected[:80]})")
            q = torch.randn(1, 1, 4, 8).to(act_dtype)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        except Exception as exc:  # noqa: BLE001 - any failure: serve on the general kernel instead
            from flyserve.vllm.breaker import warm_up_failed
            from flyserve.vllm.runtime import RankRuntime

            warm_up_failed(RankRuntime.get(), exc, kernel=KERNEL_NAME)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the CPU prefill path")
        try:
            CpuPrefillImpl._calls += 1
            if _FAIL_AT and CpuPrefillImpl._calls == _FAIL_AT:
                raise RuntimeError(f"injected failure ({FAIL_AT_ENV}={_FAIL_AT})")
            if _FAIL_FILE is not None and os.path.exists(_FAIL_FILE):
                raise RuntimeError(f"injected failure ({FAIL_FILE_ENV} exists)")
            for _ in range(_REPEAT):
                self._sdpa_forward(layer, query, kv_cache, attn_metadata, output)
        except Exception as exc:  # noqa: BLE001 - the circuit breaker: any kernel failure
            from flyserve.vllm.runtime import RankRuntime

            trip(RankRuntime.get(), exc, kernel=KERNEL_NAME)
            # Same metadata (shared builder): the batch is re-run on vLLM's CPU kernel, not lost (no
            # output scales here: fused output quantization was refused above).
            return CPUAttentionBackendImpl.forward(
                self, layer, query, key, value, kv_cache, attn_metadata, output
            )
        if _COMPARE is not None:
            self._compare(layer, query, key, value, kv_cache, attn_metadata, output)
        return output

    def _sdpa_forward(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: torch.Tensor
    ) -> None:
        if not md.causal or md.dynamic_causal is not None:
            raise NotImplementedError("the CPU prefill path is causal only")
        num_blocks, kvh, bs, _ = kv_cache.shape
        hd = self.head_size
        tiles = kv_cache.view(num_blocks, kvh, bs * 2, hd)
        key_cache, value_cache = tiles.chunk(2, dim=2)
        kmap, vmap = cache_layout(layer.isa, bs, hd, kv_cache.dtype)
        kflat, vflat = kmap.reshape(-1), vmap.reshape(-1)
        n = md.num_actual_tokens
        out = output[:n].view(n, self.num_heads, hd)
        qsl = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        table = md.block_table
        gqa = self.num_heads != kvh
        for i in range(len(qsl) - 1):
            q0, q1 = qsl[i], qsl[i + 1]
            ql = q1 - q0
            if ql <= 0:
                continue
            ctx = seq_lens[i]
            nb = -(-ctx // bs)
            blocks = table[i, :nb].to(torch.int64)
            # [nb, kvh, bs*hd] tiles -> [kvh, nb*bs, hd] plain rows, cut to the context.
            k = key_cache[blocks].reshape(nb, kvh, bs * hd)[:, :, kflat].view(nb, kvh, bs, hd)
            v = value_cache[blocks].reshape(nb, kvh, bs * hd)[:, :, vflat].view(nb, kvh, bs, hd)
            k = k.permute(1, 0, 2, 3).reshape(kvh, nb * bs, hd)[:, :ctx]
            v = v.permute(1, 0, 2, 3).reshape(kvh, nb * bs, hd)[:, :ctx]
            q = query[q0:q1].transpose(0, 1)  # [H, ql, hd]
            # Bottom-right causal: query row r sits at position ctx - ql + r.
            qpos = torch.arange(ctx - ql, ctx).view(ql, 1)
            mask = torch.arange(ctx).view(1, ctx) <= qpos
            o = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[q0:q1] = o[0].transpose(0, 1)

    def _compare(self, layer, query, key, value, kv_cache, md, output) -> None:
        n = md.num_actual_tokens
        ref = torch.empty_like(output)
        CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, md, ref)
        a, b = output[:n].float(), ref[:n].float()
        assert _COMPARE is not None
        _COMPARE.write(
            {
                "tokens": n,
                "num_reqs": len(md.seq_lens),
                "max_query_len": int(md.max_query_len),
                "max_abs": float((a - b).abs().max()) if n else 0.0,
                "ref_max": float(b.abs().max()) if n else 0.0,
            }
        )


class CpuPrefillBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the SDPA prefill impl: same cache layout, same metadata builder."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[CpuPrefillImpl]:
        return CpuPrefillImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder


PATH = PREFILL
