"""A bounded sample of recent batch shapes, per rank: what a dry run replays through decide().

File format (documented in docs/sidecar.md for the vLLM routing): ``<state>/shapes/<engine>-<rank>.jsonl``,
one JSON object per line, newest last, at most ``capacity`` lines, rewritten whole and atomically
(temp file + os.replace) by the rank from time to time, never per step::

    {"step": 1234, "query_lens": [1, 1, 2048, ...], "max_seq_len": 8192, "num_heads": 16, "causal": true,
     "seq_lens": [8000, 301, 2048, ...], "path": "prefill", "time": 1764547200.5,
     "head_size": 128, "block_size": 16, "kernel_s": 0.0061}

Query lengths are kept (not a BatchShape) so a dry run that changes ``block_m`` or
``decode_query_len_max`` re-derives the row counts exactly as a rank would. The rest is what the
sidecar's live pricing needs (flyserve.sidecar.live_costs), each field optional so an older
rank's file still reads: ``seq_lens`` (per-row context including the query: the cost model
prices rows, not the batch), ``path`` (the kernel the step actually ran, breaker and forced path
included), ``time`` (the rank's wall clock, for the 1 min / 15 min windows), ``head_size`` and
``block_size`` (the layer, checked against the cost table), ``kernel_s`` (a measured time of one
call of ``path`` in that step, when the rank has one: the drift check compares it with the
model's prediction).

The writer's ``add`` is one deque append of a tuple the caller already holds; the JSON encoding and
the file write happen in ``flush``, which the rank calls off its step path (the simulator calls it
once a second).

On a vLLM rank ``kernel_s`` comes from the kernel timer (flyserve.telemetry.gpu_timer, per-step
mode): a timed step's harvested time is handed to ``add_kernel_time(step, path, seconds)`` (one
dict store, on timed steps only) and joined with that step's sample in ``flush``, whichever of the
two came first; a CUDA timing harvested a few steps late, or after a flush, still finds its sample
while the sample is in the ring. A timing whose step was not sampled is never written and falls out
of the bounded dict; a timing of another path than the sample's (another attention group's kernel)
is not joined. The time is of ONE layer's attention forward, the unit the cost tables are in
(flyserve.pricing.costs): no scaling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flyserve.files import safe_read
from flyserve.files.atomic import atomic_write
from flyserve.policy.rules import decide
from flyserve.policy.shape import BatchShape
from flyserve.policy.thresholds import Thresholds

SHAPES_DIR = "shapes"
log = logging.getLogger("flyserve.telemetry")


@dataclass(frozen=True, slots=True)
class ShapeSample:
    step: int
    query_lens: tuple[int, ...]
    max_seq_len: int
    num_heads: int
    causal: bool = True
    seq_lens: tuple[int, ...] | None = None
    path: str | None = None
    time: float | None = None
    head_size: int | None = None
    block_size: int | None = None
    kernel_s: float | None = None
    engine: int = 0
    rank: int = 0
    """The rank whose file held the sample (``<engine>-<rank>.jsonl``): what liveness and the
    decision-counter evidence (flyserve.sidecar.sample_evidence) are checked against."""

    def shape(self, t: Thresholds) -> BatchShape:
        return BatchShape.from_query_lens(
            np.asarray(self.query_lens, dtype=np.int64),
            max_seq_len=self.max_seq_len,
            num_heads=self.num_heads,
            causal=self.causal,
            thresholds=t,
        )


def shapes_dir(state_dir: Path) -> Path:
    return Path(state_dir) / SHAPES_DIR


class ShapeSampleWriter:
    """Keeps the last ``capacity`` shapes of one rank in memory; ``flush`` writes them out."""

    def __init__(self, state_dir: Path, *, rank: int, engine: int = 0, capacity: int = 256) -> None:
        self.path = shapes_dir(state_dir) / f"{engine}-{rank}.jsonl"
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self.layer: dict[str, int] = {}  # head_size, block_size once known (set off the step path)
        # step -> (path, seconds) of timed steps, oldest first; at most ``capacity`` entries.
        self._kernel_times: dict[int, tuple[str, float]] = {}
        self._kernel_capacity = capacity

    def set_layer(self, *, head_size: int | None = None, block_size: int | None = None) -> None:
        """What the cost table must match; written on every line (the sidecar reads any one)."""
        self.layer = {
            k: int(v) for k, v in (("head_size", head_size), ("block_size", block_size)) if v is not None
        }

    def add(
        self,
        step: int,
        query_lens: Sequence[int],
        max_seq_len: int,
        num_heads: int,
        causal: bool = True,
        seq_lens: Sequence[int] | None = None,
        path: str | None = None,
        time: float | None = None,
        kernel_s: float | None = None,
    ) -> None:
        """One deque append of what the caller holds; encoding waits for flush()."""
        self._ring.append((step, query_lens, max_seq_len, num_heads, causal, seq_lens, path, time, kernel_s))

    def add_kernel_time(self, step: int, path: str, seconds: float) -> None:
        """The measured time of one attention forward of ``step`` (KernelTimer.on_step_timed).

        Called from the step thread on timed steps only; ``flush`` (another thread) only reads the
        dict, so the eviction here needs no lock."""
        kt = self._kernel_times
        kt[step] = (path, seconds)
        if len(kt) > self._kernel_capacity:
            del kt[next(iter(kt))]

    def flush(self) -> None:
        """Rewrite the file atomically. Errors are swallowed: a missing sample only weakens a dry run."""
        items = list(self._ring)
        layer = self.layer
        kt = self._kernel_times
        lines = []
        for s, q, m, h, c, sl, p, t, k in items:
            if k is None:
                timed = kt.get(s)
                if timed is not None and timed[0] == p:
                    k = timed[1]
            d: dict = {
                "step": s,
                "query_lens": [int(x) for x in q],
                "max_seq_len": int(m),
                "num_heads": int(h),
                "causal": bool(c),
            }
            if sl is not None:
                d["seq_lens"] = [int(x) for x in sl]
            if p is not None:
                d["path"] = p
            if t is not None:
                d["time"] = round(float(t), 3)
            if k is not None:
                d["kernel_s"] = float(k)
            d.update(layer)
            lines.append(json.dumps(d, separators=(",", ":")))
        with contextlib.suppress(OSError):
            text = "\n".join(lines) + ("\n" if lines else "")
            atomic_write(self.path, text, mode=0o600, durable=False)


MAX_SHAPE_FILE_BYTES = 16 << 20
"""A rank file holds at most its ring (256-1024 lines of a few kB): a larger one is refused whole."""
_FILE_NAME = re.compile(r"^([0-9]{1,5})-([0-9]{1,5})\.jsonl$")


def rank_of_file(name: str) -> tuple[int, int] | None:
    """(engine, rank) of a rank file's name ``<engine>-<rank>.jsonl``, or None for any other name."""
    m = _FILE_NAME.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def read_shape_samples(
    state_dir: Path, *, limit: int, live: Collection[tuple[int, int]] | None = None
) -> list[ShapeSample]:
    """Recent shapes from every rank file, newest first overall, at most ``limit``; bad lines skipped.

    All TP ranks of an engine sample the same shapes; files are read in name order, which puts
    one rank per engine first, and duplicates (same engine, same step) are dropped.

    ``live``: the (engine, rank) keys of the ranks that are live now (flyserve.control.reports.
    is_live); a file of any other rank, or whose name is not ``<engine>-<rank>.jsonl``, is not
    read: samples count only from ranks that are running (a forged file of a rank that does not
    exist moved advice). Every file is read with flyserve.files.safe_read: a
    FIFO, a symlink (to /dev/zero) or a file over MAX_SHAPE_FILE_BYTES is skipped, never waited on
    or read without end.
    """
    d = shapes_dir(state_dir)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".jsonl") and not n.startswith("."))
    except OSError:
        return []
    seen: set[tuple[int, int]] = set()
    out: list[ShapeSample] = []
    for name in names:
        key = rank_of_file(name)
        if live is not None and (key is None or key not in live):
            continue
        engine, rank = key if key is not None else (_int_or(name.split("-", 1)[0], 0), 0)
        for s in _read_file(d / name, engine=engine, rank=rank):
            k = (engine, s.step)
            if k in seen:
                continue
            seen.add(k)
            out.append(s)
    out.sort(key=lambda s: s.step, reverse=True)
    return out[:limit]


def _int_or(s: str, default: int) -> int:
    try:
        return int(s)
    except ValueError:
        return default


def _opt(d: dict, key: str, conv):
    v = d.get(key)
    return None if v is None else conv(v)


def _read_file(path: Path, *, engine: int = 0, rank: int = 0) -> Iterator[ShapeSample]:
    """A rank file's samples; a line that does not parse, or whose lengths do not pair up, is skipped
    (rank files are input: one bad line must not hide the others or poison a price). A file that
    safe_read refuses yields nothing and is logged once per reason."""
    try:
        text = safe_read.read_text(path, MAX_SHAPE_FILE_BYTES, source=f"{SHAPES_DIR}/{path.name}")
    except safe_read.SafeReadError as exc:
        _note_refused(exc)
        return
    if text is None:
        return
    for line in text.splitlines():
        try:
            d = safe_read.loads_record(line)
            q = tuple(int(x) for x in d["query_lens"])
            sl = _opt(d, "seq_lens", lambda v: tuple(int(x) for x in v))
            if any(x < 0 for x in q) or (
                sl is not None and (len(sl) != len(q) or any(b < a for a, b in zip(q, sl, strict=True)))
            ):
                continue
            path_ = d.get("path")
            t = _opt(d, "time", float)
            k = _opt(d, "kernel_s", float)
            yield ShapeSample(
                step=int(d["step"]),
                query_lens=q,
                max_seq_len=int(d["max_seq_len"]),
                num_heads=int(d["num_heads"]),
                causal=bool(d.get("causal", True)),
                seq_lens=sl,
                path=path_ if path_ in ("unified", "prefill") else None,
                time=t if t is not None and math.isfinite(t) else None,
                head_size=_opt(d, "head_size", int),
                block_size=_opt(d, "block_size", int),
                kernel_s=k if k is not None and math.isfinite(k) and k > 0 else None,
                engine=engine,
                rank=rank,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue


_REFUSED_SEEN: set[str] = set()


def _note_refused(exc: safe_read.SafeReadError) -> None:
    """One warning per (file, reason): the sampler reads every second and must not flood the log."""
    key = str(exc)
    if key not in _REFUSED_SEEN and len(_REFUSED_SEEN) < 1024:
        _REFUSED_SEEN.add(key)
        log.warning("shape sample refused: %s", exc)


def routing_change(samples: Sequence[ShapeSample], current: Thresholds, proposed: Thresholds) -> dict:
    """Replay ``samples`` through decide() under both thresholds; counts per path and the transitions."""
    cur_paths: dict[str, int] = {"unified": 0, "prefill": 0}
    new_paths: dict[str, int] = {"unified": 0, "prefill": 0}
    transitions: dict[str, int] = {}
    changed = 0
    for s in samples:
        a = decide(s.shape(current), current)
        b = decide(s.shape(proposed), proposed)
        cur_paths[a.path] = cur_paths.get(a.path, 0) + 1
        new_paths[b.path] = new_paths.get(b.path, 0) + 1
        if (a.path, a.reason) != (b.path, b.reason):
            changed += 1
            key = f"{a.path}/{a.reason} -> {b.path}/{b.reason}"
            transitions[key] = transitions.get(key, 0) + 1
    n = len(samples)
    return {
        "samples": n,
        "current": cur_paths,
        "proposed": new_paths,
        "prefill_ratio_current": cur_paths["prefill"] / n if n else None,
        "prefill_ratio_proposed": new_paths["prefill"] / n if n else None,
        "changed": changed,
        "transitions": transitions,
    }
