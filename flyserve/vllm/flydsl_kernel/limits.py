"""What FlyDSL's dualwave paged path accepts: head sizes, page sizes, its KV tile and KV limit,
the light kernel's bound; each number read from FlyDSL's source (flash_attn_interface.py), where
its comment says. The routing's eligibility check (FLYDSL_SPEC) is made of them.
"""

from __future__ import annotations

from flyserve.vllm.eligibility import PrefillKernelSpec

HEAD_SIZES = (64, 128)
# The page sizes the dualwave path runs (64; 128 from #1056). The module's private page-size constant
# is intersected with these: FlyDSL's open PR #1055 sets _PAGED_PAGE_SIZES = (16, 64) for the
# paged path as a whole, and 16 must never be declared to vLLM for dualwave.
DUALWAVE_PAGE_SIZES = (64, 128)
# The paged path walks KV in 64-token tiles (flash_attn_interface._PAGED_TILE).
PAGED_TILE = 64
# flash_attn_interface._VARLEN_LIGHT_MAX_SEQ: at page 64 with contiguous K/V, a paged batch whose
# max_seqlen_q is at most this goes to the "paged light" kernel on gfx950 (no LPT flag). vLLM's
# strided cache views never do on #1056 (results/flydsl/943152de.txt, short-p64: dualwave).
LIGHT_MAX_QUERY = 256
# 2048 KV tiles staged in LDS per split (flash_attn_interface._PAGED_BT_LDS_SIZE), num_kv_splits=1
# (varlen paged has no split-K): a longer max_seqlen_kv raises NotImplementedError. 131072 tokens
# at every page size: #1056 (943152de, lines 527-537) counts 64-token tiles, not pages (a 128 page
# is two tiles); main 11c4174d counts pages, and its only page size is 64.
MAX_KV_LEN = 2048 * PAGED_TILE
# What the routing checks for the FlyDSL path: static eligibility (dtypes bf16/f16; the scale check
# is generic) and, per batch, the kernel's KV limit (reason context_too_long).
FLYDSL_SPEC = PrefillKernelSpec("flydsl-dualwave", head_sizes=HEAD_SIZES, max_kv_len=MAX_KV_LEN)
