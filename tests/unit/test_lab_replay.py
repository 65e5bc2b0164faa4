"""flyserve.lab.replay + costs + the `replay` command: the arithmetic against hand-computed traces."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from _support import require_module
from typer.testing import CliRunner

from flyserve.lab.cli import register
from flyserve.lab.costs import CostEntry, CostModel, CostTable, CostTableError, load_costs
from flyserve.lab.replay import price_trace, replay, replay_many, route_trace
from flyserve.lab.workloads import Trace, TraceStep
from flyserve.thresholds_files import load_profile


def _trace() -> Trace:
    steps = [
        TraceStep(np.array([1, 1]), np.array([100, 300])),  # decode only
        TraceStep(np.array([1, 50]), np.array([101, 3000])),  # 51 tokens: low occupancy on gfx950
        TraceStep(np.array([2000]), np.array([2000])),  # one fresh prompt: admitted on gfx950
    ]
    return Trace("hand", tuple(steps))


# per-step seconds, chosen by hand: (unified, prefill)
HAND = {0: (1.0, 2.0), 1: (5.0, 3.0), 2: (10.0, 4.0)}


def test_replay_arithmetic_by_hand():
    tr = _trace()
    index = {id(s): i for i, s in enumerate(tr)}
    costs = price_trace(tr, lambda s, p: HAND[index[id(s)]][0 if p == "unified" else 1])
    r = replay(tr, load_profile("gfx950"), costs, num_heads=32, profile="gfx950")
    # gfx950: step 0 no prefill row -> unified 1; step 1: 32 heads * 51 tokens < 48 * 256 -> unified 5;
    # step 2: 32 * 2000 >= 12288, ctx 2000 >= 1536 -> prefill 4
    assert r.routed_s == pytest.approx(1 + 5 + 4)
    assert r.unified_s == pytest.approx(16)
    assert r.prefill_s == pytest.approx(9)
    assert r.oracle_s == pytest.approx(1 + 3 + 4)
    assert r.routed_over_oracle == pytest.approx(10 / 8)
    assert r.prefill_ratio == pytest.approx(1 / 3)
    assert r.reasons == {"no_prefill_rows": 1, "low_occupancy": 1, "admitted": 1}
    assert r.wrong_steps == 1
    doc = r.to_json()
    for key in (
        "routed_s",
        "unified_s",
        "prefill_s",
        "oracle_s",
        "routed_over_oracle",
        "prefill_ratio",
        "reasons",
    ):
        assert key in doc


def test_replay_many_prices_once_and_differs_by_profile():
    tr = _trace()
    index = {id(s): i for i, s in enumerate(tr)}
    calls = []

    def price(s, p):
        calls.append((index[id(s)], p))
        return HAND[index[id(s)]][0 if p == "unified" else 1]

    everything = load_profile("gfx950").merged({"decode_path": "prefill", "min_qblock_rows": 0})
    a, b = replay_many(tr, {"gfx950": load_profile("gfx950"), "open": everything}, price, num_heads=32)
    assert len(calls) == 6  # 3 steps x 2 paths, shared by both profiles
    assert a.routed_s == pytest.approx(10)
    assert b.routed_s == pytest.approx(2 + 3 + 4) and b.prefill_ratio == 1.0
    assert [p for p, _ in route_trace(tr, everything, num_heads=32)] == ["prefill"] * 3


def _table() -> CostTable:
    """A table whose model predictions for _trace() are hand-computable (see test below)."""

    def e(kind, q, s, u, p):
        return CostEntry(kind, tuple(q), tuple(s), {"unified": u / 1e3, "prefill": p / 1e3})

    entries = (
        e("decode", [1], [100], 1.0, 2.0),
        e("decode", [1], [300], 1.0, 2.0),
        e("decode", [1, 1], [100, 100], 2.0, 4.0),
        e("decode", [1, 1], [300, 300], 2.0, 4.0),
        e("prefill", [50], [50], 2.0, 0.5),
        e("prefill", [50], [5950], 6.0, 1.5),
        e("prefill", [2000], [2000], 10.0, 4.0),
    )
    return CostTable("hand", {"num_heads": 32, "block_size": 16, "gpu": "by hand"}, entries)


def test_cost_model_by_hand():
    m = CostModel(_table())
    tr = _trace()
    got = [
        (m.predict(s.query_lens, s.seq_lens, "unified"), m.predict(s.query_lens, s.seq_lens, "prefill"))
        for s in tr
    ]
    # step 0: 2 decode rows at mean ctx 200 -> (2, 4) ms
    # step 1: decode part R=1 @101 -> (1, 2); chunk q=50 after p=2950 -> halfway (4, 1);
    #         minus the launch floor once (1, 2): unified 1+4-1 = 4, prefill max(2+1-2, 2) = 2
    # step 2: the grid point (10, 4)
    assert got == [pytest.approx((2e-3, 4e-3)), pytest.approx((4e-3, 2e-3)), pytest.approx((10e-3, 4e-3))]
    # interpolation across q is log-log: q=316 (geometric middle of 50 and 2000) at p=0 -> sqrt(2*10)
    assert m.predict(np.array([316]), np.array([316]), "unified") == pytest.approx(
        np.exp(np.log(2e-3) + np.log(316 / 50) / np.log(40) * np.log(5)), rel=1e-9
    )
    # beyond the largest decode R: proportional
    assert m.predict(np.ones(4, dtype=int), np.full(4, 100), "unified") == pytest.approx(4e-3)


def test_cli_replay_json_matches_hand(tmp_path):
    trace = tmp_path / "hand.jsonl"
    trace.write_text(_trace().to_jsonl())
    costs = tmp_path / "hand.json"
    costs.write_text(_table().to_json())
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(
        app, ["replay", str(trace), "--costs", str(costs), "--profile", "gfx950", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    # model costs per step (unified, prefill) in ms: (2, 4), (4, 2), (10, 4); gfx950 routes U, U, P
    assert doc["routed_s"] == pytest.approx((2 + 4 + 4) / 1e3)
    assert doc["unified_s"] == pytest.approx(16 / 1e3)
    assert doc["prefill_s"] == pytest.approx(10 / 1e3)
    assert doc["oracle_s"] == pytest.approx(8 / 1e3)
    assert doc["routed_over_oracle"] == pytest.approx(1.25)
    assert doc["prefill_ratio"] == pytest.approx(1 / 3)
    assert doc["reasons"] == {"no_prefill_rows": 1, "low_occupancy": 1, "admitted": 1}


@pytest.mark.slow  # 1.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_cli_replay_table_and_plot(tmp_path):
    require_module("matplotlib")
    costs = tmp_path / "hand.json"
    costs.write_text(_table().to_json())
    app = typer.Typer()
    register(app)
    png = tmp_path / "r.png"
    res = CliRunner().invoke(
        app,
        [
            "replay",
            "--workload",
            "seed-8k-c8",
            "--costs",
            str(costs),
            "-p",
            "gfx950",
            "-p",
            "gfx950",
            "--plot",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "routed/oracle" in res.output and png.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["replay"], "TRACE"),
        (["replay", "-w", "seed-9k"], "unknown workload"),
        (["replay", "-w", "seed-8k-c8", "--costs", "nope"], "unknown cost table"),
        (["replay", "-w", "seed-8k-c8", "-p", "nope"], "unknown profile"),
    ],
)
def test_cli_replay_errors(args, needle):
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert needle in res.output


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(format="x"), "'format'"),
        (lambda d: d["entries"][0].update(kind="weird"), "'kind'"),
        (lambda d: d["entries"][0]["ms"].pop("prefill"), "'ms'"),
        (lambda d: d["entries"][0]["ms"].update(unified=-1), "'ms.unified'"),
        (lambda d: d["entries"][0].update(seq_lens=[1, 2]), "'query_lens'/'seq_lens'"),
        (lambda d: d["entries"][4].update(query_lens=[1]), "'prefill' entry"),
    ],
)
def test_bad_cost_tables_name_the_field(tmp_path, mutate, field):
    doc = json.loads(_table().to_json())
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(CostTableError, match=field.replace("(", r"\(")):
        load_costs(p)


def test_committed_h200_table_loads_and_reproduces_its_grid():
    t = load_costs("h200")
    assert t.meta["gpu"] == "NVIDIA H200" and t.block_sizes == [16, 128]
    for bs in t.block_sizes:
        m = CostModel(t, block_size=bs)
        for row in m.check():
            if row["kind"] != "mixed":  # grid points reproduce exactly
                assert abs(row["unified_err"]) < 1e-9 and abs(row["prefill_err"]) < 1e-9


@pytest.mark.slow  # 0.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_cli_replay_takes_a_workload_name_as_its_argument():
    """A workload name as TRACE replays that workload, as `--workload NAME` does (was a TypeError:
    the --workload option shadowed the workload builder)."""
    app = typer.Typer()
    register(app)
    by_arg = CliRunner().invoke(app, ["replay", "seed-32k-c32", "--costs", "h200", "--json"])
    by_opt = CliRunner().invoke(app, ["replay", "--workload", "seed-32k-c32", "--costs", "h200", "--json"])
    assert by_arg.exit_code == 0, by_arg.output
    assert json.loads(by_arg.output)["routed_s"] == json.loads(by_opt.output)["routed_s"]
