"""Instrumentation overhead on a GPU (telemetry issue, item 5): a decode-shaped step loop, bare vs
fully instrumented, interleaved, under torch.cuda.set_sync_debug_mode("error").

One step = what a rank does per engine step for attention: build the BatchShape from the host
query_start_loc, decide, then one attention call per layer (32 layers, vLLM's Triton unified
attention, each layer its own KV blocks, q and output).

* bare: shape + decide + 32 kernel calls.
* full (instrumented): RankControl.current(step) + shape + decide + DispatchRecorder.record (metrics in
  multiprocess files, spans sampled at 1% into a no-op exporter through the synchronous
  SimpleSpanProcessor: the worst case, an OTLP set-up exports on a background thread) + the
  KernelTimer wrapping every kernel call (CUDA events on 1 call in 16, harvested with query()).

plus two partial variants (record: control + recorder only; timer: the kernel timer only) that
say where an overhead comes from. Each run is ``steps`` steps timed by the host clock between two
synchronizes (outside the sync-error region); the variants' runs alternate, order reversed every
round, ``pairs`` rounds. Reported: per-round ratio variant/bare (median, quartiles, min, max), the step times,
and, separately, the host microseconds per step of the instrumentation calls alone (the same
calls with the kernels left out; median of many repetitions), beside the step time.

Usage (on the device): PYTHONPATH=/tmp/site:. python3 scripts/gpu/overhead_loop.py OUT.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAYERS = 32
# bare: shape + decide + kernels; record: + RankControl.current + DispatchRecorder.record;
# timer: + KernelTimer around every kernel call; full: both (what a served rank does).
VARIANTS = ("bare", "record", "timer", "full")
SHAPES = [
    {"name": "gpu-bound: 32 decode rows @ 8k", "rows": 32, "ctx": 8192, "steps": 30},
    {"name": "launch-bound: 8 decode rows @ 2k", "rows": 8, "ctx": 2048, "steps": 60},
]
# The kernel timer's sampling (1 call in N per path; the loop uses 16, vLLM ranks default
# to 256) and which shapes to run ("all", or "launch" for the launch-bound one only).
TIMER_EVERY = int(os.environ.get("FLYSERVE_OVERHEAD_EVERY", "16"))
if os.environ.get("FLYSERVE_OVERHEAD_SHAPES", "all") == "launch":
    SHAPES = SHAPES[1:]


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [xs[0], statistics.median(xs), xs[-1]]
    return {
        "median": statistics.median(xs),
        "q1": q[0],
        "q3": q[2],
        "min": xs[0],
        "max": xs[-1],
        "mean": statistics.fmean(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


def main(out_path: str, pairs: int = 30) -> dict:
    import torch
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from flyserve.control import RankControl
    from flyserve.lab import bench
    from flyserve.lab.kernels import get_kernel
    from flyserve.policy import BatchShape, Thresholds, decide
    from flyserve.telemetry import metrics
    from flyserve.telemetry.gpu_timer import KernelTimer
    from flyserve.telemetry.recorder import DispatchRecorder
    from flyserve.telemetry.tracing import setup_tracing

    class NullExporter(SpanExporter):
        def __init__(self) -> None:
            self.n = 0

        def export(self, spans):  # type: ignore[override]
            self.n += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    tmp = Path(tempfile.mkdtemp(prefix="flyserve-overhead-"))
    metrics.setup_multiprocess(tmp / "metrics", wipe=True)
    exporter = NullExporter()
    tracing = setup_tracing(exporter=exporter, ratio=0.01)
    recorder = DispatchRecorder(0, tracing=tracing)
    timer = KernelTimer(0, every=TIMER_EVERY, clock="cuda", tracing=tracing)
    control = RankControl(tmp / "state", 0, profile="gfx950").start()
    t = Thresholds.load("gfx950")
    ua = get_kernel("triton_unified")
    report: dict = {
        "device": bench.device_info(),
        "layers": LAYERS,
        "pairs": pairs,
        "timer_every": TIMER_EVERY,
        "span_ratio": 0.01,
        "variants": list(VARIANTS),
        "shapes": [],
    }
    counter = [0]

    def make_step(variant: str, qsl: np.ndarray, ctx: int, layer_args: list, with_kernels: bool):
        use_control = variant in ("record", "full")
        use_record = variant in ("record", "full")
        use_timer = variant in ("timer", "full")
        layers = layer_args if with_kernels else [None] * LAYERS

        def steps(n: int) -> None:
            for _ in range(n):
                counter[0] += 1
                step = counter[0]
                if use_control:
                    snap = control.current(step)
                    th, version = snap.thresholds, snap.version
                else:
                    th, version = t, 0
                shape = BatchShape.from_query_start_loc(qsl, max_seq_len=ctx, num_heads=32, thresholds=th)
                d = decide(shape, th)
                if use_record:
                    recorder.record(d, shape, step, version)
                if use_timer:
                    tp = timer.path(d.path)
                    for a in layers:
                        tok = tp.start()
                        if a is not None:
                            ua(*a)
                        tp.stop(tok)
                elif with_kernels:
                    for a in layers:
                        ua(*a)

        return steps

    def run(fn, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(n)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    try:
        for sh in SHAPES:
            rows, ctx, steps = sh["rows"], sh["ctx"], sh["steps"]
            lay = bench.Layout(32, 8, 128, 16)
            pool = bench.KVPool(lay, int(LAYERS * rows * (ctx + 16) * 1.05))
            layer_args = [
                bench.make_batch(pool, [1] * rows, [ctx] * rows).args(pool, lay.scale) for _ in range(LAYERS)
            ]
            qsl = np.arange(rows + 1, dtype=np.int32)
            loops = {v: make_step(v, qsl, ctx, layer_args, True) for v in VARIANTS}
            for fn in loops.values():  # warm-up: Triton compile, event pool, metric files
                run(fn, 3)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            order = list(VARIANTS)
            for k in range(pairs):
                seq = order if k % 2 == 0 else order[::-1]
                for v in seq:
                    times[v].append(run(loops[v], steps))
            ratios = {
                v: [a / b for a, b in zip(times[v], times["bare"], strict=True)]
                for v in VARIANTS
                if v != "bare"
            }
            # host cost of the calls alone: the same loops with the kernels left out
            host = {v: make_step(v, qsl, ctx, layer_args, False) for v in VARIANTS}
            host_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(21):
                for v in VARIANTS:
                    host_us[v].append(run(host[v], 200) * 1e6)
            hb = statistics.median(host_us["bare"])
            entry = {
                "shape": sh["name"],
                "rows": rows,
                "ctx": ctx,
                "steps_per_run": steps,
                "step_ms": {v: _quantiles([x * 1e3 for x in times[v]]) for v in VARIANTS},
                "ratio": {v: _quantiles(r) for v, r in ratios.items()},
                "host_us_per_step": {v: statistics.median(h) for v, h in host_us.items()},
                "host_us_added_per_step": {
                    v: statistics.median(host_us[v]) - hb for v in VARIANTS if v != "bare"
                },
                "sync_errors": 0,
            }
            report["shapes"].append(entry)
            print(
                json.dumps(
                    {
                        "shape": entry["shape"],
                        "bare_ms": entry["step_ms"]["bare"]["median"],
                        "ratio_median": {v: round(q["median"], 5) for v, q in entry["ratio"].items()},
                        "ratio_iqr": {
                            v: [round(q["q1"], 5), round(q["q3"], 5)] for v, q in entry["ratio"].items()
                        },
                        "host_us_added": {v: round(x, 1) for v, x in entry["host_us_added_per_step"].items()},
                    }
                )
            )
            del layer_args, pool, loops
            torch.cuda.empty_cache()
    finally:
        control.stop()
    timer.harvest()
    report["spans_exported"] = exporter.n
    report["timer_pending_at_end"] = timer.pending
    Path(out_path).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1], pairs=int(sys.argv[2]) if len(sys.argv) > 2 else 30)
