"""What the autopilot's trigger reads from the sidecar's live pricing: the regret window and the
advice fitted on it (the advice worker's fit, reused while fresh), as one LiveInputs.

Asked by the autopilot's own thread only when a trial could start (mode on, nothing running, the
cool-down over): a fit costs 0.85-5 s of CPU, and it runs on the advice worker's thread as every
other fit does, one at a time, never on a thread that answers probes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from flyserve.sidecar.advice_job import FittedAdvice
from flyserve.sidecar.advice_worker import FitWorker
from flyserve.sidecar.autopilot_views import NO_INPUTS, LiveInputs

log = logging.getLogger("flyserve.sidecar")


def inputs_of(fitted: FittedAdvice) -> LiveInputs:
    """Regret and priced samples of the fitted window, the knobs the fit moves and the share of the
    window's routed attention time it predicts saved."""
    res = fitted.result
    before, after = res.before, res.after
    ratio = before.ratio(before.routed_s)
    saving = None if before.routed_s <= 0 else 1.0 - after.routed_s / before.routed_s
    return LiveInputs(
        regret=None if ratio is None else ratio - 1.0,
        priced_samples=before.samples,
        advice_changes={k: new for k, (_, new) in res.changes.items()},
        advice_saving=saving,
    )


def live_inputs(
    worker: FitWorker[str, FittedAdvice], window: str, *, priced: Callable[[], bool]
) -> Callable[[], LiveInputs]:
    """The autopilot's ``live_inputs``: the advice worker's result for ``window`` (no pricing
    (``priced()`` false: no --costs), no samples yet, refused samples: no inputs, and the trigger
    names why)."""

    def read() -> LiveInputs:
        if not priced():
            return NO_INPUTS
        got = asyncio.run(worker.get(window))  # the autopilot's thread has no event loop of its own
        if got is None or got.value is None:
            if got is not None and got.error is not None:
                log.debug("autopilot: no advice: %s", got.error)
            return NO_INPUTS
        return inputs_of(got.value)

    return read
