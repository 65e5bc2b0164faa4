"""The Kernel paths dashboard (flyserve-kernels.json): how long each attention kernel path takes."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from flyserve.dashboards.panels import (
    _annotation_thresholds_change,
    _bargauge_histogram,
    _dashboard,
    _heatmap,
    _target,
    _timeseries,
    _variables,
)
from flyserve.dashboards.queries import (
    KERNEL_SECONDS_BUCKET,
    KERNEL_TIMER_DROPPED,
    MAX_SEQ_LEN_BUCKET,
    QUERY_TOKENS_BUCKET,
    RANK_SEL,
    _kernel_time_by_path,
    _rate,
)


def kernel_paths() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-kernels",
        "flyserve / Kernel paths",
        "How long each attention kernel path takes (sampled on the device, no sync) and "
        "which batch shapes each path receives.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change())
    d = d.with_row(dash.Row("Kernel time"))
    d = d.with_panel(
        _timeseries(
            "Kernel time per path (p50, p99)",
            "Sampled per-forward kernel time of each path, from device timers harvested without a sync "
            "(1 in N forwards). p50 is the typical batch, p99 the long tail. A step up that is not "
            "explained by a shape change (see 'Shapes' below) is a regression; the KernelTimeRegression "
            "alert compares each path against its own last hour.",
            [
                _target(
                    f"histogram_quantile(0.5, {_rate(KERNEL_SECONDS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.99, {_rate(KERNEL_SECONDS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} p99",
                    "B",
                ),
            ],
            unit="s",
            legend_calcs=["mean", "lastNotNull", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Kernel time share per path",
            "Estimated share of attention kernel time spent in each path: mean sampled time per forward "
            "times decisions per second, normalised. A path with few batches can still dominate the time "
            "(long prefills); this is where tuning pays.",
            [
                _target(
                    f"{_kernel_time_by_path()} / ignoring(path) group_left sum({_kernel_time_by_path()})",
                    "{{path}}",
                )
            ],
            unit="percentunit",
            stacked=True,
            min_val=0,
            max_val=1,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _heatmap(
            "Kernel time heatmap: prefill",
            "Distribution of sampled prefill-specialist kernel times over time (darker = more samples). "
            "Two bands mean two populations of shapes; a band drifting up is a slowdown.",
            _rate(KERNEL_SECONDS_BUCKET, RANK_SEL, "le", 'path="prefill"'),
            unit="s",
        )
    )
    d = d.with_panel(
        _heatmap(
            "Kernel time heatmap: unified",
            "Distribution of sampled unified-kernel times over time (decode, mixed and refused prefill "
            "batches). Compare with the prefill heatmap: batches the prefill path refused land here.",
            _rate(KERNEL_SECONDS_BUCKET, RANK_SEL, "le", 'path="unified"'),
            unit="s",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Timer samples dropped",
            "Kernel timings skipped per second because the timer's queue of pending device events was "
            "full: the GPU ran far behind the host (the timer never waits for the device). A steady "
            "non-zero rate means the timings above under-represent the slowest forwards.",
            [_target(_rate(KERNEL_TIMER_DROPPED, RANK_SEL, "path"), "{{path}}")],
            unit="ops",
            w=24,
            h=6,
        )
    )

    d = d.with_row(dash.Row("Shapes"))
    d = d.with_panel(
        _bargauge_histogram(
            "Query tokens per batch: unified (fallbacks and decode)",
            "How many query tokens (num_actual_tokens) the batches the unified kernel ran had, over the "
            "dashboard's time range. Large-token bars here are prefills that fell back: check the "
            "Fallback reasons panel for why.",
            f'sum by (le) (increase({QUERY_TOKENS_BUCKET}{{path="unified", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "Query tokens per batch: prefill",
            "How many query tokens the batches the prefill specialist ran had, over the time range. "
            "The left edge is the smallest batch the thresholds admit (min_qblock_rows x block_m / heads).",
            f'sum by (le) (increase({QUERY_TOKENS_BUCKET}{{path="prefill", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "max_seq_len per batch: unified (fallbacks and decode)",
            "Longest sequence (context) in the batches the unified kernel ran, over the time range. Bars "
            "above max_seq_len or below min_seq_len are the context_too_long / short_context fallbacks.",
            f'sum by (le) (increase({MAX_SEQ_LEN_BUCKET}{{path="unified", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "max_seq_len per batch: prefill",
            "Longest sequence in the batches the prefill specialist ran, over the time range: the context "
            "lengths where the specialist is trusted.",
            f'sum by (le) (increase({MAX_SEQ_LEN_BUCKET}{{path="prefill", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Median shape per path",
            "Median query tokens and median max_seq_len of the batches each path ran, over time. A "
            "kernel-time change that follows a shape change here is the workload, not a regression.",
            [
                _target(
                    f"histogram_quantile(0.5, {_rate(QUERY_TOKENS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} query tokens p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.5, {_rate(MAX_SEQ_LEN_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} max_seq_len p50",
                    "B",
                ),
            ],
            unit="short",
            w=24,
        )
    )
    return d
