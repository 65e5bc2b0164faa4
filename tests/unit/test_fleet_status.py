"""`flyserve fleet status` against a scripted Prometheus (httpx.MockTransport): who disagrees, health,
and what it does with answers that are not Prometheus'. The real Prometheus: test_fleet_prometheus_live."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from typer.testing import CliRunner

from flyserve.fleet import promql as q
from flyserve.fleet.status import MAX_ANSWER_BYTES, FleetError, Prometheus, content_text, fleet_status

GOOD = float(0x0123456789ABC)
BAD = float(0x0FEDCBA987654)


def _vec(*samples: tuple[dict, float]) -> dict:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": m, "value": [1.0, repr(v)]} for m, v in samples],
        },
    }


def _fleet(window: str = "5m", m: str = "", seen: str = "15m") -> dict[str, dict]:
    """Four replicas: r0-r2 good (one at another version number, same content), r3 on another
    content and twice as slow per token, r4 whose scrape now fails."""
    names = ["r0", "r1", "r2", "r3", "r4"]
    t = {n: {"job": "flyserve", "instance": f"{n}:9400"} for n in names}
    live = names[:4]
    fp = {"r0": GOOD, "r1": GOOD, "r2": GOOD, "r3": BAD}
    kernel = {"r0": 1.0, "r1": 1.02, "r2": 0.98, "r3": 2.0}
    return {
        q.seen(seen, m): _vec(*((t[n], 1.0) for n in names)),
        q.scrape_up(seen, m): _vec(*(({**t[n], "__name__": "up"}, 0.0 if n == "r4" else 1.0) for n in names)),
        q.ranks(m): _vec(
            *(s for n in live for s in (({**t[n], "state": "all"}, 2.0), ({**t[n], "state": "live"}, 2.0)))
        ),
        q.ranks_agree(m): _vec(*(({**t[n], "__name__": "flyserve_ranks_agree"}, 1.0) for n in live)),
        q.thresholds_version(m): _vec(*((t[n], 3.0 if n == "r1" else 2.0) for n in live)),
        q.fingerprint_value(m): _vec(
            *(({**t[n], "__name__": "flyserve_thresholds_fingerprint"}, fp[n]) for n in live)
        ),
        q.kernel_us_per_token(window, m): _vec(*((t[n], kernel[n]) for n in live)),
        q.kernel_us_per_token_by_path(window, m): _vec(
            *(({**t[n], "path": "prefill"}, kernel[n]) for n in live)
        ),
        q.regret(window, m): _vec(*((t[n], 0.3 if n == "r3" else 0.0) for n in live)),
        q.fallback_ratio(window, m): _vec(*((t[n], 0.5 if n == "r3" else 0.0) for n in live)),
        q.late_applies(window, m): _vec(*((t[n], 0.0) for n in live)),
    }


def _prom(answers: dict[str, dict] | None = None, raw: bytes | None = None, status: int = 200) -> Prometheus:
    answers = _fleet() if answers is None else answers

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        if raw is not None:
            return httpx.Response(status, content=raw)
        expr = request.url.params["query"]
        return httpx.Response(200, json=answers.get(expr, _vec()))

    return Prometheus("http://prom.test:9090", timeout_s=5, transport=httpx.MockTransport(handler))


def test_the_planted_replica_and_the_failing_scrape_are_named():
    st = fleet_status(_prom())
    by = {r.name: r for r in st.replicas}
    assert list(by) == ["r0:9400", "r1:9400", "r2:9400", "r3:9400", "r4:9400"]
    assert st.majority_content == content_text(GOOD) == "0123456789abc"
    assert st.median_kernel_us_per_token == pytest.approx(1.01)
    assert [r.name for r in st.disagreeing] == ["r3:9400"]
    (why_content, why_kernel) = by["r3:9400"].disagrees
    assert why_content == "content: 0fedcba987654, the fleet's most common is 0123456789abc"
    assert why_kernel == "kernel: 1.98x the median time per token (margin 10%)"
    # r1 is at version 3 with the fleet's content: a version number is no disagreement
    assert by["r1:9400"].version == 3 and not by["r1:9400"].disagrees
    assert by["r4:9400"].health == "scrape failing" and by["r4:9400"].kernel_us_per_token is None
    assert [r.health for r in st.replicas[:4]] == ["ok"] * 4


def test_a_tie_has_no_most_common_content_and_a_margin_decides_the_kernel_check():
    answers = _fleet()
    fp = q.fingerprint_value()
    answers[fp]["data"]["result"][1]["value"][1] = repr(BAD)  # r0, r2 good; r1, r3 bad: a tie
    st = fleet_status(_prom(answers), margin=1.5)
    assert st.majority_content is None
    assert st.disagreeing == []  # no majority, and 2.0 is under 2.5x the median


def test_the_cli_prints_a_table_and_exits_1_when_a_replica_disagrees(monkeypatch):
    from flyserve.cli import app
    from flyserve.fleet import status as status_mod

    answers = _fleet()
    evil = "\x1b]52;c;ZXZpbA==\x07[red]x[/red]"
    for v in answers.values():
        for item in v["data"]["result"]:
            if item["metric"].get("instance") == "r3:9400":
                item["metric"]["instance"] = evil
    monkeypatch.setattr(status_mod, "Prometheus", lambda url, timeout_s: _prom(answers))
    r = CliRunner().invoke(
        app, ["fleet", "status", "--prometheus", "http://prom.test:9090"], terminal_width=250
    )
    assert r.exit_code == 1, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output  # escaped, visible, never obeyed
    flat = "".join(r.output.split())  # the table folds long cells
    assert "\\x1b]52;c;" in flat and "[red]x[/red]" in flat  # shown as text, not obeyed or styled
    assert "r4:9400:scrapefailing" in flat and "1.98xthemediantimepertoken" in flat
    r = CliRunner().invoke(app, ["fleet", "status", "--prometheus", "http://prom.test:9090", "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert "\x1b" not in r.output  # ensure_ascii
    contents = {x["labels"]["instance"]: x["content"] for x in doc["replicas"]}
    assert contents["r0:9400"] == contents["r1:9400"] == "0123456789abc" and contents[evil] == "0fedcba987654"
    assert doc["majority_content"] == "0123456789abc"


def test_a_healthy_agreeing_fleet_exits_0(monkeypatch):
    from flyserve.cli import app
    from flyserve.fleet import status as status_mod

    answers = {k: v for k, v in _fleet().items()}
    for v in answers.values():
        v["data"]["result"] = [
            i for i in v["data"]["result"] if i["metric"]["instance"] in ("r0:9400", "r1:9400")
        ]
    monkeypatch.setattr(status_mod, "Prometheus", lambda url, timeout_s: _prom(answers))
    r = CliRunner().invoke(app, ["fleet", "status", "--prometheus", "http://prom.test:9090"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"<html>hello</html>", 200, "not JSON"),
        (json.dumps({"status": "error", "error": "parse error \x1b[2J"}).encode(), 200, "refused the query"),
        (
            json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}).encode(),
            200,
            "instant vector",
        ),
        (
            json.dumps(
                {
                    "status": "success",
                    "data": {"resultType": "vector", "result": [{"metric": {"a": 1}, "value": [1, "2"]}]},
                }
            ).encode(),
            200,
            "not a Prometheus sample",
        ),
        (
            json.dumps({"status": "error", "error": "bad_data: 1:2 unexpected"}).encode(),
            400,
            "HTTP 400: bad_data",
        ),
        (b" " * (MAX_ANSWER_BYTES + 1), 200, "larger than 8 MiB"),
    ],
)
def test_answers_that_are_not_prometheus_are_clear_errors(raw: bytes, status: int, message: str):
    with pytest.raises(FleetError, match=message):
        fleet_status(_prom(raw=raw, status=status))


@pytest.mark.slow  # connects to 127.0.0.1:1 (nothing listens)
def test_bad_options_and_an_unreachable_prometheus_exit_2(tmp_path):
    from flyserve.cli import app

    r = CliRunner().invoke(app, ["fleet", "status", "--prometheus", "http://127.0.0.1:1", "--timeout", "2"])
    assert r.exit_code == 2 and "cannot reach Prometheus at http://127.0.0.1:1/api/v1/query" in r.output
    r = CliRunner().invoke(app, ["fleet", "status", "--prometheus", "file:///etc/passwd"])
    assert r.exit_code == 2 and "http(s) URL" in r.output
    with pytest.raises(FleetError, match="--window"):
        fleet_status(_prom(), window="5m]) or vector(1")
    with pytest.raises(FleetError, match="without braces"):
        fleet_status(_prom(), matchers='job="x"} or vector(1) or up{')


def test_content_text():
    assert content_text(None) == "-" and content_text(math.nan) == "-" and content_text(-1) == "mixed"
    assert (
        content_text(2.0**52) == "invalid"
        and content_text(0.5) == "invalid"
        and content_text(255) == "00000000000ff"
    )


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_the_queries_command_prints_each_engine():
    from flyserve.cli import app

    r = CliRunner().invoke(app, ["fleet", "queries", "--engine", "flagger"])
    assert r.exit_code == 0 and "{{ target }}-primary-" in r.output and "$CANARY" not in r.output
    r = CliRunner().invoke(app, ["fleet", "queries", "--engine", "spinnaker"])
    assert r.exit_code == 2 and "argo, flagger" in r.output
    r = CliRunner().invoke(app, ["fleet", "rules"])
    assert r.exit_code == 0 and r.output.startswith("# flyserve fleet recording rules")


def test_an_idle_fleet_with_a_zero_median_is_no_division_by_zero():
    answers = _fleet()
    kernel = answers[q.kernel_us_per_token("5m", "")]["data"]["result"]
    for i, v in enumerate((0.0, 0.0, 0.0, 2.0)):
        kernel[i]["value"][1] = repr(v)
    st = fleet_status(_prom(answers))
    assert st.median_kernel_us_per_token == 0.0
    assert all(not w.startswith("kernel") for r in st.replicas for w in r.disagrees)


@pytest.mark.parametrize("flag", ["--margin", "--timeout"])
def test_a_nan_option_is_refused_by_name(flag):
    from flyserve.cli import app

    r = CliRunner().invoke(app, ["fleet", "status", "--prometheus", "http://127.0.0.1:1", flag, "nan"])
    # refused by click's range check or, where a click lets NaN through it, by the command itself
    assert r.exit_code == 2 and flag in r.output and "cannot reach" not in r.output, r.output
