"""An explicit tag whose text is not its type (`!!bool maybe`, `!!int abc`, `!!float abc`) is
refused as malformed YAML, like every other bad document: PyYAML's constructors raise KeyError or
ValueError there (not YAMLError), which escaped as a traceback from `flyserve sidecar
--autopilot-bounds` and from every reader of a thresholds file."""

from __future__ import annotations

from pathlib import Path

import pytest

from flyserve.policy.safe_yaml import parse_mapping, parse_scalar
from flyserve.policy.thresholds import ThresholdsError
from flyserve.sidecar.autopilot_bounds import BoundsError, read_bounds

TAGGED = ["!!bool maybe", "!!int abc", "!!float abc", "!!int 0x", "!!float ."]


@pytest.mark.parametrize("value", TAGGED)
def test_a_bad_tagged_value_in_a_document_is_malformed_yaml(value: str) -> None:
    with pytest.raises(ThresholdsError) as e:
        parse_mapping(f"min_seq_len: {value}\n")
    assert "malformed YAML" in str(e.value) and "tag" in str(e.value)


@pytest.mark.parametrize("value", TAGGED)
def test_a_bad_tagged_command_line_value_is_refused(value: str) -> None:
    with pytest.raises(ThresholdsError):
        parse_scalar(value)


def test_a_bad_tagged_bound_is_refused_by_the_bounds_reader(tmp_path: Path) -> None:
    f = tmp_path / "bounds.yaml"
    f.write_text("prefill_enabled: {min: !!bool maybe, max: true}\n")
    with pytest.raises(BoundsError):
        read_bounds(f)


def test_good_tags_still_read() -> None:
    assert parse_mapping("a: !!int 7\nb: !!bool true\nc: !!float 0.5\n") == {"a": 7, "b": True, "c": 0.5}
