"""Where the named profiles and operators' thresholds files are found, and how they are read.

The file side of the thresholds: policy parses a mapping or YAML bytes and never touches a file, so
a rank's per-step decision cannot block on a disk; this package finds a profile
(``$FLYSERVE_PROFILE_PATH``, the wheel's ``flyserve/profiles``, the source tree's config/profiles),
reads it through flyserve.files.safe_read and hands the bytes to policy. Not named ``profiles``:
the wheel force-includes config/profiles as the data folder ``flyserve/profiles``.
"""

from flyserve.thresholds_files.locate import available_profiles, is_path_like, profile_dirs, profile_path
from flyserve.thresholds_files.read import load_profile, read_yaml_file

__all__ = [
    "available_profiles",
    "is_path_like",
    "load_profile",
    "profile_dirs",
    "profile_path",
    "read_yaml_file",
]
