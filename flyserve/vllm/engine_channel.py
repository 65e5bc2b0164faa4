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
from collections.abc import Mapping
from typing import Any

from flyserve.control.rank import ENGINE_CHANNEL
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.policy.thresholds import ThresholdsError

log = logging.getLogger("flyserve.vllm")

METHOD = "flyserve_apply_thresholds"
"""The collective RPC's method name (vLLM looks it up with getattr on each worker)."""

ANSWER_KEYS: tuple[str, ...] = ("rank", "engine", "pid", "step", "version", "applied", "why")
"""Every answer carries these keys (``error`` too, when the snapshot was refused as bad input)."""


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
    return ConfigSnapshot.from_dict(data, source="engine channel")


def apply_pushed(doc: str | None) -> dict[str, Any]:
    """Apply one pushed snapshot in this process; never raises (an exception in a worker RPC is
    logged by vLLM as a worker failure). ``doc`` is ConfigSnapshot.to_json() (a string travels
    through any executor's serialiser unchanged) or None: switch to the engine channel only."""
    from flyserve.vllm.runtime import RankRuntime

    rt = RankRuntime.get()
    rc = rt.control
    answer: dict[str, Any] = {"rank": rt.rank, "engine": rt.engine, "pid": os.getpid()}
    try:
        snap = parse_doc(doc)
    except ThresholdsError as exc:
        # Bad input changes nothing; the answer names the field, in bounded size.
        answer.update(step=rc.step, version=rc.snapshot.version, applied=False, why="invalid",
                      error=str(exc)[:300])  # fmt: skip
        return answer
    first = rc.mode != ENGINE_CHANNEL
    applied, why = rc.apply_pushed(snap)
    if first:
        log.info(
            "flyserve rank %d: thresholds now come through the engine channel (was file polling)", rt.rank
        )
    if applied:
        log.info(
            "flyserve rank %d: version %d from the engine channel, effective from step %d",
            rt.rank,
            rc.snapshot.version,
            rc.snapshot.effective_step,
        )
    answer.update(step=rc.step, version=rc.snapshot.version, applied=applied, why=why)
    return answer


def _worker_method(self: Any, doc: str | None = None) -> dict[str, Any]:
    """Bound onto WorkerWrapperBase: the per-process state lives in RankRuntime, not the worker."""
    return apply_pushed(doc)


def install() -> bool:
    """Add METHOD to vLLM's WorkerWrapperBase (idempotent). False when vLLM is not importable."""
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError:
        return False
    if getattr(WorkerWrapperBase, METHOD, None) is not _worker_method:
        setattr(WorkerWrapperBase, METHOD, _worker_method)
    return True
