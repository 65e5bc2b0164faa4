"""What the thresholds cost, live: regret, advice and cost-table drift from the ranks' shape samples.

The ranks sample 1 engine step in N (flyserve.telemetry.shape_sample): the rows' query and context
lengths, the path the step ran, when, and (where the rank has one) a measured kernel time. The
sidecar reads those files every second, prices each new sample ONCE with the cost table named at
start (``--costs``), and keeps the priced samples of the last 15 minutes (this module). From them:

* regret per window (1 min, 15 min): the priced seconds of the path each step ran (routed), of the
  faster path per step (oracle), and of always-unified / always-prefill; ``routed/oracle - 1`` is
  the share of attention time the thresholds spent beyond the best per-batch choice. The same
  arithmetic as ``flyserve replay`` (flyserve.lab.replay), over live samples instead of a trace
  (flyserve.sidecar.regret sums the windows).
* advice: calibrate's fitter (flyserve.pricing.fit) run on the window's priced shapes, starting
  from the thresholds in force; only the run-time knobs it changes, never decode_path. The knobs
  fixed at start (decode_path, the KV block size) are priced apart (flyserve.sidecar.restart_advice):
  named with their saving, "needs a restart", never in the ready PATCH (flyserve.sidecar.advice_fit).
* drift: per path, the median over the window of measured / predicted for the samples that carry
  a kernel time. 1.0: the table still describes this GPU and kernel build.

Prices are per attention-layer call of a sampled step: the ratios are what mean something, the
absolute sums are a 1-in-N sample. A table measured for another layer (heads, head size, block
size) prices nothing and says why: pricing 16-head batches with a 32-head table would be a
confident wrong answer.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from flyserve.policy import PREFILL, UNIFIED, Thresholds
from flyserve.pricing.costs import CostModel, CostTable, CostTableError
from flyserve.sidecar.advice_fit import AdviceResult, advise
from flyserve.sidecar.regret import PricedSample, drift_of, summarize
from flyserve.telemetry.shape_sample import ShapeSample

REGRET_WINDOWS: dict[str, float] = {"60s": 60.0, "900s": 900.0}
HORIZON_S = max(REGRET_WINDOWS.values())
POLICIES = ("routed", "oracle", "always_unified", "always_prefill")
SAMPLE_CLOCK_SKEW_S = 5.0
"""A sample dated up to this far ahead of the sidecar's clock (ranks' clocks differ a little) is
taken as dated now; one dated further ahead is dropped, so no sample outlives its window."""


def layer_mismatch(table: CostTable, s: ShapeSample) -> str | None:
    """Why ``table`` cannot price ``s``'s layer, or None. A field the sample does not carry is not
    checked (an older rank); heads are always known."""
    meta = table.meta
    if "num_heads" in meta and int(meta["num_heads"]) != s.num_heads:
        return (
            f"cost table {table.name!r} was measured with {meta['num_heads']} query heads per rank; "
            f"the ranks run {s.num_heads}"
        )
    if s.head_size is not None and "head_size" in meta and int(meta["head_size"]) != s.head_size:
        return f"cost table {table.name!r} was measured with head size {meta['head_size']}; the ranks run {s.head_size}"
    if s.block_size is not None and s.block_size not in table.block_sizes:
        return (
            f"cost table {table.name!r} has no entries for block size {s.block_size} "
            f"(measured: {', '.join(map(str, table.block_sizes))})"
        )
    if s.seq_lens is None:
        return "the ranks' shape samples carry no seq_lens (a rank older than this sidecar): nothing to price"
    return None


class LivePricing:
    """Priced samples of the last 15 minutes; thread-safe (the sampler thread ingests, requests read).

    ``on_priced`` is called with each newly priced sample (the sidecar adds it to the Prometheus
    counters). Samples are keyed by (engine, step): TP ranks sample the same steps, and a file is
    re-read every second; a key seen again with a time more than 5 s apart is a restarted engine.
    """

    def __init__(
        self,
        table: CostTable,
        *,
        clock: Callable[[], float] = time.time,
        on_priced: Callable[[PricedSample], None] | None = None,
    ) -> None:
        self.table = table
        self._clock = clock
        self._on_priced = on_priced
        self._models: dict[int, CostModel] = {}
        self._priced: deque[PricedSample] = deque()
        self._seen: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self.unpriceable: str | None = None  # the latest reason a sample could not be priced
        self.unpriceable_count = 0
        self.future_samples = 0  # samples dated more than SAMPLE_CLOCK_SKEW_S ahead: never priced
        self._uncorroborated: frozenset[tuple[int, int]] = frozenset()

    def _model(self, block_size: int | None) -> CostModel:
        bs = self.table.block_sizes[0] if block_size is None else block_size
        m = self._models.get(bs)
        if m is None:
            m = self._models[bs] = CostModel(self.table, block_size=bs)
        return m

    def price(self, s: ShapeSample, now: float) -> PricedSample | str:
        """The priced sample, or the reason it cannot be priced."""
        why = layer_mismatch(self.table, s)
        if why is not None:
            return why
        try:
            model = self._model(s.block_size)
        except CostTableError as exc:
            return str(exc)
        q = np.asarray(s.query_lens, dtype=np.int64)
        sl = np.asarray(s.seq_lens, dtype=np.int64)
        u = model.predict(q, sl, UNIFIED)
        p = model.predict(q, sl, PREFILL)
        path = s.path if s.path is not None else UNIFIED
        t = min(s.time, now) if s.time is not None else now
        return PricedSample(t, s, u, p, path, p if path == PREFILL else u)

    def ingest(self, samples: Iterable[ShapeSample]) -> int:
        """Price the samples not seen before (oldest step first); drop what left the horizon."""
        now = self._clock()
        new: list[PricedSample] = []
        with self._lock:
            for s in sorted(samples, key=lambda x: (x.engine, x.step)):
                key = (s.engine, s.step)
                t = s.time if s.time is not None else now
                seen = self._seen.get(key)
                if t > now + SAMPLE_CLOCK_SKEW_S:
                    # Dated in the future: it would fill every window until that date
                    # (forged samples 65 s after their file was deleted). Never priced,
                    # and remembered so the same sample is not taken when its date comes.
                    if seen is None:
                        self.future_samples += 1
                        self._seen[key] = t
                    continue
                t = min(t, now)  # within the skew: as fresh as now, no fresher
                if seen is not None and (s.time is None or abs(seen - t) <= 5.0):
                    continue
                self._seen[key] = t
                if t < now - HORIZON_S:
                    continue
                got = self.price(s, now)
                if isinstance(got, str):
                    self.unpriceable, self.unpriceable_count = got, self.unpriceable_count + 1
                    continue
                new.append(got)
            new.sort(key=lambda p: p.time)
            self._priced.extend(new)
            if new and len(self._priced) > len(new) and self._priced[-len(new) - 1].time > new[0].time:
                self._priced = deque(sorted(self._priced, key=lambda p: p.time))
            self._expire(now)
        if self._on_priced is not None:
            for p in new:
                self._on_priced(p)
        return len(new)

    def _expire(self, now: float) -> None:
        cutoff = now - HORIZON_S
        while self._priced and self._priced[0].time < cutoff:
            self._priced.popleft()
        if len(self._seen) > 4 * max(len(self._priced), 1024):
            self._seen = {k: t for k, t in self._seen.items() if t >= cutoff - 10.0}

    def window(self, seconds: float, *, corroborated_only: bool = False) -> list[PricedSample]:
        """The priced samples of the last ``seconds``; with ``corroborated_only``, without the
        ranks set_uncorroborated() named (regret and drift: gauges a forged file must not move)."""
        now = self._clock()
        with self._lock:
            bad = self._uncorroborated if corroborated_only else frozenset()
            return [
                p
                for p in self._priced
                if p.time >= now - seconds and (not bad or (p.sample.engine, p.sample.rank) not in bad)
            ]

    def set_uncorroborated(self, ranks: frozenset[tuple[int, int]]) -> None:
        """(engine, rank)s whose samples their decision counters do not corroborate (flyserve.
        sidecar.sample_evidence, checked by the sampler after each read): left out of regret and
        drift, named in the regret section. Advice checks again itself and refuses instead."""
        with self._lock:
            self._uncorroborated = ranks

    def sample_ranks(self) -> dict[str, int]:
        """Priced samples in the horizon per ``<engine>-<rank>``: whose samples regret and drift use."""
        out: dict[str, int] = {}
        with self._lock:
            for p in self._priced:
                k = f"{p.sample.engine}-{p.sample.rank}"
                out[k] = out.get(k, 0) + 1
        return out

    def regret_drift(self) -> dict[str, float | None]:
        """Per path, the 15-minute median measured / predicted (the drift gauge's value)."""
        d = drift_of(self.window(HORIZON_S, corroborated_only=True))
        return {path: v["median_ratio"] for path, v in d.items()}

    def regret(self) -> dict[str, Any]:
        """The ``regret`` section of /dispatch-stats."""
        windows = {}
        for name, secs in REGRET_WINDOWS.items():
            w = self.window(secs, corroborated_only=True)
            span = (w[-1].time - w[0].time) if len(w) > 1 else 0.0
            windows[name] = summarize(w, span).to_json()
        return {
            "costs": self.table.name,
            "measured_on": {
                k: self.table.meta[k]
                for k in ("gpu", "platform", "kernels", "num_heads", "head_size", "block_size")
                if k in self.table.meta
            },
            "unpriceable": self.unpriceable,
            "unpriceable_samples": self.unpriceable_count,
            "future_samples": self.future_samples,
            "uncorroborated_ranks": sorted(f"{e}-{r}" for e, r in self._uncorroborated),
            "sample_ranks": self.sample_ranks(),
            "windows": windows,
        }

    def advise(self, current: Thresholds, *, window_s: float = 900.0, max_shapes: int = 2048) -> AdviceResult:
        """Fit the run-time knobs to the window's priced shapes: the newest ``max_shapes`` batches
        with a prefill row (the ones the knobs route) and every decode-only batch of the window."""
        w = self.window(window_s)
        keep = {id(p) for p in [p for p in w if p.has_prefill_row][-max_shapes:]}
        return advise(
            [p for p in w if not p.has_prefill_row or id(p) in keep],
            current,
            block_sizes=self.table.block_sizes,
            reprice=self.reprice,
        )

    def reprice(self, s: ShapeSample, block_size: int) -> tuple[float, float] | None:
        """(unified, prefill) seconds of ``s`` at another KV block size, or None if the table cannot."""
        try:
            model = self._model(block_size)
        except CostTableError:
            return None
        q = np.asarray(s.query_lens, dtype=np.int64)
        sl = np.asarray(s.seq_lens, dtype=np.int64)
        return model.predict(q, sl, UNIFIED), model.predict(q, sl, PREFILL)


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x
