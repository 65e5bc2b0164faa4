"""The vLLM rank's feed of a trial's blocks: the routing notes a timed step's tokens when it arms
the kernel timer (1 step in N), and the harvested timing of that step joins the shape sample (the
drift check) and, inside a trial's block, adds to that block (RankControl.record_kernel_sample)."""

from __future__ import annotations

from pathlib import Path

from flyserve.control import ControlPlane
from flyserve.control.snapshot import Trial
from flyserve.control.trial_blocks import parse_trial_blocks
from flyserve.vllm.runtime import TIMED_STEPS_KEPT, RankRuntime


def test_a_timed_step_in_a_trial_block_adds_seconds_and_tokens(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    cur = plane.snapshot()
    candidate = cur.thresholds.merged({"min_seq_len": cur.thresholds.min_seq_len + 512})
    plane.publish_autopilot(cur.thresholds, trial=Trial("ap-0-1", 5, 4, 10, candidate), request={})
    rt = RankRuntime(state_dir=tmp_path / "state", rank=0, start=False, setup_metrics=False)
    first = rt.control.snapshot.step_for(0)
    for step in range(first, first + 9):
        rt.control.current(step)
        rt.note_timed_step(step, 64)
        rt.on_step_timed(step, "unified", 0.001)
    rt.on_step_timed(first + 9, "unified", 0.5)  # a forward of a step never armed: no token count
    blocks = parse_trial_blocks(rt.control.report_dict()["trial_blocks"])
    assert blocks is not None and blocks.through == 1
    assert [(b.block, b.samples, b.tokens) for b in blocks.blocks] == [(0, 4, 256), (1, 4, 256)]
    assert len(rt.timed_tokens) == TIMED_STEPS_KEPT  # bounded: only the last few timed steps wait
    assert rt.shape_sample._kernel_times[first] == ("unified", 0.001)  # the drift join as before
