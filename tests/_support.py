"""Helpers shared by the test modules (imported as ``_support``: tests/ is on sys.path via its conftest).

Why not ``pytest.importorskip``: when ``import vllm`` breaks, about 30 tests turn into skips and a
green run says nothing. Under CI (``FLYSERVE_CI=1``, set by .ci/run) a missing dependency fails
the run; on a developer machine without the extra it still skips, saying what to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing.util
import os
import re
import shutil
import socket
import subprocess
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CI_VARIABLE = "FLYSERVE_CI"


def under_ci() -> bool:
    return os.environ.get(CI_VARIABLE, "") not in ("", "0")


def _missing(what: str, install: str, detail: str) -> None:
    msg = f"{what} is not available ({detail}); {install}"
    if under_ci():
        pytest.fail(f"{msg}. {CI_VARIABLE} is set: a missing dependency fails the run", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require_module(name: str, install: str = "run scripts/setup.sh") -> ModuleType:
    """``import name``, or fail under CI / skip elsewhere. Any import error counts, not only a missing
    module: a vllm that is installed but broken is exactly what must not pass quietly."""
    try:
        return importlib.import_module(name)
    except Exception as exc:
        _missing(f"python module {name!r}", install, f"{type(exc).__name__}: {str(exc)[:200]}")
        raise  # unreachable: fail/skip raise


# Every run collects every test module (``-m "not slow"`` deselects after collection), so a heavy
# import at module level (vllm, torch: seconds each) costs the fast tier even when its tests are
# deselected. A test module imports them the way these two let it: when a test runs.


def module_requires(*names: str, install: str = "run scripts/setup.sh") -> Any:
    """An autouse, module-scoped fixture that does ``require_module(name)`` for each name before the
    module's first test, not when the module is collected: ``required_modules = module_requires("vllm")``."""

    @pytest.fixture(autouse=True, scope="module")
    def required_modules() -> None:
        for name in names:
            require_module(name, install)

    return required_modules


class _LazyModule(ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr == "pytestmark":  # pytest's probes of a module's globals
            raise AttributeError(attr)
        return getattr(require_module(self.__name__, self.__dict__["_install"]), attr)


def lazy_module(name: str, install: str = "run scripts/setup.sh") -> Any:
    """``name``, imported (by ``require_module``) when one of its attributes is first read:
    ``torch = lazy_module("torch")`` at module level imports nothing while the module is collected."""
    lazy = _LazyModule(name)
    lazy.__dict__["_install"] = install
    return lazy


def require_binary(
    name: str, install: str = "install Debian's `prometheus` package (scripts/setup.sh does)"
) -> str:
    """The path of executable ``name`` on PATH, or fail under CI / skip elsewhere."""
    path = shutil.which(name)
    if path is None:
        _missing(f"executable {name!r}", install, "not on PATH")
        raise AssertionError("unreachable")
    return path


# Fast to slow, so a broken unit test shows in seconds, before the servers and vLLM start (the
# order tests/conftest.py gives a run). Within a tier, collection order is kept.
REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "benchmarks", "integration", "e2e", "gpu")


def tier_of(path: Path) -> int:
    """The tier of a test file: the first directory under the repository named in TIERS."""
    try:
        parts = path.resolve().relative_to(REPO).parts
    except ValueError:
        return len(TIERS)
    for part in parts[:2]:
        if part in TIERS:
            return TIERS.index(part)
    return len(TIERS)


def require_flydsl_checkout(root: Path, revision: str) -> Path:
    """The FlyDSL checkout ``root/FlyDSL-<revision>``, or fail under CI / skip elsewhere.

    scripts/flydsl-compile-setup.sh makes it: a copy of the revision's vendored files
    (third_party/flydsl/<revision>/, what flyserve's call imports: FlyDSL's kernels/ package is not
    in the flydsl wheel and CI cannot reach github.com), or a ``git archive`` of a whole tree.
    .ci/run runs it (for flydsl 0.4.2 and 0.5.0), so under CI a missing checkout is a failure like
    any other missing dependency.
    """
    tree = root / f"FlyDSL-{revision}"
    if not (tree / "kernels" / "attention").is_dir():
        _missing(
            f"the FlyDSL checkout {tree.name}/",
            "run scripts/flydsl-compile-setup.sh (.ci/run does) to compile flyserve's call with FlyDSL's compiler",
            f"none under {root.name}/",
        )
    return tree


def require_executable(path: Path, install: str) -> Path:
    """``path`` if it is an executable file, or fail under CI / skip elsewhere (a tool installed into
    a venv of its own, like checkov in .venv-checkov, is not on PATH)."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        _missing(f"executable {path.name!r}", install, f"no {path.parent.parent.name}/bin/{path.name}")
        raise AssertionError("unreachable")
    return path


SHARED_FIXTURE_SCOPE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")
"""A fixture shared wider than one test, as its module declares it."""

LONGEST_FIRST = (
    # The longest modules of a 4-worker run on the 2-core CI machine, longest first (measured,
    # --durations, with other work on the machine): started first, they run beside the many short ones
    # instead of after them. A module missing here only starts later.
    "tests/integration/test_flydsl_compile_live.py",  # 800 s: 4 independent compiles, spread
    "tests/e2e/test_vllm_e2e_engine_channel.py",  # 503 s
    "tests/e2e/test_vllm_e2e_offline.py",  # one engine (module fixture) serving 10 tests: ~400 s
    "tests/e2e/test_vllm_e2e_demo.py",  # 283 s
    "tests/e2e/test_vllm_e2e_startup_refusals.py",  # 261 s
    "tests/e2e/test_vllm_e2e_data_parallel.py",  # 246 s
    "tests/e2e/test_vllm_e2e_two_nodes.py",  # 247 s
    "tests/integration/test_dashboards_live.py",  # 4 x 60 s set-ups
    "tests/e2e/test_vllm_e2e_serve.py",
    "tests/e2e/test_arms_vllm.py",
    "tests/e2e/test_vllm_bad_profile.py",
)


@functools.cache
def shares_a_fixture(module_path: str) -> bool:
    """Whether a test module declares a module-, class- or package-scoped fixture (read from its
    source: the xdist controller that asks has collected nothing)."""
    try:
        return bool(SHARED_FIXTURE_SCOPE.search((REPO / module_path).read_text(errors="replace")))
    except OSError:
        return False


def xdist_work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a module that shares a fixture (a vLLM engine, a
    kubectl build) goes to one worker, so the fixture is set up once, as without xdist; any other
    test is a unit of its own. pytest-xdist's own --dist loadgroup does this by renaming each node
    id, which pytest 9.2 no longer lets it do (Node.nodeid reads _id, xdist writes _nodeid): the
    offline e2e module's engine then started on four workers (4 x ~260 s)."""
    module = nodeid.split("::", 1)[0]
    return module if shares_a_fixture(module) else nodeid


def xdist_order(path: Path) -> tuple[int, int]:
    """The collection order under xdist: the longest modules first (LONGEST_FIRST), then the slow
    tiers before the fast (e2e, integration, benchmarks, unit), so that the long tail starts early;
    a run in one process keeps tier_of's fast-to-slow order."""
    try:
        rel = path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        rel = ""
    rank = LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
    return rank, -tier_of(path)


HEAVY_AT_ONCE = 1
"""How many heavy work units (a real vLLM, FlyDSL's compiler) run at once. On the 2-core CI machine
four workers with two heavy units (load average 10-13) made sidecars miss 60-90 s start deadlines and
promtool runs their 120 s timeout (measured: 4 failed, 3 errors, all timeouts): one heavy unit at a
time, beside one worker of light tests.
"""


def is_heavy(unit: str) -> bool:
    """A work unit that keeps the CPU busy for minutes: tests/e2e (a real vLLM) and the compile check."""
    module = unit.split("::", 1)[0]
    return module.startswith("tests/e2e/") or module == "tests/integration/test_flydsl_compile_live.py"


def next_unit(queue: list[str], heavy_running: int) -> str:
    """The unit to deal next: the first in order, but the first light one while HEAVY_AT_ONCE heavy
    units run (the first heavy one when none light is left: a worker is never left idle)."""
    if heavy_running >= HEAVY_AT_ONCE:
        for unit in queue:
            if not is_heavy(unit):
                return unit
    return queue[0]


def indices_to_run(collection: list[str], pending: set[str]) -> list[int]:
    """Every index of every pending node id, in collection order. pytest-xdist's LoadScopeScheduling
    sends ``collection.index(nodeid)``, the first only: schemathesis' items of one test (one per API
    operation, tests/unit/test_sidecar_fuzz.py) share their node id, and under ``-n 2`` one of its
    17 operations ran (measured: 10 requests instead of 969). The first of them to finish marks the
    id done; the worker still runs the others it was sent before it takes its shutdown."""
    return [i for i, nodeid in enumerate(collection) if nodeid in pending]


def make_xdist_scheduler(config: pytest.Config, log: object) -> object:
    """A LoadScopeScheduling whose work units are xdist_work_unit's, dealt in collection order with
    at most HEAVY_AT_ONCE heavy units running."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            heavy_running = sum(
                1
                for units in self.assigned_work.values()
                for unit, tests in units.items()
                if is_heavy(unit) and not all(tests.values())
            )
            unit = next_unit(list(self.workqueue), heavy_running)
            scope, work_unit = unit, self.workqueue.pop(unit)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            pending = {nodeid for nodeid, completed in work_unit.items() if not completed}
            node.send_runtest_some(indices_to_run(self.registered_collections[node], pending))

    config.option.loadscopereorder = False  # keep xdist_order's order
    return SharedFixtureScheduling(config, log)


# The fast tier, ``pytest -m "not slow"``: tests that start no subprocess, connect no socket
# (127.0.0.1 included) and run no external tool. Everything under these directories is slow
# (tests/conftest.py marks it); elsewhere a test that does any of it carries the mark itself.
SLOW_TIERS = ("integration", "e2e", "gpu")


def in_slow_tier(path: Path) -> bool:
    tier = tier_of(path)
    return tier < len(TIERS) and TIERS[tier] in SLOW_TIERS


class FastTierGuard:
    """While installed, starting a subprocess or connecting a socket raises (pytest's Failed, which
    ``except Exception`` does not swallow) and is recorded, so the test fails even where the code under
    test catches it or runs it in a thread. In-process ASGI clients (httpx.ASGITransport, fastapi's
    TestClient) and typer's CliRunner use no socket and no subprocess: they pass."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.violations: list[str] = []

    @staticmethod
    def _where() -> str:
        """The innermost caller outside the standard library (a library's call) and in the repository."""
        stdlib = os.path.dirname(os.__file__)
        found: dict[str, str] = {}
        for frame in reversed(traceback.extract_stack()[:-3]):
            name = frame.filename
            if name == __file__ or (name.startswith(stdlib + os.sep) and "site-packages" not in name):
                continue
            key = "repo" if name.startswith(str(REPO) + os.sep) and "/.venv" not in name else "lib"
            found.setdefault(key, f"{name.removeprefix(str(REPO) + os.sep)}:{frame.lineno}")
            if "repo" in found:
                break
        return " from " + " <- ".join(found.values()) if found else ""

    def refuse(self, what: str) -> None:
        msg = (
            f"{self.nodeid} {what}{self._where()}, and it is not marked slow: the fast tier "
            "(pytest -m 'not slow') starts no subprocess, connects no socket and runs no external tool. "
            "mark it slow (a module-level `pytestmark = pytest.mark.slow` or `@pytest.mark.slow`), or "
            "move it to tests/integration"
        )
        self.violations.append(msg)
        pytest.fail(msg, pytrace=False)

    def install(self, mp: pytest.MonkeyPatch) -> None:
        guard = self

        def execute_child(popen: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
            guard.refuse(f"started a subprocess ({args if isinstance(args, str | bytes) else list(args)!r})")

        def connect(sock: socket.socket, address: Any) -> Any:
            guard.refuse(f"connected a socket to {address!r}")

        def process_call(name: str) -> Any:
            def refused(*args: Any, **kw: Any) -> Any:
                guard.refuse(f"called {name}{args[:2]!r}")

            return refused

        # subprocess.run/check_output/Popen and asyncio's subprocesses all start the child here.
        mp.setattr(subprocess.Popen, "_execute_child", execute_child)
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, process_call(f"os.{name}"))
        # multiprocessing's spawn and forkserver start methods (fork goes through os.fork)
        mp.setattr(multiprocessing.util, "spawnv_passfds", process_call("multiprocessing spawn"))


FAST_TIER_GUARD = pytest.StashKey[FastTierGuard]()


@contextlib.contextmanager
def fast_tier_guard(item: pytest.Item) -> Iterator[None]:
    """Around one phase (setup, call, teardown: module-scoped fixtures included) of an item not marked
    slow: the item's guard installed, and the phase failed afterwards if anything was refused, caught
    by the code under test or not."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    guard = item.stash.setdefault(FAST_TIER_GUARD, FastTierGuard(item.nodeid))
    with pytest.MonkeyPatch.context() as mp:
        guard.install(mp)
        try:
            yield
        except BaseException as exc:  # the phase fails already (the refusal itself, as a rule)
            refused, guard.violations = guard.violations, []
            if refused and isinstance(exc, pytest.skip.Exception):  # a skip does not hide one
                pytest.fail("\n".join(dict.fromkeys(refused)), pytrace=False)
            raise
    refused, guard.violations = guard.violations, []
    if refused:
        pytest.fail("\n".join(dict.fromkeys(refused)), pytrace=False)
