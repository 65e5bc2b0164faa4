"""Per-step host budget on a GPU: a decode step loop at the serving default, with and without
flyserve, interleaved, under torch.cuda.set_sync_debug_mode("error").

One step = what a rank does per engine step for attention: the routing's select() on the step's
metadata, then one attention forward per layer (32 layers, vLLM's Triton unified attention, each
layer its own KV blocks, q and output). Variants:

* none: the forwards alone, through a plain impl's forward() (vLLM without flyserve).
* bare: + BatchShape.from_query_start_loc + decide() (the previous loop's baseline, kept so its
  numbers compare).
* serve: what a served rank runs: the real FlyserveRouting.select() (RankRuntime with its control
  thread, DispatchRecorder in multiprocess metric files, the 1-in-8 shape sample, the kernel timer
  armed once per step, FLYSERVE_KERNEL_TIMER_EVERY at its serving default) and every forward
  through flyserve's TimedCompositeImpl (backends.py), whose forward the routing switches to the
  checked one only on a timed or prefill step (forward_switch.py; CUDA events on the armed
  forward, harvested with query()). No OTLP endpoint is set: no spans, as served without one.

Each run is ``steps`` steps timed by the host clock between two synchronizes (outside the
sync-error region); the variants alternate, order reversed every round, ``pairs`` rounds. Reported
per shape: per-round ratio variant/none and variant/bare (median, quartiles, min, max), step
times, and the host microseconds per step of the calls alone (the same loops with the kernels left
out; median and quartiles of ``host_reps`` runs of 200 steps, interleaved), minus none's.

Also, on this machine's idle host: select() on a 256-row decode step, a 256-row mixed step and a
2-row step beside a bare np.diff of the same query_start_loc (min of repeats, interleaved), the
benchmark of benchmarks/test_bench_routing.py without pytest (the device has no vLLM, so the
metadata is a stand-in with the same fields).

Usage (on the device): PYTHONPATH=/tmp/site:. python3 scripts/gpu/overhead_loop.py OUT.json [PAIRS]
On a machine without CUDA, ``--host-only`` runs the select()/np.diff table alone, and the full
script runs its loops with a no-op kernel (a dry run: it checks the script, measures nothing).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

import numpy as np

LAYERS = 32
HEADS = 32
VARIANTS = ("none", "bare", "serve")
SHAPES = [
    {"name": "gpu-bound: 32 decode rows @ 8k", "rows": 32, "ctx": 8192, "steps": 30},
    {"name": "launch-bound: 8 decode rows @ 2k", "rows": 8, "ctx": 2048, "steps": 60},
]
SELECT_STEPS = {
    "decode-256": ([1] * 256, 8192),
    "mixed-256": ([1] * 248 + [1024] * 8, 61440),
    "2-rows": ([1, 2048], 4096),
}


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [xs[0], statistics.median(xs), xs[-1]]
    return {
        "median": statistics.median(xs),
        "q1": q[0],
        "q3": q[2],
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


def _metadata(query_lens: list[int], max_seq_len: int, torch_mod) -> SimpleNamespace:
    """The CommonAttentionMetadata fields the routing reads (query_start_loc_cpu a CPU tensor)."""
    q = np.asarray(query_lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    n = len(query_lens)
    # As vLLM 0.32 passes them: prefixes of persistent CPU buffers (gpu_model_runner.py).
    qsl_buf = torch_mod.zeros(1024, dtype=torch_mod.int32)
    qsl_buf[: n + 1] = torch_mod.from_numpy(qsl)
    seq_buf = torch_mod.zeros(1024, dtype=torch_mod.int32)
    seq_buf[:n] = max_seq_len
    return SimpleNamespace(
        query_start_loc_cpu=qsl_buf[: n + 1],
        num_reqs=n,
        num_actual_tokens=int(q.sum()),
        max_query_len=int(q.max()),
        max_seq_len=max_seq_len,
        causal=True,
        seq_lens_cpu_upper_bound=seq_buf[:n],
        seq_lens=seq_buf[:n],
    )


def _fake_layer() -> SimpleNamespace:
    impl = SimpleNamespace(
        num_heads=HEADS,
        head_size=128,
        scale=128**-0.5,
        alibi_slopes=None,
        sinks=None,
        logits_soft_cap=0,
        sliding_window=-1,
        kv_cache_dtype="auto",
    )
    return SimpleNamespace(impl=impl, sliding_window=None)


def build_rank(state: Path):
    """The rank runtime and the leader routing object, as vLLM's builder makes them."""
    from flyserve.vllm.eligibility import PrefillKernelSpec
    from flyserve.vllm.routing import routing_class
    from flyserve.vllm.runtime import RankRuntime

    os.environ["FLYSERVE_PROFILE"] = "gfx950"
    for k in ("FLYSERVE_KERNEL_TIMER_EVERY", "FLYSERVE_FORCE_PATH", "FLYSERVE_SHAPE_LOG"):
        os.environ.pop(k, None)
    rt = RankRuntime(state_dir=state, rank=0, start=True)
    RankRuntime._instance = rt
    layers = {f"model.layers.{i}.attn": _fake_layer() for i in range(LAYERS)}
    vcfg = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype="bfloat16", get_num_attention_heads=lambda parallel: HEADS),
        parallel_config=SimpleNamespace(),
    )
    cls = routing_class(PrefillKernelSpec("FLASH_ATTN"), "unified", name="FlyserveRouting_loop")
    return rt, cls(list(layers), vcfg, runtime=rt)


def _select_parts(routing, md, reps: int, number: int) -> dict[str, float]:
    """Where a mixed step's time goes: each piece of select() alone (min of repeats, microseconds)."""
    from flyserve.policy import BatchShape, decide

    t = routing.rt.control.snapshot.thresholds
    n = md.num_reqs + 1
    a = md.query_start_loc_cpu.numpy()
    shape = BatchShape.from_step(
        a, md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len, HEADS, True, 1, 256
    )
    d = decide(shape, t)
    rec = routing.rt.recorder
    parts = {
        "tensor.numpy()": lambda: md.query_start_loc_cpu.numpy(),
        "cached view": lambda: routing._qsl_view(md.query_start_loc_cpu, n),
        "from_step": lambda: BatchShape.from_step(
            a, md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len, HEADS, True, 1, 256
        ),
        "decide": lambda: decide(shape, t),
        "record": lambda: rec.record(d, shape, 1, 0),
    }
    hv = getattr(routing, "_qsl", None)
    if hasattr(hv, "lens"):  # routing with HostView.lens: rows > 8 skip from_step
        lens = hv.lens(md.query_start_loc_cpu, md.num_reqs)
        bound = routing._decode_bound
        parts["HostView.lens"] = lambda: hv.lens(md.query_start_loc_cpu, md.num_reqs)
        parts["count"] = lambda: int(np.count_nonzero(lens <= bound))
    return {k: min(timeit.repeat(f, number=number, repeat=reps)) / number * 1e6 for k, f in parts.items()}


def select_table(routing, torch_mod, reps: int = 9, number: int = 5000) -> dict:
    """select() beside np.diff of the same array, min over interleaved repeats (microseconds)."""
    out = {}
    for name, (lens, ctx) in SELECT_STEPS.items():
        md = _metadata(lens, ctx, torch_mod)
        a = md.query_start_loc_cpu.numpy()
        sel, diff = [], []
        for _ in range(reps):
            sel.append(timeit.timeit(lambda md=md: routing.select(md), number=number) / number * 1e6)
            diff.append(timeit.timeit(lambda a=a: np.diff(a), number=number) / number * 1e6)
        d = routing.last_decision
        out[name] = {
            "select_us": min(sel),
            "np_diff_us": min(diff),
            "ratio": min(sel) / min(diff),
            "decision": f"{d.path}/{d.reason}",
            "parts_us": _select_parts(routing, md, reps, number),
        }
        print(
            json.dumps(
                {
                    "select": name,
                    **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in out[name].items()},
                }
            )
        )
    return out


def main(out_path: str, pairs: int = 30, host_only: bool = False) -> dict:
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="flyserve-overhead-"))
    rt, routing = build_rank(tmp / "state")
    report: dict = {"layers": LAYERS, "pairs": pairs, "variants": list(VARIANTS), "shapes": []}
    report["select_vs_np_diff"] = select_table(routing, torch)
    if host_only:
        Path(out_path).write_text(json.dumps(report, indent=1))
        return report

    from flyserve.lab import bench
    from flyserve.lab.kernels import get_kernel
    from flyserve.policy import BatchShape, decide
    from flyserve.thresholds_files import load_profile
    from flyserve.vllm.backends import PrefillStatus, _with_flyserve_parts

    cuda = torch.cuda.is_available()
    # --dry on a machine without CUDA: the same loops with a no-op kernel (checks the script runs).
    ua = get_kernel("triton_unified") if cuda else (lambda *a: None)
    t = load_profile("gfx950")
    timer = rt.kernel_timer
    report["device"] = bench.device_info() if cuda else {"device": "none (dry run)"}
    report["timer_every_steps"] = getattr(timer, "every_steps", None)  # None: code before per-step mode
    report["timer_every_calls"] = timer.every
    report["timer_clock"] = timer.clock

    class PlainImpl:
        """A vLLM impl's forward signature; the kernel call stands for the composite's child."""

        def forward(
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale=None,
            output_block_scale=None,
        ):
            if layer is not None:
                ua(*layer)

    class _Base:
        @staticmethod
        def get_impl_cls():
            return PlainImpl

        @staticmethod
        def get_builder_cls():
            return object

    timed_impl = _with_flyserve_parts(_Base, "LoopComposite", PrefillStatus("FLASH_ATTN")).get_impl_cls()()
    plain_impl = PlainImpl()
    per_variant_md = (
        SimpleNamespace(_attention_backend_variant=0),
        SimpleNamespace(_attention_backend_variant=1),
    )

    def make_step(variant: str, md, qsl_np: np.ndarray, ctx: int, layer_args: list, with_kernels: bool):
        # impl.forward is looked up on every call, as vLLM's attention op does: the routing switches
        # the class's forward between vLLM's and flyserve's checked one (forward_switch.py).
        layers = layer_args if with_kernels else [None] * LAYERS
        amd0 = per_variant_md[0]
        select = routing.select

        if variant == "none":

            def steps(n: int) -> None:
                for _ in range(n):
                    for a in layers:
                        plain_impl.forward(a, None, None, None, None, amd0, None)

        elif variant == "bare":

            def steps(n: int) -> None:
                for _ in range(n):
                    shape = BatchShape.from_query_start_loc(
                        qsl_np, max_seq_len=ctx, num_heads=HEADS, thresholds=t
                    )
                    decide(shape, t)
                    for a in layers:
                        plain_impl.forward(a, None, None, None, None, amd0, None)

        else:

            def steps(n: int) -> None:
                for _ in range(n):
                    amd = per_variant_md[select(md)]
                    for a in layers:
                        timed_impl.forward(a, None, None, None, None, amd, None)

        return steps

    def run(fn, n: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            fn(n)
            return (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(n)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    step0 = rt.step
    for sh in SHAPES:
        rows, ctx, steps = sh["rows"], sh["ctx"], sh["steps"]
        if cuda:
            lay = bench.Layout(32, 8, 128, 16)
            pool = bench.KVPool(lay, int(LAYERS * rows * (ctx + 16) * 1.05))
            layer_args = [
                bench.make_batch(pool, [1] * rows, [ctx] * rows).args(pool, lay.scale) for _ in range(LAYERS)
            ]
        else:
            pool, layer_args = None, [() for _ in range(LAYERS)]
        md = _metadata([1] * rows, ctx, torch)
        qsl_np = md.query_start_loc_cpu.numpy()
        loops = {v: make_step(v, md, qsl_np, ctx, layer_args, True) for v in VARIANTS}
        for fn in loops.values():  # warm-up: Triton compile, event pool, metric files
            run(fn, 3)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        order = list(VARIANTS)
        for k in range(pairs):
            for v in order if k % 2 == 0 else order[::-1]:
                times[v].append(run(loops[v], steps))
        ratios = {
            f"{v}/{b}": [x / y for x, y in zip(times[v], times[b], strict=True)]
            for v, b in (("bare", "none"), ("serve", "none"), ("serve", "bare"))
        }
        host = {v: make_step(v, md, qsl_np, ctx, layer_args, False) for v in VARIANTS}
        host_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for k in range(31):
            for v in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
                host_us[v].append(run(host[v], 200) * 1e6)
        added = {
            f"{v}-{b}": [x - y for x, y in zip(host_us[v], host_us[b], strict=True)]
            for v, b in (("bare", "none"), ("serve", "none"), ("serve", "bare"))
        }
        entry = {
            "shape": sh["name"],
            "rows": rows,
            "ctx": ctx,
            "steps_per_run": steps,
            "step_ms": {v: _quantiles([x * 1e3 for x in times[v]]) for v in VARIANTS},
            "ratio": {k: _quantiles(r) for k, r in ratios.items()},
            "host_us_per_step": {v: _quantiles(h) for v, h in host_us.items()},
            "host_us_added_per_step": {k: _quantiles(a) for k, a in added.items()},
        }
        report["shapes"].append(entry)
        print(
            json.dumps(
                {
                    "shape": entry["shape"],
                    "none_ms": round(entry["step_ms"]["none"]["median"], 4),
                    "ratio_median": {k: round(q["median"], 5) for k, q in entry["ratio"].items()},
                    "ratio_iqr": {
                        k: [round(q["q1"], 5), round(q["q3"], 5)] for k, q in entry["ratio"].items()
                    },
                    "host_us_added_median": {
                        k: round(q["median"], 2) for k, q in entry["host_us_added_per_step"].items()
                    },
                    "host_us_added_iqr": {
                        k: [round(q["q1"], 2), round(q["q3"], 2)]
                        for k, q in entry["host_us_added_per_step"].items()
                    },
                }
            )
        )
        del layer_args, pool, loops
        if cuda:
            torch.cuda.empty_cache()
    timer.harvest()
    report["steps_routed"] = rt.step - step0
    report["timer_pending_at_end"] = timer.pending
    from flyserve.telemetry import metrics

    report["kernel_seconds_count"] = {
        p: metrics.REGISTRY.get_sample_value("flyserve_kernel_seconds_count", {"path": p, "rank": "0"})
        for p in ("unified", "prefill")
    }
    report["sync_errors"] = 0  # any synchronize inside a run would have raised
    Path(out_path).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], pairs=int(args[1]) if len(args) > 1 else 30, host_only="--host-only" in sys.argv)
