"""At unit level: shape samples are read through safe_read (a FIFO or a
/dev/zero link in shapes/ is skipped, not waited on or read without end), dated in the future they
are never priced (so they cannot outlive their window), only live ranks' files count, and advice
refuses (409, field ``samples``) samples the ranks' decision counters do not corroborate."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from pydantic import SecretStr

from flyserve.pricing.costs import load_costs
from flyserve.sidecar.app import create_app
from flyserve.sidecar.live_costs import HORIZON_S, SAMPLE_CLOCK_SKEW_S, LivePricing
from flyserve.sidecar.sample_evidence import corroborate
from flyserve.sidecar.settings import SidecarSettings
from flyserve.sidecar.stats import RankCounters
from flyserve.telemetry.shape_sample import ShapeSample, ShapeSampleWriter, read_shape_samples

T0 = 1_000_000.0
CHUNK = {"query_lens": [1] * 8 + [2048], "seq_lens": [4096] * 8 + [8192], "max_seq_len": 8192}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_samples(
    state: Path, *, rank: int, steps: range, time_of, engine: int = 0, path: str = "prefill"
) -> None:
    w = ShapeSampleWriter(state, rank=rank, engine=engine, capacity=len(steps) + 1)
    w.set_layer(head_size=128, block_size=16)
    for s in steps:
        w.add(s, CHUNK["query_lens"], CHUNK["max_seq_len"], 32, True, CHUNK["seq_lens"], path, time_of(s))
    w.flush()


def read_in_thread(state: Path, **kw) -> list[ShapeSample]:
    """read_shape_samples in a daemon thread: on a reader that blocks on a FIFO the test fails
    after 20 s instead of hanging the suite (the reader itself needs no thread)."""
    box: dict[str, list[ShapeSample]] = {}
    t = threading.Thread(target=lambda: box.setdefault("v", read_shape_samples(state, **kw)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "read_shape_samples blocked on a file in shapes/"
    return box["v"]


# ---------------------------------------------------------------- what is in shapes/


def test_a_fifo_and_a_dev_zero_link_in_shapes_are_skipped(tmp_path: Path) -> None:
    write_samples(tmp_path, rank=0, steps=range(5), time_of=lambda s: T0 + s)
    shapes = tmp_path / "shapes"
    os.mkfifo(shapes / "0-1.jsonl")
    (shapes / "0-2.jsonl").symlink_to("/dev/zero")
    (shapes / "0-3.jsonl").mkdir()
    got = read_in_thread(tmp_path, limit=100)
    assert sorted(s.step for s in got) == [0, 1, 2, 3, 4] and {s.rank for s in got} == {0}


# ---------------------------------------------------------------- time


def test_samples_dated_in_the_future_are_never_priced_and_cannot_fill_a_window(tmp_path: Path) -> None:
    now = T0 + 1000
    write_samples(tmp_path, rank=0, steps=range(10), time_of=lambda s: now + 3600 + s)  # an hour ahead
    lp = LivePricing(load_costs("h200"), clock=Clock(now))
    assert lp.ingest(read_shape_samples(tmp_path, limit=100)) == 0
    assert lp.window(60) == [] and lp.future_samples == 10
    # Not when their date comes either: they were seen as forged, and stay refused.
    lp._clock = Clock(now + 3600 + 5)  # type: ignore[assignment]
    assert lp.ingest(read_shape_samples(tmp_path, limit=100)) == 0 and lp.window(60) == []


def test_a_sample_within_the_clock_skew_counts_as_now_and_expires_with_its_window(tmp_path: Path) -> None:
    now = T0 + 1000
    write_samples(tmp_path, rank=0, steps=range(3), time_of=lambda s: now + SAMPLE_CLOCK_SKEW_S - 1)
    clock = Clock(now)
    lp = LivePricing(load_costs("h200"), clock=clock)
    assert lp.ingest(read_shape_samples(tmp_path, limit=100)) == 3
    assert all(p.time == now for p in lp.window(60))  # clamped: as fresh as now, no fresher
    (tmp_path / "shapes" / "0-0.jsonl").unlink()
    clock.t = now + 61  # the file is gone: 61 s later the 60 s window is empty
    assert lp.window(60) == []
    clock.t = now + HORIZON_S + 1
    lp.ingest([])
    assert lp.window(HORIZON_S) == []


# ---------------------------------------------------------------- whose samples


def test_only_live_ranks_files_are_read(tmp_path: Path) -> None:
    write_samples(tmp_path, rank=0, steps=range(5), time_of=lambda s: T0)
    write_samples(tmp_path, rank=7, steps=range(100, 105), time_of=lambda s: T0)  # no such rank runs
    (tmp_path / "shapes" / "evil.jsonl").write_text((tmp_path / "shapes" / "0-7.jsonl").read_text())
    everything = read_shape_samples(tmp_path, limit=100)
    assert {s.rank for s in everything} == {0, 7}  # without a liveness filter: all of them
    got = read_shape_samples(tmp_path, limit=100, live={(0, 0)})
    assert sorted(s.step for s in got) == [0, 1, 2, 3, 4] and {(s.engine, s.rank) for s in got} == {(0, 0)}


def _counters(prefill: float, unified: float = 0.0) -> RankCounters:
    return RankCounters(decisions={("prefill", "admitted"): prefill, ("unified", "short_context"): unified})


def _sample(rank: int, step: int, path: str = "prefill") -> ShapeSample:
    return ShapeSample(step, (1, 2048), 8192, 32, path=path, time=T0, rank=rank)


def test_corroborate_passes_an_honest_rank_and_refuses_a_forged_claim() -> None:
    honest = [_sample(0, s) for s in range(100)]
    ev = corroborate(honest, {0: _counters(prefill=100, unified=50)})
    assert ev.corroborated and ev.samples == 100 and ev.reason is None
    # 400 'prefill' samples claimed by rank 1, which routed 20 batches to prefill
    forged = [_sample(1, 1000 + s) for s in range(400)]
    ev = corroborate(honest + forged, {0: _counters(100, 50), 1: _counters(prefill=20, unified=5000)})
    assert not ev.corroborated and ev.samples == 500
    assert ev.reason is not None and "500 samples from ranks 0-0, 0-1" in ev.reason
    assert "rank 0-1: 400 'prefill' samples but 20 prefill decisions counted" in ev.reason
    assert [r["corroborated"] for r in ev.to_json()["ranks"]] == [True, False]
    # a rank without any counters cannot vouch for its samples
    assert not corroborate(honest, {}).corroborated


def _settings(state: Path) -> SidecarSettings:
    return SidecarSettings(
        state_dir=state, profile="gfx950", token=SecretStr("t0ken-for-tests-0123456789"),
        share_control_metrics=False, stats_ttl_s=0.0, metrics_ttl_s=0.0, costs="h200",
    )  # fmt: skip


def write_live_report(state: Path, rank: int) -> None:
    d = state / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (d / f"{rank}.json").write_text(
        json.dumps({"pid": 4000 + rank, "rank": rank, "engine": 0, "step": 500, "applied_version": 0,
                    "time": now, "started": now - 600})
    )  # fmt: skip


def test_advice_refuses_uncorroborated_samples_with_409_naming_count_and_ranks(tmp_path: Path) -> None:
    """A live rank's file full of samples, and no decision counted by that rank: 409, field
    'samples', the count and the rank in the reason; nothing fitted."""
    write_live_report(tmp_path, 0)
    now = time.time()
    write_samples(tmp_path, rank=0, steps=range(50), time_of=lambda s: now - 1)
    with TestClient(create_app(_settings(tmp_path))) as c:
        r = c.get("/thresholds/advice?window=60s")
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["field"] == "samples" and body["samples"]["used"] == 50
    assert "50 samples from ranks 0-0" in body["detail"] and "no decision counters" in body["detail"]
    assert body["samples"]["ranks"][0] | {"reason": None} == {
        "engine": 0, "rank": 0, "samples": 50, "samples_by_path": {"prefill": 50}, "decisions": None,
        "corroborated": False, "reason": None,
    }  # fmt: skip


def test_advice_ignores_samples_of_ranks_that_do_not_run(tmp_path: Path) -> None:
    """No live rank: a forged file priced nothing, so advice has nothing to fit (409 window)."""
    now = time.time()
    write_samples(tmp_path, rank=5, steps=range(50), time_of=lambda s: now - 1)
    with TestClient(create_app(_settings(tmp_path))) as c:
        r = c.get("/thresholds/advice?window=60s")
    assert r.status_code == 409 and r.json()["field"] == "window", r.text


def test_regret_and_drift_leave_out_a_rank_its_counters_do_not_back(tmp_path: Path) -> None:
    """The same forged-but-live rank in /dispatch-stats: named in regret.uncorroborated_ranks, its
    samples counted in sample_ranks but left out of the windows (and so of the drift gauge)."""
    write_live_report(tmp_path, 0)
    now = time.time()
    write_samples(tmp_path, rank=0, steps=range(50), time_of=lambda s: now - 1)
    with TestClient(create_app(_settings(tmp_path))) as c:
        reg = c.get("/dispatch-stats").json()["regret"]
    assert reg["sample_ranks"] == {"0-0": 50} and reg["uncorroborated_ranks"] == ["0-0"]
    assert reg["windows"]["60s"]["samples"] == 0 and reg["windows"]["900s"]["samples"] == 0
