"""ControlPlane: the operator side's API over one state directory (the CLI, the sidecar and the
watcher use it): each change below says what it changes; publishing.py publishes it (validate,
version, audit, under the writers' lock) and versioning.py numbers it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flyserve.control.change_requests import as_request, check_keys, check_mapping
from flyserve.control.config_file import FileRead, read_config_file
from flyserve.control.effective import ASSUMED_STEPS_PER_S
from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir, default_state_dir
from flyserve.control.publishing import ChangeResult, Publisher
from flyserve.control.snapshot import ConfigSnapshot, Trial
from flyserve.control.store import Store
from flyserve.policy.thresholds import START_ONLY_FIELDS, Thresholds, ThresholdsError
from flyserve.thresholds_files import load_profile

DEFAULT_STEP_MARGIN = 8
"""The fewest steps between the ranks' current step and a new version's effective_step."""

DEFAULT_LEAD_S = 3.0
"""How far ahead, in time, a new version takes effect: every rank must notice it first. A rank's
thread looks about once a second, so 3 s covers one missed round plus a busy machine. The step
margin used is max(step_margin, ceil(fastest rank's steps_per_s * lead_s)): time, not a fixed count,
because vLLM's step rate varies from ~10/s (long prefills) to ~200/s (small decode batches)."""


class _TrialNotInForce(Exception):
    """end_trial found its version replaced under the writers' lock (not audited: nothing happened)."""


class ControlPlane(Publisher):
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

    def history(self, limit: int | None = None) -> list[ConfigSnapshot]:
        """Kept versions, oldest first."""
        return self.store.history(limit)

    def audit_log(self, limit: int | None = None) -> list[dict[str, Any]]:
        return self.store.read_audit(limit)

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

        def overrides(cur: ConfigSnapshot) -> dict[str, Any]:
            check_mapping(changes)
            check_keys(changes, source="overrides")
            ov = dict(cur.overrides)
            for k, v in changes.items():
                if v is None:
                    ov.pop(k, None)
                else:
                    ov[k] = v
            return ov

        return self._overrides_change("set", changes, overrides, actor, source, if_match, dry_run)

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

        def overrides(cur: ConfigSnapshot) -> dict[str, Any]:
            check_mapping(values)
            return dict(values)

        return self._overrides_change("replace", values, overrides, actor, source, if_match, dry_run)

    def _overrides_change(
        self,
        action: str,
        request: Any,
        overrides: Callable[[ConfigSnapshot], dict[str, Any]],
        actor: str,
        source: str,
        if_match: int | None,
        dry_run: bool,
    ) -> ChangeResult:
        """A change whose new override layer is ``overrides(current snapshot)``; ``request`` is what
        the caller sent, for the audit line (as_request: huge values described, unknown keys counted)."""
        return self._change(
            action,
            lambda cur: {"overrides": overrides(cur)},
            actor=actor,
            source=source,
            if_match=if_match,
            dry_run=dry_run,
            request=as_request(request),
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

    def publish_autopilot(
        self,
        thresholds: Thresholds,
        *,
        trial: Trial | None,
        request: Mapping[str, Any],
        actor: str = "autopilot",
        if_match: int | None = None,
    ) -> ChangeResult:
        """The sidecar's autopilot: publish ``thresholds`` (with ``trial`` attached, or none) through
        the one publishing path: validated like every change (a trial's candidate may not move a
        start-only field), versioned, audited (source 'autopilot', ``request`` says which trial and
        why). As a rollback does, the values that differ from the file's become the overrides."""

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            base = load_profile(cur.profile).merged(cur.file_values, source=cur.config_file or "file")
            target, below = thresholds.model_dump(), base.model_dump()
            target.update({k: getattr(cur.thresholds, k) for k in START_ONLY_FIELDS})
            return {"overrides": {k: v for k, v in target.items() if below[k] != v}, "trial": trial}

        return self._change(
            "autopilot", build, actor=actor, source="autopilot", request=dict(request), if_match=if_match
        )

    def end_trial(self, *, actor: str, request: Mapping[str, Any], if_match: int) -> ChangeResult | None:
        """A new version (source 'rollback') that is version ``if_match`` without its trial: the
        same thresholds, layers and circuit, so every rank leaves the trial at one step, back on the
        version's own thresholds (the arm the trial runs over). Only the autopilot's own publishes
        name a trial, so a version of any other source ends one.

        None, with nothing published or audited, when ``if_match`` is no longer the current version
        or carries no trial: whoever published since has replaced the trial already. Checked under
        the writers' lock, so of two keepers that saw the same expired lease (two API servers, a
        pusher and a rank) the second leaves no refused-change line in the audit."""

        def build(cur: ConfigSnapshot) -> dict[str, Any]:
            if cur.version != int(if_match) or cur.trial is None:
                raise _TrialNotInForce
            return {}

        try:
            return self._change("rollback", build, actor=actor, source="rollback", request=dict(request))
        except _TrialNotInForce:
            return None

    # ------------------------------------------------------------------ watching

    def watch(self, *, poll_interval_s: float = 5.0, actor: str = "watcher", **kwargs: Any) -> Any:
        """Start a Watcher on this plane's config file (directory watch + poll backstop + SIGHUP)."""
        from flyserve.control.watcher import Watcher

        w = Watcher(self, poll_interval_s=poll_interval_s, actor=actor, **kwargs)
        w.start()
        return w
