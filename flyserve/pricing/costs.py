"""Measured cost tables and the interpolating cost model that replays traces without a GPU.

A cost table (``config/costs/<name>.json``, written by ``flyserve calibrate``) holds the measured
time of ONE attention call (one layer) per kernel path for a grid of batch shapes, plus what it
was measured on (GPU, kernels, heads, block size). Entries have a ``kind``:

* ``decode``: R rows of query_len 1, all at one context length (the (R, ctx) grid);
* ``prefill``: one row of q query tokens after p tokens of earlier context (seq_len = p + q; the
  (q, p) grid);
* ``mixed``: anything else (decode rows plus chunks, several prompts). Not interpolated: used to
  fit the thresholds and to check the model (``CostModel.check``).

The model prices a batch as the sum of its parts, because both kernels process every row of a
varlen batch in one launch and their time is close to additive in the rows' work. Measured on the
H200 (tests/data/h200_vllm_kernel_pair.json): FA3 chunk 8k@32k 5.86 ms + 32 decode rows @32k
0.96 ms = 6.82 ms predicted, 6.89 ms measured together; Triton unified 48.69 + 1.84 = 50.5 vs 49.9.

    t(batch) = D(R_decode, mean decode ctx) + sum_i P(q_i, p_i) - o * (parts - 1)

* D: per grid value of R, piecewise linear in ctx (decode reads the KV cache: time is affine in
  context), extrapolated linearly past the ends; between grid values of R, linear in log(t) over
  log(R); beyond the largest R, proportional to R.
* P: per grid value of q, piecewise linear in p (a chunk's work is q*p + q*q/2: affine in p);
  between grid values of q, linear in log(t) over log(q); beyond the largest q, the last
  segment's log-log slope; below the smallest q, the smallest q's time (a floor).
* o: the path's launch floor, the smallest measured decode time; subtracted once per extra part
  so a batch is not charged one launch per row. The result is never below its largest part.

Rows shorter than the prefill grid's smallest q (speculative-decode rows of a few tokens) are
counted as decode rows: such a row reads its KV cache once, like a decode row, and its extra
query tokens are nearly free while the call is memory-bound (H200: 32 rows of 4 tokens @32k took
FA3 0.958 ms vs 0.956 ms for 32 decode rows, Triton unified 2.07 vs 1.84 ms).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flyserve.files import safe_read
from flyserve.policy.vocabulary import PATHS

KINDS = ("decode", "prefill", "mixed")
_PACKAGE_COSTS = Path(__file__).resolve().parent.parent / "costs"  # inside a built wheel
_REPO_COSTS = Path(__file__).resolve().parents[2] / "config" / "costs"  # source tree


class CostTableError(ValueError):
    """A cost table was rejected; the message names the entry and field, never the value."""


MAX_COSTS_BYTES = 16 << 20
"""A cost table of the default grid is 74 kB; a larger file than this is refused unread."""
MAX_COST_MS = 1e6
"""The largest time one attention call may cost in a table: 1000 s. Anything above is a typo or an
attack (a table of 1e308 ms summed to near overflow and priced every batch as infinite)."""
MAX_TOKENS = 1 << 24
"""Query and context lengths above 16M tokens are not a shape any engine runs."""
_META_INTS: dict[str, int] = {
    "num_heads": 4096,
    "num_kv_heads": 4096,
    "head_size": 4096,
    "block_size": 1 << 16,
}
"""Layer fields of ``meta`` (and an entry's ``block_size``): positive integers of at most this."""


def _check_meta(meta: dict[str, Any], where: str) -> None:
    """The layer fields a table is matched and priced by: positive bounded integers (never echoed)."""
    for key, hi in _META_INTS.items():
        if key in meta:
            _check_int(meta[key], f"{where}: field 'meta.{key}'", hi)
    if "block_sizes" in meta:
        bs = meta["block_sizes"]
        if not isinstance(bs, list) or len(bs) > 64:
            raise CostTableError(f"{where}: field 'meta.block_sizes' must be a list of at most 64 integers")
        for i, v in enumerate(bs):
            _check_int(v, f"{where}: field 'meta.block_sizes[{i}]'", _META_INTS["block_size"])


def _check_int(v: Any, what: str, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise CostTableError(f"{what} must be an integer from 1 to {hi}")


@dataclass(frozen=True, slots=True)
class CostEntry:
    """One measured batch: per-row query and context lengths, and seconds per path."""

    kind: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    seconds: Mapping[str, float]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "query_lens": list(self.query_lens),
            "seq_lens": list(self.seq_lens),
            "ms": {p: round(s * 1e3, 6) for p, s in self.seconds.items()},
            **dict(self.extra),
        }


@dataclass(frozen=True)
class CostTable:
    """A named, measured cost table. ``meta`` says what it was measured on."""

    name: str
    meta: Mapping[str, Any]
    entries: tuple[CostEntry, ...]

    @property
    def num_heads(self) -> int:
        return int(self.meta.get("num_heads", 32))

    def block_size_of(self, e: CostEntry) -> int:
        """An entry's KV block size: its own ``block_size`` field, else the table's."""
        return int(e.extra.get("block_size", self.meta.get("block_size", 16)))

    @property
    def block_sizes(self) -> list[int]:
        """Block sizes present, the table's primary one (meta.block_size) first."""
        seen = list(dict.fromkeys(self.block_size_of(e) for e in self.entries))
        primary = self.meta.get("block_size")
        if primary in seen:
            seen.remove(primary)
            seen.insert(0, primary)
        return seen

    def to_json(self) -> str:
        doc = {
            "format": "flyserve-costs",
            "version": 1,
            "meta": dict(self.meta),
            "entries": [e.to_json() for e in self.entries],
        }
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, name: str, source: str | None = None) -> CostTable:
        """Parse and validate a table (flyserve.files.safe_read.parse_json: depth and number caps,
        so deep nesting, a 400-digit integer or 1e400 is an error naming the field)."""
        where = source or name
        try:
            doc = safe_read.parse_json(text, source=where, max_depth=8)
        except safe_read.SafeReadError as exc:
            raise CostTableError(str(exc)) from None
        if not isinstance(doc, dict) or doc.get("format") != "flyserve-costs":
            raise CostTableError(f"{where}: field 'format' must be 'flyserve-costs'")
        if doc.get("version") != 1:
            raise CostTableError(f"{where}: field 'version' must be 1")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise CostTableError(f"{where}: field 'meta' must be an object")
        _check_meta(meta, where)
        raw = doc.get("entries")
        if not isinstance(raw, list) or not raw:
            raise CostTableError(f"{where}: field 'entries' must be a non-empty list")
        entries = tuple(_parse_entry(e, f"{where}: entries[{i}]") for i, e in enumerate(raw))
        return cls(name, meta, entries)


def _parse_entry(e: Any, where: str) -> CostEntry:
    if not isinstance(e, dict):
        raise CostTableError(f"{where}: must be an object")
    kind = e.get("kind")
    if kind not in KINDS:
        raise CostTableError(f"{where}: field 'kind' must be one of {KINDS}")
    q, s = e.get("query_lens"), e.get("seq_lens")
    for key, v in (("query_lens", q), ("seq_lens", s)):
        if (
            not isinstance(v, list)
            or not v
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_TOKENS for x in v)
        ):
            raise CostTableError(
                f"{where}: field '{key}' must be a non-empty list of integers from 0 to {MAX_TOKENS}"
            )
    if len(q) != len(s) or any(b < a for a, b in zip(q, s, strict=True)):
        raise CostTableError(
            f"{where}: fields 'query_lens'/'seq_lens' must pair up with seq_len >= query_len"
        )
    ms = e.get("ms")
    if not isinstance(ms, dict) or set(ms) != set(PATHS):
        raise CostTableError(f"{where}: field 'ms' must map each of {PATHS} to milliseconds")
    for p, v in ms.items():
        if (
            not isinstance(v, int | float)
            or isinstance(v, bool)
            or not math.isfinite(v)
            or not 0 < v <= MAX_COST_MS
        ):
            raise CostTableError(
                f"{where}: field 'ms.{p}' must be a number of milliseconds above 0, at most {MAX_COST_MS:g}"
            )
    if "block_size" in e:
        _check_int(e["block_size"], f"{where}: field 'block_size'", _META_INTS["block_size"])
    if kind == "decode" and (any(x != 1 for x in q) or len(set(s)) != 1):
        raise CostTableError(f"{where}: a 'decode' entry has query_len 1 rows at one seq_len")
    if kind == "prefill" and (len(q) != 1 or q[0] < 2):
        raise CostTableError(f"{where}: a 'prefill' entry has exactly one row with query_len >= 2")
    extra = {k: v for k, v in e.items() if k not in ("kind", "query_lens", "seq_lens", "ms")}
    return CostEntry(kind, tuple(q), tuple(s), {p: float(v) / 1e3 for p, v in ms.items()}, extra)


# ----------------------------------------------------------------------------- lookup by name


def costs_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("FLYSERVE_COSTS_PATH", "").split(os.pathsep) if p]
    return dirs + [d for d in (_PACKAGE_COSTS, _REPO_COSTS) if d.is_dir()]


def available_costs() -> list[str]:
    return sorted({p.stem for d in costs_dirs() for p in d.glob("*.json")})


def load_costs(name_or_path: str | Path) -> CostTable:
    """A committed table by name (``h200``) or a cost-table JSON file by path."""
    s = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in s or s.endswith(".json"):
        path = Path(s)
    else:
        found = [d / f"{s}.json" for d in costs_dirs() if (d / f"{s}.json").is_file()]
        if not found:
            raise CostTableError(
                f"unknown cost table {s!r} (available: {', '.join(available_costs()) or 'none'})"
            )
        path = found[0]
    # One reader for operator files (flyserve.files.safe_read): a FIFO is refused at once instead
    # of hanging start, a link to /dev/zero is refused instead of read without end. A link to a
    # regular file is followed (a Kubernetes ConfigMap mounts files as links).
    where = path.name
    try:
        raw = safe_read.read_bytes(path, MAX_COSTS_BYTES, source=where, follow_symlinks=True)
    except safe_read.SafeReadError as exc:
        raise CostTableError(str(exc)) from None
    if raw is None:
        raise CostTableError(f"{where}: no such file")
    return CostTable.from_json(raw, name=path.stem, source=where)


# ----------------------------------------------------------------------------- the model


class _Curve:
    """Piecewise-linear y(x) over sorted points, linear extrapolation from the end segments."""

    __slots__ = ("xs", "ys")

    def __init__(self, pts: Iterable[tuple[float, float]]) -> None:
        pts = sorted(pts)
        self.xs = [p[0] for p in pts]
        self.ys = [p[1] for p in pts]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class _Grid:
    """t(a, b): per grid value of ``a`` a _Curve in ``b``; across ``a`` log-log interpolation."""

    def __init__(self, pts: dict[tuple[int, int], float], *, above: str) -> None:
        by_a: dict[int, list[tuple[float, float]]] = {}
        for (a, b), t in pts.items():
            by_a.setdefault(a, []).append((float(b), t))
        self.a_vals = sorted(by_a)
        self.curves = [_Curve(by_a[a]) for a in self.a_vals]
        self.above = above  # 'proportional' or 'slope'
        self.floor = min(pts.values())

    def _at(self, i: int, b: float) -> float:
        return max(self.curves[i](b), self.floor * 0.5)

    def __call__(self, a: float, b: float) -> float:
        av = self.a_vals
        if a <= av[0]:
            return self._at(0, b)
        if a >= av[-1]:
            top = self._at(len(av) - 1, b)
            if a == av[-1]:
                return top
            if self.above == "proportional" or len(av) == 1:
                return top * a / av[-1]
            prev = self._at(len(av) - 2, b)
            slope = math.log(top / prev) / math.log(av[-1] / av[-2])
            return top * (a / av[-1]) ** slope
        j = bisect.bisect_right(av, a) - 1
        t0, t1 = self._at(j, b), self._at(j + 1, b)
        w = math.log(a / av[j]) / math.log(av[j + 1] / av[j])
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


class CostModel:
    """Prices any batch from a CostTable (see the module docstring for the method)."""

    def __init__(self, table: CostTable, *, block_size: int | None = None) -> None:
        self.table = table
        sizes = table.block_sizes
        self.block_size = sizes[0] if block_size is None else block_size
        if self.block_size not in sizes:
            raise CostTableError(f"{table.name}: no entries for block size {block_size} (has {sizes})")
        self.entries = tuple(e for e in table.entries if table.block_size_of(e) == self.block_size)
        self._decode: dict[str, _Grid] = {}
        self._prefill: dict[str, _Grid] = {}
        self._floor: dict[str, float] = {}
        self._short_q: dict[str, int] = {}
        for path in PATHS:
            dec = {
                (len(e.query_lens), e.seq_lens[0]): e.seconds[path]
                for e in self.entries
                if e.kind == "decode"
            }
            pre = {
                (e.query_lens[0], e.seq_lens[0] - e.query_lens[0]): e.seconds[path]
                for e in self.entries
                if e.kind == "prefill"
            }
            if not dec or not pre:
                raise CostTableError(
                    f"{table.name}: needs both 'decode' and 'prefill' entries to build a model"
                )
            self._decode[path] = _Grid(dec, above="proportional")
            self._prefill[path] = _Grid(pre, above="slope")
            self._floor[path] = min(dec.values())
            self._short_q[path] = min(q for q, _ in pre)

    def predict(self, query_lens: np.ndarray, seq_lens: np.ndarray, path: str) -> float:
        """Seconds for one attention call of this batch on ``path``."""
        dec = query_lens < self._short_q[path]
        parts: list[float] = []
        n_dec = int(np.count_nonzero(dec))
        if n_dec:
            parts.append(self._decode[path](n_dec, float(seq_lens[dec].mean())))
        if n_dec < query_lens.size:
            grid = self._prefill[path]
            for q, s in zip(query_lens[~dec].tolist(), seq_lens[~dec].tolist(), strict=True):
                parts.append(grid(q, s - q))
        if not parts:
            return 0.0
        total = sum(parts) - self._floor[path] * (len(parts) - 1)
        return max(total, max(parts))

    def check(self) -> list[dict[str, Any]]:
        """Predicted vs measured for every entry (the grid points reproduce; mixed ones test the model)."""
        out = []
        for e in self.entries:
            q, s = np.asarray(e.query_lens), np.asarray(e.seq_lens)
            row: dict[str, Any] = {
                "kind": e.kind,
                "rows": len(q),
                "tokens": int(q.sum()),
                "max_seq_len": int(s.max()),
            }
            for p in PATHS:
                pred = self.predict(q, s, p)
                row[f"{p}_ms"] = e.seconds[p] * 1e3
                row[f"{p}_pred_ms"] = pred * 1e3
                row[f"{p}_err"] = pred / e.seconds[p] - 1.0
            out.append(row)
        return out
