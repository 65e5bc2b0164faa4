"""`flyserve explain`'s rule-by-rule account agrees with decide() (a property over 10,000 random
shapes under random valid thresholds). explain() restates the rules as a table, independently of
decide(), so a rule edited in one and not the other fails here."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flyserve.policy import BatchShape, Thresholds, decide
from flyserve.policy import explain as ex
from flyserve.policy.vocabulary import NO_PREFILL_ROWS, SHORT_CONTEXT
from flyserve.thresholds_files import load_profile


def random_thresholds(rng: random.Random) -> Thresholds:
    """A valid Thresholds with every knob drawn (the relations decide() relies on kept)."""
    dq = rng.randint(1, 4)
    min_seq = rng.choice([0, 256, 1536, 4096, 20000])
    max_seq = rng.choice([0, 8192, 65536, 131072])
    if max_seq and min_seq > max_seq:
        min_seq = max_seq
    return Thresholds.parse(
        {
            "block_m": rng.choice([64, 128, 256]),
            "min_qblock_rows": rng.choice([0, 1, 8, 48, 200]),
            "min_seq_len": min_seq,
            "max_seq_len": max_seq,
            "min_query_len": dq + rng.randint(1, 3),
            "decode_query_len_max": dq,
            "decode_rows_base": rng.choice([0, 1, 8, 64]),
            "decode_ctx_unit": rng.choice([1024, 8192, 32768]),
            "lpt_qblocks_always": rng.randint(0, 100),
            "lpt_qblocks_one_short": rng.randint(0, 60),
            "lpt_min_short_rows": rng.randint(0, 10),
            "lpt_qblocks_many_short_max": rng.randint(0, 40),
            "lpt": rng.choice(["auto", "auto", "always", "never"]),
            "prefill_enabled": rng.random() < 0.8,
            "decode_path": rng.choice(["unified", "prefill"]),
        }
    )


# Thresholds from a pool: drawing 15 fields per example tripled the test's time; 512 random valid
# sets, each met about 20 times over the 10,000 examples, vary every knob.
_rng = random.Random(25)
POOL = [random_thresholds(_rng) for _ in range(512)] + [load_profile(p) for p in ("gfx950", "h200")]


# Rows: decode-like (0-4 tokens), short chunks, long prompts; drawn as one integer each (cheap to draw).
def _row(x: int) -> int:
    return x % 5 if x < 20_000 else (x - 20_000) % 300 if x < 30_000 else x


def _ctx(x: int) -> int:
    """Context beyond the longest row: a quarter short (under 2000), the rest up to 200k."""
    return x % 2000 if x < 50_000 else x


row_len = st.integers(0, 40_000).map(_row)


def _on_boundaries(
    t: Thresholds, lens: list[int], msl: int, heads: int, which: int, d: int
) -> tuple[list[int], int]:
    """Move the batch onto one threshold's boundary (plus ``d`` in -1, 0, 1), where an off-by-one
    between the two statements of a rule shows: 0 context floor, 1 context cap, 2 a decode_ctx_unit
    step, 3 the occupancy floor (a row padded to reach it), 4 the decode-row cap (decode rows added,
    the context on a step of the cap)."""
    lens = list(lens)
    if which == 0:
        msl = t.min_seq_len + d
    elif which == 1 and t.max_seq_len:
        msl = t.max_seq_len + d
    elif which == 2:
        msl = t.decode_ctx_unit * (1 + msl % 4) + d
    elif which == 3:
        target = -(-t.min_qblock_rows * t.block_m // heads) + d  # tokens that just reach the floor
        if target > sum(lens):
            lens.append(target - sum(lens))
    elif which == 4:  # the context on a decode_ctx_unit step (or one below) too: the cap's own boundary
        msl = max(t.decode_ctx_unit * (2 + msl % 3) - msl % 2, max(lens))
        units = msl // t.decode_ctx_unit
        cap = t.decode_rows_base * max(1, units)
        have = sum(1 for x in lens if x <= t.decode_query_len_max)
        lens += [1] * max(0, min(cap + d - have, 600))
    return lens, max(msl, max(lens), 0)


@pytest.mark.slow  # 43.2 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.sampled_from(POOL),
    lens=st.lists(row_len, min_size=1, max_size=64),
    extra_ctx=st.integers(0, 200_000).map(_ctx),
    heads=st.sampled_from([1, 8, 16, 32, 64]),
    causal=st.booleans(),
    boundary=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(-1, 1))),
)
def test_explain_agrees_with_decide(t, lens, extra_ctx, heads, causal, boundary):
    msl = max(lens) + extra_ctx
    if boundary is not None:
        lens, msl = _on_boundaries(t, lens, msl, heads, *boundary)
    q = np.asarray(lens, dtype=np.int64)
    shape = BatchShape.from_query_lens(q, max_seq_len=msl, num_heads=heads, causal=causal, thresholds=t)
    d = decide(shape, t)
    e = ex.explain(shape, t)
    assert (e.path, e.reason, e.lpt) == (d.path, d.reason, d.lpt)
    failed = [c for c in e.checks if c.reached and not c.passed]
    assert len(failed) == (0 if d.reason == "admitted" else 1)
    assert [c.reached for c in e.checks] == sorted((c.reached for c in e.checks), reverse=True)


def test_every_rule_is_listed_with_both_sides_and_the_boundary_is_exact():
    t = load_profile("gfx950")
    at = BatchShape.from_query_lens([2048], max_seq_len=t.min_seq_len, num_heads=16, thresholds=t)
    below = at._replace(max_seq_len=t.min_seq_len - 1)
    assert ex.explain(at, t).reason == decide(at, t).reason != SHORT_CONTEXT
    e = ex.explain(below, t)
    assert e.reason == decide(below, t).reason == SHORT_CONTEXT
    row = next(c for c in e.checks if c.reason == SHORT_CONTEXT)
    assert row.threshold == "min_seq_len = 1536" and row.value == "max_seq_len = 1535"
    assert row.verdict == "FAIL -> short_context"
    later = e.checks[e.checks.index(row) + 1 :]
    assert later and all(not c.reached for c in later)


def test_a_rule_that_drifts_from_decide_is_caught():
    """The property above can fail: an explanation whose occupancy rule is off by one disagrees
    with decide() on the boundary shape."""
    t = load_profile("gfx950")
    n = t.min_qblock_rows * t.block_m // 16  # tokens that exactly meet the occupancy floor at 16 heads
    shape = BatchShape.from_query_lens([n], max_seq_len=8192, num_heads=16, thresholds=t)
    assert ex.explain(shape, t).reason == decide(shape, t).reason == "admitted"
    rules = list(ex.RULES)
    i = next(i for i, r in enumerate(rules) if r[1] == "low_occupancy")
    name, reason, thr, val, _ok = rules[i]
    rules[i] = (
        name,
        reason,
        thr,
        val,
        lambda s, t: s.num_heads * s.num_actual_tokens > t.min_qblock_rows * t.block_m,
    )
    saved = ex.RULES
    try:
        ex.RULES = tuple(rules)
        assert ex.explain(shape, t).reason != decide(shape, t).reason
    finally:
        ex.RULES = saved


def test_decode_only_batch_takes_decode_path_and_says_so():
    t = load_profile("gfx950").merged({"decode_path": "prefill"})
    shape = BatchShape.from_query_lens([1] * 32, max_seq_len=32768, num_heads=32, thresholds=t)
    e = ex.explain(shape, t)
    assert (e.path, e.reason) == ("prefill", NO_PREFILL_ROWS) and "decode_path = prefill" in e.lpt_detail


def test_the_random_shapes_reach_every_reason_and_both_lpt_orderings():
    """The property is only as good as its inputs: the same distributions, drawn with a seeded RNG,
    end on every reason decide() can give and on both orderings."""
    rng = random.Random(7)
    seen = set()
    for _ in range(3000):
        t = rng.choice(POOL)
        q = np.asarray([_row(rng.randint(0, 40_000)) for _ in range(rng.randint(1, 64))], dtype=np.int64)
        shape = BatchShape.from_query_lens(
            q,
            max_seq_len=int(q.max()) + _ctx(rng.randint(0, 200_000)),
            num_heads=rng.choice([1, 8, 16, 32, 64]),
            causal=rng.random() < 0.5,
            thresholds=t,
        )
        d = decide(shape, t)
        seen |= {d.reason, d.ordering}
    reasons = {"no_prefill_rows", "disabled", "not_causal", "context_too_long", "short_context"}
    reasons |= {"low_occupancy", "too_many_decode_rows", "admitted"}
    assert reasons | {"lpt", "plain"} <= seen
