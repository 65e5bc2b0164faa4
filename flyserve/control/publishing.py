"""The one publishing path of the control plane: every change - file reload, API, CLI, rollback,
circuit - goes through _change(), which validates the whole candidate, publishes it under the
writers' lock, counts it and audits it. A change that fails anywhere publishes nothing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flyserve.control._metrics import count_reload
from flyserve.control.change_requests import check_keys
from flyserve.control.effective import plan_steps
from flyserve.control.errors import ControlIOError, DecodePathChangeRefused, VersionConflict
from flyserve.control.reports import RankReport
from flyserve.control.signals import signals_deferred
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.versioning import VersionRecord
from flyserve.policy.thresholds import ThresholdsError
from flyserve.thresholds_files import load_profile

log = logging.getLogger("flyserve.control")


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


def _diff(old: ConfigSnapshot, new: ConfigSnapshot) -> dict[str, tuple[Any, Any]]:
    d: dict[str, tuple[Any, Any]] = dict(old.thresholds.diff(new.thresholds))
    if old.circuit_open != new.circuit_open:
        d["circuit_open"] = (old.circuit_open, new.circuit_open)
    return d


class Publisher(VersionRecord):
    """ControlPlane's publishing path (flyserve.control.plane.ControlPlane sets the attributes below)."""

    lock_timeout_s: float
    step_margin: int
    lead_s: float
    assumed_steps_per_s: float

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
        check_keys(overrides, source="overrides")
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
            # Only the autopilot's changes name a trial: any other change ends a running one.
            trial=fields.get("trial"),
        )
