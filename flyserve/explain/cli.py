"""`flyserve explain`: why one batch goes where, rule by rule (flyserve.policy.explain).

The batch comes from the command line (query and context lengths per row), from a line of a rank's
shape log (``<state>/shapes/<engine>-<rank>.jsonl``) or from a shape of ``GET /thresholds/advice``.
The thresholds come from a profile, a thresholds file laid over it, or a published version of the
state directory's history ("what would version N have done"). With ``--costs`` each path is priced
by the cost model (flyserve.pricing.costs) and the oracle named. Reads only; changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from flyserve.control.options import StateDirArg
from flyserve.terminal.printable import printable, printable_block

MAX_SAMPLE_BYTES = 4 << 20
"""A shape log is a few hundred lines of a few kB; an advice answer at most 10,000 shapes."""
MAX_ROWS = 1 << 16


class ExplainInputError(ValueError):
    """A bad flag or sample: the message names the field, never echoes the file's content."""


def parse_lens(text: str, flag: str) -> list[int]:
    """'1,1,2048' -> [1, 1, 2048]; an error naming the flag otherwise."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ExplainInputError(f"{flag}: give comma-separated row lengths, e.g. 1,1,2048")
    if len(parts) > MAX_ROWS:
        raise ExplainInputError(f"{flag}: more than {MAX_ROWS} rows")
    try:
        out = [int(p) for p in parts]
    except ValueError:
        raise ExplainInputError(f"{flag}: every row length must be an integer") from None
    if any(x < 0 or x > 1 << 24 for x in out):
        raise ExplainInputError(f"{flag}: row lengths must be between 0 and {1 << 24}")
    return out


def _int_field(d: dict[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ExplainInputError(f"{where}: field {key!r} must be a non-negative integer")
    return v


def _lens_field(d: dict[str, Any], key: str, where: str) -> list[int] | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v or len(v) > MAX_ROWS:
        raise ExplainInputError(f"{where}: field {key!r} must be a non-empty list of row lengths")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1 << 24 for x in v):
        raise ExplainInputError(f"{where}: field {key!r} must hold integers between 0 and {1 << 24}")
    return v


def sample_from_json(doc: Any, where: str, index: int) -> dict[str, Any]:
    """One batch from a parsed JSON document: a shape-log line / advice shape (an object with
    ``query_lens``), an advice answer (``shapes``: the ``index``-th), or a list of such objects."""
    if isinstance(doc, dict) and "shapes" in doc and "query_lens" not in doc:
        doc = doc["shapes"]
        where = f"{where}: shapes"
    if isinstance(doc, list):
        if not doc:
            raise ExplainInputError(f"{where}: no shapes")
        try:
            doc = doc[index]
        except IndexError:
            raise ExplainInputError(f"{where}: --index {index} is out of range ({len(doc)} shapes)") from None
        where = f"{where}[{index}]"
    if not isinstance(doc, dict) or "query_lens" not in doc:
        raise ExplainInputError(f"{where}: not a batch shape (an object with 'query_lens')")
    return {**doc, "_where": where}


def read_sample(path: str, index: int) -> dict[str, Any]:
    """The batch of ``path`` ('-' is stdin): a JSON document, or JSON lines (a shape log, newest last)."""
    import sys

    from flyserve.control.state_files import read_regular_file
    from flyserve.files import safe_read

    where = "stdin" if path == "-" else Path(path).name
    try:
        raw = (
            sys.stdin.buffer.read(MAX_SAMPLE_BYTES + 1)
            if path == "-"
            else read_regular_file(Path(path), MAX_SAMPLE_BYTES)
        )
    except (OSError, ValueError) as exc:
        raise ExplainInputError(f"--sample {where}: cannot read ({type(exc).__name__}: {exc})") from None
    if raw is None:
        raise ExplainInputError(f"--sample {where}: no such file")
    if len(raw) > MAX_SAMPLE_BYTES:
        raise ExplainInputError(f"--sample {where}: larger than {MAX_SAMPLE_BYTES} bytes")
    text = raw.decode("utf-8", errors="replace")
    # flyserve.files.safe_read's parser: depth and number caps, errors that name the field.
    try:
        return sample_from_json(
            safe_read.parse_json(text, source=f"--sample {where}"), f"--sample {where}", index
        )
    except safe_read.NotJSONError:
        pass  # not one JSON document: JSON lines, one sample per line
    except safe_read.SafeReadError as exc:
        raise ExplainInputError(str(exc)) from None
    docs = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                docs.append(safe_read.parse_json(line, source=f"--sample {where}: line {i + 1}"))
            except safe_read.NotJSONError:
                raise ExplainInputError(f"--sample {where}: line {i + 1} is not JSON") from None
            except safe_read.SafeReadError as exc:
                raise ExplainInputError(str(exc)) from None
    return sample_from_json(docs, f"--sample {where}", index)


def load_thresholds(profile: str, thresholds_file: Path | None, version: int | None, state_dir: Path | None):
    """(Thresholds, a line saying where they came from)."""
    from flyserve.policy.thresholds import ThresholdsError
    from flyserve.thresholds_files import load_profile, read_yaml_file

    if version is not None:
        if thresholds_file is not None:
            raise ExplainInputError("--version and --thresholds: give one of them")
        from flyserve.control.errors import ControlIOError
        from flyserve.control.initialise import resolve
        from flyserve.control.store import Store

        sd, _implicit = resolve(state_dir)
        try:
            store = Store(sd)
            snap = store.read_version(version)
            if snap is None:
                cur = store.read_current()
                snap = cur if cur is not None and cur.version == version else None
        except (ControlIOError, OSError, ValueError) as exc:
            raise ExplainInputError(
                f"--version {version}: cannot read the state directory's history ({exc})"
            ) from None
        if snap is None:
            raise ExplainInputError(
                f"--version {version}: not in the history of {sd} (never published, or pruned; "
                "`flyserve thresholds history` lists what is kept)"
            )
        return snap.thresholds, f"version {snap.version} of {sd} ({snap.source}, sha256 {snap.sha256[:12]})"
    try:
        base = load_profile(profile)
        if thresholds_file is None:
            return base, f"profile {profile}"
        return (
            base.merged(read_yaml_file(thresholds_file), source=str(thresholds_file)),
            f"{thresholds_file} over profile {profile}",
        )
    except ThresholdsError as exc:
        raise ExplainInputError(str(exc)) from None


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def render(batch: dict[str, Any], source: str, e, prices: dict[str, Any] | None) -> str:
    """The explanation as text, for a person (docs/policy.md shows one)."""
    rows = [("#", "rule", "threshold", "this batch", "verdict")]
    for i, c in enumerate(e.checks, 1):
        rows.append((str(i), c.rule, c.threshold, c.value, c.verdict))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    lines = [
        (
            f"batch: {batch['rows']} rows, {batch['tokens']} tokens, max_query_len {batch['max_query_len']}, "
            f"max_seq_len {batch['max_seq_len']}, {batch['num_heads']} heads, "
            f"{'causal' if batch['causal'] else 'not causal'}; {batch['decode_rows']} decode rows, "
            f"{batch['short_rows']} short rows"
        ),
        f"thresholds: {printable(source, 1024)}",
        "",
    ]
    for r in rows:
        lines.append("  " + "  ".join(r[k].ljust(widths[k]) for k in range(4)) + "  " + r[4])
    lines.append("")
    order = "" if e.lpt is None else f", {'lpt' if e.lpt else 'plain'} ordering"
    lines.append(f"path: {e.path} ({e.reason}){order}")
    if e.lpt_detail:
        lines.append(f"  {e.lpt_detail}")
    if prices is not None:
        lines.append(
            f"costs {printable(prices['costs'])} (block size {prices['block_size']}): unified {_fmt_ms(prices['unified_s'])}, "
            f"prefill {_fmt_ms(prices['prefill_s'])}"
        )
        verdict = (
            "the faster path"
            if prices["routed_s"] <= prices["oracle_s"]
            else (f"{prices['routed_s'] / prices['oracle_s']:.2f}x the oracle")
        )
        lines.append(
            f"oracle: {prices['oracle']} ({_fmt_ms(prices['oracle_s'])}); routed: {e.path} "
            f"({_fmt_ms(prices['routed_s'])}), {verdict}"
        )
        if e.reason == "no_prefill_rows" and prices["routed_s"] > prices["oracle_s"]:
            lines.append(
                "  a batch with no prefill row takes decode_path, fixed at start: only a restart changes it "
                "(`flyserve thresholds advise` prices that under 'needs a restart')"
            )
    return "\n".join(lines)


def explain_command(
    query_lens: Annotated[
        str | None,
        typer.Option("--query-lens", help="Query tokens per row, comma-separated (e.g. 1,1,2048)."),
    ] = None,
    seq_lens: Annotated[
        str | None,
        typer.Option(
            "--seq-lens",
            help="Context per row including its query (vLLM's seq_lens), comma-separated; needed by --costs.",
        ),
    ] = None,
    max_seq_len: Annotated[
        int | None,
        typer.Option(
            "--max-seq-len", min=0, help="The batch's longest context (default: max of --seq-lens)."
        ),
    ] = None,
    num_heads: Annotated[
        int | None,
        typer.Option(
            "--num-heads",
            min=1,
            help="Query heads per rank (default 16, the seed's; the sample's; or --costs' table's).",
        ),
    ] = None,
    not_causal: Annotated[bool, typer.Option("--not-causal", help="The layer is not causal.")] = False,
    sample: Annotated[
        str | None,
        typer.Option(
            "--sample",
            help="A JSON file ('-': stdin) holding the batch: a rank's shape log (<state>/shapes/*.jsonl, one "
            "line per step), one of its lines, or a GET /thresholds/advice answer (its shapes).",
        ),
    ] = None,
    index: Annotated[
        int, typer.Option("--index", help="Which line / shape of --sample (default -1: the newest).")
    ] = -1,
    profile: Annotated[
        str, typer.Option("--profile", help="Thresholds profile (or the base of --thresholds).")
    ] = "gfx950",
    thresholds_file: Annotated[
        Path | None, typer.Option("--thresholds", help="A thresholds YAML file, laid over --profile.")
    ] = None,
    version: Annotated[
        int | None,
        typer.Option(
            "--version",
            min=0,
            help="A published version from --state-dir's history: what would it have done.",
        ),
    ] = None,
    state_dir: StateDirArg = None,
    costs: Annotated[
        str | None,
        typer.Option(
            "--costs", help="Cost table (name or JSON path): each path's predicted time and the oracle."
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            "--block-size", min=1, help="KV block size to price at (default: the sample's, else the table's)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Why one batch goes where: decide()'s rules in order, each with its threshold, the batch's value
    and the verdict; the path and reason; with --costs each path's predicted time and the oracle."""
    import numpy as np

    from flyserve.policy.explain import explain
    from flyserve.policy.shape import BatchShape

    try:
        if (query_lens is None) == (sample is None):
            raise ExplainInputError(
                "give the batch as --query-lens (and --seq-lens) or as --sample, one of them"
            )
        sample_block = None
        heads: int | None  # None: --costs' table's, else 16 (below)
        if sample is not None:
            d = read_sample(sample, index)
            where = d["_where"]
            q = _lens_field(d, "query_lens", where)
            sl = _lens_field(d, "seq_lens", where)
            heads = num_heads if num_heads is not None else _int_field(d, "num_heads", where, default=16)
            causal = bool(d.get("causal", True)) and not not_causal
            msl = (
                max_seq_len
                if max_seq_len is not None
                else (_int_field(d, "max_seq_len", where) if "max_seq_len" in d or sl is None else max(sl))
            )
            if d.get("block_size") is not None:
                sample_block = _int_field(d, "block_size", where)
        else:
            q = parse_lens(query_lens or "", "--query-lens")
            sl = parse_lens(seq_lens, "--seq-lens") if seq_lens is not None else None
            heads, causal = num_heads, not not_causal
            if max_seq_len is None and sl is None:
                raise ExplainInputError("give --seq-lens (per row) or --max-seq-len")
            msl = max_seq_len if max_seq_len is not None else max(sl or [0])
        assert q is not None
        if sl is not None:
            if len(sl) != len(q):
                raise ExplainInputError(f"--seq-lens has {len(sl)} rows, the query lengths {len(q)}")
            if any(s < x for x, s in zip(q, sl, strict=True)):
                raise ExplainInputError(
                    "--seq-lens: each row's context includes its query (seq_len >= query_len)"
                )
        model = None
        if costs is not None:
            from flyserve.pricing.costs import CostModel, CostTableError, load_costs

            try:
                table = load_costs(costs)
                model = CostModel(
                    table,
                    block_size=block_size or (sample_block if sample_block in table.block_sizes else None),
                )
            except CostTableError as exc:
                raise ExplainInputError(f"--costs: {exc}") from None
            if sl is None:
                raise ExplainInputError(
                    "--costs prices rows: give --seq-lens (or a sample that has seq_lens)"
                )
            if heads is None:
                heads = table.num_heads
            elif heads != table.num_heads:
                raise ExplainInputError(
                    f"--costs: table {table.name!r} was measured with {table.num_heads} query heads per rank, "
                    f"the batch has {heads}"
                )
        heads = 16 if heads is None else heads
        t, source = load_thresholds(profile, thresholds_file, version, state_dir)
    except ExplainInputError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None

    qa = np.asarray(q, dtype=np.int64)
    shape = BatchShape.from_query_lens(qa, max_seq_len=msl, num_heads=heads, causal=causal, thresholds=t)
    e = explain(shape, t)
    prices = None
    if model is not None and sl is not None:
        sa = np.asarray(sl, dtype=np.int64)
        u, p = model.predict(qa, sa, "unified"), model.predict(qa, sa, "prefill")
        prices = {
            "costs": model.table.name,
            "block_size": model.block_size,
            "unified_s": u,
            "prefill_s": p,
            "oracle": "prefill" if p < u else "unified",
            "oracle_s": min(u, p),
            "routed_s": p if e.path == "prefill" else u,
        }
    batch = {
        "rows": shape.num_reqs,
        "tokens": shape.num_actual_tokens,
        "max_query_len": shape.max_query_len,
        "max_seq_len": shape.max_seq_len,
        "num_heads": shape.num_heads,
        "causal": shape.causal,
        "decode_rows": shape.num_decode_rows,
        "short_rows": shape.num_short_query_rows,
    }
    if as_json:
        typer.echo(
            json.dumps({"batch": batch, "thresholds": source, **e.to_json(), "costs": prices}, indent=1)
        )
    else:
        typer.echo(printable_block(render(batch, source, e, prices)))  # names from files: the boundary


def register(app: typer.Typer) -> None:
    app.command("explain")(explain_command)
