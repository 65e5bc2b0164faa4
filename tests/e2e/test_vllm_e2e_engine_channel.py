"""Real `vllm serve` on the CPU with tensor parallel 2 (two worker
processes, one core each: VLLM_CPU_OMP_THREADS_BIND="0|1"), clients sending completions, and 50
threshold changes made at random moments from the first second of serving on.

Engine channel (VLLM_PLUGINS=flyserve,flyserve-endpoint): every one of the 50 versions is applied by
both workers from the same engine step (their RPC answers), and every batch each worker logged was
routed by the version the pushes put in force at its step, with decide()'s decision for its shape.

File polling (the endpoint plugin off): the ranks say so, both still reach every version and route
each batch by the version they hold; how many versions both applied at the same step is printed
(the heuristic's margin in time, not a guarantee: that is what the engine channel fixes).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Self

import pytest
from pydantic import SecretStr

from flyserve.control import ControlPlane
from flyserve.control.rank_daemon import MIN_RATE_STEPS
from flyserve.policy import BatchShape, Thresholds, decide
from flyserve.vllm.launch import TINY_SERVE_ARGS, VllmServer, flyserve_env

pytestmark = pytest.mark.e2e

CHANGES = 50
TP = 2
HEADS_PER_RANK = 4 // TP  # the tiny model's 4 query heads, split over 2 ranks
SEED = 18
TOKEN = "e2e-token-0123456789abcdef"
FIRST_SECOND = 4  # changes made in the first second of serving, before anything else is waited for


def serve_args() -> list[str]:
    args = [*TINY_SERVE_ARGS, "--tensor-parallel-size", str(TP)]
    args[args.index("--kv-cache-memory-bytes") + 1] = str(128 << 20)  # two workers on 24 GB, shared
    return args


class Load:
    """Client threads sending short completions (prompts of mixed lengths) until stopped."""

    def __init__(self, url: str, n: int = 3) -> None:
        self.url, self.stop = url, threading.Event()
        self.codes: list[int] = []
        self.failures: list[str] = []  # what a code 0 was: the exception, its message, when, how long
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        answered = time.monotonic()
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                prompt = [rng.randrange(10, 2000) for _ in range(rng.choice((8, 60, 150, 300)))]
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 6,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                sent = time.monotonic()
                try:
                    code = c.post(f"{self.url}/v1/completions", json=body).status_code
                except httpx.HTTPError as e:
                    code = 0
                    self.failures.append(
                        f"client {seed}: {type(e).__name__}: {str(e)[:160]} (sent at +{sent - self.t0:.1f} s, "
                        f"{sent - answered:.1f} s after its previous answer, failed after "
                        f"{time.monotonic() - sent:.1f} s, stop set: {self.stop.is_set()})"
                    )
                answered = time.monotonic()
                self.codes.append(code)

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop and join, within one deadline for all threads together: a hung server must surface as
        the test's own error, not as n sequential 180 s joins that run into pytest's timeout."""
        self.stop.set()
        deadline = time.monotonic() + (180 if exc[0] is None else 15)
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


# vLLM's API server closes a keep-alive connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): a
# client thread of these tests, starved on the 2-core VM by the workers' OpenMP threads, that sends
# on such a connection as it closes gets "Server disconnected without sending a response" (seen
# once in the TP 2 test: a request failed 1.1 s after it was sent, nothing in vLLM's log). That race
# is httpx's and uvicorn's, not flyserve's: the tests' servers keep idle connections for 10 minutes,
# and any other disconnection still fails them, with the failure's details.
KEEP_ALIVE_ENV = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A shape log's step rows (header skipped; a torn last line, mid-write, is skipped too)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines()[1:]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class StepTail:
    """Counts the step rows of shape logs as they grow, reading only the new bytes: the tests poll it
    every 0.25 s while two engines each log thousands of steps, and re-parsing whole logs on every
    poll starved vLLM of the CI VM's two cores (the data-parallel test's changes drifted from 5 s
    apart to 15 s apart and ran into pytest's timeout)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.offsets = [0] * len(paths)
        self.count = 0
        self.last: dict[Path, dict[str, Any]] = {}

    def poll(self) -> int:
        for i, path in enumerate(self.paths):
            try:
                with path.open("rb") as f:
                    if os.fstat(f.fileno()).st_size < self.offsets[i]:
                        raise AssertionError(f"{path.name} shrank: the shape logs are append-only")
                    f.seek(self.offsets[i])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1  # a torn last line waits for the next poll
            for line in chunk[:end].splitlines():
                if line.startswith(b'{"step"'):
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # a garbled line is skipped, as read_rows does
                    self.count += 1
                    self.last[path] = row
            self.offsets[i] += end
        return self.count

    def step(self, path: Path) -> int:
        """The last step ``path`` logged (0 before its first), after reading what is new."""
        self.poll()
        return self.last.get(path, {}).get("step", 0)

    def all_at(self, version: int) -> bool:
        """Whether every log's newest step ran under ``version`` (versions only go up)."""
        self.poll()
        return all(self.last.get(p, {}).get("version") == version for p in self.paths)


def wait_for(pred, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def make_changes(
    plane: ControlPlane,
    t_serving: float,
    shape_log: Path,
    via_http: tuple[str, str] | None = None,
    start_load: Any = None,
) -> list[tuple[int, float, Thresholds]]:
    """CHANGES versions at random moments; the first ones inside the first second of serving.

    Each flips something the routing looks at (min_seq_len, prefill_enabled). After the first
    FIRST_SECOND changes, each waits for the engine to have run a step since the previous one (the
    first step after start-up takes 7-18 s on this loaded 2-core machine: without this, all 50 could
    land before it and the test would exercise one step boundary, not 50), then a random pause.
    With ``via_http`` (vLLM's URL, token), 1 change in 10 goes through PATCH /flyserve/thresholds.
    The first FIRST_SECOND changes land right after the server came up, before ``start_load``
    starts the clients: the ranks have no measured step rate then (the case file polling gets
    wrong), whatever a loaded machine does to the wall clock.
    Returns (version, seconds since serving began, thresholds)."""
    rng = random.Random(SEED)
    out: list[tuple[int, float, Thresholds]] = []
    cur = plane.snapshot().thresholds
    seen = 0
    tail = StepTail([shape_log])
    step_at_start = tail.step(shape_log)
    for i in range(CHANGES):
        if i == FIRST_SECOND and start_load is not None:
            start_load()  # the first changes land on a server that has not stepped since it came up
        if i >= FIRST_SECOND:
            wait_for(lambda seen=seen: tail.step(shape_log) > seen, "the engine to run another step", 180)
            seen = tail.step(shape_log)
        time.sleep(rng.uniform(0.02, 0.2) if i < FIRST_SECOND else rng.uniform(0.0, 0.4))
        msl = rng.choice([v for v in (64, 96, 128, 200, 300, 500) if v != cur.min_seq_len])
        change = {"min_seq_len": msl, "prefill_enabled": rng.random() < 0.75}
        if via_http is not None and i % 10 == 9:  # 1 change in 10 through vLLM's own server
            import httpx

            url, token = via_http
            r = httpx.patch(f"{url}/flyserve/thresholds", json=change, timeout=60,
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert r.status_code == 200, r.text
        else:
            plane.apply_overrides(change, actor="e2e-18")
        snap = plane.snapshot()
        cur = snap.thresholds
        out.append((snap.version, time.monotonic() - t_serving, snap.thresholds))
        if i < FIRST_SECOND:
            # "The ranks' first moments": the first change within the first second of serving; the
            # others within it too, or before the engine had run MIN_RATE_STEPS steps since serving
            # began (the ranks had no measured step rate yet: the case file polling gets wrong).
            t = out[-1][1]
            early = t < 1.0 or tail.step(shape_log) - step_at_start < MIN_RATE_STEPS
            assert early, f"change {i + 1} came {t:.2f} s into serving, after the ranks measured a rate"
    return out


def run(tiny_model: Path, tmp: Path, *, channel: bool) -> dict[str, Any]:
    """Start TP=2 serving, make the changes under load, wait until both ranks logged steps of the
    last version; return what the assertions need."""
    state = tmp / "state"
    first = ControlPlane(state, profile="cpu-tiny").reload(actor="e2e", startup=True).snapshot
    env = flyserve_env(
        state,
        "cpu-tiny",
        FLYSERVE_SHAPE_LOG=str(tmp / "shapes-{rank}.jsonl"),
        FLYSERVE_LOG_LEVEL="INFO",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_PLUGINS="flyserve,flyserve-endpoint" if channel else "flyserve",
        FLYSERVE_ROUTES="1",  # only the endpoint plugin reads it: no routes in the fallback run
        FLYSERVE_SIDECAR_TOKEN=TOKEN,
        **KEEP_ALIVE_ENV,
    )
    server = VllmServer(tiny_model, serve_args(), env=env, log_path=tmp / "vllm.log")
    server.start(timeout=480)
    try:
        plane = ControlPlane(state, profile="cpu-tiny")
        with contextlib.ExitStack() as stack:
            loads: list[Load] = []
            t_serving = time.monotonic()
            logs = [tmp / f"shapes-{r}.jsonl" for r in range(TP)]
            changes = make_changes(
                plane,
                t_serving,
                logs[0],
                (server.url, TOKEN) if channel else None,
                start_load=lambda: loads.append(stack.enter_context(Load(server.url))),
            )
            load = loads[0]
            last = changes[-1][0]
            tail = StepTail(logs)
            wait_for(
                lambda: tail.all_at(last),
                f"both ranks to log a step of version {last}",
                240,
            )
        from fastapi.testclient import TestClient

        from flyserve.sidecar.app import create_app
        from flyserve.sidecar.settings import SidecarSettings

        settings = SidecarSettings(
            state_dir=state,
            profile="cpu-tiny",
            token=SecretStr(TOKEN),
            share_control_metrics=False,
            stats_ttl_s=0.0,
            metrics_ttl_s=0.0,
        )
        with TestClient(create_app(settings)) as c:
            stats = c.get("/dispatch-stats").json()
        import httpx

        in_vllm = httpx.get(f"{server.url}/flyserve/dispatch-stats", timeout=60)
    finally:
        server.stop()
    # The store keeps the last 50 versions; the test keeps all 51 itself.
    history = {first.version: first.thresholds, **{v: t for v, _, t in changes}}
    return {
        "state": state,
        "changes": changes,
        "codes": load.codes,
        "failures": load.failures,
        "rows": {r: read_rows(tmp / f"shapes-{r}.jsonl") for r in range(TP)},
        "history": history,
        "stats": stats,
        "in_vllm": in_vllm,
        "log": (tmp / "vllm.log").read_text(errors="replace"),
    }


def assert_rows_follow_their_version(rows: list[dict[str, Any]], history: dict[int, Thresholds]) -> int:
    """Every logged batch took decide()'s path for its shape under the version it was logged with."""
    checked = 0
    for x in rows:
        t = history[x["version"]]
        shape = BatchShape.from_query_lens(
            x["query_lens"], max_seq_len=x["max_seq_len"], num_heads=HEADS_PER_RANK, thresholds=t
        )
        d = decide(shape, t)
        assert (x["path"], x["reason"]) == (d.path, d.reason), x
        checked += 1
    return checked


def first_step_of(rows: list[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in rows:
        out.setdefault(x["version"], x["step"])
    return out


def test_engine_channel_tp2_every_worker_applies_all_50_changes_at_the_same_step(tiny_model, tmp_path):
    got = run(tiny_model, tmp_path, channel=True)
    changes, rows = got["changes"], got["rows"]
    versions = [v for v, _, _ in changes]
    assert versions == list(range(2, 2 + CHANGES))
    # make_changes asserted that its first FIRST_SECOND changes came in the ranks' first moments.
    assert got["codes"] and all(code == 200 for code in got["codes"]), got["failures"][:5]

    # The RPC answers: both workers, each version, one step.
    pushes = {}
    for line in (got["state"] / "channel" / "pushes.jsonl").read_text().splitlines():
        p = json.loads(line)
        pushes[p["version"]] = p
    same = 0
    for v in versions:
        answers = pushes[v]["answers"]
        assert sorted(a["rank"] for a in answers) == list(range(TP)), pushes[v]
        assert all(a["applied"] and a["why"] == "applied" for a in answers), pushes[v]
        same += len({a["step"] for a in answers}) == 1
    boundaries = len({pushes[v]["answers"][0]["step"] for v in versions})
    print(
        f"\nengine channel: {same}/{CHANGES} versions applied by all {TP} workers at the same step; "
        f"{boundaries} distinct step boundaries; {len(rows[0])} steps logged by rank 0"
    )
    assert same == CHANGES
    assert boundaries >= 10, "the changes did not spread over the serving steps"

    # Each worker's batches: the version in force at each step is the last one pushed before it.
    boundary = sorted((pushes[v]["answers"][0]["step"], v) for v in versions)

    def in_force(step: int) -> int:
        cur = 1
        for s, v in boundary:
            if s < step:
                cur = v
        return cur

    for r in range(TP):
        assert rows[r], f"rank {r} logged no step"
        wrong = [
            (x["step"], x["version"], in_force(x["step"]))
            for x in rows[r]
            if x["version"] != in_force(x["step"])
        ]
        assert not wrong, f"rank {r}: (step, logged version, pushed version) {wrong[:5]}"
        assert assert_rows_follow_their_version(rows[r], got["history"]) == len(rows[r])
    by_step = [{x["step"]: (x["version"], x["path"], x["reason"]) for x in rows[r]} for r in range(TP)]
    common = by_step[0].keys() & by_step[1].keys()
    assert len(common) >= 20
    assert all(by_step[0][s] == by_step[1][s] for s in common)
    firsts = [first_step_of(rows[r]) for r in range(TP)]
    assert firsts[0] == firsts[1]

    stats = got["stats"]
    assert stats["control_mode"] == "engine channel"
    assert {v["control_mode"] for v in stats["ranks"]} == {"engine channel"}
    status = json.loads((got["state"] / "channel" / "status.json").read_text())
    assert status["mode"] == "engine channel" and status["split_steps"] == 0
    assert status["pushed_version"] == versions[-1]
    assert got["in_vllm"].status_code == 200 and got["in_vllm"].json()["control_mode"] == "engine channel"
    assert "mode engine channel" in got["log"]
    assert got["log"].count("thresholds now come through the engine channel") == TP


def test_file_polling_fallback_tp2_still_reaches_every_worker(tiny_model, tmp_path):
    got = run(tiny_model, tmp_path, channel=False)
    changes, rows = got["changes"], got["rows"]
    versions = [v for v, _, _ in changes]
    assert got["codes"] and all(code == 200 for code in got["codes"]), got["failures"][:5]
    assert not (got["state"] / "channel").exists()
    assert got["in_vllm"].status_code == 404  # no endpoint plugin, no /flyserve routes
    assert got["stats"]["control_mode"] == "file polling"
    assert {v["control_mode"] for v in got["stats"]["ranks"]} == {"file polling"}
    assert "mode file polling" in got["log"] and "engine channel" not in got["log"].replace(
        "(until an engine channel attaches)", ""
    )
    for r in range(TP):
        assert rows[r][-1]["version"] == versions[-1]
        steps = [x["step"] for x in rows[r]]
        logged = [x["version"] for x in rows[r]]
        assert steps == sorted(steps) and logged == sorted(logged), f"rank {r}: versions went back"
        assert assert_rows_follow_their_version(rows[r], got["history"]) == len(rows[r])
    firsts = [first_step_of(rows[r]) for r in range(TP)]
    both = [v for v in versions if v in firsts[0] and v in firsts[1]]
    same = sum(firsts[0][v] == firsts[1][v] for v in both)
    print(
        f"\nfile polling: of {len(both)} versions both ranks routed a step with, {same} started at the "
        f"same step ({CHANGES - len(both)} were superseded before a step ran under them on some rank)"
    )
