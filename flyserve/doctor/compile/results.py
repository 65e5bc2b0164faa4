"""What each variant's child process reported, and the verdict on it (ok or fail, one line why)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flyserve.doctor.compile.variants import Variant
from flyserve.doctor.compile_child import RESULT_MARK


@dataclass(frozen=True, slots=True)
class VariantResult:
    """A variant and what its child process reported."""

    variant: Variant
    status: str  # ok | fail
    summary: str
    child: dict[str, Any]
    wall_s: float  # the child process, start to exit (imports included)

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant.as_dict(),
            "status": self.status,
            "summary": self.summary,
            "wall_s": self.wall_s,
            **{k: v for k, v in self.child.items() if k not in ("variant",)},
        }


def parse_child_output(stdout: str) -> dict[str, Any] | None:
    """The child's result (its last ``RESULT_MARK`` line), or None if it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK + " "):
            try:
                value = json.loads(line[len(RESULT_MARK) + 1 :])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def judge(
    variant: Variant, child: dict[str, Any] | None, *, rc: int, stderr_tail: str, cached: bool
) -> tuple[str, str]:
    """(status, one-line summary) of a variant from its child's result."""
    if child is None:
        why = f"child process exited {rc} with no result" + (f": {stderr_tail}" if stderr_tail else "")
        return "fail", why
    outcome = child.get("outcome")
    message = f"{child.get('error_type', '')}: {child.get('message', '')}".strip(": ")
    if outcome == "setup-failed":
        return "fail", f"setup failed: {message}"
    kernels = child.get("kernels") or []
    if variant.expect == "rejected":
        if outcome == "raised" and not kernels:
            return "ok", f"rejected by FlyDSL as expected: {message} ({child.get('where', '?')})"
        if outcome == "raised":
            return "fail", f"compiled, then failed (expected FlyDSL to reject it first): {message}"
        return "fail", "FlyDSL accepted a call it must reject"
    if outcome == "raised":
        return "fail", f"{message} ({child.get('where', '?')})"
    if not kernels:
        if cached and child.get("compiles", 0) == 0:
            return "ok", "loaded from FlyDSL's cache: nothing compiled"
        return "fail", "call_paged returned but FlyDSL compiled no code object"
    k = kernels[0]
    if "error" in k:
        return "fail", f"code object unreadable: {k['error']}"
    spills = k["vgpr_spills"] + k["sgpr_spills"]
    return "ok", f"{k['symbol']} {k['code_object_bytes']} B, {k['vgprs']} VGPRs, {spills} spills"
