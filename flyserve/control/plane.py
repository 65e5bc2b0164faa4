"""ControlPlane: the operator side. Every change - file reload, API, CLI, rollback, circuit - goes
through one function, _change(), which validates the whole candidate, publishes it under the lock,
counts it and audits it. A change that fails anywhere publishes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flyserve.control._metrics import count_reload
from flyserve.control.effective import ASSUMED_STEPS_PER_S, plan_steps
from flyserve.control.errors import ControlIOError, DecodePathChangeRefused, VersionConflict
from flyserve.control.paths import MAX_VERSION, StateDir, default_state_dir
from flyserve.control.reports import Liveness, RankReport, liveness
from flyserve.control.signals import signals_deferred
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.version_trust import MAX_VERSION_STEP, anchored_ceiling, live_anchor
from flyserve.files import safe_read
from flyserve.policy.errors import describe_value
from flyserve.policy.safe_yaml import MAX_DOCUMENT_BYTES
from flyserve.policy.safe_yaml import parse_mapping as parse_yaml_mapping
from flyserve.policy.thresholds import FIELDS, START_ONLY_FIELDS, ThresholdsError, unknown_key_error
from flyserve.thresholds_files import load_profile

log = logging.getLogger("flyserve.control")

UNCONFIRMED_VERSION_SLACK = MAX_VERSION_STEP - 1
"""How far above every recorded version an unconfirmed rank's applied_version is believed (the
ranks' applied versions matter when current.json, history and audit are all lost; a real rank's
version is a count of changes, far below this; a forged 10**18 - 1 would exhaust version numbers).
One below the step every reader allows (control.version_trust): the next version is numbered one
above it, and a claim of exactly MAX_VERSION_STEP above the record made that one a version every
rank at the record refused ("implausible"), circuit open included."""

DEFAULT_STEP_MARGIN = 8
"""The fewest steps between the ranks' current step and a new version's effective_step."""

DEFAULT_LEAD_S = 3.0
"""How far ahead, in time, a new version takes effect: every rank must notice it first. A rank's
thread looks about once a second, so 3 s covers one missed round plus a busy machine. The step
margin used is max(step_margin, ceil(fastest rank's steps_per_s * lead_s)): time, not a fixed count,
because vLLM's step rate varies from ~10/s (long prefills) to ~200/s (small decode batches)."""


@dataclass(frozen=True, slots=True)
class ChangeResult:
    """What a change did. ``changed`` is False when the content equals the current one (no new version)."""

    snapshot: ConfigSnapshot
    changed: bool
    diff: Mapping[str, tuple[Any, Any]]
    dry_run: bool = False

    @property
    def conflicts(self) -> Mapping[str, Mapping[str, Any]]:
        return self.snapshot.conflicts

    def to_dict(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "dry_run": self.dry_run,
            "diff": {k: {"old": a, "new": b} for k, a, b in ((k, *v) for k, v in self.diff.items())},
            "snapshot": self.snapshot.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class FileRead:
    """The operator file as last read: its values and content hash (None when missing)."""

    path: str
    values: Mapping[str, Any]
    sha256: str


def read_config_file(path: str | os.PathLike[str]) -> FileRead:
    """Read and parse the operator file. Symlinks are followed (a ConfigMap's ..data swap) but the
    file they lead to must be a regular file of at most MAX_DOCUMENT_BYTES: a FIFO would block the
    reader for ever, a device or a 90 MB file would hold the writers' lock. Raises ControlIOError if
    it cannot be read and ThresholdsError if it is not a valid YAML mapping."""
    p = Path(path)
    try:
        raw = safe_read.read_bytes(p, MAX_DOCUMENT_BYTES, source=str(p), follow_symlinks=True)
    except safe_read.UnreadableError as exc:
        raise ControlIOError(f"cannot read config file: {exc.reason}", path=str(p)) from None
    except safe_read.SafeReadError as exc:
        raise ThresholdsError([("<file>", exc.reason)], source=str(p)) from None
    if raw is None:
        raise ControlIOError("config file is missing (deleted, or mid-swap?)", path=str(p))
    values = parse_yaml_mapping(raw, source=str(p))
    return FileRead(str(p), values, hashlib.sha256(raw).hexdigest())


def _diff(old: ConfigSnapshot, new: ConfigSnapshot) -> dict[str, tuple[Any, Any]]:
    d: dict[str, tuple[Any, Any]] = dict(old.thresholds.diff(new.thresholds))
    if old.circuit_open != new.circuit_open:
        d["circuit_open"] = (old.circuit_open, new.circuit_open)
    return d


def _as_request(body: Any) -> dict[str, Any]:
    """The request as the audit line records it: known keys with their values (huge ones described,
    not copied); unknown keys only counted - they may be content of a file that is not a config."""
    if not isinstance(body, Mapping):
        return {"body": describe_value(body)}
    out: dict[str, Any] = {}
    unknown = 0
    for k, v in body.items():
        if k not in FIELDS:
            unknown += 1
            if isinstance(k, str) and k.isidentifier() and k.islower() and len(k) <= 32:
                out[k] = describe_value(v)
            continue
        big = isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64
        out[k] = describe_value(v) if big or (isinstance(v, str) and len(v) > 256) else v
    if unknown:
        out["<unknown keys>"] = unknown
    return out


def _check_mapping(m: Any) -> None:
    if not isinstance(m, Mapping):
        raise ThresholdsError(
            [("<document>", f"must be a mapping of threshold names to values, got {type(m).__name__}")],
            source="overrides",
        )


def _check_keys(keys: Iterable[str], *, source: str) -> None:
    bad = [k for k in keys if k not in FIELDS]
    if bad:
        raise ThresholdsError([unknown_key_error(k) for k in bad], source=source)


class ControlPlane:
    """Operator-side API over one state directory (used by the CLI, the sidecar and the watcher).

    The layers live in the published snapshot, so a ControlPlane built without ``config_file`` (the
    sidecar, the CLI) keeps the file layer as last published; ``profile`` and ``config_file`` matter
    for the first version and for reload().
    """

    def __init__(
        self,
        state_dir: StateDir | str | os.PathLike[str] | None = None,
        *,
        profile: str = "gfx950",
        config_file: str | os.PathLike[str] | None = None,
        step_margin: int = DEFAULT_STEP_MARGIN,
        lead_s: float = DEFAULT_LEAD_S,
        history_keep: int = 50,
        rank_stale_after_s: float = 30.0,
        lock_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        assumed_steps_per_s: float = ASSUMED_STEPS_PER_S,
    ) -> None:
        self.state_dir = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.store = Store(self.state_dir, history_keep=history_keep, own_profile=profile)
        self.profile = profile
        self.config_file = str(config_file) if config_file is not None else None
        self.step_margin = int(step_margin)
        self.lead_s = float(lead_s)
        self.rank_stale_after_s = rank_stale_after_s
        self.lock_timeout_s = lock_timeout_s
        self._clock = clock
        self.assumed_steps_per_s = float(assumed_steps_per_s)

    # ------------------------------------------------------------------ reads

    def snapshot(self, reports: Iterable[RankReport] | None = None) -> ConfigSnapshot:
        """The current snapshot; before the first publish, version 0 from the profile (not written).

        A current.json that is missing while history exists (deleted by hand), or damaged (torn by a
        full disk, hand-edited), is not trusted: the newest intact history entry stands in for it, so
        the next change repairs current.json and versions keep going up. With nothing readable at all,
        the profile's values stand in, numbered at the highest version on record (history file names,
        the audit log, the versions live ranks report as applied), so the next change publishes
        above every version ranks have seen.

        A current.json whose version does not continue the sequence on record (control.version_trust)
        counts as damaged: with ``reports``, the lowest version the confirmed live ranks applied
        is the record (what they themselves believe), else the chain of history names.
        """
        anchor = self._confirmed_applied(reports)
        try:
            cur = self.store.read_current(anchor=anchor)
        except ControlIOError as exc:
            problem: str | None = str(exc)
        else:
            if cur is not None:
                return cur
            problem = None if self.store.version_floor() == 0 else "current.json is missing"
            if problem is None:
                return self._initial()
        fallback = self.store.newest_credible_history(at_most=self._ceiling(anchor))
        if fallback is not None:
            log.error("%s; using history version %d instead", problem, fallback.version)
            return fallback
        now = self._clock()
        floor = max(
            self._floor(anchor),
            self.store.max_audited_version(),
            self._live_applied_version(self.store.reports(now=now), now),
        )
        log.error(
            "%s and no history entry is readable; the profile's values stand in (versions continue above %d)",
            problem,
            floor,
        )
        return self._initial().replace(version=floor)

    @staticmethod
    def _ceiling(anchor: int | None) -> int | None:
        """The highest version the plane may stand on when confirmed ranks run (None: none run, no
        bound): one below the highest they believe, so the next version is one they believe too."""
        return anchored_ceiling(anchor)

    def _floor(self, anchor: int | None) -> int:
        """The version floor of history names (Store.version_floor), up to what the confirmed ranks
        believe when there are any: a version numbered above it would be refused by every rank."""
        return self.store.version_floor(at_most=self._ceiling(anchor))

    def _confirmed_applied(self, reports: Iterable[RankReport] | None) -> int | None:
        """The lowest version a live rank the process table confirms has applied, or None (no
        reports given, or none confirmed with a version): the anchor a change is numbered from
        when ranks run, so the plane never believes a version one of its ranks refuses
        (control.version_trust.live_anchor, which a starting rank and the pusher ask too; with no
        rank confirmed, the lowest fresh unconfirmed one)."""
        if reports is None:
            return None
        return live_anchor(
            reports,
            now=self._clock(),
            stale_after_s=self.rank_stale_after_s,
            record=self.store.version_floor(),
        )

    def history(self, limit: int | None = None) -> list[ConfigSnapshot]:
        """Kept versions, oldest first."""
        return self.store.history(limit)

    def audit_log(self, limit: int | None = None) -> list[dict[str, Any]]:
        return self.store.read_audit(limit)

    def next_version(self, cur: ConfigSnapshot, reports: Iterable[RankReport] = ()) -> int:
        """Above the current version, above every history file name and above every version a live
        rank has applied: versions only go up, so a rank (which ignores versions it has already
        passed) never misses one, and history is never overwritten. The ranks' applied versions
        matter when current.json, history and the audit log are all lost: versions would otherwise
        restart at 1 there and every rank would ignore the new ones. Raises ControlIOError past
        MAX_VERSION."""
        reports = list(reports)
        floor = self._floor(self._confirmed_applied(reports))
        v = max(cur.version, floor, self._live_applied_version(reports, self._clock())) + 1
        if v > MAX_VERSION:
            raise ControlIOError(
                f"version numbers exhausted (next would be {v}); inspect control/history",
                path=str(self.state_dir.history_dir),
            )
        return v

    def _live_applied_version(self, reports: Iterable[RankReport], now: float) -> int:
        """The highest version a live rank reports as applied (0 with none): the confirmed ranks'
        when any rank is confirmed (flyserve.control.reports.liveness), else the unconfirmed ones'
        up to UNCONFIRMED_VERSION_SLACK above every other record of versions (current.json,
        history names, the audit log). A forged report "from another host" with applied_version
        10**18 - 1 would otherwise exhaust version numbers and refuse every later change - next
        to confirmed ranks, and with none (ranks in another pid namespace, or stopped)."""
        reports = list(reports)
        by_state: dict[Liveness, list[int]] = {Liveness.CONFIRMED: [], Liveness.UNCONFIRMED: []}
        for r in reports:
            if r.applied_version is not None:
                state = liveness(r, now=now, stale_after_s=self.rank_stale_after_s)
                if state is not Liveness.GONE:
                    by_state[state].append(r.applied_version)
        if by_state[Liveness.CONFIRMED]:
            # Confirmed only says a live process of a trusted uid is named: a report naming the
            # forger's own process claimed 10**18 - 2 (or just past what the real ranks believe),
            # the plane numbered the next change above it, every rank refused it ("implausible")
            # and every later change, circuit open included, found its number "already in
            # history". Counted only up to one below what every confirmed rank believes
            # (anchored_ceiling of confirmed_anchor), as for the history names.
            # With none believed, they count as unconfirmed ones do (below).
            anchor = self._confirmed_applied(reports)
            if anchor is not None:
                ceiling = anchored_ceiling(anchor)
                return max((v for v in by_state[Liveness.CONFIRMED] if v <= ceiling), default=0)
            by_state[Liveness.UNCONFIRMED] += by_state[Liveness.CONFIRMED]
        if not by_state[Liveness.UNCONFIRMED]:
            return 0
        ceiling = self._recorded_version() + UNCONFIRMED_VERSION_SLACK
        # ...and no higher than every fresh report believes (live_anchor): the record's chain of
        # history names may itself be forged.
        lowest = self._confirmed_applied(reports)
        if lowest is not None:
            ceiling = min(ceiling, anchored_ceiling(lowest))
        believed = [v for v in by_state[Liveness.UNCONFIRMED] if v <= ceiling]
        if len(believed) < len(by_state[Liveness.UNCONFIRMED]):
            log.warning(
                "thresholds: %d unconfirmed rank report(s) claim an applied version more than %d above "
                "every version on record; not believed",
                len(by_state[Liveness.UNCONFIRMED]) - len(believed),
                UNCONFIRMED_VERSION_SLACK,
            )
        return max(believed, default=0)

    def _recorded_version(self) -> int:
        """The highest version current.json, history names or the audit log record (0 with none)."""
        try:
            cur = self.store.read_current()
        except ControlIOError:
            cur = None
        return max(cur.version if cur else 0, self.store.version_floor(), self.store.max_audited_version())

    def _initial(self) -> ConfigSnapshot:
        return ConfigSnapshot.build(
            version=0,
            thresholds=load_profile(self.profile),
            source="default",
            actor="",
            time=0.0,
            effective_step=0,
            profile=self.profile,
        )

    # ------------------------------------------------------------------ changes

    def apply_overrides(
        self,
        changes: Mapping[str, Any],
        *,
        actor: str,
        source: str = "api",
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """PATCH: lay ``changes`` over the override layer. A value of None clears that key's override."""

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            _check_mapping(changes)
            _check_keys(changes, source="overrides")
            ov = dict(cur.overrides)
            for k, v in changes.items():
                if v is None:
                    ov.pop(k, None)
                else:
                    ov[k] = v
            return {"overrides": ov}

        return self._change(
            "set",
            build,
            actor=actor,
            source=source,
            if_match=if_match,
            dry_run=dry_run,
            request=_as_request(changes),
        )

    def unset_overrides(
        self,
        keys: Iterable[str],
        *,
        actor: str,
        source: str = "api",
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """Clear overrides: each key falls back to the file's value, or the profile's."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        return self.apply_overrides(
            dict.fromkeys(keys), actor=actor, source=source, if_match=if_match, dry_run=dry_run
        )

    def replace(
        self,
        values: Mapping[str, Any],
        *,
        actor: str,
        source: str = "api",
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """PUT: ``values`` becomes the whole override layer (keys not in it fall back to file/profile)."""

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            _check_mapping(values)
            return {"overrides": dict(values)}

        return self._change(
            "replace",
            build,
            actor=actor,
            source=source,
            if_match=if_match,
            dry_run=dry_run,
            request=_as_request(values),
        )

    def rollback(
        self,
        version: int,
        *,
        actor: str,
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """A new version (source 'rollback') whose effective thresholds equal ``version``'s.

        The file layer stays what the file says; the values that differ from it become overrides,
        so `unset` later falls back to the file, and a conflict with the file is reported. The
        circuit breaker's state is not rolled back (it is a safety switch, not a threshold), nor are
        the fields fixed at start (START_ONLY_FIELDS: decode_path keeps its running value).
        """

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            old = self.store.read_version(int(version))
            if old is None:
                kept = self.store.history_versions()
                raise ThresholdsError(
                    [
                        (
                            "version",
                            (
                                f"version {version} is not in history (kept: {kept[0] if kept else '-'}"
                                f"..{kept[-1] if kept else '-'})"
                            ),
                        )
                    ]
                )
            base = load_profile(cur.profile).merged(cur.file_values, source=cur.config_file or "file")
            target, below = old.thresholds.model_dump(), base.model_dump()
            # The fields fixed at start keep the running value: the ranks' graphs were captured with
            # it, and a rollback to a version from before a restart must not be refused for it.
            target.update({k: getattr(cur.thresholds, k) for k in START_ONLY_FIELDS})
            keep = {k for k in old.overrides if k not in START_ONLY_FIELDS} | {
                k for k in START_ONLY_FIELDS if k in cur.overrides
            }
            return {"overrides": {k: v for k, v in target.items() if below[k] != v or k in keep}}

        return self._change(
            "rollback",
            build,
            actor=actor,
            source="rollback",
            if_match=if_match,
            dry_run=dry_run,
            request={"version": int(version)},
        )

    def reload(
        self,
        *,
        actor: str,
        startup: bool = False,
        source: str = "file",
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """Re-read the operator file (this plane's ``config_file``, else the path the current version
        recorded) and publish it as the file layer. With no file at all, republishes the profile.

        ``startup=True`` is for the serving process before it captures CUDA graphs: it takes this
        plane's profile and may change decode_path (the only time that is allowed).
        """

        # The file is read and parsed before the writers' lock is taken: a slow or huge file must
        # not keep other writers waiting (a 90 MB file once turned a PATCH into a 503).
        path = self.config_file or self.snapshot().config_file
        read: FileRead | Exception | None = None
        if path is not None:
            try:
                read = read_config_file(path)
            except (ThresholdsError, ControlIOError) as exc:
                read = exc

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if startup or cur.version == 0:
                out["profile"] = self.profile
            if read is None:
                out.update(file_values={}, config_file=None, file_sha256=None)
                return out
            if isinstance(read, Exception):
                raise read
            out.update(file_values=dict(read.values), config_file=read.path, file_sha256=read.sha256)
            return out

        return self._change(
            "reload",
            build,
            actor=actor,
            source=source,
            if_match=if_match,
            dry_run=dry_run,
            allow_decode_path=startup,
            request={"config_file": self.config_file},
        )

    def set_circuit(
        self,
        open: bool,
        *,
        actor: str,
        reason: str = "",
        source: str = "api",
        if_match: int | None = None,
        dry_run: bool = False,
    ) -> ChangeResult:
        """Open (every rank stops using the prefill path) or close the circuit breaker: a new version."""

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            return {"circuit_open": bool(open), "circuit_reason": reason if open else ""}

        return self._change(
            "circuit",
            build,
            actor=actor,
            source=source,
            if_match=if_match,
            dry_run=dry_run,
            request={"circuit_open": bool(open), "reason": reason},
        )

    # ------------------------------------------------------------------ the one publishing path

    def _change(
        self,
        action: str,
        build: Callable[[ConfigSnapshot], dict[str, Any]],
        *,
        actor: str,
        source: str,
        request: Mapping[str, Any],
        if_match: int | None = None,
        dry_run: bool = False,
        allow_decode_path: bool = False,
    ) -> ChangeResult:
        """Validate, publish, count and audit one change under the writers' lock. The steps are the
        methods below: _validated (what), _planned (when), _commit (write-ahead audit, publish,
        completion); _refused records a failure. Nothing is published unless every step passes."""
        now = self._clock()
        entry = self._audit_entry(action, actor=actor, source=source, request=request, now=now)
        cur: ConfigSnapshot | None = None
        try:
            with self.store.lock(timeout_s=self.lock_timeout_s):
                reports = self.store.reports(now=now)
                cur = self.snapshot(reports)
                entry["version_before"] = cur.version
                if if_match is not None and int(if_match) != cur.version:
                    raise VersionConflict(int(if_match), cur.version)
                candidate, diff = self._validated(cur, build(cur), source, actor, now, allow_decode_path)
                if candidate.sha256 == cur.sha256 and cur.version > 0:
                    if not dry_run:
                        entry.update(result="unchanged", version=cur.version)
                        self.store.audit(entry)
                        count_reload("success", source)
                    return ChangeResult(cur, False, {}, dry_run)
                if dry_run:
                    return ChangeResult(candidate, True, diff, True)
                snap = self._planned(cur, candidate, now, entry, reports)
                self._commit(entry, cur, snap, diff)
                return ChangeResult(snap, True, diff, False)
        except (VersionConflict, ThresholdsError, ControlIOError) as exc:
            if not dry_run:  # a dry run changes nothing, so it leaves no audit line either
                self._refused(entry, exc, source, actor, cur)
            raise

    @staticmethod
    def _audit_entry(
        action: str, *, actor: str, source: str, request: Mapping[str, Any], now: float
    ) -> dict[str, Any]:
        return {
            "id": uuid.uuid4().hex[:16],
            "time": now,
            "time_iso": datetime.fromtimestamp(now, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "actor": str(actor)[:200],
            "source": source,
            "action": action,
            "request": dict(request),
        }

    def _validated(
        self,
        cur: ConfigSnapshot,
        fields: Mapping[str, Any],
        source: str,
        actor: str,
        now: float,
        allow_decode_path: bool,
    ) -> tuple[ConfigSnapshot, dict[str, tuple[Any, Any]]]:
        """The candidate version and its diff. Raises ThresholdsError (DecodePathChangeRefused)."""
        candidate = self._candidate(cur, fields, source=source, actor=actor, now=now)
        # The first version may set decode_path only while no rank runs: ranks that started on the
        # profile's value have captured their CUDA graphs with it.
        if (
            candidate.thresholds.decode_path != cur.thresholds.decode_path
            and not allow_decode_path
            and (cur.version > 0 or self.store.live_ranks(stale_after_s=self.rank_stale_after_s, now=now) > 0)
        ):
            raise DecodePathChangeRefused(
                cur.thresholds.decode_path, candidate.thresholds.decode_path, source=source
            )
        return candidate, _diff(cur, candidate)

    def _planned(
        self,
        cur: ConfigSnapshot,
        candidate: ConfigSnapshot,
        now: float,
        entry: dict[str, Any],
        reports: list[RankReport],
    ) -> ConfigSnapshot:
        """The candidate numbered above every version on record, with its effective step per engine
        (flyserve.control.effective: live, plausible ranks only, per engine, confirmed ones first).
        The audit entry gets what the step was based on: ``ranks`` {confirmed, unconfirmed,
        unconfirmed_ignored}; unconfirmed reports are also logged. ``reports``: the look _change
        took under the writers' lock."""
        plan = plan_steps(
            reports,
            now=now,
            stale_after_s=self.rank_stale_after_s,
            step_margin=self.step_margin,
            lead_s=self.lead_s,
            assumed_steps_per_s=self.assumed_steps_per_s,
        )
        entry["ranks"] = {
            "confirmed": plan.confirmed_ranks,
            "unconfirmed": plan.unconfirmed_ranks,
            "unconfirmed_ignored": plan.unconfirmed_ignored,
        }
        if plan.unconfirmed_ranks:
            log.warning(
                "thresholds: %d live rank report(s) cannot be confirmed by the process table (another "
                "host or pid namespace, or a forgery); %s",
                plan.unconfirmed_ranks,
                f"{plan.unconfirmed_ignored} left out of effective_step (their engines have confirmed ranks)"
                if plan.unconfirmed_ignored == plan.unconfirmed_ranks
                else "effective_step is capped near the lowest rank of each engine",
            )
        return candidate.replace(
            version=self.next_version(cur, reports),
            effective_step=plan.effective_step,
            engine_steps=plan.engine_steps,
        )

    def _commit(
        self, entry: dict[str, Any], cur: ConfigSnapshot, snap: ConfigSnapshot, diff: Mapping[str, Any]
    ) -> None:
        """Write-ahead audit line, publish, completion line. A writer killed in between leaves a
        'publishing' line that `repair` (run by the sidecar at start) completes: no published version
        is ever without an audit entry. A write-ahead line that cannot be written stops the change."""
        entry.update(
            version=snap.version,
            effective_step=snap.effective_step,
            diff={k: {"old": a, "new": b} for k, (a, b) in diff.items()},
        )
        if snap.conflicts:
            entry["conflicts"] = {k: dict(v) for k, v in snap.conflicts.items()}
        with signals_deferred():  # a SIGTERM mid-publish acts once the completion line is written
            if not self.store.audit({**entry, "result": "publishing"}):
                reason = getattr(self.store, "last_audit_error", None) or "not writable"
                raise ControlIOError(
                    f"audit log: {reason}; change not published", path=str(self.store.dir.audit_log)
                )
            self.store.publish(snap)
            entry["result"] = "success"
            self.store.audit(entry)
        count_reload("success", entry["source"])
        if snap.conflicts and snap.conflicts != cur.conflicts:
            log.warning(
                "thresholds v%d: the file and overrides disagree on %s (override wins; "
                "`flyserve thresholds unset KEY` to take the file's value)",
                snap.version,
                ", ".join(snap.conflicts),
            )
        log.info(
            "thresholds v%d published (%s by %s, effective at step %d): %s",
            snap.version,
            entry["source"],
            entry["actor"] or "-",
            snap.effective_step,
            ", ".join(f"{k} {a}->{b}" for k, (a, b) in diff.items()) or "no value changed",
        )

    def _refused(
        self, entry: dict[str, Any], exc: Exception, source: str, actor: str, cur: ConfigSnapshot | None
    ) -> None:
        """Audit, count and log a change that published nothing."""
        running = f"running version {cur.version if cur else '?'} unchanged"
        if isinstance(exc, VersionConflict):
            entry.update(result="conflict", reason=str(exc))
            self.store.audit(entry)
            log.warning("thresholds change refused (%s by %s): %s", source, actor or "-", exc)
        elif isinstance(exc, ThresholdsError):
            entry.update(
                result="invalid",
                field=exc.field,
                reason=exc.reason,
                errors=[{"field": f, "reason": r} for f, r in exc.errors],
            )
            self.store.audit(entry)
            count_reload("invalid", source)
            log.error("thresholds change rejected (%s by %s): %s; %s", source, actor or "-", exc, running)
        else:
            entry.update(result="io_error", reason=str(exc)[:500])
            self.store.audit(entry)
            count_reload("io_error", source)
            log.error("thresholds change failed (%s by %s): %s; %s", source, actor or "-", exc, running)

    def _candidate(
        self, cur: ConfigSnapshot, fields: Mapping[str, Any], *, source: str, actor: str, now: float
    ) -> ConfigSnapshot:
        """Validate profile < file < overrides as a whole; each layer's errors name that layer."""
        profile = fields.get("profile", cur.profile)
        file_values = fields.get("file_values", cur.file_values)
        config_file = fields.get("config_file", cur.config_file)
        overrides = fields.get("overrides", cur.overrides)
        base = load_profile(profile)
        with_file = base.merged(file_values, source=config_file or "file")
        _check_keys(overrides, source="overrides")
        effective = with_file.merged(overrides, source="overrides")
        return ConfigSnapshot.build(
            version=cur.version + 1,
            thresholds=effective,
            source=source,
            actor=actor,
            time=now,
            effective_step=0,
            profile=profile,
            file_values=file_values,
            overrides=overrides,
            circuit_open=fields.get("circuit_open", cur.circuit_open),
            circuit_reason=fields.get("circuit_reason", cur.circuit_reason),
            config_file=config_file,
            file_sha256=fields.get("file_sha256", cur.file_sha256),
        )

    # ------------------------------------------------------------------ watching

    def watch(self, *, poll_interval_s: float = 5.0, actor: str = "watcher", **kwargs: Any) -> Any:
        """Start a Watcher on this plane's config file (directory watch + poll backstop + SIGHUP)."""
        from flyserve.control.watcher import Watcher

        w = Watcher(self, poll_interval_s=poll_interval_s, actor=actor, **kwargs)
        w.start()
        return w
