"""The demo's last phase: what the thresholds cost, live, on the real vLLM CPU engine.

The demo's sidecar prices the engine's sampled steps with the CPU pair's measured cost table
(``--costs cpu``, written by `flyserve calibrate --platform cpu`). After the two halves of the
workload this phase prints the regret they had (priced routed time over the per-batch best, from
the sidecar's ``flyserve_priced_attention_seconds_total`` counters, as Prometheus would), asks
``GET /thresholds/advice``, applies the PATCH it returns (with its If-Match), runs one more round
of traffic and prints the regret of that round alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flyserve.demo.procs import send_authenticated

DEMO_COSTS = "cpu"
PRICED = "flyserve_priced_attention_seconds_total"


def priced_seconds(sidecar_url: str) -> dict[str, float]:
    """The sidecar's priced-seconds counters by policy (a /metrics scrape)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{sidecar_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == PRICED:
                out[s.labels.get("policy", "")] = s.value
    return out


def regret_between(start: dict[str, float], end: dict[str, float]) -> float | None:
    """routed / oracle - 1 over the counters' increase from ``start`` to ``end``; None if nothing priced."""
    routed = end.get("routed", 0.0) - start.get("routed", 0.0)
    oracle = end.get("oracle", 0.0) - start.get("oracle", 0.0)
    # routed >= oracle step by step; a difference of sums can still come out -1e-16.
    return max(0.0, routed / oracle - 1.0) if oracle > 0 else None


def _pct(x: float | None) -> str:
    return "n/a (nothing priced)" if x is None else f"{x:.1%}"


def advice_phase(
    sidecar_url: str,
    token: str,
    priced_at_start: dict[str, float],
    run_traffic: Callable[[], dict[str, Any]],
    echo: Callable[[str], Any],
) -> dict[str, Any]:
    """Regret so far, advice, PATCH, one more round of traffic, regret of that round. The phase dict
    ``run_traffic`` returns, with ``regret_before``, ``advice`` and ``regret_after`` added."""
    from flyserve.sidecar.advice_client import fetch_advice

    before = priced_seconds(sidecar_url)
    regret_before = regret_between(priced_at_start, before)
    echo(
        f"[+] what the thresholds cost in both halves (steps priced by the measured CPU table): "
        f"regret {_pct(regret_before)} over the per-batch best"
    )
    r = fetch_advice(sidecar_url, {"shapes": 0}, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"GET /thresholds/advice answered {r.status_code}: {r.text[:300]}")
    adv = r.json()
    echo(
        f"    advice from {adv['samples']} sampled steps: {adv['changes'] or 'no change'}; routed/oracle on "
        f"them {adv['before']['routed_over_oracle']:.3f} -> {adv['after']['routed_over_oracle']:.3f}"
    )
    from flyserve.sidecar.advise_cli import render_restart

    for line in render_restart(adv.get("restart") or []):  # named for the operator, never applied here
        echo(f"    {line}")
    if adv["patch"] is not None:
        p = adv["patch"]
        got = send_authenticated(p["method"], f"{sidecar_url}{p['path']}", token, p["body"], p["headers"])
        echo(f"    applied: version {got['thresholds']['version']} (If-Match {p['headers']['If-Match']})")
    phase = run_traffic()
    regret_after = regret_between(before, priced_seconds(sidecar_url))
    echo(f"[+] regret with the advice in force (this round only): {_pct(regret_after)}")
    return {
        **phase,
        "regret_before": regret_before,
        "regret_after": regret_after,
        "advice": {k: adv.get(k) for k in ("samples", "changes", "thresholds_version", "restart")},
    }
