"""A switch (prefill_enabled) can be opened to the autopilot: the bounds file takes true/false ends,
the trigger lets a trial move the switch only inside them, and integer knobs keep refusing booleans.

Advice proposes ``prefill_enabled: false`` where the prefill path measures slower everywhere (the
CPU demo's advice does); without a switch bound that advice could never be trialled."""

from __future__ import annotations

from pathlib import Path

import pytest
from autopilot_rig import config, observation

from flyserve.autopilot import trigger
from flyserve.autopilot.actions import TrialSpec
from flyserve.autopilot.inputs import InputError, KnobBound
from flyserve.sidecar.autopilot_bounds import BoundsError, read_bounds


def test_a_switch_bound_reads_true_false_ends(tmp_path: Path) -> None:
    f = tmp_path / "bounds.yaml"
    f.write_text("prefill_enabled: {min: false, max: true}\nmin_seq_len: {min: 0, max: 9}\n")
    assert dict(read_bounds(f)) == {
        "prefill_enabled": KnobBound(0, 1, boolean=True),
        "min_seq_len": KnobBound(0, 9),
    }
    f.write_text("prefill_enabled: {min: false, max: false}\n")
    assert dict(read_bounds(f)) == {"prefill_enabled": KnobBound(0, 0, boolean=True)}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("prefill_enabled: {min: 0, max: 1}\n", "prefill_enabled.min"),
        ("prefill_enabled: {min: false, max: 1}\n", "prefill_enabled.max"),
        ("prefill_enabled: {min: true, max: false}\n", "prefill_enabled.max"),
        ("prefill_enabled: {min: false}\n", "prefill_enabled.max"),
        ("prefill_enabled: {min: 'false', max: true}\n", "prefill_enabled.min"),
        ("min_seq_len: {min: false, max: true}\n", "min_seq_len.min"),
    ],
)
def test_a_bad_switch_bound_is_refused_by_name(tmp_path: Path, text: str, field: str) -> None:
    f = tmp_path / "bounds.yaml"
    f.write_text(text)
    with pytest.raises(BoundsError) as got:
        read_bounds(f)
    assert got.value.field == field


def test_a_switch_holds_only_booleans_inside_its_ends() -> None:
    either, off_only = KnobBound(0, 1, boolean=True), KnobBound(0, 0, boolean=True)
    assert either.holds(False) and either.holds(True)
    assert off_only.holds(False) and not off_only.holds(True)
    assert not either.holds(0) and not either.holds(1)  # an integer is not a switch's value
    assert not KnobBound(0, 1).holds(True)  # nor a boolean an integer knob's
    with pytest.raises(InputError):
        KnobBound(0, 2, boolean=True)
    with pytest.raises(InputError):
        KnobBound(0, 1, boolean=1)  # type: ignore[arg-type]


def test_the_trigger_trials_a_switch_only_inside_its_bound() -> None:
    advice = {"prefill_enabled": False}
    opened = {"prefill_enabled": KnobBound(0, 1, boolean=True)}
    got = trigger.check(
        config(),
        observation(0.0, advice_changes=advice, knob_bounds=opened),
        busy=None,
        cooldown_until=0.0,
        number=1,
    )
    assert isinstance(got, TrialSpec)
    assert got.candidate.prefill_enabled is False
    on_only = {"prefill_enabled": KnobBound(1, 1, boolean=True)}
    got = trigger.check(
        config(),
        observation(0.0, advice_changes=advice, knob_bounds=on_only),
        busy=None,
        cooldown_until=0.0,
        number=1,
    )
    assert got == trigger.Refusal(trigger.OUT_OF_BOUNDS, "prefill_enabled")
