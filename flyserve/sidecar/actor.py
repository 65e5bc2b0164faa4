"""The actor id the audit log and GET /thresholds show for a change made with the bearer token.

It was ``token:<first 8 hex of sha256(token)>``, shown to anyone on GET /thresholds: a 32-bit
offline check for guessing a weak token. Now it is an HMAC of the token under a
random key that never leaves the state directory (``control/actor.key``, 0600, made once, read with
the store's no-follow reader), or a name the operator gives (``--actor-name``). Entries written
before keep their old ``token:`` ids: readers treat the actor as an opaque string.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
from pathlib import Path

from flyserve.control.paths import StateDir
from flyserve.control.state_files import read_regular_file

log = logging.getLogger("flyserve.sidecar")

KEY_NAME = "actor.key"
KEY_HEX_CHARS = 64
"""The key file holds 32 random bytes as hex (and an optional newline), nothing else."""
ID_PREFIX = "token-hmac:"
ID_HEX_CHARS = 16
ACTOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
"""--actor-name: 1-64 characters of letters, digits, '.', '_', '@', '-' (it lands in JSON and logs)."""


class ActorNameError(ValueError):
    """--actor-name is not a usable name; the message says what is allowed (never echoes it)."""


def check_actor_name(name: str) -> str:
    if not ACTOR_NAME.fullmatch(name):
        raise ActorNameError(
            "--actor-name: 1-64 characters of letters, digits, '.', '_', '@' or '-', starting with a "
            f"letter or digit (got {len(name)} characters)"
        )
    return name


def key_path(state_dir: Path | StateDir) -> Path:
    return StateDir(state_dir).control_dir / KEY_NAME


def _parse_key(raw: bytes) -> bytes | None:
    text = raw.strip()
    if len(text) != KEY_HEX_CHARS:
        return None
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def load_or_create_key(state_dir: Path | StateDir) -> bytes:
    """The state directory's actor key, created (0600, O_EXCL) on first use.

    A key file that is a symlink, FIFO, device, too large or not 64 hex characters is never used:
    the sidecar logs it and keeps a key in memory for this run (ids then differ from the last run;
    the token stays uncheckable offline either way)."""
    path = key_path(state_dir)
    for _ in range(2):
        try:
            raw = read_regular_file(path, max_bytes=4 * KEY_HEX_CHARS)
        except (ValueError, OSError) as exc:
            log.error("actor key %s unusable (%s); using a key for this run only", path, exc)
            return secrets.token_bytes(32)
        if raw is not None:
            key = _parse_key(raw)
            if key is None:
                log.error(
                    "actor key %s is not %d hex characters; using a key for this run only",
                    path,
                    KEY_HEX_CHARS,
                )
                return secrets.token_bytes(32)
            return key
        key = secrets.token_bytes(32)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue  # another sidecar made it between our read and our create: read theirs
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue
            log.error("actor key %s cannot be created (%s); using a key for this run only", path, exc)
            return key
        try:
            os.write(fd, key.hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        return key
    return secrets.token_bytes(32)


def token_actor_id(token: str, key: bytes) -> str:
    """``token-hmac:<16 hex>``: which token made a change, checkable only with the state dir's key."""
    mac = hmac.new(key, token.encode(), hashlib.sha256).hexdigest()
    return ID_PREFIX + mac[:ID_HEX_CHARS]


def actor_id(token: str | None, *, state_dir: Path | StateDir, actor_name: str | None) -> str | None:
    """The id every change made with ``token`` is recorded under (None: no token, no changes)."""
    if token is None:
        return None
    if actor_name is not None:
        return check_actor_name(actor_name)
    return token_actor_id(token, load_or_create_key(state_dir))
