"""The autopilot's anytime-valid paired test (flyserve/autopilot/sequential.py) and its trials command.

Fast: every trial here is a bounded, seeded run of the real decision code on synthetic blocks
(flyserve/autopilot/trials.py). The full table (>= 1000 A/A trials) is docs/autopilot.md's.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.autopilot import sequential
from flyserve.autopilot.sequential import (
    REASON_ABORT,
    REASON_BETTER,
    REASON_BUDGET,
    REASON_NOT_BETTER,
    REASON_WORSE,
    SequentialConfig,
    SequentialConfigError,
    SequentialState,
    Verdict,
    decide,
    run_pairs,
    t_mixture_halfwidth,
)
from flyserve.autopilot.trials import SyntheticBlocks, run_scenario, run_trial, scenario_rng


def _log_mixture(xs: list[float], m: float, alpha_unused: float, mixture_sd: float) -> float:
    """log M_n(m) of Lai's t-mixture, straight from its definition over the raw observations."""
    n = len(xs)
    c = 1.0 / mixture_sd**2
    s = sum(x - m for x in xs)
    v = sum((x - m) ** 2 for x in xs)
    return 0.5 * math.log(c / (n + c)) - (n / 2) * math.log(1 - s * s / ((n + c) * v))


@pytest.mark.parametrize("mixture_sd", [0.1, 1.0])
def test_the_closed_form_bounds_are_where_the_mixture_crosses_one_over_alpha(mixture_sd):
    xs = [0.03, -0.11, 0.2, 0.05, -0.02, 0.14, -0.07, 0.01, 0.09, -0.04] * 3
    alpha = 0.05
    config = SequentialConfig(mixture_sd=mixture_sd)
    state = SequentialState()
    for x in xs:
        state = state.update(config, 1.0, math.exp(x))
    lo, hi = state.bounds(alpha, mixture_sd)
    assert math.isfinite(lo) and lo < state.mean < hi
    for bound in (lo, hi):
        assert _log_mixture(xs, bound, alpha, mixture_sd) == pytest.approx(math.log(1 / alpha), abs=1e-9)
    w = hi - state.mean
    assert _log_mixture(xs, state.mean + 0.99 * w, alpha, mixture_sd) < math.log(1 / alpha)  # inside
    assert _log_mixture(xs, state.mean + 1.01 * w, alpha, mixture_sd) > math.log(1 / alpha)  # excluded


def test_too_few_pairs_give_an_open_sequence():
    assert t_mixture_halfwidth(1, 1.0, 0.05, 0.1) == math.inf
    assert t_mixture_halfwidth(3, 1.0, 0.05, 1.0) == math.inf  # needs ~5 pairs at 95% even when wide
    assert math.isfinite(t_mixture_halfwidth(8, 1.0, 0.05, 1.0))


def test_the_statistic_is_the_log_ratio_so_swapping_the_arms_flips_its_sign():
    """(2, 1) then (1, 2): the log ratios cancel (mean 0), where the relative differences
    (cand - cur) / cur = -0.5 and +1 would average +0.25 - the bias that makes A/A look slower."""
    config = SequentialConfig()
    s = SequentialState().update(config, 2.0, 1.0).update(config, 1.0, 2.0)
    assert s.mean == pytest.approx(0.0, abs=1e-15)
    assert s.m2 == pytest.approx(2 * math.log(2) ** 2)


def test_the_state_is_frozen_and_of_fixed_size():
    config = SequentialConfig(cuped=True)
    s = SequentialState()
    for i in range(100):
        s = s.update(config, 1.0 + 0.01 * (i % 7), 1.0, 0.001 * (i % 5))
    assert all(isinstance(getattr(s, f.name), int | float) for f in dataclasses.fields(s))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.pairs = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_pairs = 5  # type: ignore[misc]


def test_the_core_is_pure_python():
    """What the sidecar will run per block: the standard library's math only, no numpy, no flyserve."""
    tree = ast.parse(Path(sequential.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "math", "dataclasses", "enum", "functools"}


@pytest.mark.slow  # 1.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_aa_false_promotion_stays_within_the_bound_when_looked_at_after_every_pair():
    """A/A (both arms the same), GPU-like noise, a decision after every pair. min_effect 0 puts the
    test at its edge: nothing but the confidence sequence stands between noise and a promotion.
    The guarantee is <= 5%; 300 trials at a true 5% would give >= 29 promotions with probability
    0.0006 (binomial tail), so more than 28 fails the bound beyond sampling error. (The run finds
    fewer: the bound is on the union of both sides and all times.)"""
    config = SequentialConfig(min_effect=0.0, max_pairs=200)
    r = run_scenario(config, SyntheticBlocks(effect=0.0, cv=0.10), trials=300, seed=11)
    assert r.promote <= 28
    # the default minimum effect keeps a faster-looking A/A from promoting at all here
    r = run_scenario(SequentialConfig(max_pairs=200), SyntheticBlocks(0.0), trials=100, seed=12)
    assert r.promote == 0


def test_a_planted_20_percent_improvement_promotes():
    config = SequentialConfig()
    r = run_scenario(config, SyntheticBlocks(effect=0.20, cv=0.10), trials=20, seed=1)
    assert r.promote == 20
    assert max(r.pairs) < 100
    o = run_trial(config, SyntheticBlocks(0.20), scenario_rng(1, 0.20, 0))
    assert o.reason == REASON_BETTER and o.estimate == pytest.approx(-0.20, abs=0.05)


def test_a_10_percent_worse_candidate_rolls_back():
    config = SequentialConfig()
    r = run_scenario(config, SyntheticBlocks(effect=-0.10, cv=0.10), trials=20, seed=2)
    assert r.rollback == 20 and r.promote == 0
    assert max(r.pairs) < 150
    o = run_trial(config, SyntheticBlocks(-0.10), scenario_rng(2, -0.10, 0))
    assert o.verdict is Verdict.ROLLBACK and o.estimate == pytest.approx(0.10, abs=0.05)
    # the sequence's lower bound crossed log(1 - min_effect) first: "worse" needs it above 0
    assert o.reason in (REASON_NOT_BETTER, REASON_WORSE, REASON_ABORT)


def test_a_far_worse_candidate_aborts_within_a_few_pairs():
    config = SequentialConfig()
    r = run_scenario(config, SyntheticBlocks(effect=-1.0, cv=0.10), trials=20, seed=3)  # twice as slow
    assert r.abort == 20
    assert max(r.pairs) <= 8


def test_the_budget_ends_in_inconclusive():
    config = SequentialConfig(max_pairs=40)
    o = run_trial(config, SyntheticBlocks(effect=0.0), scenario_rng(4, 0.0, 0))
    assert (o.verdict, o.reason, o.pairs) == (Verdict.INCONCLUSIVE, REASON_BUDGET, 40)


def test_the_futility_rollback_says_not_better_than_the_minimum():
    """Identical noiseless-ish arms: the sequence closes around 0, above log(1 - min_effect)."""
    config = SequentialConfig(min_effect=0.05)
    pairs = [(1.0, 1.0 + (0.001 if i % 2 else -0.001)) for i in range(200)]
    d, _ = run_pairs(config, pairs)
    assert (d.verdict, d.reason) == (Verdict.ROLLBACK, REASON_NOT_BETTER)


def test_a_decision_is_a_function_of_the_pairs_alone():
    config = SequentialConfig()
    pairs = list(SyntheticBlocks(0.05).pairs(scenario_rng(5, 0.05, 0), 500))
    assert run_pairs(config, pairs) == run_pairs(config, pairs)
    d, state = run_pairs(config, pairs)
    assert d == decide(config, state) and d.pairs == state.pairs


def test_cuped_cuts_the_pairs_when_the_covariate_explains_the_noise():
    """Shape explains 80% of a block's variance: the adjusted test decides in far fewer pairs, still
    promoting the better candidate; the slope is estimated on the first pairs, then frozen."""
    blocks = SyntheticBlocks(effect=0.05, cv=0.10, shape_r2=0.8)
    plain = run_scenario(SequentialConfig(), blocks, trials=10, seed=6)
    cuped = run_scenario(SequentialConfig(cuped=True), blocks, trials=10, seed=6)
    assert cuped.promote == plain.promote == 10
    assert sum(cuped.pairs) < 0.7 * sum(plain.pairs)

    config = SequentialConfig(cuped=True, cuped_pairs=20)
    s = SequentialState()
    slopes = []
    for cur, cand, z in blocks.pairs(scenario_rng(6, 0.05, 0), 60):
        s = s.update(config, cur, cand, z)
        slopes.append(s.slope)
    assert slopes[19] == slopes[-1] != 0 and s.adj_pairs == 40
    assert slopes[19] == pytest.approx(1.0, abs=0.3)  # log time moves one for one with the shape


def test_cuped_needs_a_covariate_on_every_pair():
    with pytest.raises(ValueError, match="covariate"):
        SequentialState().update(SequentialConfig(cuped=True), 1.0, 1.0)
    with pytest.raises(ValueError, match="covariate"):
        SequentialState().update(SequentialConfig(cuped=True), 1.0, 1.0, math.nan)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SequentialConfig(max_pairs=0), "max_pairs"),
        (lambda: SequentialConfig(max_pairs=True), "max_pairs"),
        (lambda: SequentialConfig(confidence=1.0), "confidence"),
        (lambda: SequentialConfig(min_effect=math.nan), "min_effect"),
        (lambda: SequentialConfig(mixture_sd=0.0), "mixture_sd"),
        (lambda: SequentialConfig(abort_margin=-0.1), "abort_margin"),
        (lambda: SyntheticBlocks(effect=math.nan), "effect"),
        (lambda: SyntheticBlocks(effect=0.0, cv=-0.1), "cv"),
        (lambda: SyntheticBlocks(effect=0.0, shape_r2=1.0), "shape_r2"),
        (lambda: SyntheticBlocks(effect=0.0, noise="pink"), "noise"),
    ],
)
def test_bad_config_is_refused_by_field_name(make, field):
    with pytest.raises(SequentialConfigError) as e:
        make()
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize(("cur", "cand", "name"), [(0.0, 1.0, "current"), (1.0, math.nan, "candidate")])
def test_a_bad_measurement_is_refused_by_name(cur, cand, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        SequentialState().update(SequentialConfig(), cur, cand)


def test_the_trials_command_prints_json_with_the_rates():
    from flyserve.cli import app

    r = CliRunner().invoke(
        app,
        [
            "autopilot",
            "trials",
            "--trials",
            "8",
            "--max-pairs",
            "60",
            "--effect",
            "0.2",
            "--json",
            "--seed",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["config"]["max_pairs"] == 60 and doc["seed"] == 3
    assert "--effect 0.2" in doc["command"]
    aa, better = doc["scenarios"]
    assert (aa["role"], aa["effect"], better["effect"]) == ("A/A", 0.0, 0.2)
    for row in (aa, better):
        assert row["trials"] == 8
        assert row["promote"] + row["rollback"] + row["inconclusive"] == pytest.approx(1.0)
        for key in ("pairs_median", "pairs_p90", "promote_ci95"):
            assert key in row
    assert aa["false_promotion"] == 0.0 and aa["power"] is None
    assert better["power"] == 1.0 and better["false_rollback"] == 0.0
    assert [t["met"] for t in doc["targets"]] == [None]  # 8 A/A trials prove nothing


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_the_trials_command_refuses_bad_input_by_flag():
    from flyserve.cli import app

    for args, flag in (
        (["--cv", "-0.1"], "--cv"),
        (["--effect", "nan"], "--effect"),
        (["--max-pairs", "0"], "--max-pairs"),
    ):
        r = CliRunner().invoke(app, ["autopilot", "trials", "--trials", "2", *args])
        assert r.exit_code == 2
        assert f"error: {flag}: " in r.stderr


def test_the_table_never_rounds_a_rate_to_0_or_100():
    """1999 rollbacks in 2000 trials is not 100%: the table says >99.9%, and 1 in 2000 says <0.1%."""
    from flyserve.autopilot.cli import _num

    assert [_num(v) for v in (0.0, 0.0004, 0.001, 0.904, 0.9995, 1.0)] == [
        "0",
        "<0.1",
        "0.1",
        "90.4",
        ">99.9",
        "100",
    ]
