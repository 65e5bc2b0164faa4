"""Dispatch statistics from the ranks' multiprocess counters and their reports.

Three steps, each a small pure function so it can be tested without a server:

1. ``read_counters(metrics_dir)``: prometheus_client's multiprocess files -> per-rank
   ``RankCounters`` (plain dicts of floats). The only I/O.
2. ``totals_of`` / ``kernels_of``: counters -> ``Totals`` / ``KernelStats``.
3. ``CounterHistory``: periodic snapshots of the counters, so a 60s/300s/900s window is the
   difference between now and the snapshot taken that long ago (the counters themselves are
   monotonic and cheap; keeping a history of them is what Prometheus' ``increase()`` does too).

Every TP rank of an engine decides the same thing each step (decide() is pure, the shape and the
thresholds version are the same), so an engine's totals come from ONE rank, never the sum over
ranks. The representative is the rank with the most decisions in the interval (ties: the lowest
rank): a killed rank's counters stop growing, so the choice moves to a live rank by itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flyserve.policy.vocabulary import NO_PREFILL_ROWS, PATHS, PREFILL, REASONS
from flyserve.sidecar.models import KernelStats, Totals, Window
from flyserve.telemetry import metrics as tm
from flyserve.telemetry.compaction import reading
from flyserve.telemetry.entry_cache import EntryCache
from flyserve.telemetry.multiprocess import note_skipped_file

log = logging.getLogger("flyserve.sidecar")

# The sample names as the ranks' files hold them, from the metric definitions (never retyped here).
DECISIONS = tm.exposed_name(tm.DISPATCH_DECISIONS)
TOKENS = tm.exposed_name(tm.DISPATCH_TOKENS)
ROWS = tm.exposed_name(tm.DISPATCH_ROWS)
LPT = tm.exposed_name(tm.DISPATCH_LPT)
KERNEL = tm.exposed_name(tm.KERNEL_SECONDS)
ROW_KINDS = ("prefill", "decode")

WINDOWS: dict[str, float] = {"60s": 60.0, "300s": 300.0, "900s": 900.0}


@dataclass
class RankCounters:
    """One rank's counters at one moment. Mutable while being filled by read_counters only."""

    decisions: dict[tuple[str, str], float] = field(default_factory=dict)  # (path, reason)
    tokens: dict[str, float] = field(default_factory=dict)  # path
    rows: dict[tuple[str, str], float] = field(default_factory=dict)  # (path, kind)
    lpt: dict[str, float] = field(default_factory=dict)  # ordering: lpt | plain
    kernel_buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # path -> {le: cumulative}
    kernel_sum: dict[str, float] = field(default_factory=dict)
    kernel_count: dict[str, float] = field(default_factory=dict)

    @property
    def batches(self) -> float:
        return sum(self.decisions.values())

    def minus(self, earlier: RankCounters | None) -> RankCounters:
        """self - earlier, series by series. A series that went down was reset (a restarted rank
        wiped its files): its delta is its current value, as Prometheus' increase() treats resets."""
        if earlier is None:
            return self

        def sub(a: Mapping, b: Mapping) -> dict:
            out = {}
            for k, v in a.items():
                d = v - b.get(k, 0.0)
                # A float sum read in another order (files merged by a compaction) may differ in
                # its last bits: only a real drop is a reset.
                out[k] = v if d < -1e-9 * max(1.0, abs(v)) else max(d, 0.0)
            return out

        return RankCounters(
            decisions=sub(self.decisions, earlier.decisions),
            tokens=sub(self.tokens, earlier.tokens),
            rows=sub(self.rows, earlier.rows),
            lpt=sub(self.lpt, earlier.lpt),
            kernel_buckets={
                p: sub(b, earlier.kernel_buckets.get(p, {})) for p, b in self.kernel_buckets.items()
            },
            kernel_sum=sub(self.kernel_sum, earlier.kernel_sum),
            kernel_count=sub(self.kernel_count, earlier.kernel_count),
        )


def _rank_of(labels: Mapping[str, str]) -> int | None:
    try:
        return int(labels["rank"])
    except (KeyError, ValueError):
        return None


# The mmap key (a JSON string) -> (field, rank, k1, k2) or None for a series we do not read.
# Keys are stable for the life of a series, so each is parsed once per process (bounded by the
# number of distinct series: paths x reasons x ranks plus buckets).
_KEY_CACHE: dict[str, tuple[str, int, str, object] | None] = {}
_KEY_CACHE_MAX = 200_000


def _parse_key(key: str) -> tuple[str, int, str, object] | None:
    hit = _KEY_CACHE.get(key, _KEY_CACHE)
    if hit is not _KEY_CACHE:
        return hit  # type: ignore[return-value]
    out: tuple[str, int, str, object] | None = None
    try:
        _metric, name, labels, _help = json.loads(key)
        rank = _rank_of(labels)
        if rank is not None:
            path = labels.get("path", "")
            if name == DECISIONS:
                out = ("decisions", rank, path, labels.get("reason", ""))
            elif name == TOKENS:
                out = ("tokens", rank, path, None)
            elif name == ROWS:
                out = ("rows", rank, path, labels.get("kind", ""))
            elif name == LPT:
                out = ("lpt", rank, labels.get("ordering", ""), None)
            elif name == KERNEL + "_bucket":
                out = ("kbucket", rank, path, float(labels.get("le", "inf")))
            elif name == KERNEL + "_sum":
                out = ("ksum", rank, path, None)
            elif name == KERNEL + "_count":
                out = ("kcount", rank, path, None)
    except (ValueError, TypeError, AttributeError):
        out = None
    except RecursionError:
        # A key nested thousands deep ('[' * 50000): the file is skipped and counted like any
        # corrupt one (EntryCache passes the ValueError up), never a 500 on every request.
        raise ValueError("a metrics key nested too deeply") from None
    if len(_KEY_CACHE) < _KEY_CACHE_MAX:
        _KEY_CACHE[key] = out
    return out


def read_counters(metrics_dir: Path) -> dict[int, RankCounters]:
    """All ranks' dispatch counters from flyserve's multiprocess metrics directory (read-only).

    Reads the files prometheus_client's MultiProcessCollector reads (same format), but only the
    counter and histogram files and only the series /dispatch-stats uses, with each key parsed
    once per process: measured 20 ms -> a few ms for 8 ranks (docs/performance.md, Sidecar latency).
    Histogram buckets in the files are per-bucket counts; they are made cumulative here.
    Files of dead processes stay and keep counting toward their rank, as they should: counters
    are totals over the run. Raises OSError if the directory cannot be listed.
    """
    if not metrics_dir.is_dir():
        raise FileNotFoundError(f"metrics directory {metrics_dir} does not exist")
    with reading(metrics_dir) as excluded:  # never mid-commit of a compaction (telemetry.compaction)
        out = _read_counters(metrics_dir, excluded)
    for rc in out.values():
        for path, buckets in rc.kernel_buckets.items():
            acc = 0.0
            cumulative = {}
            for le in sorted(buckets):
                acc += buckets[le]
                cumulative[le] = acc
            rc.kernel_buckets[path] = cumulative
            if path not in rc.kernel_count:  # multiprocess files hold no _count: it is the +Inf bucket
                rc.kernel_count[path] = acc
    return out


def _read_counters(metrics_dir: Path, excluded: frozenset[str]) -> dict[int, RankCounters]:
    out: dict[int, RankCounters] = {}
    present = set()
    for name in os.listdir(metrics_dir):
        if not name.endswith(".db") or not name.startswith(("counter_", "histogram_")) or name in excluded:
            continue
        path = os.path.join(metrics_dir, name)
        present.add(path)
        try:
            values, entries = _ENTRIES.read(path)
        except FileNotFoundError:  # wiped between listdir and open
            continue
        except (ValueError, OSError) as exc:  # a corrupt or foreign file: skipped, counted, logged once
            note_skipped_file(name, str(exc))
            continue
        for (field_, rank, a, b), i in entries:
            value = values[i]
            rc = out.get(rank)
            if rc is None:
                rc = out[rank] = RankCounters()
            if field_ == "decisions":
                k = (a, b)
                rc.decisions[k] = rc.decisions.get(k, 0.0) + value
            elif field_ == "tokens":
                rc.tokens[a] = rc.tokens.get(a, 0.0) + value
            elif field_ == "rows":
                k = (a, b)
                rc.rows[k] = rc.rows.get(k, 0.0) + value
            elif field_ == "lpt":
                rc.lpt[a] = rc.lpt.get(a, 0.0) + value
            elif field_ == "kbucket":
                bk = rc.kernel_buckets.setdefault(a, {})
                bk[b] = bk.get(b, 0.0) + value
            elif field_ == "ksum":
                rc.kernel_sum[a] = rc.kernel_sum.get(a, 0.0) + value
            else:
                rc.kernel_count[a] = rc.kernel_count.get(a, 0.0) + value
    _ENTRIES.forget_missing(present)  # files a compaction or a wipe removed
    return out


_ENTRIES: EntryCache[tuple[str, int, str, object]] = EntryCache(_parse_key)
"""Each file's wanted entries and where their values are, parsed once (telemetry.entry_cache):
measured 110 -> 22 ms per /dispatch-stats computation with 64 ranks' files (2-core VM)."""


# ----------------------------------------------------------------------------- derived numbers


def _ratio(num: float, den: float) -> float | None:
    return None if den <= 0 else num / den


def representative(counters: Mapping[int, RankCounters], ranks: Iterable[int]) -> int | None:
    """The rank that stands for an engine: most decisions, ties to the lowest rank."""
    best: tuple[float, int] | None = None
    for r in ranks:
        c = counters.get(r)
        n = c.batches if c is not None else 0.0
        if best is None or n > best[0] or (n == best[0] and r < best[1]):
            best = (n, r)
    return None if best is None else best[1]


def totals_of(counters: Iterable[RankCounters]) -> Totals:
    """Sum of the given ranks' counters (pass one representative per engine)."""
    decisions = {p: 0.0 for p in PATHS}
    reasons = {r: 0.0 for r in REASONS}
    tokens = {p: 0.0 for p in PATHS}
    rows = {p: {k: 0.0 for k in ROW_KINDS} for p in PATHS}
    lpt = {"lpt": 0.0, "plain": 0.0}
    prefill_with_rows = 0.0  # prefill-path batches that had a prefill row
    for c in counters:
        for (p, r), v in c.decisions.items():
            decisions[p] = decisions.get(p, 0.0) + v
            reasons[r] = reasons.get(r, 0.0) + v
            if p == PREFILL and r != NO_PREFILL_ROWS:
                prefill_with_rows += v
        for p, v in c.tokens.items():
            tokens[p] = tokens.get(p, 0.0) + v
        for (p, k), v in c.rows.items():
            kinds = rows.setdefault(p, {})
            kinds[k] = kinds.get(k, 0.0) + v
        for o, v in c.lpt.items():
            lpt[o] = lpt.get(o, 0.0) + v
    batches = sum(decisions.values())
    lpt_batches = lpt.get("lpt", 0.0) + lpt.get("plain", 0.0)
    return Totals(
        batches=round(batches),
        decisions={p: round(v) for p, v in decisions.items()},
        reasons={r: round(v) for r, v in reasons.items()},
        prefill_ratio=_ratio(decisions.get(PREFILL, 0.0), batches),
        prefill_ratio_of_prefill_batches=_ratio(
            prefill_with_rows, batches - reasons.get(NO_PREFILL_ROWS, 0.0)
        ),
        tokens={p: round(v) for p, v in tokens.items()},
        rows={p: {k: round(v) for k, v in kinds.items()} for p, kinds in rows.items()},
        lpt_share=_ratio(lpt.get("lpt", 0.0), lpt_batches),
    )


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets {le: count}: linear within a bucket.

    Falls in the +Inf bucket -> the largest finite bound (as Prometheus does).
    """
    if not buckets:
        return None
    items = sorted(buckets.items())
    total = items[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def kernels_of(counters: Iterable[RankCounters]) -> dict[str, KernelStats]:
    """Per-path kernel time, every given rank's samples pooled (each rank times its own kernels)."""
    buckets: dict[str, dict[float, float]] = {p: {} for p in PATHS}
    sums: dict[str, float] = {p: 0.0 for p in PATHS}
    counts: dict[str, float] = {p: 0.0 for p in PATHS}
    for c in counters:
        for p, b in c.kernel_buckets.items():
            acc = buckets.setdefault(p, {})
            for le, v in b.items():
                acc[le] = acc.get(le, 0.0) + v
        for p, v in c.kernel_sum.items():
            sums[p] = sums.get(p, 0.0) + v
        for p, v in c.kernel_count.items():
            counts[p] = counts.get(p, 0.0) + v
    out = {}
    for p, b in buckets.items():
        n = counts.get(p, 0.0)
        out[p] = KernelStats(
            count=round(n),
            mean_s=_ratio(sums.get(p, 0.0), n),
            p50_s=histogram_quantile(0.5, b) if n > 0 else None,
            p99_s=histogram_quantile(0.99, b) if n > 0 else None,
        )
    return out


# ----------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class CounterSnapshot:
    """All ranks' counters at one monotonic time."""

    time: float
    counters: Mapping[int, RankCounters]


class CounterHistory:
    """A bounded ring of counter snapshots, one every ``interval_s``, covering the longest window.

    Thread-safe: the sampler thread appends while request handlers read.
    """

    def __init__(self, interval_s: float, horizon_s: float = max(WINDOWS.values())) -> None:
        self.interval_s = interval_s
        self._ring: deque[CounterSnapshot] = deque(maxlen=math.ceil(horizon_s / interval_s) + 2)
        self._lock = threading.Lock()

    def add(self, snap: CounterSnapshot) -> None:
        with self._lock:
            self._ring.append(snap)

    def __len__(self) -> int:
        return len(self._ring)

    def baseline(self, now: float, seconds: float) -> tuple[CounterSnapshot | None, bool]:
        """The newest snapshot at least ``seconds`` old (complete window), else the oldest one."""
        with self._lock:
            ring = list(self._ring)
        cutoff = now - seconds
        best = None
        for s in ring:  # oldest first
            if s.time <= cutoff:
                best = s
            else:
                break
        if best is not None:
            return best, True
        return (ring[0] if ring else None), False


def window_of(
    now: CounterSnapshot,
    base: CounterSnapshot | None,
    complete: bool,
    engines: Mapping[int, list[int]],
) -> Window:
    """Totals over (base, now], one representative rank per engine chosen on the window's deltas."""
    if base is None:
        deltas: dict[int, RankCounters] = {}
        span = 0.0
    else:
        deltas = {r: c.minus(base.counters.get(r)) for r, c in now.counters.items()}
        span = max(0.0, now.time - base.time)
    reps = [representative(deltas, ranks) for ranks in engines.values()]
    t = totals_of(deltas[r] for r in reps if r is not None and r in deltas)
    return Window(**t.model_dump(), span_s=round(span, 3), complete=complete)


def take_snapshot(metrics_dir: Path, clock=time.monotonic) -> CounterSnapshot:
    return CounterSnapshot(time=clock(), counters=read_counters(metrics_dir))
