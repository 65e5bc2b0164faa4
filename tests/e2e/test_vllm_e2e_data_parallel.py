"""Real `vllm serve` on the CPU with data parallel 2 (two engine cores, each with its
own scheduler, step counter and one worker; VLLM_CPU_OMP_THREADS_BIND="0|1" gives each engine's
worker one core), clients sending completions, 50 threshold changes at random moments.

vLLM's DP client answers a collective RPC with the first engine's result only; the engine channel
calls it on each engine core instead. Checked here: every version is confirmed by BOTH engines,
each at one step of its own on its worker (pushes.jsonl), every batch each engine logged ran under
the version its engine had in force at that step (and took decide()'s path for its shape), the two
engines' ranks are distinct (rank 0 / engine 0, rank 1 / engine 1), only API server 0 pushes (vLLM
starts one API server per engine), and /dispatch-stats shows both engines through the channel.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm_e2e_engine_channel import KEEP_ALIVE_ENV, Load, StepTail, read_rows, wait_for

from flyserve.control import ControlPlane
from flyserve.policy import BatchShape, Thresholds, decide
from flyserve.vllm.launch import TINY_SERVE_ARGS, VllmServer, flyserve_env

pytestmark = pytest.mark.e2e

CHANGES = 50
DP = 2
HEADS = 4  # the tiny model's query heads: TP 1, all on each engine's one worker
SEED = 23


def serve_args() -> list[str]:
    args = [*TINY_SERVE_ARGS, "--data-parallel-size", str(DP)]
    args[args.index("--kv-cache-memory-bytes") + 1] = str(128 << 20)  # two engines on 24 GB, shared
    return args


def make_changes(plane: ControlPlane, tail: StepTail) -> list[tuple[int, Thresholds]]:
    """CHANGES versions, each 0.05-0.4 s after some engine ran a step since the previous one (so
    the changes spread over the serving steps instead of all landing before the first). Prints how
    long the waits and the changes took, so a slow CI run can be told from a hang."""
    rng = random.Random(SEED)
    out: list[tuple[int, Thresholds]] = []
    cur = plane.snapshot().thresholds
    seen = tail.poll()
    waited = applying = 0.0
    for _ in range(CHANGES):
        t = time.monotonic()
        wait_for(lambda seen=seen: tail.poll() > seen, "an engine to run another step", 90)
        seen = tail.count
        time.sleep(rng.uniform(0.05, 0.4))
        t1 = time.monotonic()
        msl = rng.choice([v for v in (64, 96, 128, 200, 300, 500) if v != cur.min_seq_len])
        snap = plane.apply_overrides(
            {"min_seq_len": msl, "prefill_enabled": rng.random() < 0.75}, actor="e2e-23"
        ).snapshot
        waited, applying = waited + t1 - t, applying + time.monotonic() - t1
        cur = snap.thresholds
        out.append((snap.version, snap.thresholds))
    print(
        f"\n{CHANGES} changes: {waited:.1f} s waiting for steps (sleeps included), {applying:.1f} s applying"
    )
    return out


def run(tiny_model: Path, tmp: Path) -> dict[str, Any]:
    state = tmp / "state"
    first = ControlPlane(state, profile="cpu-tiny").reload(actor="e2e", startup=True).snapshot
    env = flyserve_env(
        state,
        "cpu-tiny",
        FLYSERVE_SHAPE_LOG=str(tmp / "shapes-{rank}.jsonl"),
        FLYSERVE_LOG_LEVEL="INFO",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_PLUGINS="flyserve,flyserve-endpoint",
        **KEEP_ALIVE_ENV,
    )
    server = VllmServer(tiny_model, serve_args(), env=env, log_path=tmp / "vllm.log")
    server.start(timeout=480)
    logs = [tmp / f"shapes-{r}.jsonl" for r in range(DP)]
    try:
        plane = ControlPlane(state, profile="cpu-tiny")
        tail = StepTail(logs)
        with Load(server.url, n=4) as load:
            changes = make_changes(plane, tail)
            last = changes[-1][0]
            # Each engine steps only while it has requests: the load keeps both busy until both
            # logged a step under the last version.
            wait_for(
                lambda: tail.all_at(last),
                f"both engines to log a step of version {last}",
                180,
            )
        wait_for(
            lambda: _status(state).get("reported_at") and _status(state)["engines"][-1]["workers"],
            "the pusher's reports",
            30,
        )
        from fastapi.testclient import TestClient

        from flyserve.sidecar.app import create_app
        from flyserve.sidecar.settings import SidecarSettings

        settings = SidecarSettings(state_dir=state, profile="cpu-tiny", share_control_metrics=False,
                                   stats_ttl_s=0.0, metrics_ttl_s=0.0)  # fmt: skip
        time.sleep(2.5)  # one more report round, after the load stopped: every worker at the last version
        with TestClient(create_app(settings)) as c:
            stats = c.get("/dispatch-stats").json()
    except BaseException:
        _diagnose(tmp, state, logs)
        raise
    finally:
        server.stop()
    return {
        "state": state,
        "changes": changes,
        "codes": load.codes,
        "failures": load.failures,
        "rows": {r: read_rows(logs[r]) for r in range(DP)},
        "history": {first.version: first.thresholds, **dict(changes)},
        "stats": stats,
        "log": (tmp / "vllm.log").read_text(errors="replace"),
    }


def _diagnose(tmp: Path, state: Path, logs: list[Path]) -> None:
    """On a failure, what CI needs to tell a hang from a slow machine: steps per engine, the last
    version each logged, the pusher's status and the end of vLLM's log (shown by pytest)."""
    for p in logs:
        rows = read_rows(p)
        print(f"{p.name}: {len(rows)} steps, last {rows[-1]['step'] if rows else None} "
              f"at version {rows[-1]['version'] if rows else None}")  # fmt: skip
    print("channel/status.json:", json.dumps(_status(state))[:3000])
    log_path = tmp / "vllm.log"
    if log_path.exists():
        print("vllm.log (tail):\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-80:]))


def _status(state: Path) -> dict[str, Any]:
    try:
        return json.loads((state / "channel" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_data_parallel_2_every_engine_confirms_all_50_changes_at_one_step_each(tiny_model, tmp_path):
    got = run(tiny_model, tmp_path)
    changes, rows = got["changes"], got["rows"]
    versions = [v for v, _ in changes]
    assert versions == list(range(2, 2 + CHANGES))
    assert got["codes"] and all(code == 200 for code in got["codes"]), (
        set(got["codes"]),
        got["failures"][:5],
    )

    pushes = {}
    for line in (got["state"] / "channel" / "pushes.jsonl").read_text().splitlines():
        p = json.loads(line)
        pushes[p["version"]] = p
    from_step: dict[int, list[tuple[int, int]]] = {e: [] for e in range(DP)}
    for v in versions:
        engines = pushes[v]["engines"]
        assert [e["engine"] for e in engines] == list(range(DP)), pushes[v]
        for e in engines:
            assert e["same_step"], pushes[v]
            assert [(w["rank"], w["engine"]) for w in e["workers"]] == [(e["engine"], e["engine"])]
            assert all(w["applied"] or w["why"] == "already applied" for w in e["workers"]), pushes[v]
            from_step[e["engine"]].append((e["from_step"], v))
    status = _status(got["state"])
    assert status["pushed_version"] == versions[-1] and status["split_steps"] == 0
    assert status["unconfirmed"] == {}

    checked = {}
    for e in range(DP):
        boundaries = sorted(from_step[e])

        def in_force(step: int, boundaries=boundaries) -> int:
            cur = 1
            for s, v in boundaries:
                if s <= step:
                    cur = v
            return cur

        assert rows[e], f"engine {e} logged no step"
        assert {x["rank"] for x in rows[e]} == {e}
        wrong = [
            (x["step"], x["version"], in_force(x["step"]))
            for x in rows[e]
            if x["version"] != in_force(x["step"])
        ]
        assert not wrong, f"engine {e}: (step, logged version, version in force) {wrong[:5]}"
        for x in rows[e]:
            t = got["history"][x["version"]]
            shape = BatchShape.from_query_lens(x["query_lens"], max_seq_len=x["max_seq_len"], num_heads=HEADS,
                                               thresholds=t)  # fmt: skip
            d = decide(shape, t)
            assert (x["path"], x["reason"]) == (d.path, d.reason), x
        checked[e] = (len(rows[e]), len({s for s, _ in boundaries}), len({x["version"] for x in rows[e]}))
    print(
        "\ndata parallel 2: "
        + "; ".join(
            f"engine {e}: {n} steps logged, {b} distinct from-steps for {CHANGES} versions, {k} versions seen in batches"
            for e, (n, b, k) in checked.items()
        )
    )
    # The changes spread over the serving steps of each engine, not one boundary.
    assert all(b >= 10 for _, b, _ in checked.values()), checked
    # The two engines step on their own: their from-steps for the same versions are not all equal.
    assert [s for s, _ in sorted(from_step[0], key=lambda x: x[1])] != [
        s for s, _ in sorted(from_step[1], key=lambda x: x[1])
    ]

    stats = got["stats"]
    assert stats["control_mode"] == "engine channel"
    assert sorted((v["engine"], v["rank"]) for v in stats["ranks"]) == [(0, 0), (1, 1)]
    ch = stats["channel"]
    assert [e["engine"] for e in ch["engines"]] == list(range(DP))
    for e in ch["engines"]:
        assert e["confirmed_version"] == versions[-1] and e["unconfirmed"] == [] and e["error"] is None
        assert [(w["rank"], w["applied_version"], w["control_mode"]) for w in e["workers"]] == [
            (e["engine"], versions[-1], "engine channel")
        ]
        assert sum(e["workers"][0]["decisions"].values()) > 0
    log = got["log"]
    assert "to every worker of engines [0, 1]" in log and "confirmed by 2 engine(s)" in log
    assert "API server 1 leaves pushing to API server 0" in log
    assert log.count("thresholds now come through the engine channel") == DP
