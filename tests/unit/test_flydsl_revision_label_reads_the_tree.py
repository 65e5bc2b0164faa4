"""The FlyDSL revision label says what the tree says (page sizes, ``linear3d``, paged FP8, the
commit), never "or older", and the KV-layout prediction follows vLLM 0.34's ``_split_kv_cache``.

The newest FlyDSL tree readable here with a commit (tests/data/contracts/
flydsl_flash_attn_func-main-02ecfe12.json: page 64 only, ``linear3d`` named, a paged FP8 builder,
paged ``bias``, no ``causal_lpt``, strided K/V copied) is built as a checkout in a temporary folder
(its interface module, a ``.git`` naming the commit) with a function of the contract's signature.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _support import lazy_module, module_requires, require_module
from contract_fakes import CONTRACTS

from flyserve.vllm import flydsl_kernel as fk
from flyserve.vllm import flydsl_tree, kv_views

torch = lazy_module("torch")  # imported when a test runs, not at collection
required_modules = module_requires("torch")
COMMIT = "02ecfe12c6633892954270bc4d363ab96dc5c10a"
CONTRACT = json.loads((CONTRACTS / "flydsl_flash_attn_func-main-02ecfe12.json").read_text())
PRE = json.loads((CONTRACTS / "flydsl_paged_preconditions.json").read_text())["revisions"]["main-02ecfe12"]
# vLLM 0.34 vllm/v1/kv_cache_layout.py: LHBNC = (0, 2, 1, 3, 4), its layer_view_order drops L
LHBNC_VIEW_ORDER = (1, 0, 2, 3)


def checkout(tmp_path: Path, *, git: bool = True) -> Path:
    """A FlyDSL checkout: its interface has the contract's function and names the layouts that tree
    names; a packed ref gives its commit."""
    root = tmp_path / "FlyDSL"
    mod = root / "kernels" / "attention"
    mod.mkdir(parents=True)
    for pkg in (root / "kernels", mod):
        (pkg / "__init__.py").write_text("")
    layouts = ", ".join(f'"{n}"' for n in PRE["kv_cache_layouts_named"])
    (mod / "flash_attn_interface.py").write_text(
        "import json\nfrom contract_fakes import CONTRACTS, fake_function\n"
        f"_PAGED_PAGE_SIZE = {PRE['page_sizes'][0]}\n_LAYOUTS = ({layouts})\nCALLS = []\n"
        f"flydsl_flash_attn_func = fake_function(json.loads((CONTRACTS / {PRE['contract']!r}).read_text()), "
        "CALLS.append)\nflydsl_flash_attn_func.__module__ = __name__\n"
        "def _build_paged_fp8():\n    pass\n"
    )
    if git:
        (root / ".git").mkdir()
        (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (root / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{COMMIT} refs/heads/main\n")
    return root


MODULES = ("kernels", "kernels.attention", "kernels.attention.flash_attn_interface")


@pytest.fixture
def newest_main(tmp_path, monkeypatch):
    """The checkout on $VLLM_FLYDSL_KERNELS_PATH; yields the calls its function received."""
    monkeypatch.setenv(fk.KERNELS_PATH_ENV, str(checkout(tmp_path)))
    monkeypatch.delenv(fk.MODULE_ENV, raising=False)
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    kernel = fk.load_flydsl_kernel()
    yield kernel, sys.modules[fk.DEFAULT_MODULE].CALLS
    for name in MODULES:
        sys.modules.pop(name, None)


def test_label_of_the_newest_main_is_read_off_the_tree(newest_main):
    rev = newest_main[0].revision
    assert (rev.has_causal_lpt, rev.page_sizes, rev.strided_kv) == (False, (64,), False)
    assert rev.kv_layouts == ("linear", "linear3d", "vectorized") and rev.paged_fp8 and rev.commit == COMMIT
    assert rev.label == "no causal_lpt, pages 64, strided K/V copied, linear3d, paged fp8, commit 02ecfe12"
    assert "older" not in rev.label and "newer" not in rev.label


def test_flyserves_call_binds_to_the_newest_main(newest_main):
    kernel, calls = newest_main
    q, k, v, out, batch = fk.warm_up_batch(dtype=torch.bfloat16, device="cpu", num_heads=2, num_kv_heads=1,
                                           head_size=64, page_size=64)  # fmt: skip
    fk.call_paged(kernel, q, k, v, out, num_kv_heads=1, lpt=True, **batch)  # a TypeError if it did not bind
    (a,) = calls
    assert "causal_lpt" not in a["__passed__"] and a["kv_cache_layout"] == "linear" and a["bias"] is None


def test_an_archive_without_git_says_its_commit_is_unknown(tmp_path):
    root = checkout(tmp_path, git=False)
    assert flydsl_tree.checkout_commit(root) is None
    rev = fk.FlyDSLRevision(False, (64,), False, str(root / "kernels/attention/flash_attn_interface.py"))
    assert rev.label.endswith("commit unknown (not a git checkout)")


def test_vllm_034_layouts_predict_what_flydsl_would_copy():
    pr1056 = fk.FlyDSLRevision(True, (64, 128), True, "interface.py")
    newest = fk.FlyDSLRevision(False, (64,), False, "interface.py")
    for order in (kv_views.IDENTITY, LHBNC_VIEW_ORDER):
        k, v = kv_views.split_like_aiter(kv_views.aiter_layer_cache(1, 64, 128, order), 128)
        assert tuple(k.shape) == (2, 64, 1, 128)
        assert fk.kv_layout_problem(k, v, pr1056) is None  # one KV head: read in place either way
        assert "copies them on every call" in fk.kv_layout_problem(k, v, newest)
    k, v = kv_views.split_like_aiter(kv_views.aiter_layer_cache(2, 64, 128, LHBNC_VIEW_ORDER), 128)
    assert k.stride()[2] == 2 * 64 * 256  # heads a layer's blocks apart under LHBNC
    assert "head stride" in fk.kv_layout_problem(k, v, pr1056)
    k, v = kv_views.split_like_aiter(kv_views.aiter_layer_cache(2, 64, 128), 128)
    assert "pages are not page_size rows apart" in fk.kv_layout_problem(k, v, pr1056)


@pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
def test_the_backend_predicts_on_vllms_own_split():
    """kv_views' tensor split by the installed vLLM's own _split_kv_cache gives kv_views' views."""
    require_module("vllm")
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionImpl

    impl = object.__new__(RocmAiterUnifiedAttentionImpl)
    impl.head_size = 128
    for order in (kv_views.IDENTITY, LHBNC_VIEW_ORDER):
        kv = kv_views.aiter_layer_cache(2, 64, 128, order)
        theirs, ours = impl._split_kv_cache(kv), kv_views.split_like_aiter(kv, 128)
        assert [t.stride() for t in theirs] == [t.stride() for t in ours]
    assert kv_views.layer_view_order(None) == kv_views.IDENTITY
