"""Advice on the knobs that need a restart: what changing each would save, never in the ready PATCH.

Live advice (flyserve.sidecar.live_costs) fits only the run-time knobs, the ones a PATCH can change
while serving. On a decode-heavy window that misses the biggest lever: a batch with no prefill row
takes ``decode_path`` whatever the run-time knobs say (the seed's gfx950 thresholds on the h200 cost
table: 95% of the sampled steps are decode only, routed/oracle 1.51, and the run-time fit found 0.04%).
The knobs fixed at start are

* ``decode_path`` (policy.thresholds.START_ONLY_FIELDS): vLLM captures CUDA graphs for batches
  with no prefill row at start, so it changes in the thresholds file plus a restart;
* the KV-cache block size (``vllm serve --block-size``): every kernel reads the paged cache with it;
  priced when the cost table was measured at more than one block size and the samples say theirs.

Each is priced alone, on top of the advised run-time values (the ready PATCH applied), over the same
window's priced samples, so "saving" is the share of the window's routed attention time that one
restart would remove. The result is advice for a person; nothing here publishes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flyserve.policy import PATHS, Thresholds
from flyserve.policy.routing import paths_under, routed_seconds
from flyserve.policy.thresholds import START_ONLY_FIELDS
from flyserve.telemetry.shape_sample import ShapeSample

MIN_SAVING = 1e-4
"""Below a hundredth of a percent of the window's routed time a restart is not worth naming."""

BLOCK_SIZE = "block_size"
"""The KV-cache block size: a vLLM serve flag, not a threshold; its name in the advice."""

HOW = {
    "decode_path": "set decode_path in the thresholds file (or the profile) and restart vLLM",
    BLOCK_SIZE: "restart vLLM with --block-size {value}",
}


class Priced(Protocol):
    """What restart advice reads of a priced sample (regret.PricedSample)."""

    sample: ShapeSample
    unified_s: float
    prefill_s: float


Reprice = Callable[[ShapeSample, int], "tuple[float, float] | None"]
"""(sample, block size) -> (unified seconds, prefill seconds) at that block size, or None."""


@dataclass(frozen=True)
class RestartKnobAdvice:
    """One start-time knob: the value in force, the advised one, and what the change would save."""

    knob: str
    current: Any
    advised: Any
    routed_s_before: float
    routed_s_after: float
    oracle_s: float
    samples_moved: int
    how: str

    @property
    def saving(self) -> float:
        """Share of the window's routed attention time the restart removes (0.36 = 36%)."""
        return 1.0 - self.routed_s_after / self.routed_s_before if self.routed_s_before > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        o = self.oracle_s
        return {
            "knob": self.knob,
            "current": self.current,
            "advised": self.advised,
            "needs_restart": True,
            "saving": self.saving,
            "routed_s_before": self.routed_s_before,
            "routed_s_after": self.routed_s_after,
            "routed_over_oracle_before": self.routed_s_before / o if o > 0 else None,
            "routed_over_oracle_after": self.routed_s_after / o if o > 0 else None,
            "samples_moved": self.samples_moved,
            "how": self.how,
        }


def _paths(samples: Sequence[Priced], t: Thresholds) -> list[str]:
    return paths_under((p.sample for p in samples), t)


_total = routed_seconds


def decode_path_advice(
    samples: Sequence[Priced], base: Thresholds, paths: Sequence[str] | None = None
) -> RestartKnobAdvice | None:
    """The other decode_path, if it is cheaper on these samples under ``base``'s run-time knobs.
    ``paths``: decide()'s paths of ``samples`` under ``base`` when the caller has them. Only the
    batches without a prefill row are routed again: decode_path is all decide() reads of them, and
    nothing else reads it (tests/integration/test_restart_advice_live.py checks the saving against
    `flyserve replay` routing every step)."""
    if not samples:
        return None
    prices = [(p.unified_s, p.prefill_s) for p in samples]
    before_paths = list(paths) if paths is not None else _paths(samples, base)
    before = _total(prices, before_paths)
    oracle = float(sum(min(u, pp) for u, pp in prices))
    decode_only = [
        i for i, p in enumerate(samples) if max(p.sample.query_lens, default=0) < base.min_query_len
    ]
    best: RestartKnobAdvice | None = None
    for other in PATHS:
        if other == base.decode_path:
            continue
        t = base.model_copy(update={"decode_path": other})
        after_paths = list(before_paths)
        for i, path in zip(decode_only, _paths([samples[i] for i in decode_only], t), strict=True):
            after_paths[i] = path
        after = _total(prices, after_paths)
        moved = sum(a != b for a, b in zip(before_paths, after_paths, strict=True))
        cand = RestartKnobAdvice(
            "decode_path", base.decode_path, other, before, after, oracle, moved, HOW["decode_path"]
        )
        if cand.saving >= MIN_SAVING and (best is None or after < best.routed_s_after):
            best = cand
    return best


def block_size_advice(
    samples: Sequence[Priced],
    base: Thresholds,
    block_sizes: Sequence[int],
    reprice: Reprice,
    paths: Sequence[str] | None = None,
) -> RestartKnobAdvice | None:
    """The cheapest other KV block size the cost table was measured at, if it saves time. Only when
    every sample says its block size and it is one value (one engine configuration)."""
    sizes = {p.sample.block_size for p in samples}
    if not samples or len(sizes) != 1 or None in sizes:
        return None
    current = int(next(iter(sizes)))  # type: ignore[arg-type]
    paths = list(paths) if paths is not None else _paths(samples, base)
    before = _total([(p.unified_s, p.prefill_s) for p in samples], paths)
    oracle = float(sum(min(p.unified_s, p.prefill_s) for p in samples))
    best: RestartKnobAdvice | None = None
    for bs in block_sizes:
        if bs == current:
            continue
        prices = [reprice(p.sample, bs) for p in samples]
        if any(x is None for x in prices):
            continue
        after = _total(prices, paths)  # type: ignore[arg-type]
        cand = RestartKnobAdvice(
            BLOCK_SIZE, current, bs, before, after, oracle, 0, HOW[BLOCK_SIZE].format(value=bs)
        )
        if cand.saving >= MIN_SAVING and (best is None or after < best.routed_s_after):
            best = cand
    return best


START_ONLY_ADVISERS: dict[
    str, Callable[[Sequence[Priced], Thresholds, Sequence[str] | None], RestartKnobAdvice | None]
] = {
    "decode_path": decode_path_advice,
}
"""One adviser per start-only threshold (tests check it covers START_ONLY_FIELDS)."""


def restart_advice(
    samples: Sequence[Priced],
    proposed: Thresholds,
    *,
    block_sizes: Sequence[int] = (),
    reprice: Reprice | None = None,
    paths: Sequence[str] | None = None,
) -> list[RestartKnobAdvice]:
    """Every start-time knob whose change would save time on ``samples``, biggest saving first.
    ``proposed`` is the run-time advice's result: restarts are priced on top of the ready PATCH.
    ``paths``: decide()'s paths of ``samples`` under ``proposed``, if the caller has them."""
    if paths is None:
        paths = _paths(samples, proposed)
    out = [START_ONLY_ADVISERS[f](samples, proposed, paths) for f in START_ONLY_FIELDS]
    if reprice is not None and len(block_sizes) > 1:
        out.append(block_size_advice(samples, proposed, block_sizes, reprice, paths))
    return sorted((a for a in out if a is not None), key=lambda a: -a.saving)
