"""Host cost of flyserve's one FlyDSL call site (``flydsl_kernel.call_paged``), once per layer per
prefill step, beside calling the same function directly with the same keywords.

Run: .venv/bin/python -m pytest benchmarks/test_bench_flydsl_call.py --benchmark-enable
The kernel is a plain Python function with FlyDSL #1056's exact signature (read from
tests/data/contracts/) that returns at once, so what is timed is the call site's own overhead:
the revision branch and the argument passing. No GPU; absolute times on this VM are indicative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flyserve.vllm.flydsl_kernel import FlyDSLKernel, FlyDSLRevision, call_paged

CONTRACT = (
    Path(__file__).resolve().parents[1] / "tests/data/contracts/flydsl_flash_attn_func-pr1056-943152de.json"
)


def _plain_function_with_the_real_signature():
    """def flydsl_flash_attn_func(q, k, v, *, causal=True, ...): return out  - built from the contract."""
    params = json.loads(CONTRACT.read_text())["parameters"]
    pos = [p["name"] for p in params if p["kind"] == "POSITIONAL_OR_KEYWORD"]
    kw = [f"{p['name']}={p['default']!r}" for p in params if p["kind"] == "KEYWORD_ONLY"]
    ns: dict = {}
    exec(f"def flydsl_flash_attn_func({', '.join(pos)}, *, {', '.join(kw)}):\n    return out\n", ns)  # noqa: S102
    return ns["flydsl_flash_attn_func"]


FN = _plain_function_with_the_real_signature()
KERNEL = FlyDSLKernel(FN, FlyDSLRevision(True, (64, 128), True, "<bench>"))
Q, K, V, OUT, CU_Q, CU_KV, SEQ, TABLE = (object() for _ in range(8))


def via_call_site():
    call_paged(KERNEL, Q, K, V, OUT, cu_seqlens_q=CU_Q, cu_seqlens_kv=CU_KV, seqlen_k=SEQ, block_table=TABLE,
               max_seqlen_q=512, max_seqlen_kv=4096, num_kv_heads=8, lpt=True)  # fmt: skip


def direct():
    FN(Q, K, V, causal=True, num_kv_heads=8, cu_seqlens_q=CU_Q, cu_seqlens_kv=CU_KV, max_seqlen_q=512,
       max_seqlen_kv=4096, cross_seqlen=True, block_table=TABLE, seqlen_k=SEQ, kv_cache_layout="linear",
       num_kv_splits=1, out=OUT, causal_lpt=True)  # fmt: skip


def via_kwargs_dict():
    kw = {"causal": True, "num_kv_heads": 8, "cu_seqlens_q": CU_Q, "cu_seqlens_kv": CU_KV, "max_seqlen_q": 512,
          "max_seqlen_kv": 4096, "cross_seqlen": True, "block_table": TABLE, "seqlen_k": SEQ,
          "kv_cache_layout": "linear", "num_kv_splits": 1, "out": OUT}  # fmt: skip
    kw["causal_lpt"] = True
    FN(Q, K, V, **kw)


@pytest.mark.benchmark(group="flydsl-call")
def test_direct_call(benchmark):
    benchmark(direct)


@pytest.mark.benchmark(group="flydsl-call")
def test_call_site(benchmark):
    benchmark(via_call_site)


@pytest.mark.benchmark(group="flydsl-call")
def test_kwargs_dict_call(benchmark):
    benchmark(via_kwargs_dict)
