"""KernelTimer's CUDA path on a real GPU: events timed without any sync, nothing recorded in a capture.

Device only (pytest -m gpu); on a machine without CUDA the module is skipped, not passed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flyserve.telemetry import metrics
from flyserve.telemetry.gpu_timer import KernelTimer

pytestmark = pytest.mark.gpu


def _get(name: str, path: str, rank: int) -> float:
    v = metrics.REGISTRY.get_sample_value(name, {"path": path, "rank": str(rank)})
    assert v is not None
    return v


def test_cuda_events_time_the_call_with_no_sync() -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    timer = KernelTimer(90, every=2, clock="cuda")
    p = timer.path("prefill")
    n = 200
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        for _ in range(n):
            p.call(torch.matmul, a, a)
        in_flight = timer.pending
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert in_flight >= 1  # the host ran ahead: timings were still pending, nobody waited
    torch.cuda.synchronize()  # the test (not the timer) waits, then harvests what remains
    timer.harvest()
    assert timer.pending == 0
    count = _get("flyserve_kernel_seconds_count", "prefill", 90)
    dropped = _get("flyserve_kernel_timer_dropped_total", "prefill", 90)
    # every sampled call was either timed or (queue of 64 full: the host far ahead) dropped and counted
    assert count + dropped == n // 2 and count >= 64
    mean_s = _get("flyserve_kernel_seconds_sum", "prefill", 90) / count
    # an independent reference: the same product timed with its own events
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        a @ a
    e1.record()
    e1.synchronize()
    ref_s = e0.elapsed_time(e1) / 20 * 1e-3
    print(
        f"timer mean {mean_s * 1e6:.1f} us, reference {ref_s * 1e6:.1f} us, "
        f"pending seen {in_flight}, timed {count:.0f}, dropped {dropped:.0f}"
    )
    assert 0.5 * ref_s < mean_s < 2.0 * ref_s


def test_nothing_is_recorded_inside_a_cuda_graph_capture() -> None:
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    timer = KernelTimer(91, every=1, clock="cuda")
    p = timer.path("unified")
    p.call(torch.matmul, a, a)  # one timing pending before the capture
    before = timer.pending
    assert before == 1
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.call(torch.matmul, a, a)  # warm-up on the side stream (timed: not capturing)
    torch.cuda.current_stream().wait_stream(s)
    pending_before_capture = timer.pending
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = p.call(torch.matmul, a, a)
    assert timer.pending == pending_before_capture  # no event recorded into the graph, no query made
    g.replay()
    torch.cuda.synchronize()
    timer.harvest()
    assert timer.pending == 0
    assert _get("flyserve_kernel_seconds_count", "unified", 91) == 2  # the two calls outside the capture
    assert out.shape == (1024, 1024)
