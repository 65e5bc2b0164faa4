"""The per-replica numbers of a fleet, as PromQL over the sidecars' own metrics.

One builder per number, for any window and any extra label matchers: config/fleet_rules.yml records
them at 5m (flyserve.fleet.rules) and ``flyserve fleet status`` asks them at its --window, so the
rules and the fleet view compute the same thing.

A replica is one scrape target (one sidecar beside one vLLM server): every expression aggregates
``without (rank, ...)``, never ``by (instance)``, so every target label survives (job, instance,
namespace, pod, and whatever the PodMonitor copies from the pod, e.g. Argo Rollouts'
``rollouts_pod_template_hash``): the analysis queries select canary and stable replicas by them.

Every per-replica number is guarded by ``live``: it exists only while the replica's sidecar is
scraped and every one of its ranks reports. A replica that stops reporting has no number at once
(its gauges go stale), never its last good one for the length of a rate window.
"""

from __future__ import annotations

from typing import Final

from flyserve.telemetry import metrics as tm

DECISIONS: Final = tm.exposed_name(tm.DISPATCH_DECISIONS)
TOKENS: Final = tm.exposed_name(tm.DISPATCH_TOKENS)
KERNEL: Final = tm.exposed_name(tm.KERNEL_SECONDS)
LATE: Final = tm.exposed_name(tm.LATE_APPLIES)
PRICED: Final = tm.exposed_name(tm.PRICED_SECONDS)
RANK_UP: Final = tm.exposed_name(tm.RANK_UP)
RANKS_AGREE: Final = tm.exposed_name(tm.RANKS_AGREE)
VERSION: Final = tm.exposed_name(tm.THRESHOLDS_VERSION)
FINGERPRINT: Final = tm.exposed_name(tm.THRESHOLDS_FINGERPRINT)

FINGERPRINT_LABEL: Final = "fingerprint"
"""The one label a fleet rule adds: a replica's content fingerprint, as count_values prints it (a
decimal integer, "-1" while its ranks disagree). At most one value per replica at any moment."""
MIXED_FINGERPRINT: Final = "-1"

FALLBACK_REASONS: Final = "admitted|no_prefill_rows"
"""Reasons that are not fallbacks: the prefill path ran the batch, or the batch had no prefill row."""


def _sel(matchers: str, *more: str) -> str:
    """``{a="b", ...}`` from an extra-matchers string (may be empty) and fixed ones."""
    parts = [m for m in (*more, matchers.strip()) if m]
    return "{" + ", ".join(parts) + "}" if parts else ""


def live(matchers: str = "") -> str:
    """1 for each replica whose every rank reports now (flyserve_rank_up), absent otherwise."""
    return f"min without (rank) ({RANK_UP}{_sel(matchers)}) == 1"


def _kernel_mean_s(w: str, m: str) -> str:
    """Mean sampled kernel time of one attention call, per path (paths timed in the window only)."""
    return (
        f"sum without (rank) (rate({KERNEL}_sum{_sel(m)}[{w}]))"
        f" / (sum without (rank) (rate({KERNEL}_count{_sel(m)}[{w}])) > 0)"
    )


def _calls(w: str, m: str) -> str:
    return f"sum without (rank, reason) (rate({DECISIONS}{_sel(m)}[{w}]))"


def _tokens(w: str, m: str) -> str:
    return f"sum without (rank) (rate({TOKENS}{_sel(m)}[{w}]))"


def kernel_us_per_token_by_path(w: str = "5m", m: str = "") -> str:
    """Microseconds of kernel time per query token, per replica and path.

    The kernel timer times one call in N (flyserve.telemetry.gpu_timer), so the path's kernel seconds
    per second are estimated as (mean timed call) x (calls per second), then divided by the path's
    tokens per second. Per path only: a threshold change moves batches between paths, and each path's
    number can improve while the replica's gets worse (see ``kernel_us_per_token``)."""
    return (
        f"1e6 * ({_kernel_mean_s(w, m)}) * {_calls(w, m)} / ({_tokens(w, m)} > 0)"
        f" and ignoring (path) ({live(m)})"
    )


def kernel_us_per_token(w: str = "5m", m: str = "") -> str:
    """Microseconds of kernel time per query token, per replica, over every path timed in the window:
    the number a canary is judged by. A path with no timing in the window is left out of the time and
    of the tokens alike."""
    return (
        f"1e6 * sum without (path) (({_kernel_mean_s(w, m)}) * {_calls(w, m)})"
        f" / (sum without (path) ({_tokens(w, m)} and ({_kernel_mean_s(w, m)})) > 0)"
        f" and ({live(m)})"
    )


def regret(w: str = "5m", m: str = "") -> str:
    """Routing regret per replica: priced attention time of the paths the steps ran over the per-step
    best, minus 1 (0.05 = 5% more than the best routing). Needs `flyserve sidecar --costs`."""
    routed, oracle = _sel(m, 'policy="routed"'), _sel(m, 'policy="oracle"')
    return (
        f"sum without (policy) (rate({PRICED}{routed}[{w}]))"
        f" / (sum without (policy) (rate({PRICED}{oracle}[{w}])) > 0) - 1"
        f" and ({live(m)})"
    )


def fallback_ratio(w: str = "5m", m: str = "") -> str:
    """Share of the batches with a prefill row that the unified kernel ran (any reason but admitted)."""
    fallbacks = _sel(m, f'reason!~"{FALLBACK_REASONS}"')
    with_prefill = _sel(m, 'reason!="no_prefill_rows"')
    return (
        f"sum without (rank, path, reason) (rate({DECISIONS}{fallbacks}[{w}]))"
        f" / (sum without (rank, path, reason) (rate({DECISIONS}{with_prefill}[{w}])) > 0)"
        f" and ({live(m)})"
    )


def late_applies(w: str = "5m", m: str = "") -> str:
    """Versions per second the replica's ranks applied late (should stay 0)."""
    return f"sum without (rank) (rate({LATE}{_sel(m)}[{w}])) and ({live(m)})"


def thresholds_version(m: str = "") -> str:
    """The highest version the replica's ranks apply: its own count of changes (not comparable across
    replicas; the fingerprint is)."""
    return f"max without (rank) ({VERSION}{_sel(m)}) and ({live(m)})"


def fingerprint_info(m: str = "") -> str:
    """1 per replica, labelled with its content fingerprint (``fingerprint``): count_values over the
    label-free gauge, one value per replica, NaN (no live rank) left out."""
    return (
        f'count_values without () ("{FINGERPRINT_LABEL}", {FINGERPRINT}{_sel(m)} >= -1)'
        f" and ignoring ({FINGERPRINT_LABEL}) ({live(m)})"
    )


def fingerprint_value(m: str = "") -> str:
    """The raw gauge per replica (the fleet view prints it as hex)."""
    return f"{FINGERPRINT}{_sel(m)}"


def seen(w: str = "5m", m: str = "") -> str:
    """Every replica whose sidecar was scraped within the window (a stopped one too, until ``w`` ends)."""
    return f"last_over_time({RANKS_AGREE}{_sel(m)}[{w}])"


def scrape_up(w: str = "5m", m: str = "") -> str:
    """``up`` of the targets that served flyserve metrics within the window (0: its scrape fails now)."""
    return f"up{_sel(m)} and ({seen(w, m)})"


def ranks(m: str = "") -> str:
    """Ranks per replica (any state) and live ranks: two series per replica, ``state`` all|live."""
    return (
        f'label_replace(count without (rank) ({RANK_UP}{_sel(m)}), "state", "all", "", "")'
        f' or label_replace(sum without (rank) ({RANK_UP}{_sel(m)}), "state", "live", "", "")'
    )


def ranks_agree(m: str = "") -> str:
    return f"{RANKS_AGREE}{_sel(m)}"
