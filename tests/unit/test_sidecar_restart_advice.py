"""Restart-only advice (flyserve.sidecar.restart_advice): every start-only threshold has an adviser,
a decode_path that is already right is not advised, the block size is priced with the table's other
size, and the ready PATCH never carries a start-only knob."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flyserve.policy import Thresholds
from flyserve.policy.thresholds import START_ONLY_FIELDS
from flyserve.sidecar.restart_advice import START_ONLY_ADVISERS
from flyserve.thresholds_files import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sidecar_live_costs import prefix, pricing, write_trace


def test_every_start_only_field_has_an_adviser_and_is_never_a_run_time_knob():
    from flyserve.sidecar.advice_fit import ADVICE_KNOBS

    assert set(START_ONLY_ADVISERS) == set(START_ONLY_FIELDS)
    assert not set(START_ONLY_FIELDS) & set(ADVICE_KNOBS)
    for f in START_ONLY_FIELDS:  # the field's own description says so
        assert "restart" in Thresholds.model_fields[f].description


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_decode_path_already_cheapest_is_not_advised(tmp_path):
    h200 = load_profile("h200")  # decode_path prefill: the faster path for decode on the h200 table
    trace = prefix("seed-32k-c32", 300)
    write_trace(tmp_path, trace, h200)
    res = pricing(tmp_path, len(trace)).advise(h200)
    assert "decode_path" not in {r.knob for r in res.restart}


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_gfx950_on_h200_advises_decode_path_and_prices_block_size(tmp_path):
    gfx = load_profile("gfx950")
    trace = prefix("seed-32k-c32", 300)
    write_trace(tmp_path, trace, gfx)  # samples say block size 16; the table also has 128
    res = pricing(tmp_path, len(trace)).advise(gfx)
    by = {r.knob: r for r in res.restart}
    assert by["decode_path"].advised == "prefill" and by["decode_path"].saving > 0.2
    assert "decode_path" not in res.changes
    if "block_size" in by:  # priced with the 128 entries: a saving, however small, and a flag to pass
        bs = by["block_size"]
        assert bs.current == 16 and bs.advised == 128 and bs.saving > 0 and "--block-size 128" in bs.how
    assert [r.saving for r in res.restart] == sorted((r.saving for r in res.restart), reverse=True)
    assert res.restart[0].to_json()["needs_restart"] is True


def test_no_block_size_advice_when_samples_do_not_say_theirs(tmp_path):
    gfx = load_profile("gfx950")
    trace = prefix("seed-32k-c32", 100)
    write_trace(tmp_path, trace, gfx, block_size=None)
    res = pricing(tmp_path, len(trace)).advise(gfx)
    assert "block_size" not in {r.knob for r in res.restart}
    assert res.restart and res.restart[0].knob == "decode_path"
    assert res.restart[0].saving == pytest.approx(
        1 - res.restart[0].routed_s_after / res.restart[0].routed_s_before
    )
