"""Runs one real offline vLLM engine (CPU) through five phases; the e2e test checks what it leaves.

Run as a script (vLLM spawns its engine processes, so this needs its own __main__):
    python vllm_offline_runner.py MODEL_DIR STATE_DIR OUT_JSON

Environment (set by the test): FLYSERVE_ATTENTION=1, FLYSERVE_STATE_DIR, FLYSERVE_PROFILE=cpu-tiny,
FLYSERVE_SHAPE_LOG, FLYSERVE_CPU_COMPARE, FLYSERVE_CPU_PREFILL_FAIL_FILE.

Phases (all prompts of a phase are submitted at once, so batches are exact, chunked prefill makes
them mixed):
  1 default     the cpu-tiny profile: both paths carry traffic
  2 unified     operator sets prefill_enabled=false  -> every prefill batch: unified/disabled
  3 prefill     operator admits everything            -> every prefill batch: prefill/admitted
  4 failing     the prefill kernel raises             -> batches re-run on unified, circuit opens
  5 closed      operator closes the circuit           -> prefill admitted again
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

PROMPT_LENS = (6, 24, 70, 130, 260, 420)
EVERYTHING_ADMITTED = {"min_seq_len": 0, "min_qblock_rows": 0, "decode_rows_base": 100000}


def prompts(seed: int, n: int) -> list[dict]:
    r = random.Random(seed)
    return [
        {"prompt_token_ids": [r.randrange(10, 2000) for _ in range(r.choice(PROMPT_LENS))]} for _ in range(n)
    ]


def applied_version(state_dir: str) -> int:
    from pathlib import Path

    reports = [json.loads(p.read_text()) for p in (Path(state_dir) / "ranks").glob("*.json")]
    return min(r["applied_version"] for r in reports)


def settle(llm, plane, state_dir: str) -> int:
    """Run short filler requests until the rank has applied the latest version.

    A published version takes effect at an engine step a little ahead of the ranks' last report,
    and an idle offline engine takes no steps: filler decode steps carry it there."""
    from vllm import SamplingParams

    target = plane.snapshot().version
    for _ in range(30):
        time.sleep(1.2)  # the rank thread reads the control state and reports about once a second
        if applied_version(state_dir) >= target:
            return target
        llm.generate(
            [{"prompt_token_ids": [11, 12, 13]}],
            SamplingParams(max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    raise RuntimeError(f"version {target} was not applied by the rank")


def last_step(state_dir: str) -> int:
    """The engine step the rank reported after the phase (reports are about 1 s apart)."""
    from pathlib import Path

    time.sleep(1.3)
    steps = [json.loads(p.read_text())["step"] for p in (Path(state_dir) / "ranks").glob("*.json")]
    return max(steps)


def main() -> None:
    model, state_dir, out_path = sys.argv[1:4]
    from vllm import LLM, SamplingParams

    from flyserve.control import ControlPlane

    # Margin 0 and no lead time: an idle offline engine does not advance its step, so a version
    # must apply at the rank's next step (it learns of it "late" and applies at once).
    plane = ControlPlane(state_dir, profile="cpu-tiny", step_margin=0, lead_s=0.0)
    plane.reload(actor="e2e", startup=True)  # version 1: the profile, published before the engine starts
    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="bfloat16",
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        max_model_len=1024,
        enable_chunked_prefill=True,
        seed=0,
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    result: dict = {"phases": []}

    def phase(name: str, seed: int, n: int = 10) -> None:
        t0 = time.monotonic()
        outs = llm.generate(prompts(seed, n), params, use_tqdm=False)
        result["phases"].append(
            {
                "name": name,
                "version": plane.snapshot().version,
                "requests": n,
                "finished": sum(1 for o in outs if o.finished),
                "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
                "seconds": round(time.monotonic() - t0, 2),
                "last_step": last_step(state_dir),
            }
        )
        print(f"phase {name}: {result['phases'][-1]}", flush=True)

    phase("default", 1, 12)
    plane.apply_overrides({"prefill_enabled": False}, actor="e2e")
    settle(llm, plane, state_dir)
    phase("unified", 2)
    plane.apply_overrides({"prefill_enabled": True, **EVERYTHING_ADMITTED}, actor="e2e")
    settle(llm, plane, state_dir)
    phase("prefill", 3)
    fail_file = os.environ["FLYSERVE_CPU_PREFILL_FAIL_FILE"]
    open(fail_file, "w").close()
    phase("failing", 4)
    result["circuit_after_failure"] = {
        "open": plane.snapshot().circuit_open,
        "reason": plane.snapshot().circuit_reason,
    }
    os.remove(fail_file)
    plane.set_circuit(False, actor="operator")
    settle(llm, plane, state_dir)
    phase("closed", 5)
    result["history"] = [
        {"version": s.version, "thresholds": s.thresholds.model_dump(), "circuit_open": s.circuit_open}
        for s in plane.history()
    ]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
