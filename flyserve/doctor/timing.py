"""``flyserve doctor --run``: one small call of each path of this platform's pair, on the GPU,
checked against the float32 torch reference and timed with CUDA events (flyserve.lab.bench's
method: random inputs, NaN-poisoned output, L2 flushed, median of the timed calls).

The batch is small and mixed on purpose (a decode row, a fresh prompt, a chunk after a long
context) so that it says "both kernels run and agree here", not how fast they are on a workload:
``flyserve calibrate`` is for that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flyserve.lab.bench import REL_TOL

QUERY_LENS = [1, 512, 64]
SEQ_LENS = [1024, 512, 2048]
PAIRS = {"cuda": ("triton_unified", "fa3"), "rocm": ("aiter_unified", "flydsl_dualwave")}


@dataclass(frozen=True, slots=True)
class PathRun:
    path: str
    kernel: str
    status: str  # ok | fail
    median_us: float | None
    rel_err: float | None
    detail: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def run_pair(kind: str | None, *, block_size: int = 64) -> list[PathRun]:
    """Time the pair's two paths (unified, prefill) on one mixed batch; [] without a GPU pair."""
    from flyserve.lab.bench import (
        GpuUnavailable,
        KVPool,
        Layout,
        check_kernel,
        make_batch,
        time_kernel,
        warm_gpu,
    )
    from flyserve.lab.kernels import get_kernel

    if kind not in PAIRS:
        return []
    try:
        warm_gpu(0.5)
    except GpuUnavailable as exc:
        return [PathRun("-", "-", "fail", None, None, str(exc))]
    layout = Layout(num_heads=32, num_kv_heads=8, head_size=128, block_size=block_size)
    pool = KVPool(layout, 4 * sum(SEQ_LENS) + 4096)
    out = []
    for path, name in zip(("unified", "prefill"), PAIRS[kind], strict=True):
        try:
            kernel = get_kernel(name)
            batch = make_batch(pool, QUERY_LENS, SEQ_LENS)
            chk = check_kernel(kernel, pool, batch)
            t = time_kernel(kernel, pool, [batch, make_batch(pool, QUERY_LENS, SEQ_LENS)], target_s=0.05)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is the finding
            out.append(PathRun(path, name, "fail", None, None, f"{type(exc).__name__}: {exc}"[:400]))
            continue
        good = chk["nan"] == 0 and chk["rel_err"] < REL_TOL
        detail = (
            f"batch q={QUERY_LENS} kv={SEQ_LENS}, block {block_size}; "
            f"{chk['nan']} non-finite, rel err {chk['rel_err']:.2e} (tolerance {REL_TOL:g})"
        )
        out.append(PathRun(path, name, "ok" if good else "fail", t["median_s"] * 1e6, chk["rel_err"], detail))
    return out
