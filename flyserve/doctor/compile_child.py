"""One variant of `flyserve flydsl compile`, in its own process: FlyDSL's compiler, flyserve's call.

Run by ``flyserve.doctor.compile`` as ``python -m flyserve.doctor.compile_child`` with the variant
as JSON on stdin (or ``--revision`` alone), in the environment ``compile.child_env`` builds
(``COMPILE_ONLY=1``, ``ARCH=gfx950``, ...). One process per variant: FlyDSL's JIT keeps every
specialization it compiled in memory, so a second variant in the same process could be served from
the first one's compile and show nothing; and a compiler crash (an abort in native code) then costs
one variant, not the run. Prints one line ``RESULT_MARK <json>`` last; exit status 0 when the
result was printed, whatever it says.

The call is flyserve's own ``flydsl_kernel.call_paged`` with the batch each serving situation hands
it (``flydsl_kernel.warm_up_batch`` for the warm-up, vLLM's AITER cache views for serving).
What it observes of FlyDSL, without changing it: each ``MlirCompiler.compile`` (time and the
code objects in the lowered module's ``gpu.binary``) and each JIT cache key (flydsl 0.4.2's
``_build_full_cache_key``, 0.5.0's ``_artifact_cache_key`` and disk lookups: ``Observer``), with
the cache file it names (``cache_entries``: the folder-relative ``.pkl`` path and the key's target
arch, which `flyserve flydsl compile --cache-dir` lists in flyserve's cache manifest). A flydsl with
neither set of names fails the setup with a message naming its version.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

RESULT_MARK = "@@flyserve-compile-result@@"
DTYPES = {"bf16": "bfloat16", "f16": "float16", "fp32": "float32"}


def short_path(path: str) -> str:
    """A path as it can be shown and committed: under the FlyDSL checkout, in site-packages, or
    the file name."""
    root = os.environ.get("VLLM_FLYDSL_KERNELS_PATH", "")
    if root and os.path.abspath(path).startswith(os.path.abspath(root) + os.sep):
        return os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.basename(path)


def _scrub(text: str) -> str:
    """The message with the checkout path replaced by a placeholder (results get committed)."""
    root = os.environ.get("VLLM_FLYDSL_KERNELS_PATH", "")
    if root:
        text = text.replace(os.path.abspath(root), "$VLLM_FLYDSL_KERNELS_PATH")
    return text


class ObserverUnsupported(RuntimeError):
    """This flydsl's compiler or cache-key internals are not the ones flyserve observes (0.4.2,
    0.5.0); the message names the version."""


class Observer:
    """Records FlyDSL's compiles and cache keys in this process (observation only).

    The hooks follow the installed flydsl's own names, detected by feature (flydsl_layout):
    0.4.2's ``JitFunction._build_full_cache_key`` (the key tuple; the file is
    ``{function}_{manager_key}/{sha256(str(key))[:16]}.pkl``) or 0.5.0's module-level
    ``_artifact_cache_key`` / ``_disk_cache_key`` (jit_function.py 515-554: the file is
    ``{function}/{disk key}.pkl``, read through ``JitCacheManager.get``).
    """

    def __init__(self) -> None:
        self.compiles: list[dict[str, Any]] = []
        self.cache_keys: list[str] = []
        self.cache_entries: list[dict[str, Any]] = []

    def install(self) -> None:
        from flydsl.compiler import jit_function as jf

        from flyserve.vllm.flydsl_layout import BUILD_FOLDERS, FUNCTION_FOLDERS, detect_layout

        layout = detect_layout(jf)
        compile_fn = getattr(getattr(jf, "MlirCompiler", None), "compile", None)
        if layout is None or compile_fn is None:
            raise ObserverUnsupported(unsupported_message(jf))
        self._hook_compile(jf, compile_fn.__func__)
        if layout is BUILD_FOLDERS:
            self._hook_key_042(jf)
        elif layout is FUNCTION_FOLDERS:
            self._hook_key_050(jf)

    def _note(self, text: str, entry: dict[str, Any] | None) -> None:
        if text not in self.cache_keys:
            self.cache_keys.append(text)
        if entry is not None and entry not in self.cache_entries:
            self.cache_entries.append(entry)

    def _hook_compile(self, jf: Any, original: Any) -> None:
        """Time each lowering and keep the code objects of the module it returns (0.4.2 passes the
        module, 0.5.0 its text; both return the lowered module)."""
        observer = self

        def compile_observed(cls: Any, module: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = original(cls, module, **kw)
            observer.compiles.append(
                {"func": kw.get("func_name", ""), "arch": kw.get("arch", ""),
                 "lower_s": round(time.perf_counter() - t0, 2), "objects": gpu_objects(out)}
            )  # fmt: skip
            return out

        jf.MlirCompiler.compile = classmethod(compile_observed)

    def _hook_key_042(self, jf: Any) -> None:
        observer = self
        build_key = jf.JitFunction._build_full_cache_key

        def key_observed(self: Any, *args: Any, **kw: Any) -> Any:
            key = build_key(self, *args, **kw)
            # with FlyDSL's disk cache on, the folder name (function + toolchain/source/closure hash)
            # is the other half of what a cached kernel is found by
            folder = f"{self.func.__name__}_{self.manager_key}" if self.cache_manager else self.func.__name__
            text = f"{folder}: {jf.JitFunction._cache_key_to_str(key)}"
            entry = (
                cache_entry(folder, jf.JitFunction._cache_key_to_str(key), key)
                if self.cache_manager
                else None
            )
            observer._note(text, entry)
            return key

        jf.JitFunction._build_full_cache_key = key_observed

    def _hook_key_050(self, jf: Any) -> None:
        """The artifact key (traced module + pipeline + target: what the strides would change) for
        ``cache_keys``; each disk lookup's file and the arch of the backend that keyed it."""
        observer = self
        artifact_key, manager_get = jf._artifact_cache_key, jf.JitCacheManager.get
        arch: dict[str, str | None] = {}

        def artifact_observed(asm: Any, cfg: Any, backend: Any, **kw: Any) -> Any:
            key = artifact_key(asm, cfg, backend, **kw)
            arch[key] = getattr(getattr(backend, "target", None), "arch", None)
            observer._note(f"artifact {key} (target {arch[key]})", None)
            return key

        def get_observed(self: Any, cache_key: str) -> Any:
            folder = Path(self.cache_dir).name
            target = list(arch.values())[-1] if arch else None  # the key this lookup follows
            observer._note(f"{folder}: {cache_key}", {"path": f"{folder}/{cache_key}.pkl", "arch": target})
            return manager_get(self, cache_key)

        jf._artifact_cache_key = artifact_observed
        jf.JitCacheManager.get = get_observed


def unsupported_message(jf: Any) -> str:
    """Why flyserve cannot observe this flydsl, naming its version and the ones it knows."""
    from flyserve.vllm.flydsl_key import TESTED_FLYDSL, flydsl_version

    return (
        f"flydsl {flydsl_version() or '?'} has neither 0.4.2's JitFunction._build_full_cache_key nor 0.5.0's "
        f"_artifact_cache_key/_disk_cache_key{'' if hasattr(jf, 'MlirCompiler') else ', or no MlirCompiler'} in "
        f"flydsl.compiler.jit_function: its cache-key internals changed again; flyserve's compile check "
        f"follows flydsl {' and '.join(TESTED_FLYDSL)} (pip install 'flydsl>=0.4.2,<0.6')"
    )


def cache_entry(folder: str, key_text: str, key: Any) -> dict[str, Any]:
    """The cache file a 0.4.2 key names and the arch it was built for: FlyDSL 0.4.2 files a
    specialization as ``{folder}/{sha256(str(key))[:16]}.pkl`` (jit_function.py
    JitCacheManager._safe_key) and the key holds ``("_target_", GPUTarget(...))``."""
    target = next((p[1] for p in key if isinstance(p, tuple) and len(p) == 2 and p[0] == "_target_"), None)
    name = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return {"path": f"{folder}/{name}.pkl", "arch": getattr(target, "arch", None)}


def gpu_objects(module: Any) -> list[bytes]:
    """The code objects (HSA ELF bytes) of every ``gpu.binary`` in a lowered module."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu

    out = []
    for op in module.body.operations:
        op = op.operation
        if op.name != "gpu.binary":
            continue
        for attr in ir.ArrayAttr(op.attributes["objects"]):
            out.append(bytes(gpu.ObjectAttr(attr).object))
    return out


def _tensors(spec: dict[str, Any]) -> dict[str, Any]:
    """The batch of one variant, as plain CPU tensors (wrapped as device tensors by the caller)."""
    import torch

    from flyserve.vllm import flydsl_kernel as fk

    dtype = getattr(torch, DTYPES[spec["dtype"]])
    heads, kv_heads, d, page = spec["num_heads"], spec["num_kv_heads"], spec["head_size"], spec["page_size"]
    if spec["batch"] == "warm-up":
        q, k, v, out, kw = fk.warm_up_batch(
            dtype=dtype, device="cpu", num_heads=heads, num_kv_heads=kv_heads, head_size=d, page_size=page
        )
        return {"q": q, "k": k, "v": v, "out": out, **kw}
    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]
    pages = [-(-n // page) for n in kv_lens]
    blocks = sum(pages) + 1
    if spec["layout"] == "vllm":  # vLLM 0.32's AITER unified cache and its own _split_kv_cache
        kv = torch.zeros(blocks, kv_heads, page, 2 * d, dtype=dtype)
        k, v = kv.transpose(1, 2).split(d, dim=-1)
    else:
        k = torch.zeros(blocks, page, kv_heads, d, dtype=dtype)
        v = torch.zeros(blocks, page, kv_heads, d, dtype=dtype)
    total = sum(q_lens)
    q_buf = torch.zeros(total + 16, heads, d, dtype=dtype)  # vLLM hands query[:num_actual_tokens]
    out_buf = torch.zeros_like(q_buf)
    table = torch.zeros(len(q_lens), max(pages), dtype=torch.int32)
    first = 0
    for row, n in enumerate(pages):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n

    def cu(lens: list[int]) -> Any:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return {
        "q": q_buf[:total], "k": k, "v": v, "out": out_buf[:total],
        "cu_seqlens_q": cu(q_lens), "cu_seqlens_kv": cu(kv_lens),
        "seqlen_k": torch.tensor(kv_lens, dtype=torch.int32), "block_table": table,
        "max_seqlen_q": max(q_lens), "max_seqlen_kv": max(kv_lens),
    }  # fmt: skip


def vllm_layout_problem(kernel: Any, spec: dict[str, Any]) -> str | None:
    """flyserve's own layout check on the K/V views vLLM's AITER cache gives at this geometry
    (meta tensors, as ``FlyDSLDualwaveImpl.predicted_layout_problem``): None means the server
    runs FlyDSL for these layers, anything else is the reason it keeps the path off."""
    from flyserve.vllm.flydsl_kernel import kv_layout_problem
    from flyserve.vllm.kv_views import aiter_layer_cache, split_like_aiter

    # vLLM's preferred layout for the AITER unified backend (0.32's only one, 0.34's LBHNC)
    kv = aiter_layer_cache(spec["num_kv_heads"], spec["page_size"], spec["head_size"])
    k, v = split_like_aiter(kv, spec["head_size"])
    return kv_layout_problem(k, v, kernel.revision)


def compile_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one variant through ``call_paged``; the result as a JSON-able dict."""
    from flyserve.doctor import gfx950_stand_in as stand_in
    from flyserve.doctor.code_object import CodeObjectError, kernel_facts

    stand_in.install()
    observer = Observer()
    observer.install()
    from flyserve.vllm import flydsl_kernel as fk

    t0 = time.perf_counter()
    kernel = fk.load_flydsl_kernel()
    load_s = time.perf_counter() - t0
    b = _tensors(spec)
    problem = vllm_layout_problem(kernel, spec) if spec["page_size"] in kernel.revision.page_sizes else None
    if spec.get("extra_kwargs"):  # a deliberately wrong call: call_paged's keywords plus these
        kernel = fk.FlyDSLKernel(
            fn=functools.partial(kernel.fn, **spec["extra_kwargs"]), revision=kernel.revision
        )
    dev = stand_in.on_device
    result: dict[str, Any] = {"load_s": round(load_s, 2), "vllm_layout_problem": problem}
    t0 = time.perf_counter()
    try:
        fk.call_paged(
            kernel, dev(b["q"]), dev(b["k"]), dev(b["v"]), dev(b["out"]),
            cu_seqlens_q=dev(b["cu_seqlens_q"]), cu_seqlens_kv=dev(b["cu_seqlens_kv"]),
            seqlen_k=dev(b["seqlen_k"]), block_table=dev(b["block_table"]),
            max_seqlen_q=b["max_seqlen_q"], max_seqlen_kv=b["max_seqlen_kv"],
            num_kv_heads=spec["num_kv_heads"], lpt=spec["lpt"],
        )  # fmt: skip
        result["outcome"] = "returned"
    except Exception as exc:  # noqa: BLE001 - the compiler's or FlyDSL's message is the result
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f for f in reversed(frames) if "flyserve" not in f.filename), frames[-1])
        result.update(
            outcome="raised",
            error_type=type(exc).__name__,
            message=_scrub(str(exc))[:2000],
            where=f"{short_path(where.filename)}:{where.lineno}",
        )
    result["call_s"] = round(time.perf_counter() - t0, 2)
    kernels = []
    for c in observer.compiles:
        for blob in c["objects"]:
            try:
                facts = [f.as_dict() for f in kernel_facts(blob)]
            except CodeObjectError as exc:
                facts = [{"error": str(exc), "code_object_bytes": len(blob)}]
            for f in facts:
                kernels.append({**f, "func": c["func"], "lower_s": c["lower_s"]})
    result["kernels"] = kernels
    result["compiles"] = len(observer.compiles)
    result["cache_keys"] = [_scrub(k) for k in observer.cache_keys]
    result["cache_entries"] = observer.cache_entries
    result["peak_rss_mb"] = _peak_rss_mb()
    if spec.get("save_objects"):
        os.makedirs(spec["save_objects"], exist_ok=True)
        for n, blob in enumerate(b for c in observer.compiles for b in c["objects"]):
            with open(os.path.join(spec["save_objects"], f"{spec['name']}.{n}.hsaco"), "wb") as fh:
                fh.write(blob)
    return result


def _peak_rss_mb() -> float | None:
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB
    except (ImportError, OSError):
        return None


def key_inputs(revision_label: str) -> dict[str, Any]:
    """The cache key's machine-dependent inputs as this flydsl sees them: its version, its layout and
    the device-bitcode fingerprint. Under 0.5.0 the fingerprint is FlyDSL's own
    (``get_backend().toolkit_fingerprint()``, backends/rocm.py 201-211), checked against flyserve's
    computation of it (flydsl_key.bitcode_fingerprint), so a manifest records what FlyDSL hashed."""
    from flydsl.compiler import jit_function as jf

    from flyserve.vllm import flydsl_key
    from flyserve.vllm.flydsl_layout import detect_layout

    layout = detect_layout(jf)
    out: dict[str, Any] = {
        "unsupported": None if layout and hasattr(jf, "MlirCompiler") else unsupported_message(jf)
    }
    root = flydsl_key.bitcode_root()
    ours = flydsl_key.bitcode_fingerprint(root)
    theirs = None
    if layout is not None and layout.bitcode_in_key:
        from flydsl.compiler.backends import get_backend

        fp = get_backend().toolkit_fingerprint()
        theirs = fp.split(":", 1)[1] if isinstance(fp, str) and fp.startswith("rocm-bitcode:") else None
    inputs = flydsl_key.KeyInputs(flydsl_key.flydsl_version(), layout.name if layout else None,
                                  theirs or ours, revision_label)  # fmt: skip
    out.update(inputs.as_dict())
    out["bitcode_files"] = len(list(Path(root, "amdgcn", "bitcode").glob("*.bc")))
    out["bitcode_matches_flydsl"] = None if theirs is None else theirs == ours
    out["bitcode_in_key"] = bool(layout and layout.bitcode_in_key)
    return out


def revision() -> dict[str, Any]:
    """The installed FlyDSL: what flyserve reads off the real function, the versions, and the key's
    machine-dependent inputs."""
    import flydsl
    import torch

    from flyserve.vllm import flydsl_kernel as fk

    kernel = fk.load_flydsl_kernel()
    rev = kernel.revision.as_dict()
    rev["module_file"] = short_path(kernel.revision.module_file)
    return {"revision": rev, "flydsl_version": flydsl.__version__, "torch_version": torch.__version__,
            "key": key_inputs(kernel.revision.label)}  # fmt: skip


def main(argv: list[str]) -> int:
    try:
        out = revision() if argv[1:2] == ["--revision"] else compile_variant(json.load(sys.stdin))
    except Exception as exc:  # noqa: BLE001 - setup failures (FlyDSL not importable, ...) are results too
        out = {
            "outcome": "setup-failed",
            "error_type": type(exc).__name__,
            "message": _scrub(str(exc))[:2000],
        }
    sys.stdout.flush()
    print(RESULT_MARK, json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
