"""flyserve.lab.workloads: the scheduler simulation and the shape-log format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flyserve.lab.workloads import (
    SEED_WORKLOADS,
    Trace,
    TraceError,
    WorkloadSpec,
    generate,
    load_trace,
    shape_log_line,
    workload,
    workload_names,
)
from flyserve.policy import BatchShape


def test_six_seed_workloads_exist():
    assert workload_names() == [
        "seed-8k-c8",
        "seed-8k-c32",
        "seed-32k-c8",
        "seed-32k-c32",
        "seed-60k-c8",
        "seed-60k-c32",
    ]


def test_hand_checked_small_trace():
    # 2 clients, prompts of 10, 3 output tokens, 2 requests, budget 8: worked out by hand
    t = generate(
        WorkloadSpec(input_len=10, output_len=3, concurrency=2, num_requests=2, max_num_batched_tokens=8)
    )
    got = [(s.query_lens.tolist(), s.seq_lens.tolist()) for s in t]
    assert got == [
        ([8], [8]),  # A's first chunk takes the whole budget; B waits
        ([2, 6], [10, 6]),  # A finishes its prompt (samples token 1), B starts
        ([1, 4], [11, 10]),  # A decodes (token 2); B finishes its prompt (token 1)
        ([1, 1], [12, 11]),  # A's token 3 -> A done; B token 2
        ([1], [12]),  # B token 3 -> done
    ]


@pytest.mark.slow  # 1.1 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("name", list(SEED_WORKLOADS))
def test_seed_workload_invariants(name):
    inp, out, conc = SEED_WORKLOADS[name]
    t = workload(name)
    assert t.name == name and len(t) > out
    # every request's prompt and output are accounted for: prompt tokens + (output - 1) decode tokens
    reqs = 2 * conc
    assert t.num_tokens == reqs * (inp + out - 1)
    assert t.max_seq_len == inp + out - 1
    for s in t:
        assert s.num_tokens <= 32768
        assert s.query_lens.size == s.seq_lens.size <= conc
        assert (s.seq_lens >= s.query_lens).all() and (s.query_lens >= 1).all()
        # decode rows first, then prefill chunks
        is_dec = (s.query_lens == 1).astype(int)
        assert (np.diff(is_dec) <= 0).all()
        BatchShape.from_query_lens(s.query_lens, max_seq_len=s.max_seq_len, num_heads=32)


@pytest.mark.slow  # 0.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_deterministic_and_seeded():
    a, b = workload("seed-8k-c8"), workload("seed-8k-c8")
    assert [s.query_lens.tolist() for s in a] == [s.query_lens.tolist() for s in b]
    r1 = workload("seed-8k-c8", range_ratio=0.2, seed=1)
    r2 = workload("seed-8k-c8", range_ratio=0.2, seed=1)
    r3 = workload("seed-8k-c8", range_ratio=0.2, seed=2)
    assert [s.seq_lens.tolist() for s in r1] == [s.seq_lens.tolist() for s in r2]
    assert [s.seq_lens.tolist() for s in r1] != [s.seq_lens.tolist() for s in r3]


def test_budget_16384_makes_more_smaller_chunks():
    big = workload("seed-32k-c8")
    small = workload("seed-32k-c8", max_num_batched_tokens=16384)
    assert max(s.num_tokens for s in small) == 16384
    assert sum(s.max_query_len > 1 for s in small) > sum(s.max_query_len > 1 for s in big)
    assert small.num_tokens == big.num_tokens


def test_bad_workload_args_name_the_field():
    with pytest.raises(TraceError, match="unknown workload"):
        workload("seed-9k")
    with pytest.raises(TraceError, match="'max_num_batched_tokens'"):
        workload("seed-8k-c8", max_num_batched_tokens=0)


def test_shape_log_round_trip(tmp_path):
    t = workload("seed-8k-c8", num_requests=3)
    p = tmp_path / "t.jsonl"
    p.write_text(t.to_jsonl())
    back = load_trace(p)
    assert isinstance(back, Trace) and back.name == "seed-8k-c8" and len(back) == len(t)
    assert back.meta["concurrency"] == 8
    for x, y in zip(t, back, strict=True):
        assert x.query_lens.tolist() == y.query_lens.tolist() and x.seq_lens.tolist() == y.seq_lens.tolist()


def test_shape_log_rank_filter(tmp_path):
    p = tmp_path / "ranks.jsonl"
    p.write_text(
        "\n".join(
            [
                shape_log_line(0, np.array([5, 1]), np.array([5, 9]), rank=0),
                shape_log_line(0, [5, 1], [5, 9], rank=1),
                shape_log_line(1, [1, 1], [6, 10], rank=0),
                "",
            ]
        )
    )
    assert len(load_trace(p)) == 3
    r0 = load_trace(p, rank=0)
    assert len(r0) == 2 and r0[1].seq_lens.tolist() == [6, 10]
    assert json.loads(shape_log_line(3, [2], [4]))["step"] == 3


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", r"bad:2: not JSON"),
        ('{"query_lens": [1], "seq_lens": [1, 2]}', "differ in length"),
        ('{"query_lens": [3], "seq_lens": [2]}', "'seq_lens'"),
        ('{"query_lens": [1.5], "seq_lens": [2]}', "'query_lens'"),
        ('{"seq_lens": [2]}', "'query_lens'"),
        ('{"format": "other"}', "'format'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_shape_logs_name_line_and_field(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"query_lens": [2], "seq_lens": [2]}\n' + line + "\n")
    with pytest.raises(TraceError, match=match):
        load_trace(p)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
