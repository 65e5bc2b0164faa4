"""The PromQL the dashboards share: metric names as a scrape shows them, the selectors, the rate
window and the expressions more than one panel asks (ratios, kernel time, regret)."""

from __future__ import annotations

from flyserve.telemetry import metrics as tm

# Metric names as a scrape shows them, from the definitions (flyserve.telemetry.metrics): a renamed
# metric changes every query here, and test_dashboards_promql checks each name is exposed.
DECISIONS = tm.exposed_name(tm.DISPATCH_DECISIONS)
TOKENS = tm.exposed_name(tm.DISPATCH_TOKENS)
ROWS = tm.exposed_name(tm.DISPATCH_ROWS)
LPT = tm.exposed_name(tm.DISPATCH_LPT)
QUERY_TOKENS = tm.exposed_name(tm.DISPATCH_QUERY_TOKENS)
MAX_SEQ_LEN = tm.exposed_name(tm.DISPATCH_MAX_SEQ_LEN)
KERNEL_SECONDS = tm.exposed_name(tm.KERNEL_SECONDS)
KERNEL_TIMER_DROPPED = tm.exposed_name(tm.KERNEL_TIMER_DROPPED)
ENGINE_STEP = tm.exposed_name(tm.ENGINE_STEP)
THRESHOLDS_VERSION = tm.exposed_name(tm.THRESHOLDS_VERSION)
CIRCUIT_OPEN = tm.exposed_name(tm.CIRCUIT_OPEN)
LATE_APPLIES = tm.exposed_name(tm.LATE_APPLIES)
COST_DRIFT = tm.exposed_name(tm.COST_DRIFT)
CONFIG_RELOADS = tm.exposed_name(tm.CONFIG_RELOADS)
CONFIG_LAST_SUCCESS = tm.exposed_name(tm.CONFIG_LAST_SUCCESS)
SIDECAR_REQUESTS = tm.exposed_name(tm.SIDECAR_REQUESTS)
SIDECAR_REQUEST_SECONDS = tm.exposed_name(tm.SIDECAR_REQUEST_SECONDS)
RANK_UP = tm.exposed_name(tm.RANK_UP)
RANK_REPORT_AGE = tm.exposed_name(tm.RANK_REPORT_AGE)
RANKS_AGREE = tm.exposed_name(tm.RANKS_AGREE)
SIDECAR_IGNORED_FILES = tm.exposed_name(tm.SIDECAR_IGNORED_FILES)
SIDECAR_DROPPED_CONNECTIONS = tm.exposed_name(tm.SIDECAR_DROPPED_CONNECTIONS)
SIDECAR_SHED_REQUESTS = tm.exposed_name(tm.SIDECAR_SHED_REQUESTS)
SIDECAR_STREAM_RECLAIMS = tm.exposed_name(tm.SIDECAR_STREAM_RECLAIMS)
SIDECAR_COMPACTED_FILES = tm.exposed_name(tm.SIDECAR_COMPACTED_FILES)
SIDECAR_METRICS_FILES = tm.exposed_name(tm.SIDECAR_METRICS_FILES)
AUTOPILOT_TRIALS = tm.exposed_name(tm.AUTOPILOT_TRIALS)
AUTOPILOT_ARM = tm.exposed_name(tm.AUTOPILOT_ARM)
AUTOPILOT_EXPLORATION_COST = tm.exposed_name(tm.AUTOPILOT_EXPLORATION_COST)
AUTOPILOT_MODE = tm.exposed_name(tm.AUTOPILOT_MODE)
KERNEL_SECONDS_BUCKET = KERNEL_SECONDS + "_bucket"
KERNEL_SECONDS_COUNT = KERNEL_SECONDS + "_count"
KERNEL_SECONDS_SUM = KERNEL_SECONDS + "_sum"
MAX_SEQ_LEN_BUCKET = MAX_SEQ_LEN + "_bucket"
QUERY_TOKENS_BUCKET = QUERY_TOKENS + "_bucket"
SIDECAR_REQUEST_SECONDS_BUCKET = SIDECAR_REQUEST_SECONDS + "_bucket"

RATE = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals, so rate() always sees two samples."""
RANGE = "$__range"
"""The dashboard's whole time range: what a stat that counts "over the range" increases over."""

RANK_SEL = 'instance=~"$instance", rank=~"$rank"'
INSTANCE_SEL = 'instance=~"$instance"'


def _rate(metric: str, sel: str, by: str = "", extra: str = "") -> str:
    matchers = sel if not extra else f"{extra}, {sel}"
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}{{{matchers}}}[{RATE}]))"


PREFILL_RATIO_DECISIONS = (
    _rate(DECISIONS, RANK_SEL, extra='path="prefill"') + " / " + _rate(DECISIONS, RANK_SEL)
)
PREFILL_RATIO_ELIGIBLE = (
    _rate(DECISIONS, RANK_SEL, extra='reason="admitted"')
    + " / "
    + _rate(DECISIONS, RANK_SEL, extra='reason!="no_prefill_rows"')
)
"""Among batches that have prefill rows, the share the prefill specialist ran: what thresholds control."""
PREFILL_RATIO_TOKENS = _rate(TOKENS, RANK_SEL, extra='path="prefill"') + " / " + _rate(TOKENS, RANK_SEL)
VERSION_BY_RANK = f"max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})"
"""The thresholds version each rank applied: the Dispatch and Control plane dashboards both draw it."""
LPT_SHARE = _rate(LPT, RANK_SEL, extra='ordering="lpt"') + " / " + _rate(LPT, RANK_SEL)


def _mean_kernel_seconds_by_path() -> str:
    return (
        f"({_rate(KERNEL_SECONDS_SUM, RANK_SEL, 'path')} / {_rate(KERNEL_SECONDS_COUNT, RANK_SEL, 'path')})"
    )


def _kernel_time_by_path() -> str:
    """Estimated kernel seconds per second per path: mean sampled time x decisions per second.

    The timer samples 1 in N forwards; multiplying its mean by the (exact) decision rate keeps the
    estimate right even if the two paths were sampled at different rates.
    """
    # ">= 0" drops a path whose mean is NaN (no timing sampled in the window) instead of letting
    # it turn the whole normalised share into NaN.
    return f"(({_mean_kernel_seconds_by_path()} * {_rate(DECISIONS, RANK_SEL, 'path')}) >= 0)"


PRICED = tm.exposed_name(tm.PRICED_SECONDS)


def _over_oracle(policy: str, window: str = RATE) -> str:
    return (
        f'sum(rate({PRICED}{{{INSTANCE_SEL}, policy="{policy}"}}[{window}]))'
        f' / sum(rate({PRICED}{{{INSTANCE_SEL}, policy="oracle"}}[{window}]))'
    )


PRICED_BY_BATCH = tm.exposed_name(tm.PRICED_BY_BATCH)


def _regret_by_batch(window: str = "15m") -> str:
    """Each kind of batch's share of the regret: (its routed - its oracle) over ALL oracle time, so
    the two lines add up to the regret stat."""

    def by(policy: str) -> str:
        return f'sum by (batch) (rate({PRICED_BY_BATCH}{{{INSTANCE_SEL}, policy="{policy}"}}[{window}]))'

    return (
        f"({by('routed')} - {by('oracle')})"
        f' / ignoring(batch) group_left() sum(rate({PRICED}{{{INSTANCE_SEL}, policy="oracle"}}[{window}]))'
    )
