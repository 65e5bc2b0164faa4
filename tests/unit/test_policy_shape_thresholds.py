"""BatchShape constructors and Thresholds validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydantic
import pytest

from flyserve.policy import BatchShape, Thresholds, ThresholdsError
from flyserve.policy import shape as shape_mod
from flyserve.thresholds_files import available_profiles, load_profile


def test_defaults_used_without_thresholds_match_the_model():
    t = Thresholds()
    assert shape_mod._DEFAULT_BLOCK_M == t.block_m
    assert shape_mod._DEFAULT_DECODE_QUERY_LEN_MAX == t.decode_query_len_max


def test_from_query_start_loc_counts():
    qsl = np.array([0, 1, 2, 3, 259, 4355], dtype=np.int32)  # three decode rows, 256, 4096
    s = BatchShape.from_query_start_loc(qsl, max_seq_len=8192, num_heads=16)
    assert (s.num_reqs, s.num_actual_tokens, s.max_query_len) == (5, 4355, 4096)
    assert s.num_decode_rows == 3
    assert s.num_short_query_rows == 3  # 256 is not < block_m
    assert s.num_prefill_rows == 2
    assert s.num_q_blocks(256) == 16


def test_speculative_decode_rows_and_block_m_from_thresholds():
    t = Thresholds().merged({"decode_query_len_max": 4, "min_query_len": 5, "block_m": 128})
    s = BatchShape.from_query_lens([4, 4, 5, 200], max_seq_len=4096, num_heads=8, thresholds=t)
    assert s.num_decode_rows == 2
    assert s.num_short_query_rows == 3


def test_torch_like_input_and_empty_batch():
    class FakeTensor:
        def __init__(self, a):
            self.a = a

        def numpy(self):
            return self.a

    s = BatchShape.from_query_start_loc(FakeTensor(np.array([0, 5, 7])), max_seq_len=9, num_heads=2)
    assert (s.num_reqs, s.num_actual_tokens, s.max_query_len) == (2, 7, 5)
    e = BatchShape.from_query_start_loc(np.array([0]), max_seq_len=0, num_heads=2)
    assert (e.num_reqs, e.max_query_len) == (0, 0)


def test_shape_is_frozen():
    s = BatchShape.from_query_lens([1], max_seq_len=1, num_heads=1)
    with pytest.raises(AttributeError):
        s.num_reqs = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "data,field",
    [
        ({"block_m": 300}, "block_m"),
        ({"block_m": 0}, "block_m"),
        ({"min_qblock_rows": -1}, "min_qblock_rows"),
        ({"min_seq_len": 5000, "max_seq_len": 4000}, "min_seq_len"),
        ({"decode_ctx_unit": 0}, "decode_ctx_unit"),
        ({"bogus": 1}, "bogus"),
        ({"min_seq_len": "1536"}, "min_seq_len"),
        ({"min_seq_len": 1.5}, "min_seq_len"),
        ({"prefill_enabled": "yes"}, "prefill_enabled"),
        ({"lpt": "sometimes"}, "lpt"),
        ({"decode_path": "fast"}, "decode_path"),
        ({"min_query_len": 1}, "min_query_len"),
    ],
)
def test_validation_names_the_field(data, field):
    with pytest.raises(ThresholdsError) as exc:
        Thresholds.parse(data)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_not_a_mapping():
    with pytest.raises(ThresholdsError, match="mapping"):
        Thresholds.parse([1, 2])


@pytest.mark.parametrize(
    "text,reason",
    [
        ("", "empty"),
        ("block_m: [1,\n", "malformed YAML"),
        ("- 1\n- 2\n", "mapping"),
        ("block_m: 128\nblock_m", "malformed"),
    ],
)
def test_yaml_errors(text, reason):
    with pytest.raises(ThresholdsError, match=reason):
        Thresholds.from_yaml_text(text)


def test_profiles_load_by_name_and_path(tmp_path: Path):
    assert "gfx950" in available_profiles()
    p = tmp_path / "mine.yaml"
    p.write_text("min_seq_len: 4096\n")
    assert load_profile(p).min_seq_len == 4096
    assert load_profile(str(p)).block_m == 256
    with pytest.raises(ThresholdsError, match="unknown profile"):
        load_profile("nope")


def test_frozen_and_diff():
    t = Thresholds()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        t.block_m = 128  # type: ignore[misc]
    u = t.merged({"min_seq_len": 2048})
    assert t.diff(u) == {"min_seq_len": (1536, 2048)}
    assert t.min_seq_len == 1536
