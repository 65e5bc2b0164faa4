"""flyserve.control: thresholds that change while serving.

Operator side: ControlPlane (CLI, sidecar, file watcher) validates, versions, audits and publishes.
Rank side: RankControl.current(step) - one int compare per engine step - applies each version at
the engine step the publisher chose, the same on every rank. See docs/operations.md.
"""

from flyserve.control.config_file import read_config_file
from flyserve.control.errors import ControlIOError, DecodePathChangeRefused, VersionConflict
from flyserve.control.paths import StateDir, default_state_dir
from flyserve.control.plane import DEFAULT_LEAD_S, DEFAULT_STEP_MARGIN, ControlPlane
from flyserve.control.publishing import ChangeResult
from flyserve.control.rank import RankControl
from flyserve.control.snapshot import LAYERS, SOURCES, ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.watcher import Watcher
from flyserve.files.atomic import atomic_write

__all__ = [
    "DEFAULT_LEAD_S",
    "DEFAULT_STEP_MARGIN",
    "LAYERS",
    "SOURCES",
    "ChangeResult",
    "ConfigSnapshot",
    "ControlIOError",
    "ControlPlane",
    "DecodePathChangeRefused",
    "RankControl",
    "StateDir",
    "Store",
    "VersionConflict",
    "Watcher",
    "atomic_write",
    "default_state_dir",
    "read_config_file",
]
