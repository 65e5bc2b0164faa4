"""The fast tier's guard (tests/_support.py FastTierGuard, installed by tests/conftest.py around every
phase of a test not marked slow): a subprocess or a socket connection fails the test saying "mark it
slow"; in-process ASGI clients and typer's CliRunner pass. These tests run under the guard themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import typer
from _support import REPO, fast_tier_guard, in_slow_tier, lazy_module
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

_REAL_FORK = os.fork  # read at import, outside the guard: a test below must never call it


def _refused(guard, what: str) -> str:
    """The one refusal the guard recorded, which the test then takes back (its phase would fail)."""
    assert guard is not None and len(guard.violations) == 1, guard and guard.violations
    msg = guard.violations.pop()
    assert what in msg and "mark it slow" in msg and "test_fast_tier_guard.py" in msg, msg
    return msg


def test_popen_fails_a_fast_test_saying_mark_it_slow(fast_tier):
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        subprocess.Popen(["true"])
    _refused(fast_tier, "started a subprocess (['true'])")
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    _refused(fast_tier, "started a subprocess")


def test_an_asyncio_subprocess_is_refused(fast_tier):
    async def spawn() -> None:
        await asyncio.create_subprocess_exec("true")

    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        asyncio.run(spawn())
    _refused(fast_tier, "started a subprocess (['true'])")


def test_fork_and_system_are_refused(fast_tier):
    assert os.fork is not _REAL_FORK  # replaced: calling it below forks nothing
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        os.fork()
    _refused(fast_tier, "called os.fork")
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        os.system("true")
    _refused(fast_tier, "called os.system")


def test_a_socket_connect_is_refused_127_0_0_1_included(fast_tier):
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    _refused(fast_tier, "connected a socket to ('127.0.0.1', 9)")
    with socket.socket() as s, pytest.raises(pytest.fail.Exception, match="mark it slow"):
        s.connect_ex(("127.0.0.1", 9))
    _refused(fast_tier, "connected a socket")
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):  # a real HTTP client: httpcore
        httpx.get("http://127.0.0.1:9/", timeout=1)
    _refused(fast_tier, "connected a socket")


def test_a_refusal_the_code_swallows_still_fails_the_phase():
    """The guard of a fast item, around a phase whose code catches the refusal: the phase fails."""
    item = SimpleNamespace(nodeid="tests/unit/test_x.py::test_quiet", stash=pytest.Stash(),
                           get_closest_marker=lambda name: None)  # fmt: skip
    failed = pytest.raises(pytest.fail.Exception, match="test_quiet started a subprocess.*mark it slow")
    with failed, fast_tier_guard(item), contextlib.suppress(BaseException):  # as code under test may
        subprocess.Popen(["true"])
    failed = pytest.raises(pytest.fail.Exception, match="connected a socket")
    with failed, fast_tier_guard(item):
        with contextlib.suppress(BaseException):
            socket.create_connection(("127.0.0.1", 9), timeout=1)
        pytest.skip("after the refusal")  # a skip hides no refusal either


def test_in_process_asgi_and_cli_runner_pass_under_the_guard(fast_tier):
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"pong": "yes"}

    with TestClient(app) as client:
        assert client.get("/ping").json() == {"pong": "yes"}

    async def via_transport() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/ping")).json()

    assert asyncio.run(via_transport()) == {"pong": "yes"}
    cli = typer.Typer()

    @cli.command()
    def hello(name: str) -> None:
        print(f"hello {name}")

    assert CliRunner().invoke(cli, ["fast"]).output == "hello fast\n"
    assert fast_tier.violations == []


@pytest.mark.slow  # the guard's other side: it starts a subprocess and connects a socket
def test_a_slow_test_is_not_guarded(fast_tier):
    assert fast_tier is None
    assert subprocess.run(["true"], check=False).returncode == 0
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            pass


def test_the_slow_directories():
    for where, slow in (("tests/unit", False), ("benchmarks", False), ("tests/integration", True),
                        ("tests/e2e", True), ("tests/gpu", True)):  # fmt: skip
        assert in_slow_tier(REPO / where / "test_x.py") is slow, where


def test_lazy_module_imports_on_first_use(monkeypatch):
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)
    tab = lazy_module("tabnanny")
    assert not hasattr(tab, "_pytestfixturefunction") and not hasattr(tab, "pytestmark")  # pytest's probes
    assert "tabnanny" not in sys.modules
    assert callable(tab.check)
    assert "tabnanny" in sys.modules
