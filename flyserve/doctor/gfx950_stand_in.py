"""What FlyDSL's ``flash_attn_interface`` asks of torch's CUDA layer before its compiler runs,
answered on a CPU-only torch so `flyserve flydsl compile` can compile for gfx950 with no GPU.

Only used inside the compile check's child process (``compile_child``), never in a server. FlyDSL
itself (compiler, kernels) is not touched; the interface reads four things from torch, and each
stand-in below says what breaks without it (found by leaving each out, one at a time):

* ``torch.cuda.get_device_properties(dev).gcnArchName``: the interface routes on it (light vs
  dualwave kernel). A CPU torch has no device, and a wrong arch routes a contiguous 512-token batch
  to the light kernel. Answered "gfx950:sramecc+:xnack-", what an MI355X reports.
* ``torch.cuda.current_stream()``: passed as the launch stream; a CPU torch raises "Torch not
  compiled with CUDA enabled". Answered None, which FlyDSL's ``Stream(None)`` takes as the default
  stream (the stream is a run-time argument and not part of the compiled code).
* ``torch.cuda.device(index)``: a context manager around the launch; torch 2.13 CPU raises
  TypeError for index None. A no-op here.
* ``tensor.is_cuda``: the interface's first check. ``DeviceTensor`` is a ``torch.Tensor`` subclass
  over the same CPU storage, shape and strides whose ``is_cuda`` is True; FlyDSL's JIT takes it as a
  compile placeholder (nothing is read from it: ``COMPILE_ONLY`` stops before any launch).
"""

from __future__ import annotations

import types
from typing import Any, Self

import torch

GCN_ARCH_NAME = "gfx950:sramecc+:xnack-"
DEVICE_PROPERTIES = types.SimpleNamespace(
    name="gfx950 stand-in (flyserve compile check, no GPU)",
    gcnArchName=GCN_ARCH_NAME,
    multi_processor_count=256,  # MI355X; read only by FlyDSL's dense (non-paged) path
    total_memory=288 * 2**30,
)


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it is on the GPU (``is_cuda``), for the interface's check."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _NoDevice:
    """Stands in for ``torch.cuda.device``: entering it selects nothing."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def on_device(t: Any) -> Any:
    """``t`` as a DeviceTensor (same storage); anything else unchanged."""
    return t.as_subclass(DeviceTensor) if isinstance(t, torch.Tensor) else t


def install() -> None:
    """Replace the three ``torch.cuda`` functions for this process (the child exits after one call)."""
    torch.cuda.get_device_properties = lambda device=None: DEVICE_PROPERTIES
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.device = _NoDevice
