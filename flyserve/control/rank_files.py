"""ranks/<rank>.json: each rank's report (pid, step, applied version), written by the rank every
second and read by the plane and the sidecar: which files are read, whose they are, and whether
each agrees with what this reader saw before (flyserve.control.witness).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any

from flyserve.control.paths import StateDir
from flyserve.control.reports import CLOCK_SKEW_S, RankReport, parse_report, process_confirmed
from flyserve.control.state_files import read_json_owned
from flyserve.control.witness import StepWitness
from flyserve.files.atomic import atomic_write

MAX_RANK_FILES = 256
"""Rank reports read per look at ranks/: far above any real TP x DP size (which ones: rank_file_order)."""

_RANK_FILE_NAME = re.compile(r"(?:([1-9][0-9]{0,3})-)?(0|[1-9][0-9]{0,3})\.json", re.ASCII)
"""The names StateDir.rank_file writes: ``<rank>.json`` (engine 0), ``<engine>-<rank>.json``,
ASCII digits without leading zeros, so one (engine, rank) has exactly one name."""


def rank_file_order(engine: int, rank: int, confirmed_last_look: bool) -> tuple[int, int, int, int]:
    """Which rank reports are read first when ranks/ holds more than MAX_RANK_FILES candidates:
    those the process table confirmed at the reader's last look, then by key, square by square
    (max(engine, rank), engine, rank). A deployment's own ranks are numbered from 0 (engines
    0..DP-1, ranks 0..TP-1), so with DP and TP of at most 16 they are all read before any other
    name, whatever mtimes or names anyone else writes; larger ones are found as the long-lived
    reader (the sidecar) confirms them. Never by mtime: anyone can date a file."""
    return (0 if confirmed_last_look else 1, max(engine, rank), engine, rank)


class RankReportFiles:
    """The Store's rank reports (a part of flyserve.control.store.Store, which sets ``dir`` and calls
    _init_rank_reading)."""

    dir: StateDir

    def _init_rank_reading(self) -> None:
        # Files in ranks/ not used at the last look: left unread (odd names, past the newest
        # MAX_RANK_FILES) or read and refused (unreadable, implausible). One assignment per look, so
        # a reader never sees parts of two looks (_read_reports).
        self.skipped_rank_files = 0
        # Names whose report the process table confirmed at the last look: read first next time.
        self._confirmed_names: frozenset[str] = frozenset()
        self._witness = StepWitness()
        self._witness_lock = threading.Lock()  # one look at a time (_read_reports)
        self._ranks_dir_sticky = False  # ranks/ checked for its sticky bit (write_rank_report)
        self.confirmed_seen = False
        """Some look of this reader confirmed a rank (flyserve.control.reports.liveness): ranks run
        in its pid namespace, so an unconfirmed report is not taken for a live rank by /readyz."""

    def rank_reports(self, *, now: float | None = None) -> list[dict[str, Any]]:
        """Every ranks/*.json whose fields are all finite and plausible (see reports.parse_report);
        a half-written, foreign or poisoned file is skipped, never fatal."""
        now = time.time() if now is None else now
        return [d for d, r in self._read_reports(now) if r is not None]

    def reports(self, *, now: float | None = None) -> list[RankReport]:
        """The validated reports (flyserve.control.reports.RankReport)."""
        now = time.time() if now is None else now
        return [r for _, r in self._read_reports(now) if r is not None]

    def read_rank_reports(self, *, now: float | None = None) -> list[tuple[dict[str, Any], RankReport]]:
        """One look: each validated report with its JSON object (for views that show its fields)."""
        now = time.time() if now is None else now
        return [(d, r) for d, r in self._read_reports(now) if r is not None]

    def _rank_file_names(self) -> tuple[list[str], int]:
        """The rank report names worth reading, at most MAX_RANK_FILES (see
        rank_file_order), and how many other entries ranks/ holds. 20,000 stale files once made a
        PATCH hold the writers' lock for 5 s; 300 files dated an hour ahead once pushed the live
        ranks out of "the 256 newest by mtime": mtimes are anyone's to set, so they decide nothing
        but that a file dated in the future is skipped.
        Dot files (a rank's own atomic-write temp file, an NFS silly-rename) are neither read nor
        counted."""
        try:
            entries = list(os.scandir(self.dir.ranks_dir))
        except OSError:
            return [], 0
        latest = time.time() + CLOCK_SKEW_S  # mtimes are the file system's: the real clock, not a plane's
        keyed: list[tuple[tuple[int, int, int, int], str]] = []
        others = 0
        for e in entries:
            if e.name.startswith("."):
                continue
            m = _RANK_FILE_NAME.fullmatch(e.name)
            if m is None:
                others += 1
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:  # gone since the scan
                continue
            if st.st_mtime > latest:
                others += 1
                continue
            engine, rank = int(m.group(1) or 0), int(m.group(2))
            keyed.append((rank_file_order(engine, rank, e.name in self._confirmed_names), e.name))
        keyed.sort()
        others += max(0, len(keyed) - MAX_RANK_FILES)
        return [n for _, n in keyed[:MAX_RANK_FILES]], others

    def _trusted_uids(self) -> frozenset[int]:
        """Whose rank report files may be confirmed: the reader's own uid and the state directory's
        owner. A process of any other uid that can write in ranks/ could name its own live pid."""
        uids = {os.geteuid()}
        with contextlib.suppress(OSError):
            uids.add(os.stat(self.dir.path).st_uid)
        return frozenset(uids)

    def _read_reports(self, now: float) -> list[tuple[dict[str, Any], RankReport | None]]:
        out: list[tuple[dict[str, Any], RankReport | None]] = []
        names, skipped = self._rank_file_names()
        trusted = self._trusted_uids()
        for n in names:
            try:
                got = read_json_owned(self.dir.ranks_dir / n)
            except (OSError, ValueError):
                skipped += 1
                continue
            if got is not None:
                d, uid = got
                r = parse_report(d, now=now, file_uid=uid, foreign_writer=uid not in trusted)
                if r is not None and self.dir.rank_file(r.rank, r.engine).name != n:
                    r = None  # a report under another rank's name: one key, one file
                out.append((d, r))
        # A report must agree with what this reader saw of the same key (control.witness): a
        # contradicting one is replaced by the key's last credible report.
        # The witness is shared by every thread of this reader (probes, sampler, compactor,
        # requests): its look and the refused count it leaves are read as one step under
        # _witness_lock, or two looks lose each other's observations and one reads the other's
        # count. The process table is asked before taking it (the look itself is in memory).
        found = [(d, r) for d, r in out if r is not None]
        confirmed = {id(r): process_confirmed(r) for _, r in found}

        def is_confirmed(r: RankReport) -> bool:
            got = confirmed.get(id(r))
            return process_confirmed(r) if got is None else got

        with self._witness_lock:
            judged = self._witness.look(found, now, is_confirmed)
            refused = self._witness.refused
        skipped += sum(r is None for _, r in out) + refused
        out = [(d, r) for d, r in out if r is None] + list(judged)
        self.skipped_rank_files = skipped
        self._confirmed_names = frozenset(
            self.dir.rank_file(r.rank, r.engine).name for _, r in judged if is_confirmed(r)
        )
        self.confirmed_seen = self.confirmed_seen or bool(self._confirmed_names)
        return out

    def live_ranks(self, *, stale_after_s: float = 30.0, now: float | None = None) -> int:
        """How many ranks are live (fresh report, process not known to be gone)."""
        now = time.time() if now is None else now
        return sum(1 for r in self.reports(now=now) if r.is_live(now, stale_after_s))

    def max_rank_step(self, *, stale_after_s: float = 30.0, now: float | None = None) -> int:
        """The highest step a live rank reported."""
        now = time.time() if now is None else now
        return max((r.step for r in self.reports(now=now) if r.is_live(now, stale_after_s)), default=0)

    def write_rank_report(self, report: Mapping[str, Any], *, rank: int, engine: int = 0) -> None:
        if not self._ranks_dir_sticky:
            self._make_ranks_dir_sticky()
        atomic_write(self.dir.rank_file(rank, engine), json.dumps(dict(report), sort_keys=True))

    def _make_ranks_dir_sticky(self) -> None:
        """Create ranks/ and give it the sticky bit (when this process owns it), once per Store: in a
        sticky directory only a file's owner may rename over it or remove it, so another uid that
        can write in ranks/ cannot replace a rank's own report with a forgery (see
        control.effective "Where it does not hold"). A directory this process does not own, or a
        file system that refuses the bit, is left as it is."""
        self._ranks_dir_sticky = True
        with contextlib.suppress(OSError):
            self.dir.ranks_dir.mkdir(parents=True, exist_ok=True)
            st = os.stat(self.dir.ranks_dir)
            if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
                os.chmod(self.dir.ranks_dir, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)
