"""The threshold fitter: the knob values that minimise total routed time over priced batches.

Shared by ``flyserve calibrate`` (measured grid shapes) and the sidecar's live advice (the
window's sampled shapes priced by the cost model), so it lives outside ``lab``: the sidecar
imports nothing from ``lab``.

The fit (pure numpy, no GPU) minimises the total routed time over the entries: for every
batch the routing picks a path under the candidate thresholds and is charged that path's time.

* ``decode_path`` is fitted on the batches with no prefill row alone (it is the only knob they
  read): the path with the smaller total. ``fit_decode_path=False`` keeps the base's value (a
  running engine captured its CUDA graphs with it; live advice never proposes it).
* The prefill-side knobs (prefill_enabled, min_seq_len, max_seq_len, min_qblock_rows,
  decode_rows_base, decode_ctx_unit) by coordinate descent over candidate values: every
  boundary the entries can tell apart (geometric midpoints between neighbouring values)
  plus "check off" (0). Each knob in turn takes the value with the least total; ties go to the
  most permissive value (the check off, the widest range), so a knob the entries cannot
  tell anything about stays out of the way. Rounds repeat until nothing changes.
* ``max_candidates`` thins each knob's candidate list (live advice: a window of real traffic
  has a boundary between every two distinct context lengths).
* Knobs the entries do not inform (block_m, the LPT rule) come from the base.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flyserve.policy import PREFILL, UNIFIED, Thresholds, ThresholdsError
from flyserve.policy.routing import Rows, paths_under, routed_seconds
from flyserve.pricing.costs import CostEntry

PREFILL_KNOBS = (
    "prefill_enabled",
    "min_seq_len",
    "max_seq_len",
    "min_qblock_rows",
    "decode_rows_base",
    "decode_ctx_unit",
)


def _midpoints(values: Iterable[float]) -> list[int]:
    vs = sorted({float(v) for v in values if v > 0})
    return [m for a, b in itertools.pairwise(vs) if (m := round(math.sqrt(a * b))) > 0]


@dataclass(frozen=True)
class FitReport:
    thresholds: Thresholds
    routed_s: float
    oracle_s: float
    unified_s: float
    prefill_s: float
    decode_unified_s: float
    decode_prefill_s: float
    entries: int
    wrong: int

    @property
    def routed_over_oracle(self) -> float:
        return self.routed_s / self.oracle_s if self.oracle_s else 1.0


def fit_thresholds(
    entries: Sequence[CostEntry],
    *,
    num_heads: int,
    base: Thresholds,
    fit_decode_path: bool = True,
    max_candidates: int | None = None,
) -> FitReport:
    """Fit the knobs to minimise total routed time over ``entries`` (see the module docstring)."""
    if not entries:
        raise ValueError("no entries to fit on")
    qls = [np.asarray(e.query_lens) for e in entries]
    sls = [np.asarray(e.seq_lens) for e in entries]
    tu = np.array([e.seconds[UNIFIED] for e in entries])
    tp = np.array([e.seconds[PREFILL] for e in entries])
    no_prefill = np.array([int(q.max()) < base.min_query_len for q in qls])
    dec_u, dec_p = float(tu[no_prefill].sum()), float(tp[no_prefill].sum())
    t = base.merged({"decode_path": PREFILL if dec_p < dec_u else UNIFIED}) if fit_decode_path else base

    rows = [Rows(q, int(s.max()), num_heads) for q, s in zip(qls, sls, strict=True)]
    prices = list(zip(tu.tolist(), tp.tolist(), strict=True))

    def total(th: Thresholds) -> float:
        return routed_seconds(prices, paths_under(rows, th))

    max_lens = [int(s.max()) for s in sls]
    occupancy = [num_heads * int(q.sum()) / t.block_m for q in qls]
    candidates: dict[str, list[Any]] = {
        "prefill_enabled": [True, False],
        "min_seq_len": [0, *_midpoints(max_lens)],
        "max_seq_len": [0, *sorted(_midpoints(max_lens), reverse=True)],
        "min_qblock_rows": [0, *_midpoints(occupancy)],
        "decode_rows_base": [4096, 1024, 256, 128, 64, 32, 16, 8, 4, 2, 1, 0],
        "decode_ctx_unit": [1024, 2048, 4096, 8192, 16384, 32768, 65536],
    }
    if max_candidates is not None:
        candidates = {k: _thin(v, max_candidates) for k, v in candidates.items()}
    best = total(t)
    for _ in range(6):
        changed = False
        for knob in PREFILL_KNOBS:
            for v in candidates[knob]:
                if v == getattr(t, knob):
                    continue
                try:
                    cand = t.merged({knob: v})
                except ThresholdsError:  # an invalid combination (e.g. min_seq_len > max_seq_len)
                    continue
                cost = total(cand)
                cur_rank = _rank(candidates[knob], getattr(t, knob))
                if cost < best - 1e-12 or (
                    abs(cost - best) <= 1e-12 and _rank(candidates[knob], v) < cur_rank
                ):
                    t, best, changed = cand, cost, True
        if not changed:
            break
    oracle = float(np.minimum(tu, tp).sum())
    wrong = 0
    for (a, b), path in zip(prices, paths_under(rows, t), strict=True):
        chosen = b if path == PREFILL else a
        wrong += int(chosen > min(a, b))
    return FitReport(t, best, oracle, float(tu.sum()), float(tp.sum()), dec_u, dec_p, len(entries), wrong)


def _thin(values: list[Any], k: int) -> list[Any]:
    """At most ``k`` of ``values``: the first ("check off", the most permissive) and evenly spaced
    others. A live window has a boundary between every two distinct context lengths (thousands);
    each candidate costs a pass over every entry, so live advice thins them (a 2056-step trace took
    186 s unthinned on the 2-core CI VM)."""
    if len(values) <= k:
        return values
    rest = values[1:]
    step = (len(rest) - 1) / max(k - 2, 1)
    return [values[0], *dict.fromkeys(rest[round(i * step)] for i in range(k - 1))]


def _rank(cands: list[Any], v: Any) -> int:
    try:
        return cands.index(v)
    except ValueError:
        return len(cands)
