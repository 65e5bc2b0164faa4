"""flyserve simulate --truth-costs and --noise-cv: the measured kernel times (flyserve_kernel_seconds)
come from a truth table plus lognormal noise, which may disagree with the table the samples and the
sidecar price with; bad input is refused at start, naming the flag."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from flyserve.cli import app
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.sim.args import SimulateArgs, validate
from flyserve.sim.kernel_times import (
    KernelTimes,
    MeasurementNoise,
    load_pricing,
    load_truth,
    lognormal_params,
    truth_mismatch,
)
from flyserve.sim.rank import parse_rank_argv, rank_command, rank_kernel_times

PREFILL_BATCH = (np.array([4096, 1, 1]), np.array([8192, 16384, 16384]))  # a chunk beside two decode rows
DECODE_BATCH = (np.array([1] * 32), np.array([32768] * 32))


def _args(**kw: Any) -> SimulateArgs:
    base: dict[str, Any] = {
        "state_dir": Path("/nonexistent"),
        "ranks": 1,
        "workload": "seed-8k-c8",
        "steps": 10,
        "profile": "h200",
        "num_heads": 32,
        "costs": "h200",
        "kernel_timer_every": 1,
    }
    return SimulateArgs(**{**base, **kw})


def _h200_doc() -> dict[str, Any]:
    return json.loads(load_costs("h200").to_json())


def _write(tmp_path: Path, name: str, doc: dict[str, Any]) -> str:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.fixture
def prefill_slower(tmp_path: Path) -> str:
    """The h200 table with every prefill-path time 10% slower: the truth the pricing table misses."""
    doc = _h200_doc()
    for e in doc["entries"]:
        e["ms"]["prefill"] *= 1.1
    return _write(tmp_path, "h200-prefill-slower", doc)


def test_the_measured_time_is_the_truth_tables_price_not_the_pricing_tables(prefill_slower: str):
    args = _args(truth_costs=prefill_slower)
    validate(args)  # a truth table that re-times the pricing table's shapes is accepted at start
    kernel = rank_kernel_times(args, rank=0)
    assert kernel is not None and kernel.truth is not None and kernel.noise is None
    q, s = PREFILL_BATCH
    priced = kernel.pricing.predict(q, s, "prefill")
    modelled = kernel.modelled(q, s, "prefill")
    assert modelled == priced  # the samples (and the sidecar) price with --costs
    measured = kernel.measured(q, s, "prefill", modelled)
    assert measured == pytest.approx(1.1 * priced, rel=1e-9)  # the timer sees the truth
    assert measured != pytest.approx(priced, rel=0.05)
    q, s = DECODE_BATCH  # the path the truth table did not slow measures what was priced
    modelled = kernel.modelled(q, s, "unified")
    assert kernel.measured(q, s, "unified", modelled) == pytest.approx(modelled, rel=1e-12)


def test_drift_multiplies_the_truth_as_it_multiplies_the_model(prefill_slower: str):
    kernel = rank_kernel_times(_args(truth_costs=prefill_slower, drift=(("prefill", 1.5),)), rank=0)
    assert kernel is not None
    q, s = PREFILL_BATCH
    priced = kernel.pricing.predict(q, s, "prefill")
    modelled = kernel.modelled(q, s, "prefill")
    assert modelled == pytest.approx(1.5 * priced, rel=1e-12)
    assert kernel.measured(q, s, "prefill", modelled) == pytest.approx(1.5 * 1.1 * priced, rel=1e-9)


def test_without_truth_or_noise_the_measured_time_is_the_modelled_one_exactly():
    args = _args(noise_cv=0.0)
    kernel = rank_kernel_times(args, rank=3)
    assert kernel is not None and kernel.truth is None and kernel.noise is None
    for path in ("prefill", "unified"):
        q, s = PREFILL_BATCH
        modelled = kernel.modelled(q, s, path)
        assert kernel.measured(q, s, path, modelled) == modelled == kernel.pricing.predict(q, s, path)
    cmd = rank_command(args, 0, 1.0)
    assert "--noise-cv" not in cmd and "--noise-seed" not in cmd and "--truth-costs" not in cmd


@pytest.mark.parametrize("cv", [0.05, 0.1, 0.3])
def test_the_noise_has_mean_one_and_the_asked_coefficient_of_variation(cv: float):
    mu, sigma = lognormal_params(cv)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(1.0, rel=1e-12)
    noise = MeasurementNoise(cv, seed=20240, stream=0)
    n = 20000
    x = np.array([noise.factor() for _ in range(n)])
    # Standard errors at n = 20000: mean cv / sqrt(n) (0.0007 at CV 0.1); sample sd about
    # cv * sqrt((kurtosis - 1) / 4n) relative (under 1.5% at CV 0.3). Bounds are 4-5 of them.
    assert x.mean() == pytest.approx(1.0, abs=5 * cv / math.sqrt(n))
    assert x.std(ddof=1) / x.mean() == pytest.approx(cv, rel=0.06)
    assert (x > 0).all()


def test_the_noise_multiplies_each_measured_time():
    pricing = rank_kernel_times(_args(), rank=0)
    assert pricing is not None
    kernel = KernelTimes(pricing.pricing, noise=MeasurementNoise(0.1, seed=5))
    twin = MeasurementNoise(0.1, seed=5)
    q, s = PREFILL_BATCH
    modelled = kernel.modelled(q, s, "prefill")
    for _ in range(20):
        assert kernel.measured(q, s, "prefill", modelled) == pytest.approx(
            modelled * twin.factor(), rel=1e-12
        )


def test_the_same_seed_gives_the_same_sequence_and_ranks_draw_their_own():
    def seq(seed: int, rank: int) -> list[float]:
        kernel = rank_kernel_times(_args(noise_cv=0.2, noise_seed=seed), rank=rank)
        assert kernel is not None and kernel.noise is not None
        return [kernel.noise.factor() for _ in range(50)]

    assert seq(7, 0) == seq(7, 0)
    assert seq(7, 0) != seq(8, 0)
    assert seq(7, 0) != seq(7, 1)  # every rank its own stream, reproducible from (seed, rank)


def test_the_rank_command_carries_the_measurement_options(prefill_slower: str):
    args = _args(truth_costs=prefill_slower, noise_cv=0.25, noise_seed=11)
    cmd = rank_command(args, 2, 5.0)
    parsed = parse_rank_argv(cmd[3:])  # after the interpreter, -m and the module
    assert parsed.rank == 2 and parsed.start_at == 5.0
    got = parsed.args
    assert (got.costs, got.truth_costs, got.noise_cv, got.noise_seed) == ("h200", prefill_slower, 0.25, 11)


@pytest.mark.parametrize("cv", [-0.1, 1.01, math.nan, math.inf, -math.inf])
def test_a_bad_noise_cv_is_refused_naming_the_flag(cv: float):
    with pytest.raises(ValueError, match=r"--noise-cv must be a finite number from 0 to 1"):
        validate(_args(noise_cv=cv))


def test_noise_and_truth_need_costs_and_a_kernel_timer(prefill_slower: str):
    with pytest.raises(ValueError, match="--noise-cv needs --costs"):
        validate(_args(costs=None, kernel_timer_every=0, num_heads=16, noise_cv=0.1))
    with pytest.raises(ValueError, match="--truth-costs needs --costs"):
        validate(_args(costs=None, kernel_timer_every=0, num_heads=16, truth_costs=prefill_slower))
    with pytest.raises(ValueError, match="--noise-cv needs --kernel-timer-every"):
        validate(_args(kernel_timer_every=0, noise_cv=0.1))
    with pytest.raises(ValueError, match="--truth-costs needs --kernel-timer-every"):
        validate(_args(kernel_timer_every=0, truth_costs=prefill_slower))
    with pytest.raises(ValueError, match="--noise-seed must be an integer from 0"):
        validate(_args(noise_cv=0.1, noise_seed=-1))
    validate(_args(kernel_timer_every=0, noise_cv=0.0))  # no noise asked: nothing needed


@pytest.fixture(scope="module")
def h200_pricing() -> CostModel:
    return load_pricing("h200")


def test_a_truth_table_that_prices_another_layer_or_shape_is_refused_at_start(
    tmp_path: Path, h200_pricing: CostModel
):
    doc = _h200_doc()
    doc["meta"]["head_size"] = 64
    with pytest.raises(
        ValueError, match=r"--truth-costs: .*'meta\.head_size' differs from cost table 'h200'"
    ):
        validate(_args(truth_costs=_write(tmp_path, "other-layer", doc)))  # validate: before any rank
    doc = _h200_doc()
    extra = next(e for e in doc["entries"] if e["kind"] == "prefill")
    doc["entries"].append({**extra, "seq_lens": [extra["seq_lens"][0] + 1]})  # a shape h200 lacks
    n = len(doc["entries"]) - 1
    with pytest.raises(
        ValueError, match=rf"--truth-costs: .*entries\[{n}\] is a shape .* 'h200' does not have"
    ):
        load_truth(h200_pricing, _write(tmp_path, "other-shape", doc))
    doc = _h200_doc()
    doc["entries"] = [e for e in doc["entries"] if e.get("block_size", 16) != 16]  # only block size 128
    with pytest.raises(ValueError, match=r"--truth-costs: .*no entries for block size 16"):
        load_truth(h200_pricing, _write(tmp_path, "other-blocks", doc))
    doc = _h200_doc()
    doc["entries"][0]["ms"]["flash"] = 1.0  # a path the pricing table (and flyserve) does not name
    with pytest.raises(ValueError, match=r"--truth-costs: .*entries\[0\]: field 'ms' must map each of"):
        load_truth(h200_pricing, _write(tmp_path, "other-path", doc))


def test_a_subset_of_the_pricing_tables_shapes_is_a_truth_table():
    table = load_costs("h200")
    assert truth_mismatch(table, table) is None


def test_a_truth_file_that_is_missing_a_fifo_or_huge_is_refused_by_name(tmp_path: Path):
    with pytest.raises(ValueError, match=r"--truth-costs: missing\.json: no such file"):
        validate(_args(truth_costs=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match=r"--truth-costs: unknown cost table 'nope'"):
        validate(_args(truth_costs="nope"))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--truth-costs: fifo\.json: not a regular file"):
        validate(_args(truth_costs=str(fifo)))
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: refused by its size, never read
    with pytest.raises(ValueError, match=r"--truth-costs: huge\.json: larger than 16777216 bytes"):
        validate(_args(truth_costs=str(huge)))


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_the_command_refuses_bad_values_before_starting_anything(tmp_path: Path):
    runner = CliRunner()
    base = ["simulate", "--state-dir", str(tmp_path), "--profile", "h200", "--costs", "h200", "--steps", "5"]
    r = runner.invoke(app, [*base, "--kernel-timer-every", "1", "--noise-cv", "nan"])
    assert r.exit_code == 2 and "--noise-cv" in r.output, r.output  # typer's range check names it
    r = runner.invoke(app, [*base, "--kernel-timer-every", "1", "--truth-costs", str(tmp_path / "no.json")])
    assert r.exit_code == 2 and "--truth-costs: no.json: no such file" in r.output, r.output
    assert not (tmp_path / "metrics").exists()  # validated before the state directory was laid out
