"""--autopilot-step-time-limit sets the step-time guardrail's ratio (AutopilotConfig.p99_ratio_limit):
where host stalls are common (two cores shared by vLLM and the sidecar's advice fits: one block of
64 steps measured 4.7x its neighbour's step time) an operator raises it; out of range is refused by name."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner


@pytest.mark.parametrize("bad", ["0.5", "nan", "inf", "101"])
def test_the_flag_out_of_range_is_refused_by_name(tmp_path, bad):
    from flyserve.cli import app

    r = CliRunner().invoke(
        app, ["sidecar", "--state-dir", str(tmp_path / "s"), "--autopilot-step-time-limit", bad]
    )
    assert r.exit_code == 2 and "--autopilot-step-time-limit" in r.output, r.output
    assert not (tmp_path / "s").exists()  # refused before anything was created


def test_the_setting_reaches_the_guardrail(tmp_path):
    from flyserve.sidecar.settings import SidecarSettings

    assert SidecarSettings(state_dir=tmp_path).autopilot_config().p99_ratio_limit == 1.5
    settings = SidecarSettings(state_dir=tmp_path, autopilot_step_time_limit=8.0)
    assert settings.autopilot_config().p99_ratio_limit == 8.0
    for bad in (0.9, 101.0, math.nan):
        with pytest.raises(ValueError, match="autopilot_step_time_limit"):
            SidecarSettings(state_dir=tmp_path, autopilot_step_time_limit=bad)
