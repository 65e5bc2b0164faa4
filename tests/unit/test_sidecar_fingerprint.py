"""flyserve_thresholds_fingerprint: the content the live ranks apply, comparable across replicas."""

from __future__ import annotations

import hashlib
import math

from flyserve.sidecar.app import update_rank_gauges
from flyserve.sidecar.fingerprint import FINGERPRINT_HEX_DIGITS, MIXED, fingerprint, fingerprint_of
from flyserve.sidecar.rank_views import rank_views
from flyserve.telemetry import metrics as tm

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()


def _views(*reports: dict, liveness: dict | None = None):
    now = 1000.0
    docs = [
        {"rank": i, "engine": 0, "time": now - 0.1, "applied_version": 1, **r} for i, r in enumerate(reports)
    ]
    return rank_views(docs, {}, now=now, stale_after_s=5.0, liveness=liveness)


def test_the_fingerprint_is_the_hash_prefix_and_exact_in_a_float():
    top = "f" * 64
    assert fingerprint(top) == 2**52 - 1  # the largest: 13 hex digits
    assert float(fingerprint(top)) == 2**52 - 1 and int(float(fingerprint(top))) == fingerprint(top)
    assert f"{fingerprint(A):0{FINGERPRINT_HEX_DIGITS}x}" == A[:FINGERPRINT_HEX_DIGITS]


def test_live_ranks_on_one_content_give_its_fingerprint_whatever_their_version_numbers():
    v = _views({"applied_sha256": A, "applied_version": 1}, {"applied_sha256": A, "applied_version": 7})
    assert fingerprint_of(v) == float(fingerprint(A))


def test_ranks_on_two_contents_or_without_a_hash_are_mixed():
    assert fingerprint_of(_views({"applied_sha256": A}, {"applied_sha256": B})) == MIXED
    assert fingerprint_of(_views({"applied_sha256": A}, {})) == MIXED
    # a malformed hash in a report is no hash (reports are files anyone with access can write)
    v = _views({"applied_sha256": A}, {"applied_sha256": "\x1b]52;c;" + "0" * 56})
    assert v[1].applied_sha256 is None and fingerprint_of(v) == MIXED
    assert _views({"applied_sha256": A.upper()})[0].applied_sha256 is None


def test_no_live_rank_is_nan_and_stale_ranks_do_not_count():
    assert math.isnan(fingerprint_of([]))
    now = 1000.0
    stale = rank_views([{"rank": 0, "time": now - 60, "applied_sha256": B}], {}, now=now, stale_after_s=5.0)
    assert math.isnan(fingerprint_of(stale))
    live = rank_views(
        [{"rank": 0, "time": now - 60, "applied_sha256": B}, {"rank": 1, "time": now, "applied_sha256": A}],
        {},
        now=now,
        stale_after_s=5.0,
    )
    assert fingerprint_of(live) == float(fingerprint(A))


def test_with_confirmed_ranks_live_an_unconfirmed_report_does_not_decide():
    v = _views(
        {"applied_sha256": A},
        {"applied_sha256": B},
        liveness={(0, 0): "confirmed", (0, 1): "unconfirmed"},
    )
    assert fingerprint_of(v) == float(fingerprint(A))
    # with none confirmed, every live report counts (the forgery makes it "mixed": observability only)
    v = _views(
        {"applied_sha256": A}, {"applied_sha256": B}, liveness={(0, 0): "unconfirmed", (0, 1): "unconfirmed"}
    )
    assert fingerprint_of(v) == MIXED


def test_the_rank_gauges_set_it():
    update_rank_gauges(_views({"applied_sha256": A}))
    assert tm.REGISTRY.get_sample_value("flyserve_thresholds_fingerprint") == float(fingerprint(A))
    update_rank_gauges([])
    assert math.isnan(tm.REGISTRY.get_sample_value("flyserve_thresholds_fingerprint"))
