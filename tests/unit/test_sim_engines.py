"""flyserve simulate's engines, restarts and rank cap, without starting processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.sim.args import MAX_RANKS, SimulateArgs, validate
from flyserve.sim.rank import rank_command
from flyserve.sim.simulate import ENGINE_STAGGER_S, rank_slots


def _args(**kw) -> SimulateArgs:  # type: ignore[no-untyped-def]
    base = {"state_dir": Path("/nonexistent"), "ranks": 8, "workload": "seed-8k-c8", "steps": 10}
    return SimulateArgs(**{**base, **kw})


def test_engines_number_ranks_as_vllm_workers_are_numbered_and_step_on_their_own():
    slots = rank_slots(_args(engines=8, ranks=8), start_at=100.0)
    assert len(slots) == 64
    assert [s.rank for s in slots] == list(range(64))  # engine * ranks + tp rank: unique across engines
    assert {s.engine for s in slots if 8 <= s.rank < 16} == {1}
    starts = sorted({s.start_at for s in slots})
    assert len(starts) == 8 and starts[1] - starts[0] == pytest.approx(ENGINE_STAGGER_S)  # own schedules
    cmd = rank_command(_args(engines=8, ranks=8), 13, 101.0, engine=1, join=True)
    assert cmd[cmd.index("--engine") + 1] == "1" and "--join" in cmd and cmd[cmd.index("--rank") + 1] == "13"


def test_256_ranks_are_allowed_and_one_more_is_refused_naming_both_options():
    validate(_args(engines=32, ranks=8))  # 256
    with pytest.raises(ValueError, match=r"--engines 33 x --ranks 8 = 264 rank processes; at most 256"):
        validate(_args(engines=33, ranks=8))
    assert MAX_RANKS == 256


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        ({"engines": 0}, "--engines"),
        ({"restart_every_s": -1.0}, "--restart-every"),
        ({"max_restarts": -1}, "--max-restarts"),
    ],
)
def test_bad_engine_and_restart_options_are_refused(kw, option):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=option):
        validate(_args(**kw))


def test_the_cli_refuses_300_ranks_before_starting_anything(tmp_path: Path):
    from flyserve.cli import app

    r = CliRunner().invoke(
        app, ["simulate", "--state-dir", str(tmp_path / "s"), "--engines", "10", "--ranks", "30"]
    )
    assert r.exit_code == 2
    assert "at most 256" in r.output
    assert not (tmp_path / "s" / "metrics").exists()  # refused before the state directory was prepared
