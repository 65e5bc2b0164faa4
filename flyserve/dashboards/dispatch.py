"""The Dispatch overview dashboard (flyserve-dispatch.json): which path each batch took and why,
and what the thresholds cost."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from flyserve.dashboards.panels import (
    _annotation_circuit_change,
    _annotation_thresholds_change,
    _dashboard,
    _stat,
    _target,
    _timeseries,
    _variables,
)
from flyserve.dashboards.queries import (
    COST_DRIFT,
    DECISIONS,
    INSTANCE_SEL,
    LATE_APPLIES,
    LPT_SHARE,
    PREFILL_RATIO_DECISIONS,
    PREFILL_RATIO_ELIGIBLE,
    PREFILL_RATIO_TOKENS,
    RANK_SEL,
    RANKS_AGREE,
    ROWS,
    THRESHOLDS_VERSION,
    VERSION_BY_RANK,
    _over_oracle,
    _rate,
    _regret_by_batch,
)


def _what_the_thresholds_cost(d: dash.Dashboard) -> dash.Dashboard:
    """Live regret and cost-table drift (the sidecar started with --costs; empty without it)."""
    d = d.with_row(dash.Row("What the thresholds cost"))
    d = d.with_panel(
        _stat(
            "Routing regret (15 min)",
            "Attention time the routed paths cost beyond the faster path per batch, over 15 minutes, as a "
            "share of that best (the oracle): sampled steps priced by the sidecar's cost table (--costs). "
            "Above 5% for 30 minutes is the RoutingRegretHigh alert: ask `flyserve thresholds advise`.",
            _target(_over_oracle("routed", "15m") + " - 1", "regret"),
            unit="percentunit",
            decimals=1,
            thresholds=[(None, "green"), (0.05, "orange"), (0.2, "red")],
            w=6,
            h=8,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Attention time relative to the oracle",
            "Priced attention time of the paths the steps ran (routed), and of always-unified and "
            "always-prefill, each over the per-batch best (1.0 = the oracle). routed near 1.0: the "
            "thresholds pick the faster kernel; a gap that opens after an orange mark is that change's cost.",
            [
                _target(_over_oracle("routed"), "routed / oracle", "A"),
                _target(_over_oracle("always_unified"), "always unified / oracle", "B"),
                _target(_over_oracle("always_prefill"), "always prefill / oracle", "C"),
            ],
            unit="none",
            min_val=1,
            legend_calcs=["mean", "lastNotNull"],
            w=10,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Cost-table drift",
            "Median measured / predicted kernel time per path over 15 minutes, from the shape samples "
            "that carry a kernel time of their step (docs/operations.md). Inside [0.7, 1.4] the cost table still describes this GPU "
            "and kernel build; outside it for 30 minutes is the CostTableDrift alert: re-run calibrate.",
            [_target(f"max by (path) ({COST_DRIFT}{{{INSTANCE_SEL}}})", "{{path}}")],
            unit="none",
            legend_calcs=["lastNotNull", "max"],
            w=8,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Regret by cause (15 min)",
            "The regret split by the kind of batch that spent it, each over all oracle time (the two "
            "add up to the regret stat). with_prefill: batches with a prefill row, routed by the run-time "
            "thresholds: `flyserve thresholds advise` proposes a PATCH. decode_only: batches that take "
            "decode_path, fixed at start: only a restart moves it (advice lists it under 'needs a restart').",
            [_target(_regret_by_batch(), "{{batch}}")],
            unit="percentunit",
            min_val=0,
            legend_calcs=["mean", "lastNotNull"],
            w=24,
            h=7,
        )
    )
    return d


def dispatch_overview() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-dispatch",
        "flyserve / Dispatch overview",
        "Which attention kernel path vLLM's batches take, why they fall back, and whether "
        "every rank runs the same thresholds.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change()).annotation(_annotation_circuit_change())
    d = d.with_row(dash.Row("Now"))
    d = d.with_panel(
        _stat(
            "Prefill share of eligible batches",
            "Share of batches WITH prefill rows that the prefill specialist ran (reason=admitted), over the "
            "rate window. Pure-decode batches are left out: they always take the decode path. A sudden drop "
            "right after a thresholds change or a circuit opening is what the PrefillRatioCollapsed alert "
            "looks for.",
            _target(PREFILL_RATIO_ELIGIBLE, "eligible"),
            unit="percentunit",
            decimals=1,
        )
    )
    d = d.with_panel(
        _stat(
            "Decisions per second",
            "Dispatch decisions per second across the selected ranks: one per engine step per rank "
            "(the routing decides once per batch, on CUDA-graph replays too). Zero means the engine is idle "
            "or the ranks stopped reporting.",
            _target(_rate(DECISIONS, RANK_SEL), "decisions/s"),
            unit="ops",
        )
    )
    d = d.with_panel(
        _stat(
            "Thresholds version",
            "The newest thresholds version any selected rank has applied. Compare with 'Ranks agree': a "
            "version that went up on some ranks only is a split configuration.",
            _target(f"max({THRESHOLDS_VERSION}{{{RANK_SEL}}})", "version", instant=True),
            unit="none",
            decimals=0,
        )
    )
    d = d.with_panel(
        _stat(
            "Ranks agree",
            "1 (AGREE) when every live rank applied the same thresholds version, as the sidecar sees it. "
            "DISAGREE for more than a few seconds means a rank missed a change (see the Control plane "
            "dashboard) and ranks now route the same shapes differently.",
            _target(f"min({RANKS_AGREE}{{{INSTANCE_SEL}}})", "agree", instant=True),
            unit="none",
            thresholds=[(None, "red"), (1, "green")],
            mappings={"0": ("DISAGREE", "red"), "1": ("AGREE", "green")},
        )
    )

    d = d.with_row(dash.Row("Routing"))
    d = d.with_panel(
        _timeseries(
            "Prefill ratio",
            "Share of work the prefill specialist ran, three ways: by decisions (all batches, decode "
            "included), by decisions among batches that have prefill rows (the number the thresholds "
            "control), and by tokens (how much of the attention work it carries). Orange marks are "
            "thresholds version changes; a step down right after one is that change's effect.",
            [
                _target(PREFILL_RATIO_DECISIONS, "by decisions (all batches)", "A"),
                _target(PREFILL_RATIO_ELIGIBLE, "by decisions (batches with prefill rows)", "B"),
                _target(PREFILL_RATIO_TOKENS, "by tokens", "C"),
            ],
            unit="percentunit",
            min_val=0,
            max_val=1,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Fallback reasons",
            "Batches with prefill rows that the unified kernel ran, stacked by the first rule that refused "
            "the prefill path (short_context, low_occupancy, too_many_decode_rows, context_too_long, "
            "not_causal, disabled, unsupported, circuit_open). The tallest band is the threshold worth "
            "tuning; circuit_open or unsupported growing means the prefill kernel is unavailable, not "
            "refused by the thresholds.",
            [
                _target(
                    _rate(DECISIONS, RANK_SEL, "reason", 'reason!~"admitted|no_prefill_rows"'), "{{reason}}"
                )
            ],
            unit="ops",
            stacked=True,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Decisions per second by path",
            "Batches per second routed to each kernel path (unified = general kernel, prefill = causal "
            "prefill specialist). The total follows the engine step rate; the split follows the workload "
            "and the thresholds.",
            [_target(_rate(DECISIONS, RANK_SEL, "path"), "{{path}}")],
            unit="ops",
            stacked=True,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Rows per second by path and kind",
            "Batch rows (requests in a batch) per second by the path that ran them and their kind: "
            "prefill rows (more than one query token) or decode rows. Prefill rows on the unified path "
            "are prefills the specialist did not get; many decode rows riding along in prefill-path "
            "batches is what the too_many_decode_rows rule limits.",
            [_target(_rate(ROWS, RANK_SEL, "path, kind"), "{{path}} {{kind}} rows")],
            unit="ops",
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "LPT share",
            "Share of prefill-path batches scheduled longest-processing-time first (ordering=lpt) rather "
            "than in plain order. LPT pays off when one long sequence dominates a mixed batch; the "
            "thresholds' lpt mode (auto/always/never) sets it.",
            [_target(LPT_SHARE, "lpt share")],
            unit="percentunit",
            min_val=0,
            max_val=1,
        )
    )

    d = _what_the_thresholds_cost(d)

    d = d.with_row(dash.Row("Configuration"))
    d = d.with_panel(
        _timeseries(
            "Thresholds version per rank",
            "The thresholds version each rank applied. All lines should move together, at the same engine "
            "step; orange annotations mark every change. A rank whose line lags is a rank that missed "
            "the change.",
            [_target(VERSION_BY_RANK, "rank {{rank}}")],
            unit="none",
            legend_calcs=["lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Ranks in agreement",
            "Distinct thresholds versions among the selected ranks (should be 1) and the sidecar's own "
            "verdict over live ranks (1 = agree). Two or more versions for longer than one change "
            "takes is the RanksDisagreeOnThresholds alert. Late applies: versions a rank learned of "
            "after their effective step and applied at a step of its own.",
            [
                _target(
                    f'count(count_values("version", max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})))',
                    "distinct versions",
                    "A",
                ),
                _target(f"min({RANKS_AGREE}{{{INSTANCE_SEL}}})", "sidecar: ranks agree", "B"),
                _target(
                    f"sum(increase({LATE_APPLIES}{{{RANK_SEL}}}[$__rate_interval]))",
                    "late applies (should stay 0)",
                    "C",
                ),
            ],
            unit="none",
            min_val=0,
            legend_calcs=["lastNotNull", "max"],
        )
    )
    return d
