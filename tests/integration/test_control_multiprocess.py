"""Four rank processes step through the same shapes with the real policy
while thresholds change under them (file edit, API call, two Kubernetes-style symlink swaps); every
rank applies every version at the same step, every decision follows the version of its step, and no
process restarts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flyserve.control import ControlPlane, Store
from flyserve.policy import decide

sys.path.insert(0, str(Path(__file__).parent))
from _control_rank_worker import shape_pool
from _live_sidecar import wait_for

pytestmark = pytest.mark.integration

RANKS = 4
# A new version takes effect LEAD_S after it is published (in steps, from the ranks' reported rate):
# ranks poll every 50 ms here. A rank that still learns of it late (a loaded machine) must apply it at
# once; the checks below tell the two cases apart from what each rank recorded.
LEAD_S = 2.0


class ConfigMapDir:
    """A directory laid out like a Kubernetes ConfigMap volume: flyserve.yaml -> ..data/flyserve.yaml,
    ..data -> ..<timestamp>; an update writes a new timestamped dir and renames a new ..data over the old."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        root.mkdir()
        self.n = 0
        self._current = self._write_version(text)
        (root / "..data").symlink_to(self._current.name)
        (root / "flyserve.yaml").symlink_to("..data/flyserve.yaml")

    @property
    def file(self) -> Path:
        return self.root / "flyserve.yaml"

    def _write_version(self, text: str) -> Path:
        self.n += 1
        d = self.root / f"..2026_11_29_23_00_{self.n:02d}.{os.getpid()}"
        d.mkdir()
        (d / "flyserve.yaml").write_text(text)
        return d

    def swap(self, text: str) -> None:
        new = self._write_version(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(new.name)
        os.rename(tmp, self.root / "..data")  # atomic, as kubelet does
        old, self._current = self._current, new
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def test_four_ranks_switch_together_through_file_api_and_configmap_swaps(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cm = ConfigMapDir(tmp_path / "config", "min_seq_len: 2048\n")
    plane = ControlPlane(state, config_file=cm.file, step_margin=16, lead_s=LEAD_S)
    first = plane.reload(actor="startup", startup=True)
    assert first.snapshot.version == 1

    stop = tmp_path / "stop"
    worker = Path(__file__).with_name("_control_rank_worker.py")
    procs: list[subprocess.Popen] = []
    watcher = None
    try:
        for r in range(RANKS):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(worker),
                        "--state-dir",
                        str(state),
                        "--rank",
                        str(r),
                        "--out",
                        str(tmp_path / f"rank{r}.json"),
                        "--stop-file",
                        str(stop),
                        "--interval",
                        "0.05",
                        "--step-sleep",
                        "0.004",
                        "--max-seconds",
                        "600",
                    ],
                )
            )
        store = Store(state)

        def reports() -> dict[int, dict]:
            return {d["rank"]: d for d in store.rank_reports()}

        wait_for(
            lambda: len(reports()) == RANKS and all(d["step"] > 0 for d in reports().values()),
            what="every rank to report",
            every=0.02,
            timeout=120,  # four interpreters importing numpy and pydantic: over 30 s beside a parallel run
        )
        watcher = plane.watch(poll_interval_s=1.0, actor="test-watcher", debounce_ms=50)

        def applied_everywhere(v: int) -> None:
            wait_for(
                lambda: plane.snapshot().version == v,
                what=f"version {v} to be published",
                timeout=60,
                every=0.02,
            )
            wait_for(
                lambda: all(d["applied_version"] == v for d in reports().values()),
                what=f"every rank to apply version {v}",
                timeout=60,
                every=0.02,
            )

        # 1. an in-place edit of the file (through the symlinks)
        cm.file.write_text("min_seq_len: 4096\n")
        applied_everywhere(2)
        # 2. an API call (what the sidecar does for PATCH /thresholds)
        assert plane.apply_overrides({"lpt": "never", "decode_rows_base": 2}, actor="test-api").changed
        applied_everywhere(3)
        # 3. and 4. Kubernetes ConfigMap updates: the ..data symlink swap, twice
        cm.swap("min_seq_len: 1024\nmin_qblock_rows: 16\n")
        applied_everywhere(4)
        cm.swap("min_seq_len: 1024\nmin_qblock_rows: 16\nprefill_enabled: false\n")
        applied_everywhere(5)
        pids_during = {r: d["pid"] for r, d in reports().items()}
        stop.touch()
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        if watcher is not None:
            watcher.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)

    history = {s.version: s for s in plane.history()}
    assert sorted(history) == [1, 2, 3, 4, 5]
    assert [history[v].source for v in range(1, 6)] == ["file", "file", "api", "file", "file"]
    assert [e["result"] for e in plane.audit_log() if e["result"] != "unchanged"] == ["success"] * 5

    pool = shape_pool()
    # Every change is visible in decisions on this shape sequence (else the test proves little).
    for v in range(2, 6):
        before, after = history[v - 1].thresholds, history[v].thresholds
        assert any(decide(s, before) != decide(s, after) for s in pool), f"version {v} changes no decision"

    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    late: list[tuple[int, int]] = []
    for r, out in enumerate(outs):
        assert out["pid"] == procs[r].pid == pids_during[r], "a rank process was restarted"
        applied = {v: (eff, at) for v, eff, at in out["applied"]}
        assert sorted(applied) == [1, 2, 3, 4, 5], f"rank {r} skipped a version: {out['applied']}"
        learned = {int(v): step for v, step in out["learned"].items()}
        for v in range(2, 6):
            eff, at = applied[v]
            assert eff == history[v].effective_step
            if learned[v] < eff:  # known in time: exactly at the effective step
                assert at == eff, (
                    f"rank {r} applied version {v} at step {at}, not at its effective step {eff}"
                )
            else:  # learned late (a loaded machine): at once, at the step it learned of it (or the next)
                assert at in (learned[v], learned[v] + 1), (r, v, eff, at, learned[v])
                late.append((r, v))
        assert out["steps"] > history[5].effective_step
        for step, (v, got) in enumerate(zip(out["versions"], out["decisions"], strict=True)):
            expect_v = max((u for u in range(2, 6) if history[u].effective_step <= step), default=1)
            assert v == expect_v, f"rank {r} step {step}: version {v}, expected {expect_v}"
            d = decide(pool[step % len(pool)], history[v].thresholds)
            assert got == f"{d.path}/{d.reason}/{d.ordering}", f"rank {r} step {step}"
    # The same step for every rank, by construction of the checks above; say it plainly too.
    in_time = [v for v in range(2, 6) if all((r, v) not in late for r in range(RANKS))]
    assert in_time, f"no version reached every rank before its effective step ({LEAD_S} s lead): {late}"
    switch_steps = {tuple(sorted((v, at) for v, _eff, at in o["applied"] if v in in_time)) for o in outs}
    assert len(switch_steps) == 1
