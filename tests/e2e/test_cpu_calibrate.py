"""`flyserve calibrate --platform cpu`: the CPU pair timed on a real paged cache with vLLM's own
CPU attention op and flyserve's CPU SDPA path, the committed CPU cost table, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _support import require_module
from typer.testing import CliRunner

from flyserve.cli import app
from flyserve.policy import PREFILL, UNIFIED
from flyserve.pricing.costs import CostModel, load_costs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
runner = CliRunner()


def test_calibrate_cpu_quick_writes_a_table_and_a_profile(tmp_path: Path):
    require_module("vllm")
    costs, profile = tmp_path / "cpu.json", tmp_path / "cpu.yaml"
    r = runner.invoke(
        app,
        ["calibrate", "--platform", "cpu", "--grid", "cpu-quick", "--out-costs", str(costs),
         "--out-profile", str(profile)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(costs.read_text())
    assert doc["meta"]["platform"] == "cpu" and doc["meta"]["num_heads"] == 4
    assert len(doc["entries"]) == 9  # 2x2 decode, 2x2 prefill, 1 mixed
    assert all(e["agreement"] < 2e-2 and min(e["ms"].values()) > 0 for e in doc["entries"])
    assert "prefill_enabled" in profile.read_text() and "decode_path: unified" in profile.read_text()
    CostModel(load_costs(costs))  # a table the sidecar can use


def test_calibrate_cpu_refuses_a_gpu_grid_and_two_block_sizes(tmp_path: Path):
    base = ["calibrate", "--platform", "cpu", "--out-costs", str(tmp_path / "c.json"),
            "--out-profile", str(tmp_path / "p.yaml")]  # fmt: skip
    r = runner.invoke(app, [*base, "--grid", "quick"])
    assert r.exit_code == 2 and "cpu-quick" in r.output
    r = runner.invoke(app, [*base, "--block-size", "128", "--block-size", "256"])
    assert r.exit_code == 2 and "one block size" in r.output
    assert not (tmp_path / "c.json").exists()


def test_the_committed_cpu_table_is_for_the_tiny_models_layer():
    from flyserve.vllm.tiny_model import HEADS, HIDDEN, KV_HEADS

    t = load_costs("cpu")
    assert (t.meta["num_heads"], t.meta["num_kv_heads"], t.meta["head_size"]) == (
        HEADS,
        KV_HEADS,
        HIDDEN // HEADS,
    )
    assert t.meta["block_size"] == 128  # vLLM's CPU default
    m = CostModel(t)
    # Measured: on this CPU the SDPA stand-in is the slower path for decode rows and prefill chunks.
    for q, s in (([1] * 8, [512] * 8), ([200], [200]), ([1, 1, 64], [300, 300, 64])):
        q_, s_ = np.asarray(q), np.asarray(s)
        assert m.predict(q_, s_, PREFILL) > m.predict(q_, s_, UNIFIED)
