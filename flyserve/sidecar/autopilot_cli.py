"""`flyserve autopilot status|mode|pause|resume|kill|approve`: a client of a running sidecar's
/autopilot routes (the commands `trials`, `history` and `replay` read files: flyserve/autopilot/cli.py).

The changes carry the bearer token (--token-file, else $FLYSERVE_SIDECAR_TOKEN), sent to --url only:
no proxy is taken from the environment ($HTTP(S)_PROXY would receive the token) and no redirect is
followed (as flyserve top does). Whatever answers at --url wrote what is printed: every line goes
through flyserve.terminal.printable, every field read by type (a list where an object belongs, a
number too large for a float) shows "?" or "-", never a traceback.
Exit codes: 0 done; 1 the sidecar refused (its status and detail printed); 2 usage, no token, or the
sidecar cannot be reached.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from flyserve.terminal.printable import printable, printable_block

DEFAULT_URL = "http://127.0.0.1:9400"
TIMEOUT_S = 30.0

Url = Annotated[
    str,
    typer.Option(
        "--url", envvar="FLYSERVE_SIDECAR_URL", help="The sidecar's base URL ($FLYSERVE_SIDECAR_URL)."
    ),
]
TokenFile = Annotated[
    Path | None,
    typer.Option(
        "--token-file", help="File whose first line is the bearer token (else $FLYSERVE_SIDECAR_TOKEN)."
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print the status as JSON.")]


def make_client(url: str) -> httpx.Client:
    """The HTTP client the commands use (tests put a TestClient here): the token goes to ``url``
    itself, never to a proxy named by the environment nor to where a redirect points."""
    return httpx.Client(base_url=url, timeout=TIMEOUT_S, trust_env=False, follow_redirects=False)


def _token(token_file: Path | None) -> str:
    from flyserve.sidecar.settings import TokenError, read_token

    try:
        secret = read_token(token_file)
    except TokenError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
    if secret is None:
        typer.echo("error: no token: --token-file or $FLYSERVE_SIDECAR_TOKEN", err=True)
        raise typer.Exit(2)
    return secret.get_secret_value()


def _call(url: str, method: str, path: str, *, token: str | None = None, body: Any = None) -> dict[str, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with make_client(url) as client:
            r = client.request(method, path, headers=headers, json=body)
    except httpx.HTTPError as exc:
        typer.echo(printable_block(f"error: cannot reach the sidecar at {url}: {exc}"), err=True)
        raise typer.Exit(2) from None
    try:
        got = r.json()
    except ValueError:
        got = None
    if r.status_code != 200 or not isinstance(got, dict):
        detail = got.get("detail") if isinstance(got, dict) else r.text[:300]
        typer.echo(
            printable_block(f"error: {method} {path}: HTTP {r.status_code}: {printable(detail, 400)}"),
            err=True,
        )
        raise typer.Exit(1)
    return got


def _as_dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _as_list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _relative(x: Any) -> str:
    """A relative change (-0.02: 2% faster) as a signed percentage; "-" when absent, "?" when not a
    number a float holds (a string, 10**400)."""
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "?"
    try:
        v = float(x)
    except OverflowError:
        return "?"
    if math.isnan(v):
        return "?"
    if math.isinf(v):
        return "+inf" if v > 0 else "-inf"
    return f"{v:+.2%}"


def _changes(changed: Any) -> str:
    """``{knob: [current, candidate]}`` as ``knob current -> candidate, ...``."""
    parts = []
    for k, v in _as_dict(changed).items():
        pair = _as_list(v)
        if len(pair) == 2:
            parts.append(f"{printable(k, 64)} {printable(pair[0])} -> {printable(pair[1])}")
        else:
            parts.append(f"{printable(k, 64)} ?")
    return ", ".join(parts)


def render(st: dict[str, Any]) -> str:
    """The status as lines for a person; each field read by type, so an odd answer prints, never crashes."""
    paused = ", paused" if st.get("paused") is True else ""
    lines = [f"autopilot: mode {printable(st.get('mode'))}{paused}, {printable(st.get('state'))}"]
    for key in ("trial", "proposal"):
        t = st.get(key)
        if isinstance(t, dict):
            lines.append(f"{key}: {printable(t.get('id'), 64)} ({_changes(t.get('changed'))})")
            if key == "trial":
                lines.append(
                    f"  pairs {printable(t.get('pairs'))}, arm now {printable(t.get('arm_now'))}, "
                    f"estimate {_relative(t.get('estimate'))} (negative: candidate faster), "
                    f"verdict {printable(t.get('verdict'))}"
                )
    if st.get("last_refusal"):
        lines.append(f"no trial: {printable(st['last_refusal'], 300)}")
    for d in _as_list(st.get("last_decisions")):
        if isinstance(d, dict):
            version = d.get("result_version")
            lines.append(
                f"  {printable(d.get('trial_id'), 64)}: {printable(d.get('decision'))} "
                f"({printable(d.get('reason'), 120)}) after {printable(d.get('pairs'))} pairs, "
                f"effect {_relative(d.get('effect'))}"
                + ("" if version is None else f" -> v{printable(version)}")
            )
    return "\n".join(lines)


def _show(st: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(printable_block(json.dumps(st, indent=2, sort_keys=True)))
    else:
        typer.echo(render(st))


def status_cmd(url: Url = DEFAULT_URL, as_json: Json = False) -> None:
    """The autopilot's mode, its trial, why no trial started, and its last decisions."""
    _show(_call(url, "GET", "/autopilot"), as_json)


def mode_cmd(
    mode: Annotated[str, typer.Argument(help="off, advise, trial or auto.")],
    url: Url = DEFAULT_URL,
    token_file: TokenFile = None,
    as_json: Json = False,
) -> None:
    """Set the mode (to off or advise: a running trial is rolled back)."""
    _show(_call(url, "POST", "/autopilot/mode", token=_token(token_file), body={"mode": mode}), as_json)


def _simple(path: str, doc: str):
    def command(url: Url = DEFAULT_URL, token_file: TokenFile = None, as_json: Json = False) -> None:
        _show(_call(url, "POST", path, token=_token(token_file)), as_json)

    command.__doc__ = doc
    return command


pause_cmd = _simple("/autopilot/pause", "No new trial until resume; a running trial is rolled back.")
resume_cmd = _simple("/autopilot/resume", "Trials may start again.")
kill_cmd = _simple(
    "/autopilot/kill", "The kill switch: mode off, any trial ended, the operator's version back."
)


def approve_cmd(
    trial_id: Annotated[str, typer.Argument(help="The trial whose promotion awaits (GET /autopilot).")],
    url: Url = DEFAULT_URL,
    token_file: TokenFile = None,
    as_json: Json = False,
) -> None:
    """Trial mode: publish the candidate of the promotion awaiting under TRIAL_ID."""
    from flyserve.autopilot.switchback import SwitchbackPlanError, check_trial_id

    try:  # it becomes part of the URL: "../thresholds" or "x?y" would reach another route
        check_trial_id(trial_id)
    except SwitchbackPlanError as exc:
        typer.echo(printable_block(f"error: TRIAL_ID {printable(trial_id, 80)}: {exc.reason}"), err=True)
        raise typer.Exit(2) from None
    _show(_call(url, "POST", f"/autopilot/approve/{trial_id}", token=_token(token_file)), as_json)


def register(app: typer.Typer) -> None:
    """Add the commands to `flyserve autopilot`."""
    app.command("status")(status_cmd)
    app.command("mode")(mode_cmd)
    app.command("pause")(pause_cmd)
    app.command("resume")(resume_cmd)
    app.command("kill")(kill_cmd)
    app.command("approve")(approve_cmd)
