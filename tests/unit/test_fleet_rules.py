"""config/fleet_rules.yml and the canary-vs-stable queries of flyserve.fleet.queries, checked by promtool.

The rules file is generated (``flyserve fleet rules``): the committed file must be that text. Its
unit tests (config/fleet_rules_test.yml) must pass and must bite (a rule with its guard removed or
its window changed fails them). The analysis queries are run by promtool over the same synthetic
fleet, each replica in turn as the canary: the planted bad replica fails, the good ones pass, and
replicas that stopped reporting give no data. tests/integration/test_fleet_prometheus_live.py does
the same against a real Prometheus scraping simulated sidecars.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flyserve.fleet import promql, queries, rules
from flyserve.telemetry import metrics as tm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (scripts/setup.sh does)")
    return path


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), *args], check=False, capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_the_rules_file_is_what_flyserve_fleet_rules_prints():
    assert (CONFIG / "fleet_rules.yml").read_text() == rules.render(), (
        "config/fleet_rules.yml is stale: run `flyserve fleet rules > config/fleet_rules.yml`"
    )


def test_the_rules_the_issue_names_and_their_expressions():
    doc = yaml.safe_load((CONFIG / "fleet_rules.yml").read_text())
    (group,) = doc["groups"]
    recorded = {r["record"]: " ".join(r["expr"].split()) for r in group["rules"]}
    for name in (
        "flyserve:fleet_kernel_us_per_token:rate5m",
        "flyserve:fleet_regret:avg5m",
        "flyserve:fleet_fallback_ratio:rate5m",
        "flyserve:fleet_late_applies:rate5m",
        "flyserve:fleet_mixed_versions",
        "flyserve:fleet_version_replicas:count",
        "flyserve:fleet_version_kernel_us_per_token:avg5m",
    ):
        assert name in recorded
    assert list(recorded) == [r.record for r in rules.RULES]
    for r in rules.RULES:
        assert recorded[r.record] == " ".join(r.expr.split())
    # Every metric a rule reads exists, and no rule adds a label but `fingerprint`.
    known = set(tm.METRIC_NAMES) | {f"{tm.exposed_name(tm.KERNEL_SECONDS)}_{s}" for s in ("sum", "count")}
    for expr in recorded.values():
        for word in re.findall(r"\bflyserve_[a-z_]+", expr):
            assert word in known, (word, expr)
        assert "by (instance" not in expr  # target labels kept whole (pod, rollout hash, ...)


@pytest.mark.slow  # runs promtool
def test_promtool_check_rules():
    r = _run("check", "rules", "config/fleet_rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules.RULES)} rules found" in r.stdout


@pytest.mark.slow  # runs promtool
def test_promtool_unit_tests_of_the_fleet_rules_pass():
    r = _run("test", "rules", "config/fleet_rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def _stage(tmp_path: Path, text: str | None = None) -> Path:
    (tmp_path / "fleet_rules.yml").write_text(text if text is not None else rules.render())
    shutil.copy(CONFIG / "fleet_rules_test.yml", tmp_path / "fleet_rules_test.yml")
    return tmp_path


MUTANTS = [
    # the live guard of the replica kernel rule: the stopped replica c would keep its number
    (
        rules.KERNEL_US_PER_TOKEN,
        "\n          and (min without (rank) (flyserve_rank_up) == 1)\n      # Routing regret",
        "\n      # Routing regret",
    ),
    # per path instead of over every path: d would look as good as a on prefill
    (rules.KERNEL_US_PER_TOKEN, "1e6 * sum without (path) ((", "1e6 * max without (path) (("),
    # a tie for most common flags a side
    (rules.MIXED_VERSIONS, "< bool on ()", "<= bool on ()"),
    # NaN fingerprints (no live rank) counted as a content
    (rules.FINGERPRINT_INFO, "flyserve_thresholds_fingerprint >= -1)", "flyserve_thresholds_fingerprint)"),
]


@pytest.mark.slow  # runs promtool
@pytest.mark.parametrize(
    ("record", "old", "new"), MUTANTS, ids=[f"{m[0]}:{i}" for i, m in enumerate(MUTANTS)]
)
def test_the_unit_tests_notice_a_changed_rule(tmp_path: Path, record: str, old: str, new: str):
    text = rules.render()
    assert text.count(old) == 1, f"mutant anchor {old!r} not unique"
    r = _run("test", "rules", "fleet_rules_test.yml", cwd=_stage(tmp_path, text.replace(old, new)))
    assert r.returncode != 0, r.stdout
    assert record in r.stdout + r.stderr


# --------------------------------------------------------------------------- the analysis queries


@pytest.mark.slow  # runs promtool
def test_the_queries_parse_for_every_engine(tmp_path: Path):
    """Each engine's rendering is valid PromQL (promtool parses it as a recording rule)."""
    doc = {
        "groups": [
            {
                "name": f"analysis-{engine}",
                "rules": [
                    {"record": f"analysis:{q.name.replace('-', '_')}", "expr": queries.render(q, engine)}
                    for q in queries.QUERIES
                ],
            }
            for engine in queries.ENGINES
        ]
    }
    (tmp_path / "analysis.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = _run("check", "rules", str(tmp_path / "analysis.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_query_reads_the_recording_rules_and_both_sides():
    recorded = {r.record for r in rules.RULES}
    for q in queries.QUERIES:
        assert queries.CANARY in q.template
        names = {
            w for w in q.template.replace("(", " ").replace("{", " ").split() if w.startswith("flyserve")
        }
        assert names <= recorded, (q.name, names - recorded)
        rendered = queries.render(q, "argo")
        assert "$" not in rendered
    two_sided = [q for q in queries.QUERIES if queries.STABLE in q.template]
    assert {q.name for q in two_sided} == {"kernel-time-per-token", "regret"}


def _verdict_expr(q: queries.AnalysisQuery, canary: str, stable: str) -> str:
    """1 pass, 0 fail, empty: no data (what promtool can compare exactly)."""
    sides = q.render(f'instance="{canary}"', f'instance=~"{stable}"')
    return f"({sides}) <= bool {q.pass_max!r}"


@pytest.mark.slow  # runs promtool
@pytest.mark.parametrize(
    ("canary", "stable", "expected"),
    [
        # a good replica against the other good one: every query passes
        ("a", "b", {"kernel-time-per-token": 1, "regret": 1, "late-applies": 1, "canary-contents": 1}),
        # the planted bad one: twice the kernel time per token, regret 0.5, late applies
        ("d", "a|b", {"kernel-time-per-token": 0, "regret": 0, "late-applies": 0, "canary-contents": 1}),
        # stopped reporting at minute 6 / one rank stale / its ranks disagree: no data, never a pass
        (
            "c",
            "a|b",
            {"kernel-time-per-token": None, "regret": None, "late-applies": None, "canary-contents": None},
        ),
        (
            "e",
            "a|b",
            {"kernel-time-per-token": None, "regret": None, "late-applies": None, "canary-contents": None},
        ),
        (
            "f",
            "a|b",
            {"kernel-time-per-token": None, "regret": None, "late-applies": None, "canary-contents": 0},
        ),
        # a stable side with no data (c stopped): no data either
        ("a", "c", {"kernel-time-per-token": None, "regret": None, "late-applies": 1, "canary-contents": 1}),
    ],
)
def test_the_queries_judge_the_synthetic_fleet(tmp_path: Path, canary: str, stable: str, expected: dict):
    base = yaml.safe_load((CONFIG / "fleet_rules_test.yml").read_text())
    case = base["tests"][0]
    tests = []
    for q in queries.QUERIES:
        want = expected[q.name]
        tests.append(
            {
                "expr": _verdict_expr(q, canary, stable),
                "eval_time": "10m",
                "exp_samples": [] if want is None else [{"labels": "{}", "value": want}],
            }
        )
    doc = {
        "rule_files": ["fleet_rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": case["interval"], "input_series": case["input_series"], "promql_expr_test": tests}
        ],
    }
    (tmp_path / "fleet_rules.yml").write_text(rules.render())
    (tmp_path / "analysis_test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = _run("test", "rules", "analysis_test.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_judge_reads_no_data_as_no_pass():
    q = queries.BY_NAME["kernel-time-per-token"]
    assert queries.judge(q, []) == "no data"
    assert queries.judge(q, [float("nan")]) == "fail"
    assert queries.judge(q, [1.05]) == "pass"
    assert queries.judge(q, [1.2]) == "fail"


def test_promql_builders_take_extra_matchers():
    e = promql.kernel_us_per_token("30s", 'namespace="prod"')
    assert "[30s]" in e and "[5m]" not in e
    assert e.count("flyserve_") == e.count('{namespace="prod"}')  # every selector carries them
