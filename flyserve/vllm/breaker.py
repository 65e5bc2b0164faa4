"""The prefill path's circuit breaker.

If the prefill kernel raises, the batch must not be lost and the path must stop being used:

1. this process stops routing to it at once (``RankRuntime.local_circuit_open``: the next step's
   select() already answers ``unified``, reason ``circuit_open``);
2. every rank stops, through the control plane: ``ControlPlane.set_circuit(True)`` publishes a
   version with ``circuit_open`` that all ranks apply at the same step;
3. the failed batch is re-run on the unified path when the backend pair shares its metadata
   (CPU, ROCm: the prefill backend reuses the unified builder), otherwise ``PrefillPathError``
   surfaces once with the cause and the way back;
4. an operator closes it again: ``flyserve thresholds circuit close`` (or POST /thresholds/circuit).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("flyserve.vllm")


class PrefillPathError(RuntimeError):
    """The prefill kernel raised and its batch could not be re-run on the unified path."""


def trip(rt: Any, exc: BaseException, *, kernel: str) -> None:
    """Open the breaker for this process and, once, for every rank through the control plane."""
    first = not rt.local_circuit_open
    rt.local_circuit_open = True
    if rt.circuit_reported:
        return
    rt.circuit_reported = True
    reason = f"{kernel} raised {type(exc).__name__}: {exc}"[:400]
    log.error(
        "flyserve rank %d: the prefill path (%s) raised; circuit OPEN, prefill batches now take the "
        "unified path on every rank. Close it with `flyserve thresholds circuit close` once fixed.",
        rt.rank,
        kernel,
        exc_info=exc if first else None,
    )
    try:
        rt.recorder.set_circuit_open(True)
    except Exception:
        log.exception("flyserve: could not set the circuit gauge")
    rt.circuit_trip_version = rt.control.snapshot.version
    try:
        from flyserve.control import ControlPlane

        res = ControlPlane(rt.state_dir, profile=rt.profile).set_circuit(
            True, actor=f"flyserve-rank{rt.rank}", reason=reason, source="api"
        )
        rt.circuit_trip_version = res.snapshot.version
    except Exception:
        # The local breaker stays open whatever happens here; the other ranks learn of it when
        # their own prefill path raises.
        log.exception("flyserve rank %d: could not publish the open circuit to the control plane", rt.rank)


def warm_up_failed(rt: Any, exc: BaseException, *, kernel: str) -> None:
    """A prefill kernel failed to compile or launch at start: say why, open the circuit, keep serving.

    Start-up must not abort for the specialist kernel: the unified path serves every batch until an
    operator has fixed the kernel and closed the circuit.
    """
    log.error(
        "flyserve rank %d: %s warm-up failed (%s: %s); the prefill path is OFF (circuit open), serving on the "
        "unified path. Fix the kernel, then `flyserve thresholds circuit close`.",
        rt.rank,
        kernel,
        type(exc).__name__,
        str(exc)[:300],
    )
    trip(rt, exc, kernel=f"{kernel} warm-up")
