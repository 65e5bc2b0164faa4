"""What the engines' workers answer the engine channel, made small and grouped per engine.

The answers come from other processes (on other nodes too) through vLLM's collective RPC: input like
any other. Everything here bounds what the pusher keeps of them (known fields, short strings, at
most MAX_ENGINES engines of MAX_WORKERS_PER_ENGINE workers) and groups them per engine, whether the
RPC answered per engine (the DP client, one collective RPC per engine core) or as one list.
Pure: no I/O, no vLLM import (flyserve.vllm.channel_pusher uses it; the unit tests drive it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flyserve.vllm.engine_channel import MAX_DOCS

MAX_ENGINES = 1024
MAX_WORKERS_PER_ENGINE = 256


@dataclass(frozen=True, slots=True)
class Push:
    """One version pushed to every worker, and what each answered."""

    version: int
    sha256: str
    answers: tuple[dict[str, Any], ...]

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(int(a.get("step", -1)) for a in self.answers)

    @property
    def same_step(self) -> bool:
        """Every worker of each engine answered from the same step (so all of an engine's workers
        apply from the same next step; engines step on their own, so theirs may differ)."""
        per_engine: dict[Any, set[int]] = {}
        for a, step in zip(self.answers, self.steps, strict=True):
            per_engine.setdefault(a.get("engine"), set()).add(step)
        return all(len(s) == 1 for s in per_engine.values())


REPORT_INT_FIELDS = ("rank", "engine", "pid", "step", "applied_version", "applied_step", "late_applies")


def small_report(report: Any) -> dict[str, Any]:
    """A worker's REPORT_METHOD answer, reduced to known fields of bounded size."""
    if not isinstance(report, dict):
        return {"why": "not a report"}
    out: dict[str, Any] = {k: report[k] for k in REPORT_INT_FIELDS if is_int(report.get(k))}
    for k, n in (("host", 64), ("control_mode", 64), ("why", 40), ("error", 200)):
        if isinstance(report.get(k), str):
            out[k] = report[k][:n]
    rate = report.get("steps_per_s")
    out["steps_per_s"] = float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None
    decisions = report.get("decisions")
    if isinstance(decisions, dict):
        out["decisions"] = {
            str(p)[:32]: float(v)
            for p, v in list(decisions.items())[:8]
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    applied = report.get("applied")
    if isinstance(applied, list):
        out["applied"] = [
            [int(x) for x in a] for a in applied[-8:]
            if isinstance(a, list | tuple) and len(a) == 3 and all(is_int(x) for x in a)
        ]  # fmt: skip
    return out


def small_answer(answer: Any) -> dict[str, Any]:
    """A worker's answer, reduced to known fields of bounded size (it is input like any other)."""
    if not isinstance(answer, dict):
        return {"why": "not an answer", "error": repr(answer)[:200]}
    out = {k: answer[k] for k in ("rank", "engine", "step", "version") if is_int(answer.get(k))}
    if isinstance(answer.get("host"), str):
        out["host"] = answer["host"][:64]
    results = answer.get("results")
    out["results"] = [
        {
            "version": r.get("version"),
            "applied": bool(r.get("applied")),
            "why": str(r.get("why"))[:40],
            "from_step": r.get("from_step") if is_int(r.get("from_step")) else None,
        }
        for r in (results if isinstance(results, list) else [])[:MAX_DOCS]
        if isinstance(r, dict)
    ]
    if "why" in answer:
        out["why"] = str(answer["why"])[:40]
    if "error" in answer:
        out["error"] = str(answer["error"])[:300]
    return out


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def by_engine(raw: Any) -> dict[int, list[Any] | str]:
    """The answers grouped per engine: {engine: [worker answers]} or {engine: "error text"}.

    A mapping is taken as per-engine already (an exception value becomes its text); a list is
    grouped by each answer's own "engine" (0 when it has none), as one engine's collective RPC
    answers. Bounded: a foreign or absurd answer cannot make the pusher hold unbounded state."""
    out: dict[int, list[Any] | str] = {}
    if isinstance(raw, Mapping):
        for k, v in list(raw.items())[:MAX_ENGINES]:
            if not is_int(k):
                continue
            if isinstance(v, BaseException):
                out[k] = f"{type(v).__name__}: {v}"[:300]
            elif isinstance(v, list | tuple):
                out[k] = list(v)[:MAX_WORKERS_PER_ENGINE]
            else:
                out[k] = "not a list of worker answers"
        return out
    for a in (raw if isinstance(raw, list | tuple) else [raw])[: MAX_ENGINES * 8]:
        e = a.get("engine", 0) if isinstance(a, dict) else 0
        e = e if is_int(e) and 0 <= e < 1 << 20 else 0
        group = out.setdefault(e, [])
        if isinstance(group, list) and len(group) < MAX_WORKERS_PER_ENGINE:
            group.append(a)
    return out
