"""/dispatch-stats shows each rank's prefill kernel (which FlyDSL revision, or why it is off),
from the rank reports; a malformed field in a report (it is input) is dropped, not trusted."""

from __future__ import annotations

from flyserve.sidecar.rank_views import rank_views


def _report(**extra):
    return {"rank": 0, "engine": 0, "pid": 1, "step": 5, "applied_version": 1, "time": 100.0, **extra}


def test_prefill_kernel_reaches_the_rank_view():
    pk = {"kernel": "flydsl-dualwave", "revision": "causal_lpt, pages 64/128", "off_reason": None}
    (v,) = rank_views([_report(prefill_kernel=pk)], {}, now=100.5, stale_after_s=5)
    assert v.prefill_kernel is not None
    assert v.prefill_kernel.model_dump() == pk


def test_off_reason_is_shown_and_bounded():
    pk = {"kernel": "flydsl-dualwave", "revision": None, "off_reason": "FlyDSL not importable " + "x" * 5000}
    (v,) = rank_views([_report(prefill_kernel=pk)], {}, now=100.5, stale_after_s=5)
    assert (
        v.prefill_kernel.off_reason.startswith("FlyDSL not importable")
        and len(v.prefill_kernel.off_reason) == 400
    )


def test_malformed_prefill_kernel_is_dropped():
    for bad in ("flydsl", 3, {"revision": "r"}, {"kernel": 5}, ["kernel"]):
        (v,) = rank_views([_report(prefill_kernel=bad)], {}, now=100.5, stale_after_s=5)
        assert v.prefill_kernel is None
    (v,) = rank_views([_report()], {}, now=100.5, stale_after_s=5)
    assert v.prefill_kernel is None
