"""The attention geometry one tensor-parallel rank compiles for: from a Hugging Face config.json.

Heads and KV heads per rank, head size and dtype decide which specializations FlyDSL builds; they
are read here from the model's own config (bounded, through flyserve.files.safe_read), checked
against ``--tp`` as vLLM splits them, with the dtype vLLM would serve attention in.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flyserve.doctor.compile.errors import CompileCheckError

HF_DTYPES = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "fp32", "float": "fp32"}
DTYPE_CHOICES = ("auto", "bf16", "f16", "fp32")


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
