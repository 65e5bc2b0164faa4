"""docs/metrics.md: every metric documented, every PromQL example valid and about real metrics."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from flyserve.telemetry import metrics
from flyserve.telemetry.prom import label_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PROMTOOL = "/usr/bin/promtool"
_SUFFIXES = ("_bucket", "_sum", "_count")


def _queries() -> list[str]:
    return [q.strip() for q in re.findall(r"```promql\n(.*?)```", DOC.read_text(), re.DOTALL)]


def test_every_metric_is_documented_with_its_labels() -> None:
    text = DOC.read_text()
    for m in metrics.ALL_METRICS:
        name = metrics.exposed_name(m)
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} has no row in docs/metrics.md"
        for label in label_names(m):
            assert label in row, (name, label)


def test_every_section_the_metrics_module_cites_exists() -> None:
    """A citation ``docs/<file>.md, "<section>"`` names a heading of that file (AUTOPILOT_OUTCOMES
    cited docs/autopilot.md, "Metrics", a section it never had)."""
    docs = DOC.parent
    cited = re.findall(r'docs/([\w-]+\.md), "([^"]+)"', Path(metrics.__file__).read_text())
    assert cited
    for name, section in cited:
        headings = re.findall(r"^#+ (.+?)\s*$", (docs / name).read_text(), re.MULTILINE)
        assert section in headings, f"docs/{name} has no section {section!r}"


def test_promql_examples_use_known_metrics() -> None:
    queries = _queries()
    assert len(queries) >= 10
    known = set(metrics.METRIC_NAMES)
    for q in queries:
        for name in set(re.findall(r"\bflyserve_[a-z_]+", q)):
            base = next(
                (name[: -len(s)] for s in _SUFFIXES if name.endswith(s) and name[: -len(s)] in known), name
            )
            assert base in known, (name, q)
            if name != base:
                assert metrics.METRIC_TYPES[base] == "histogram", (name, q)


@pytest.mark.slow  # runs promtool
def test_promql_examples_parse(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "docs",
                "rules": [{"record": f"docs:example_{i}", "expr": q} for i, q in enumerate(_queries())],
            }
        ]
    }
    f = tmp_path / "rules.yml"
    f.write_text(yaml.safe_dump(rules))
    res = subprocess.run(
        [PROMTOOL, "check", "rules", str(f)], check=False, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
