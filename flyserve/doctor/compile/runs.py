"""`flyserve flydsl compile`: FlyDSL's own compiler checks flyserve's call for gfx950, on a CPU.

For a model's geometry (``--model-config`` HF config.json, ``--tp``) and the installed FlyDSL
checkout, every variant a deployment runs is compiled through ``flydsl_kernel.call_paged``, each
in its own process (``compile_child``): the warm-up batch and vLLM's serving batches at each page
size the revision takes, LPT on and off, and the light kernel where it is reachable. Per variant:
ok or the compiler's message, and from the code object the kernel symbol, size, VGPRs, SGPRs, LDS
and spills. ``--wrong-calls`` adds deliberately wrong calls that FlyDSL must reject.

With ``--cache-dir`` the folder is checked (``flyserve.vllm.flydsl_cache``) before any child is
pointed at it - FlyDSL unpickles what it finds there - and refused with the path and the reason;
after the run the entries the children's cache keys name are listed in flyserve's manifest with
their variant, and the report counts the folder's entries for this deployment apart from the rest.

This module is the plan, the runs and the report; nothing here imports torch or FlyDSL (the child
does), so the plan and the parsing are unit-tested without them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flyserve.doctor.compile_child import RESULT_MARK
from flyserve.vllm import flydsl_cache
from flyserve.vllm.flydsl_key import KeyInputs, short

FORMAT = "flyserve-flydsl-compile"
HF_DTYPES = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "fp32", "float": "fp32"}
DTYPE_CHOICES = ("auto", "bf16", "f16", "fp32")
# Serving batches: two requests, one past two 256-row q-blocks, KV longer than the query (chunked
# prefill); and a short one (every request <= 256 query tokens, the light kernel's bound).
SERVE_Q, SERVE_KV = (512, 300), (1024, 2048)
SHORT_Q, SHORT_KV = (200, 100), (1024, 2048)
BATCHES = ("warm-up", "serve", "short", "light")
LIGHT_PAGE = 64  # FlyDSL's light kernel pages only in 64-token tiles (flash_attn_interface _PAGED_TILE)
CHILD_TIMEOUT_S = 600.0
CHILD_ENV = {
    # FlyDSL 0.4.2's names (utils/env.py gives them explicit env_var= without a FLYDSL_ prefix):
    "COMPILE_ONLY": "1",  # lower to a code object, never launch (no HIP runtime here)
    "ARCH": "gfx950",  # the compile target
    "FLYDSL_GPU_ARCH": "gfx950",  # flydsl.runtime.device.get_rocm_arch(): what the kernel builders see
}


class CompileCheckError(ValueError):
    """Bad arguments or a machine that cannot run the check; the message names what and the fix."""


# ----------------------------------------------------------------------------- geometry


@dataclass(frozen=True, slots=True)
class Geometry:
    """What one tensor-parallel rank's attention layers look like to the kernel."""

    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank
    head_size: int
    dtype: str  # bf16 | f16 | fp32
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CompileCheckError(f"{where}: field {key!r} must be a positive integer")
    return value


def geometry_from_hf_config(path: str | os.PathLike[str], *, tp: int = 1, dtype: str = "auto") -> Geometry:
    """Per-rank attention geometry from a Hugging Face ``config.json`` at tensor-parallel size ``tp``.

    Heads split evenly over the ranks; KV heads too when there are at least ``tp`` of them, else
    (as vLLM does) each rank holds one replicated KV head. ``head_dim`` defaults to
    hidden_size / num_attention_heads. A multimodal config's ``text_config`` is used when present.
    """
    where = str(path)
    from flyserve.files import safe_read

    try:  # one reader for operator files: no FIFO waited on, no /dev/zero read, depth and digit caps
        raw = safe_read.read_bytes(Path(path), 16 << 20, source=where, follow_symlinks=True)
        if raw is None:
            raise CompileCheckError(f"{where}: cannot read the model config (No such file or directory)")
        cfg = safe_read.parse_json(raw, source=where)
    except safe_read.SafeReadError as exc:
        raise CompileCheckError(f"{where}: cannot read the model config: {exc.reason}") from None
    if not isinstance(cfg, dict):
        raise CompileCheckError(f"{where}: a HF config.json is a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CompileCheckError("--tp must be a positive integer")
    heads = _positive_int(cfg, "num_attention_heads", where)
    kv_heads = _positive_int(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else heads
    if cfg.get("head_dim") is not None:
        head_size = _positive_int(cfg, "head_dim", where)
    else:
        hidden = _positive_int(cfg, "hidden_size", where)
        if hidden % heads:
            raise CompileCheckError(
                f"{where}: hidden_size is not a multiple of num_attention_heads; set head_dim"
            )
        head_size = hidden // heads
    if heads % tp:
        raise CompileCheckError(f"--tp {tp} does not divide num_attention_heads ({heads}) of {where}")
    if kv_heads >= tp and kv_heads % tp:
        raise CompileCheckError(f"--tp {tp} does not divide num_key_value_heads ({kv_heads}) of {where}")
    if kv_heads < tp and tp % kv_heads:
        raise CompileCheckError(f"--tp {tp} is not a multiple of num_key_value_heads ({kv_heads}) of {where}")
    return Geometry(
        num_heads=heads // tp,
        num_kv_heads=max(1, kv_heads // tp),
        head_size=head_size,
        dtype=resolve_dtype(dtype, cfg.get("torch_dtype", cfg.get("dtype")), where),
        source=f"{Path(path).name}, tp {tp}",
    )


def resolve_dtype(requested: str, config_dtype: Any, where: str = "model config") -> str:
    """The activation dtype vLLM would run: ``--dtype`` if given, else the config's ``torch_dtype``
    (a float32 checkpoint runs in bf16 under vLLM's ``auto``, as on ROCm)."""
    if requested not in DTYPE_CHOICES:
        raise CompileCheckError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested
    if config_dtype is None:
        return "bf16"
    name = HF_DTYPES.get(str(config_dtype).removeprefix("torch."))
    if name is None:
        raise CompileCheckError(
            f"{where}: field 'torch_dtype' is not a dtype vLLM serves attention in; pass --dtype"
        )
    return "bf16" if name == "fp32" else name


# ----------------------------------------------------------------------------- variants


@dataclass(frozen=True, slots=True)
class Variant:
    """One specialization to compile: a batch of a serving situation through call_paged."""

    name: str
    batch: str  # warm-up | serve | short | light | wrong
    layout: str  # contiguous | vllm (vLLM 0.32's AITER cache views, strided)
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    lpt: bool
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    expect: str = "ok"  # ok | rejected
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["q_lens"], d["kv_lens"] = list(self.q_lens), list(self.kv_lens)
        return d


def plan_variants(
    geometry: Geometry,
    *,
    page_sizes: Iterable[int],
    has_causal_lpt: bool,
    wrong_calls: bool = False,
) -> list[Variant]:
    """Every specialization a deployment of ``geometry`` runs on a revision taking ``page_sizes``.

    Per page size: the warm-up batch (contiguous K/V, 512 query tokens) and vLLM's serving batch
    (its AITER cache views) for each LPT value the revision has; a short serving batch (every
    request <= 256 query tokens); at page 64 the light kernel's batch (short, contiguous K/V: the
    lab adapter's; vLLM's strided views never reach it on #1056).
    """
    lpts = (False, True) if has_causal_lpt else (False,)
    g = geometry
    base: dict[str, Any] = {"num_heads": g.num_heads, "num_kv_heads": g.num_kv_heads, "head_size": g.head_size,
                            "dtype": g.dtype}  # fmt: skip
    out: list[Variant] = []
    for page in sorted(set(page_sizes)):
        for lpt in lpts:
            tag = f"p{page}-lpt{int(lpt)}" if has_causal_lpt else f"p{page}"
            out.append(Variant(f"warm-up-{tag}", "warm-up", "contiguous", page, lpt=lpt, q_lens=(512,),
                               kv_lens=(512,), why="flyserve's warm-up batch (before graph capture)", **base))  # fmt: skip
        for lpt in lpts:
            tag = f"p{page}-lpt{int(lpt)}" if has_causal_lpt else f"p{page}"
            out.append(Variant(f"serve-{tag}", "serve", "vllm", page, lpt=lpt, q_lens=SERVE_Q, kv_lens=SERVE_KV,
                               why="a serving prefill batch on vLLM's AITER cache views", **base))  # fmt: skip
        out.append(Variant(f"short-p{page}", "short", "vllm", page, lpt=lpts[-1], q_lens=SHORT_Q, kv_lens=SHORT_KV,
                           why="a serving batch of <= 256 query tokens per request, vLLM's cache", **base))  # fmt: skip
        if page == LIGHT_PAGE:
            out.append(Variant(f"light-p{page}", "light", "contiguous", page, lpt=lpts[-1], q_lens=SHORT_Q,
                               kv_lens=SHORT_KV, why="<= 256 query tokens on contiguous K/V (lab adapter)", **base))  # fmt: skip
    if wrong_calls:
        out.extend(wrong_variants(geometry, has_causal_lpt=has_causal_lpt))
    return out


def wrong_variants(geometry: Geometry, *, has_causal_lpt: bool) -> list[Variant]:
    """Deliberately wrong calls, one fault each, that FlyDSL itself must reject: page 16 (vLLM's
    default block size), head 96, fp32, and a keyword FlyDSL does not have."""
    g = replace(geometry, dtype="bf16" if geometry.dtype == "fp32" else geometry.dtype)
    base: dict[str, Any] = {"batch": "wrong", "layout": "vllm", "num_heads": g.num_heads,
                            "num_kv_heads": g.num_kv_heads, "lpt": has_causal_lpt, "q_lens": SERVE_Q,
                            "kv_lens": SERVE_KV, "expect": "rejected"}  # fmt: skip
    scale = {"softmax_scale": round(g.head_size**-0.5, 6)}
    return [
        Variant("wrong-page16", page_size=16, head_size=g.head_size, dtype=g.dtype, why="page 16", **base),
        Variant("wrong-head96", page_size=64, head_size=96, dtype=g.dtype, why="head size 96", **base),
        Variant("wrong-fp32", page_size=64, head_size=g.head_size, dtype="fp32", why="fp32 q/k/v", **base),
        Variant(
            "wrong-extra-keyword",
            page_size=64,
            head_size=g.head_size,
            dtype=g.dtype,
            why="softmax_scale=",
            extra_kwargs=scale,
            **base,
        ),
    ]


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class VariantResult:
    """A variant and what its child process reported."""

    variant: Variant
    status: str  # ok | fail
    summary: str
    child: dict[str, Any]
    wall_s: float  # the child process, start to exit (imports included)

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant.as_dict(),
            "status": self.status,
            "summary": self.summary,
            "wall_s": self.wall_s,
            **{k: v for k, v in self.child.items() if k not in ("variant",)},
        }


def parse_child_output(stdout: str) -> dict[str, Any] | None:
    """The child's result (its last ``RESULT_MARK`` line), or None if it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK + " "):
            try:
                value = json.loads(line[len(RESULT_MARK) + 1 :])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def judge(
    variant: Variant, child: dict[str, Any] | None, *, rc: int, stderr_tail: str, cached: bool
) -> tuple[str, str]:
    """(status, one-line summary) of a variant from its child's result."""
    if child is None:
        why = f"child process exited {rc} with no result" + (f": {stderr_tail}" if stderr_tail else "")
        return "fail", why
    outcome = child.get("outcome")
    message = f"{child.get('error_type', '')}: {child.get('message', '')}".strip(": ")
    if outcome == "setup-failed":
        return "fail", f"setup failed: {message}"
    kernels = child.get("kernels") or []
    if variant.expect == "rejected":
        if outcome == "raised" and not kernels:
            return "ok", f"rejected by FlyDSL as expected: {message} ({child.get('where', '?')})"
        if outcome == "raised":
            return "fail", f"compiled, then failed (expected FlyDSL to reject it first): {message}"
        return "fail", "FlyDSL accepted a call it must reject"
    if outcome == "raised":
        return "fail", f"{message} ({child.get('where', '?')})"
    if not kernels:
        if cached and child.get("compiles", 0) == 0:
            return "ok", "loaded from FlyDSL's cache: nothing compiled"
        return "fail", "call_paged returned but FlyDSL compiled no code object"
    k = kernels[0]
    if "error" in k:
        return "fail", f"code object unreadable: {k['error']}"
    spills = k["vgpr_spills"] + k["sgpr_spills"]
    return "ok", f"{k['symbol']} {k['code_object_bytes']} B, {k['vgprs']} VGPRs, {spills} spills"


# ----------------------------------------------------------------------------- running


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
    here = str(Path(__file__).resolve().parents[2])  # this flyserve, not another installed one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def run_child(payload: dict[str, Any] | None, env: dict[str, str], *, timeout: float = CHILD_TIMEOUT_S) -> tuple[dict[str, Any] | None, int, str, float]:  # fmt: skip
    """(result, exit status, stderr tail, wall seconds) of one child process."""
    args = [sys.executable, "-m", "flyserve.doctor.compile_child"] + ([] if payload else ["--revision"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)  # fmt: skip
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


def key_line(key: dict[str, Any] | None) -> str:
    """The report's line on what the cache key depends on here, and what that means for a cache."""
    if not key:
        return "cache key inputs: not reported"
    inputs = KeyInputs.from_record(key)
    text = f"cache key inputs: {inputs.describe() if inputs else '?'}"
    text += f" ({key.get('bitcode_files', '?')} .bc files under $ROCM_PATH/amdgcn/bitcode"
    if key.get("bitcode_matches_flydsl") is False:
        text += "; flyserve's fingerprint differs from FlyDSL's"
    text += ")"
    if key.get("bitcode_in_key"):
        text += (
            "; a cache built here hits only on a host with this flydsl and this bitcode: on a CPU machine with "
            "Debian's bitcode this run is a compile check, not a warm start for a ROCm image"
        )
    return text


def run_variants(
    variants: list[Variant],
    env: dict[str, str],
    *,
    cached: bool,
    save_objects: str | None = None,
    progress: Callable[[int, int, Variant, VariantResult | None], None] | None = None,
) -> list[VariantResult]:
    """Compile each variant in its own child, one at a time (measured: 410-420 MB peak, 5-27 s on 2 cores)."""
    results = []
    for i, v in enumerate(variants):
        if progress:
            progress(i, len(variants), v, None)
        payload = v.as_dict()
        if save_objects:
            payload["save_objects"] = os.path.abspath(save_objects)
        child, rc, tail, wall = run_child(payload, env)
        status, summary = judge(v, child, rc=rc, stderr_tail=tail, cached=cached)
        r = VariantResult(v, status, summary, child or {}, wall)
        results.append(r)
        if progress:
            progress(i, len(variants), v, r)
    return results


# ----------------------------------------------------------------------------- the cache folder


def check_cache_arg(cache_dir: str | None) -> None:
    """Refuse a ``--cache-dir`` FlyDSL must not load (CompileCheckError naming the path and the reason)."""
    if not cache_dir:
        return
    try:
        flydsl_cache.check_cache_dir(cache_dir)
    except flydsl_cache.CacheRefused as exc:
        raise CompileCheckError(
            f"--cache-dir {exc.path} refused: {exc.reason}. FlyDSL unpickles what it finds there, so only "
            'this user or root may be able to write it (docs/vllm.md, "The cache is code")'
        ) from None


def deployment_of(geometry: Geometry, page_sizes: Iterable[int]) -> flydsl_cache.Deployment:
    """The variants this run's deployment serves, as the cache check counts them."""
    g = geometry
    return flydsl_cache.Deployment(
        g.num_heads, g.num_kv_heads, g.head_size, g.dtype, tuple(sorted(set(page_sizes)))
    )


def observed_entries(results: list[VariantResult]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(entry, arch of its cache key, variant) of every cache entry a variant that ran as planned used."""
    rows = []
    for r in results:
        if r.status != "ok" or r.variant.batch == "wrong":
            continue
        for e in r.child.get("cache_entries") or []:
            if isinstance(e, dict) and isinstance(e.get("path"), str):
                rows.append((e["path"], e.get("arch"), r.variant.as_dict()))
    return rows


def cache_after_run(
    cache_dir: str | None,
    results: list[VariantResult],
    deployment: flydsl_cache.Deployment,
    key: KeyInputs | None = None,
) -> dict[str, Any] | None:
    """List this run's entries in the folder's manifest (with the key inputs this run had), then
    check the folder again as the server will: the counts (entries for this deployment, for other
    variants, not listed and, given ``key``, stale for this flydsl and bitcode), or the refusal."""
    if not cache_dir:
        return None
    try:
        flydsl_cache.record_entries(cache_dir, observed_entries(results), key=key)
        check = flydsl_cache.check_cache_dir(cache_dir)
    except flydsl_cache.CacheRefused as exc:
        return {"refused": exc.reason}
    except OSError as exc:
        return {"refused": f"the manifest could not be written ({exc.strerror or type(exc).__name__})"}
    return {"arch": check.arch, **check.counts(deployment, key), "describe": check.describe(deployment, key)}


def failed(rep: dict[str, Any]) -> bool:
    """Whether the run failed: a variant did, or the cache it built would be refused by the server."""
    return bool(rep["summary"]["fail"] or (rep.get("cache") or {}).get("refused"))


def report(
    *,
    geometry: Geometry,
    info: dict[str, Any],
    kernels_path: str,
    results: list[VariantResult],
    cache_dir: str | None,
    run_only: bool,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    counts = {s: sum(1 for r in results if r.status == s) for s in ("ok", "fail")}
    return {
        "format": FORMAT,
        "version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flydsl_version": info.get("flydsl_version"),
        "torch_version": info.get("torch_version"),
        "kernels_path": os.path.basename(os.path.abspath(kernels_path)),
        "revision": info.get("revision"),
        "key": info.get("key"),
        "geometry": geometry.as_dict(),
        "target": CHILD_ENV["ARCH"],
        "cache_dir": "given" if cache_dir else None,
        "run_only": run_only,
        "variants": [r.as_dict() for r in results],
        "summary": counts,
        **({"cache": cache} if cache is not None else {}),
    }


# ----------------------------------------------------------------------------- rendering


def served_note(row: dict[str, Any]) -> str:
    """Whether flyserve's server runs this variant, from the child's layout check."""
    v = row["variant"]
    if v["batch"] == "wrong":
        return "-"
    if row.get("outcome") == "setup-failed" or "vllm_layout_problem" not in row:
        return "unknown: setup failed"  # the layout check never ran: nothing says the server runs it
    if v["batch"] == "light":
        return "lab only"
    problem = row.get("vllm_layout_problem")
    return "yes" if problem is None else "no: path off"


def render(rep: dict[str, Any]) -> str:
    """The report as a table (what `flyserve flydsl compile` prints without --json)."""
    g, rev = rep["geometry"], rep.get("revision") or {}
    lines = [
        f"flyserve flydsl compile  {rep['time']}  flydsl {rep.get('flydsl_version')}  target {rep['target']}",
        f"FlyDSL checkout {rep['kernels_path']}: {rev.get('label', '?')}",
        *([key_line(rep["key"])] if rep.get("key") else []),  # reports recorded before it was kept have none
        (
            f"geometry ({g.get('source') or 'flags'}): {g['num_heads']} heads, {g['num_kv_heads']} KV heads per "
            f"rank, head {g['head_size']}, {g['dtype']}"
        ),
        "",
    ]
    head = ("variant", "status", "kernel", "bytes", "VGPR", "SGPR", "LDS", "spills", "compile_s", "served")
    rows = [head]
    for row in rep["variants"]:
        ks = row.get("kernels") or []
        k = ks[0] if ks and "error" not in ks[0] else {}
        rows.append((
            row["variant"]["name"], row["status"], str(k.get("symbol", "-")), str(k.get("code_object_bytes", "-")),
            str(k.get("vgprs", "-")), str(k.get("sgprs", "-")), str(k.get("lds_bytes", "-")),
            str(k["vgpr_spills"] + k["sgpr_spills"]) if k else "-", f"{row.get('call_s', 0):.1f}", served_note(row),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    for row in rep["variants"]:
        if row["status"] != "ok" or row["variant"]["batch"] == "wrong":
            lines.append(f"  {row['variant']['name']}: {row['summary']}")
    problems = sorted(
        {row["vllm_layout_problem"] for row in rep["variants"] if row.get("vllm_layout_problem")}
    )
    for p in problems:
        lines.append(f"  served 'no': flyserve keeps the prefill path off under vLLM's AITER cache: {p}")
    if rep.get("cache"):
        lines.append(f"  {cache_line(rep['cache'])}")
        if rep.get("run_only") and rep["summary"]["fail"] and rep["cache"].get("stale"):
            lines.append(
                f"  run-only misses: {rep['cache']['stale']} entries there were built with another flydsl or another "
                f"ROCm (bitcode here {short((rep.get('key') or {}).get('bitcode'))}); FlyDSL never looks them up: "
                "rebuild the cache with this flydsl on the serving image's ROCm"
            )
    s = rep["summary"]
    lines.append(f"\n{s['ok']} ok, {s['fail']} fail")
    return "\n".join(lines)


def cache_line(cache: dict[str, Any]) -> str:
    """The report's line on the cache folder: refused (the server would not load it), or its entries."""
    if cache.get("refused"):
        return f"FlyDSL cache: refused, the server would not load it: {cache['refused']}"
    return f"FlyDSL cache: {cache.get('describe', '')}"
