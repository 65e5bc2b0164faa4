"""scripts/contracts/vllm_upstream.py: what a new vLLM changes for flyserve, before it is recorded.

Run on two small synthetic vLLM trees written here (a directory and the same tree as a wheel), and on
the recorded 0.33.0 and 0.34.0 touch points.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile

import pytest
from _support import REPO

pytestmark = pytest.mark.slow  # 11 s on the 2-core VM: builds and reads synthetic vLLM trees, wheels

_spec = importlib.util.spec_from_file_location(
    "vllm_upstream", REPO / "scripts" / "contracts" / "vllm_upstream.py"
)
up = importlib.util.module_from_spec(_spec)
sys.modules["vllm_upstream"] = up
_spec.loader.exec_module(up)
tp = up.tp
RECORDS = tp.load_records(REPO / tp.RECORDS)

AITER_KW = (
    "q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k", "max_seqlen_k", "softmax_scale",
    "causal", "window_size", "block_table", "softcap", "q_descale", "k_descale", "v_descale",
)  # fmt: skip


def write_tree(root, *, new_release: bool):
    """A vLLM-shaped tree with a few touch points. The new release adds an AttentionBackend member and
    an AttentionImpl method, drops WorkerWrapperBase.execute_model (flyserve names it) and
    vllm.platforms (flyserve imports current_platform from it), and passes aiter one more keyword."""
    files = {
        "vllm/__init__.py": "",
        **({} if new_release else {"vllm/platforms/__init__.py": "current_platform = None\n"}),
        "vllm/v1/attention/backend.py": (
            "class AttentionBackend:\n"
            "    @classmethod\n    def supports_head_size(cls, head_size): ...\n"
            + ("    @classmethod\n    def supports_new_thing(cls, x): ...\n" if new_release else "")
            + "class AttentionImpl:\n    def forward(self, layer, query): ...\n"
            + ("    def brand_new_hook(self): ...\n" if new_release else "")
        ),
        "vllm/v1/worker/worker_base.py": (
            "class WorkerWrapperBase:\n    def __getattr__(self, attr): ...\n"
            + ("" if new_release else "    def execute_model(self, scheduler_output): ...\n")
        ),
        "vllm/v1/attention/backends/rocm_aiter_unified_attn.py": (
            "class RocmAiterUnifiedAttentionImpl:\n"
            "    def __init__(self):\n"
            "        from aiter.ops.triton.unified_attention import unified_attention\n"
            "        self.unified_attention = unified_attention\n"
            "    def forward(self):\n"
            f"        self.unified_attention({', '.join(k + '=None' for k in AITER_KW)}"
            + (", new_flag=True)\n" if new_release else ")\n")
        ),
    }
    if new_release:
        files["vllm-9.9.0.dist-info/METADATA"] = (
            "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.0\nRequires-Dist: torch==9.0.0\n"
        )
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def trees(tmp_path):
    return write_tree(tmp_path / "old", new_release=False), write_tree(tmp_path / "new", new_release=True)


def _run(capsys, *argv):
    rc = up.main([str(a) for a in argv])
    return rc, capsys.readouterr().out


def test_a_synthetic_release_against_its_predecessor(trees, capsys):
    old, new = trees
    rc, out = _run(capsys, new, "--against", old, "--json")
    r = json.loads(out)
    assert rc == 1 and r["release"] == "9.9.0"
    assert r["touchpoints"]["AttentionBackend"] == ["changed: +supports_new_thing(cls, x)"]
    assert r["touchpoints"]["WorkerWrapperBase"] == ["changed: -execute_model"]
    assert r["unaccounted_impl_methods"] == ["brand_new_hook"]
    (gone,) = r["imports"]
    assert gone.startswith("vllm.platforms:current_platform: no module vllm.platforms (flyserve/vllm/")
    (dropped,) = r["dropped_names_flyserve_uses"]
    assert (
        dropped.startswith("WorkerWrapperBase.execute_model: gone")
        and "flyserve/vllm/startup_phase.py" in dropped
    )
    (member,) = r["new_backend_members"]
    assert "supports_new_thing" in member and "flyserve does not answer it" in member
    (aiter,) = r["aiter_call"]
    assert "passes new_flag=" in aiter and "e4048607" in aiter
    assert any("torch==9.0.0" in n for n in r["notes"])


def test_the_same_release_as_a_wheel_reads_the_same(trees, tmp_path, capsys):
    old, new = trees
    wheel = tmp_path / "vllm-9.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in sorted(new.rglob("*")):
            if f.is_file():
                z.write(f, f.relative_to(new).as_posix())
    _rc, from_dir = _run(capsys, new, "--against", old, "--json")
    rc, from_wheel = _run(capsys, wheel, "--against", old, "--json")
    assert rc == 1 and json.loads(from_wheel) == json.loads(from_dir)


def test_the_text_report_says_what_to_do(trees, capsys):
    old, new = trees
    rc, out = _run(capsys, new, "--against", old)
    assert rc == 1 and out.startswith("vLLM 9.9.0 against the recorded unknown (old): ")
    assert "AttentionImpl methods flyserve's composite does not account for" in out
    assert "next: handle each finding" in out


def test_a_release_that_changes_nothing_exits_0(trees, capsys):
    old, _new = trees
    rc, out = _run(capsys, old, "--against", old)
    assert rc == 0 and "nothing changed for flyserve" in out


def test_an_unreadable_source_exits_2(tmp_path, capsys):
    rc = up.main([str(tmp_path / "missing")])
    assert rc == 2 and "cannot read it" in capsys.readouterr().err


def test_034_against_033_on_the_recorded_data():
    r = up.review(RECORDS["0.34.0"], RECORDS["0.33.0"], release="0.34.0", against="0.33.0")
    assert r.touchpoints["AttentionBackend"] == [
        "changed: +supports_head_size_v(cls, head_size, head_size_v)"
    ]
    assert r.touchpoints["AttentionMetadataBuilder"] == ["changed: -build_for_drafting"]
    assert set(r.touchpoints) == {
        "AttentionBackend",
        "AttentionMetadataBuilder",
        "MLAAttentionImpl",
        "WorkerWrapperBase",
    }
    assert r.imports == [] and r.seed_imports == [] and r.unaccounted_impl_methods == []
    assert r.dropped_names_flyserve_uses == []  # flyserve never used build_for_drafting
    (member,) = r.new_backend_members
    assert "supports_head_size_v" in member and "flyserve/vllm/backends.py" in member
    assert "composite inherits" in member


def test_the_newest_record_against_itself_is_clean():
    newest = max(RECORDS, key=tp_release)
    r = up.review(RECORDS[newest], RECORDS[newest], release=newest, against=newest)
    assert r.findings() == 0


def tp_release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def test_help_is_the_release_checklist(capsys):
    with pytest.raises(SystemExit) as done:
        up.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for step in ("pip download --no-deps vllm==X.Y.Z", "vllm_touchpoints.py /tmp/vllm-X.Y.Z", "RecordedRelease",
                 "--table", "pytest tests/unit/test_vllm_touchpoints.py", "Exit status"):  # fmt: skip
        assert step in out, step
