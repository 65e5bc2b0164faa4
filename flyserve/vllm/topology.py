"""What a worker can tell about the deployment it runs in: its engine, whether the launch spans
nodes, and whether vLLM orders a collective RPC with the engine steps (the engine channel's premise).

Pure functions over a ``parallel_config``-like object and an environment mapping, so the unit tests
need no vLLM. Facts from vLLM 0.32's source (docs/operations.md, "Deployment shapes"):

* ``run_engine_core`` (v1/engine/core.py) gives every DP engine ``data_parallel_index = dp_rank`` and
  ``data_parallel_rank_local = local_dp_rank``; a dense model's engine is then made independent
  (``ParallelConfig.reconfigure_for_independent_dp_rank``: DP size 1, ``data_parallel_rank`` 0), an
  MoE model's keeps its DP fields (``DPEngineCoreProc``).
* ``Executor.get_class`` (v1/executor/abstract.py) picks ``RayExecutorV2`` for
  ``--distributed-executor-backend ray`` unless ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``; then the
  legacy ``RayDistributedExecutor`` (v1/executor/ray_executor.py) runs ``execute_model`` through a
  compiled Ray DAG (``_execute_dag``) and ``collective_rpc`` as ordinary actor calls: not ordered.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RAY_V2_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
PLUGINS_ENV = "VLLM_PLUGINS"
ENDPOINT_PLUGIN = "flyserve-endpoint"


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def engine_index(pc: Any) -> int:
    """The data-parallel engine index: ``data_parallel_index`` (vLLM 0.32+; survives the reset of
    ``data_parallel_rank`` for independent DP engines), else ``data_parallel_rank``, else 0."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        v = _int(getattr(pc, name, None))
        if v is not None and v >= 0:
            return v
    return 0


def multinode_reason(pc: Any) -> str | None:
    """Why this worker's launch spans more than one node, or None when nothing says so.

    Seen from a worker: the executor's own multi-node launch (``nnodes > 1``: a TP/PP group across
    nodes), an MoE DP group with fewer local engines than engines, or an engine whose global DP
    index differs from its local one (it runs on a node other than the first: ``--headless`` with
    ``--data-parallel-start-rank``). The first node of a dense DP launch cannot tell from its own
    config; its peers on the other nodes refuse, and the launch with them."""
    nnodes = _int(getattr(pc, "nnodes", None))
    if nnodes is not None and nnodes > 1:
        return f"the executor spans {nnodes} nodes (--nnodes {nnodes})"
    size = _int(getattr(pc, "data_parallel_size", None))
    local = _int(getattr(pc, "data_parallel_size_local", None))
    if size is not None and local is not None and size > 1 and local < size:
        return f"{local} of {size} data-parallel engines run on this node (--data-parallel-size-local)"
    index = _int(getattr(pc, "data_parallel_index", None))
    index_local = _int(getattr(pc, "data_parallel_rank_local", None))
    if index is not None and index_local is not None and index != index_local:
        return (
            f"data-parallel engine {index} is local engine {index_local} of its node "
            "(engines of lower index run on another node)"
        )
    return None


def channel_configured(env: Mapping[str, str] | None = None) -> bool:
    """True when this node's ``VLLM_PLUGINS`` names the endpoint plugin: the deployment uses the
    engine channel (set the same VLLM_PLUGINS on every node; a headless node has no API server, but
    its workers take the head's pushes)."""
    env = os.environ if env is None else env
    names = {n.strip() for n in env.get(PLUGINS_ENV, "").split(",")}
    return ENDPOINT_PLUGIN in names


def multinode_refusal(pc: Any, env: Mapping[str, str] | None = None) -> str | None:
    """The start-up error for file polling across nodes, or None when allowed.

    Nodes share no state directory: a rank polling its own node's control/current.json never learns
    of a change made on the head, and the head's sidecar never sees its report."""
    reason = multinode_reason(pc)
    if reason is None or channel_configured(env):
        return None
    return (
        f"flyserve: this vLLM launch spans nodes ({reason}) and thresholds would come by file polling, "
        "which cannot cross nodes (each node has its own state directory). Load the engine channel on "
        f"every node: {PLUGINS_ENV}=flyserve,{ENDPOINT_PLUGIN} (docs/operations.md, 'Deployment shapes')."
    )


@dataclass(frozen=True, slots=True)
class ChannelOrdering:
    """Whether the engine channel's pushes are ordered with the engine steps under this executor."""

    ordered: bool
    executor: str
    why: str


def channel_ordering(
    backend: Any, env: Mapping[str, str] | None = None, vllm_version: str | None = None
) -> ChannelOrdering:
    """``backend`` is ``parallel_config.distributed_executor_backend`` (a name, a class or None).

    Unordered only for vLLM 0.32's legacy Ray path: ``ray`` with ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND``
    set to 0 (vLLM reads ``bool(int(value))``, default "1"). vLLM 0.33 maps ``ray`` to RayExecutorV2
    whatever the variable says (notes of the 0.33.0 sdist), so a version >= 0.33 is ordered."""
    env = os.environ if env is None else env
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", None) or "mp"
    if name != "ray":
        return ChannelOrdering(True, name, "one ordered queue per worker (execute_model and RPCs)")
    if vllm_version is not None and _at_least(vllm_version, (0, 33)):
        return ChannelOrdering(True, "RayExecutorV2", "vLLM >= 0.33: Ray always runs RayExecutorV2")
    raw = (env.get(RAY_V2_ENV) or "1").strip()
    try:
        v2 = bool(int(raw))
    except ValueError:
        v2 = True  # vLLM itself would fail to start on a non-integer; nothing to decide here
    if v2:
        return ChannelOrdering(True, "RayExecutorV2", f"{RAY_V2_ENV}=1 (the default)")
    return ChannelOrdering(
        False,
        "RayDistributedExecutor",
        f"{RAY_V2_ENV}=0: the legacy Ray executor runs execute_model through a compiled DAG and "
        "collective RPCs as separate actor calls, not ordered with the steps",
    )


def _at_least(version: str, floor: tuple[int, int]) -> bool:
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts) >= floor
