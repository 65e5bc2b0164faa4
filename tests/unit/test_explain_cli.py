"""`flyserve explain` as a person runs it: a batch from flags, from a rank's shape log and from an
advice answer; thresholds from a profile, a file and a published version; prices with --costs;
bad input named and refused (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flyserve.cli import app
from flyserve.policy import BatchShape, decide
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.telemetry.shape_sample import ShapeSampleWriter
from flyserve.thresholds_files import load_profile

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["explain", *args])
    return r.exit_code, r.output


def test_flags_with_costs_name_every_rule_the_path_and_the_oracle():
    code, out = run("--query-lens", "1,1,1,1", "--seq-lens", "32768,32000,31000,30000", "--costs", "h200")
    assert code == 0, out
    for rule in ("has a prefill row", "context at least min_seq_len", "decode rows within the cap"):
        assert rule in out
    assert "FAIL -> no_prefill_rows" in out and "path: unified (no_prefill_rows)" in out
    model = CostModel(load_costs("h200"))
    q, s = np.array([1, 1, 1, 1]), np.array([32768, 32000, 31000, 30000])
    u, p = model.predict(q, s, "unified"), model.predict(q, s, "prefill")
    assert f"unified {u * 1e3:.3f} ms, prefill {p * 1e3:.3f} ms" in out
    assert f"oracle: prefill ({p * 1e3:.3f} ms)" in out and "only a restart changes it" in out


def test_json_output_agrees_with_decide():
    t = load_profile("gfx950")
    code, out = run("--query-lens", "1,2048", "--max-seq-len", "900", "--num-heads", "16", "--json")
    assert code == 0, out
    doc = json.loads(out)
    d = decide(BatchShape.from_query_lens([1, 2048], max_seq_len=900, num_heads=16, thresholds=t), t)
    assert (doc["path"], doc["reason"]) == (d.path, d.reason) == ("unified", "short_context")
    assert [r["verdict"] for r in doc["rules"]][:5] == ["pass"] * 4 + ["FAIL -> short_context"]


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_a_shape_log_line_and_an_advice_answer(tmp_path: Path):
    w = ShapeSampleWriter(tmp_path, rank=0, capacity=8)
    w.set_layer(head_size=128, block_size=16)
    w.add(7, [1] * 3, 40000, 32, True, [40000, 39000, 100], "unified", 1.0, None)
    w.add(8, [1, 4096], 20000, 32, True, [20000, 4096], "prefill", 1.1, None)
    w.flush()
    log = next((tmp_path / "shapes").glob("*.jsonl"))
    code, out = run("--sample", str(log), "--costs", "h200")  # the newest line: step 8
    assert code == 0, out
    assert "2 rows, 4097 tokens" in out and "32 heads" in out and "block size 16" in out
    code, out = run("--sample", str(log), "--index", "0")
    assert code == 0 and "3 rows" in out and "no_prefill_rows" in out
    advice = {"shapes": [{"engine": 0, "step": 8, "query_lens": [1, 4096], "seq_lens": [20000, 4096]}]}
    f = tmp_path / "advice.json"
    f.write_text(json.dumps(advice))
    code, out = run("--sample", str(f), "--num-heads", "32")
    assert code == 0 and "max_seq_len 20000" in out
    code, out = run("--sample", str(f), "--index", "5")
    assert code == 2 and "--index 5 is out of range (1 shapes)" in out


@pytest.mark.slow  # 1.1 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_thresholds_file_and_a_published_version(tmp_path: Path):
    args = ("--query-lens", "4096", "--max-seq-len", "8192", "--num-heads", "16")
    code, out = run(*args)
    assert code == 0 and "path: prefill (admitted)" in out
    f = tmp_path / "t.yaml"
    f.write_text("min_seq_len: 100000\n")
    code, out = run(*args, "--thresholds", str(f))
    assert code == 0 and "short_context" in out and f"{f} over profile gfx950" in out
    state = tmp_path / "state"
    r = runner.invoke(app, ["thresholds", "set", "min_seq_len=100000", "--state-dir", str(state), "--create"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["thresholds", "set", "min_seq_len=1000", "--state-dir", str(state)])
    assert r.exit_code == 0, r.output
    code, out = run(*args, "--version", "1", "--state-dir", str(state))  # what would version 1 have done
    assert code == 0, out
    assert "thresholds: version 1 of" in out and "FAIL -> short_context" in out
    code, out = run(*args, "--version", "2", "--state-dir", str(state))
    assert code == 0 and "path: prefill (admitted)" in out
    code, out = run(*args, "--version", "9", "--state-dir", str(state))
    assert code == 2 and "--version 9: not in the history" in out


@pytest.mark.slow  # 1.1 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_bad_input_is_named_and_refused(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-token-value\n")
    cases = [
        (("--query-lens", "1,x", "--max-seq-len", "9"), "--query-lens: every row length must be an integer"),
        (("--query-lens", "4,4", "--seq-lens", "9"), "--seq-lens has 1 rows"),
        (("--query-lens", "4", "--seq-lens", "2"), "seq_len >= query_len"),
        (("--query-lens", "4"), "give --seq-lens (per row) or --max-seq-len"),
        (("--query-lens", "4", "--max-seq-len", "9", "--costs", "h200"), "--costs prices rows"),
        (("--query-lens", "4", "--seq-lens", "9", "--costs", "h200", "--num-heads", "16"), "32 query heads"),
        (("--sample", str(secret)), "line 1 is not JSON"),
        (("--sample", "/dev/zero"), "not a regular file"),
        ((), "give the batch as --query-lens"),
        (("--query-lens", "4", "--max-seq-len", "9", "--profile", "nope"), "nope"),
    ]
    for args, words in cases:
        code, out = run(*args)
        assert code == 2 and words in out, (args, out)
        assert "hunter2" not in out
