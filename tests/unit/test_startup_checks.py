"""Start-up checks: a bad profile stops a process first, with one ERROR line naming it."""

from __future__ import annotations

import pytest

from flyserve.startup.checks import StartupError, check_profile, profile_problem


def test_profile_problem_names_the_profile_and_the_ones_available():
    assert profile_problem("gfx950") is None
    msg = profile_problem("gfx955")
    assert msg is not None and "'gfx955'" in msg and "cpu-tiny, gfx950, h200" in msg


def test_check_profile_logs_one_error_line_and_raises(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(StartupError, match="--profile: unknown profile 'nope'"):
        check_profile("nope", setting="--profile")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ERROR flyserve.startup: --profile: unknown profile 'nope'")


@pytest.mark.slow  # flyserve.vllm.plugin imports vLLM, which runs `uname -p` (its platform probe)
def test_vllm_plugin_exits_on_a_bad_profile_before_registering_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """vLLM calls register() while it builds its argument parser; a bad FLYSERVE_PROFILE must end the
    process there (it was found at line 56 of a 275-line log)."""
    from flyserve.vllm import plugin

    registered: list[bool] = []
    from flyserve.vllm import backends

    monkeypatch.setattr(backends, "register_for_current_platform", lambda: registered.append(True))
    monkeypatch.setenv("FLYSERVE_ATTENTION", "1")
    monkeypatch.setenv("FLYSERVE_PROFILE", "mi355")
    with pytest.raises(SystemExit) as exc:
        plugin.register()
    assert exc.value.code == 2 and registered == []
    err = capsys.readouterr().err
    assert "ERROR" in err and "FLYSERVE_PROFILE: unknown profile 'mi355'" in err and "gfx950" in err
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    plugin.register()
    assert registered == [True]


def test_disabled_plugin_does_not_look_at_the_profile(monkeypatch: pytest.MonkeyPatch):
    from flyserve.vllm import plugin

    monkeypatch.delenv("FLYSERVE_ATTENTION", raising=False)
    monkeypatch.setenv("FLYSERVE_PROFILE", "mi355")
    plugin.register()  # no exit: flyserve is installed but off
