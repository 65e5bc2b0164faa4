"""The report of a run (the JSON ``--json`` prints) and its table."""

from __future__ import annotations

import os
import time
from typing import Any

from flyserve.doctor.compile.geometry import Geometry
from flyserve.doctor.compile.results import VariantResult
from flyserve.doctor.compile.runs import CHILD_ENV
from flyserve.vllm.flydsl_key import KeyInputs, short

FORMAT = "flyserve-flydsl-compile"


def failed(rep: dict[str, Any]) -> bool:
    """Whether the run failed: a variant did, or the cache it built would be refused by the server."""
    return bool(rep["summary"]["fail"] or (rep.get("cache") or {}).get("refused"))


def report(
    *,
    geometry: Geometry,
    info: dict[str, Any],
    kernels_path: str,
    results: list[VariantResult],
    cache_dir: str | None,
    run_only: bool,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    counts = {s: sum(1 for r in results if r.status == s) for s in ("ok", "fail")}
    return {
        "format": FORMAT,
        "version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flydsl_version": info.get("flydsl_version"),
        "torch_version": info.get("torch_version"),
        "kernels_path": os.path.basename(os.path.abspath(kernels_path)),
        "revision": info.get("revision"),
        "key": info.get("key"),
        "geometry": geometry.as_dict(),
        "target": CHILD_ENV["ARCH"],
        "cache_dir": "given" if cache_dir else None,
        "run_only": run_only,
        "variants": [r.as_dict() for r in results],
        "summary": counts,
        **({"cache": cache} if cache is not None else {}),
    }


def key_line(key: dict[str, Any] | None) -> str:
    """The report's line on what the cache key depends on here, and what that means for a cache."""
    if not key:
        return "cache key inputs: not reported"
    inputs = KeyInputs.from_record(key)
    text = f"cache key inputs: {inputs.describe() if inputs else '?'}"
    text += f" ({key.get('bitcode_files', '?')} .bc files under $ROCM_PATH/amdgcn/bitcode"
    if key.get("bitcode_matches_flydsl") is False:
        text += "; flyserve's fingerprint differs from FlyDSL's"
    text += ")"
    if key.get("bitcode_in_key"):
        text += (
            "; a cache built here hits only on a host with this flydsl and this bitcode: on a CPU machine with "
            "Debian's bitcode this run is a compile check, not a warm start for a ROCm image"
        )
    return text


def served_note(row: dict[str, Any]) -> str:
    """Whether flyserve's server runs this variant, from the child's layout check."""
    v = row["variant"]
    if v["batch"] == "wrong":
        return "-"
    if row.get("outcome") == "setup-failed" or "vllm_layout_problem" not in row:
        return "unknown: setup failed"  # the layout check never ran: nothing says the server runs it
    if v["batch"] == "light":
        return "lab only"
    problem = row.get("vllm_layout_problem")
    return "yes" if problem is None else "no: path off"


def render(rep: dict[str, Any]) -> str:
    """The report as a table (what `flyserve flydsl compile` prints without --json)."""
    g, rev = rep["geometry"], rep.get("revision") or {}
    lines = [
        f"flyserve flydsl compile  {rep['time']}  flydsl {rep.get('flydsl_version')}  target {rep['target']}",
        f"FlyDSL checkout {rep['kernels_path']}: {rev.get('label', '?')}",
        *([key_line(rep["key"])] if rep.get("key") else []),  # reports recorded before it was kept have none
        (
            f"geometry ({g.get('source') or 'flags'}): {g['num_heads']} heads, {g['num_kv_heads']} KV heads per "
            f"rank, head {g['head_size']}, {g['dtype']}"
        ),
        "",
    ]
    head = ("variant", "status", "kernel", "bytes", "VGPR", "SGPR", "LDS", "spills", "compile_s", "served")
    rows = [head]
    for row in rep["variants"]:
        ks = row.get("kernels") or []
        k = ks[0] if ks and "error" not in ks[0] else {}
        rows.append((
            row["variant"]["name"], row["status"], str(k.get("symbol", "-")), str(k.get("code_object_bytes", "-")),
            str(k.get("vgprs", "-")), str(k.get("sgprs", "-")), str(k.get("lds_bytes", "-")),
            str(k["vgpr_spills"] + k["sgpr_spills"]) if k else "-", f"{row.get('call_s', 0):.1f}", served_note(row),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    for row in rep["variants"]:
        if row["status"] != "ok" or row["variant"]["batch"] == "wrong":
            lines.append(f"  {row['variant']['name']}: {row['summary']}")
    problems = sorted(
        {row["vllm_layout_problem"] for row in rep["variants"] if row.get("vllm_layout_problem")}
    )
    for p in problems:
        lines.append(f"  served 'no': flyserve keeps the prefill path off under vLLM's AITER cache: {p}")
    if rep.get("cache"):
        lines.append(f"  {cache_line(rep['cache'])}")
        if rep.get("run_only") and rep["summary"]["fail"] and rep["cache"].get("stale"):
            lines.append(
                f"  run-only misses: {rep['cache']['stale']} entries there were built with another flydsl or another "
                f"ROCm (bitcode here {short((rep.get('key') or {}).get('bitcode'))}); FlyDSL never looks them up: "
                "rebuild the cache with this flydsl on the serving image's ROCm"
            )
    s = rep["summary"]
    lines.append(f"\n{s['ok']} ok, {s['fail']} fail")
    return "\n".join(lines)


def cache_line(cache: dict[str, Any]) -> str:
    """The report's line on the cache folder: refused (the server would not load it), or its entries."""
    if cache.get("refused"):
        return f"FlyDSL cache: refused, the server would not load it: {cache['refused']}"
    return f"FlyDSL cache: {cache.get('describe', '')}"
