"""The worker side of the engine channel: a method vLLM's collective RPC can call on every worker.

Why: a rank that polls the state directory learns of a version at its own moment, so the publisher
has to pick an effective step with a margin (a heuristic: some ranks learn late), and a worker on a
node that cannot see the directory never learns at all. vLLM already orders a collective RPC with
the engine steps: the engine core sends it between two steps, and every worker (on every node of a
multiprocessing executor) takes it from the same ordered queue as its ``execute_model`` calls. A
snapshot pushed that way is applied by every worker between the same two steps, with no margin.

``install()`` (called by the ``vllm.general_plugins`` entry point, flyserve.vllm.plugin, in every
vLLM process) adds ``METHOD`` to vLLM's ``WorkerWrapperBase``: the multiprocessing, uniprocess and
Ray executors all resolve a collective RPC's method name on that object. The method answers with
this worker's step so the caller (flyserve.vllm.endpoint_plugin) learns the exact step boundary and
can check that every worker reported the same one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flyserve.control.rank_modes import ENGINE_CHANNEL
from flyserve.control.reports import HOST
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.policy.thresholds import ThresholdsError

log = logging.getLogger("flyserve.vllm")

METHOD = "flyserve_apply_thresholds"
"""The collective RPC's method name (vLLM looks it up with getattr on each worker)."""
REPORT_METHOD = "flyserve_rank_report"
"""The report RPC: each worker's identity, step, applied versions and dispatch counters, through the
engine channel (so the head sees ranks on nodes whose state directory it cannot read)."""

MAX_DOC_BYTES = 64 << 10
"""A snapshot document is about 2 KB; anything far larger is not one."""


def parse_doc(doc: str | None) -> ConfigSnapshot | None:
    """The pushed snapshot, verified (sha256 recomputed). Raises ThresholdsError naming the field."""
    if doc is None:
        return None
    if not isinstance(doc, str) or len(doc) > MAX_DOC_BYTES:
        raise ThresholdsError([("<snapshot>", f"not a JSON document of at most {MAX_DOC_BYTES} bytes")])
    try:
        data = json.loads(doc)
    except ValueError as exc:
        raise ThresholdsError([("<snapshot>", f"not JSON: {exc}")]) from None
    if not isinstance(data, Mapping):
        raise ThresholdsError([("<snapshot>", "not a JSON object")])
    return ConfigSnapshot.from_dict(data, source="engine channel", check_profile=False)


MAX_DOCS = 64
"""Versions in one push at most (the pusher sends what piled up since its last push, oldest first)."""


def parse_docs(docs: Sequence[str] | None) -> list[ConfigSnapshot]:
    """Every pushed snapshot, verified, before any is applied (a bad one means none is)."""
    if docs is None:
        return []
    if not isinstance(docs, list | tuple) or len(docs) > MAX_DOCS:
        raise ThresholdsError([("<snapshots>", f"not a list of at most {MAX_DOCS} snapshot documents")])
    return [s for s in (parse_doc(d) for d in docs) if s is not None]


def apply_pushed(docs: Sequence[str] | None) -> dict[str, Any]:
    """Apply pushed snapshots in this process, in order, all from the next step; never raises (an
    exception in a worker RPC is logged by vLLM as a worker failure). ``docs`` are
    ConfigSnapshot.to_json() strings (a string travels through any executor's serialiser unchanged);
    None or [] only switches this rank to the engine channel.

    The answer: rank, engine, pid, host, step (the last step this worker ran: the versions apply
    from the next one), version (the one in force from then), results [{version, applied, why,
    from_step}] per document. ``from_step`` is the step the version is in force from on this worker:
    step + 1 when applied now, the step it was applied at for "already applied" (a retried push
    confirms an engine that had applied it), None when it is not in force.
    """
    from flyserve.vllm.runtime import RankRuntime

    rt = RankRuntime.get()
    rc = rt.control
    answer: dict[str, Any] = {"rank": rt.rank, "engine": rt.engine, "pid": os.getpid(), "host": HOST}
    try:
        snaps = parse_docs(docs)
    except ThresholdsError as exc:
        # Bad input changes nothing; the answer names the field, in bounded size.
        answer.update(step=rc.step, version=rc.snapshot.version, results=[], why="invalid",
                      error=str(exc)[:300])  # fmt: skip
        return answer
    first = rc.mode != ENGINE_CHANNEL
    results = []
    if not snaps:
        rc.apply_pushed(None)
    for snap in snaps:
        applied, why = rc.apply_pushed(snap)
        results.append(
            {
                "version": snap.version,
                "applied": applied,
                "why": why,
                "from_step": _from_step(rc, snap.version),
            }
        )
    if first:
        log.info(
            "flyserve rank %d: thresholds now come through the engine channel (was file polling)", rt.rank
        )
    if any(r["applied"] for r in results):
        log.info(
            "flyserve rank %d: version(s) %s from the engine channel, in force from step %d: version %d",
            rt.rank,
            [r["version"] for r in results if r["applied"]],
            rc.step + 1,
            rc.snapshot.version,
        )
    answer.update(step=rc.step, version=rc.snapshot.version, results=results)
    return answer


def _from_step(rc: Any, version: int) -> int | None:
    """The step ``version`` is in force from on this rank (its applied history), else None."""
    for v, _effective, applied_step in reversed(rc.applied):
        if v == version:
            return int(applied_step)
    return None


def rank_report() -> dict[str, Any]:
    """This worker's report for the engine channel (the same fields as its ranks/ file, plus host
    and its dispatch counters); never raises. Read between two steps: no lock is needed for the
    step and snapshot, which only this thread changes."""
    from flyserve.vllm.runtime import RankRuntime

    rt = RankRuntime.get()
    try:
        out = rt.control.report_dict()
    except Exception as exc:  # noqa: BLE001 - a report must not fail the RPC
        return {"rank": rt.rank, "engine": rt.engine, "pid": os.getpid(), "host": HOST,
                "why": "report failed", "error": str(exc)[:200]}  # fmt: skip
    out["host"] = HOST
    out["applied"] = [list(x) for x in rt.control.applied[-8:]]
    out["decisions"] = rank_decisions(rt.rank)
    return out


def rank_decisions(rank: int) -> dict[str, float]:
    """This process's dispatch decisions per path ({} when none yet): its own metric values, read
    from this process's registry (never the other ranks' files)."""
    from flyserve.telemetry import metrics as tm

    label = str(rank)
    out: dict[str, float] = {}
    try:
        for family in tm.DISPATCH_DECISIONS.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("rank") == label:
                    path = sample.labels.get("path", "")
                    out[path] = out.get(path, 0.0) + float(sample.value)
    except Exception:  # noqa: BLE001 - counters are observability: an empty dict, never a failure
        return {}
    return out


def _worker_method(self: Any, docs: Sequence[str] | None = None) -> dict[str, Any]:
    """Bound onto WorkerWrapperBase: the per-process state lives in RankRuntime, not the worker."""
    return apply_pushed(docs)


def _report_method(self: Any) -> dict[str, Any]:
    return rank_report()


def install() -> bool:
    """Add METHOD and REPORT_METHOD to vLLM's WorkerWrapperBase (idempotent). False when vLLM is not
    importable."""
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError:
        return False
    if getattr(WorkerWrapperBase, METHOD, None) is not _worker_method:
        setattr(WorkerWrapperBase, METHOD, _worker_method)
    if getattr(WorkerWrapperBase, REPORT_METHOD, None) is not _report_method:
        setattr(WorkerWrapperBase, REPORT_METHOD, _report_method)
    return True
