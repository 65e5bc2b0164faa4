"""The report of `flyserve arms compare`: a terminal table, the JSON file and the margin plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flyserve.files.atomic import atomic_write
from flyserve.terminal.printable import printable


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render_table(report: dict[str, Any], console: Console) -> None:
    arms = report.get("arms", {})
    title = f"flyserve arms: {report['prompts']} prompts x {report['runs']} runs per arm"
    t = Table(title=title, show_lines=False)
    t.add_column("figure")
    t.add_column("A vs B", justify="right")
    t.add_column("A vs A", justify="right")
    t.add_column("B vs B", justify="right")
    selfd = report["self_divergence_share"]
    selfc = report["self_answer_changed_share"]
    t.add_row("responses that diverge", _pct(report["diverged_share"]), _pct(selfd["a"]), _pct(selfd["b"]))
    t.add_row(
        "final answer changes", _pct(report["answer_changed_share"]), _pct(selfc["a"]), _pct(selfc["b"])
    )
    t.add_row("answer changes, of the diverged", _pct(report["answer_changed_given_diverged_share"]), "", "")
    t.add_row(
        "median first-divergence token", _num(report["first_divergence_position_median"], ".0f"), "", ""
    )
    t.add_row("median margin at divergence (nats)", _num(report["margin_median"]), "", "")
    t.add_row("margins exactly 0 (ties)", _pct(report["margin_zero_share"]), "", "")
    t.add_row("divergences without margin", str(report["divergences_without_margin"]), "", "")
    drift = report.get("logprob_drift") or {}

    def _drift(key: str, field: str) -> str:
        d = drift.get(key)
        return "-" if not d else (_pct(d[field]) if field == "share_nonzero" else f"{d[field]:.4g}")

    t.add_row(
        "logprob drift on shared prefix (median of max)",
        *(_drift(k, "median") for k in ("a_vs_b", "a_vs_a", "b_vs_b")),
    )
    t.add_row("pairs with any drift", *(_drift(k, "share_nonzero") for k in ("a_vs_b", "a_vs_a", "b_vs_b")))
    acc = report.get("accuracy")
    if acc:
        se = report.get("accuracy_stderr") or {}
        for arm in ("a", "b"):
            err = se.get(arm)
            t.add_row(
                f"accuracy {arm.upper()} ({report['extractor']})",
                f"{100 * acc[arm]:.2f}%" + (f" +- {100 * err:.2f}" if err is not None else ""),
                "",
                "",
            )
    console.print(t)
    for arm in ("a", "b"):
        info = arms.get(arm)
        if info:  # the model name is the server's: Text, never markup
            url, model = printable(info.get("url")), printable(info.get("model"))
            console.print(Text(f"arm {arm.upper()}: {url}  model {model}"))
    for key in ("accuracy_difference", "divergence_vs_noise"):
        test = report["tests"].get(key)
        if test:
            statement = printable(test["statement"], 1024)
            console.print(Text.assemble((key.replace("_", " "), "bold"), f": {statement}"))


def write_json(report: dict[str, Any], path: Path) -> None:
    atomic_write(path, json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Histogram of the top-two logprob margin at the first divergence: cross-arm and each arm vs itself.

    matplotlib is optional (the `lab` extra) and imported here only.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("--plot needs matplotlib (pip install 'flyserve[lab]')") from exc

    cross = report["divergence_margins"]
    selfm = report["self_divergence_margins"]
    series = [("A vs B", cross), ("A vs A", selfm["a"]), ("B vs B", selfm["b"])]
    every = cross + selfm["a"] + selfm["b"]
    top = max(every) if every and max(every) > 0 else 1.0
    w = top / 30
    # Exact ties get a bin of their own left of 0, so "exactly 0" is visible next to "just above 0".
    edges = [-w, 0.0] + [w * k for k in range(1, 31)]
    fig, (hist, ecdf) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in series:
        if not values:
            continue
        shown = [-w / 2 if v == 0.0 else v for v in values]
        hist.hist(shown, bins=edges, histtype="step", linewidth=1.5, label=f"{label} (n={len(values)})")
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ecdf.step([0.0, *xs], [0.0, *ys], where="post", label=label)
    hist.axvline(0.0, color="grey", linewidth=0.5)
    hist.set_xticks([-w / 2, *[top * k / 4 for k in range(1, 5)]])
    hist.set_xticklabels(["=0", *[f"{top * k / 4:.2g}" for k in range(1, 5)]])
    hist.set_xlabel("top-1 minus top-2 logprob at the first divergence (nats)")
    hist.set_ylabel("diverged response pairs")
    ecdf.set_xlabel("margin (nats); the jump at 0 is the share of exact ties")
    ecdf.set_ylabel("share of diverged pairs with margin <= x")
    ecdf.set_ylim(0, 1.02)
    med, zero = report["margin_median"], report["margin_zero_share"]
    fig.suptitle(
        f"{report['prompts']} prompts x {report['runs']} runs: A vs B diverged {_pct(report['diverged_share'])}, "
        f"median margin {_num(med)}, exactly 0: {_pct(zero)} (margins from the left arm: A, or the earlier run)",
        fontsize=9,
    )
    if every:
        hist.legend()
        ecdf.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
