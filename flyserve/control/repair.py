"""repair(plane): make a state directory consistent again from whatever is readable in it.

Run by the sidecar at start and by `flyserve thresholds repair`. Under the writers' lock it:

1. removes temp files a killed writer left (``control/.*.tmp``, ``history/.*.tmp``);
2. sets aside history files that fail their checks (renamed ``*.json.bad``: their version numbers
   still count, so no later version reuses one) and names that carry no valid version number
   (renamed ``*.stray``: they never count);
3. rebuilds a missing or damaged current.json from the newest intact history entry, or, with none,
   publishes the profile's values above every version on record (the overrides are then lost, and
   the report says so);
3a. a current.json whose version does not continue the versions on record (control.version_trust:
   a forged 10**18 - 2 once pinned every change) counts as damaged, and is rebuilt from the newest
   history entry that does;
4. removes history files above the current version (written by a writer killed before it made
   them current: no rank ever saw them), and sets aside as ``*.stray`` those that do not continue
   the versions on record;
5. completes write-ahead audit lines ('publishing') that have no completion: 'success' with
   ``recovered: true`` when the version was in force, 'abandoned' when it never was - judged by
   current.json, the confirmed ranks' applied versions and the later audit entries, not by whether
   its history file still exists (_was_in_force).

Every step is logged and the whole repair is one audit entry naming what it dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.control.reports import Liveness, liveness
from flyserve.control.snapshot import ConfigSnapshot

log = logging.getLogger("flyserve.control")


@dataclass(frozen=True, slots=True)
class RepairReport:
    """What repair() did (``actions``) and what it dropped, and the version current afterwards."""

    version: int
    actions: tuple[str, ...]
    dropped: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.actions or self.dropped)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "actions": list(self.actions), "dropped": list(self.dropped)}


# A rank's report temp file (ranks/.<rank>.json.*.tmp) lives for the milliseconds of its atomic
# write; one older than this was left by a rank killed mid-write.
RANK_TEMP_MAX_AGE_S = 60.0


def _remove_temp_files(plane: Any, dropped: list[str]) -> None:
    sd = plane.state_dir
    now = time.time()
    for d in (sd.control_dir, sd.history_dir, sd.ranks_dir):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if n.startswith(".") and n.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if d == sd.ranks_dir and now - os.lstat(d / n).st_mtime < RANK_TEMP_MAX_AGE_S:
                        continue  # a live rank may be writing it (the writers' lock is not theirs)
                    os.unlink(d / n)
                    dropped.append(f"temp file {d.name}/{ascii(n)[1:-1][:80]}")


def _set_aside_stray_names(plane: Any, dropped: list[str]) -> None:
    """history/*.json names that carry no valid version ('²³.json', a 30-digit number) are renamed
    '*.stray': they were never versions and never count as one."""
    hist = plane.state_dir.history_dir
    for n in plane.store.stray_history_names():
        with contextlib.suppress(OSError):
            os.replace(hist / n, hist / (n + ".stray"))
            dropped.append(f"history file {ascii(n)[1:-1][:80]} (not a version number), kept as *.stray")


def _set_aside_bad_history(plane: Any, dropped: list[str]) -> list[ConfigSnapshot]:
    good = []
    for v in plane.store.history_versions():
        try:
            snap = plane.store.read_version(v)
        except ControlIOError as exc:
            path = plane.state_dir.history_file(v)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(path.name + ".bad"))
                dropped.append(f"history version {v} (unreadable: {str(exc)[:120]}), kept as {path.name}.bad")
            continue
        if snap is not None:
            good.append(snap)
    return good


def _current(
    plane: Any, good: list[ConfigSnapshot], actions: list[str], dropped: list[str]
) -> ConfigSnapshot:
    store = plane.store
    now = plane._clock()
    reports = store.reports(now=now)
    anchor = plane._confirmed_applied(reports)
    try:
        cur = store.read_current(anchor=anchor)
        problem = None if cur is not None else "current.json is missing"
    except ControlIOError as exc:
        cur, problem = None, f"current.json is damaged or forged ({str(exc)[:200]})"
    if cur is not None:
        return cur
    # Only versions the readers believe (control.version_trust): a forged history entry beside a
    # forged current.json is not what current.json is rebuilt from.
    floor = plane._floor(anchor)
    good = [g for g in good if g.version <= floor]
    ranks = plane._live_applied_version(reports, now)
    if not good and store.version_floor() == 0 and store.max_audited_version() == 0 and ranks == 0:
        return plane.snapshot()  # a fresh state directory: nothing to repair
    if good:
        newest = good[-1]
        store.restore_current(newest)
        actions.append(f"{problem}: rebuilt it from history version {newest.version}")
        return newest
    floor = max(floor, store.max_audited_version(), ranks)
    snap = plane._initial().replace(version=floor + 1, time=time.time(), actor="repair")
    store.publish(snap)
    actions.append(
        f"{problem} and no history is readable: published the profile {snap.profile!r} values as "
        f"version {snap.version}"
    )
    dropped.append("every override and the file layer (nothing readable held them; reload the config file)")
    return snap


def _remove_orphans(plane: Any, cur: ConfigSnapshot, dropped: list[str]) -> None:
    """History files above the current version: a writer's that stopped before making them current
    (removed), or names that do not continue the versions on record (control.version_trust: kept
    as ``*.stray``, which never count as a version, for whoever investigates the forgery)."""
    floor = plane._floor(plane._confirmed_applied(plane.store.reports(now=plane._clock())))
    for v in plane.store.history_versions():
        if v <= cur.version:
            continue
        path = plane.state_dir.history_file(v)
        with contextlib.suppress(OSError):
            if v > floor:
                os.replace(path, path.with_name(path.name + ".stray"))
                dropped.append(
                    f"history version {v} (does not continue the versions on record, above "
                    f"{floor}), kept as {path.name}.stray"
                )
            else:
                os.unlink(path)
                dropped.append(
                    f"history version {v} (written by a writer that stopped before making it current)"
                )


def _was_in_force(
    v: Any,
    index: int,
    entries: list[dict[str, Any]],
    cur: ConfigSnapshot,
    applied: set[int],
    history_exists: Callable[[int], bool],
) -> bool:
    """Whether version ``v`` (of the unfinished write-ahead line ``entries[index]``) was ever in
    force, judged by what records it - not by its history file, which pruning
    removes from a version that was in force, and which a writer killed before current.json leaves
    behind for a version that never was:

    * it is current, or a live rank the process table confirms reports it applied (a rank only
      applies a version that was current; an unconfirmed report is anyone's to write);
    * a later entry was computed from it (``version_before == v``: every change reads the current
      version under the writers' lock, so it was current then);
    * a later publish was computed from below it and numbered above it: it was skipped, never current.

    With none of these on record (the audit log's later lines lost), its history file still decides."""
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    if v == cur.version or v in applied:
        return True
    for later in entries[index + 1 :]:
        before = later.get("version_before")
        if not isinstance(before, int) or isinstance(before, bool):
            continue
        if before == v:
            return True
        after = later.get("version")
        if (
            later.get("result") in ("publishing", "success")  # written under the lock, in order
            and before < v
            and isinstance(after, int)
            and after > v
        ):
            return False
    return v < cur.version and history_exists(v)


def _complete_audit(plane: Any, cur: ConfigSnapshot, actions: list[str], dropped: list[str]) -> None:
    store = plane.store
    try:
        entries = store.read_audit(raw=True)
    except ControlIOError as exc:
        # A symlink, FIFO or other non-regular audit.jsonl is never read (state_files.read_file_tail);
        # the rest of the repair stands and says so, rather than ending in an error that hides it.
        dropped.append(f"audit log not read, its entries not completed: {exc.message}"[:300])
        return
    now = plane._clock()
    # Only ranks the process table confirms (flyserve.control.reports.liveness): an unconfirmed
    # report is a file anyone who can write in ranks/ can drop, and one claiming an applied_version
    # would make repair record a version that never was in force as 'success'. With no
    # confirmed rank (ranks in another pid namespace, or stopped), the audit log decides alone.
    applied = {
        r.applied_version
        for r in store.reports(now=now)
        if r.applied_version is not None
        and liveness(r, now=now, stale_after_s=plane.rank_stale_after_s) is Liveness.CONFIRMED
    }
    done = {e.get("id") for e in entries if e.get("result") != "publishing"}
    for i, e in enumerate(entries):
        if e.get("result") != "publishing" or e.get("id") in done:
            continue
        v = e.get("version")
        published = _was_in_force(v, i, entries, cur, applied, store.history_file_exists)
        store.audit({**e, "result": "success" if published else "abandoned", "recovered": True})
        actions.append(
            f"audit: completed the entry of version {v} ({'published' if published else 'abandoned'})"
        )


def repair(plane: Any, *, actor: str = "repair") -> RepairReport:
    """Make ``plane``'s state directory consistent; see the module docstring. Raises ControlIOError
    when the directory cannot be locked or written."""
    actions: list[str] = []
    dropped: list[str] = []
    with plane.store.lock(timeout_s=plane.lock_timeout_s):
        _remove_temp_files(plane, dropped)
        _set_aside_stray_names(plane, dropped)
        good = _set_aside_bad_history(plane, dropped)
        cur = _current(plane, good, actions, dropped)
        _remove_orphans(plane, cur, dropped)
        _complete_audit(plane, cur, actions, dropped)
        report = RepairReport(cur.version, tuple(actions), tuple(dropped))
        if report.changed:
            now = time.time()
            plane.store.audit(
                {
                    "time": now,
                    "actor": actor,
                    "source": "repair",
                    "action": "repair",
                    "result": "repaired",
                    "version": cur.version,
                    "actions": list(actions)[:20],
                    "dropped": list(dropped)[:20],
                }
            )
            for a in actions:
                log.warning("repair: %s", a)
            for d in dropped:
                log.warning("repair: dropped %s", d)
    return report
