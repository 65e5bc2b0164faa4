"""GPU harness shared by ``flyserve calibrate`` and ``flyserve replay --live``: build a paged batch,
check a kernel against the torch reference, time it with CUDA events.

Method (see docs/performance.md):

* Inputs are random (never zeros): q ~ N(0, 1), K/V caches ~ N(0, 1) in bf16, in a pool of
  blocks far larger than the L2 cache; every input set draws its blocks at random from the pool,
  as vLLM's allocator scatters them. Small batches rotate among several input sets so repeated
  calls do not measure the L2 cache.
* Correctness: ``out`` is filled with NaN before the call; after it every element must be
  finite, and sampled query tokens (the first and last of every row, plus random ones, up to 64
  per row, on up to 16 rows) must match a float32 reference with ||out - ref|| / ||ref|| below
  the tolerance (bf16: 2e-2).
* Timing: the GPU is first warmed up (clocks ramp from idle), each shape gets warm-up calls
  (Triton compiles then), then N calls each between two CUDA events, each preceded by an L2
  flush and a device-side spin so the host has enqueued the call before its start event (see
  time_kernel); N is chosen so the timed calls take about ``target_s``; the median is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

REL_TOL = 2e-2


class GpuUnavailable(RuntimeError):
    """No CUDA device (or no torch) on this machine."""


def require_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise GpuUnavailable("torch is not installed: calibrate and --live need torch with CUDA") from exc
    if not torch.cuda.is_available():
        raise GpuUnavailable("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return torch


@dataclass(frozen=True)
class Layout:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * 2  # K and V, bf16


class KVPool:
    """One big paged K/V cache of random bf16 data; batches borrow random blocks from it."""

    def __init__(self, layout: Layout, num_tokens: int, *, seed: int = 0) -> None:
        torch = require_cuda()
        self.layout = layout
        self.num_blocks = -(-num_tokens // layout.block_size)
        shape = (self.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.k = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=g)
        self.v = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=g)
        self._gen = g


@dataclass
class Batch:
    q: Any
    out: Any
    cu_seqlens_q: Any
    seqused_k: Any
    block_table: Any
    max_seqlen_q: int
    max_seqlen_k: int

    def args(self, pool: KVPool, scale: float, causal: bool = True) -> tuple[Any, ...]:
        return (
            self.q,
            pool.k,
            pool.v,
            self.out,
            self.cu_seqlens_q,
            self.seqused_k,
            self.block_table,
            self.max_seqlen_q,
            self.max_seqlen_k,
            scale,
            causal,
        )


def make_batch(pool: KVPool, query_lens: list[int], seq_lens: list[int]) -> Batch:
    torch = require_cuda()
    lay = pool.layout
    bs = lay.block_size
    nblocks = [-(-s // bs) for s in seq_lens]
    need = sum(nblocks)
    if need > pool.num_blocks:
        raise ValueError(f"batch needs {need} blocks, the pool has {pool.num_blocks}")
    ids = torch.randperm(pool.num_blocks, device="cuda", generator=pool._gen)[:need].to(torch.int32)
    width = max(nblocks)
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32, device="cuda")
    off = 0
    for i, n in enumerate(nblocks):
        table[i, :n] = ids[off : off + n]
        off += n
    total = sum(query_lens)
    q = torch.randn(
        (total, lay.num_heads, lay.head_size), dtype=torch.bfloat16, device="cuda", generator=pool._gen
    )
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return Batch(
        q=q,
        out=torch.empty_like(q),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table,
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
    )


def check_kernel(kernel: Any, pool: KVPool, batch: Batch, *, seed: int = 0) -> dict[str, Any]:
    """Poison, run, and compare sampled tokens with the float32 reference. Returns
    {"nan": count of non-finite outputs, "rel_err": ||out-ref||/||ref|| on the sampled tokens}."""
    torch = require_cuda()
    from flyserve.lab.kernels import _gather_kv, reference_row

    lay = pool.layout
    batch.out.fill_(float("nan"))
    kernel(*batch.args(pool, lay.scale))
    torch.cuda.synchronize()
    nonfinite = int((~torch.isfinite(batch.out)).sum().item())
    cu = batch.cu_seqlens_q.tolist()
    ctx = batch.seqused_k.tolist()
    g = torch.Generator().manual_seed(seed)
    rows = list(range(len(ctx)))
    if len(rows) > 16:
        rows = sorted({0, len(rows) - 1, *torch.randperm(len(rows), generator=g)[:14].tolist()})
    num = den = 0.0
    for i in rows:
        a, b = cu[i], cu[i + 1]
        n = b - a
        if n == 0:
            continue
        pos = {0, n - 1}
        if n > 2:
            pos.update(torch.randint(0, n, (min(62, n),), generator=g).tolist())
        p = torch.tensor(sorted(pos), device="cuda")
        k = _gather_kv(pool.k, batch.block_table[i], ctx[i])
        v = _gather_kv(pool.v, batch.block_table[i], ctx[i])
        ref = reference_row(batch.q[a:b], k, v, ctx[i], p, lay.scale, True)
        got = batch.out[a:b][p].float()
        num += float(((got - ref) ** 2).sum().item())
        den += float((ref**2).sum().item())
    rel = math.sqrt(num / den) if den > 0 else float("inf")
    return {"nan": nonfinite, "rel_err": rel}


def warm_gpu(seconds: float = 1.5) -> None:
    """Run matrix products for a while: an idle H200 sits at 345 MHz and ramps up under load
    (measured here), so the first shapes timed from cold would be slow for the wrong reason."""
    import time

    torch = require_cuda()
    a = torch.randn((8192, 8192), dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


_FLUSH: dict[str, Any] = {}


def _flush_buffer() -> Any:
    buf = _FLUSH.get("buf")
    if buf is None:
        torch = require_cuda()
        buf = _FLUSH["buf"] = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return buf


SLEEP_CYCLES = 600_000  # ~0.3 ms at 1.98 GHz: the host enqueues the timed call meanwhile


def time_kernel(
    kernel: Any,
    pool: KVPool,
    batches: list[Batch],
    *,
    target_s: float = 0.2,
    min_reps: int = 3,
    max_reps: int = 100,
    warmup: int = 2,
) -> dict[str, float]:
    """Median device seconds of one call, rotating over ``batches`` (same shape, different data).

    Before every timed call (outside its events) the L2 cache is flushed (a 256 MiB memset, as
    triton.testing.do_bench does) and the stream spins for ~0.3 ms (torch.cuda._sleep), so the
    host has enqueued the call before the start event fires: the time is the kernel's device
    time, not the Python wrapper's launch time (vLLM replays decode batches as CUDA graphs, and
    the launch of an eager call overlaps the previous step's device work).
    """
    torch = require_cuda()
    scale = pool.layout.scale
    args = [b.args(pool, scale) for b in batches]
    flush = _flush_buffer()
    for i in range(warmup):
        kernel(*args[i % len(args)])
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.zero_()
    torch.cuda._sleep(SLEEP_CYCLES)
    s.record()
    kernel(*args[0])
    e.record()
    e.synchronize()
    est = max(s.elapsed_time(e) * 1e-3, 1e-6)
    reps = int(min(max_reps, max(min_reps, target_s / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        starts[i].record()
        kernel(*args[i % len(args)])
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e-3 for a, b in zip(starts, ends, strict=True))
    return {"median_s": ts[len(ts) // 2], "min_s": ts[0], "max_s": ts[-1], "reps": float(reps)}


def sets_for(pool: KVPool, query_lens: list[int], seq_lens: list[int]) -> list[Batch]:
    """Input sets for timing: 4 when the batch's KV footprint is under 256 MiB (L2 is 60 MB), else 1."""
    foot = sum(seq_lens) * pool.layout.kv_bytes_per_token()
    n = 4 if foot < (256 << 20) else 1
    return [make_batch(pool, query_lens, seq_lens) for _ in range(n)]


def device_info() -> dict[str, str]:
    torch = require_cuda()
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm")
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or broken metadata: fall back
        try:
            import vllm

            info["vllm"] = getattr(vllm, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - a partial vLLM (the device bundle) may raise anything
            info["vllm"] = "absent"
    return info


class LivePricer:
    """Prices trace steps by timing both kernels live (memoised per distinct shape).

    seq_lens are rounded up to a multiple of ``quantum`` tokens (default 256) so a trace's
    decode steps, whose contexts grow by one token per step, share a few hundred shapes.
    """

    def __init__(
        self,
        kernels: dict[str, Any],
        layout: Layout,
        *,
        pool_tokens: int = 8 << 20,
        quantum: int = 256,
        check: bool = True,
    ) -> None:
        self.kernels = kernels
        self.layout = layout
        self.num_heads = layout.num_heads
        self.quantum = quantum
        self.check = check
        self.pool = KVPool(layout, pool_tokens)
        self.device_name = device_info()["gpu"]
        warm_gpu()
        self._memo: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[str, float]] = {}

    @classmethod
    def for_platform(
        cls,
        *,
        num_heads: int = 32,
        num_kv_heads: int = 8,
        head_size: int = 128,
        block_size: int = 16,
        platform: str = "cuda",
    ) -> LivePricer:
        from flyserve.lab.kernels import PAIRS, KernelUnavailable, get_kernel

        require_cuda()
        pair = PAIRS[platform]
        try:
            kernels = {"unified": get_kernel(pair.unified), "prefill": get_kernel(pair.prefill)}
        except KernelUnavailable as exc:
            raise GpuUnavailable(str(exc)) from exc
        return cls(kernels, Layout(num_heads, num_kv_heads, head_size, block_size))

    def times(self, query_lens: list[int], seq_lens: list[int]) -> dict[str, float]:
        qz = self.quantum
        s = tuple(-(-x // qz) * qz for x in seq_lens)
        key = (tuple(query_lens), s)
        hit = self._memo.get(key)
        if hit is None:
            sets = sets_for(self.pool, list(key[0]), list(key[1]))
            hit = {}
            for path, k in self.kernels.items():
                if self.check:
                    res = check_kernel(k, self.pool, sets[0])
                    if res["nan"] or not res["rel_err"] < REL_TOL:
                        raise RuntimeError(f"{k.name} wrong on q={query_lens[:4]}..: {res}")
                hit[path] = time_kernel(k, self.pool, sets, warmup=1)["median_s"]  # check_kernel ran it once
            self._memo[key] = hit
            if len(self._memo) % 10 == 0:
                import sys

                print(f"live: {len(self._memo)} distinct shapes timed", file=sys.stderr, flush=True)
        return hit

    def price(self, step: Any, path: str) -> float:
        return self.times(step.query_lens.tolist(), step.seq_lens.tolist())[path]
