"""flyserve.vllm.topology: the engine index under data parallel, multi-node detection (file polling
refused across nodes) and the Ray legacy-DAG detection, over vLLM-0.32-shaped parallel configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flyserve.control import ControlPlane, RankControl
from flyserve.control.rank_modes import CONTROL_MODES, FILE_POLLING_UNORDERED
from flyserve.vllm.topology import (
    channel_configured,
    channel_ordering,
    engine_index,
    multinode_reason,
    multinode_refusal,
)


def pc(**kw):
    base = {"nnodes": 1, "data_parallel_size": 1, "data_parallel_size_local": 1, "data_parallel_rank": 0,
                "data_parallel_index": 0, "data_parallel_rank_local": None}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_engine_index_survives_vllms_reset_of_data_parallel_rank():
    # A dense model's DP engine 1 after reconfigure_for_independent_dp_rank: rank reset to 0.
    assert engine_index(pc(data_parallel_rank=0, data_parallel_index=1)) == 1
    assert engine_index(SimpleNamespace(data_parallel_rank=3)) == 3  # a vLLM without the index
    assert engine_index(SimpleNamespace()) == 0
    assert engine_index(pc(data_parallel_index=True, data_parallel_rank=2)) == 2  # a bool is no index


def test_multinode_is_seen_from_the_executor_the_moe_group_or_the_engines_node():
    assert multinode_reason(pc()) is None
    assert multinode_reason(pc(data_parallel_index=1, data_parallel_rank_local=1)) is None  # DP=2, one node
    assert "--nnodes 2" in multinode_reason(pc(nnodes=2))
    assert "1 of 2" in multinode_reason(pc(data_parallel_size=2, data_parallel_size_local=1))
    # --headless node 1 with --data-parallel-start-rank 1: global engine 1 is local engine 0.
    assert "engine 1 is local engine 0" in multinode_reason(
        pc(data_parallel_index=1, data_parallel_rank_local=0)
    )


def test_file_polling_across_nodes_is_refused_unless_the_channel_is_loaded():
    two_nodes = pc(nnodes=2)
    msg = multinode_refusal(two_nodes, {"VLLM_PLUGINS": "flyserve"})
    assert msg is not None and "file polling" in msg and "VLLM_PLUGINS=flyserve,flyserve-endpoint" in msg
    assert multinode_refusal(two_nodes, {}) is not None
    assert multinode_refusal(two_nodes, {"VLLM_PLUGINS": "flyserve, flyserve-endpoint"}) is None
    assert multinode_refusal(pc(), {}) is None  # one node: file polling is fine
    assert channel_configured({"VLLM_PLUGINS": "flyserve-endpointX"}) is False


@pytest.mark.parametrize(
    ("backend", "env", "version", "ordered", "executor"),
    [
        ("mp", {}, "0.32.0", True, "mp"),
        (None, {}, "0.32.0", True, "mp"),
        ("uni", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}, "0.32.0", True, "uni"),
        ("ray", {}, "0.32.0+cpu", True, "RayExecutorV2"),  # 0.32's default is V2
        ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}, "0.32.0", True, "RayExecutorV2"),
        ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}, "0.32.0", False, "RayDistributedExecutor"),
        ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": " 0 "}, None, False, "RayDistributedExecutor"),
        ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}, "0.33.0", True, "RayExecutorV2"),
    ],
)
def test_only_the_legacy_ray_dag_path_is_unordered(backend, env, version, ordered, executor):
    got = channel_ordering(backend, env, version)
    assert (got.ordered, got.executor) == (ordered, executor)


def test_a_rank_under_an_unordered_executor_refuses_the_channel_and_keeps_file_polling(tmp_path, monkeypatch):
    from flyserve.vllm import runtime

    plane = ControlPlane(tmp_path / "state", profile="cpu-tiny")
    plane.reload(actor="startup", startup=True)
    rc = RankControl(plane.state_dir, 0, report=False)
    legacy = SimpleNamespace(distributed_executor_backend="ray")
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    monkeypatch.setattr(runtime, "_vllm_parallel_config", lambda: legacy)
    monkeypatch.setitem(__import__("sys").modules, "vllm", SimpleNamespace(__version__="0.32.0"))
    runtime.keep_file_polling_if_unordered(rc)
    assert rc.mode == FILE_POLLING_UNORDERED and rc.mode in CONTROL_MODES
    v2 = plane.apply_overrides({"min_seq_len": 200}, actor="a").snapshot
    assert rc.apply_pushed(v2) == (False, "unordered executor")
    assert rc.mode == FILE_POLLING_UNORDERED and rc.snapshot.version == 1
    assert rc.report_dict()["control_mode"] == FILE_POLLING_UNORDERED
    rc.poll()  # the file poll still works: margin publishing
    assert rc.current(10_000).version == 2


def test_a_multinode_worker_without_the_channel_refuses_to_start(monkeypatch):
    from flyserve.vllm import runtime

    monkeypatch.setattr(runtime, "_vllm_parallel_config", lambda: pc(nnodes=2))
    monkeypatch.setenv("VLLM_PLUGINS", "flyserve")
    with pytest.raises(RuntimeError, match="cannot cross nodes"):
        runtime.RankRuntime(start=False, setup_metrics=False)
