"""The Prometheus text of every process's metric files, merged as prometheus_client merges them,
at a fraction of its cost.

prometheus_client's ``MultiProcessCollector`` plus ``generate_latest`` took 220-350 ms of CPU for
64 ranks' files (711 KB of text, cProfile on the 2-core VM): every scrape JSON-parses every key of
every file again, builds a ``Sample`` per entry and formats each line from scratch. Here:

* a file's entries are append-only and never move, so each file's (key, value offset) list is
  parsed once and extended when its used size grows; a scrape only reads the values;
* a key is parsed once per process (bounded cache), with its line prefix (``name{labels} ``)
  rendered once;
* merging is one dict update per entry, with prometheus_client's semantics: counters and
  histograms summed (buckets made cumulative, ``_count`` the +Inf bucket), gauges by their
  multiprocess mode (the pid label kept for ``all``/``liveall`` only).

The output has the same lines as ``generate_latest`` over ``SoundFilesCollector`` (HELP, TYPE and
sample lines; tests/unit/test_telemetry_compaction.py compares them), in another order. A
file that cannot be read is left out and counted like SoundFilesCollector does.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from flyserve.telemetry.compaction import parse_name, reading
from flyserve.telemetry.multiprocess import note_skipped_file
from flyserve.telemetry.prom import entry_offsets, float_text, read_used

_KEY_CACHE_MAX = 200_000
_FILE_CACHE_MAX = 100_000


@dataclass(frozen=True, slots=True)
class _Key:
    """One parsed file key, with what rendering it needs precomputed: its line prefix
    (``name{labels} ``), and for a histogram bucket its bound and its series (``group``, a string
    so the per-scrape dict work hashes cached strings, not tuples)."""

    metric: str
    help: str
    prefix: str
    le: float | None  # a histogram bucket's bound
    group: str  # a bucket's series without le (its _count line's prefix); "" otherwise


def _bound(k: _Key) -> float:
    """A bucket key's bound: set wherever ``group`` is (FilesExposition._key), so on every key
    of a bucket series."""
    if k.le is None:
        raise ValueError(f"not a histogram bucket key: {k.prefix!r}")
    return k.le


def _escape_label(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n")


def _labels_text(labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return "{" + inner + "}" if inner else ""


class FilesExposition:
    """Thread-safe; one per metrics directory (the sidecar's /metrics holds one)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._keys: dict[str, _Key | None] = {}
        # file name -> (inode, used size, [(key, value index)])
        self._files: dict[str, tuple[int, int, list[tuple[str, int]]]] = {}
        self._order: dict[str, list[str]] = {}  # bucket series -> its keys by bound
        self._texts: dict[float, str] = {}

    def _key(self, key: str) -> _Key | None:
        k = self._keys.get(key, self._keys)
        if k is not self._keys:
            return k  # type: ignore[return-value]
        try:
            metric, sample, labels, help_text = json.loads(key)
            pairs = sorted((str(a), str(b)) for a, b in labels.items())
            le = None
            group = ""
            if "le" in labels and str(sample).endswith("_bucket"):
                le = float(labels["le"])
                without = [(a, b) for a, b in pairs if a != "le"]
                group = f"{metric}_count{_labels_text(without)} "
            parsed: _Key | None = _Key(
                str(metric), str(help_text), f"{sample}{_labels_text(pairs)} ", le, group
            )
        except (ValueError, TypeError, AttributeError, RecursionError):
            # RecursionError: a key nested thousands deep ('[' * 50000); the file is skipped and
            # counted like any corrupt one, never a 500 on every scrape.
            raise ValueError("a key that is not prometheus_client's JSON") from None
        if len(self._keys) < _KEY_CACHE_MAX:
            self._keys[key] = parsed
        return parsed

    def _entries(self, name: str) -> tuple[memoryview[float], list[tuple[str, int]]]:
        """The file's float64 view and its entries; reparses only what was appended."""
        st, data = read_used(os.path.join(self.path, name))  # via safe_read.open_regular; size-capped
        if not data:
            return memoryview(b"").cast("d"), []
        used = len(data)
        hit = self._files.get(name)
        if hit is not None and hit[0] == st.st_ino and hit[1] <= used:
            new = entry_offsets(data, hit[1], used) if hit[1] < used else []
            entries = hit[2] + new if new else hit[2]
        else:
            new = entries = entry_offsets(data, 8, used)
        for key, _ in new:
            self._key(key)  # a bad key fails the file now, before it is cached
        if len(self._files) < _FILE_CACHE_MAX or name in self._files:
            self._files[name] = (st.st_ino, used, entries)
        return memoryview(data[: used - used % 8]).cast("d"), entries

    def text(self) -> bytes:
        """The merged exposition of every sound file in the directory (read under the read lock)."""
        with self._lock, reading(self.path) as excluded:
            return self._text(excluded)

    def _text(self, excluded: frozenset[str]) -> bytes:
        types: dict[str, tuple[str, str]] = {}  # metric -> (type, help), in first-seen order
        sums: dict[str, float] = {}  # file key -> summed value (counters, histogram sums)
        buckets: dict[str, dict[str, float]] = {}  # bucket series (group) -> file key -> count
        gauges: dict[str, tuple[float, float, str]] = {}  # key (+ pid) -> (value, timestamp, key)
        key_of = self._key
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:  # removed under us: nothing to show (the sidecar re-creates it)
            return b""
        present = set(names)
        for gone in [n for n in self._files if n not in present]:  # merged by a compaction, or wiped
            del self._files[gone]
        for name in names:
            if not name.endswith(".db") or name in excluded:
                continue
            mf = parse_name(name)
            if mf is None:
                continue
            try:
                values, entries = self._entries(name)
            except FileNotFoundError:
                continue
            except (ValueError, OSError) as exc:
                note_skipped_file(name, str(exc))
                continue
            if mf.kind == "gauge":
                self._gauges(mf.mode, mf.pid, values, entries, types, gauges)
                continue
            typ = mf.kind
            for key, i in entries:
                k = key_of(key)
                if k is None:
                    continue
                if k.metric not in types:
                    types[k.metric] = (typ, k.help)
                if k.group and typ == "histogram":
                    b = buckets.get(k.group)
                    if b is None:
                        b = buckets[k.group] = {}
                    b[key] = b.get(key, 0.0) + values[i]
                else:
                    sums[key] = sums.get(key, 0.0) + values[i]
        return self._render(types, sums, buckets, gauges)

    def _gauges(
        self,
        mode: str,
        pid: str,
        values: memoryview[float],
        entries: list[tuple[str, int]],
        types: dict[str, tuple[str, str]],
        gauges: dict[str, tuple[float, float, str]],
    ) -> None:
        """Merge one gauge file by its multiprocess mode (prometheus_client's rules)."""
        keep_pid = mode in ("all", "liveall")
        for key, i in entries:
            k = self._key(key)
            if k is None:
                continue
            if k.metric not in types:
                types[k.metric] = ("gauge", k.help)
            sid = key + "\0" + pid if keep_pid else key
            v, ts = values[i], values[i + 1]
            old = gauges.get(sid)
            if old is None:
                if mode.endswith("mostrecent") and not ts:
                    continue  # prometheus_client shows a mostrecent gauge only with a timestamp
                gauges[sid] = (v, ts, key)
            elif mode in ("min", "livemin"):
                if v < old[0]:
                    gauges[sid] = (v, ts, key)
            elif mode in ("max", "livemax"):
                if v > old[0]:
                    gauges[sid] = (v, ts, key)
            elif mode in ("sum", "livesum"):
                gauges[sid] = (old[0] + v, ts, key)
            elif mode.endswith("mostrecent"):
                if ts > old[1]:
                    gauges[sid] = (v, ts, key)
            else:
                gauges[sid] = (v, ts, key)

    def _value_text(self, v: float) -> str:
        """float_text with a bounded cache: most values (counts) repeat from scrape to scrape."""
        t = self._texts.get(v)
        if t is None:
            t = float_text(v)
            if not math.isnan(v) and len(self._texts) < _KEY_CACHE_MAX:  # a NaN key is never found again
                self._texts[v] = t
        return t

    def _parsed(self, key: str) -> _Key:
        """A key's _Key: from the cache, or parsed again when the cache was full when the key was
        first read (it parsed then, so it parses now)."""
        k = self._keys.get(key)
        return k if k is not None else self._key(key)  # type: ignore[return-value]

    def _render(
        self,
        types: dict[str, tuple[str, str]],
        sums: dict[str, float],
        buckets: dict[str, dict[str, float]],
        gauges: dict[str, tuple[float, float, str]],
    ) -> bytes:
        keys = self._parsed  # never self._keys[...]: keys read after the cache filled are not in it
        text = self._value_text
        by_metric: dict[str, list[str]] = {m: [] for m in types}
        for key, v in sums.items():
            k = keys(key)
            by_metric[k.metric].append(k.prefix + text(v) + "\n")
        for sid, (v, _ts, key) in gauges.items():
            k = keys(key)
            prefix = k.prefix
            if "\0" in sid:  # all/liveall: the pid label, after the others as prometheus_client puts it
                pid = sid.rsplit("\0", 1)[1]
                prefix = (
                    prefix[:-2] + f',pid="{pid}"}} '
                    if prefix.endswith("} ")
                    else prefix[:-1] + f'{{pid="{pid}"}} '
                )
            by_metric[k.metric].append(prefix + text(v) + "\n")
        for group, b in buckets.items():
            order = self._order.get(group)
            if order is None or len(order) != len(b) or any(key not in b for key in order):
                order = sorted(b, key=lambda key: _bound(keys(key)))
                if len(self._order) < _KEY_CACHE_MAX:
                    self._order[group] = order
            out = by_metric[keys(order[0]).metric]
            acc = 0.0
            for key in order:
                acc += b[key]
                out.append(keys(key).prefix + text(acc) + "\n")
            out.append(group + text(acc) + "\n")
        parts = []
        for metric, (typ, help_text) in types.items():
            name = metric + "_total" if typ == "counter" else metric
            parts.append(f"# HELP {name} {_escape_help(help_text)}\n# TYPE {name} {typ}\n")
            parts.extend(by_metric[metric])
        return "".join(parts).encode()
