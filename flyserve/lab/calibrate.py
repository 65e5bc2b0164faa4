"""``flyserve calibrate``: measure both kernel paths over a grid of batch shapes on this GPU, fit
the dispatch thresholds to the measurements, write the profile and the cost table.

The fit (``fit_thresholds``, pure numpy, no GPU; flyserve.pricing.fit, shared with the
sidecar's live advice) minimises the total routed time over the measured grid: for every measured
batch the routing picks a path under the candidate thresholds and is charged that path's measured
time. Knobs the grid does not measure (block_m, the LPT rule) come from the base profile or flags.

Generalisation is checked separately: ``flyserve replay --workload all`` on the six seed
workloads (docs/performance.md).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyserve.files import safe_read
from flyserve.files.atomic import atomic_write
from flyserve.policy import PREFILL, UNIFIED, Thresholds
from flyserve.pricing.costs import CostEntry, CostTable
from flyserve.pricing.fit import FitReport, fit_thresholds
from flyserve.thresholds_files import load_profile

MAX_PARTIAL_BYTES = 256 << 20
"""A resume file holds one line per measured shape (a few hundred, under 1 MB); more is refused."""

# ----------------------------------------------------------------------------- grids


@dataclass(frozen=True)
class GridPoint:
    kind: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.kind}:{_rle(self.query_lens)}/{_rle(self.seq_lens)}"


def _rle(xs: Sequence[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j < len(xs) and xs[j] == xs[i]:
            j += 1
        out.append(f"{xs[i]}x{j - i}" if j - i > 1 else str(xs[i]))
        i = j
    return ",".join(out)


def mixed(decode_rows: int = 0, decode_ctx: int = 0, chunks: Iterable[tuple[int, int]] = ()) -> GridPoint:
    """decode rows (query 1 at decode_ctx) first, then chunks (q tokens after p earlier tokens)."""
    q = [1] * decode_rows + [c[0] for c in chunks]
    s = [decode_ctx] * decode_rows + [c[0] + c[1] for c in chunks]
    return GridPoint("mixed", tuple(q), tuple(s))


def build_grid(spec: dict[str, Any]) -> list[GridPoint]:
    pts: list[GridPoint] = []
    for r in spec["decode"]["rows"]:
        for c in spec["decode"]["ctx"]:
            pts.append(GridPoint("decode", (1,) * r, (c,) * r))
    for q in spec["prefill"]["q"]:
        for p in spec["prefill"]["p"]:
            pts.append(GridPoint("prefill", (q,), (q + p,)))
    for m in spec.get("mixed", []):
        pts.append(
            mixed(m.get("decode_rows", 0), m.get("decode_ctx", 0), [tuple(c) for c in m.get("chunks", [])])
        )
    return pts


GRIDS: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B-shaped serving, contexts to 64k: the six seed workloads' range.
    "default": {
        "decode": {"rows": [1, 4, 16, 32, 64], "ctx": [1024, 4096, 16384, 65536]},
        "prefill": {"q": [16, 128, 512, 2048, 8192, 32768], "p": [0, 4096, 16384, 49152]},
        "mixed": [
            {"decode_rows": 8, "decode_ctx": 32768, "chunks": [[8192, 24576]]},
            {"decode_rows": 32, "decode_ctx": 32768, "chunks": [[8192, 24576]]},
            {"decode_rows": 16, "decode_ctx": 8192, "chunks": [[2048, 6144]]},
            {"decode_rows": 31, "decode_ctx": 8192, "chunks": [[2048, 6144]]},
            {"decode_rows": 7, "decode_ctx": 61440, "chunks": [[49, 61391]]},
            {"decode_rows": 31, "decode_ctx": 61440, "chunks": [[1024, 30000]]},
            {"decode_rows": 4, "decode_ctx": 1024, "chunks": [[64, 960]]},
            {"chunks": [[8192, 0]] * 4},
            {"chunks": [[512, 0]] * 4},
            {"decode_rows": 0, "chunks": [[4, 32764]] * 32},
            {"decode_rows": 3, "decode_ctx": 9000, "chunks": [[20460, 0], [12282, 0]]},
        ],
    },
    # A smoke test: a few shapes of each kind.
    "quick": {
        "decode": {"rows": [1, 32], "ctx": [1024, 16384]},
        "prefill": {"q": [128, 8192], "p": [0, 8192]},
        "mixed": [{"decode_rows": 8, "decode_ctx": 8192, "chunks": [[2048, 6144]]}],
    },
}


def load_grid(name_or_path: str) -> list[GridPoint]:
    if name_or_path in GRIDS:
        return build_grid(GRIDS[name_or_path])
    try:
        spec = safe_read.read_json(Path(name_or_path), 1 << 20, follow_symlinks=True)
        if spec is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", name_or_path)
        return build_grid(spec)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(
            f"--grid {name_or_path!r}: not a known grid ({', '.join(GRIDS)}) "
            f"nor a readable grid JSON ({exc})",
            2,
        ) from exc


# ----------------------------------------------------------------------------- writing


def profile_yaml(t: Thresholds, header: Sequence[str]) -> str:
    """The profile document: a comment header (provenance) then one key per line."""
    import yaml

    lines = [f"# {h}" if h else "#" for h in header]
    body = yaml.safe_dump(t.model_dump(), sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body


class CalibrationError(RuntimeError):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename (a crash leaves the old file or
    the new one, never half of one); both calibrators write their profile and cost table with it."""
    atomic_write(path, text)


def write_calibration(
    out_costs: Path, out_profile: Path, table: CostTable, fit: FitReport, shapes: int, header: Sequence[str]
) -> str:
    """Write the cost table and the fitted profile (each atomically); the line that says so. One
    writer for the device and the CPU calibration, so both say the same thing the same way."""
    atomic_write_text(out_costs, table.to_json())
    atomic_write_text(out_profile, profile_yaml(fit.thresholds, header))
    return (
        f"wrote {out_costs} ({shapes} shapes) and {out_profile}: routed/oracle on the grid "
        f"{fit.routed_over_oracle:.4f}, decode_path {fit.thresholds.decode_path}"
    )


def run_calibration(
    *,
    out_profile: Path,
    out_costs: Path,
    grid: str,
    block_sizes: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    platform: str,
    base_profile: str,
    block_m: int | None,
    resume: bool,
    partial: Path | None,
    command: str,
) -> str:
    """Measure, check, fit, write. Raises CalibrationError with an exit code on failure."""
    from flyserve.lab import bench
    from flyserve.lab.kernels import PAIRS, KernelUnavailable, get_kernel

    points = load_grid(grid)
    try:
        bench.require_cuda()
    except bench.GpuUnavailable as exc:
        raise CalibrationError(str(exc), 3) from exc
    if platform not in PAIRS:
        raise CalibrationError(f"--platform {platform!r}: expected one of {', '.join(PAIRS)}", 2)
    pair = PAIRS[platform]
    try:
        kernels = {UNIFIED: get_kernel(pair.unified), PREFILL: get_kernel(pair.prefill)}
    except KernelUnavailable as exc:
        raise CalibrationError(str(exc), 4) from exc
    base = load_profile(base_profile)
    if block_m is not None:
        base = base.merged({"block_m": block_m})

    partial = partial or out_costs.with_name(out_costs.name + ".partial.jsonl")
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if resume and partial.is_file():
        try:
            text = safe_read.read_text(partial, MAX_PARTIAL_BYTES, follow_symlinks=True) or ""
        except safe_read.SafeReadError as exc:
            raise CalibrationError(f"--partial: {exc}") from None
        for line in text.splitlines():
            if line.strip():
                try:
                    rec = safe_read.loads_record(line)
                    done[(rec["block_size"], rec["key"])] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill: measured again
    elif partial.exists():
        partial.unlink()
    partial.parent.mkdir(parents=True, exist_ok=True)

    info = bench.device_info()
    bench.warm_gpu()
    todo = [(bs, p) for bs in block_sizes for p in points]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with (
        Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        ) as prog,
        partial.open("a", encoding="utf-8") as sink,
    ):
        task = prog.add_task("calibrating", total=len(todo))
        pools: dict[int, Any] = {}
        for bs, p in todo:
            prog.update(task, description=f"bs {bs} {p.kind} {p.key[:40]}")
            if (bs, p.key) in done:
                prog.advance(task)
                continue
            lay = bench.Layout(num_heads, num_kv_heads, head_size, bs)
            if bs not in pools:
                pools.clear()  # one pool at a time: free the last block size's memory first
                # the largest batch, or 4 rotated sets of a batch just under the 256 MiB rotation limit
                rotated = 4 * (256 << 20) // lay.kv_bytes_per_token()
                need = max(max(sum(pt.seq_lens) + bs * len(pt.seq_lens) for pt in points), rotated)
                pools[bs] = bench.KVPool(lay, int(need * 1.1))
            pool = pools[bs]
            sets = bench.sets_for(pool, list(p.query_lens), list(p.seq_lens))
            rec: dict[str, Any] = {
                "block_size": bs,
                "key": p.key,
                "kind": p.kind,
                "query_lens": list(p.query_lens),
                "seq_lens": list(p.seq_lens),
                "ms": {},
                "rel_err": {},
                "spread": {},
            }
            for path, k in kernels.items():
                res = bench.check_kernel(k, pool, sets[0])
                if res["nan"] or not res["rel_err"] < bench.REL_TOL:
                    raise CalibrationError(
                        f"{k.name} gave a wrong result at block size {bs}, shape {p.key}: "
                        f"{res['nan']} non-finite outputs, rel_err {res['rel_err']:.3g} (tol {bench.REL_TOL})",
                        5,
                    )
                tm = bench.time_kernel(k, pool, sets)
                rec["ms"][path] = tm["median_s"] * 1e3
                rec["rel_err"][path] = res["rel_err"]
                rec["spread"][path] = [tm["min_s"] * 1e3, tm["max_s"] * 1e3, int(tm["reps"])]
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            done[(bs, p.key)] = rec
            prog.advance(task)

    entries = []
    for bs, p in todo:
        rec = done[(bs, p.key)]
        extra = {"block_size": bs, "rel_err": rec["rel_err"], "spread_ms": rec["spread"]}
        entries.append(
            CostEntry(p.kind, p.query_lens, p.seq_lens, {k: v / 1e3 for k, v in rec["ms"].items()}, extra)
        )
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = {
        **info,
        "date": now,
        "command": command,
        "platform": platform,
        "kernels": {UNIFIED: pair.unified, PREFILL: pair.prefill},
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "dtype": "bfloat16",
        "block_size": block_sizes[0],
        "block_sizes": list(block_sizes),
        "grid": grid,
        "method": "median of CUDA-event-timed calls (random bf16 data, blocks scattered in a pool, "
        "small batches rotated over 4 input sets); every shape checked against a float32 "
        "torch reference on sampled tokens after NaN-poisoning the output",
    }
    table = CostTable(out_costs.stem, meta, tuple(entries))
    fit = fit_thresholds(entries, num_heads=num_heads, base=base)
    per_bs = {
        bs: fit_thresholds(
            [e for e in entries if e.extra["block_size"] == bs], num_heads=num_heads, base=base
        ).thresholds
        for bs in block_sizes
    }
    agree = all(t == fit.thresholds for t in per_bs.values())
    header = [
        f"flyserve thresholds profile: {out_profile.stem} ({info['gpu']})",
        "Produced by `flyserve calibrate`; re-run it rather than hand-editing the fitted values.",
        f"command: {command}",
        f"date: {now}",
        f"GPU: {info['gpu']}; vLLM {info['vllm']}; torch {info['torch']}; triton {info['triton']}",
        f"kernel pair: unified = {pair.unified}, prefill = {pair.prefill}",
        f"layer: {num_heads} query heads, {num_kv_heads} KV heads, head size {head_size}, bf16",
        f"block sizes measured: {', '.join(map(str, block_sizes))}",
        f"fitted on {fit.entries} measured shapes (grid '{grid}', cost table {out_costs.name}):",
        f"  routed {fit.routed_s * 1e3:.2f} ms vs oracle {fit.oracle_s * 1e3:.2f} ms (x{fit.routed_over_oracle:.4f}),",
        f"  always-unified {fit.unified_s * 1e3:.2f} ms, always-prefill {fit.prefill_s * 1e3:.2f} ms;",
        f"  {fit.wrong} shapes on the slower path",
        f"decode-only shapes: unified {fit.decode_unified_s * 1e3:.2f} ms, prefill {fit.decode_prefill_s * 1e3:.2f} ms",
        f"  -> decode_path {fit.thresholds.decode_path}",
        "per-block-size fits "
        + (
            "agree"
            if agree
            else "differ: "
            + "; ".join(
                f"bs {bs}: {fit.thresholds.diff(t)}" for bs, t in per_bs.items() if t != fit.thresholds
            )
        ),
        "",
    ]
    return write_calibration(out_costs, out_profile, table, fit, len(entries), header)
