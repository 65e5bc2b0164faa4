"""decide(): the seed's measured cases, every reason, the LPT rule and the invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flyserve.policy import (
    ADMITTED,
    CONTEXT_TOO_LONG,
    DISABLED,
    LOW_OCCUPANCY,
    NO_PREFILL_ROWS,
    NOT_CAUSAL,
    PREFILL,
    SHORT_CONTEXT,
    TOO_MANY_DECODE_ROWS,
    UNIFIED,
    BatchShape,
    Thresholds,
    decide,
)
from flyserve.thresholds_files import load_profile

SEED = load_profile("gfx950")


def shape(lens, ctx, heads=16, causal=True, t=SEED):
    return BatchShape.from_query_lens(
        np.array(lens), max_seq_len=ctx, num_heads=heads, causal=causal, thresholds=t
    )


def test_profile_matches_seed_constants(seed_cases):
    for key, value in seed_cases["constants"].items():
        assert getattr(SEED, key) == value, key
    assert SEED == Thresholds()  # the model's defaults are the seed's


def test_seed_cases_route_as_measured(seed_cases):
    heads = seed_cases["num_heads"]
    for case in seed_cases["cases"]:
        d = decide(shape(case["query_lens"], case["max_seq_len"], heads), SEED)
        assert d.path == case["expected"], case
        # The measured speed-up agrees with the routing: > 1 admitted, < 1 not.
        assert (case["measured_speedup"] > 1.0) == (d.path == PREFILL), case


def test_decode_row_cap(seed_cases):
    for ctx, cap in seed_cases["decode_row_cap_examples"].items():
        ctx = int(ctx)
        assert SEED.decode_row_cap(ctx) == cap
        # exactly `cap` decode rows beside a long prefill row are admitted, cap + 1 are not
        ok = shape([8192] + [1] * cap, ctx)
        over = shape([8192] + [1] * (cap + 1), ctx)
        assert decide(ok, SEED).reason == ADMITTED
        assert decide(over, SEED).reason == TOO_MANY_DECODE_ROWS


@pytest.mark.parametrize(
    "lens,ctx,kw,changes,reason",
    [
        ([1, 1, 1], 8192, {}, {}, NO_PREFILL_ROWS),
        ([4096], 8192, {}, {"prefill_enabled": False}, DISABLED),
        ([4096], 8192, {"causal": False}, {}, NOT_CAUSAL),
        ([4096], 200_000, {}, {}, CONTEXT_TOO_LONG),
        ([1024], 1024, {}, {}, SHORT_CONTEXT),
        ([512], 8192, {}, {}, LOW_OCCUPANCY),
        ([4096] + [1] * 9, 8192, {}, {}, TOO_MANY_DECODE_ROWS),
        ([4096], 8192, {}, {}, ADMITTED),
    ],
)
def test_each_reason(lens, ctx, kw, changes, reason):
    t = SEED.merged(changes)
    d = decide(shape(lens, ctx, t=t, **kw), t)
    assert d.reason == reason
    assert d.path == (PREFILL if reason == ADMITTED else UNIFIED)
    assert d.variant == (1 if d.path == PREFILL else 0)
    assert (d.lpt is None) == (d.path == UNIFIED)


def test_checks_run_in_order():
    # Fails short_context, low_occupancy and too_many_decode_rows at once: the first wins.
    s = shape([4] + [1] * 40, 1024)
    assert decide(s, SEED).reason == SHORT_CONTEXT
    assert decide(s, SEED.merged({"min_seq_len": 0})).reason == LOW_OCCUPANCY
    assert decide(s, SEED.merged({"min_seq_len": 0, "min_qblock_rows": 0})).reason == TOO_MANY_DECODE_ROWS
    # not causal beats everything but no_prefill_rows and disabled
    nc = shape([4] + [1] * 40, 200_000, causal=False)
    assert decide(nc, SEED).reason == NOT_CAUSAL
    assert decide(nc, SEED.merged({"prefill_enabled": False})).reason == DISABLED


def test_zero_disables_checks():
    s = shape([64], 256, heads=1)
    t = SEED.merged({"min_seq_len": 0, "min_qblock_rows": 0, "max_seq_len": 0})
    assert decide(s, t).reason == ADMITTED
    assert decide(shape([64], 10**9, heads=1), t).reason == ADMITTED


@pytest.mark.parametrize(
    "lens,expect_lpt",
    [
        ([8192], True),  # no short rows
        ([96 * 256] + [1], True),  # q-blocks >= 96
        ([48 * 256] + [1], True),  # one short row, q-blocks >= 48
        ([47 * 256] + [1], False),  # one short row, 47 q-blocks
        ([32 * 256] + [1] * 8, True),  # >= 8 short rows, q-blocks <= 32
        ([33 * 256] + [1] * 8, False),  # >= 8 short rows but 33 q-blocks
        ([4096] + [1] * 3, False),  # 3 short rows, 16 q-blocks
    ],
)
def test_lpt_rule(lens, expect_lpt):
    t = SEED.merged({"decode_rows_base": 1000})
    d = decide(shape(lens, 61440, t=t), t)
    assert d.reason == ADMITTED
    assert d.lpt is expect_lpt
    assert decide(shape(lens, 61440, t=t), t.merged({"lpt": "always"})).lpt is True
    assert decide(shape(lens, 61440, t=t), t.merged({"lpt": "never"})).lpt is False


def test_decode_path_prefill_takes_no_prefill_batches():
    t = SEED.merged({"decode_path": "prefill"})
    d = decide(shape([1] * 32, 8192), t)
    assert (d.path, d.reason, d.variant) == (PREFILL, NO_PREFILL_ROWS, 1)
    assert isinstance(d.lpt, bool)


def test_decisions_are_interned():
    a = decide(shape([4096], 8192), SEED)
    b = decide(shape([4096], 8192), SEED)
    assert a is b


# ----------------------------------------------------------------- properties

lens_st = st.lists(st.integers(min_value=1, max_value=40_000), min_size=1, max_size=64)
ctx_st = st.integers(min_value=1, max_value=300_000)
heads_st = st.sampled_from([1, 4, 8, 16, 32, 64])
thresholds_st = st.builds(
    lambda mq, mqr, msl, base, unit, dp, en: SEED.merged(
        {
            "min_qblock_rows": mqr,
            "min_seq_len": msl,
            "decode_rows_base": base,
            "decode_ctx_unit": unit,
            "decode_path": dp,
            "prefill_enabled": en,
            "min_query_len": mq,
            "decode_query_len_max": mq - 1,
        }
    ),
    st.integers(2, 8),
    st.integers(0, 200),
    st.integers(0, 100_000),
    st.integers(0, 64),
    st.integers(1, 65536),
    st.sampled_from(["unified", "prefill"]),
    st.booleans(),
)


@pytest.mark.slow  # 1.2 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(0, 1), min_size=1, max_size=64), ctx=ctx_st, heads=heads_st, t=thresholds_st)
def test_no_prefill_batch_always_takes_decode_path(lens, ctx, heads, t):
    d = decide(shape(lens, ctx, heads, t=t), t)
    assert d.path == t.decode_path
    assert d.reason == NO_PREFILL_ROWS


@pytest.mark.slow  # 1.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=300, deadline=None)
@given(lens=lens_st, ctx=ctx_st, heads=heads_st, t=thresholds_st, causal=st.booleans())
def test_decision_is_deterministic(lens, ctx, heads, t, causal):
    s1 = shape(lens, ctx, heads, causal, t=t)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    s2 = BatchShape.from_query_start_loc(qsl, max_seq_len=ctx, num_heads=heads, causal=causal, thresholds=t)
    assert s1 == s2
    assert decide(s1, t) == decide(s2, t) == decide(s1, t.merged({}))


@pytest.mark.slow  # 1.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=300, deadline=None)
@given(
    lens=lens_st,
    ctx=ctx_st,
    heads=heads_st,
    t=thresholds_st,
    bump=st.integers(0, 100_000),
    which=st.sampled_from(["min_seq_len", "min_qblock_rows"]),
)
def test_raising_a_minimum_never_admits_more(lens, ctx, heads, t, bump, which):
    s = shape(lens, ctx, heads, t=t)
    raised = getattr(t, which) + bump
    if which == "min_seq_len" and t.max_seq_len and raised > t.max_seq_len:
        raised = t.max_seq_len
    t2 = t.merged({which: raised})
    if decide(s, t).path == UNIFIED and decide(s, t).reason != NO_PREFILL_ROWS:
        assert decide(s, t2).path == UNIFIED
    if decide(s, t2).reason == ADMITTED:
        assert decide(s, t).reason == ADMITTED
