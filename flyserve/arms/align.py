"""Token-by-token alignment of two responses to the same prompt.

Both responses answer one deterministic request (temperature 0, same seed), so they share the
prompt and every token up to the first position where they differ: the *first divergence*.
From there on they condition on different text, so later differences say nothing new; the
first divergence is the event to explain.

The margin. At the first divergence position p the two arms saw the same context, so the
question is how close the decision was. We take the LEFT response's distribution (arm A for a
cross-arm pair; the lower-numbered run for a self pair) and report

    margin = logprob(top-1 alternative) - logprob(top-2 alternative)   at position p

from its top alternatives (>= 0; exactly 0.0 is a tie in the reported logprobs: a tie re-rolled by
numerics, not a worse decision). Arm A is the reference (the baseline, e.g. vLLM's default
kernel), so the margin asks: "how sure was the baseline about the token the candidate changed?"
When the left response has no token at p (it stopped where the other continued) there is no
distribution to read: the margin is None and the pair is counted under divergences without margin.

The prefix drift. Before p both responses chose the same tokens; the largest absolute difference
of their best logprobs over those positions shows how far the numerics differ even where no token
flipped (0.0 for bit-identical arms, a few bf16 ulps for two kernels that agree closely).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flyserve.arms.extract import Extractor

Alternatives = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Response:
    """One arm's answer to one prompt in one run, as much of it as the figures need.

    Only the top-two margin of each position is kept, not the alternatives themselves: a full
    gsm8k comparison (1319 prompts x 2 arms x K runs x a few hundred tokens x N alternatives) is
    hundreds of MB of JSON, and the raw file keeps them anyway.
    """

    arm: str
    run: int
    prompt: int
    text: str
    tokens: tuple[str, ...]
    margins: tuple[float | None, ...]  # per generated token: logprob(best) - logprob(second best)
    top1: tuple[float | None, ...] = ()  # per generated token: logprob(best), for the prefix drift
    finish_reason: str | None = None

    @staticmethod
    def from_record(rec: dict) -> Response:
        """From a results-file record; ValueError naming the problem if it is malformed."""
        try:
            tokens = tuple(str(t) for t in rec["tokens"])
            ranked = [sort_alternatives(alts) for alts in rec["top_logprobs"]]
            margins = tuple(top_two_margin(a) for a in ranked)
            top1 = tuple(a[0][1] if a else None for a in ranked)
            resp = Response(
                arm=str(rec["arm"]),
                run=int(rec["run"]),
                prompt=int(rec["prompt"]),
                text=str(rec["text"]),
                tokens=tokens,
                margins=margins,
                top1=top1,
                finish_reason=rec.get("finish_reason"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed response record ({type(exc).__name__}: {exc})") from None
        if len(tokens) != len(margins):
            raise ValueError(f"{len(tokens)} tokens but {len(margins)} top_logprobs entries")
        return resp


def sort_alternatives(alts: Sequence[Sequence]) -> Alternatives:
    """Best first; ties keep the server's order (a stable sort)."""
    pairs = [(str(t), float(lp)) for t, lp in alts]
    return tuple(sorted(pairs, key=lambda p: -p[1]))


def first_divergence(left: Sequence[str], right: Sequence[str]) -> int | None:
    """Index of the first differing token; min(len) if one is a strict prefix of the other; None if equal."""
    for i, (x, y) in enumerate(zip(left, right, strict=False)):
        if x != y:
            return i
    if len(left) != len(right):
        return min(len(left), len(right))
    return None


def top_two_margin(alts: Alternatives) -> float | None:
    """logprob(best) - logprob(second best); None with fewer than two alternatives."""
    if len(alts) < 2:
        return None
    return alts[0][1] - alts[1][1]


@dataclass(frozen=True)
class PairComparison:
    """The comparison of two responses to one prompt (left vs right)."""

    prompt: int
    left: tuple[str, int]  # (arm, run)
    right: tuple[str, int]
    diverged: bool
    first_divergence: int | None
    margin: float | None
    answer_left: str | None
    answer_right: str | None
    prefix_drift: float | None = None  # max |top-1 logprob difference| over the shared prefix

    @property
    def answer_changed(self) -> bool:
        return self.answer_left != self.answer_right

    def to_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "left": list(self.left),
            "right": list(self.right),
            "diverged": self.diverged,
            "first_divergence": self.first_divergence,
            "margin": self.margin,
            "answer_left": self.answer_left,
            "answer_right": self.answer_right,
            "answer_changed": self.answer_changed,
            "prefix_drift": self.prefix_drift,
        }


def compare_pair(left: Response, right: Response, extractor: Extractor) -> PairComparison:
    if left.prompt != right.prompt:
        raise ValueError(f"cannot align responses to different prompts ({left.prompt} vs {right.prompt})")
    pos = first_divergence(left.tokens, right.tokens)
    margin = None
    if pos is not None and pos < len(left.margins):
        margin = left.margins[pos]
    shared = len(left.tokens) if pos is None else pos
    drift = prefix_drift(left.top1[:shared], right.top1[:shared])
    return PairComparison(
        prompt=left.prompt,
        left=(left.arm, left.run),
        right=(right.arm, right.run),
        diverged=pos is not None,
        first_divergence=pos,
        margin=margin,
        answer_left=extractor.extract(left.text),
        answer_right=extractor.extract(right.text),
        prefix_drift=drift,
    )


def prefix_drift(left: Sequence[float | None], right: Sequence[float | None]) -> float | None:
    """Largest |difference| of the best logprob over positions where both arms chose the same token.

    Numerics can differ without flipping a token: this shows it (0.0 for bit-identical arms).
    None when there is no shared position with logprobs on both sides.
    """
    diffs = [abs(x - y) for x, y in zip(left, right, strict=False) if x is not None and y is not None]
    return max(diffs) if diffs else None
