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

from flyserve.control.paths import MAX_VERSION
from flyserve.policy.thresholds import FIELDS, Thresholds, ThresholdsError, unknown_key_error

SOURCES: tuple[str, ...] = ("default", "file", "api", "cli", "rollback")
"""Who made a version: the profile alone at start, the operator file, the HTTP API, the CLI, a rollback."""

LAYERS: tuple[str, ...] = ("profile", "file", "override")
"""Provenance values, lowest priority first (Envoy runtime style)."""

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _frozen(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m)) if m else _EMPTY


def content_sha256(
    *,
    profile: str,
    thresholds: Thresholds,
    file_values: Mapping[str, Any],
    overrides: Mapping[str, Any],
    circuit_open: bool,
) -> str:
    """The identity of a version's content: same layers and same effective values -> same hash.

    Publishing content whose hash equals the current one is a no-op (no new version), which is
    what makes several watchers of one file (sidecar and rank 0) safe.
    """
    doc = {
        "profile": profile,
        "thresholds": thresholds.model_dump(),
        "file": dict(file_values),
        "overrides": dict(overrides),
        "circuit_open": bool(circuit_open),
    }
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
    ) -> ConfigSnapshot:
        """A snapshot with its derived fields (sha256, provenance, conflicts) computed, not trusted."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        fv, ov = dict(file_values or {}), dict(overrides or {})
        return cls(
            version=int(version),
            sha256=content_sha256(
                profile=profile,
                thresholds=thresholds,
                file_values=fv,
                overrides=ov,
                circuit_open=circuit_open,
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
            snap = cls.build(
                version=int(d["version"]),
                thresholds=Thresholds.parse(d["thresholds"], source=source),
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
            )
        except ThresholdsError:
            raise
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
    ControlPlane._candidate computes), and the effective thresholds must hold every value the two
    layers set. The sha256 alone proves nothing: whoever forges current.json computes it too, and a
    forged profile name or override key once made every later change fail while `repair` said
    "consistent". Values the profile alone sets are not compared: a profile file edited since (a
    new release) must not turn every kept version into a forgery. Raises ThresholdsError naming
    the layer and field (an unknown key is shown only as unknown_key_error shows it)."""
    from flyserve.policy.profiles import load_profile

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
