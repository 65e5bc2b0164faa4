"""Live pricing in the sidecar: regret equals `flyserve replay` on the same trace, advice that replay
confirms, layer checks, drift, and sample input that must not double count or poison a price.

Samples go through the real file format (ShapeSampleWriter -> rank file -> read_shape_samples),
as the sidecar reads them from the ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flyserve.lab.replay import model_price, price_trace, replay
from flyserve.lab.workloads import Trace, workload
from flyserve.policy import PREFILL, BatchShape, Thresholds, decide
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.sidecar.advice_fit import ADVICE_KNOBS
from flyserve.sidecar.live_costs import LivePricing
from flyserve.telemetry.shape_sample import ShapeSampleWriter, read_shape_samples
from flyserve.thresholds_files import load_profile

H200_HEADS = 32  # the h200 table's layer: 32 query heads, head size 128, block size 16
T0 = 1_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_trace(
    state: Path,
    trace: Trace,
    t: Thresholds,
    *,
    heads: int = H200_HEADS,
    head_size: int | None = 128,
    block_size: int | None = 16,
    kernel=None,
    ranks: int = 1,
) -> None:
    """What a rank writes for each step of ``trace`` (0.01 s apart), routed by decide() under ``t``."""
    for rank in range(ranks):
        w = ShapeSampleWriter(state, rank=rank, capacity=len(trace) + 1)
        w.set_layer(head_size=head_size, block_size=block_size)
        for i, s in enumerate(trace):
            shape = BatchShape.from_query_lens(
                s.query_lens, max_seq_len=s.max_seq_len, num_heads=heads, thresholds=t
            )
            path = decide(shape, t).path
            k = kernel(s, path) if kernel is not None else None
            w.add(i, s.query_lens, s.max_seq_len, heads, True, s.seq_lens, path, T0 + i * 0.01, k)
        w.flush()


def pricing(state: Path, trace_len: int) -> LivePricing:
    lp = LivePricing(load_costs("h200"), clock=Clock(T0 + trace_len * 0.01))
    lp.ingest(read_shape_samples(state, limit=1 << 20))
    return lp


@pytest.fixture(scope="module")
def h200_model() -> CostModel:
    return CostModel(load_costs("h200"))


def prefix(name: str, n: int) -> Trace:
    tr = workload(name)
    return Trace(f"{name}[:{n}]", tr.steps[:n], tr.meta)


@pytest.mark.slow  # 0.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_live_regret_equals_replay_on_the_same_trace(tmp_path, h200_model):
    trace = prefix("seed-8k-c32", 1000)
    t = load_profile("gfx950")
    write_trace(tmp_path, trace, t, ranks=2)  # two TP ranks sample the same steps: counted once
    lp = pricing(tmp_path, len(trace))
    w = lp.regret()["windows"]["900s"]
    r = replay(trace, t, price_trace(trace, model_price(h200_model)), num_heads=H200_HEADS)
    assert w["samples"] == len(trace)
    assert w["routed_over_oracle"] == pytest.approx(r.routed_over_oracle, rel=1e-9)
    assert w["routed_s"] == pytest.approx(r.routed_s, rel=1e-9)
    assert w["always_unified_s"] == pytest.approx(r.unified_s, rel=1e-9)
    assert w["always_prefill_s"] == pytest.approx(r.prefill_s, rel=1e-9)
    assert w["prefill_batches"]["routed_over_oracle"] == pytest.approx(
        r.extra["prefill_batches_routed_over_oracle"], rel=1e-9
    )
    assert w["routed_over_oracle"] > 1.5  # gfx950's decode_path on H200 prices: a real regret
    # The 60 s window holds only the last minute of samples (0.01 s apart: all 1000 are in 10 s).
    assert lp.regret()["windows"]["60s"]["samples"] == len(trace)
    lp._clock.t += 55.0  # type: ignore[attr-defined]
    assert lp.regret()["windows"]["60s"]["samples"] == 500  # steps 500..999 are within 60 s
    assert lp.regret()["windows"]["900s"]["samples"] == len(trace)


def test_reading_the_same_files_again_prices_nothing_twice(tmp_path):
    trace = prefix("seed-8k-c8", 300)
    write_trace(tmp_path, trace, load_profile("gfx950"))
    seen = []
    lp = LivePricing(load_costs("h200"), clock=Clock(T0 + 10), on_priced=seen.append)
    assert lp.ingest(read_shape_samples(tmp_path, limit=1 << 20)) == 300
    assert lp.ingest(read_shape_samples(tmp_path, limit=1 << 20)) == 0
    assert len(seen) == 300 and lp.regret()["windows"]["900s"]["samples"] == 300


@pytest.mark.slow  # 1.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_advice_for_gfx950_on_h200_prices_is_confirmed_by_replay(tmp_path, h200_model):
    """The seed gfx950 profile on a workload priced by the H200 table: advice fitted on the live
    samples; replay of the whole trace under the advised values confirms routed/oracle on the
    batches run-time knobs route within 2% of 1.0 (it was 7x), and decode_path is never touched."""
    trace = workload("seed-8k-c32")
    gfx = load_profile("gfx950")
    write_trace(tmp_path, trace, gfx)
    lp = pricing(tmp_path, len(trace))
    res = lp.advise(gfx, window_s=900.0, max_shapes=len(trace))
    assert res.changes and set(res.changes) <= set(ADVICE_KNOBS)
    assert "decode_path" not in res.changes and res.proposed.decode_path == gfx.decode_path
    costs = price_trace(trace, model_price(h200_model))
    before = replay(trace, gfx, costs, num_heads=H200_HEADS)
    after = replay(trace, res.proposed, costs, num_heads=H200_HEADS)
    assert before.extra["prefill_batches_routed_over_oracle"] > 1.5
    assert after.extra["prefill_batches_routed_over_oracle"] == pytest.approx(1.0, abs=0.02)
    assert after.routed_s < before.routed_s
    # The advice's own before/after are the same numbers replay gives on these samples.
    assert res.before.prefill_batches["routed_over_oracle"] == pytest.approx(
        before.extra["prefill_batches_routed_over_oracle"], rel=1e-9
    )
    assert res.after.prefill_batches["routed_over_oracle"] == pytest.approx(
        after.extra["prefill_batches_routed_over_oracle"], rel=1e-9
    )


def test_advice_on_an_empty_window_is_refused(tmp_path):
    lp = LivePricing(load_costs("h200"), clock=Clock(T0))
    with pytest.raises(ValueError, match="no priced shapes"):
        lp.advise(load_profile("gfx950"))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"heads": 16}, "32 query heads per rank; the ranks run 16"),
        ({"head_size": 64}, "head size 128; the ranks run 64"),
        ({"block_size": 64}, "no entries for block size 64"),
    ],
)
def test_a_table_for_another_layer_prices_nothing_and_says_why(tmp_path, kw, words):
    trace = prefix("seed-8k-c8", 50)
    write_trace(tmp_path, trace, load_profile("gfx950"), **kw)
    lp = pricing(tmp_path, len(trace))
    reg = lp.regret()
    assert reg["windows"]["900s"]["samples"] == 0
    assert words in reg["unpriceable"] and reg["unpriceable_samples"] == 50


def test_samples_without_seq_lens_are_not_priced(tmp_path):
    d = tmp_path / "shapes"
    d.mkdir()
    (d / "0-0.jsonl").write_text(
        json.dumps({"step": 1, "query_lens": [1, 500], "max_seq_len": 900, "num_heads": 32}) + "\n"
    )
    lp = pricing(tmp_path, 0)
    assert "carry no seq_lens" in lp.regret()["unpriceable"]


def test_bad_sample_lines_are_skipped_not_priced(tmp_path):
    d = tmp_path / "shapes"
    d.mkdir()
    good = {"step": 3, "query_lens": [1, 64], "seq_lens": [900, 64], "max_seq_len": 900, "num_heads": 32}
    lines = [
        {**good, "step": 1, "seq_lens": [900]},  # lengths do not pair up
        {**good, "step": 2, "seq_lens": [900, 10]},  # seq_len < query_len
        {**good, "step": 4, "kernel_s": "Infinity"},  # an absurd kernel time: the shape stays, not it
        {**good, "step": 5, "query_lens": [1, -64]},  # negative
        good,
    ]
    (d / "0-0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    samples = read_shape_samples(tmp_path, limit=100)
    assert [s.step for s in samples] == [4, 3]
    assert samples[0].kernel_s is None and samples[0].seq_lens == (900, 64)


def test_drift_is_the_median_measured_over_predicted_per_path(tmp_path, h200_model):
    trace = prefix("seed-32k-c32", 400)

    def kernel(step, path):  # the prefill kernel 1.5x slower than the table, unified as measured
        return h200_model.predict(step.query_lens, step.seq_lens, path) * (1.5 if path == PREFILL else 1.0)

    write_trace(tmp_path, trace, load_profile("h200"), kernel=kernel)
    lp = pricing(tmp_path, len(trace))
    drift = lp.regret()["windows"]["900s"]["drift"]
    assert drift["prefill"]["samples"] == 400  # h200 sends every batch to FA3 (its decode_path)
    assert drift["prefill"]["median_ratio"] == pytest.approx(1.5)
    assert lp.regret_drift() == {"unified": None, "prefill": pytest.approx(1.5)}


def test_no_kernel_times_no_drift(tmp_path):
    trace = prefix("seed-8k-c8", 50)
    write_trace(tmp_path, trace, load_profile("gfx950"))
    lp = pricing(tmp_path, len(trace))
    assert lp.regret_drift() == {"unified": None, "prefill": None}


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_advice_changes_nothing_the_window_cannot_pay_for(tmp_path):
    """Thresholds that already route every sampled batch to its faster path get no advice, even
    where the fitter's tie-break would widen knobs (the h200 profile on the h200 table)."""
    trace = prefix("seed-8k-c32", 600)
    h200 = load_profile("h200")
    write_trace(tmp_path, trace, h200)
    res = pricing(tmp_path, len(trace)).advise(h200)
    assert res.changes == {} and res.proposed == h200


@pytest.mark.slow  # 1.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_advice_keeps_only_the_knobs_that_pay(tmp_path, h200_model):
    trace = workload("seed-8k-c32")
    gfx = load_profile("gfx950")
    write_trace(tmp_path, trace, gfx)
    res = pricing(tmp_path, len(trace)).advise(gfx, max_shapes=len(trace))
    for knob, (old, _new) in res.changes.items():  # putting any one back costs attention time
        try:
            back = res.proposed.merged({knob: old})
        except ValueError:
            continue
        costs = price_trace(trace, model_price(h200_model))
        assert (
            replay(trace, back, costs, num_heads=H200_HEADS).routed_s
            > replay(trace, res.proposed, costs, num_heads=H200_HEADS).routed_s
        ), knob
