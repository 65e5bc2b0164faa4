"""`flyserve sidecar` / `flyserve simulate`: bad flags and files fail early, naming what is wrong."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from flyserve.cli import app

runner = CliRunner()


def test_sidecar_refuses_unreadable_or_short_token(tmp_path: Path):
    r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path), "--token-file", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "--token-file" in r.output and "cannot read" in r.output
    short = tmp_path / "tok"
    short.write_text("abc\n")
    r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path), "--token-file", str(short)])
    assert r.exit_code == 2 and "at least 16" in r.output


def test_sidecar_refuses_a_file_as_state_dir(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["sidecar", "--state-dir", str(f)], env={"FLYSERVE_SIDECAR_TOKEN": "x" * 20})
    assert r.exit_code == 2 and "not a directory" in r.output


def test_sidecar_has_no_token_flag():
    r = runner.invoke(app, ["sidecar", "--help"])
    assert r.exit_code == 0 and "--token-file" in r.output and "--token " not in r.output


def test_simulate_validates_before_starting_anything(tmp_path: Path):
    r = runner.invoke(
        app, ["simulate", "--state-dir", str(tmp_path), "--workload", "seed-9k-c1", "--steps", "5"]
    )
    assert r.exit_code == 2 and "--workload" in r.output and "seed-8k-c8" in r.output
    r = runner.invoke(app, ["simulate", "--state-dir", str(tmp_path), "--profile", "nope", "--steps", "5"])
    assert r.exit_code == 2 and "--profile" in r.output
    r = runner.invoke(app, ["simulate", "--state-dir", str(tmp_path), "--ranks", "0"])
    assert r.exit_code == 2
    assert not (tmp_path / "ranks").exists()  # nothing was started


def test_simulate_one_rank_runs_the_real_path(tmp_path: Path):
    """One rank, a few steps, no sleeping: counters, report and shape sample appear; exit 0."""
    from flyserve.sidecar.stats import read_counters
    from flyserve.telemetry.shape_sample import read_shape_samples

    r = runner.invoke(
        app,
        ["simulate", "--state-dir", str(tmp_path), "--ranks", "1", "--steps", "40", "--step-interval", "0"],
    )
    assert r.exit_code == 0, r.output
    assert "simulate: done" in r.output
    c = read_counters(tmp_path / "metrics")
    assert sum(c[0].decisions.values()) == 40
    assert (tmp_path / "ranks" / "0.json").is_file()
    assert [s.step for s in read_shape_samples(tmp_path, limit=5)] == [39, 38, 37, 36, 35]
