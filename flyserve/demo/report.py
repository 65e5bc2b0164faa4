"""What the demo prints: the live line every 3 s, each phase's figures, the closing lines.

A live line keeps the two kinds of number apart: "this phase" (deltas since the phase began: the
figures the threshold change moves) and "totals" (since the server started). Before, one line mixed
them and the phase's prefill share sat between running totals.
"""

from __future__ import annotations

from typing import Any

CPU_KERNEL_NOTE = (
    "kernel times: on the CPU the prefill path is a deliberately simple stand-in (torch SDPA per "
    "request over vLLM's paged cache, flyserve/vllm/cpu_prefill.py), not FlyDSL or FA3: it is there "
    "so routing between two real kernels happens and is timed, and its times say nothing about "
    "which kernel is faster on a GPU (docs/performance.md has the GPU numbers)."
)


def phase_figures(start: dict, end: dict) -> dict[str, Any]:
    """Deltas of two /dispatch-stats bodies: batches, prefill decisions, reasons and the prefill
    share of the batches that had a prefill row (decode-only batches never take the prefill path)."""
    a, b = start["totals"], end["totals"]
    n = b["batches"] - a["batches"]
    pre = b["decisions"].get("prefill", 0) - a["decisions"].get("prefill", 0)
    reasons = {k: v - a["reasons"].get(k, 0) for k, v in b["reasons"].items() if v - a["reasons"].get(k, 0)}
    with_prefill = n - reasons.get("no_prefill_rows", 0)
    return {
        "batches": n,
        "prefill": pre,
        "prefill_ratio": (pre / n) if n else None,
        "batches_with_prefill_rows": with_prefill,
        "prefill_ratio_of_prefill_batches": (pre / with_prefill) if with_prefill else None,
        "reasons": reasons,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def live_line(stats: dict, phase_start: dict | None, elapsed_s: float, phase: str) -> str:
    """One line: the phase's own figures, then the running totals, then the kernel means."""
    version = stats["thresholds"]["version"] if stats.get("thresholds") else "?"
    ph = phase_figures(phase_start or _zero(stats), stats)
    top = dict(sorted(ph["reasons"].items(), key=lambda kv: -kv[1])[:3])
    t = stats["totals"]
    d = t["decisions"]
    k = stats.get("kernels", {})
    kern = " ".join(
        f"{p} {v['mean_s'] * 1e3:.2f}ms" for p, v in sorted(k.items()) if v.get("count") and v.get("mean_s")
    )
    return (
        f"[{elapsed_s:4.0f}s] {phase} (v{version}) | this phase: {ph['batches']} batches, "
        f"{ph['batches_with_prefill_rows']} with a prefill row, {_pct(ph['prefill_ratio_of_prefill_batches'])} "
        f"of those to prefill; reasons {top} | totals: {t['batches']} batches, unified {d.get('unified', 0)}, "
        f"prefill {d.get('prefill', 0)}" + (f" | kernel mean (CPU stand-in) {kern}" if kern else "")
    )


def _zero(stats: dict) -> dict:
    return {"totals": {"batches": 0, "decisions": {}, "reasons": {}}}


def phase_done_line(name: str, phase: dict[str, Any]) -> str:
    return (
        f"      {name}: {phase['requests_completed']}/{phase['requests_sent']} requests completed; this "
        f"phase {phase.get('batches', 0)} batches, {phase.get('batches_with_prefill_rows', 0)} with a prefill "
        f"row, of which {_pct(phase.get('prefill_ratio_of_prefill_batches'))} took the prefill path"
        f"{' (bench TIMED OUT)' if phase.get('bench_timed_out') else ''}"
    )


def closing_lines(
    phases: list[dict[str, Any]], requests: dict[str, int], sidecar_url: str, held_s: float
) -> list[str]:
    """The result, and where the sidecar was (and whether it still is)."""
    a = phases[0].get("prefill_ratio_of_prefill_batches") if phases else None
    b = phases[1].get("prefill_ratio_of_prefill_batches") if len(phases) > 1 else None
    lines = [
        "",
        (
            f"prefill path share of batches with a prefill row: before the change {_pct(a)}, "
            f"after {_pct(b)}; requests: {requests}"
        ),
    ]
    if held_s > 0:
        lines.append(
            f"the sidecar stays up for {held_s:.0f} s (Ctrl-C ends it sooner): {sidecar_url}/dispatch-stats"
        )
    else:
        lines.append(
            f"the sidecar was at {sidecar_url}/dispatch-stats and stops with the demo now "
            "(--hold SECONDS keeps it and vLLM up afterwards)"
        )
    return lines
