"""`flyserve flydsl compile`: the parts that need no FlyDSL (run in CI).

The model geometry from a HF config.json and --tp, the variants a deployment runs, the child's
result line, the verdicts, the code-object reader (on a code object FlyDSL's compiler produced,
committed in results/flydsl/), the report of a recorded run, the warm-up's "compiled or loaded"
log line. The compile itself runs in tests/integration/test_flydsl_compile_live.py where a FlyDSL
checkout is present.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.doctor import compile as cc
from flyserve.doctor.code_object import CodeObjectError, MsgPackReader, amdgpu_metadata, kernel_facts
from flyserve.doctor.compile_child import RESULT_MARK

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "tests" / "data" / "hf_configs" / "llama-3.1-8b-instruct.json"
RESULTS = REPO / "results" / "flydsl"
HSACO = RESULTS / "code-objects" / "943152de-warm-up-p64-lpt1.0.hsaco"


def write_config(tmp_path: Path, **cfg: object) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


# ----------------------------------------------------------------------------- geometry


@pytest.mark.parametrize(
    ("tp", "heads", "kv_heads"),
    [(1, 32, 8), (2, 16, 4), (8, 4, 1), (16, 2, 1), (32, 1, 1)],
)
def test_tp_splits_heads_and_kv_heads_per_rank(tp, heads, kv_heads):
    g = cc.geometry_from_hf_config(LLAMA, tp=tp)
    assert (g.num_heads, g.num_kv_heads, g.head_size, g.dtype) == (heads, kv_heads, 128, "bf16")
    assert g.source == f"llama-3.1-8b-instruct.json, tp {tp}"


def test_config_fields_head_dim_text_config_and_dtype(tmp_path):
    p = write_config(tmp_path, text_config={"num_attention_heads": 16, "num_key_value_heads": 4,
                                            "hidden_size": 2048, "head_dim": 64, "torch_dtype": "float16"})  # fmt: skip
    g = cc.geometry_from_hf_config(p, tp=4)
    assert (g.num_heads, g.num_kv_heads, g.head_size, g.dtype) == (4, 1, 64, "f16")
    # no num_key_value_heads: multi-head attention; no head_dim: hidden_size / heads; fp32 runs as bf16
    p = write_config(tmp_path, num_attention_heads=8, hidden_size=1024, torch_dtype="float32")
    g = cc.geometry_from_hf_config(p, tp=2)
    assert (g.num_heads, g.num_kv_heads, g.head_size, g.dtype) == (4, 4, 128, "bf16")
    assert cc.geometry_from_hf_config(p, tp=2, dtype="fp32").dtype == "fp32"


@pytest.mark.parametrize(
    ("cfg", "tp", "needle"),
    [
        (
            {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096},
            3,
            "--tp 3 does not divide",
        ),
        (
            {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096},
            12,
            "num_attention_heads",
        ),
        (
            {"num_attention_heads": 24, "num_key_value_heads": 6, "hidden_size": 3072},
            4,
            "num_key_value_heads",
        ),
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}, 0, "--tp must be"),
        (
            {"num_key_value_heads": 8, "hidden_size": 4096},
            1,
            "'num_attention_heads' must be a positive integer",
        ),
        ({"num_attention_heads": "32", "hidden_size": 4096}, 1, "'num_attention_heads'"),
        ({"num_attention_heads": 7, "hidden_size": 4096}, 1, "hidden_size is not a multiple"),
        ({"num_attention_heads": 8, "hidden_size": 4096, "torch_dtype": "int8"}, 1, "'torch_dtype'"),
    ],
)
def test_bad_config_or_tp_names_the_field_and_the_file(tmp_path, cfg, tp, needle):
    p = write_config(tmp_path, **cfg)
    with pytest.raises(cc.CompileCheckError, match=needle.replace("(", r"\(")) as info:
        cc.geometry_from_hf_config(p, tp=tp)
    if "tp" not in needle:
        assert str(p) in str(info.value)


def test_unreadable_or_non_json_config(tmp_path):
    with pytest.raises(cc.CompileCheckError, match="cannot read"):
        cc.geometry_from_hf_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(cc.CompileCheckError, match="not JSON"):
        cc.geometry_from_hf_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(cc.CompileCheckError, match="JSON object"):
        cc.geometry_from_hf_config(tmp_path / "list.json")


# ----------------------------------------------------------------------------- variants

G = cc.Geometry(num_heads=4, num_kv_heads=1, head_size=128, dtype="bf16")


def test_variants_of_pr1056_cover_both_pages_both_lpt_values_and_the_light_kernel():
    vs = cc.plan_variants(G, page_sizes=(128, 64), has_causal_lpt=True)
    assert [v.name for v in vs] == [
        "warm-up-p64-lpt0", "warm-up-p64-lpt1", "serve-p64-lpt0", "serve-p64-lpt1", "short-p64", "light-p64",
        "warm-up-p128-lpt0", "warm-up-p128-lpt1", "serve-p128-lpt0", "serve-p128-lpt1", "short-p128",
    ]  # fmt: skip
    by = {v.name: v for v in vs}
    # the warm-up is flyserve's batch (contiguous, 512 tokens: past the light kernel's 256)
    assert by["warm-up-p128-lpt1"].layout == "contiguous" and by["warm-up-p128-lpt1"].lpt is True
    assert by["warm-up-p64-lpt0"].q_lens == (512,)
    # serving is on vLLM's cache views; the short batch stays under the light kernel's bound
    assert {by[n].layout for n in ("serve-p64-lpt0", "short-p64", "short-p128")} == {"vllm"}
    assert max(by["short-p64"].q_lens) <= 256 < max(by["serve-p64-lpt1"].q_lens)
    # the light kernel only where it is reachable: page 64, contiguous K/V
    assert by["light-p64"].layout == "contiguous" and "light-p128" not in by
    assert all((v.num_heads, v.num_kv_heads, v.head_size, v.dtype) == (4, 1, 128, "bf16") for v in vs)
    assert all(v.expect == "ok" for v in vs)


def test_variants_of_main_have_one_page_and_no_lpt_and_wrong_calls_expect_rejection():
    vs = cc.plan_variants(G, page_sizes=(64,), has_causal_lpt=False, wrong_calls=True)
    names = [v.name for v in vs]
    assert names == ["warm-up-p64", "serve-p64", "short-p64", "light-p64",
                     "wrong-page16", "wrong-head96", "wrong-fp32", "wrong-extra-keyword"]  # fmt: skip
    wrong = {v.name: v for v in vs if v.batch == "wrong"}
    assert all(v.expect == "rejected" for v in wrong.values())
    assert wrong["wrong-page16"].page_size == 16 and wrong["wrong-head96"].head_size == 96
    assert wrong["wrong-fp32"].dtype == "fp32" and wrong["wrong-extra-keyword"].extra_kwargs == {
        "softmax_scale": round(128**-0.5, 6)
    }
    # each wrong call has exactly one fault: the others are the good geometry
    assert wrong["wrong-page16"].dtype == "bf16" and wrong["wrong-head96"].page_size == 64


# ----------------------------------------------------------------------------- child output and verdicts


def test_parse_child_output_takes_the_last_result_line():
    out = (
        "noise\n"
        + RESULT_MARK
        + ' {"outcome": "raised"}\nmore\n'
        + RESULT_MARK
        + ' {"outcome": "returned"}\n'
    )
    assert cc.parse_child_output(out) == {"outcome": "returned"}
    assert cc.parse_child_output("compiler printed this\n") is None
    assert cc.parse_child_output(RESULT_MARK + " {truncated") is None
    assert cc.parse_child_output(RESULT_MARK + " [1, 2]") is None


def _kernel(**kw):
    base = {"symbol": "flash_attn_dualwave_swp_gfx950_kernel_0", "code_object_bytes": 26640, "vgprs": 246,
            "sgprs": 50, "lds_bytes": 76288, "vgpr_spills": 0, "sgpr_spills": 0}  # fmt: skip
    return {**base, **kw}


def test_judge_every_outcome():
    ok_v = cc.plan_variants(G, page_sizes=(64,), has_causal_lpt=True)[0]
    wrong_v = cc.wrong_variants(G, has_causal_lpt=True)[0]
    returned = {"outcome": "returned", "kernels": [_kernel()], "compiles": 1}
    assert cc.judge(ok_v, returned, rc=0, stderr_tail="", cached=False) == (
        "ok",
        "flash_attn_dualwave_swp_gfx950_kernel_0 26640 B, 246 VGPRs, 0 spills",
    )
    raised = {"outcome": "raised", "error_type": "ValueError", "message": "native paged KV supports page_size in "
              "(64, 128), got 16", "where": "kernels/attention/flash_attn_interface.py:470", "kernels": []}  # fmt: skip
    status, summary = cc.judge(wrong_v, raised, rc=0, stderr_tail="", cached=False)
    assert status == "ok" and "rejected by FlyDSL as expected: ValueError: native paged KV" in summary
    assert cc.judge(ok_v, raised, rc=0, stderr_tail="", cached=False)[0] == "fail"
    assert cc.judge(wrong_v, returned, rc=0, stderr_tail="", cached=False) == (
        "fail",
        "FlyDSL accepted a call it must reject",
    )
    # nothing compiled: a failure unless the variant was loaded from a cache
    empty = {"outcome": "returned", "kernels": [], "compiles": 0}
    assert cc.judge(ok_v, empty, rc=0, stderr_tail="", cached=False)[0] == "fail"
    assert cc.judge(ok_v, empty, rc=0, stderr_tail="", cached=True) == (
        "ok",
        "loaded from FlyDSL's cache: nothing compiled",
    )
    # a child killed in native code (SIGABRT) leaves no result line
    status, summary = cc.judge(ok_v, None, rc=-6, stderr_tail="libamdhip64.so.7: cannot open", cached=False)
    assert status == "fail" and "exited -6" in summary and "libamdhip64" in summary
    setup = {"outcome": "setup-failed", "error_type": "FlyDSLUnavailable", "message": "no kernels/attention"}
    assert cc.judge(ok_v, setup, rc=0, stderr_tail="", cached=False)[0] == "fail"


def test_machine_check_names_what_is_missing(tmp_path):
    problems = cc.check_machine(None, None)
    assert any("VLLM_FLYDSL_KERNELS_PATH is not set" in p for p in problems)
    assert any("ROCM_PATH is not set" in p for p in problems)
    problems = cc.check_machine(str(tmp_path), str(tmp_path))
    assert any("has no kernels/attention/" in p for p in problems)
    assert any("ROCM_PATH has no amdgcn/bitcode/ockl.bc" in p for p in problems)
    assert any("ROCM_PATH has no llvm/bin/ld.lld" in p for p in problems)


def test_child_env_sets_flydsls_real_switch_names(tmp_path):
    env = cc.child_env(kernels_path="k", rocm_path="r", cache_dir=None)
    assert env["COMPILE_ONLY"] == "1" and env["ARCH"] == "gfx950" and env["FLYDSL_GPU_ARCH"] == "gfx950"
    assert env["FLYDSL_RUNTIME_ENABLE_CACHE"] == "0" and "FLYDSL_RUNTIME_RUN_ONLY" not in env
    env = cc.child_env(kernels_path="k", rocm_path="r", cache_dir=str(tmp_path), run_only=True)
    assert env["FLYDSL_RUNTIME_ENABLE_CACHE"] == "1" and env["FLYDSL_RUNTIME_CACHE_DIR"] == str(tmp_path)
    assert env["FLYDSL_RUNTIME_RUN_ONLY"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(REPO)  # the child imports this flyserve


def _fake_children(monkeypatch, variants, jobs: int) -> list[int]:
    """run_child replaced by a function (no process) that records how many children run at once.
    With jobs > 1 the first wave waits until all of it is running (a barrier: the peak is jobs by
    construction, not by timing), and the first variant ends only after the last one ended: the
    children end out of the variants' order. A broken wait fails the test within 10 s."""
    import threading

    from flyserve.doctor.compile import runs

    running = [0]
    peak = [0]
    lock = threading.Lock()
    first_wave = threading.Barrier(min(jobs, len(variants)))
    last_ended = threading.Event()
    names = [v.name for v in variants]

    def fake(payload, env, **kw):
        i = names.index(payload["name"])
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        if jobs > 1 and i < jobs:
            first_wave.wait(timeout=10)
        if jobs > 1 and i == 0:
            assert last_ended.wait(timeout=10), "the last variant never ended"
        with lock:
            running[0] -= 1
        if i == len(names) - 1:
            last_ended.set()
        return {"outcome": "returned", "kernels": [_kernel()], "compiles": 1}, 0, "", 0.1

    monkeypatch.setattr(runs, "run_child", fake)
    return peak


@pytest.mark.parametrize("jobs", [1, 3])
def test_jobs_compile_at_once_and_report_in_the_variants_order(monkeypatch, jobs):
    variants = [v for v in cc.plan_variants(G, page_sizes=(64,), has_causal_lpt=True) if v.batch != "wrong"][
        :4
    ]
    assert len(variants) == 4
    peak = _fake_children(monkeypatch, variants, jobs)
    calls: list[tuple[int, str, bool]] = []
    results = cc.run_variants(
        variants,
        {},
        cached=False,
        jobs=jobs,
        progress=lambda i, n, v, r: calls.append((i, v.name, r is None)),
    )
    assert [r.variant.name for r in results] == [v.name for v in variants]
    assert all(r.status == "ok" for r in results)
    assert peak[0] == jobs
    # every variant says when it starts and when it ends, with its own index
    assert sorted(calls) == sorted([(i, v.name, s) for i, v in enumerate(variants) for s in (True, False)])
    for i, v in enumerate(variants):
        assert calls.index((i, v.name, True)) < calls.index((i, v.name, False))
    ends = [name for _, name, started in calls if not started]
    if jobs == 1:
        assert ends == [v.name for v in variants]
    else:  # the first variant ended last, its result still first in the report
        assert ends[-1] == variants[0].name


class _FakeChild:
    """What run_variants may kill: kill() wakes the fake child blocked on it."""

    def __init__(self) -> None:
        import threading

        self.killed = threading.Event()

    def poll(self) -> int | None:
        return -9 if self.killed.is_set() else None

    def kill(self) -> None:
        self.killed.set()


@pytest.mark.parametrize("where", ["child", "progress"])
def test_the_first_error_abandons_the_run_kills_the_running_child_and_starts_no_other(monkeypatch, where):
    """Two at a time over four variants: variant 0's child runs until killed; variant 1 fails (its
    child, or the progress line of its start). The error comes out, variant 0's child is killed and
    neither 2 nor 3 ever starts. A broken wait fails the test within 10 s."""
    from flyserve.doctor.compile import runs

    variants = [v for v in cc.plan_variants(G, page_sizes=(64,), has_causal_lpt=True) if v.batch != "wrong"][
        :4
    ]
    names = [v.name for v in variants]
    blocked = _FakeChild()
    started: list[str] = []

    def fake(payload, env, **kw):
        i = names.index(payload["name"])
        started.append(payload["name"])
        if i == 0:
            kw["started"](blocked)
            assert blocked.killed.wait(timeout=10), "the running child was never killed"
            return None, -9, "killed", 0.1
        if where == "child":
            raise RuntimeError("the compiler's child could not be started")
        return {"outcome": "returned", "kernels": [_kernel()], "compiles": 1}, 0, "", 0.1

    def progress(i, n, v, r):
        if where == "progress" and i == 1:
            raise RuntimeError("stderr is gone")

    monkeypatch.setattr(runs, "run_child", fake)
    with pytest.raises(RuntimeError, match="could not be started|stderr is gone"):
        cc.run_variants(variants, {}, cached=False, jobs=2, progress=progress)
    assert blocked.killed.is_set()
    assert names[2] not in started and names[3] not in started


def test_progress_is_never_entered_twice_at_once(monkeypatch):
    import threading
    import time

    variants = [v for v in cc.plan_variants(G, page_sizes=(64,), has_causal_lpt=True) if v.batch != "wrong"][
        :4
    ]
    _fake_children(monkeypatch, variants, 3)
    inside = threading.Lock()
    overlaps = []

    def progress(i, n, v, r):
        if not inside.acquire(blocking=False):
            overlaps.append(v.name)
            return
        time.sleep(0.005)  # long enough for another thread to arrive
        inside.release()

    cc.run_variants(variants, {}, cached=False, jobs=3, progress=progress)
    assert overlaps == []


@pytest.mark.parametrize("jobs", [0, -1, cc.MAX_JOBS + 1])
def test_jobs_out_of_range_is_refused_naming_the_flag(jobs):
    with pytest.raises(cc.CompileCheckError, match="--jobs"):
        cc.run_variants([], {}, cached=False, jobs=jobs)


@pytest.mark.slow  # 0.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_cli_refuses_bad_arguments_before_starting_anything(tmp_path, monkeypatch):
    from flyserve.cli import app

    monkeypatch.delenv("VLLM_FLYDSL_KERNELS_PATH", raising=False)
    monkeypatch.delenv("ROCM_PATH", raising=False)
    run = CliRunner().invoke
    res = run(app, ["flydsl", "compile"])
    assert res.exit_code == 2 and "--model-config" in res.output
    res = run(app, ["flydsl", "compile", "--model-config", str(LLAMA), "--tp", "3"])
    assert res.exit_code == 2 and "--tp 3 does not divide num_attention_heads" in res.output
    res = run(app, ["flydsl", "compile", "--model-config", str(LLAMA), "--tp", "8"])
    assert res.exit_code == 2 and "VLLM_FLYDSL_KERNELS_PATH is not set" in res.output
    res = run(app, ["flydsl", "compile", "--model-config", str(LLAMA), "--run-only"])
    assert res.exit_code == 2 and "--run-only needs --cache-dir" in res.output
    res = run(app, ["flydsl", "compile", "--model-config", str(LLAMA), "--batch", "decode"])
    assert res.exit_code == 2 and "--batch ['decode']" in res.output
    for jobs in ("0", str(cc.MAX_JOBS + 1), "two"):
        res = run(app, ["flydsl", "compile", "--model-config", str(LLAMA), "--jobs", jobs])
        assert res.exit_code == 2 and "--jobs" in res.output, res.output


# ----------------------------------------------------------------------------- code objects


def test_code_object_facts_from_a_gfx950_object_flydsls_compiler_made():
    """The committed object (results/flydsl/code-objects/) against the facts the same run recorded."""
    blob = HSACO.read_bytes()
    (k,) = kernel_facts(blob)
    rec = json.loads((RESULTS / "943152de.json").read_text())
    row = next(r for r in rec["variants"] if r["variant"]["name"] == "warm-up-p64-lpt1")
    recorded = row["kernels"][0]
    assert k.as_dict() == {key: recorded[key] for key in k.as_dict()}
    assert k.symbol == "flash_attn_dualwave_swp_gfx950_kernel_0" and k.target.endswith("gfx950")
    assert k.code_object_bytes == len(blob) and k.wavefront_size == 64
    meta = amdgpu_metadata(blob)
    assert meta["amdhsa.kernels"][0][".symbol"] == k.symbol + ".kd"


def test_code_object_reader_refuses_what_is_not_one():
    with pytest.raises(CodeObjectError, match="not an ELF"):
        kernel_facts(b"not an elf" * 10)
    blob = bytearray(HSACO.read_bytes())
    blob[4] = 1  # 32-bit class
    with pytest.raises(CodeObjectError, match="64-bit"):
        kernel_facts(bytes(blob))
    with pytest.raises(CodeObjectError, match="section table"):
        kernel_facts(HSACO.read_bytes()[:200])


def test_msgpack_reader_types():
    data = bytes([0x83, 0xA1, 0x61, 0xCD, 0x01, 0x00, 0xA1, 0x62, 0x92, 0xC3, 0xFF, 0xA1, 0x63, 0xC0])
    assert MsgPackReader(data).read() == {"a": 256, "b": [True, -1], "c": None}
    with pytest.raises(CodeObjectError, match="truncated"):
        MsgPackReader(bytes([0xDA, 0x00])).read()
    with pytest.raises(CodeObjectError, match="unsupported"):
        MsgPackReader(bytes([0xC7])).read()


# ----------------------------------------------------------------------------- recorded runs


@pytest.mark.parametrize("rev", ["943152de", "11c4174d"])
def test_recorded_run_of_each_revision_reports_every_variant_ok(rev):
    rec = json.loads((RESULTS / f"{rev}.json").read_text())
    assert rec["format"] == cc.FORMAT and rec["kernels_path"] == f"FlyDSL-{rev}"
    assert rec["summary"] == {"ok": len(rec["variants"]), "fail": 0}
    expected = cc.plan_variants(cc.Geometry(**{k: v for k, v in rec["geometry"].items()}),
                                page_sizes=rec["revision"]["page_sizes"],
                                has_causal_lpt=rec["revision"]["causal_lpt"], wrong_calls=True)  # fmt: skip
    assert [r["variant"]["name"] for r in rec["variants"]] == [v.name for v in expected]
    for r in rec["variants"]:
        if r["variant"]["batch"] == "wrong":
            assert r["outcome"] == "raised" and r["kernels"] == []
            continue
        (k,) = r["kernels"]
        assert k["target"].endswith("gfx950") and k["vgpr_spills"] == 0 and k["sgpr_spills"] == 0
        # the light kernel: contiguous short batches; on main also vLLM's short batches (main copies
        # strided K/V to contiguous first, and flyserve keeps its path off for that reason)
        light = r["variant"]["batch"] == "light" or (
            r["variant"]["batch"] == "short" and not rec["revision"]["strided_kv"]
        )
        assert ("generic" in k["symbol"]) is light, r["variant"]["name"]
        assert (r["vllm_layout_problem"] is None) is rec["revision"]["strided_kv"]
    table = (RESULTS / f"{rev}.txt").read_text()
    assert cc.render(rec).split("\n", 1)[1] == table.split("\n", 1)[1].rstrip("\n")


def test_recorded_wrong_calls_carry_flydsls_messages():
    rec = json.loads((RESULTS / "943152de.json").read_text())
    msg = {r["variant"]["name"]: r["message"] for r in rec["variants"] if r["variant"]["batch"] == "wrong"}
    assert "page_size in (64, 128), got 16" in msg["wrong-page16"]
    assert "96" in msg["wrong-head96"]
    assert "only supports bf16/f16/fp8" in msg["wrong-fp32"]
    assert "unexpected keyword argument 'softmax_scale'" in msg["wrong-extra-keyword"]


def test_short_serving_batches_take_dualwave_on_pr1056():
    """vLLM's strided cache never reaches the light kernel on #1056 (the corrected note)."""
    rec = json.loads((RESULTS / "943152de.json").read_text())
    short = [r for r in rec["variants"] if r["variant"]["batch"] == "short"]
    assert short and all("dualwave" in r["kernels"][0]["symbol"] for r in short)


# ----------------------------------------------------------------------------- the warm-up's log line


def test_warm_up_says_whether_it_compiled_or_loaded(tmp_path, monkeypatch, caplog):
    from _support import require_module

    torch = require_module("torch")
    from flydsl_cache_fakes import artifact_bytes

    from flyserve.vllm import flydsl_kernel as fk

    cache = tmp_path / "cache"
    monkeypatch.setenv(fk.CACHE_DIR_ENV, str(cache))
    monkeypatch.delenv(fk.CACHE_ENABLE_ENV, raising=False)

    def fake_fn(q, k, v, **kw):  # stands in for FlyDSL: a compile writes one cache file per LPT value
        d = cache / "launch_flash_attn_dualwave_swp_abc"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{int(kw.get('causal_lpt', False))}.pkl").write_bytes(artifact_bytes())  # what FlyDSL writes

    kernel = fk.FlyDSLKernel(fake_fn, fk.FlyDSLRevision(True, (64, 128), True, "interface.py"))
    args = {"dtype": torch.bfloat16, "device": "cpu", "num_heads": 2, "num_kv_heads": 1, "head_size": 64,
            "page_size": 64, "is_capturing": lambda: False}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        assert fk.warm_up(kernel, **args) == [False, True]
    assert "FlyDSL warm-up compiled 2 kernel(s)" in caplog.text and str(cache) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, **args)
    assert (
        f"loaded from FlyDSL's cache {cache}" in caplog.text and "nothing compiled (2 cached" in caplog.text
    )
    caplog.clear()
    monkeypatch.setenv(fk.CACHE_ENABLE_ENV, "0")
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        fk.warm_up(kernel, **args)
    assert "disk cache is off" in caplog.text


def test_cache_location_follows_flydsls_rules(tmp_path, monkeypatch):
    from flyserve.vllm import flydsl_kernel as fk

    monkeypatch.delenv(fk.CACHE_ENABLE_ENV, raising=False)
    monkeypatch.delenv(fk.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fk.flydsl_cache_dir() == str(tmp_path / ".flydsl" / "cache")
    assert fk.flydsl_cache_entries() == frozenset()  # no folder yet
    for off in ("0", "false", "", "nope"):  # FlyDSL's OptBool: only 1/true/yes/on are true
        monkeypatch.setenv(fk.CACHE_ENABLE_ENV, off)
        assert fk.flydsl_cache_dir() is None and fk.flydsl_cache_entries() is None
    monkeypatch.setenv(fk.CACHE_ENABLE_ENV, "TRUE")
    monkeypatch.setenv(fk.CACHE_DIR_ENV, "")
    assert fk.flydsl_cache_dir() is None


def test_more_than_one_kv_head_per_rank_compiles_but_flyserve_keeps_the_path_off():
    """TP 2 (4 KV heads per rank) on vLLM's cache: FlyDSL compiles (it would copy), flyserve says no."""
    rec = json.loads((RESULTS / "943152de-tp2-serve.json").read_text())
    assert rec["geometry"]["num_kv_heads"] == 4 and rec["summary"]["fail"] == 0
    for r in rec["variants"]:
        assert r["kernels"][0]["symbol"] == "flash_attn_dualwave_swp_gfx950_kernel_0"
        assert "pages are not page_size rows apart" in r["vllm_layout_problem"]
        assert cc.served_note(r) == "no: path off"
