"""Hostile shape files and forged shape samples against real processes: `flyserve simulate --costs
h200` (two ranks) beside `flyserve sidecar --costs h200`, both subprocesses on a free port of
127.0.0.1.

Shape files: a FIFO and a /dev/zero symlink in shapes/, under the names of two forged rank reports
that are fresh (so the sampler opens those files): the sampler keeps pricing the real ranks' samples,
the sidecar's memory stays under deploy/'s 512Mi, /healthz answers in under 1 s throughout, and a
valid PATCH is applied by both live ranks at one step within control/effective.py's bound.

Forged samples: advice on the real ranks' samples is corroborated (200, the ranks named); a forged,
fresh rank report with a shapes file full of plausible prefill samples makes advice refuse with 409,
field "samples", naming the sample count and the ranks; `flyserve thresholds advise` prints the
refusal. Every wait polls with a generous deadline; nothing asserts on speed except the stated
/healthz deadline (1 s)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from _attack_rig import REPORT_LAG_S, STEP_MARGIN, recording_healthz
from _attack_rig import effective_bound_s as bound_s
from _live_sidecar import STEP_INTERVAL_S, read_rank_reports, sidecar_beside_simulator, wait_for

from flyserve.control import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKEN = "file-attack-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MEMORY_LIMIT_BYTES = 512 << 20  # deploy/'s limit for the sidecar container


@dataclass
class Rig:
    url: str
    state: Path
    log: Path
    procs: list[subprocess.Popen]
    healthz_s: list[float] = field(default_factory=list)
    healthz_failures: list[str] = field(default_factory=list)

    @property
    def sidecar(self) -> subprocess.Popen:
        return self.procs[0]

    def real_reports(self) -> dict[int, dict]:
        return read_rank_reports(self.state / "ranks")

    def priced_60s(self) -> int:
        stats = httpx.get(self.url + "/dispatch-stats", timeout=30).json()
        return int(((stats.get("regret") or {}).get("windows") or {}).get("60s", {}).get("samples") or 0)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.sidecar.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("file-attacks")
    with sidecar_beside_simulator(
        tmp,
        TOKEN,
        sidecar_args=("--step-margin", str(STEP_MARGIN), "--costs", "h200"),
        simulate_args=(
            "--workload",
            "seed-8k-c32",
            "--steps",
            "100000",
            "--step-interval",
            str(STEP_INTERVAL_S),
            "--profile",
            "gfx950",
            "--costs",
            "h200",
        ),
    ) as both:
        rig = Rig(both.sidecar.url, both.sidecar.state, both.sidecar.log, both.procs)
        wait_for(
            lambda: len(got := rig.real_reports()) == 2 and all(d.get("steps_per_s") for d in got.values()),
            timeout=90,
            what="both ranks to report a measured step rate",
            every=0.2,
        )
        wait_for(lambda: rig.priced_60s() > 0, timeout=60, what="the first priced samples", every=0.5)
        yield rig


@contextlib.contextmanager
def probing_healthz(rig: Rig) -> Iterator[None]:
    """/healthz every 0.2 s in a thread: each answer's time, or what went wrong."""
    rig.healthz_s.clear()
    rig.healthz_failures.clear()
    with recording_healthz(rig.url, rig.healthz_s, rig.healthz_failures):
        yield


@contextlib.contextmanager
def forged_reports(rig: Rig, ranks: tuple[int, ...]) -> Iterator[None]:
    """Fresh rank reports for ``ranks`` (another host: unconfirmed, so live), refreshed every
    0.5 s with the real ranks' step: the sampler then opens those ranks' shape files."""
    stop = threading.Event()
    store = Store(rig.state)

    def forge() -> None:
        while not stop.is_set():
            real = rig.real_reports()
            step = max((d.get("step", 0) for d in real.values()), default=0)
            now = time.time()
            for rank in ranks:
                store.write_rank_report(
                    {"pid": 4242 + rank, "host": "elsewhere", "pidns": "", "rank": rank, "engine": 0,
                     "started": now - 60, "step": step, "applied_version": None, "time": now},
                    rank=rank,
                )  # fmt: skip
            stop.wait(0.5)

    t = threading.Thread(target=forge, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        yield
    finally:
        stop.set()
        t.join(10)
        for rank in ranks:
            with contextlib.suppress(OSError):
                (rig.state / "ranks" / f"{rank}.json").unlink()


def patch_and_wait_for_the_apply(rig: Rig, value: int) -> dict:
    before = rig.real_reports()
    rate = min(d["steps_per_s"] for d in before.values())
    current = httpx.get(rig.url + "/thresholds", timeout=30).json()
    r = httpx.patch(
        rig.url + "/thresholds",
        json={"min_seq_len": value},
        headers=AUTH | {"If-Match": f'"{current["version"]}"'},
        timeout=30,
    )
    assert r.status_code == 200, r.text[:500]
    published = time.monotonic()
    snap = r.json()["thresholds"]

    def applied() -> bool:
        got = rig.real_reports()
        return len(got) == 2 and all(d.get("applied_version") == snap["version"] for d in got.values())

    wait_for(applied, timeout=bound_s(rate) + 30, what=f"both ranks to apply version {snap['version']}")
    took = time.monotonic() - published
    after = rig.real_reports()
    return {
        "version": snap["version"],
        "effective_step": snap["effective_step"],
        "applied_steps": sorted(d["applied_step"] for d in after.values()),
        "rate": rate,
        "apply_s": took,
        "bound_s": bound_s(rate),
    }


# ---------------------------------------------------------------- hostile shape files


def test_a_fifo_and_a_dev_zero_link_in_shapes_cost_nothing(rig: Rig) -> None:
    """Was: the sampler hung on the FIFO for ever (regret froze), and the /dev/zero link cost a
    MemoryError a second and 2.65 GB."""
    shapes = rig.state / "shapes"
    fifo, zero = shapes / "0-2.jsonl", shapes / "0-3.jsonl"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    try:
        with forged_reports(rig, (2, 3)), probing_healthz(rig):
            # The sampler keeps pricing the real ranks: the 60 s window keeps growing.
            first = rig.priced_60s()
            wait_for(lambda: rig.priced_60s() > first + 20, timeout=60, what="the sampler to keep pricing")
            m = patch_and_wait_for_the_apply(rig, 4096)
            log = rig.log.read_text()
            assert "shapes/0-2.jsonl: not a regular file (a FIFO)" in log, log[-2000:]
            assert "shapes/0-3.jsonl: a symlink" in log, log[-2000:]
            stats = httpx.get(rig.url + "/dispatch-stats", timeout=30).json()
            assert {v["rank"] for v in stats["ranks"] if not v["stale"]} >= {0, 1}
            rss = rig.rss_bytes()
        assert m["applied_steps"] == [m["effective_step"]] * 2, m
        assert m["apply_s"] <= m["bound_s"] + REPORT_LAG_S, m
        assert rig.healthz_s and not rig.healthz_failures, rig.healthz_failures[:5]
        assert max(rig.healthz_s) < 1.0, max(rig.healthz_s)
        assert rss < MEMORY_LIMIT_BYTES, rss
        print(
            f"\nmeasured (a FIFO and a /dev/zero link in shapes/): {m}; /healthz max {max(rig.healthz_s) * 1000:.0f} ms over "
            f"{len(rig.healthz_s)} probes; sidecar RSS {rss / 2**20:.0f} MiB"
        )
    finally:
        with contextlib.suppress(OSError):
            fifo.unlink()
        with contextlib.suppress(OSError):
            zero.unlink()


# ---------------------------------------------------------------- forged shape samples


def _forged_lines(n: int) -> str:
    now = time.time()
    line = {"query_lens": [1] * 31 + [1024], "max_seq_len": 9216, "num_heads": 32, "causal": True,
            "seq_lens": [8192] * 31 + [9216], "path": "prefill", "head_size": 128, "block_size": 16}  # fmt: skip
    return "".join(
        json.dumps({"step": 10**6 + i, "time": round(now - 0.01 * i, 3)} | line) + "\n" for i in range(n)
    )


def test_forged_samples_make_advice_refuse_with_409_naming_samples(rig: Rig) -> None:
    """Was: forged samples moved advice (decode_ctx_unit 8192 -> 1024) and the drift gauge."""
    r = httpx.get(rig.url + "/thresholds/advice", params={"window": "60s"}, timeout=120)
    assert r.status_code == 200, r.text[:500]
    honest = r.json()
    assert {(s["engine"], s["rank"]) for s in honest["sample_ranks"]} <= {(0, 0), (0, 1)}
    assert honest["sample_ranks"] and all(s["corroborated"] for s in honest["sample_ranks"])

    forged = rig.state / "shapes" / "0-4.jsonl"
    try:
        with forged_reports(rig, (4,)), probing_healthz(rig):
            base = rig.priced_60s()
            forged.write_text(_forged_lines(300))
            # Priced first (the sampler reads live ranks' files each second), so the one advice
            # request below is refused before any fit.
            wait_for(
                lambda: rig.priced_60s() >= base + 300, timeout=60, what="the forged samples to be priced"
            )
            r = httpx.get(rig.url + "/thresholds/advice", params={"window": "60s"}, timeout=120)
            assert r.status_code == 409, r.text[:500]
            body = r.json()
            assert body["field"] == "samples", body
            assert body["samples"]["used"] >= 300
            assert (
                f"{body['samples']['used']} samples from ranks" in body["detail"] and "0-4" in body["detail"]
            )
            bad = [x for x in body["samples"]["ranks"] if not x["corroborated"]]
            assert [(x["engine"], x["rank"]) for x in bad] == [(0, 4)], body
            out = subprocess.run(
                [sys.executable, "-m", "flyserve.cli", "thresholds", "advise", "--url", rig.url, "--window", "60s"],
                check=False, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 1, out.stdout + out.stderr
            assert "advice refused:" in out.stderr and "rank 0-4:" in out.stderr and "REFUSED" in out.stderr
            # Regret and drift leave the forged rank out and name it.
            reg = httpx.get(rig.url + "/dispatch-stats", timeout=30).json()["regret"]
            assert reg["uncorroborated_ranks"] == ["0-4"] and reg["sample_ranks"].get("0-4", 0) >= 300, reg
            m = patch_and_wait_for_the_apply(rig, 2048)
        assert m["applied_steps"] == [m["effective_step"]] * 2, m
        assert m["apply_s"] <= m["bound_s"] + REPORT_LAG_S, m
        assert rig.healthz_s and not rig.healthz_failures, rig.healthz_failures[:5]
        assert max(rig.healthz_s) < 1.0, max(rig.healthz_s)
        print(f"\nmeasured (forged shape samples): {m}; /healthz max {max(rig.healthz_s) * 1000:.0f} ms")
    finally:
        with contextlib.suppress(OSError):
            forged.unlink()
