"""flyserve.telemetry.metrics and DispatchRecorder: names, series, counts, exposition, multiprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from flyserve.policy import PATHS, PREFILL, REASONS, UNIFIED, BatchShape, Thresholds, decide
from flyserve.telemetry import metrics
from flyserve.telemetry.recorder import DispatchRecorder

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = "/usr/bin/promtool"


def _value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def test_metric_names_are_the_agreed_ones() -> None:
    assert metrics.METRIC_NAMES == (
        "flyserve_dispatch_decisions_total",
        "flyserve_dispatch_tokens_total",
        "flyserve_dispatch_rows_total",
        "flyserve_dispatch_lpt_total",
        "flyserve_dispatch_query_tokens",
        "flyserve_dispatch_max_seq_len",
        "flyserve_kernel_seconds",
        "flyserve_kernel_timer_dropped_total",
        "flyserve_engine_step",
        "flyserve_thresholds_version",
        "flyserve_circuit_open",
        "flyserve_control_late_applies_total",
        "flyserve_config_reloads_total",
        "flyserve_config_last_success_timestamp_seconds",
        "flyserve_sidecar_requests_total",
        "flyserve_sidecar_request_seconds",
        "flyserve_sidecar_dropped_connections_total",
        "flyserve_sidecar_shed_requests_total",
        "flyserve_sidecar_stream_reclaims_total",
        "flyserve_rank_up",
        "flyserve_rank_report_age_seconds",
        "flyserve_ranks_agree",
        "flyserve_thresholds_fingerprint",
        "flyserve_sidecar_ignored_files",
        "flyserve_sidecar_compacted_files_total",
        "flyserve_sidecar_metrics_files",
        "flyserve_priced_attention_seconds_total",
        "flyserve_priced_attention_by_batch_seconds_total",
        "flyserve_cost_drift_ratio",
        "flyserve_autopilot_trials_total",
        "flyserve_autopilot_arm",
        "flyserve_autopilot_exploration_cost_seconds_total",
        "flyserve_autopilot_mode",
    )
    assert all(":" not in n and n.startswith("flyserve_") for n in metrics.METRIC_NAMES)
    assert metrics.METRIC_TYPES["flyserve_kernel_seconds"] == "histogram"
    assert metrics.KERNEL_SECONDS_BUCKETS[0] == 1e-5 and metrics.KERNEL_SECONDS_BUCKETS[-1] == 1.0


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_every_series_exists_before_the_first_decision() -> None:
    DispatchRecorder(rank=41)
    r = "41"
    for p in PATHS:
        for reason in REASONS:
            assert _value("flyserve_dispatch_decisions_total", path=p, reason=reason, rank=r) == 0.0
        assert _value("flyserve_dispatch_tokens_total", path=p, rank=r) == 0.0
        for kind in ("prefill", "decode"):
            assert _value("flyserve_dispatch_rows_total", path=p, kind=kind, rank=r) == 0.0
        for h in (
            "flyserve_dispatch_query_tokens",
            "flyserve_dispatch_max_seq_len",
            "flyserve_kernel_seconds",
        ):
            assert _value(h + "_count", path=p, rank=r) == 0.0
        assert _value("flyserve_kernel_timer_dropped_total", path=p, rank=r) == 0.0
    for o in ("lpt", "plain"):
        assert _value("flyserve_dispatch_lpt_total", ordering=o, rank=r) == 0.0
    for g in ("flyserve_engine_step", "flyserve_thresholds_version", "flyserve_circuit_open"):
        assert _value(g, rank=r) == 0.0
    assert _value("flyserve_config_reloads_total", result="invalid", source="api") is not None


def _known_shapes(seed_cases: dict) -> list[tuple[list[int], int]]:
    shapes = [(c["query_lens"], c["max_seq_len"]) for c in seed_cases["cases"]]
    # decode-only steps, a long-context batch beyond max_seq_len, an empty-ish short one
    shapes += [([1] * 32, 8192), ([1] * 8, 2048), ([4096], 200_000), ([3, 1, 1], 512)]
    return shapes


@pytest.mark.slow  # 1.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_counters_match_the_decisions_of_a_known_sequence(seed_cases: dict) -> None:
    t = Thresholds()
    heads = seed_cases["num_heads"]
    rec = DispatchRecorder(rank=42)
    want_decisions: Counter[tuple[str, str]] = Counter()
    want_tokens: Counter[str] = Counter()
    want_rows: Counter[tuple[str, str]] = Counter()
    want_lpt: Counter[str] = Counter()
    qt: dict[str, list[int]] = {p: [] for p in PATHS}
    msl: dict[str, list[int]] = {p: [] for p in PATHS}
    shapes = _known_shapes(seed_cases)
    for step, (lens, max_seq) in enumerate(shapes, start=1):
        shape = BatchShape.from_query_lens(lens, max_seq_len=max_seq, num_heads=heads, thresholds=t)
        d = decide(shape, t)
        rec.record(d, shape, step, 7)
        # expectations computed from the raw lists, not from BatchShape
        want_decisions[(d.path, d.reason)] += 1
        want_tokens[d.path] += sum(lens)
        want_rows[(d.path, "decode")] += sum(1 for x in lens if x <= 1)
        want_rows[(d.path, "prefill")] += sum(1 for x in lens if x > 1)
        if d.path == PREFILL:
            want_lpt["lpt" if d.lpt else "plain"] += 1
        qt[d.path].append(sum(lens))
        msl[d.path].append(max_seq)
    # the sequence exercises both paths and several reasons, or the test proves little
    assert {p for p, _ in want_decisions} == {UNIFIED, PREFILL}
    assert len({r for _, r in want_decisions}) >= 4
    r = "42"
    for p in PATHS:
        for reason in REASONS:
            got = _value("flyserve_dispatch_decisions_total", path=p, reason=reason, rank=r)
            assert got == want_decisions[(p, reason)], (p, reason)
        assert _value("flyserve_dispatch_tokens_total", path=p, rank=r) == want_tokens[p]
        for kind in ("prefill", "decode"):
            assert _value("flyserve_dispatch_rows_total", path=p, kind=kind, rank=r) == want_rows[(p, kind)]
        for name, seen, bounds in (
            ("flyserve_dispatch_query_tokens", qt[p], metrics.QUERY_TOKEN_BUCKETS),
            ("flyserve_dispatch_max_seq_len", msl[p], metrics.MAX_SEQ_LEN_BUCKETS),
        ):
            assert _value(name + "_count", path=p, rank=r) == len(seen)
            assert _value(name + "_sum", path=p, rank=r) == sum(seen)
            for le in bounds:
                labels = {"path": p, "rank": r, "le": floatToGoString(le)}
                got = metrics.REGISTRY.get_sample_value(name + "_bucket", labels)
                assert got == sum(1 for v in seen if v <= le), (name, p, le)
            assert _value(name + "_bucket", path=p, rank=r, le="+Inf") == len(seen)
    for o in ("lpt", "plain"):
        assert _value("flyserve_dispatch_lpt_total", ordering=o, rank=r) == want_lpt[o]
    assert _value("flyserve_engine_step", rank=r) == len(shapes)
    assert _value("flyserve_thresholds_version", rank=r) == 7


def test_non_interned_decision_counts_on_the_same_series() -> None:
    from flyserve.policy.rules import Decision

    rec = DispatchRecorder(rank=43)
    shape = BatchShape.from_query_lens([1, 1], max_seq_len=100, num_heads=8)
    rec.record(Decision(UNIFIED, "circuit_open", None, 0), shape, 1, 1)
    assert _value("flyserve_dispatch_decisions_total", path=UNIFIED, reason="circuit_open", rank="43") == 1
    with pytest.raises(ValueError, match="vocabulary"):
        rec.record(Decision(UNIFIED, "made_up", None, 0), shape, 2, 1)


def test_circuit_gauge_and_config_reload_counter() -> None:
    rec = DispatchRecorder(rank=44)
    rec.set_circuit_open(True)
    assert _value("flyserve_circuit_open", rank="44") == 1.0
    rec.set_circuit_open(False)
    assert _value("flyserve_circuit_open", rank="44") == 0.0
    before = _value("flyserve_config_reloads_total", result="success", source="api")
    metrics.record_config_reload("success", "api")
    assert _value("flyserve_config_reloads_total", result="success", source="api") == before + 1
    assert _value("flyserve_config_last_success_timestamp_seconds") > 1.7e9
    with pytest.raises(ValueError, match="result"):
        metrics.record_config_reload("maybe", "api")


def _promtool_check(text: bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=text.decode(),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # a python subprocess or promtool
def test_promtool_check_metrics_is_clean_on_the_exposition() -> None:
    if not os.path.exists(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is required (scripts/setup.sh installs Prometheus)")
    rec = DispatchRecorder(rank=45)
    t = Thresholds()
    shape = BatchShape.from_query_lens([2048, 1], max_seq_len=8192, num_heads=16)
    rec.record(decide(shape, t), shape, 1, 1)
    metrics.SIDECAR_REQUESTS.labels("/metrics", "GET", "200").inc()
    metrics.SIDECAR_REQUEST_SECONDS.labels("/metrics").observe(0.002)
    metrics.RANK_UP.labels("45").set(1)
    metrics.RANKS_AGREE.set(1)
    text = generate_latest(metrics.exposition_registry())
    for name in metrics.METRIC_NAMES:
        assert f"# TYPE {name} {metrics.METRIC_TYPES[name]}" in text.decode(), name
    res = _promtool_check(text)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


@pytest.mark.slow  # a python subprocess or promtool
def test_promtool_flags_a_bad_exposition() -> None:
    """The promtool check above can fail: a counter without _total is reported."""
    res = _promtool_check(b"# HELP x_count a\n# TYPE x_count counter\nx_count 1\n")
    assert res.returncode != 0 or res.stdout.strip() or res.stderr.strip()


# -- multiprocess ---------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, sys
    # What vLLM does when it runs several API-server processes: its own multiprocess dir,
    # set before anything imports prometheus_client.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
    import prometheus_client
    from prometheus_client import values
    assert values.ValueClass is not values.MutexValue  # prometheus_client is in vLLM's mode
    vllm_counter = prometheus_client.Counter("vllm_like_requests", "vLLM's own", registry=None)
    vllm_counter.inc()
    from flyserve.policy import BatchShape, Thresholds, decide
    from flyserve.telemetry import metrics
    from flyserve.telemetry.recorder import DispatchRecorder
    metrics.setup_multiprocess(sys.argv[1], wipe=sys.argv[4] == "wipe")
    rank = int(sys.argv[3])
    rec = DispatchRecorder(rank)
    t = Thresholds()
    for step, (lens, ctx) in enumerate([([2048], 8192), ([1] * 8, 8192), ([1] * 8, 8192)], 1):
        s = BatchShape.from_query_lens(lens, max_seq_len=ctx, num_heads=16)
        rec.record(decide(s, t), s, step, 3)
    metrics.record_config_reload("invalid", "file")
    print("ok", os.getpid(), flush=True)
    if sys.argv[5] == "wait":
        sys.stdin.readline()  # stay alive (a serving rank) until the test says stop
    """
)


def _child_args(flyserve_dir: Path, other_dir: Path, rank: int, wipe: bool, wait: bool) -> list[str]:
    return [
        sys.executable,
        "-c",
        _CHILD,
        str(flyserve_dir),
        str(other_dir),
        str(rank),
        "wipe" if wipe else "-",
        "wait" if wait else "-",
    ]


def _python(args: list[str], *, unset_multiproc_dir: bool = False) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter on ``args`` from the checkout (PYTHONPATH and cwd the repo), its output
    captured, 120 s at most; ``unset_multiproc_dir``: without PROMETHEUS_MULTIPROC_DIR, as a process
    nothing set up for multiprocess metrics."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if unset_multiproc_dir:
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def _run_child(flyserve_dir: Path, other_dir: Path, rank: int, wipe: bool = False) -> int:
    res = _python(_child_args(flyserve_dir, other_dir, rank, wipe, False))
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def _collect(d: Path) -> CollectorRegistry:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(d))
    return reg


@pytest.mark.slow  # a python subprocess or promtool
def test_metrics_land_in_flyserve_dir_even_when_vllm_sets_the_env_var(tmp_path: Path) -> None:
    ours, vllms = tmp_path / "metrics", tmp_path / "vllm"
    ours.mkdir()
    vllms.mkdir()
    _run_child(ours, vllms, rank=0, wipe=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    live = subprocess.Popen(
        _child_args(ours, vllms, 1, False, True),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert live.stdout is not None and live.stdout.readline().startswith("ok")
        reg = _collect(ours)
        # a live rank's gauges are visible; a finished rank's "live" gauges went with it
        assert reg.get_sample_value("flyserve_thresholds_version", {"rank": "1"}) == 3
        assert reg.get_sample_value("flyserve_engine_step", {"rank": "1"}) == 3
        assert reg.get_sample_value("flyserve_circuit_open", {"rank": "1"}) == 0
        assert reg.get_sample_value("flyserve_engine_step", {"rank": "0"}) is None
    finally:
        try:
            live.communicate("stop\n", timeout=60)
        finally:
            if live.poll() is None:
                live.kill()
                live.wait()
    assert live.returncode == 0
    for rank in ("0", "1"):
        get = reg.get_sample_value
        assert (
            get("flyserve_dispatch_decisions_total", {"path": PREFILL, "reason": "admitted", "rank": rank})
            == 1
        )
        assert (
            get(
                "flyserve_dispatch_decisions_total",
                {"path": UNIFIED, "reason": "no_prefill_rows", "rank": rank},
            )
            == 2
        )
        # pre-created series reach the sidecar as zeros
        assert (
            get("flyserve_dispatch_decisions_total", {"path": UNIFIED, "reason": "disabled", "rank": rank})
            == 0
        )
        assert get("flyserve_dispatch_tokens_total", {"path": UNIFIED, "rank": rank}) == 16
        assert get("flyserve_dispatch_query_tokens_count", {"path": PREFILL, "rank": rank}) == 1
    assert reg.get_sample_value("flyserve_engine_step", {"rank": "1"}) is None  # rank 1 has exited now
    # control-side counter summed over both processes
    assert reg.get_sample_value("flyserve_config_reloads_total", {"result": "invalid", "source": "file"}) == 2
    # vLLM's directory got vLLM's metric and none of flyserve's
    vreg = _collect(vllms)
    names = {m.name for m in vreg.collect()}
    assert "vllm_like_requests" in names
    assert not any(n.startswith("flyserve_") for n in names)
    assert generate_latest(reg).count(b"flyserve_dispatch_decisions_total{") == 2 * len(PATHS) * len(REASONS)


@pytest.mark.slow  # a python subprocess or promtool
def test_wipe_removes_only_dead_processes_files(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    dead = _run_child(d, tmp_path, rank=0)
    (d / f"counter_{os.getpid()}.db").write_bytes(b"")  # a live process's file (this one)
    assert (d / f"counter_{dead}.db").exists()
    removed = metrics.wipe_metrics_dir(d)
    assert removed >= 1
    assert not (d / f"counter_{dead}.db").exists()
    assert (d / f"counter_{os.getpid()}.db").exists()
    assert metrics.wipe_metrics_dir(d, only_dead=False) == 1
    assert list(d.iterdir()) == []


_SIDECAR_CHILD = textwrap.dedent(
    """
    import sys
    from prometheus_client import generate_latest
    from flyserve.telemetry import metrics
    reg = metrics.exposition_registry(sys.argv[1])
    metrics.SIDECAR_REQUESTS.labels("/metrics", "GET", "200").inc()
    metrics.record_config_reload("success", "api")
    sys.stdout.write(generate_latest(reg).decode())
    """
)


@pytest.mark.slow  # a python subprocess or promtool
def test_sidecar_exposition_merges_files_and_own_metrics(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (tmp_path / "v").mkdir()
    _run_child(d, tmp_path / "v", rank=3)
    res = _python([sys.executable, "-c", _SIDECAR_CHILD, str(d)], unset_multiproc_dir=True)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert 'flyserve_sidecar_requests_total{code="200",method="GET",route="/metrics"} 1.0' in text
    assert 'flyserve_dispatch_decisions_total{path="prefill",rank="3",reason="admitted"} 1.0' in text
    assert 'flyserve_config_reloads_total{result="success",source="api"} 1.0' in text
    assert 'flyserve_config_reloads_total{result="invalid",source="file"} 1.0' in text
    assert text.count("# TYPE flyserve_config_reloads_total counter") == 1
    res = _promtool_check(text.encode())
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


@pytest.mark.slow  # a python subprocess or promtool
def test_in_process_mode_without_any_multiprocess_setup() -> None:
    """No setup_multiprocess, no env var: plain in-process values (unit tests, the sidecar's own)."""
    code = textwrap.dedent(
        """
        import os
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
        from flyserve.telemetry import metrics
        from flyserve.telemetry.recorder import DispatchRecorder
        from flyserve.policy import BatchShape, Thresholds, decide
        assert metrics.multiprocess_dir() is None
        rec = DispatchRecorder(5)
        s = BatchShape.from_query_lens([1] * 4, max_seq_len=1000, num_heads=8)
        rec.record(decide(s, Thresholds()), s, 9, 2)
        v = metrics.REGISTRY.get_sample_value
        assert v("flyserve_dispatch_decisions_total", {"path": "unified", "reason": "no_prefill_rows", "rank": "5"}) == 1
        assert v("flyserve_engine_step", {"rank": "5"}) == 9
        print("ok")
        """
    )
    res = _python([sys.executable, "-c", code], unset_multiproc_dir=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.slow  # a python subprocess or promtool
def test_setup_multiprocess_rebinds_an_existing_recorder(tmp_path: Path) -> None:
    """A recorder built before setup_multiprocess keeps counting, into the files."""
    code = textwrap.dedent(
        """
        import sys
        from flyserve.telemetry import metrics
        from flyserve.telemetry.recorder import DispatchRecorder
        from flyserve.policy import BatchShape, Thresholds, decide
        rec = DispatchRecorder(6)
        s = BatchShape.from_query_lens([1] * 4, max_seq_len=1000, num_heads=8)
        rec.record(decide(s, Thresholds()), s, 1, 1)
        metrics.setup_multiprocess(sys.argv[1])
        rec.record(decide(s, Thresholds()), s, 2, 1)
        rec.record(decide(s, Thresholds()), s, 3, 1)
        """
    )
    res = _python([sys.executable, "-c", code, str(tmp_path)])
    assert res.returncode == 0, res.stderr
    got = _collect(tmp_path).get_sample_value(
        "flyserve_dispatch_decisions_total", {"path": "unified", "reason": "no_prefill_rows", "rank": "6"}
    )
    assert got == 2  # the in-process count before set-up is not carried over (documented)


_GROW_AND_FORK = textwrap.dedent(
    """
    import os, sys
    from flyserve.telemetry import metrics
    from flyserve.telemetry.recorder import DispatchRecorder
    from flyserve.policy import BatchShape, Thresholds, decide
    metrics.setup_multiprocess(sys.argv[1])
    rec = DispatchRecorder(8)
    s = BatchShape.from_query_lens([1] * 4, max_seq_len=1000, num_heads=8)
    d = decide(s, Thresholds())
    rec.record(d, s, 1, 1)
    counter_file = os.path.join(sys.argv[1], f"counter_{os.getpid()}.db")
    size0 = os.path.getsize(counter_file)
    for i in range(1500):  # enough new series to make the counter file grow (a new, larger mapping)
        metrics.DISPATCH_TOKENS.labels("unified", f"grow{i}")
    assert os.path.getsize(counter_file) > size0, "the file did not grow: the test proves nothing"
    rec.record(d, s, 2, 1)  # cells bound before the growth still reach the file
    pid = os.fork()
    if pid == 0:  # the child counts in its own file, not its parent's
        rec.record(d, s, 3, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    rec.record(d, s, 4, 1)
    print(os.getpid(), pid)
    """
)


@pytest.mark.slow  # a python subprocess or promtool
def test_counts_survive_file_growth_and_fork(tmp_path: Path) -> None:
    res = _python([sys.executable, "-c", _GROW_AND_FORK, str(tmp_path)])
    assert res.returncode == 0, res.stderr
    parent, child = res.stdout.split()
    labels = {"path": "unified", "reason": "no_prefill_rows", "rank": "8"}
    assert _collect(tmp_path).get_sample_value("flyserve_dispatch_decisions_total", labels) == 4
    (d_parent := tmp_path / "p").mkdir()
    (tmp_path / f"counter_{parent}.db").rename(d_parent / f"counter_{parent}.db")
    assert _collect(d_parent).get_sample_value("flyserve_dispatch_decisions_total", labels) == 3
    (d_child := tmp_path / "c").mkdir()
    (tmp_path / f"counter_{child}.db").rename(d_child / f"counter_{child}.db")
    assert _collect(d_child).get_sample_value("flyserve_dispatch_decisions_total", labels) == 1


def test_record_makes_no_label_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """After construction the hot path never calls .labels() (nor observe()/inc() of a child)."""
    rec = DispatchRecorder(rank=46)
    t = Thresholds()

    def forbidden(*a: object, **k: object) -> None:
        raise AssertionError("label lookup on the hot path")

    for m in metrics.RANK_METRICS:
        monkeypatch.setattr(m, "labels", forbidden)
    for lens, ctx in (([2048], 8192), ([1] * 8, 8192), ([300] * 4, 1024)):
        shape = BatchShape.from_query_lens(lens, max_seq_len=ctx, num_heads=16)
        rec.record(decide(shape, t), shape, 1, 1)
    monkeypatch.undo()
    total = sum(
        _value("flyserve_dispatch_decisions_total", path=p, reason=r, rank="46")
        for p in PATHS
        for r in REASONS
    )
    assert total == 3
