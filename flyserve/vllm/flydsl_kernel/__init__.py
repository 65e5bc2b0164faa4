"""FlyDSL's ``flydsl_flash_attn_func``: loading it, knowing which revision it is, the one call,
the warm-up, and FlyDSL's disk cache in this process.

This is the only place in flyserve that calls FlyDSL. The serving backend (``flyserve.vllm.flydsl``)
and the lab adapter (``flyserve.lab.kernels.FlyDSLDualwave``) both go through ``call_paged``, so
what the lab times is what vLLM runs. No vLLM import here; torch is imported lazily.

One module a job: limits.py what the paged path accepts (FLYDSL_SPEC), load.py the import and the
revision read off the real function, call.py ``call_paged`` (FlyDSL's interface, in its docstring)
and the K/V layout check, warmup.py the warm-up, disk_cache.py where FlyDSL keeps compiled kernels
here (checked by flyserve.vllm.flydsl_cache before FlyDSL opens them). The names below are the
package's public API.
"""

from flyserve.vllm.flydsl_kernel.call import call_paged, kv_layout_problem
from flyserve.vllm.flydsl_kernel.disk_cache import (
    CACHE_DIR_ENV,
    CACHE_ENABLE_ENV,
    PRIVATE_CACHE_PREFIX,
    RUN_ONLY_ENV,
    checked_cache,
    flydsl_cache_dir,
    flydsl_cache_entries,
    use_private_cache,
)
from flyserve.vllm.flydsl_kernel.limits import (
    DUALWAVE_PAGE_SIZES,
    FLYDSL_SPEC,
    HEAD_SIZES,
    LIGHT_MAX_QUERY,
    MAX_KV_LEN,
    PAGED_TILE,
)
from flyserve.vllm.flydsl_kernel.load import (
    DEFAULT_MODULE,
    FUNCTION_NAME,
    INSTALL_HINT,
    KERNELS_PATH_ENV,
    LPT_PARAM,
    MODULE_ENV,
    FlyDSLKernel,
    FlyDSLRevision,
    FlyDSLUnavailable,
    detect_revision,
    kernel_block_sizes,
    load_flydsl_kernel,
    try_load,
)
from flyserve.vllm.flydsl_kernel.warmup import (
    WARMUP_QUERY_LEN,
    dtype_label,
    variant_counts,
    warm_up,
    warm_up_batch,
    warm_up_source,
)

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_ENABLE_ENV",
    "DEFAULT_MODULE",
    "DUALWAVE_PAGE_SIZES",
    "FLYDSL_SPEC",
    "FUNCTION_NAME",
    "HEAD_SIZES",
    "INSTALL_HINT",
    "KERNELS_PATH_ENV",
    "LIGHT_MAX_QUERY",
    "LPT_PARAM",
    "MAX_KV_LEN",
    "MODULE_ENV",
    "PAGED_TILE",
    "PRIVATE_CACHE_PREFIX",
    "RUN_ONLY_ENV",
    "WARMUP_QUERY_LEN",
    "FlyDSLKernel",
    "FlyDSLRevision",
    "FlyDSLUnavailable",
    "call_paged",
    "checked_cache",
    "detect_revision",
    "dtype_label",
    "flydsl_cache_dir",
    "flydsl_cache_entries",
    "kernel_block_sizes",
    "kv_layout_problem",
    "load_flydsl_kernel",
    "try_load",
    "use_private_cache",
    "variant_counts",
    "warm_up",
    "warm_up_batch",
    "warm_up_source",
]
