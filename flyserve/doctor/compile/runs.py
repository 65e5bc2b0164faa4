"""The runs: whether this machine can compile, and one child process per variant.

Each variant compiles in its own ``python -m flyserve.doctor.compile_child`` with FlyDSL's
compile-only switches (no GPU, no HIP runtime): a compiler crash or a hang costs that variant
only, and the parent never imports torch or FlyDSL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from flyserve.doctor.compile.errors import CompileCheckError
from flyserve.doctor.compile.results import VariantResult, judge, parse_child_output
from flyserve.doctor.compile.variants import Variant
from flyserve.vllm.flydsl_key import KeyInputs

CHILD_TIMEOUT_S = 600.0
CHILD_ENV = {
    # FlyDSL 0.4.2's names (utils/env.py gives them explicit env_var= without a FLYDSL_ prefix):
    "COMPILE_ONLY": "1",  # lower to a code object, never launch (no HIP runtime here)
    "ARCH": "gfx950",  # the compile target
    "FLYDSL_GPU_ARCH": "gfx950",  # flydsl.runtime.device.get_rocm_arch(): what the kernel builders see
}


def check_machine(kernels_path: str | None, rocm_path: str | None) -> list[str]:
    """Why this machine cannot run the check (empty: it can). Nothing is imported."""
    problems = []
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        problems.append(
            f"needs x86-64 Linux (flydsl's wheel), this is {platform.system()} {platform.machine()}"
        )
    for mod, fix in (
        ("flydsl", "pip install 'flydsl>=0.4.2,<0.6' (flyserve is tested with 0.4.2 and 0.5.0)"),
        ("torch", "pip install torch (the CPU build will do)"),
    ):
        if importlib.util.find_spec(mod) is None:
            problems.append(f"python module {mod!r} is not installed in {sys.executable}: {fix}")
    if not kernels_path:
        problems.append(
            "VLLM_FLYDSL_KERNELS_PATH is not set (a FlyDSL checkout: its kernels/ is not in the wheel)"
        )
    elif not os.path.isdir(os.path.join(kernels_path, "kernels", "attention")):
        problems.append(f"VLLM_FLYDSL_KERNELS_PATH={kernels_path} has no kernels/attention/")
    if not rocm_path:
        problems.append(
            "ROCM_PATH is not set: the compiler links amdgcn/bitcode/ockl.bc and runs llvm/bin/ld.lld under it "
            "(scripts/flydsl-compile-setup.sh makes one from Debian's rocm-device-libs and lld-22)"
        )
    else:
        for rel in ("amdgcn/bitcode/ockl.bc", "llvm/bin/ld.lld"):
            if not os.path.exists(os.path.join(rocm_path, rel)):
                problems.append(f"ROCM_PATH has no {rel}")
    return problems


def child_env(
    *, kernels_path: str, rocm_path: str, cache_dir: str | None, run_only: bool = False
) -> dict[str, str]:
    """The child's environment: FlyDSL's compile-only switches and where everything is."""
    env = dict(os.environ)
    env.update(CHILD_ENV)
    env["VLLM_FLYDSL_KERNELS_PATH"] = os.path.abspath(kernels_path)
    env["ROCM_PATH"] = os.path.abspath(rocm_path)
    if cache_dir:
        env["FLYDSL_RUNTIME_ENABLE_CACHE"] = "1"
        env["FLYDSL_RUNTIME_CACHE_DIR"] = os.path.abspath(cache_dir)
    else:
        env["FLYDSL_RUNTIME_ENABLE_CACHE"] = "0"  # every variant really compiles
    if run_only:
        env["FLYDSL_RUNTIME_RUN_ONLY"] = "1"  # FlyDSL raises instead of compiling on a cache miss
    else:
        env.pop("FLYDSL_RUNTIME_RUN_ONLY", None)
    here = str(Path(__file__).resolve().parents[3])  # this flyserve, not another installed one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def run_child(
    payload: dict[str, Any] | None,
    env: dict[str, str],
    *,
    timeout: float = CHILD_TIMEOUT_S,
    started: Callable[[subprocess.Popen[str]], None] | None = None,
) -> tuple[dict[str, Any] | None, int, str, float]:
    """(result, exit status, stderr tail, wall seconds) of one child process. ``started`` is handed
    the child as soon as it runs (run_variants keeps them, to kill them when the run is abandoned)."""
    args = [sys.executable, "-m", "flyserve.doctor.compile_child"] + ([] if payload else ["--revision"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)  # fmt: skip
    if started:
        started(proc)
    try:
        out, err = proc.communicate(json.dumps(payload) if payload else "", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = f"timed out after {timeout:.0f} s. " + err
    tail = " | ".join(line.strip() for line in err.strip().splitlines()[-3:])[-600:]
    return parse_child_output(out), proc.returncode, tail, round(time.perf_counter() - t0, 1)


def read_revision(env: dict[str, str]) -> dict[str, Any]:
    """The installed FlyDSL revision, as a child reads it (raises CompileCheckError)."""
    child, rc, tail, _ = run_child(None, env)
    if child is None or "revision" not in child:
        detail = (child or {}).get("message") or tail or f"exit status {rc}"
        raise CompileCheckError(f"FlyDSL could not be loaded: {detail}")
    unsupported = (child.get("key") or {}).get("unsupported")
    if unsupported:  # every variant would fail the same way: say it once, naming the version
        raise CompileCheckError(unsupported)
    return child


def key_of(info: dict[str, Any]) -> KeyInputs | None:
    """The key inputs the revision child read (None from a child that reported none)."""
    return KeyInputs.from_record(info.get("key"))


MAX_JOBS = 32
"""The most children at once: each peaks at about 420 MB (measured), so 32 is 13 GB of memory."""


class _Abandoned(Exception):
    """A queued variant not started: the run was abandoned (an error or Ctrl-C elsewhere)."""


def run_variants(
    variants: list[Variant],
    env: dict[str, str],
    *,
    cached: bool,
    save_objects: str | None = None,
    progress: Callable[[int, int, Variant, VariantResult | None], None] | None = None,
    jobs: int = 1,
) -> list[VariantResult]:
    """Compile each variant in its own child, ``jobs`` children at a time (measured: 410-420 MB peak,
    5-27 s each on 2 cores); the results come back in the variants' order whatever order the
    children end in. ``progress`` is called from one thread at a time: (i, n, variant, None) when a
    child starts, with its result when it ends. The first error (or Ctrl-C) abandons the run: no
    queued variant starts, the running children are killed, and that error is raised.

    FlyDSL's disk cache takes concurrent writers (an exclusive file lock per key and an atomic
    replace, 0.4.2 and 0.5.0 alike), so ``--cache-dir`` works with any ``jobs``; of two variants
    sharing a key (warm-up and serve) whichever takes the lock first compiles, the other loads."""
    if not 1 <= jobs <= MAX_JOBS:
        raise CompileCheckError(f"--jobs {jobs}: between 1 and {MAX_JOBS}")
    lock = threading.Lock()
    stop = threading.Event()
    live: set[subprocess.Popen[str]] = set()

    def started(proc: subprocess.Popen[str]) -> None:
        with lock:
            live.add(proc)

    def one(i: int, v: Variant) -> VariantResult:
        if stop.is_set():
            raise _Abandoned(v.name)
        try:
            if progress:
                with lock:
                    progress(i, len(variants), v, None)
            payload = v.as_dict()
            if save_objects:
                payload["save_objects"] = os.path.abspath(save_objects)
            child, rc, tail, wall = run_child(payload, env, started=started)
            status, summary = judge(v, child, rc=rc, stderr_tail=tail, cached=cached)
            r = VariantResult(v, status, summary, child or {}, wall)
            if progress and not stop.is_set():  # an abandoned run's killed children say nothing
                with lock:
                    progress(i, len(variants), v, r)
            return r
        except BaseException:
            stop.set()
            raise

    def abandon() -> None:
        stop.set()
        with lock:
            procs = list(live)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="flydsl-compile")
    try:
        futures = [pool.submit(one, i, v) for i, v in enumerate(variants)]
        pending = set(futures)
        while pending:  # a queued variant can be abandoned a moment before the failure it follows lands
            _, pending = wait(pending, return_when=FIRST_EXCEPTION)
            failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
            real = [e for e in failed if not isinstance(e, _Abandoned)]
            if real:
                raise real[0]
        return [f.result() for f in futures]
    except BaseException:
        abandon()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
