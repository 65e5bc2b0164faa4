"""ROCm gfx950: the FlyDSL dualwave causal prefill backend (the seed's ROCM_FLYDSL_DUALWAVE_ATTN).

As in vLLM PR 53335, it subclasses AITER unified attention and reuses its KV cache layout,
metadata builder and cache-update path, so the two kernels are interchangeable on one cache and
a batch the FlyDSL kernel fails on can be re-run by the unified kernel unchanged (circuit breaker).

The kernel is ``flydsl_flash_attn_func`` from a FlyDSL source checkout named by
``VLLM_FLYDSL_KERNELS_PATH`` (as in the seed; its ``kernels`` package is not in the flydsl wheel).
Differences from the seed, each for a measured or stated reason:

* ``max_seqlen_kv`` is passed from the host-side metadata, so the kernel never reads sequence
  lengths back from the device (a device->host read would stall the step);
* the ``cu_seqlens_kv`` prefix sum is written into one persistent device buffer per builder
  (``PrefixSumBuffer``) with ``torch.cumsum(out=...)``: no allocation per step, a stable address;
* both LPT variants are compiled in ``process_weights_after_loading`` - before vLLM captures any
  CUDA graph - and never while a stream is capturing;
* the LPT ordering comes from the routing's decision (``Decision.lpt``), i.e. from the
  operator-tunable thresholds, instead of module constants.

NOT RUN ON HARDWARE here (no gfx950 machine): tests/unit/test_vllm_flydsl_contract.py checks the
call it makes against a fake kernel module. The keyword names follow FlyDSL's
``flash_attn_interface`` (varlen ``cu_seqlens_q``/``cu_seqlens_kv``, paged ``block_table``/
``num_kv_heads``); check them against your FlyDSL checkout before relying on this backend.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

KERNELS_PATH_ENV = "VLLM_FLYDSL_KERNELS_PATH"
MODULE_ENV = "FLYSERVE_FLYDSL_MODULE"
DEFAULT_MODULES = ("kernels.attention.flash_attn_interface", "kernels.flash_attn_interface")
KERNEL_NAME = "flydsl-dualwave"


class FlyDSLUnavailable(ImportError):
    """flydsl_flash_attn_func could not be imported; the message says where it was looked for."""


def load_flydsl_attn_func() -> Callable[..., Any]:
    """``flydsl_flash_attn_func`` from $VLLM_FLYDSL_KERNELS_PATH (a FlyDSL checkout)."""
    root = os.environ.get(KERNELS_PATH_ENV)
    if root:
        if not os.path.isdir(root):
            raise FlyDSLUnavailable(f"{KERNELS_PATH_ENV}={root!r} is not a directory")
        if root not in sys.path:
            sys.path.insert(0, root)
    names = [os.environ[MODULE_ENV]] if os.environ.get(MODULE_ENV) else list(DEFAULT_MODULES)
    errors = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        fn = getattr(mod, "flydsl_flash_attn_func", None)
        if fn is not None:
            return fn
        errors.append(f"{name}: has no flydsl_flash_attn_func")
    raise FlyDSLUnavailable(
        f"flydsl_flash_attn_func not found (set {KERNELS_PATH_ENV} to a FlyDSL checkout): "
        + "; ".join(errors)
    )


class PrefixSumBuffer:
    """A persistent device buffer holding [0, cumsum(seq_lens)] (int32), rewritten in place."""

    def __init__(self, capacity: int, device: Any) -> None:
        import torch

        self.buf = torch.zeros(capacity + 1, dtype=torch.int32, device=device)

    def fill(self, seq_lens: Any, num_reqs: int) -> Any:
        import torch

        if num_reqs + 1 > self.buf.numel():
            raise ValueError(f"{num_reqs} requests exceed the prefix-sum buffer ({self.buf.numel() - 1})")
        torch.cumsum(seq_lens[:num_reqs], 0, dtype=torch.int32, out=self.buf[1 : num_reqs + 1])
        return self.buf[: num_reqs + 1]


def call_kernel(
    fn: Callable[..., Any],
    query: Any,
    key_cache: Any,
    value_cache: Any,
    md: Any,
    output: Any,
    *,
    num_kv_heads: int,
    scale: float,
    lpt: bool,
) -> None:
    """One causal prefill batch on the paged cache. Host ints only for the max lengths."""
    n = md.num_actual_tokens
    fn(
        query[:n],
        key_cache,
        value_cache,
        causal=True,
        out=output[:n],
        cu_seqlens_q=md.query_start_loc,
        cu_seqlens_kv=md.cu_seqlens_kv,
        max_seqlen_q=int(md.max_query_len),
        max_seqlen_kv=int(md.max_seq_len),
        block_table=md.block_table,
        num_kv_heads=num_kv_heads,
        softmax_scale=scale,
        lpt=bool(lpt),
    )


def warm_up(
    fn: Callable[..., Any],
    *,
    dtype: Any,
    device: Any,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    is_capturing: Callable[[], bool],
) -> None:
    """Compile both LPT variants with a one-request batch. Refuses to run inside graph capture."""
    import torch

    if is_capturing():
        raise RuntimeError("FlyDSL warm-up must run before CUDA-graph capture, not during it")
    q_len = block_size
    q = torch.zeros(q_len, num_heads, head_size, dtype=dtype, device=device)
    k = torch.zeros(1, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    out = torch.empty_like(q)
    cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    md = type(
        "WarmupMetadata",
        (),
        {
            "num_actual_tokens": q_len,
            "query_start_loc": cu_q,
            "cu_seqlens_kv": cu_q.clone(),
            "max_query_len": q_len,
            "max_seq_len": q_len,
            "block_table": torch.zeros(1, 1, dtype=torch.int32, device=device),
        },
    )()
    for lpt in (False, True):
        call_kernel(fn, q, k, v, md, out, num_kv_heads=num_kv_heads, scale=head_size**-0.5, lpt=lpt)


def _last_lpt() -> bool:
    from flyserve.vllm.runtime import RankRuntime

    inst = RankRuntime._instance
    d = inst.last_decision if inst is not None else None
    return bool(d is not None and d.lpt)


# ----------------------------------------------------------------------------- vLLM classes
# Built on import of this module, which only happens on ROCm (flyserve.vllm.backends imports it
# lazily for the ROCm composite) and in the contract tests.

from vllm.v1.attention.backends.rocm_aiter_unified_attn import (
    RocmAiterUnifiedAttentionBackend,
    RocmAiterUnifiedAttentionImpl,
    RocmAiterUnifiedAttentionMetadataBuilder,
)


class FlyDSLDualwaveMetadataBuilder(RocmAiterUnifiedAttentionMetadataBuilder):
    """The unified builder's metadata plus the persistent cu_seqlens_kv and the decision's LPT flag."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any, **kw: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kw)
        self.cu_seqlens_kv = PrefixSumBuffer(vllm_config.scheduler_config.max_num_seqs, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.cu_seqlens_kv = self.cu_seqlens_kv.fill(
            common_attn_metadata.seq_lens, common_attn_metadata.num_reqs
        )
        md.lpt = _last_lpt()  # set by FlyserveRouting.select() just before this build
        return md


class FlyDSLDualwaveImpl(RocmAiterUnifiedAttentionImpl):
    """FlyDSL dualwave for causal prefill; AITER unified (the parent) re-runs a batch it fails on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flydsl_attn = load_flydsl_attn_func()

    def process_weights_after_loading(self, act_dtype: Any) -> None:
        super().process_weights_after_loading(act_dtype)
        import torch
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        block_size = cfg.cache_config.block_size if cfg is not None else 64
        warm_up(
            self.flydsl_attn,
            dtype=act_dtype,
            device=torch.device("cuda", torch.cuda.current_device()),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=block_size,
            is_capturing=torch.cuda.is_current_stream_capturing,
        )

    def forward(
        self,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        output_scale: Any = None,
        output_block_scale: Any = None,
    ) -> Any:
        if attn_metadata is None or output_scale is not None or output_block_scale is not None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        try:
            key_cache, value_cache = self._split_kv_cache(kv_cache)
            call_kernel(
                self.flydsl_attn,
                query,
                key_cache,
                value_cache,
                attn_metadata,
                output,
                num_kv_heads=self.num_kv_heads,
                scale=self.scale,
                lpt=getattr(attn_metadata, "lpt", False),
            )
            return output
        except Exception as exc:  # noqa: BLE001 - the circuit breaker: any kernel failure
            from flyserve.vllm.breaker import trip
            from flyserve.vllm.runtime import RankRuntime

            trip(RankRuntime.get(), exc, kernel=KERNEL_NAME)
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )


class FlyDSLDualwaveBackend(RocmAiterUnifiedAttentionBackend):
    """Same cache layout and builder family as AITER unified; the FlyDSL impl."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlyDSLDualwaveImpl]:
        return FlyDSLDualwaveImpl

    @staticmethod
    def get_builder_cls() -> type[FlyDSLDualwaveMetadataBuilder]:
        return FlyDSLDualwaveMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in (64, 128)
