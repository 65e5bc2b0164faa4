"""flyserve.lab.calibrate: the fit (CPU), the profile document, and clear failure without a GPU."""

from __future__ import annotations

import types

import pytest
import typer
from _support import require_module
from typer.testing import CliRunner

from flyserve.lab.calibrate import GRIDS, build_grid, fit_thresholds, load_grid, profile_yaml
from flyserve.lab.cli import register
from flyserve.lab.costs import CostEntry, CostModel, load_costs
from flyserve.lab.replay import model_price, replay_many
from flyserve.lab.workloads import workload
from flyserve.policy import Thresholds
from flyserve.thresholds_files import load_profile, profile_path


def _synthetic(decode_winner: str, crossover_ctx: int) -> list[CostEntry]:
    """Prefill path faster than unified only when max_seq_len >= crossover_ctx (prefill rows);
    decode-only batches: ``decode_winner`` is 30% faster."""
    out = []
    for p in build_grid(GRIDS["default"]):
        work = sum(q * (s - q / 2) for q, s in zip(p.query_lens, p.seq_lens, strict=True)) + 1e5
        if max(p.query_lens) < 2:
            u, f = (work, 1.3 * work) if decode_winner == "unified" else (1.3 * work, work)
        else:
            u, f = (work, 2 * work) if max(p.seq_lens) < crossover_ctx else (2 * work, work)
        out.append(CostEntry(p.kind, p.query_lens, p.seq_lens, {"unified": u * 1e-12, "prefill": f * 1e-12}))
    return out


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("decode_winner", ["unified", "prefill"])
def test_fit_finds_decode_path_and_the_crossover(decode_winner):
    entries = _synthetic(decode_winner, crossover_ctx=10000)
    fit = fit_thresholds(entries, num_heads=32, base=load_profile("gfx950"))
    t = fit.thresholds
    assert t.decode_path == decode_winner
    assert fit.routed_s == pytest.approx(fit.oracle_s) and fit.wrong == 0
    # the boundary sits between the measured contexts either side of 10000 (8192+? and 16384+)
    ctxs = sorted({max(e.seq_lens) for e in entries})
    below = max(c for c in ctxs if c < 10000)
    above = min(c for c in ctxs if c >= 10000)
    assert below < t.min_seq_len <= above


def test_fit_when_prefill_always_wins_turns_the_checks_off():
    entries = _synthetic("prefill", crossover_ctx=0)
    t = fit_thresholds(entries, num_heads=32, base=load_profile("gfx950")).thresholds
    assert (t.min_seq_len, t.max_seq_len, t.min_qblock_rows, t.prefill_enabled) == (0, 0, 0, True)
    assert t.decode_row_cap(8192) >= 256  # never too many decode rows in practice


def test_profile_yaml_round_trips_with_header():
    t = load_profile("gfx950").merged({"decode_path": "prefill", "min_seq_len": 0})
    text = profile_yaml(t, ["flyserve thresholds profile: x", "command: flyserve calibrate ..."])
    assert text.startswith("# flyserve thresholds profile: x\n# command: flyserve calibrate")
    assert Thresholds.from_yaml_text(text) == t


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_committed_h200_profile_was_produced_by_calibrate_and_generalises():
    text = profile_path("h200").read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any(ln.startswith("# command: flyserve calibrate") for ln in header)
    assert any(ln.startswith("# date: ") for ln in header)
    assert any("GPU: NVIDIA H200" in ln and "vLLM" in ln for ln in header)
    h200 = load_profile("h200")
    assert h200.decode_path == "prefill"
    # the six seed workloads, priced by the committed table: within 2% of the oracle
    model = CostModel(load_costs("h200"))
    for name in ("seed-8k-c32", "seed-60k-c8"):  # two of six here; docs/performance.md has all
        (r,) = replay_many(workload(name), {"h200": h200}, model_price(model), num_heads=32)
        assert r.routed_over_oracle <= 1.02


def _lab(args: list[str]):
    """`flyserve <args>` with the lab's commands registered."""
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, args)


def _calibrate_args(tmp_path, *extra: str) -> list[str]:
    """`calibrate` on the quick grid, writing p.yaml and c.json under tmp_path."""
    out = ["--out-profile", str(tmp_path / "p.yaml"), "--out-costs", str(tmp_path / "c.json")]
    return ["calibrate", *out, "--grid", "quick", *extra]


def test_grids_and_bad_grid():
    assert len(load_grid("default")) == 20 + 24 + len(GRIDS["default"]["mixed"])
    res = _lab(["calibrate", "--out-profile", "x.yaml", "--out-costs", "x.json", "--grid", "no-such-grid"])
    assert res.exit_code == 2 and "not a known grid" in res.output


@pytest.mark.parametrize("flag", ["--num-heads", "--num-kv-heads", "--head-size", "--block-m"])
@pytest.mark.parametrize("value", ["0", "-4"])
def test_calibrate_refuses_a_size_below_1_naming_the_flag(tmp_path, flag, value):
    """0 silently meant the default (``num_heads or 32``) and -4 ran."""
    res = _lab([*_calibrate_args(tmp_path), flag, value])
    assert res.exit_code == 2 and flag in res.output, res.output
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("value", ["0", "-4"])
def test_replay_refuses_a_head_count_below_1(value):
    res = _lab(["replay", "seed-8k-c8", "--costs", "h200", "--num-heads", value])
    assert res.exit_code == 2 and "--num-heads" in res.output, res.output


@pytest.mark.parametrize("command", ["calibrate", "replay --live"])
def test_a_gpu_command_without_gpu_exits_3(tmp_path, command):
    torch = require_module("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this test is about its absence")
    args = _calibrate_args(tmp_path) if command == "calibrate" else ["replay", "--live", "-w", "seed-8k-c8"]
    res = _lab(args)
    assert res.exit_code == 3
    assert "no CUDA GPU" in res.output
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "c.json").exists()


class _FakeBench:
    """Stands in for the GPU harness: times are a deterministic function of the shape."""

    def __init__(self, monkeypatch, *, wrong: str | None = None):
        from flyserve.lab import bench, kernels

        self.timed: list[tuple[int, ...]] = []
        self.wrong = wrong
        monkeypatch.setattr(bench, "require_cuda", lambda: None)
        monkeypatch.setattr(bench, "warm_gpu", lambda seconds=1.5: None)
        monkeypatch.setattr(
            bench, "device_info", lambda: {"gpu": "FakeGPU", "torch": "t", "triton": "tr", "vllm": "v"}
        )
        monkeypatch.setattr(bench, "KVPool", lambda layout, n: layout)
        monkeypatch.setattr(bench, "sets_for", lambda pool, q, s: [(tuple(q), tuple(s))])
        monkeypatch.setattr(bench, "check_kernel", self.check)
        monkeypatch.setattr(bench, "time_kernel", self.time)
        fake = {n: types.SimpleNamespace(name=n) for n in ("triton_unified", "fa3")}
        monkeypatch.setattr(kernels, "get_kernel", lambda n: fake[n])

    def check(self, k, pool, batch):
        return {"nan": 3 if k.name == self.wrong else 0, "rel_err": 1e-3}

    def time(self, k, pool, sets):
        q, s = sets[0]
        self.timed.append(q)
        work = sum(a * (b - a / 2) for a, b in zip(q, s, strict=True)) + 1e4
        t = work * (1e-12 if k.name == "fa3" else 5e-12)
        return {"median_s": t, "min_s": t, "max_s": t, "reps": 3.0}


def _calibrate(tmp_path, *extra):
    return _lab(_calibrate_args(tmp_path, "--partial", str(tmp_path / "part.jsonl"), *extra))


def test_calibrate_end_to_end_with_a_fake_gpu_and_resume(tmp_path, monkeypatch):
    fb = _FakeBench(monkeypatch)
    res = _calibrate(tmp_path, "--block-size", "16", "--block-m", "128")
    assert res.exit_code == 0, res.output
    n = len(load_grid("quick"))
    assert len(fb.timed) == 2 * n  # both paths, every shape
    text = (tmp_path / "p.yaml").read_text()
    assert "# command: flyserve calibrate" in text and "GPU: FakeGPU; vLLM v" in text
    t = Thresholds.from_yaml_text(text)
    assert t.decode_path == "prefill" and t.block_m == 128  # the fake FA3 is 5x faster everywhere
    table = load_costs(tmp_path / "c.json")
    assert len(table.entries) == n and table.meta["gpu"] == "FakeGPU"
    # a rerun with --resume times nothing; without it, everything again
    fb.timed.clear()
    assert _calibrate(tmp_path, "--block-size", "16", "--resume").exit_code == 0
    assert fb.timed == []
    assert _calibrate(tmp_path, "--block-size", "16").exit_code == 0
    assert len(fb.timed) == 2 * n


def test_calibrate_stops_on_a_wrong_kernel(tmp_path, monkeypatch):
    _FakeBench(monkeypatch, wrong="fa3")
    res = _calibrate(tmp_path)
    assert res.exit_code == 5
    assert "fa3 gave a wrong result" in res.output
    assert not (tmp_path / "p.yaml").exists()


def test_calibrate_without_the_kernels_exits_4(tmp_path, monkeypatch):
    from flyserve.lab import bench, kernels

    monkeypatch.setattr(bench, "require_cuda", lambda: None)

    def missing(name):
        raise kernels.KernelUnavailable(f"{name}: cannot import vllm")

    monkeypatch.setattr(kernels, "get_kernel", missing)
    res = _calibrate(tmp_path)
    assert res.exit_code == 4 and "cannot import vllm" in res.output
