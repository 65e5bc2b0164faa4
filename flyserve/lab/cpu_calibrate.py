"""`flyserve calibrate --platform cpu`: the CPU pair's cost table and fitted profile.

The same product as the GPU calibration (a cost table of one-call times per path over a grid of
batch shapes, and a profile fitted to it by flyserve.pricing.fit), measured on the CPU pair the
demo and CI serve with (flyserve.lab.cpu_bench). Default layer: the tiny test model's
(flyserve.vllm.tiny_model: 4 query heads, 2 KV heads, head size 32; vLLM's CPU block size 128),
so the sidecar can price the demo's live traffic with it (``--costs cpu``).

Times are wall clock on a CPU shared with whatever else runs: a median of several calls per shape,
indicative of the ratio between the two paths (which differs by 10-1000x here), not of a
kernel's absolute speed.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from flyserve.lab.calibrate import CalibrationError, GridPoint, build_grid, write_calibration
from flyserve.policy import PREFILL, UNIFIED
from flyserve.pricing.costs import CostEntry, CostTable
from flyserve.pricing.fit import fit_thresholds
from flyserve.thresholds_files import load_profile

CPU_GRIDS: dict[str, dict[str, Any]] = {
    # The tiny model's serving range in the demo and CI: contexts of a few hundred to 2k tokens,
    # --max-num-batched-tokens 256.
    "cpu": {
        "decode": {"rows": [1, 4, 16], "ctx": [128, 512, 2048]},
        "prefill": {"q": [16, 64, 256], "p": [0, 256, 1024]},
        "mixed": [
            {"decode_rows": 4, "decode_ctx": 512, "chunks": [[64, 448]]},
            {"decode_rows": 2, "decode_ctx": 256, "chunks": [[200, 0]]},
            {"chunks": [[128, 0], [128, 0]]},
        ],
    },
    "cpu-quick": {
        "decode": {"rows": [1, 4], "ctx": [128, 512]},
        "prefill": {"q": [16, 128], "p": [0, 256]},
        "mixed": [{"decode_rows": 2, "decode_ctx": 256, "chunks": [[100, 0]]}],
    },
}
CPU_LAYER = {"num_heads": 4, "num_kv_heads": 2, "head_size": 32, "block_size": 128}
"""flyserve.vllm.tiny_model's attention layer, with vLLM's default CPU KV block size."""


def run_cpu_calibration(
    *,
    out_profile: Path,
    out_costs: Path,
    grid: str,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    base_profile: str,
    command: str,
    echo=print,
) -> str:
    """Measure, check, fit, write. Raises CalibrationError (exit codes as the GPU calibration)."""
    if grid not in CPU_GRIDS:
        raise CalibrationError(f"--grid {grid!r}: the CPU grids are {', '.join(CPU_GRIDS)}", 2)
    try:
        from flyserve.lab.cpu_bench import AGREE_TOL, CpuBatch, CpuLayout, cpu_info, time_path
    except ImportError as exc:
        raise CalibrationError(f"the CPU pair needs vllm (CPU build) and torch: {exc}", 4) from exc
    import torch

    points: list[GridPoint] = build_grid(CPU_GRIDS[grid])
    lay = CpuLayout(num_heads, num_kv_heads, head_size, block_size)
    base = load_profile(base_profile)
    entries: list[CostEntry] = []
    threads = torch.get_num_threads()
    # One thread, fastest call: on a shared machine the scheduler only ever adds time (medians of
    # 5 calls with 2 threads on the 2-core CI VM jumped between 0.04 and 20 ms for one shape).
    torch.set_num_threads(1)
    try:
        for i, p in enumerate(points, 1):
            batch = CpuBatch(lay, list(p.query_lens), list(p.seq_lens), seed=i)
            err = batch.agreement()
            if not err < AGREE_TOL:
                raise CalibrationError(
                    f"the CPU paths disagree on shape {p.key}: max |prefill - unified| / max|unified| "
                    f"= {err:.3g} (tol {AGREE_TOL})",
                    5,
                )
            t = {path: time_path(batch, path) for path in (UNIFIED, PREFILL)}
            spread = {path: [v["min_s"] * 1e3, v["max_s"] * 1e3, int(v["reps"])] for path, v in t.items()}
            entries.append(
                CostEntry(
                    p.kind,
                    p.query_lens,
                    p.seq_lens,
                    {path: v["min_s"] for path, v in t.items()},
                    {"block_size": block_size, "agreement": err, "spread_ms": spread},
                )
            )
            echo(
                f"  [{i}/{len(points)}] {p.key[:48]:<48} unified {t[UNIFIED]['min_s'] * 1e3:9.3f} ms  "
                f"prefill {t[PREFILL]['min_s'] * 1e3:9.3f} ms"
            )
    finally:
        torch.set_num_threads(threads)
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    info = cpu_info()
    meta = {
        **info,
        "date": now,
        "command": command,
        "platform": "cpu",
        "kernels": {UNIFIED: "vllm-cpu-attention", PREFILL: "cpu-sdpa-prefill"},
        "isa": lay.isa,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "dtype": "bfloat16",
        "block_size": block_size,
        "block_sizes": [block_size],
        "grid": grid,
        "threads": 1,
        "method": "fastest of at least 5 synchronous calls (perf_counter) after one warm-up, one torch "
        "thread, random bf16 data in a paged cache; every shape first checked by running both paths on "
        "the same data",
    }
    table = CostTable(out_costs.stem, meta, tuple(entries))
    fit = fit_thresholds(entries, num_heads=num_heads, base=base)
    header = [
        f"flyserve thresholds profile: {out_profile.stem} (CPU pair, {info['gpu']})",
        "Produced by `flyserve calibrate --platform cpu`; re-run it rather than hand-editing the fitted values.",
        f"command: {command}",
        f"date: {now}",
        f"torch {info['torch']}; vLLM {info['vllm']}; ISA {lay.isa}",
        "kernel pair: unified = vLLM's CPU attention, prefill = flyserve's CPU SDPA path",
        f"layer: {num_heads} query heads, {num_kv_heads} KV heads, head size {head_size}, bf16, block size {block_size}",
        f"fitted on {fit.entries} measured shapes (grid '{grid}', cost table {out_costs.name}):",
        f"  routed {fit.routed_s * 1e3:.2f} ms vs oracle {fit.oracle_s * 1e3:.2f} ms (x{fit.routed_over_oracle:.4f}),",
        f"  always-unified {fit.unified_s * 1e3:.2f} ms, always-prefill {fit.prefill_s * 1e3:.2f} ms",
        "",
    ]
    return write_calibration(out_costs, out_profile, table, fit, len(entries), header)
