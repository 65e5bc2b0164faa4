"""flyserve's composite attention backends, one per platform, built with vLLM's own factory.

    platform      general (variant 0)            causal prefill (variant 1)
    ROCm gfx950   ROCM_AITER_UNIFIED_ATTN        FlyDSL dualwave (flyserve.vllm.flydsl)
    CUDA          TRITON_ATTN                    FLASH_ATTN
    CPU           CPU_ATTN (vLLM's kernel)       torch SDPA over the paged cache (cpu_prefill)

Each composite is registered under ``AttentionBackendEnum.CUSTOM`` (``--attention-backend CUSTOM``);
on CPU also over ``CPU_ATTN`` itself, because vLLM's CPU platform ignores CUSTOM (it only ever
selects CPU_ATTN). ``backend_name`` is ``CUSTOM``, an existing enum member: the attention layer
looks the backend up by that name, and a name invented at run time crashes the engine core,
which reads its configuration before plugins load.

The composites are module attributes built on first access (PEP 562 ``__getattr__``), so that
vLLM can import them by class path in every process, and a platform's kernels are imported only
on that platform.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.flydsl_kernel import FLYDSL_SPEC
from flyserve.vllm.forward_switch import SWITCH
from flyserve.vllm.routing import routing_class

log = logging.getLogger("flyserve.vllm")

BACKEND_NAME = "CUSTOM"
CONFIG_ENV = "FLYSERVE_CONFIG"  # the operator's thresholds file (docs/operations.md)
CLASS_NAMES = {
    "cpu": "FlyserveCpuAttention",
    "cuda": "FlyserveCudaAttention",
    "rocm": "FlyserveRocmAttention",
}

CPU_PREFILL_SPEC = PrefillKernelSpec("cpu-sdpa-prefill")
CUDA_PREFILL_SPEC = PrefillKernelSpec("FLASH_ATTN")
ROCM_PREFILL_SPEC = FLYDSL_SPEC

_BUILT: dict[str, type] = {}


@dataclass(frozen=True)
class PrefillStatus:
    """The prefill kernel as found at start in this process: what it is and, if off, why.

    ``off_reason`` (the kernel cannot run here at all: FlyDSL missing, not gfx950) and the
    config problems (``config_problems(vllm_config)``: a --block-size FlyDSL cannot page) turn the
    prefill path off for every layer group, reason ``unsupported``; the server runs on the unified
    kernel. ``revision`` is reported in the log and, through the rank report, in /dispatch-stats.
    """

    kernel: str
    revision: str | None = None
    off_reason: str | None = None
    config_problems: Callable[[Any], list[str]] = field(default=lambda cfg: [], compare=False)

    def report(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "revision": self.revision, "off_reason": self.off_reason}


def rocm_prefill_status() -> PrefillStatus:
    """FlyDSL on this machine: importable, which revision, on a gfx950. Logs one line either way."""
    from flyserve.vllm import device
    from flyserve.vllm.flydsl import forced_block_size_problem, try_load
    from flyserve.vllm.flydsl_kernel import INSTALL_HINT

    kernel, why = try_load()
    arch = device.gpu_arch()
    off = None
    if not arch.startswith("gfx950"):
        off = f"GPU arch {arch or 'unknown'} is not gfx950 (FlyDSL dualwave runs on MI350/MI355 only)"
    elif kernel is None:
        off = f"FlyDSL not importable: {why}"
    elif not kernel.revision.page_sizes:
        off = f"FlyDSL at {kernel.revision.module_file} declares no page size dualwave runs (64, 128)"
    if off is not None:
        log.warning(
            "flyserve: FlyDSL prefill path unavailable (%s); serving on AITER unified. To enable it on a "
            "gfx950: %s",
            off,
            INSTALL_HINT,
        )
        return PrefillStatus(ROCM_PREFILL_SPEC.name, None, off)
    rev = kernel.revision
    log.info("flyserve: FlyDSL kernel %s, revision: %s", rev.module_file, rev.label)

    def problems(cfg: Any) -> list[str]:
        p = forced_block_size_problem(rev, int(cfg.cache_config.block_size))
        return [p] if p else []

    return PrefillStatus(ROCM_PREFILL_SPEC.name, rev.label, None, problems)


def _plain_status(kind: str, spec: PrefillKernelSpec) -> PrefillStatus:
    """CUDA and CPU: the prefill kernel ships with vLLM. On CPU a test hook can declare it
    unavailable (FLYSERVE_CPU_PREFILL_UNAVAILABLE), exercising the same start-up refusal as a
    missing FlyDSL on ROCm inside a real vLLM."""
    why = os.environ.get("FLYSERVE_CPU_PREFILL_UNAVAILABLE") if kind == "cpu" else None
    if why:
        off = f"{spec.name} unavailable (FLYSERVE_CPU_PREFILL_UNAVAILABLE: {why[:200]})"
        log.warning("flyserve: prefill path unavailable (%s); serving on the unified path", off)
        return PrefillStatus(spec.name, None, off)
    return PrefillStatus(spec.name)


def platform_kind() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cuda():
        return "cuda"
    raise RuntimeError(f"flyserve attention: unsupported platform {current_platform.device_name!r}")


def start_decode_path() -> str:
    """decode_path at start: the published snapshot's if there is one, else the profile's.

    With $FLYSERVE_CONFIG set, the operator's file is published first (``reload(startup=True)``, the
    one moment decode_path may change: no graph is captured yet). Every worker does this; the first
    publishes, the others find the same content and publish nothing, so all capture the same variant.
    A bad file is logged and the thresholds already in force are used: serving is not refused.
    """
    from flyserve.control import ControlPlane
    from flyserve.policy.thresholds import ThresholdsError
    from flyserve.vllm.runtime import profile_name

    config_file = os.environ.get(CONFIG_ENV) or None
    try:
        plane = ControlPlane(profile=profile_name(), config_file=config_file)
        if config_file:
            try:
                plane.reload(actor=f"vllm-startup:{os.getpid()}", startup=True)
            except ThresholdsError as exc:
                log.error(
                    "flyserve: $%s not published at start (%s); serving with the thresholds in force",
                    CONFIG_ENV,
                    exc,
                )
        return plane.snapshot().thresholds.decode_path
    except Exception:  # noqa: BLE001 - an unreadable state dir must not stop vLLM: use the profile
        from flyserve.thresholds_files import load_profile

        return load_profile(profile_name()).decode_path


def _children(kind: str) -> tuple[type, type, PrefillKernelSpec]:
    if kind == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        from flyserve.vllm.cpu_prefill import CpuPrefillBackend

        return CPUAttentionBackend, CpuPrefillBackend, CPU_PREFILL_SPEC
    if kind == "cuda":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend, FlashAttentionBackend, CUDA_PREFILL_SPEC
    if kind == "rocm":
        from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend

        from flyserve.vllm.flydsl import FlyDSLDualwaveBackend

        return RocmAiterUnifiedAttentionBackend, FlyDSLDualwaveBackend, ROCM_PREFILL_SPEC
    raise ValueError(f"unknown platform kind {kind!r}")


def build_composite(kind: str) -> type:
    """The composite backend class for a platform (built once per process)."""
    if kind in _BUILT:
        return _BUILT[kind]
    from vllm.v1.attention.backends.composite import create_composite_attention_backend

    general, causal, spec = _children(kind)
    status = rocm_prefill_status() if kind == "rocm" else _plain_status(kind, spec)
    routing = routing_class(spec, start_decode_path(), name=f"FlyserveRouting_{kind}")
    base = create_composite_attention_backend(
        general,
        causal,
        name=CLASS_NAMES[kind] + "Base",
        backend_name=BACKEND_NAME,
        module=__name__,
        routing_policy=routing,
    )
    cls = _with_flyserve_parts(base, CLASS_NAMES[kind], status)
    _BUILT[kind] = cls
    return cls


def mark_unsupported(routing: Any, reason: str, *, quiet: bool = False) -> None:
    """Turn the prefill path off for this routing's layer group (reason ``unsupported``), once per reason.

    ``quiet``: the reason was logged already, once for the process (a kernel missing at start).
    """
    if reason in routing.problems:
        return
    routing.problems.append(reason)
    routing.unsupported = True
    if quiet:
        return
    log.warning(
        "flyserve: layers %s: prefill path off (%s); their prefill batches take the unified path, "
        "reason 'unsupported'",
        routing.layer_names[:2] + (["..."] if len(routing.layer_names) > 2 else []),
        reason,
    )


def _bind_group(builder: Any, vllm_config: Any, status: PrefillStatus) -> None:
    """Hand the routing to the child builders and layers that need it; apply the start-time verdict.

    The FlyDSL builder reads the LPT flag of the routing's decision (``bind_routing``), and its
    impl reports a KV layout it cannot address to this routing (``static_off_listeners``): no
    process global carries either.
    """
    routing = builder.routing
    for child in (builder.general_builder, builder.causal_builder):
        bind = getattr(child, "bind_routing", None)
        if bind is not None:
            bind(routing)
    if status.off_reason:
        mark_unsupported(routing, status.off_reason, quiet=True)
    for reason in status.config_problems(vllm_config):
        mark_unsupported(routing, reason)
    ctx = vllm_config.compilation_config.static_forward_context
    for name in routing.layer_names:
        causal = getattr(getattr(ctx.get(name), "impl", None), "causal_impl", None)
        listeners = getattr(causal, "static_off_listeners", None)
        if listeners is None:
            continue
        listeners.append(lambda reason, r=routing: mark_unsupported(r, reason))
        if causal.static_off is not None:
            mark_unsupported(routing, causal.static_off)
    control = getattr(getattr(routing, "rt", None), "control", None)
    if control is not None:
        control.prefill_kernel = status.report()


VLLM = "forwarded by vLLM's composite"
IMPL_METHODS: dict[str, str] = {
    "__init__": VLLM + " (builds both children)",
    "__new__": "vLLM's base class (context-parallel ranks): nothing to forward",
    "forward": VLLM + " (the routed child), flyserve's checked_forward on timed/prefill steps",
    "process_weights_after_loading": VLLM + " (both children: the prefill kernels warm up there)",
    "get_impl_variants": VLLM,
    "kv_quant_mode": "vLLM's base property over kv_cache_dtype, which the composite copies from the general child",
    "fused_output_quant_supported": VLLM + " (only if both children support it)",
    "fused_qk_norm_rope_kvcache_supported": VLLM + " (the general child, which writes the cache)",
    "do_qk_norm_rope_kvcache_update": VLLM + " (the general child)",
    "fused_rope_kvcache_supported": VLLM + " (the general child)",
    "do_rope_and_kv_cache_update": VLLM + " (the general child)",
    "fused_qk_norm_mrope_kvcache_supported": "not forwarded: the base's False keeps the MRoPE fusion off, so "
    "do_qk_norm_mrope_kvcache_update is never called",
    "do_qk_norm_mrope_kvcache_update": "not forwarded: never called (fused_qk_norm_mrope_kvcache_supported is False)",
    "prepare_for_batch": "not forwarded: only sparse MLA impls use it; none of flyserve's children overrides it",
    "set_interleaved_v_cache": "not forwarded, on purpose (TimedCompositeImpl pins the no-op): both children "
    "read one shared cache, and the prefill kernels (FlyDSL, FLASH_ATTN, the CPU SDPA path) read only the "
    "plain V layout; the general child's fused writer then keeps the plain layout too",
}
"""How flyserve's composite impl handles every method of vLLM's AttentionImplBase/AttentionImpl, in every
recorded vLLM (tests/unit/test_vllm_touchpoints.py fails on a method missing here). MLAAttentionImpl's
methods (0.33's ``reserve_workspace``) do not apply: flyserve composes no MLA backend."""

KV_CACHE_UPDATE_BYPASS = False
"""vLLM 0.33's ``AttentionBackend.supports_kv_cache_update_bypass`` (forward may run with key/value omitted
after a fused op wrote the cache; used by vllm/models/muse_spark/.../fused_qk_norm_rope_kv.py). Pinned off
for the composite: it holds only if both children run without key/value, and the general kernels flyserve
composes (TRITON_ATTN, ROCM_AITER_UNIFIED_ATTN, CPU_ATTN) all declare False in 0.33."""


def child_takes_head_size_v(backend: type, head_size: int, head_size_v: int) -> bool:
    """Whether one child backend serves V heads of ``head_size_v`` beside K heads of ``head_size``.
    A vLLM before 0.34 has no ``supports_head_size_v``: there K and V share one head size."""
    ask = getattr(backend, "supports_head_size_v", None)
    return bool(ask(head_size, head_size_v)) if ask is not None else head_size_v == head_size


def _head_size_v_answer(name: str) -> Any:
    """The composite's ``supports_head_size_v`` (vLLM 0.34): yes only if both children say yes, since
    either may run any batch. vLLM's composite does not forward it (its base answers equal sizes only,
    silently); flyserve asks both kernels (``general_backend_cls``, ``causal_backend_cls``: vLLM's
    composite keeps them in every recorded release) and logs once per geometry when it declines."""
    declined: set[tuple[int, int]] = set()

    def supports_head_size_v(cls: Any, head_size: int, head_size_v: int) -> bool:
        children = (cls.general_backend_cls, cls.causal_backend_cls)
        refused = [b.__name__ for b in children if not child_takes_head_size_v(b, head_size, head_size_v)]
        if refused and (head_size, head_size_v) not in declined:
            declined.add((head_size, head_size_v))
            log.warning(
                "flyserve: %s declines V head size %d with K head size %d: %s cannot serve it; vLLM gives "
                "those layers another backend, and flyserve neither routes nor counts their batches",
                name,
                head_size_v,
                head_size,
                " and ".join(refused),
            )
        return not refused

    return classmethod(supports_head_size_v)


def _with_flyserve_parts(base: type, name: str, status: PrefillStatus) -> type:
    """The composite with the routing bound into its builders and the impl's checked forward
    (timer, breaker) registered with the forward switch."""
    base_impl = base.get_impl_cls()
    base_builder = base.get_builder_cls()

    class FlyserveCompositeBuilder(base_builder):  # type: ignore[misc, valid-type]
        """vLLM's composite builder, plus ``_bind_group`` once at construction (never per step)."""

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)
            _bind_group(self, vllm_config, status)

    plain = base_impl.forward

    class TimedCompositeImpl(base_impl):  # type: ignore[misc, valid-type]
        """vLLM's composite impl, plus a checked forward that the routing installs for the steps
        that need it (forward_switch.py): it times the armed forward (KernelTimer per-step mode)
        and trips the circuit breaker when the prefill kernel raises. On other steps ``forward``
        is vLLM's own: no flyserve frame per attention forward.

        (The CPU and ROCm prefill impls catch their own failures and re-run the batch on the
        unified kernel; one that cannot - FLASH_ATTN's metadata is not TRITON_ATTN's - lands here.)
        """

        def checked_forward(
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale=None,
            output_block_scale=None,
        ):
            variant = getattr(attn_metadata, "_attention_backend_variant", 0)
            timer = SWITCH.timer
            tok = None
            if timer is not None and timer.armed and attn_metadata is not None:
                tok = timer.forward_start(variant)  # None unless this is the armed forward
            try:
                out = plain(
                    self,
                    layer,
                    query,
                    key,
                    value,
                    kv_cache,
                    attn_metadata,
                    output,
                    output_scale,
                    output_block_scale,
                )
            except Exception as exc:
                if variant:
                    _prefill_failed(exc)
                raise
            if tok is not None:
                timer.forward_stop(tok)
            return out

        def set_interleaved_v_cache(self) -> bool:
            """vLLM 0.33's opt-in to an interleaved V cache (QkNormRopeKvCacheFusionPass): declined for
            both children, whatever a newer vLLM composite does (IMPL_METHODS says why)."""
            return False

    SWITCH.register(TimedCompositeImpl, plain, TimedCompositeImpl.checked_forward)

    def get_impl_cls() -> type:
        return TimedCompositeImpl

    def get_builder_cls() -> type:
        return FlyserveCompositeBuilder

    cls = type(
        name,
        (base,),
        {
            "get_impl_cls": staticmethod(get_impl_cls),
            "get_builder_cls": staticmethod(get_builder_cls),
            "prefill_status": status,
            "supports_kv_cache_update_bypass": KV_CACHE_UPDATE_BYPASS,
            "supports_head_size_v": _head_size_v_answer(name),
            "__module__": __name__,
        },
    )
    cls.__qualname__ = name
    return cls


def _prefill_failed(exc: BaseException) -> None:
    """The prefill kernel raised and its batch cannot be re-run here: open the breaker, say so once."""
    from flyserve.vllm.breaker import PrefillPathError, trip
    from flyserve.vllm.runtime import RankRuntime

    rt = RankRuntime.get()
    first = not rt.circuit_reported
    trip(rt, exc, kernel="prefill")
    if first:
        raise PrefillPathError(
            "flyserve: the prefill attention kernel failed on this batch and it cannot be re-run on the "
            "unified kernel with this backend pair; the circuit is now OPEN (every rank routes prefill "
            "batches to the unified path). Cause: " + f"{type(exc).__name__}: {exc}"
        ) from exc


def class_path(kind: str) -> str:
    return f"{__name__}.{CLASS_NAMES[kind]}"


def register_for_current_platform() -> str:
    """Register this platform's composite with vLLM; returns its class path."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    kind = platform_kind()
    path = class_path(kind)
    register_backend(AttentionBackendEnum.CUSTOM, path)
    if kind == "cpu":
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    log.info(
        "flyserve: attention backend %s registered as CUSTOM%s",
        path,
        " and CPU_ATTN" if kind == "cpu" else "",
    )
    return path


def __getattr__(name: str) -> Any:
    for kind, cls_name in CLASS_NAMES.items():
        if name == cls_name:
            return build_composite(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
