"""Whether a window's shape samples are corroborated by the ranks' own decision counters.

Shape samples are files in ``<state>/shapes/`` that anyone who can write the state directory can
write: forged ones moved advice (``decode_ctx_unit`` 8192 -> 1024) and the drift gauge (19.6
instead of 1.0). Liveness (only files of live ranks are read,
flyserve.telemetry.shape_sample.read_shape_samples) removes files of ranks that do not exist; this
module checks what the live ranks' files claim against a second witness, the dispatch-decision
counters the ranks count where vLLM calls the routing (the multiprocess metrics the sidecar
already aggregates, flyserve.sidecar.stats):

    a rank's samples of path p in the window  <=  its decisions of path p over the window + slack

A rank samples at most one sample per engine step and decides at least once per step, so an honest
rank always passes; a file that claims more batches of a path than the rank routed down that path
is refused. The counter delta is taken over a baseline at least as old as the window when the
sidecar has one (CounterHistory), else over the counters' totals since each rank started (an upper
bound of any window: never a false refusal right after the sidecar starts). A sample without a
recorded path is checked against the rank's decisions of all paths.

The check is cheap (one pass over the window's samples, one counter read): it runs before any fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flyserve.sidecar.stats import RankCounters
from flyserve.telemetry.shape_sample import ShapeSample

SLACK_SAMPLES = 8
"""Samples a rank may claim beyond its counted decisions: a flush lands up to a second away from
the counter read."""
SLACK_SHARE = 0.02
"""And this share of its decisions (the same skew at a high step rate)."""
ALL_PATHS = "*"


@dataclass(frozen=True, slots=True)
class RankEvidence:
    """One rank's samples in the window against its decision counters."""

    engine: int
    rank: int
    samples: Mapping[str, int]
    """Samples per path (``*``: all of them)."""
    decisions: Mapping[str, float] | None
    """Decisions per path over the window (``*``: all), None when the rank has no counters."""
    refused: str | None
    """Why the rank's samples are not corroborated, None when they are."""

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "rank": self.rank,
            "samples": self.samples.get(ALL_PATHS, 0),
            "samples_by_path": {p: n for p, n in self.samples.items() if p != ALL_PATHS},
            "decisions": None if self.decisions is None else round(self.decisions.get(ALL_PATHS, 0.0)),
            "corroborated": self.refused is None,
            "reason": self.refused,
        }


@dataclass(frozen=True, slots=True)
class Evidence:
    """Every rank that contributed samples to a window."""

    ranks: tuple[RankEvidence, ...]

    @property
    def samples(self) -> int:
        return sum(r.samples.get(ALL_PATHS, 0) for r in self.ranks)

    @property
    def corroborated(self) -> bool:
        return all(r.refused is None for r in self.ranks)

    def rank_names(self) -> list[str]:
        return [f"{r.engine}-{r.rank}" for r in self.ranks]

    @property
    def reason(self) -> str | None:
        """One sentence naming the sample count and the ranks whose samples are not corroborated."""
        bad = [r for r in self.ranks if r.refused is not None]
        if not bad:
            return None
        parts = "; ".join(f"rank {r.engine}-{r.rank}: {r.refused}" for r in bad)
        return (
            f"{self.samples} samples from ranks {', '.join(self.rank_names())}: not corroborated by the "
            f"ranks' decision counters ({parts})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "used": self.samples,
            "ranks": [r.to_json() for r in self.ranks],
            "corroborated": self.corroborated,
        }


def _per_path(decisions: Mapping[tuple[str, str], float]) -> dict[str, float]:
    out: dict[str, float] = {ALL_PATHS: 0.0}
    for (path, _reason), v in decisions.items():
        out[path] = out.get(path, 0.0) + v
        out[ALL_PATHS] += v
    return out


def allowed(decisions: float) -> float:
    """Samples a rank with ``decisions`` counted decisions may claim."""
    return decisions * (1.0 + SLACK_SHARE) + SLACK_SAMPLES


def corroborate(samples: Iterable[ShapeSample], decisions: Mapping[int, RankCounters]) -> Evidence:
    """Check each (engine, rank)'s samples against ``decisions``: the window's counter deltas (or
    totals) per rank, keyed by the metrics' ``rank`` label."""
    counts: dict[tuple[int, int], dict[str, int]] = {}
    for s in samples:
        c = counts.setdefault((s.engine, s.rank), {ALL_PATHS: 0})
        c[ALL_PATHS] += 1
        if s.path is not None:
            c[s.path] = c.get(s.path, 0) + 1
    out = []
    for (engine, rank), c in sorted(counts.items()):
        rc = decisions.get(rank)
        if rc is None:
            out.append(RankEvidence(engine, rank, c, None, "no decision counters for this rank"))
            continue
        per = _per_path(rc.decisions)
        refused = None
        for path, n in sorted(c.items()):
            d = per.get(path, 0.0)
            if n > allowed(d):
                what = "samples" if path == ALL_PATHS else f"'{path}' samples"
                refused = (
                    f"{n} {what} but {round(d)} {'' if path == ALL_PATHS else path + ' '}decisions counted"
                )
                break
        out.append(RankEvidence(engine, rank, c, per, refused))
    return Evidence(tuple(out))
