"""One simulated rank for tests/integration/test_control_multiprocess.py (run as a script).

Steps through a deterministic shape sequence with the real policy, asking RankControl for the
thresholds at every step, exactly as the vLLM routing does, and writes what it decided.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from flyserve.control import RankControl
from flyserve.policy import BatchShape, decide


def shape_pool(n: int = 97, seed: int = 7) -> list[BatchShape]:
    """Mixed batches around the gfx950 thresholds: decode-only, short and long prefill, mixed rows."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(n):
        rows = int(rng.integers(1, 24))
        lens = np.where(rng.random(rows) < 0.5, 1, rng.integers(2, 3000, rows))
        ctx = int(rng.choice([512, 1024, 1536, 2048, 3000, 4096, 8192, 16384, 40000]))
        pool.append(BatchShape.from_query_lens(lens, max_seq_len=ctx, num_heads=16))
    return pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--step-sleep", type=float, default=0.004)
    ap.add_argument("--max-steps", type=int, default=200_000)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    a = ap.parse_args()

    pool = shape_pool()
    rc = RankControl(a.state_dir, a.rank, interval_s=a.interval).start()
    versions = np.zeros(a.max_steps, dtype=np.int64)
    decisions: list[str] = []
    stop = Path(a.stop_file)
    deadline = time.monotonic() + a.max_seconds
    step = 0
    # The first step at which this rank knew of each version (its poll thread had read it): lets the
    # test tell a version learned in time (applied exactly at effective_step) from one learned late
    # on a loaded machine (applied at once), instead of assuming the machine is fast enough.
    learned: dict[int, int] = {}
    known = 0
    try:
        while step < a.max_steps:
            snap = rc.current(step)
            now_known = rc._known_version
            for v in range(known + 1, now_known + 1):
                learned[v] = step
            known = max(known, now_known)
            d = decide(pool[step % len(pool)], snap.thresholds)
            versions[step] = snap.version
            decisions.append(f"{d.path}/{d.reason}/{d.ordering}")
            step += 1
            if step % 16 == 0 and (stop.exists() or time.monotonic() > deadline):
                break
            time.sleep(a.step_sleep)
    finally:
        rc.stop()
    Path(a.out).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "rank": a.rank,
                "steps": step,
                "versions": versions[:step].tolist(),
                "decisions": decisions,
                "applied": rc.applied,
                "learned": learned,
            }
        )
    )


if __name__ == "__main__":
    main()
