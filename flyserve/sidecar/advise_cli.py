"""`flyserve thresholds advise`: ask a running sidecar (started with --costs) for threshold advice.

Advice lives in the sidecar because the window of priced live shapes does (flyserve.sidecar.live_costs);
this command is a reader of GET /thresholds/advice that prints it for a person. It changes nothing:
applying the advice is the PATCH it prints, an operator action guarded by If-Match. What it prints
comes from whatever answers at --url: every line goes out through flyserve.terminal.printable, and an answer
that is not advice is an error, not a traceback.
"""

from __future__ import annotations

import json
import shlex
from typing import Annotated, Any

import typer

from flyserve.terminal.printable import printable, printable_block

DEFAULT_URL = "http://127.0.0.1:9400"


PATCH_METHODS = ("PATCH", "PUT")
PATCH_PATH = "/thresholds"


class ForgedPatch(ValueError):
    """The advice's ``patch`` is not a PATCH or PUT of /thresholds: never printed as a command."""


def curl_command(url: str, patch: dict[str, Any]) -> str:
    """The curl line that applies ``patch``, for an operator to paste into a shell. Whatever answers at
    --url wrote the patch, so only a PATCH or PUT of /thresholds is printed (ForgedPatch otherwise) and
    every part of it is one shell word (shlex.quote): no ``;``, ``$(...)`` or quote in it runs."""
    method, path = patch.get("method"), patch.get("path")
    if method not in PATCH_METHODS or path != PATCH_PATH:
        raise ForgedPatch(
            f"the advice's apply command is not a PATCH or PUT of {PATCH_PATH} (method "
            f"{printable(method, 40)}, path {printable(path, 80)}): not printed; the answer at --url "
            "is not a flyserve sidecar's"
        )
    body = json.dumps(patch["body"], separators=(",", ":"))
    return (
        f"curl -X {shlex.quote(method)} {shlex.quote(url.rstrip('/') + path)} "
        f"-H {shlex.quote('If-Match: ' + str(patch['headers']['If-Match']))} "
        '-H "Authorization: Bearer $FLYSERVE_SIDECAR_TOKEN" '
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )


def _ratio(w: dict[str, Any], key: str = "routed_over_oracle") -> str:
    v = w.get(key)
    return "-" if v is None else f"{v:.4f}"


def render(adv: dict[str, Any], url: str, shapes: int) -> str:
    """The advice as text: changes, routed/oracle before and after, the PATCH to apply it."""
    b, a = adv["before"], adv["after"]
    lines = [
        (
            f"advice from {adv['samples']} sampled steps ({adv['window']} window), "
            f"thresholds version {adv['thresholds_version']}"
        ),
        f"  routed/oracle, all batches:          {_ratio(b)} -> {_ratio(a)}",
        (
            f"  routed/oracle, batches with prefill: {_ratio(b['prefill_batches'])} -> "
            f"{_ratio(a['prefill_batches'])} ({b['prefill_batches']['samples']} batches)"
        ),
    ]
    if not adv["changes"]:
        lines.append(
            "no change advised: the thresholds in force route these batches as well as any values would"
        )
    else:
        lines.append("changes (run-time knobs only; decode_path is fixed at start):")
        changes = {printable(k, 64): (printable(o), printable(n)) for k, (o, n) in adv["changes"].items()}
        width = max(len(k) for k in changes)
        for k, (old, new) in changes.items():
            lines.append(f"  {k:<{width}}  {old} -> {new}")
        lines += [
            "apply (an operator action; 409 if the thresholds changed since):",
            f"  {curl_command(url, adv['patch'])}",
        ]
    lines += render_restart(adv.get("restart") or [])
    listed = adv["shapes"][-shapes:] if shapes else []
    if listed:
        lines.append(
            f"newest {len(listed)} of {adv['shapes_total']} fitted shapes (rows, max ctx, ms per path):"
        )
        for s in listed:
            moved = "" if s["before"] == s["after"] else f"  {s['before']} -> {s['after']}"
            lines.append(
                f"  step {s['step']:>8}: {len(s['query_lens']):>4} rows, {max(s['seq_lens'], default=0):>7} ctx, "
                f"unified {s['unified_ms']:.3f} prefill {s['prefill_ms']:.3f}{moved}"
            )
    return "\n".join(lines)


def render_refusal(body: dict[str, Any]) -> str:
    """The sidecar's 409 with field ``samples``: advice refused because the window's shape samples
    are not corroborated by the ranks' decision counters; one line per rank says which and why."""
    ev = body.get("samples") if isinstance(body.get("samples"), dict) else {}
    lines = [
        (
            f"advice refused: {ev.get('used', '?')} sampled steps in the window are not corroborated by the "
            "ranks' decision counters (forged or stale files in <state>/shapes/?)"
        ),
    ]
    for r in ev.get("ranks") or []:
        if not isinstance(r, dict):
            continue
        verdict = "ok" if r.get("corroborated") else f"REFUSED: {str(r.get('reason'))[:200]}"
        lines.append(
            f"  rank {r.get('engine')}-{r.get('rank')}: {r.get('samples')} samples, "
            f"{r.get('decisions')} decisions counted: {verdict}"
        )
    lines.append("nothing was fitted; remove the files named above from <state>/shapes/ and ask again")
    return "\n".join(lines)


def render_restart(restart: list[dict[str, Any]]) -> list[str]:
    """The start-time knobs worth a restart: marked as such, never part of the PATCH above."""
    if not restart:
        return []
    lines = ["needs a restart (not in the PATCH; the saving is on top of it, each knob alone):"]
    width = max(len(printable(r["knob"], 64)) for r in restart)
    for r in restart:
        ro = r.get("routed_over_oracle_after")
        knob, current, advised = printable(r["knob"], 64), printable(r["current"]), printable(r["advised"])
        lines.append(
            f"  {knob:<{width}}  {current} -> {advised}: saves {r['saving']:.1%} of attention "
            f"time, needs a restart" + ("" if ro is None else f" (routed/oracle -> {ro:.4f})")
        )
        lines.append(f"  {'':<{width}}  {printable(r['how'], 1024)}")
    return lines


def _not_advice(endpoint: str, exc: Exception) -> typer.Exit:
    typer.echo(f"error: {printable(endpoint)}: the answer is not advice ({type(exc).__name__})", err=True)
    return typer.Exit(1)


def advise(
    url: Annotated[
        str,
        typer.Option("--url", envvar="FLYSERVE_SIDECAR_URL", help="The sidecar ($FLYSERVE_SIDECAR_URL)."),
    ] = DEFAULT_URL,
    window: Annotated[
        str, typer.Option("--window", help="Which window's sampled shapes to fit: 60s or 900s.")
    ] = "900s",
    shapes: Annotated[
        int, typer.Option("--shapes", min=0, max=10_000, help="How many fitted shapes to list.")
    ] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the sidecar's JSON as is.")] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the sidecar.")
    ] = 60.0,
) -> None:
    """Threshold values that would have routed the last window's real batches best, priced by the
    sidecar's cost table: routed/oracle before and after, and the PATCH (with If-Match) to apply them."""
    import httpx

    from flyserve.sidecar.advice_client import fetch_advice

    if window not in ("60s", "900s"):
        typer.echo(f"error: --window must be 60s or 900s (got {window!r})", err=True)
        raise typer.Exit(2)
    endpoint = url.rstrip("/") + "/thresholds/advice"
    try:
        r = fetch_advice(url, {"window": window, "shapes": max(shapes, 100)}, timeout=timeout)
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach the sidecar at {printable(url)}: {printable(exc, 512)}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, AttributeError) as exc:  # a 200 that is not a JSON object
        raise _not_advice(endpoint, exc) from None
    if r.status_code != 200:
        try:
            body = r.json()
            detail = body.get("detail", r.text) if isinstance(body, dict) else r.text
        except ValueError:
            body, detail = None, r.text
        if isinstance(body, dict) and body.get("field") == "samples":
            typer.echo(printable_block(render_refusal(body)), err=True)
            raise typer.Exit(1)
        typer.echo(f"error: {printable(endpoint)}: HTTP {r.status_code}: {printable(detail, 300)}", err=True)
        raise typer.Exit(1)
    try:
        adv = r.json()
        shown = json.dumps(adv, indent=1) if as_json else printable_block(render(adv, url, shapes))
    except ForgedPatch as exc:
        typer.echo(f"error: {printable(endpoint)}: {exc}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise _not_advice(endpoint, exc) from None
    typer.echo(shown)
