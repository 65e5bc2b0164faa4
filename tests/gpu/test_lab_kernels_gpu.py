"""Device-only: vLLM's Triton unified attention and FA3 against the torch reference, through the
lab's adapters and harness. Skipped (not failed) where there is no CUDA GPU or no vLLM kernels;
run on the device with scripts/gpu/run_h200.sh's environment:
    PYTHONPATH=/tmp/site:. python3 -m pytest -q tests/gpu -p no:cacheprovider
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from flyserve.lab import bench
from flyserve.lab.kernels import KernelUnavailable, get_kernel

pytestmark = pytest.mark.gpu

SHAPES = [
    ([1] * 8, [4096] * 8),  # decode (Triton takes its 3D split-softmax kernel)
    ([1] * 32, [1000 + 97 * i for i in range(32)]),  # decode, ragged contexts (2D kernel)
    ([2048], [2048]),  # a fresh prompt
    ([1] * 4 + [512], [3000] * 4 + [8192]),  # decode rows + a chunk after 7680 tokens
    ([4] * 8, [2048] * 8),  # speculative rows
]


@pytest.fixture(scope="module")
def pool_by_bs():
    return {bs: bench.KVPool(bench.Layout(32, 8, 128, bs), 1 << 20) for bs in (16, 128)}


@pytest.mark.parametrize("name", ["triton_unified", "fa3"])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize(("ql", "sl"), SHAPES)
def test_kernel_matches_reference(pool_by_bs, name, bs, ql, sl):
    try:
        k = get_kernel(name)
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    pool = pool_by_bs[bs]
    batch = bench.make_batch(pool, ql, sl)
    res = bench.check_kernel(k, pool, batch)
    assert res["nan"] == 0, "the kernel left poisoned (NaN) outputs"
    assert res["rel_err"] < bench.REL_TOL


def test_the_check_catches_a_wrong_kernel(pool_by_bs):
    pool = pool_by_bs[16]
    batch = bench.make_batch(pool, [1, 64], [300, 640])

    def half_done(q, k, v, out, *rest):
        out[: out.shape[0] // 2] = 0.0  # leaves the rest NaN-poisoned

    res = bench.check_kernel(half_done, pool, batch)
    assert res["nan"] > 0 and not res["rel_err"] < bench.REL_TOL
