"""ROCm gfx950: the FlyDSL dualwave causal prefill backend (the seed's ROCM_FLYDSL_DUALWAVE_ATTN).

As in vLLM PR 53335, it subclasses AITER unified attention and reuses its KV cache layout,
metadata builder and cache-update path, so the two kernels are interchangeable on one cache and
a batch the FlyDSL kernel fails on can be re-run by the unified kernel unchanged (circuit breaker).

The kernel call itself lives in ``flyserve.vllm.flydsl_kernel`` (shared with the lab). Here:

* **block sizes**: the backend declares FlyDSL's page sizes (64; 128 where the installed revision
  takes it) through vLLM's ``get_supported_kernel_block_sizes``, so vLLM picks 64 by itself; with
  an explicit ``--block-size`` FlyDSL cannot page (16, say) it declares AITER's sizes instead and
  the prefill path is statically off (reason ``unsupported``, the log names ``--block-size 64``);
* **the decision**: the builder reads the LPT flag from the routing object the composite bound to
  it (``bind_routing``), never from a process global; an unbound builder is an error;
* **KV layout**: predicted at load from the views the AITER cache hands (meta tensors), and
  checked again on the first prefill forward, against what the revision addresses in place; a
  layout FlyDSL would copy on every call switches the path off (``unsupported``) - on vLLM 0.32
  that is FlyDSL main always, and #1056 with more than one KV head per rank;
* **warm-up**: only where the path can run (gfx950, eligible layer, in-place layout), in
  ``process_weights_after_loading`` (before any graph capture), with a 512-token
  query so the dualwave kernel, not the paged light one, compiles, both LPT variants where the
  revision has the flag; a failure is logged and opens the circuit instead of aborting start-up.

NOT RUN ON HARDWARE (no gfx950 machine here): tests/unit/test_vllm_flydsl_contract.py checks it
against fakes built from FlyDSL's real signature at two commits (tests/data/contracts/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

from flyserve.vllm.flydsl_kernel import (
    FLYDSL_SPEC,
    FlyDSLRevision,
    call_paged,
    kv_layout_problem,
    try_load,
    warm_up,
)

log = logging.getLogger("flyserve.vllm")
KERNEL_NAME = "flydsl-dualwave"


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


def page_size_for(block_size: int, revision: FlyDSLRevision) -> int | None:
    """The kernel page size vLLM will use for this KV block size (None: FlyDSL cannot page it).

    vLLM splits a manager block into kernel blocks of the largest declared size that divides it.
    """
    fits = [p for p in revision.page_sizes if block_size % p == 0]
    return max(fits) if fits else None


# ----------------------------------------------------------------------------- vLLM classes
# Built on import of this module, which only happens on ROCm (flyserve.vllm.backends imports it
# lazily for the ROCm composite) and in the contract tests.

from vllm.v1.attention.backends.rocm_aiter_unified_attn import (
    RocmAiterUnifiedAttentionBackend,
    RocmAiterUnifiedAttentionImpl,
    RocmAiterUnifiedAttentionMetadataBuilder,
)

# Builds warmed up in this process -> whether the warm-up succeeded (see FlyDSLDualwaveImpl.warm_up).
_WARMED: dict[tuple[Any, ...], bool] = {}
# Reasons switch_off has logged in this process.
_LOGGED_OFF: set[str] = set()


class DecisionNotBound(RuntimeError):
    """The FlyDSL builder was asked to build without the routing object that decides its LPT flag."""


class FlyDSLDualwaveMetadataBuilder(RocmAiterUnifiedAttentionMetadataBuilder):
    """The unified builder's metadata plus the persistent cu_seqlens_kv and the decision's LPT flag."""

    decision_source: Any = None  # the group's routing object (has .last_decision), set by the composite

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any, **kw: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kw)
        self.cu_seqlens_kv = PrefixSumBuffer(vllm_config.scheduler_config.max_num_seqs, device)

    def bind_routing(self, routing: Any) -> None:
        """The composite hands over its routing: select() runs just before each build()."""
        self.decision_source = routing

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        src = self.decision_source
        if src is None:
            raise DecisionNotBound(
                "flyserve: FlyDSL metadata builder has no routing bound (bind_routing); "
                "it is built by flyserve's composite backend, not on its own"
            )
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.cu_seqlens_kv = self.cu_seqlens_kv.fill(
            common_attn_metadata.seq_lens, common_attn_metadata.num_reqs
        )
        md.lpt = bool(src.last_decision.lpt)
        return md


class FlyDSLDualwaveImpl(RocmAiterUnifiedAttentionImpl):
    """FlyDSL dualwave for causal prefill; AITER unified (the parent) runs whatever it cannot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernel, self.unavailable = try_load()
        if self.kernel is not None:
            forced_block_size_problem(self.kernel.revision)  # judged now, while vLLM's config is current
        self.static_off: str | None = None  # set once: the path cannot run for this layer
        self.static_off_listeners: list[Callable[[str], None]] = []
        self._layout_checked = False

    def switch_off(self, reason: str) -> None:
        """This layer's prefill path is off for good (reason ``unsupported``); tell the routing."""
        if self.static_off is not None:
            return
        self.static_off = reason
        if reason not in _LOGGED_OFF:  # once per process: every layer of a model has the same layout
            _LOGGED_OFF.add(reason)
            log.warning("flyserve: FlyDSL prefill path off: %s (reason 'unsupported')", reason)
        for cb in self.static_off_listeners:
            cb(reason)

    def process_weights_after_loading(self, act_dtype: Any) -> None:
        super().process_weights_after_loading(act_dtype)
        if self.kernel is None:
            return
        import torch
        from vllm.config import get_current_vllm_config_or_none

        if not _on_gfx950():
            return  # declined at start (rocm_prefill_status): nothing to compile for
        cfg = get_current_vllm_config_or_none()
        block_size = int(cfg.cache_config.block_size) if cfg is not None else 64
        page = page_size_for(block_size, self.kernel.revision)
        if page is None or self.ineligible(act_dtype):
            # The routing reports these (PrefillStatus.config_problems, static eligibility): a layer
            # FlyDSL cannot run must not open the circuit for every other layer by failing here.
            return
        problem = self.predicted_layout_problem(page)
        if problem is not None:  # e.g. FlyDSL main, or more than one KV head per rank
            self.switch_off(f"KV cache layout: {problem}")
            return
        self.warm_up(act_dtype, page, torch.device("cuda", torch.cuda.current_device()),
                     torch.cuda.is_current_stream_capturing)  # fmt: skip

    def predicted_layout_problem(self, page_size: int) -> str | None:
        """The layout check on the K/V views this vLLM's AITER cache will hand the layer, made on
        a two-block meta tensor (no memory) with the parent's own ``_split_kv_cache``: the cache is
        (blocks, kv_heads, page, 2*head_size) with the strides of the KV-cache layout vLLM resolved
        (0.34: ``LBHNC`` or ``LHBNC``, ``flyserve.vllm.kv_views``), so the views are strided and
        only FlyDSL #1056 with one KV head per rank reads them in place. The first forward checks
        the real cache again."""
        from vllm.config import get_current_vllm_config_or_none

        from flyserve.vllm.kv_views import aiter_layer_cache, layer_view_order, resolved_layout_name

        if getattr(self, "_shuffle_kv_layout", False):  # vLLM 0.34 on gfx1250: (2, B, N, H, hs), not gfx950's
            return "vLLM's shuffled KV cache layout (gfx1250)"
        order = layer_view_order(resolved_layout_name(get_current_vllm_config_or_none()))
        kv = aiter_layer_cache(self.num_kv_heads, page_size, self.head_size, order)
        key_cache, value_cache = self._split_kv_cache(kv)
        return kv_layout_problem(key_cache, value_cache, self.kernel.revision)

    def ineligible(self, act_dtype: Any) -> list[str]:
        """This layer's static problems for FlyDSL (head size, scale, dtype, ...), [] if none."""
        from flyserve.vllm.eligibility import group_problems

        return group_problems([self], act_dtype, FLYDSL_SPEC)

    def warm_up(self, dtype: Any, page_size: int, device: Any, is_capturing: Callable[[], bool]) -> bool:
        """Compile the dualwave variants now; on failure open the circuit and keep serving.

        Once per distinct build (dtype, heads, KV heads, head size, page size) in the process: the
        layers of a model share one, and a failure is reported once, not once per layer.
        """
        key = (str(dtype), self.num_heads, self.num_kv_heads, self.head_size, page_size)
        if key in _WARMED:
            return _WARMED[key]
        _WARMED[key] = False
        try:
            warm_up(
                self.kernel, dtype=dtype, device=device, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_size=self.head_size, page_size=page_size,
                is_capturing=is_capturing,
            )  # fmt: skip
            _WARMED[key] = True
            return True
        except Exception as exc:  # noqa: BLE001 - any compile/launch failure: serve on unified instead
            from flyserve.vllm.breaker import warm_up_failed
            from flyserve.vllm.runtime import RankRuntime

            warm_up_failed(RankRuntime.get(), exc, kernel=KERNEL_NAME)
            return False

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
        if (
            attn_metadata is not None
            and output_scale is None
            and output_block_scale is None
            and self.kernel is not None
            and self.static_off is None
        ):
            key_cache, value_cache = self._split_kv_cache(kv_cache)
            if self._layout_checked or self._layout_in_place(key_cache, value_cache):
                n = attn_metadata.num_actual_tokens
                try:
                    call_paged(
                        self.kernel,
                        query[:n],
                        key_cache,
                        value_cache,
                        output[:n],
                        cu_seqlens_q=attn_metadata.query_start_loc,
                        cu_seqlens_kv=attn_metadata.cu_seqlens_kv,
                        seqlen_k=attn_metadata.seq_lens,
                        block_table=attn_metadata.block_table,
                        max_seqlen_q=int(attn_metadata.max_query_len),
                        max_seqlen_kv=int(attn_metadata.max_seq_len),
                        num_kv_heads=self.num_kv_heads,
                        lpt=attn_metadata.lpt,
                    )
                    return output
                except Exception as exc:  # noqa: BLE001 - the circuit breaker: any kernel failure
                    from flyserve.vllm.breaker import trip
                    from flyserve.vllm.runtime import RankRuntime

                    trip(RankRuntime.get(), exc, kernel=KERNEL_NAME)
        # Not FlyDSL's batch, a layout it would copy, or a kernel failure: the unified kernel runs it
        # on the same metadata, so the batch is not lost.
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )

    def _layout_in_place(self, key_cache: Any, value_cache: Any) -> bool:
        """Once, at the first prefill forward (the layout is fixed by the backend and the config):
        whether FlyDSL addresses this K/V cache in place; if not, the path is switched off."""
        self._layout_checked = True
        problem = kv_layout_problem(key_cache, value_cache, self.kernel.revision)
        if problem is not None:
            self.switch_off(f"KV cache layout: {problem}")
        return problem is None


def _on_gfx950() -> bool:
    """GPU 0 is a gfx950 (MI350/MI355), the only arch the dualwave kernel runs on."""
    from flyserve.vllm import device

    return device.gpu_arch().startswith("gfx950")


def _installed_revision() -> FlyDSLRevision | None:
    kernel, _ = try_load()
    return kernel.revision if kernel is not None else None


class FlyDSLDualwaveBackend(RocmAiterUnifiedAttentionBackend):
    """Same cache layout and builder family as AITER unified; the FlyDSL impl; FlyDSL's page sizes."""

    # No fp8: the FlyDSL paged path compiles for bf16/f16 KV only.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlyDSLDualwaveImpl]:
        return FlyDSLDualwaveImpl

    @staticmethod
    def get_builder_cls() -> type[FlyDSLDualwaveMetadataBuilder]:
        return FlyDSLDualwaveMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        """FlyDSL's page sizes; AITER's when FlyDSL is absent, the GPU is not a gfx950, or the
        operator forced a block size FlyDSL cannot page (then the prefill path is off and says so)."""
        revision = _installed_revision()
        if (
            revision is None
            or not revision.page_sizes
            or not _on_gfx950()
            or forced_block_size_problem(revision) is not None
        ):
            return _aiter_block_sizes(kv_cache_spec)
        return list(revision.page_sizes)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # The composite needs both children to accept the head size; a head size FlyDSL lacks
        # must leave the server on AITER with the prefill path 'unsupported', not refuse it.
        return RocmAiterUnifiedAttentionBackend.supports_head_size(head_size)

    @classmethod
    def supports_head_size_v(cls, head_size: int, head_size_v: int) -> bool:
        # vLLM 0.34 asks a backend whether it serves a V head size other than K's (its one caller, a
        # model with such layers, falls back to vLLM's DiffKV backends on a no: nothing is refused).
        # AITER unified says yes to a narrower V; FlyDSL's paged call takes one head dim for q, k and
        # v, so this kernel says yes only to equal sizes, and the composite (both children) with it.
        return head_size_v == head_size


def _aiter_block_sizes(kv_cache_spec: Any) -> list[Any]:
    """AITER unified's kernel block sizes. vLLM 0.30's takes no argument (0.31 added
    ``kv_cache_spec=None``; tests/data/contracts/vllm_touchpoints/), and its composite asks with
    none: pass the spec on only when vLLM gave one."""
    if kv_cache_spec is None:
        return RocmAiterUnifiedAttentionBackend.get_supported_kernel_block_sizes()
    return RocmAiterUnifiedAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec)


# The operator's forced block size, judged once with vLLM's config in hand and remembered for the
# process: vLLM sets its "current config" while it builds the model (the impl's __init__ primes this)
# but not around every later call of get_supported_kernel_block_sizes (e.g. its KV cache set-up).
_FORCED: dict[str, str | None] = {}


def forced_block_size_problem(revision: FlyDSLRevision, block_size: int | None = None) -> str | None:
    """Why the operator's --block-size keeps FlyDSL off (None: fine, or vLLM picks the size)."""
    if block_size is None:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        if cfg is None:
            return _FORCED.get("problem")
        forced = getattr(cfg.cache_config, "user_specified_block_size", False)
        problem = forced_block_size_problem(revision, int(cfg.cache_config.block_size)) if forced else None
        _FORCED["problem"] = problem
        return problem
    if page_size_for(block_size, revision) is not None:
        return None
    return (
        f"KV block size {block_size}: FlyDSL pages {list(revision.page_sizes)} only; "
        f"start vLLM with --block-size 64 (or leave --block-size out)"
    )
