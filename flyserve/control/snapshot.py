"""ConfigSnapshot: one published version of the thresholds, immutable, with where every value came from.

A snapshot carries its layers (profile name, the operator file's values, the overrides) as well as
the effective Thresholds, so any process - the sidecar without the config file mounted, a rank that
starts late - can compute the next version from it without re-reading anything else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from flyserve.autopilot.switchback import (
    SwitchbackPlan,
    SwitchbackPlanError,
    check_block_fields,
    check_trial_id,
)
from flyserve.control.paths import MAX_VERSION
from flyserve.policy.thresholds import (
    FIELDS,
    START_ONLY_FIELDS,
    Thresholds,
    ThresholdsError,
    unknown_key_error,
)

SOURCES: tuple[str, ...] = ("default", "file", "api", "cli", "rollback", "autopilot")
"""Who made a version: the profile alone at start, the operator file, the HTTP API, the CLI, a
rollback, or the sidecar's autopilot (a trial, a promotion, a return to the operator's thresholds)."""

LAYERS: tuple[str, ...] = ("profile", "file", "override")
"""Provenance values, lowest priority first (Envoy runtime style)."""

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _frozen(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m)) if m else _EMPTY


@dataclass(frozen=True, slots=True)
class Trial:
    """A switchback trial a version carries: the candidate thresholds and how its blocks run.

    The blocks start at the version's effective step for each engine (every rank of an engine holds
    that step, file polling and engine channel alike), so a trial holds no step of its own: the
    step says when, which the content hash leaves out as it leaves out ``effective_step``.
    Everything a trial holds is content, in the hash."""

    trial_id: str
    seed: int
    block_steps: int
    blocks: int
    candidate: Thresholds

    def __post_init__(self) -> None:
        check_trial_id(self.trial_id)
        check_block_fields(seed=self.seed, block_steps=self.block_steps, blocks=self.blocks)

    def plan(self, first_step: int) -> SwitchbackPlan:
        """The blocks from ``first_step`` on (raises SwitchbackPlanError if it would end too late)."""
        return SwitchbackPlan(self.trial_id, self.seed, first_step, self.block_steps, self.blocks)

    def check_against(self, current: Thresholds, *, source: str | None = None) -> None:
        """The candidate must keep every start-only field of the current thresholds: a trial
        switches arms between two engine steps, and a start-only field (CUDA graphs captured for
        it) would need a restart. Raises ThresholdsError naming ``trial.candidate.<field>``."""
        moved = [k for k in START_ONLY_FIELDS if getattr(self.candidate, k) != getattr(current, k)]
        if moved:
            reason = "fixed at server start: a trial's candidate must keep the current value"
            raise ThresholdsError([(f"trial.candidate.{k}", reason) for k in moved], source=source)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.trial_id,
            "seed": self.seed,
            "block_steps": self.block_steps,
            "blocks": self.blocks,
            "candidate": self.candidate.model_dump(),
        }

    @classmethod
    def from_dict(cls, d: object, *, source: str | None = None) -> Trial:
        """Validate a snapshot's ``trial`` field; ThresholdsError names the field (``trial.<name>``)."""
        if not isinstance(d, Mapping):
            raise ThresholdsError([("trial", f"must be a mapping, got {type(d).__name__}")], source=source)
        unknown = sorted(str(k) for k in d if k not in _TRIAL_KEYS)
        if unknown:
            raise ThresholdsError(
                [(f"trial.{unknown_key_error(k)[0]}", "unknown key") for k in unknown], source=source
            )
        missing = [k for k in sorted(_TRIAL_KEYS) if k not in d]
        if missing:
            raise ThresholdsError([(f"trial.{k}", "missing") for k in missing], source=source)
        if not isinstance(d["candidate"], Mapping):
            reason = f"must be a mapping of threshold names to values, got {type(d['candidate']).__name__}"
            raise ThresholdsError([("trial.candidate", reason)], source=source)
        try:
            candidate = Thresholds.parse(d["candidate"], source=source)
        except ThresholdsError as exc:
            raise ThresholdsError(
                [(f"trial.candidate.{f}", r) for f, r in exc.errors], source=source
            ) from None
        try:
            return cls(
                trial_id=d.get("id"),  # type: ignore[arg-type]  # checked in __post_init__
                seed=d.get("seed"),  # type: ignore[arg-type]
                block_steps=d.get("block_steps"),  # type: ignore[arg-type]
                blocks=d.get("blocks"),  # type: ignore[arg-type]
                candidate=candidate,
            )
        except SwitchbackPlanError as exc:
            name = "id" if exc.field == "trial_id" else exc.field
            raise ThresholdsError([(f"trial.{name}", exc.reason)], source=source) from None


_TRIAL_KEYS = frozenset(("id", "seed", "block_steps", "blocks", "candidate"))


def content_sha256(
    *,
    profile: str,
    thresholds: Thresholds,
    file_values: Mapping[str, Any],
    overrides: Mapping[str, Any],
    circuit_open: bool,
    trial: Trial | None = None,
) -> str:
    """The identity of a version's content: same layers and same effective values -> same hash.

    Publishing content whose hash equals the current one is a no-op (no new version), which is
    what makes several watchers of one file (sidecar and rank 0) safe. A trial is content (two
    versions that differ only by it run different thresholds); without one the document, and so
    the hash of every version written before trials existed, is what it was.
    """
    doc: dict[str, Any] = {
        "profile": profile,
        "thresholds": thresholds.model_dump(),
        "file": dict(file_values),
        "overrides": dict(overrides),
        "circuit_open": bool(circuit_open),
    }
    if trial is not None:
        doc["trial"] = trial.to_dict()
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def provenance_of(file_values: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, str]:
    """{key: 'profile'|'file'|'override'}: the highest layer that sets each key."""
    return {k: "override" if k in overrides else "file" if k in file_values else "profile" for k in FIELDS}


def conflicts_of(file_values: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Keys the file sets to one value while an override holds another: the override wins, visibly."""
    return {
        k: {"file": file_values[k], "override": v}
        for k, v in overrides.items()
        if k in file_values and file_values[k] != v
    }


@dataclass(frozen=True, slots=True)
class ConfigSnapshot:
    """One version. ``effective_step`` is the engine step from which every rank uses it."""

    version: int
    sha256: str
    thresholds: Thresholds
    source: str
    actor: str
    time: float
    effective_step: int
    provenance: Mapping[str, str]
    overrides: Mapping[str, Any]
    profile: str
    circuit_open: bool = False
    circuit_reason: str = ""
    file_values: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    config_file: str | None = None
    file_sha256: str | None = None
    conflicts: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _EMPTY)
    engine_steps: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """engine -> effective step ('*': engines with no live rank at publish time). Empty: every
    engine uses ``effective_step``. Not part of the content hash: it says when, not what."""
    trial: Trial | None = None
    """A switchback trial from the effective step on (None: the thresholds alone)."""
    arm: int | None = None
    """Set by a rank on the snapshot it runs during a trial's block (0 current, 1 candidate); None
    outside a block. Never written to a file: the published version is the one with arm None."""
    trial_id: str | None = None
    """The trial whose block this snapshot runs (with ``arm``); None outside a block."""

    def plan_for(self, engine: int) -> SwitchbackPlan | None:
        """The trial's blocks for ``engine``: from its effective step on (None without a trial)."""
        return None if self.trial is None else self.trial.plan(self.step_for(engine))

    def step_for(self, engine: int) -> int:
        """The engine step from which ``engine``'s ranks use this version."""
        if not self.engine_steps:
            return self.effective_step
        return self.engine_steps.get(str(engine), self.engine_steps.get("*", self.effective_step))

    @classmethod
    def build(
        cls,
        *,
        version: int,
        thresholds: Thresholds,
        source: str,
        actor: str,
        time: float,
        effective_step: int,
        profile: str,
        file_values: Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None,
        circuit_open: bool = False,
        circuit_reason: str = "",
        config_file: str | None = None,
        file_sha256: str | None = None,
        engine_steps: Mapping[str, int] | None = None,
        trial: Trial | None = None,
    ) -> ConfigSnapshot:
        """A snapshot with its derived fields (sha256, provenance, conflicts) computed, not trusted."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if trial is not None:
            trial.check_against(thresholds)
            trial.plan(int(effective_step))  # its blocks must end by MAX_STEP
            for step in (engine_steps or {}).values():
                trial.plan(int(step))
        fv, ov = dict(file_values or {}), dict(overrides or {})
        return cls(
            version=int(version),
            sha256=content_sha256(
                profile=profile,
                thresholds=thresholds,
                file_values=fv,
                overrides=ov,
                circuit_open=circuit_open,
                trial=trial,
            ),
            thresholds=thresholds,
            source=source,
            actor=actor,
            time=float(time),
            effective_step=int(effective_step),
            provenance=_frozen(provenance_of(fv, ov)),
            overrides=_frozen(ov),
            profile=profile,
            circuit_open=bool(circuit_open),
            circuit_reason=circuit_reason,
            file_values=_frozen(fv),
            config_file=config_file,
            file_sha256=file_sha256,
            conflicts=_frozen({k: _frozen(v) for k, v in conflicts_of(fv, ov).items()}),
            engine_steps=_frozen({str(k): int(v) for k, v in (engine_steps or {}).items()}),
            trial=trial,
        )

    def replace(self, **changes: Any) -> ConfigSnapshot:
        """A copy with some fields changed and the derived ones recomputed."""
        args: dict[str, Any] = {
            "version": self.version,
            "thresholds": self.thresholds,
            "source": self.source,
            "actor": self.actor,
            "time": self.time,
            "effective_step": self.effective_step,
            "profile": self.profile,
            "file_values": self.file_values,
            "overrides": self.overrides,
            "circuit_open": self.circuit_open,
            "circuit_reason": self.circuit_reason,
            "config_file": self.config_file,
            "file_sha256": self.file_sha256,
            "engine_steps": self.engine_steps,
            "trial": self.trial,
        }
        args.update(changes)
        return ConfigSnapshot.build(**args)

    @property
    def time_iso(self) -> str:
        return (
            datetime.fromtimestamp(self.time, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what current.json and history/<version>.json hold, and what the HTTP API returns."""
        return {
            "version": self.version,
            "sha256": self.sha256,
            "effective_step": self.effective_step,
            "source": self.source,
            "actor": self.actor,
            "time": self.time,
            "time_iso": self.time_iso,
            "profile": self.profile,
            "thresholds": self.thresholds.model_dump(),
            "provenance": dict(self.provenance),
            "overrides": dict(self.overrides),
            "file": {
                "path": self.config_file,
                "sha256": self.file_sha256,
                "values": dict(self.file_values),
            },
            "conflicts": {k: dict(v) for k, v in self.conflicts.items()},
            "circuit_open": self.circuit_open,
            "circuit_reason": self.circuit_reason,
            **({"engine_steps": dict(self.engine_steps)} if self.engine_steps else {}),
            **({"trial": self.trial.to_dict()} if self.trial is not None else {}),
        }

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, source: str | None = None, check_profile: bool = True
    ) -> ConfigSnapshot:
        """Rebuild and verify: the recomputed sha256 must equal the stored one, else the file is not trusted.

        Raises ThresholdsError naming the field (a torn or hand-edited current.json is refused, never used).
        """
        try:
            f = d.get("file") or {}
            thresholds = Thresholds.parse(d["thresholds"], source=source)
            trial = None if d.get("trial") is None else Trial.from_dict(d["trial"], source=source)
            if trial is not None:
                trial.check_against(thresholds, source=source)
            snap = cls.build(
                version=int(d["version"]),
                thresholds=thresholds,
                source=str(d["source"]),
                actor=str(d.get("actor", "")),
                time=float(d["time"]),
                effective_step=int(d.get("effective_step", 0)),
                profile=str(d["profile"]),
                file_values=dict(f.get("values") or {}),
                overrides=dict(d.get("overrides") or {}),
                circuit_open=bool(d.get("circuit_open", False)),
                circuit_reason=str(d.get("circuit_reason", "")),
                config_file=f.get("path"),
                file_sha256=f.get("sha256"),
                engine_steps={str(k): int(v) for k, v in (d.get("engine_steps") or {}).items()},
                trial=trial,
            )
        except ThresholdsError:
            raise
        except SwitchbackPlanError as exc:  # the trial's blocks from the effective step on
            name = "effective_step" if exc.field == "first_step" else f"trial.{exc.field}"
            raise ThresholdsError([(name, exc.reason)], source=source) from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ThresholdsError(
                [("<snapshot>", f"not a snapshot document: {type(exc).__name__}")], source=source
            ) from None
        if not 0 <= snap.version <= MAX_VERSION:
            raise ThresholdsError([("version", f"must be 0..{MAX_VERSION}")], source=source)
        if snap.sha256 != d.get("sha256"):
            raise ThresholdsError(
                [
                    (
                        "sha256",
                        f"content hash mismatch (stored {str(d.get('sha256'))[:64]!r}, computed {snap.sha256!r})",
                    )
                ],
                source=source,
            )
        check_layers(snap, source=source, check_profile=check_profile)
        return snap

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1, default=str)


def check_layers(snap: ConfigSnapshot, *, source: str | None = None, check_profile: bool = True) -> None:
    """Refuse a snapshot the control plane could not have published, as strictly as a PATCH: its
    profile must load (the next change starts from it), every key of the file and override layers
    must be a threshold, each layer's values must validate laid over the one below (what
    publishing.Publisher._candidate computes), and the effective thresholds must hold every value the two
    layers set. The sha256 alone proves nothing: whoever forges current.json computes it too, and a
    forged profile name or override key once made every later change fail while `repair` said
    "consistent". Values the profile alone sets are not compared: a profile file edited since (a
    new release) must not turn every kept version into a forgery. Raises ThresholdsError naming
    the layer and field (an unknown key is shown only as unknown_key_error shows it)."""
    from flyserve.thresholds_files import load_profile

    bad = []
    for layer, values in (("file", snap.file_values), ("overrides", snap.overrides)):
        for key in values:
            if key not in FIELDS:
                field, reason = unknown_key_error(str(key))
                bad.append((f"{layer}.{field}", reason))
    if bad:
        raise ThresholdsError(bad, source=source)
    # A rank (check_profile=False) may not have the profile file the plane was given (a site
    # profile on the sidecar's FLYSERVE_PROFILE_PATH): it checks the layers over the effective
    # values instead; the plane and repair, which build the next change from the profile, load it.
    try:
        below = load_profile(snap.profile) if check_profile else snap.thresholds
        layered = below.merged(snap.file_values, source="file")
        layered = layered.merged(snap.overrides, source="overrides")
    except ThresholdsError as exc:
        raise ThresholdsError(exc.errors, source=source) from None
    stored, want = snap.thresholds.model_dump(), layered.model_dump()
    wrong = dict.fromkeys(k for k in (*snap.file_values, *snap.overrides) if stored[k] != want[k])
    if wrong:
        reason = "the effective value differs from the one its file or override layer sets"
        raise ThresholdsError([(k, reason) for k in wrong], source=source)
