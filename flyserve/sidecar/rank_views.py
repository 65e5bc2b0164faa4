"""One view per rank for /dispatch-stats and /readyz, from the ranks' reports and their counters.

A rank report (ranks/<rank>.json) is a file anyone who can write ranks/ controls: every field is
read as input, a malformed one shown as null, never trusted for its type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flyserve.control.rank_modes import CONTROL_MODES
from flyserve.sidecar.models import PrefillKernelView, RankView
from flyserve.sidecar.stats import RankCounters, totals_of


def _sha256_or_none(x: Any) -> str | None:
    """A report's applied_sha256 if it is one (64 lowercase hex digits), else None: the report is a
    file anyone who can write ranks/ controls."""
    return x if isinstance(x, str) and len(x) == 64 and all(c in _HEX for c in x) else None


_HEX = frozenset("0123456789abcdef")


def _int_or_none(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError, OverflowError):
        return None


def _prefill_kernel_or_none(v: Any) -> PrefillKernelView | None:
    """A rank report's prefill_kernel, or None when absent or malformed (a report is input)."""
    if not isinstance(v, Mapping):
        return None

    def text(key: str, limit: int) -> str | None:
        x = v.get(key)
        return x[:limit] if isinstance(x, str) else None

    kernel = text("kernel", 64)
    if kernel is None:
        return None
    return PrefillKernelView(
        kernel=kernel, revision=text("revision", 200), off_reason=text("off_reason", 400)
    )


def rank_views(
    reports: list[Mapping[str, Any]],
    counters: Mapping[int, RankCounters],
    *,
    now: float,
    stale_after_s: float,
    liveness: Mapping[tuple[int, int], str] | None = None,
) -> list[RankView]:
    """One view per rank seen in a report or in the counters. A rank that only left counters
    behind (its report is gone) is shown stale, with its counters. ``liveness``: (engine, rank) ->
    what the process table says of its report, where the caller has it."""
    by_key: dict[tuple[int, int], Mapping[str, Any]] = {}
    for d in reports:
        r = _int_or_none(d.get("rank"))
        if r is None:
            continue
        by_key[(_int_or_none(d.get("engine")) or 0, r)] = d
    known_ranks = {r for (_, r) in by_key}
    for r in counters:
        if r not in known_ranks:
            by_key[(0, r)] = {}
    out = []
    for (engine, rank), d in sorted(by_key.items()):
        t = d.get("time")
        try:
            age = max(0.0, now - float(t)) if t is not None else None
        except (TypeError, ValueError):
            age = None
        c = counters.get(rank)
        out.append(
            RankView(
                rank=rank,
                engine=engine,
                pid=_int_or_none(d.get("pid")),
                step=_int_or_none(d.get("step")),
                applied_version=_int_or_none(d.get("applied_version")),
                applied_step=_int_or_none(d.get("applied_step")),
                applied_sha256=_sha256_or_none(d.get("applied_sha256")),
                circuit_open=d.get("circuit_open") if isinstance(d.get("circuit_open"), bool) else None,
                control_mode=d.get("control_mode") if d.get("control_mode") in CONTROL_MODES else None,
                prefill_kernel=_prefill_kernel_or_none(d.get("prefill_kernel")),
                age_s=None if age is None else round(age, 3),
                stale=age is None or age > stale_after_s or (liveness or {}).get((engine, rank)) == "gone",
                totals=totals_of([c]) if c is not None else None,
                late_applies=_int_or_none(d.get("late_applies")),
                liveness=(liveness or {}).get((engine, rank)),
            )
        )
    return out


def control_mode_of(views: list[RankView]) -> str | None:
    """The live ranks' common mode, "mixed" when they differ, None when no live rank reports one."""
    modes = {v.control_mode for v in views if not v.stale and v.control_mode is not None}
    if not modes:
        return None
    return modes.pop() if len(modes) == 1 else "mixed"


def ranks_agree(views: list[RankView]) -> bool | None:
    """True/False when live ranks run one/several versions; None with no live rank (nothing agrees:
    "true" there read as "all is well" while no rank was running)."""
    versions = {v.applied_version for v in views if not v.stale}
    return len(versions) <= 1 if versions else None
