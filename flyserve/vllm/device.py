"""Which GPU this process runs on: its own module so backends.py and flydsl.py both ask it without
importing each other (tests/unit/test_layout.py forbids the circle)."""

from __future__ import annotations


def gpu_arch() -> str:
    """gcnArchName of GPU 0 on ROCm ('' when unknown)."""
    try:
        import torch

        return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
    except Exception:  # noqa: BLE001 - no GPU, or not ROCm
        return ""
