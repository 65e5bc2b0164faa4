"""Whether a profile *path* named by a stored snapshot may be loaded by the control plane.

A snapshot names the profile its thresholds were laid over, and the plane builds every next change
from it (``load_profile(cur.profile)``). A profile *name* resolves only in the operator's profile
folders ($FLYSERVE_PROFILE_PATH, the shipped ones). A *path* is different: whoever can write
current.json could point it at a file they also control (one in the state directory, one in
/tmp) and from then on set the base of every change by editing that file, while every layer check
passes. So a stored path is believed only where the operator could have given it: it is this
process's own profile setting, or it is a regular file that only this user or root can change
(owner, mode and the folder that holds it, as for the FlyDSL cache), outside the state directory.
A Kubernetes ConfigMap mount (root-owned files behind symlinks, 0644) passes; a file a stranger
planted does not.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flyserve.thresholds_files.locate import is_path_like

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def stored_profile_refusal(profile: object, *, own_profile: str | None, state_dir: Path) -> str | None:
    """Why a stored snapshot's ``profile`` must not be loaded, or None if it may be. Cheap (two
    stat calls), no file content is read: the caller loads the profile only after this says yes."""
    if not isinstance(profile, str) or not is_path_like(profile):
        return None  # a name: looked up only in the operator's profile folders
    if own_profile is not None and profile == str(own_profile):
        return None  # the operator gave this process this very path
    try:
        real = Path(os.path.realpath(profile))
        st = os.stat(real)
        parent = os.stat(real.parent)
    except (OSError, ValueError) as exc:
        return f"the profile path cannot be checked ({getattr(exc, 'strerror', None) or type(exc).__name__})"
    if not stat.S_ISREG(st.st_mode):
        return "the profile path is not a regular file"
    if not _owner_ok(st):
        return "the profile file is owned by another user"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"the profile file is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if not _owner_ok(parent) or (parent.st_mode & _WRITABLE_BY_OTHERS and not parent.st_mode & stat.S_ISVTX):
        return "the folder holding the profile file can be changed by another user"
    try:
        state_real = Path(os.path.realpath(state_dir))
    except (OSError, ValueError):
        state_real = None
    if state_real is not None and (real == state_real or state_real in real.parents):
        return "the profile file is inside the state directory (profiles never live there)"
    return None
