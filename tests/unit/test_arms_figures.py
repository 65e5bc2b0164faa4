"""flyserve arms: the figures on a small case built and computed by hand.

Three prompts, two runs per arm, the gsm8k number extractor. Logprobs are binary fractions
(0.25, 0.5, 0.125 ...) so every margin below is exact in floating point.

Responses (tokens; the top alternatives at the position that matters, best first):

prompt 0, answer "12"
  A0, A1  ["The", " answer", " is", " 12"]   pos 3: (" 12", -0.5), (" 13", -1.5)  -> margin 1.0
          (A1 only: pos 0 best logprob -0.3125 instead of the filler's -0.0625: a drift of 0.25)
  B0      ["The", " answer", " is", " 13"]   pos 3: (" 13", -0.75), (" 12", -0.75) -> margin 0.0 (a tie)
  B1      same as A0
prompt 1, answer "7"
  A0      ["x", " 7", " ok"]                 pos 2: (" ok", -1.0), (" fine", -1.0)  -> margin 0.0
  A1      ["x", " 7", " ok"]                 pos 2: (" ok", -0.75), (" fine", -1.25) -> margin 0.5
  B0      ["x", " 7", " fine"]               pos 2: (" fine", -0.125), (" ok", -2.125) -> margin 2.0
  B1      ["x", " 7"]                        (stopped one token earlier)
prompt 2, no answer
  A0, A1  ["a"]            B0, B1 ["a", "b"]  (A has no token at position 1: no margin)

Cross-arm pairs (A_i vs B_j, i, j in {0, 1}), 3 prompts x 4 = 12:
  p0: (A0,B0) diverge at 3, margin A0@3 = 1.0, answer 12 -> 13 changed; (A1,B0) the same;
      (A0,B1), (A1,B1) identical.
  p1: all 4 diverge at 2 (B0: " fine" vs " ok"; B1 ends where A has " ok"). Margin from A's
      distribution at 2: A0 -> 0.0 (twice), A1 -> 0.5 (twice). Answers 7 = 7: unchanged.
  p2: all 4 diverge at 1, A has no token there: no margin. Answers None = None: unchanged.
  diverged 2 + 4 + 4 = 10 of 12;  answer changed 2 of 12;  of the diverged 2 of 10 = 0.2.
  positions in order (p0: A0B0, A1B0; p1: A0B0, A0B1, A1B0, A1B1; p2: four):
      [3, 3, 2, 2, 2, 2, 1, 1, 1, 1]; sorted 1,1,1,1,2,2,2,2,3,3 -> median 2.0
  margins [1.0, 1.0, 0.0, 0.0, 0.5, 0.5]; sorted 0,0,0.5,0.5,1,1 -> median 0.5;
      numpy linear quartiles: 25% at rank 1.25 -> 0 + 0.25*0.5 = 0.125; 75% at rank 3.75 ->
      0.5 + 0.75*0.5 = 0.875. Exactly zero: 2 of 6 = 1/3. Without margin: 10 - 6 = 4.
Self pairs (run 0 vs run 1, run 0 on the left), 3 per arm:
  A: all identical -> 0/3 = 0.0, answers unchanged 0.0.
  B: p0 diverge at 3 (margin B0@3 = 0.0, 13 vs 12 changed); p1 diverge at 2 (margin B0@2 = 2.0,
     7 = 7); p2 identical -> 2/3 diverged, 1/3 answer changed, margins [0.0, 2.0].
Prefix drift (max |best-logprob difference| over the positions before the first divergence;
every position not listed above has the filler's best logprob -0.0625):
  cross: p0 (A0,B0) 0, (A0,B1) 0, (A1,B0) 0.25 (pos 0), (A1,B1) 0.25; p1 and p2: 0 (their shared
  prefixes are filler) -> 12 values, 2 non-zero (1/6), median 0.0, max 0.25.
  A vs A: p0 0.25 (pos 0); p1 0.25 (identical tokens, so all 3 positions shared: pos 2 has
  -1.0 vs -0.75); p2 0 -> 2/3 non-zero, median 0.25, max 0.25.
  B vs B: p0 shared 0..2, p1 shared 0..1, p2 all: filler everywhere -> 0 of 3, median 0, max 0.
Accuracy over the 2 answered prompts (per prompt: mean over runs):
  A: p0 1.0, p1 1.0 -> 1.0, stderr 0.0.  B: p0 0.5 (13 wrong, 12 right), p1 1.0 -> 0.75;
  stderr = std([0.5, 1.0], ddof=1)/sqrt(2) = 0.353553.../1.414213... = 0.25.
Tests: accuracy B - A per prompt [-0.5, 0.0] -> observed -0.25. With two prompts a resample mean
  is -0.5, -0.25 or 0.0 with probability 1/4, 1/2, 1/4, so the 95% CI is [-0.5, 0.0] and about
  half of the resamples lie >= 0.25 from -0.25: p about 0.5.
  divergence per prompt: cross [2/4, 4/4, 4/4] = [0.5, 1, 1]; self (mean of A and B)
  [(0+1)/2, (0+1)/2, (0+0)/2] = [0.5, 0.5, 0]; difference [0, 0.5, 1] -> observed 0.5;
  noise floor 1/3.
"""

from __future__ import annotations

import pytest

from flyserve.arms.align import Response, compare_pair, first_divergence, top_two_margin
from flyserve.arms.extract import NumberExtractor, make_extractor
from flyserve.arms.prompts import PromptItem
from flyserve.arms.stats import analyze, paired_bootstrap

FILL = [["<f>", -0.0625], ["<g>", -4.0]]  # alternatives at positions that do not matter


def rec(arm, run, prompt, tokens, at=None, alts=None, more=None):
    tops = [list(FILL) for _ in tokens]
    if at is not None:
        tops[at] = alts
    for pos, alt in (more or {}).items():
        tops[pos] = alt
    return Response.from_record(
        {
            "arm": arm,
            "run": run,
            "prompt": prompt,
            "text": "".join(tokens),
            "tokens": tokens,
            "top_logprobs": tops,
        }
    )


P0 = ["The", " answer", " is", " 12"]
P0_B = ["The", " answer", " is", " 13"]


def hand_case():
    items = (
        PromptItem(index=0, line=1, id="p0", prompt="q0", answer="12"),
        PromptItem(index=1, line=2, id="p1", prompt="q1", answer="#### 7"),
        PromptItem(index=2, line=3, id="p2", prompt="q2"),
    )
    rs = [
        rec("a", 0, 0, P0, 3, [[" 12", -0.5], [" 13", -1.5]]),
        # server order is not trusted: sorted. Position 0 is 0.25 less sure than everywhere else.
        rec("a", 1, 0, P0, 3, [[" 13", -1.5], [" 12", -0.5]], {0: [["The", -0.3125], ["<g>", -4.0]]}),
        rec("b", 0, 0, P0_B, 3, [[" 13", -0.75], [" 12", -0.75]]),
        rec("b", 1, 0, P0, 3, [[" 12", -0.5], [" 13", -1.5]]),
        rec("a", 0, 1, ["x", " 7", " ok"], 2, [[" ok", -1.0], [" fine", -1.0]]),
        rec("a", 1, 1, ["x", " 7", " ok"], 2, [[" ok", -0.75], [" fine", -1.25]]),
        rec("b", 0, 1, ["x", " 7", " fine"], 2, [[" fine", -0.125], [" ok", -2.125]]),
        rec("b", 1, 1, ["x", " 7"]),
        rec("a", 0, 2, ["a"]),
        rec("a", 1, 2, ["a"]),
        rec("b", 0, 2, ["a", "b"]),
        rec("b", 1, 2, ["a", "b"]),
    ]
    return items, {(r.arm, r.run, r.prompt): r for r in rs}


@pytest.fixture(scope="module")
def report():
    items, responses = hand_case()
    return analyze(items, responses, 2, NumberExtractor(), resamples=4000, seed=7)


def test_cross_arm_figures(report):
    assert report["prompts"] == 3
    assert report["runs"] == 2
    assert report["pairs_compared"] == 12
    assert report["diverged_share"] == 10 / 12
    assert report["answer_changed_share"] == 2 / 12
    assert report["answer_changed_given_diverged_share"] == 0.2
    assert report["first_divergence_positions"] == [3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    assert report["first_divergence_position_median"] == 2.0
    assert report["divergence_margins"] == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5]
    assert report["margin_median"] == 0.5
    assert report["margin_quartiles"] == [0.125, 0.5, 0.875]
    assert report["margin_zero_share"] == 2 / 6
    assert report["divergences_without_margin"] == 4


def test_prefix_drift(report):
    d = report["logprob_drift"]
    assert d["a_vs_b"] == {"pairs": 12, "share_nonzero": 2 / 12, "median": 0.0, "max": 0.25}
    assert d["a_vs_a"] == {"pairs": 3, "share_nonzero": 2 / 3, "median": 0.25, "max": 0.25}
    assert d["b_vs_b"] == {"pairs": 3, "share_nonzero": 0.0, "median": 0.0, "max": 0.0}
    assert [p["prefix_drift"] for p in report["pairs"] if p["prompt"] == 0] == [0.0, 0.0, 0.25, 0.25]


def test_noise_floor(report):
    assert report["self_divergence_share"] == {"a": 0.0, "b": 2 / 3}
    assert report["self_answer_changed_share"] == {"a": 0.0, "b": 1 / 3}
    assert report["self_divergence_margins"] == {"a": [], "b": [0.0, 2.0]}
    assert report["noise_floor_share"] == pytest.approx(1 / 3, abs=1e-15)


def test_accuracy_and_tests(report):
    assert report["answered_prompts"] == 2
    assert report["accuracy"] == {"a": 1.0, "b": 0.75}
    assert report["accuracy_stderr"]["a"] == 0.0
    assert report["accuracy_stderr"]["b"] == pytest.approx(0.25, abs=1e-15)
    acc = report["tests"]["accuracy_difference"]
    assert acc["observed"] == -0.25
    assert acc["ci95"] == [-0.5, 0.0]
    assert 0.45 < acc["p_value"] < 0.55
    assert "not distinguishable from chance" in acc["statement"]
    assert "0.25 points lower" not in acc["statement"]  # points are percentage points
    assert "25.00 points lower" in acc["statement"]
    div = report["tests"]["divergence_vs_noise"]
    assert div["observed"] == 0.5
    assert div["prompts"] == 3


def test_pairs_listed_for_independent_checks(report):
    p0 = [p for p in report["pairs"] if p["prompt"] == 0]
    assert [(p["left"], p["right"], p["diverged"], p["answer_changed"]) for p in p0] == [
        (["a", 0], ["b", 0], True, True),
        (["a", 0], ["b", 1], False, False),
        (["a", 1], ["b", 0], True, True),
        (["a", 1], ["b", 1], False, False),
    ]
    assert p0[0]["answer_left"] == "12" and p0[0]["answer_right"] == "13"


def test_one_run_has_no_noise_floor():
    items, responses = hand_case()
    one = {k: v for k, v in responses.items() if k[1] == 0}
    r = analyze(items, one, 1, NumberExtractor(), resamples=200)
    # p0: A0 vs B0 diverges; p1: A0 vs B0 diverges; p2 diverges: 3 of 3.
    assert r["diverged_share"] == 1.0
    assert r["self_divergence_share"] == {"a": None, "b": None}
    assert r["noise_floor_share"] is None
    assert "Only one run" in r["tests"]["divergence_vs_noise"]["statement"]


def test_missing_response_is_an_error():
    items, responses = hand_case()
    del responses[("b", 1, 2)]
    with pytest.raises(ValueError, match=r"\('b', 1, 2\)"):
        analyze(items, responses, 2, NumberExtractor())


def test_alignment_edge_cases():
    assert first_divergence(["a", "b"], ["a", "b"]) is None
    assert first_divergence(["a", "b"], ["a", "c"]) == 1
    assert first_divergence(["a"], ["a", "b"]) == 1
    assert first_divergence([], ["a"]) == 0
    assert top_two_margin((("a", -0.5),)) is None
    # The left response decides the margin: B on the left reads B's distribution.
    a = rec("a", 0, 0, P0, 3, [[" 12", -0.5], [" 13", -1.5]])
    b = rec("b", 0, 0, P0_B, 3, [[" 13", -0.75], [" 12", -0.75]])
    assert compare_pair(a, b, NumberExtractor()).margin == 1.0
    assert compare_pair(b, a, NumberExtractor()).margin == 0.0
    with pytest.raises(ValueError):
        compare_pair(a, rec("b", 0, 1, P0), NumberExtractor())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48 clips, then 24. #### 72", "72"),
        ("#### $1,234.50 and later 9", "1234.5"),
        ("so 18.00 dollars.", "18"),
        ("first 3 then -4.", "-4"),
        ("The answer is 5.\n\nQuestion: 7 apples", "7"),  # flexible: the LAST number
        ("no numbers", None),
    ],
)
def test_number_extractor(text, expected):
    assert NumberExtractor().extract(text) == expected


def test_exact_and_regex_extractors():
    assert make_extractor("exact").extract("  Paris \n") == "Paris"
    r = make_extractor(r"regex:answer is (\w+)")
    assert r.extract("the answer is cat; no, the answer is dog.") == "dog"
    assert r.extract("nothing") is None
    assert make_extractor(r"regex:\d+").extract("1 2 3") == "3"
    for bad in ("regex:(", "regex:", "numbers"):
        with pytest.raises(ValueError, match="--extractor"):
            make_extractor(bad)


def test_bootstrap_reproducible_and_bounded():
    d = [0.0, 1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 1.0]
    r1 = paired_bootstrap(d, resamples=2000, seed=3)
    r2 = paired_bootstrap(d, resamples=2000, seed=3)
    assert r1 == r2  # a fixed seed gives the same CI and p-value
    assert r1.observed == 3 / 8
    assert r1.ci_low <= 3 / 8 <= r1.ci_high
    # No difference at all: every resample is 0, p = 1.
    z = paired_bootstrap([0.0] * 5, resamples=500)
    assert (z.observed, z.ci_low, z.ci_high, z.p_value) == (0.0, 0.0, 0.0, 1.0)
    # The same non-zero difference on every prompt: no resample reaches 0, p = 1/(B+1).
    c = paired_bootstrap([0.5] * 5, resamples=999)
    assert (c.ci_low, c.ci_high, c.p_value) == (0.5, 0.5, 1 / 1000)
