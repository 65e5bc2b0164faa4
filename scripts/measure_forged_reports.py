"""Measure forged and garbage rank reports against the real `flyserve simulate` + `flyserve
sidecar`: how far ahead a PATCH's effective_step lands and how long the two live ranks take to
apply it, while forged or garbage rank reports are refreshed, against control/effective.py's
bound. Prints a table.

    python scripts/measure_forged_reports.py [--trials 2] [--step-interval 0.02] [--forged 3 100]

Cases: none (baseline); the "another host" forgery (N reports "from another host", step 1e11,
refreshed every 0.5 s, for each N of --forged); 10 local forgeries naming a live pid of the ranks'
user with its true start time (confirmed by the process table: only the anchor bounds them); the
"another host" forgery renamed over the two ranks' own files every 0.5 s (the reader keeps each key
for its live confirmed process: control.witness); the sidecar in its own pid namespace (every rank
unconfirmed, like containers that do not share one; needs `unshare`, skipped without it); the
300 garbage files dated an hour ahead. Nothing is left running: every process started here is
stopped at the end."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from _live_sidecar import read_rank_reports, sidecar_beside_simulator  # the live tests' launcher
from _live_sidecar import wait_for as wait_until

from flyserve.control import Store
from flyserve.control.effective import CONSENSUS_S, CONSENSUS_STEPS
from flyserve.control.plane import DEFAULT_LEAD_S, DEFAULT_STEP_MARGIN

TOKEN = "measure-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def bound_steps(rate: float) -> int:
    return (
        math.ceil(rate * CONSENSUS_S)
        + max(DEFAULT_STEP_MARGIN, CONSENSUS_STEPS)
        + max(DEFAULT_STEP_MARGIN, math.ceil(2 * rate * DEFAULT_LEAD_S))
    )


def bound_s(rate: float) -> float:
    return CONSENSUS_S + 2 * DEFAULT_LEAD_S + (max(DEFAULT_STEP_MARGIN, CONSENSUS_STEPS) + 2) / rate


def wait_for(pred: Callable[[], object], timeout: float) -> object:
    """``pred()``'s first true value within ``timeout`` s, or None: a measurement records a miss."""
    with contextlib.suppress(TimeoutError):
        return wait_until(pred, timeout=timeout, what="a measurement", every=0.05)
    return None


def real_reports(state: Path) -> dict[int, dict]:
    """The two simulated ranks' own reports (a forgery renamed over a rank's file is left out)."""
    return {r: d for r, d in read_rank_reports(state / "ranks").items() if d.get("host") != "elsewhere"}


UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM")


@contextlib.contextmanager
def rig(work: Path, step_interval: float, own_pidns: bool) -> Iterator[tuple[str, Path]]:
    """The sidecar (in its own pid namespace with ``own_pidns``) and two simulated ranks at
    ``step_interval``, ranks past their first measured rate; every process stopped at the end."""
    with sidecar_beside_simulator(
        work,
        TOKEN,
        wrap=UNSHARE if own_pidns else (),
        simulate_args=("--steps", "1000000", "--step-interval", str(step_interval)),
    ) as both:
        state = both.sidecar.state
        if not wait_for(
            lambda: len(g := real_reports(state)) == 2 and all(d.get("steps_per_s") for d in g.values()), 90
        ):
            raise RuntimeError("ranks did not report a rate")
        httpx.get(
            both.sidecar.url + "/readyz", timeout=30
        )  # as a readiness probe does: it has looked at ranks/
        yield both.sidecar.url, state


def _elsewhere(rank: int) -> dict:
    return {"pid": 4242 + rank, "host": "elsewhere", "pidns": "", "rank": rank, "engine": 0,
            "started": 1_577_836_800.0, "step": 10**11, "applied_version": 0, "time": time.time()}  # fmt: skip


def forge_elsewhere(state: Path, n: int = 3) -> None:
    store = Store(state)
    for rank in range(2, 2 + n):
        store.write_rank_report(_elsewhere(rank), rank=rank)


def forge_over_the_ranks(state: Path) -> None:
    """The "another host" forgery written beside each real rank's file and renamed over it."""
    for rank in (0, 1):
        path = state / "ranks" / f"{rank}.json"
        tmp = path.with_name(f".forged-{rank}.tmp")
        tmp.write_text(json.dumps(_elsewhere(rank)))
        os.replace(tmp, path)


def forge_local(state: Path, pid: int) -> None:
    from flyserve.control.reports import HOST, PIDNS, proc_start_ticks

    store = Store(state)
    now = time.time()
    for rank in range(2, 12):
        store.write_rank_report(
            {"pid": pid, "proc_start": proc_start_ticks(pid), "host": HOST, "pidns": PIDNS, "rank": rank,
             "engine": 0, "started": now - 100_000, "step": 10**9, "steps_per_s": 10_000.0,
             "applied_version": 0, "time": now},
            rank=rank,
        )  # fmt: skip


def garbage_ahead(state: Path) -> None:
    ahead = time.time() + 3600
    for i in range(300):
        f = state / "ranks" / f"{1000 + i}.json"
        f.write_text(json.dumps({"rank": 1000 + i, "garbage": "x" * 64}))
        os.utime(f, (ahead, ahead))


def one_case(name: str, trials: int, step_interval: float, attack: Callable[[Path], None] | None,
             refresh: bool, own_pidns: bool = False) -> dict:  # fmt: skip
    rows = []
    healthz: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="flyserve-measure-") as tmp,
        rig(Path(tmp), step_interval, own_pidns) as (
            url,
            state,
        ),
    ):
        halt = threading.Event()

        def loop() -> None:
            while not halt.is_set():
                if attack is not None:
                    attack(state)
                if not refresh:
                    return
                halt.wait(0.5)

        def probe() -> None:
            with httpx.Client(timeout=5) as c:
                while not halt.is_set():
                    t = time.monotonic()
                    with contextlib.suppress(httpx.HTTPError):
                        c.get(url + "/healthz")
                    healthz.append(time.monotonic() - t)
                    halt.wait(0.2)

        threads = [threading.Thread(target=loop, daemon=True), threading.Thread(target=probe, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(1.2)
        try:
            for i in range(trials):
                before = wait_for(lambda: len(g := real_reports(state)) == 2 and g, 10) or {}
                rate = min(d["steps_per_s"] for d in before.values())
                r = httpx.patch(url + "/thresholds", json={"min_seq_len": 3000 + i}, headers=AUTH, timeout=30)
                published = time.monotonic()
                snap = r.json()["thresholds"]
                now = wait_for(lambda: len(g := real_reports(state)) == 2 and g, 10) or {}
                projected = max(
                    d["step"] + math.ceil(rate * max(0.0, time.time() - d["time"])) for d in now.values()
                )
                ok = wait_for(
                    lambda v=snap["version"]: (
                        len(g := real_reports(state)) == 2
                        and all(d.get("applied_version") == v for d in g.values())
                    ),
                    bound_s(rate) + 60,
                )
                took = time.monotonic() - published if ok else float("inf")
                got = wait_for(lambda: len(g := real_reports(state)) == 2 and g, 10) or {}
                applied = sorted(d.get("applied_step") for d in got.values())
                rows.append((snap["effective_step"] - projected, bound_steps(rate), took, bound_s(rate), rate, applied,
                             snap["effective_step"]))  # fmt: skip
        finally:
            halt.set()
            for t in threads:
                t.join(10)
    return {"case": name, "rows": rows, "healthz_max_ms": max(healthz) * 1000 if healthz else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--step-interval", type=float, default=0.02)
    ap.add_argument(
        "--forged",
        type=int,
        nargs="+",
        default=[3],
        help="how many reports to forge from another host, one case per count",
    )
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        cases = [
            ("no attack", None, False, False),
            *[
                (
                    f"{n} forged, another host, refreshed 0.5 s",
                    lambda s, n=n: forge_elsewhere(s, n),
                    True,
                    False,
                )
                for n in args.forged
            ],
            (
                "another host's forgery renamed over both ranks' files every 0.5 s",
                forge_over_the_ranks,
                True,
                False,
            ),
            (
                "10 forged, this host, a live pid of the user",
                lambda s: forge_local(s, sleeper.pid),
                True,
                False,
            ),
        ]
        if (
            shutil.which("unshare")
            and subprocess.run(
                ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
            ).returncode
            == 0
        ):
            cases.append(
                ("sidecar in its own pid namespace + 3 forged, another host", forge_elsewhere, True, True)
            )
        else:
            print("(no unshare permission: the own-pid-namespace case is not measured)")
        cases.append(("300 garbage files dated +1 h", garbage_ahead, False, False))
        cases = [c for c in cases if args.only in c[0]]
        results = []
        for n, a, rf, ns in cases:
            results.append(one_case(n, args.trials, args.step_interval, a, rf, ns))
            print(results[-1], flush=True)
    finally:
        sleeper.kill()
        sleeper.wait(10)
    print(
        f"\nstep interval {args.step_interval} s, {args.trials} PATCH(es) per case, lead_s {DEFAULT_LEAD_S}"
    )
    print("| case | effective_step - ranks' step (bound) | publish -> both ranks applied, s (bound) | "
          "applied at one step | /healthz max ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for res in results:
        rows = res["rows"]
        ahead = ", ".join(f"{a}" for a, *_ in rows)
        took = ", ".join(f"{t:.1f}" for _, _, t, *_ in rows)
        same = all(ap == [eff, eff] for *_, ap, eff in rows)
        print(f"| {res['case']} | {ahead} ({rows[0][1]} at {rows[0][4]:.0f} steps/s) | {took} ({rows[0][3]:.1f}) "
              f"| {'yes' if same else 'no'} | {res['healthz_max_ms']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
