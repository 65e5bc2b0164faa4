"""SidecarSettings: everything the sidecar app is built from, as one frozen value.

``create_app(settings)`` takes nothing else, so a test builds an app with its own state
directory and token, and the CLI is a thin layer that fills these fields from flags.
The token is never a flag value (it would show in ``ps``): it comes from a file or from
$FLYSERVE_SIDECAR_TOKEN.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from flyserve.autopilot.inputs import AutopilotConfig, KnobBound
from flyserve.autopilot.switchback import MAX_BLOCKS
from flyserve.control.trial_lease import DEFAULT_TTL_S as LEASE_TTL_S
from flyserve.control.trial_lease import MAX_TTL_S as MAX_LEASE_TTL_S
from flyserve.control.trial_lease import MIN_TTL_S as MIN_LEASE_TTL_S
from flyserve.files import safe_read

log = logging.getLogger("flyserve.sidecar")

TOKEN_ENV = "FLYSERVE_SIDECAR_TOKEN"
AUTOPILOT_ENV = "FLYSERVE_AUTOPILOT"
"""The autopilot's mode when --autopilot is not given."""
_AP = AutopilotConfig()
# A token shorter than this is refused: a bearer token is the only thing between the network
# and the thresholds every rank runs with.
MIN_TOKEN_LENGTH = 16


class TokenError(ValueError):
    """The token file or variable is unusable; the message names which and why."""


class SidecarSettings(BaseModel):
    """The sidecar's configuration. Frozen: the app never changes it while serving."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    state_dir: Path = Field(description="The flyserve state directory shared with the ranks.")
    profile: str = Field("gfx950", description="Threshold profile the control plane layers overrides on.")
    config_file: Path | None = Field(None, description="Optional operator thresholds file (control plane).")
    watch_config: bool = Field(
        True, description="Watch config_file and publish its changes (off: only POST /reload reads it)."
    )
    config_poll_s: float = Field(
        5.0,
        gt=0,
        description="With a config_file, the sidecar watches its directory (a ConfigMap symlink swap "
        "included) and also re-reads it this often as a backstop; SIGHUP reloads it at once.",
    )
    token: SecretStr | None = Field(
        None, description="Bearer token for mutating routes. None: every mutation is refused (403)."
    )
    actor_name: str | None = Field(
        None,
        description="The actor recorded for changes made with the token (audit log, GET /thresholds). "
        "None: an HMAC of the token under the state directory's control/actor.key.",
    )
    stale_after_s: float = Field(
        5.0, gt=0, description="A rank whose report is older than this is marked stale (ranks report ~1/s)."
    )
    counter_snapshot_interval_s: float = Field(
        5.0, gt=0, description="How often the counters are snapshotted for the 60s/300s/900s windows."
    )
    stats_ttl_s: float = Field(
        0.5,
        ge=0,
        description="Computed /dispatch-stats are reused for this long: reading the multiprocess files "
        "is the expensive part, and a dashboard polling at 200 req/s needs no fresher numbers.",
    )
    metrics_ttl_s: float = Field(
        1.0,
        ge=0,
        description="The /metrics exposition is reused for this long (Prometheus scrapes every few s).",
    )
    stream_interval_s: float = Field(2.0, gt=0, description="Seconds between /dispatch-stats/stream events.")
    stream_min_interval_s: float = Field(
        0.5,
        gt=0,
        description="Floor on a client's ?interval=, and the tick of the one payload computation all "
        "streams share (three streams at interval=0.000001 once held the sidecar at 99% CPU).",
    )
    max_streams: int = Field(
        64,
        ge=1,
        description="Concurrent SSE streams. At the cap a new one takes the slot of the most-stalled "
        "stream (one not reading), else of the oldest one open over stream_lease_s; with neither it gets "
        "503 and Retry-After (flyserve.sidecar.stream).",
    )
    stream_lease_s: float = Field(
        120.0,
        gt=0,
        description="At --max-streams with no stream stalled, a new stream takes the slot of the oldest "
        "one open longer than this (its client reconnects): slow readers (?interval=3600) cannot hold "
        "every slot for an hour.",
    )
    stream_write_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A stream whose event write has not completed for this long (its client does not "
        "read) is dropped and its slot freed.",
    )
    stream_max_queued_events: int = Field(
        16,
        ge=1,
        description="A stream with more than this many events' worth of bytes queued unsent for its "
        "client is dropped and its slot freed (the kernel's send buffer can hide a non-reader for minutes).",
    )
    step_margin: int | None = Field(
        None,
        ge=1,
        description="Control plane step margin for new versions (None: the control plane's default).",
    )
    share_control_metrics: bool = Field(
        True,
        description="Write this process's control-plane counters (reloads done through the API) into "
        "<state>/metrics like the ranks do. Tests that build apps in-process turn it off so the "
        "process-wide metrics backend is left alone.",
    )
    max_requests: int = Field(
        512,
        ge=1,
        description="Requests in progress at once; one more is a 503 at once. /healthz, /readyz and "
        "changes with the valid token are always admitted (--max-connections sets it).",
    )
    max_body_bytes: int = Field(64 * 1024, gt=0, description="Larger request bodies get 413.")
    costs: str | None = Field(
        None,
        description="Cost table (a name under config/costs, or a JSON path) that prices the sampled "
        "shapes live: regret in /dispatch-stats, GET /thresholds/advice, drift. None: no pricing.",
    )
    pricing_interval_s: float = Field(
        1.0, gt=0, description="How often the ranks' shape samples are read and the new ones priced."
    )
    advice_shape_limit: int = Field(
        2048,
        gt=0,
        description="Advice fits at most this many of the window's newest priced batches that have a "
        "prefill row (decode-only batches take decode_path whatever the knobs say).",
    )
    advice_deadline_s: float = Field(
        2.0,
        gt=0,
        description="GET /thresholds/advice waits this long for a fit; then it answers the last one "
        "marked stale (or 503 with Retry-After). Fits run one at a time on their own thread.",
    )
    advice_fresh_s: float = Field(
        5.0,
        ge=0,
        description="A finished fit is reused for this long (and until the thresholds change here).",
    )
    compact_interval_s: float = Field(
        60.0,
        ge=0,
        description="Seconds between compactions of dead processes' metric files (0: never; "
        "flyserve.telemetry.compaction): without it every rank restart leaves ~4 files that every "
        "scrape reads for ever.",
    )
    dry_run_shape_limit: int = Field(
        2048, gt=0, description="At most this many recent shapes are replayed for a dry run's routing change."
    )
    autopilot: Literal["off", "advise", "trial", "auto"] = Field(
        "off",
        description="The autopilot's mode at start ($FLYSERVE_AUTOPILOT; docs/autopilot.md): off (nothing), "
        "advise (proposals only), trial (trials; a promotion waits for POST /autopilot/approve), auto.",
    )
    autopilot_bounds: Mapping[str, KnobBound] = Field(
        default_factory=dict,
        description="Knob -> KnobBound the autopilot may move a knob within (--autopilot-bounds FILE); "
        "a knob with none is never moved, and with none at all the autopilot moves nothing.",
    )
    autopilot_block_steps: int = Field(
        _AP.block_steps, ge=1, le=1 << 20, description="Engine steps per trial block (K)."
    )
    autopilot_max_blocks: int = Field(
        _AP.plan_blocks,
        ge=2,
        le=MAX_BLOCKS,
        description="Blocks a trial may run (even: whole pairs): the sequential test's budget, twice.",
    )
    autopilot_max_exploration_share: float = Field(
        _AP.max_exploration_share,
        gt=0,
        lt=1,
        description="A trial starts only when its expected extra cost (the worse arm's blocks times its "
        "slowdown) is at most this share of its plan's attention time (docs/autopilot.md).",
    )
    autopilot_step_time_limit: float = Field(
        _AP.p99_ratio_limit,
        ge=1,
        le=100,
        description="Two candidate blocks in a row whose mean step time is above this many times the "
        "current arm's roll the trial back (the step-time guardrail).",
    )
    autopilot_cooldown_s: float = Field(
        _AP.cooldown_s, ge=0, le=7 * 86400, description="No new trial this long after one ends."
    )
    autopilot_regret_bound: float = Field(
        _AP.regret_bound, ge=0, le=100, description="A trial starts only while live regret is above this."
    )
    autopilot_min_saving: float = Field(
        _AP.min_saving, ge=0, le=1, description="... and the advice predicts at least this share saved."
    )
    autopilot_min_priced_samples: int = Field(
        _AP.min_priced_samples,
        ge=1,
        description="... over a regret window of at least this many priced samples.",
    )
    autopilot_min_block_samples: int = Field(
        _AP.min_block_samples,
        ge=1,
        description="A block counts only with this many corroborated kernel samples.",
    )
    autopilot_window: Literal["60s", "900s"] = Field(
        "900s", description="The regret window (and advice window) the trigger reads."
    )
    autopilot_interval_s: float = Field(
        1.0, gt=0, le=60, description="Seconds between the autopilot's ticks (its own thread)."
    )
    autopilot_lease_s: float = Field(
        LEASE_TTL_S,
        ge=MIN_LEASE_TTL_S,
        le=MAX_LEASE_TTL_S,
        description="A running trial's lease: not renewed for this long (at least 5 ticks), the engine's "
        "side ends the trial (control.trial_lease).",
    )

    @field_validator("autopilot_max_blocks")
    @classmethod
    def _whole_pairs(cls, v: int) -> int:
        if v % 2:
            raise ValueError("must be even (blocks come in pairs)")
        return v

    def autopilot_config(self) -> AutopilotConfig:
        """The state machine's settings from these fields (the rest: AutopilotConfig's defaults)."""
        return AutopilotConfig(
            regret_bound=self.autopilot_regret_bound,
            min_priced_samples=self.autopilot_min_priced_samples,
            min_saving=self.autopilot_min_saving,
            cooldown_s=self.autopilot_cooldown_s,
            block_steps=self.autopilot_block_steps,
            min_block_samples=self.autopilot_min_block_samples,
            max_exploration_share=self.autopilot_max_exploration_share,
            p99_ratio_limit=self.autopilot_step_time_limit,
            test=replace(_AP.test, max_pairs=self.autopilot_max_blocks // 2),
        )


MAX_TOKEN_FILE_BYTES = 4096
"""A token file is one line; a larger one is refused (a /dev/zero would otherwise be read for ever)."""


def _read_token_file(token_file: Path) -> tuple[int, str]:
    """(mode, text) of the token file. Symlinks are followed (a Kubernetes Secret mount is one) but
    the target must be a regular file of at most MAX_TOKEN_FILE_BYTES: a FIFO, /dev/zero or
    /dev/urandom once made the sidecar hang at start with no error line."""
    where = f"--token-file {token_file}"
    try:
        got = safe_read.read_file(token_file, MAX_TOKEN_FILE_BYTES, source=where, follow_symlinks=True)
    except safe_read.SafeReadError as exc:
        raise TokenError(str(exc)) from None
    if got is None:
        raise TokenError(f"{where}: cannot read (No such file or directory)")
    raw, st = got
    try:
        return st.st_mode, raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenError(f"{where}: not UTF-8 text") from None


def read_token(token_file: Path | None, *, env: dict[str, str] | None = None) -> SecretStr | None:
    """The bearer token from ``token_file`` (first line, stripped), else from $FLYSERVE_SIDECAR_TOKEN.

    A token file readable by group or others is accepted with a warning: refusing would lock the
    operator out of a running deployment, but they should know (docs/sidecar.md, security notes).
    """
    env = os.environ if env is None else env
    if token_file is not None:
        mode, text = _read_token_file(token_file)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "token file %s is accessible by group/others (mode %o); chmod 600 it",
                token_file,
                mode & 0o777,
            )
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        where = f"--token-file {token_file}"
    elif env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].strip()
        where = f"${TOKEN_ENV}"
    else:
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenError(f"{where}: the token must be at least {MIN_TOKEN_LENGTH} characters")
    return SecretStr(token)
