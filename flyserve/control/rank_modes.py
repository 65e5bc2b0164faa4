"""How a rank learns of new versions (RankControl.mode, reported as control_mode): the names both
the rank (flyserve.control.rank, flyserve.control.rank_daemon) and the vLLM side share."""

from __future__ import annotations

FILE_POLLING = "file polling"
ENGINE_CHANNEL = "engine channel"
FILE_POLLING_UNORDERED = "file polling (executor does not order RPCs)"
CONTROL_MODES: tuple[str, ...] = (FILE_POLLING, ENGINE_CHANNEL, FILE_POLLING_UNORDERED)
"""How a rank learns of new versions: its own poll of control/current.json (the fallback), or a push
from vLLM's API server between two engine steps (flyserve.vllm.engine_channel). The third is file
polling kept on purpose: the executor runs RPCs apart from the steps (vLLM 0.32's legacy Ray DAG
path), so a push could land at different steps on different workers; the channel is refused."""
