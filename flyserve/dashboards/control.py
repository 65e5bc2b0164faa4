"""The Control plane dashboard (flyserve-control.json): reloads, the version every rank runs,
circuit breakers, rank liveness, the sidecar's own latency and the autopilot's trials."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import prometheus as prom_m

from flyserve.dashboards.panels import (
    DATASOURCE,
    _annotation_circuit_change,
    _annotation_thresholds_change,
    _dashboard,
    _stat,
    _state_timeline,
    _target,
    _timeseries,
    _variables,
)
from flyserve.dashboards.queries import (
    AUTOPILOT_ARM,
    AUTOPILOT_EXPLORATION_COST,
    AUTOPILOT_MODE,
    AUTOPILOT_TRIALS,
    CIRCUIT_OPEN,
    CONFIG_LAST_SUCCESS,
    CONFIG_RELOADS,
    ENGINE_STEP,
    INSTANCE_SEL,
    RANGE,
    RANK_REPORT_AGE,
    RANK_SEL,
    RANK_UP,
    RATE,
    SIDECAR_COMPACTED_FILES,
    SIDECAR_DROPPED_CONNECTIONS,
    SIDECAR_IGNORED_FILES,
    SIDECAR_METRICS_FILES,
    SIDECAR_REQUEST_SECONDS_BUCKET,
    SIDECAR_REQUESTS,
    SIDECAR_SHED_REQUESTS,
    SIDECAR_STREAM_RECLAIMS,
    THRESHOLDS_VERSION,
    VERSION_BY_RANK,
)


def control_plane() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-control",
        "flyserve / Control plane",
        "Thresholds reloads, the version every rank runs, circuit breakers, rank liveness, "
        "the sidecar's own latency and the autopilot's trials.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change()).annotation(_annotation_circuit_change())
    d = _control_reloads_row(d)
    d = _control_ranks_row(d)
    d = _control_sidecar_row(d)
    return _control_autopilot_row(d)


def _control_reloads_row(d: dash.Dashboard) -> dash.Dashboard:
    """Reload results and the age of the last good one: did a change land, or fail?"""
    d = d.with_row(dash.Row("Reloads"))
    d = d.with_panel(
        _timeseries(
            "Reload results",
            "Thresholds changes and reloads per rate window, by result (success, invalid, io_error) and "
            "source (file, api, cli, rollback). invalid = the new thresholds failed validation and changed "
            "nothing (the reason is in the sidecar log and /dispatch-stats); io_error = the state "
            "directory could not be written.",
            [
                _target(
                    f"sum by (result, source) (increase({CONFIG_RELOADS}{{{INSTANCE_SEL}}}[{RATE}]))",
                    "{{result}} ({{source}})",
                )
            ],
            unit="short",
            bars=True,
            stacked=True,
            w=16,
            legend_calcs=["sum"],
        )
    )
    d = d.with_panel(
        _stat(
            "Since last successful reload",
            "Time since the control plane last published a valid thresholds snapshot. Old is fine; it only "
            "matters next to failed reloads (left): then the running thresholds are older than intended.",
            _target(
                f"time() - max({CONFIG_LAST_SUCCESS}{{{INSTANCE_SEL}}})",
                "age",
                instant=True,
            ),
            unit="s",
            w=8,
            h=8,
        )
    )
    return d


def _control_ranks_row(d: dash.Dashboard) -> dash.Dashboard:
    """What each rank runs: version, circuit, liveness, report age, and the table of all of it now."""
    d = d.with_row(dash.Row("Ranks"))
    d = d.with_panel(
        _timeseries(
            "Config version per rank",
            "Thresholds version applied by each rank. All lines step together (same engine step) on a "
            "change; a lagging line is a rank that did not pick the change up.",
            [_target(VERSION_BY_RANK, "rank {{rank}}")],
            unit="none",
            legend_calcs=["lastNotNull"],
        )
    )
    per_rank_states: tuple[
        tuple[str, str, str, dict[str, tuple[str, str]], list[tuple[float | None, str]]], ...
    ] = (
        (
            "Circuit breaker per rank",
            (
                "Each rank's prefill circuit breaker: closed (green) or open (red). Open means the "
                "prefill kernel raised (or an operator opened it) and every batch takes the "
                "unified kernel until it is closed: correct results, slower prefills."
            ),
            f"max by (rank) ({CIRCUIT_OPEN}{{{RANK_SEL}}})",
            {"0": ("closed", "green"), "1": ("open", "red")},
            [(None, "green"), (1, "red")],
        ),
        (
            "Rank liveness",
            (
                "Whether the sidecar sees each rank as live (green, its status file is fresh) or stale "
                "(red, no report within the sidecar's --stale-after). A stale rank is hung, dead or "
                "cannot write the state directory, and cannot apply thresholds changes."
            ),
            f"min by (rank) ({RANK_UP}{{{RANK_SEL}}})",
            {"0": ("stale", "red"), "1": ("live", "green")},
            [(None, "red"), (1, "green")],
        ),
    )
    for title, description, expr, mapping, steps in per_rank_states:
        d = d.with_panel(_state_timeline(title, description, expr, mapping, steps))
    d = d.with_panel(
        _timeseries(
            "Rank report age",
            "Seconds since each rank last wrote its status file (about once a second while alive). "
            "A line climbing past the sidecar's --stale-after turns the rank stale (left); a saw-tooth "
            "below a second or two is healthy.",
            [
                _target(
                    f"max by (rank) ({RANK_REPORT_AGE}{{{RANK_SEL}}})",
                    "rank {{rank}}",
                )
            ],
            unit="s",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Files the sidecar skipped",
            "Files in the state directory the sidecar did not use: metrics (corrupt or foreign metric "
            "files, since the sidecar started) and rank_reports (odd, unreadable or implausible files "
            "in ranks/ at its last look). Above 0: something writes there what flyserve did not; the "
            "sidecar's log names each metrics file once (operations.md, Failure modes).",
            [_target(f"max by (kind) ({SIDECAR_IGNORED_FILES}{{{INSTANCE_SEL}}})", "{{kind}}")],
            unit="none",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Sidecar connections dropped and requests shed",
            "Connections the sidecar closed before answering, per second, by reason (head_timeout, "
            "request_timeout, evicted at --max-connections, refused), and requests shed with 503 over "
            "the cap. A steady rate is a slow or half-open client flood; /healthz, /readyz and changes "
            "with the token keep being answered through it (operations.md, Failure modes). Also SSE "
            "streams reclaimed from clients that do not read them (stalled, backlog) or past their "
            "--stream-lease at the cap (lease), and new streams refused at --max-streams with none "
            "stalled or past its lease (full).",
            [
                _target(
                    f"sum by (reason) (rate({SIDECAR_DROPPED_CONNECTIONS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "dropped: {{reason}}",
                ),
                _target(
                    f"sum(rate({SIDECAR_SHED_REQUESTS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "shed (503)",
                ),
                _target(
                    f"sum by (reason) (rate({SIDECAR_STREAM_RECLAIMS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "stream reclaimed: {{reason}}",
                    "C",
                ),
            ],
            unit="reqps",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Metric files and compaction",
            "Metric files (*.db) in <state>/metrics after the sidecar's last compaction (about 4 per live "
            "rank plus one archive per kind), and dead processes' files it merged or dropped per minute. "
            "Files growing with rank restarts while nothing is merged: compaction is off "
            "(--compact-interval 0) or refused (operations.md, Failure modes).",
            [
                _target(f"max({SIDECAR_METRICS_FILES}{{{INSTANCE_SEL}}})", "files", "A"),
                _target(
                    f"sum by (action) (rate({SIDECAR_COMPACTED_FILES}{{{INSTANCE_SEL}}}[{RATE}])) * 60",
                    "{{action}} per min",
                    "B",
                ),
            ],
            unit="none",
            min_val=0,
        )
    )
    return d.with_panel(_ranks_now_table())


def _ranks_now_table() -> table.Panel:
    """One row per rank, four instant queries merged on the rank label."""
    return (
        table.Panel()
        .title("Ranks now")
        .description(
            "One row per rank: thresholds version, circuit state, liveness and engine step, "
            "right now. A row that differs from the others is the rank to look at."
        )
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .with_target(
            _target(
                f"max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})",
                "",
                "version",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"max by (rank) ({CIRCUIT_OPEN}{{{RANK_SEL}}})",
                "",
                "circuit",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"min by (rank) ({RANK_UP}{{{RANK_SEL}}})",
                "",
                "up",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"max by (rank) ({ENGINE_STEP}{{{RANK_SEL}}})",
                "",
                "step",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_transformation(dash_m.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dash_m.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        "Value #version": "thresholds version",
                        "Value #circuit": "circuit open",
                        "Value #up": "up",
                        "Value #step": "engine step",
                    },
                },
            )
        )
    )


def _control_sidecar_row(d: dash.Dashboard) -> dash.Dashboard:
    """The sidecar's own latency and answers (it is never in vllm serve's request path)."""
    d = d.with_row(dash.Row("Sidecar"))
    d = d.with_panel(
        _timeseries(
            "Sidecar request latency",
            "p50 and p99 latency of the sidecar's HTTP routes (/metrics, /dispatch-stats, /thresholds). "
            "The sidecar runs beside vllm serve, never in its request path: slow here means a slow scrape "
            "or a slow state directory, not slow inference.",
            [
                _target(
                    f"histogram_quantile(0.5, sum by (le, route) (rate({SIDECAR_REQUEST_SECONDS_BUCKET}"
                    f"{{{INSTANCE_SEL}}}[{RATE}])))",
                    "{{route}} p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.99, sum by (le, route) (rate({SIDECAR_REQUEST_SECONDS_BUCKET}"
                    f"{{{INSTANCE_SEL}}}[{RATE}])))",
                    "{{route}} p99",
                    "B",
                ),
            ],
            unit="s",
            legend_calcs=["mean", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Sidecar requests by route and code",
            "Requests per second the sidecar answered, by route, method and status code. 401/403 on "
            "/thresholds are rejected tokens; 409 a stale If-Match; 422 invalid thresholds (nothing "
            "changed); 503 an unwritable state directory.",
            [
                _target(
                    f"sum by (route, method, code) (rate({SIDECAR_REQUESTS}{{{INSTANCE_SEL}}}[{RATE}]))",
                    "{{method}} {{route}} {{code}}",
                )
            ],
            unit="reqps",
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    return d


def _control_autopilot_row(d: dash.Dashboard) -> dash.Dashboard:
    """The autopilot (docs/autopilot.md): how its trials end, which arm runs now, what exploring cost,
    and the mode in force. Last on the dashboard, so the panels above keep their ids."""
    d = d.with_row(dash.Row("Autopilot"))
    d = d.with_panel(
        _timeseries(
            "Autopilot trials by outcome",
            "Trials ended per rate window, by outcome: promoted (the candidate is now the thresholds), "
            "rolled_back (measured worse or no better, or a guardrail), aborted (pause, a mode change, an "
            "operator change), inconclusive (the budget ran out), killed (the kill switch), expired (an "
            "awaited approval timed out). Rollbacks in a row: the alert FlyserveAutopilotRepeatedRollbacks; "
            "`flyserve autopilot history` says what each trial moved and why it ended.",
            [
                _target(
                    f"sum by (outcome) (increase({AUTOPILOT_TRIALS}{{{INSTANCE_SEL}}}[{RATE}]))",
                    "{{outcome}}",
                )
            ],
            unit="short",
            bars=True,
            stacked=True,
            legend_calcs=["sum"],
        )
    )
    d = d.with_panel(
        _state_timeline(
            "Autopilot arm",
            "The arm each sidecar's ranks run now, as the autopilot planned it: none (no trial), current "
            "(the thresholds in force) or candidate (the trial's). A trial alternates the two block by "
            "block (a switchback), so the band flickers while one runs; none again once it is decided.",
            f"max by (instance) ({AUTOPILOT_ARM}{{{INSTANCE_SEL}}})",
            {"-1": ("none", "transparent"), "0": ("current", "blue"), "1": ("candidate", "orange")},
            [(None, "transparent"), (0, "blue"), (1, "orange")],
            legend="{{instance}}",
        )
    )
    d = d.with_panel(
        _state_timeline(
            "Autopilot mode",
            "The autopilot's mode in force on each sidecar: off (nothing), advise (proposals only), trial "
            "(trials, promotions wait for an approval) or auto (trials and promotions by itself). One line "
            "per mode, coloured while it is in force.",
            f"max by (instance, mode) ({AUTOPILOT_MODE}{{{INSTANCE_SEL}}})",
            {"0": ("", "transparent"), "1": ("in force", "green")},
            [(None, "transparent"), (1, "green")],
            legend="{{instance}} {{mode}}",
        )
    )
    return d.with_panel(
        _stat(
            "Autopilot exploration cost",
            "Kernel seconds the trials spent on the slower arm over the dashboard's time range, as "
            "measured block pair by block pair: the price of finding out. Compare it with what a promotion "
            "saves (regret on the Dispatch overview); a cost that grows with no promotion is trials that "
            "lead nowhere: pause the autopilot (`flyserve autopilot pause`).",
            _target(
                f"sum(increase({AUTOPILOT_EXPLORATION_COST}{{{INSTANCE_SEL}}}[{RANGE}]))",
                "exploration cost",
                instant=True,
            ),
            unit="s",
            w=12,
            h=8,
        )
    )


# --------------------------------------------------------------------------- the fleet
