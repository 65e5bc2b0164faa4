"""FitWorker: one fit at a time, results reused per key, a deadline after which the last
result comes back marked stale (or nothing), and never a queue of fits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from flyserve.sidecar.advice_worker import FitWorker


class Gate:
    """A compute whose fits wait until released; counts concurrent and total calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.active = self.max_active = self.calls = 0

    def __call__(self, key: str) -> str:
        with self.lock:
            self.active += 1
            self.calls += 1
            self.max_active = max(self.max_active, self.active)
        try:
            assert self.release.wait(10)
            return f"fit:{key}:{self.calls}"
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_45_concurrent_requests_start_one_fit_and_none_waits_past_the_deadline() -> None:
    gate = Gate()
    worker: FitWorker[str, str] = FitWorker(gate, deadline_s=0.3, fresh_s=60)

    async def flood() -> list:
        return await asyncio.gather(*(worker.get("900s") for _ in range(45)))

    try:
        got = asyncio.run(asyncio.wait_for(flood(), 5))  # the deadline, not the fit, ends them
        assert got == [None] * 45 and gate.calls == 1 and worker.busy()
        gate.release.set()
        again = asyncio.run(worker.get("900s"))
        assert again is not None and again.value == "fit:900s:1" and not again.stale
        assert gate.calls == 1 and gate.max_active == 1  # reused, never a second fit alongside
    finally:
        gate.release.set()
        worker.close()


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_after_a_change_a_slow_fit_answers_the_last_result_marked_stale() -> None:
    gate = Gate()
    gate.release.set()
    worker: FitWorker[str, str] = FitWorker(gate, deadline_s=0.3, fresh_s=60)
    try:
        first = asyncio.run(worker.get("60s"))
        assert first is not None and first.value == "fit:60s:1" and not first.stale
        gate.release.clear()
        worker.invalidate()  # a PATCH through this sidecar
        stale = asyncio.run(worker.get("60s"))
        assert stale is not None and stale.stale and stale.value == "fit:60s:1"
        assert gate.calls == 2
        gate.release.set()
        fresh = asyncio.run(worker.get("60s"))
        assert fresh is not None and not fresh.stale and fresh.value == "fit:60s:2"
    finally:
        gate.release.set()
        worker.close()


def test_keys_are_fitted_one_after_the_other_never_together() -> None:
    gate = Gate()
    gate.release.set()
    worker: FitWorker[str, str] = FitWorker(gate, deadline_s=5, fresh_s=60)

    async def both() -> list:
        return await asyncio.gather(*(worker.get(k) for k in ("60s", "900s") * 10))

    try:
        got = asyncio.run(both())
        assert {g.value.split(":")[1] for g in got} == {"60s", "900s"}
        assert gate.calls == 2 and gate.max_active == 1
    finally:
        worker.close()


@pytest.mark.parametrize("exc", [ValueError("nothing priced yet"), RuntimeError("boom")])
def test_a_failed_fit_is_remembered_not_retried_on_every_request(exc: Exception) -> None:
    calls = []

    def compute(key: str) -> str:
        calls.append(key)
        raise exc

    worker: FitWorker[str, str] = FitWorker(compute, deadline_s=2, fresh_s=60)
    try:
        for _ in range(5):
            got = asyncio.run(worker.get("900s"))
            assert got is not None and got.error is exc and got.value is None
        assert calls == ["900s"]
    finally:
        worker.close()


def test_shape_files_are_read_only_by_the_sampler_and_the_advice_worker(tmp_path) -> None:
    """Regret windows and advice fits read and price shape files; requests never do (a FIFO
    in shapes/ hung every request that did)."""
    from fastapi.testclient import TestClient

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    settings = SidecarSettings(
        state_dir=tmp_path, share_control_metrics=False, stats_ttl_s=0.0, metrics_ttl_s=0.0, costs="h200"
    )
    app = create_app(settings)
    service = app.state.stats
    readers: list[str] = []
    real = service.price_new_samples

    def spy() -> int:
        readers.append(threading.current_thread().name)
        return real()

    service.price_new_samples = spy
    with TestClient(app) as c:
        for _ in range(3):
            assert c.get("/dispatch-stats").status_code == 200
        c.get("/thresholds/advice")
    assert readers, "nothing priced the samples at all"
    assert all(n.startswith(("flyserve-sidecar-sampler", "flyserve-advice")) for n in readers), readers


@pytest.mark.slow  # a python subprocess
def test_a_fit_stuck_for_ever_does_not_hold_up_the_process_exit() -> None:
    """A fit blocked on a bad file (a FIFO) must not keep the sidecar from exiting on SIGTERM."""
    import subprocess
    import sys

    code = (
        "import asyncio, threading\n"
        "from flyserve.sidecar.advice_worker import FitWorker\n"
        "w = FitWorker(lambda k: threading.Event().wait(), deadline_s=0.1)\n"
        "print(asyncio.run(w.get('900s')))\n"
        "w.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-1000:]


class _Abort(BaseException):
    """Not an Exception: what a fit killed by SystemExit or an async KeyboardInterrupt raises."""


def test_a_fit_aborted_by_a_base_exception_frees_the_slot_for_the_next_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, `_running` stayed set: every later get() waited out its deadline and no fit ran again."""
    calls: list[str] = []

    def compute(key: str) -> str:
        calls.append(key)
        if len(calls) == 1:
            raise _Abort()
        return f"fit:{key}"

    # The aborted worker thread's exception goes to threading.excepthook: keep it out of the output.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    worker: FitWorker[str, str] = FitWorker(compute, deadline_s=2.0, fresh_s=60)
    try:
        first = asyncio.run(worker.get("60s"))
        # The aborted fit left no result: the same request, still within its deadline, starts another.
        assert first is not None and first.value == "fit:60s" and not first.stale
        assert calls == ["60s", "60s"] and not worker.busy()
    finally:
        worker.close()
