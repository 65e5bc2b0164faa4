"""How the suite is dealt to xdist's workers (tests/_support.py): a module that shares a fixture is
one work unit, any other test is its own, and the longest modules are dealt first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _support import (
    HEAVY_AT_ONCE,
    LONGEST_FIRST,
    REPO,
    indices_to_run,
    is_heavy,
    next_unit,
    shares_a_fixture,
    xdist_order,
    xdist_work_unit,
)

OFFLINE = "tests/e2e/test_vllm_e2e_offline.py"  # one vLLM engine, a module fixture, ten tests
COMPILES = "tests/integration/test_flydsl_compile_live.py"  # independent compiles


def test_a_module_with_a_module_fixture_is_one_unit() -> None:
    assert shares_a_fixture(OFFLINE)
    assert xdist_work_unit(f"{OFFLINE}::test_policy_routing_used_both_paths") == OFFLINE
    assert xdist_work_unit(f"{OFFLINE}::test_forced_unified_and_forced_prefill") == OFFLINE


def test_a_test_of_a_module_without_one_is_its_own_unit() -> None:
    assert not shares_a_fixture(COMPILES)
    node = f"{COMPILES}::test_every_variant_compiles_under_flydsl_050_as_recorded[943152de]"
    assert xdist_work_unit(node) == node


def test_a_missing_module_is_not_grouped() -> None:
    assert xdist_work_unit("tests/unit/no_such_module.py::test_x") == "tests/unit/no_such_module.py::test_x"


def test_every_listed_long_module_exists() -> None:
    """A renamed module would silently lose its early start."""
    assert [p for p in LONGEST_FIRST if not (REPO / p).is_file()] == []


def test_the_longest_go_first_then_slow_tiers_before_fast() -> None:
    paths = [
        REPO / "tests/unit/test_policy_rules.py",
        REPO / "benchmarks/test_bench_routing.py",
        REPO / "tests/integration/test_sidecar_live.py",
        REPO / "tests/e2e/test_vllm_e2e_serve.py",
        REPO / COMPILES,
        REPO / OFFLINE,
    ]
    ordered = [p.relative_to(REPO).as_posix() for p in sorted(paths, key=xdist_order)]
    assert ordered == [
        COMPILES,
        OFFLINE,
        "tests/e2e/test_vllm_e2e_serve.py",
        "tests/integration/test_sidecar_live.py",
        "benchmarks/test_bench_routing.py",
        "tests/unit/test_policy_rules.py",
    ]
    assert xdist_order(Path("/elsewhere/test_x.py"))[0] == len(LONGEST_FIRST)


def test_heavy_units_wait_for_a_slot_while_light_ones_run() -> None:
    e2e = (f"{OFFLINE}", "tests/e2e/test_vllm_e2e_demo.py::test_demo")
    light = "tests/unit/test_policy_rules.py::test_x"
    queue = [*e2e, light]
    assert all(is_heavy(u) for u in e2e) and not is_heavy(light)
    assert is_heavy(f"{COMPILES}::test_every_variant_compiles_under_flydsl_050_as_recorded[943152de]")
    assert next_unit(queue, heavy_running=0) == OFFLINE
    assert next_unit(queue, heavy_running=HEAVY_AT_ONCE - 1) == OFFLINE
    assert next_unit(queue, heavy_running=HEAVY_AT_ONCE) == light
    assert next_unit(list(e2e), heavy_running=HEAVY_AT_ONCE) == OFFLINE  # no light left: never idle


def test_a_node_id_collected_more_than_once_is_sent_at_every_index() -> None:
    fuzz = "tests/unit/test_sidecar_fuzz.py::test_no_server_errors_and_schema_conformance"
    other = "tests/unit/test_policy_rules.py::test_x"
    collection = [other, fuzz, fuzz, "tests/unit/test_policy_rules.py::test_y", fuzz]
    assert indices_to_run(collection, {fuzz}) == [1, 2, 4]
    assert indices_to_run(collection, {fuzz, other}) == [0, 1, 2, 4]
    assert indices_to_run(collection, set()) == []


@pytest.mark.slow  # two xdist workers running the schemathesis module: about 25 s on the 2-core VM
def test_two_workers_run_every_operation_of_the_schema_fuzz() -> None:
    """schemathesis' items of one test share a node id (one item per API operation): two workers
    pass as many of them as one process collects, not one."""
    fuzz = "tests/unit/test_sidecar_fuzz.py"

    def pytest_run(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, fuzz],
                           cwd=REPO, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        return r.stdout

    collected = [line for line in pytest_run("--collect-only").splitlines() if line.startswith(fuzz + "::")]
    assert len(collected) > 1 and len(set(collected)) == 1  # the shared node id this is about
    assert f"{len(collected)} passed" in pytest_run("-n", "2")
