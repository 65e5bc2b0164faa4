"""`flyserve flydsl compile`: FlyDSL's own compiler checks flyserve's call for gfx950, on a CPU.

For a model's geometry (``--model-config`` HF config.json, ``--tp``) and the installed FlyDSL
checkout, every variant a deployment runs is compiled through ``flydsl_kernel.call_paged``, each
in its own process (``compile_child``): the warm-up batch and vLLM's serving batches at each page
size the revision takes, LPT on and off, and the light kernel where it is reachable. Per variant:
ok or the compiler's message, and from the code object the kernel symbol, size, VGPRs, SGPRs, LDS
and spills. ``--wrong-calls`` adds deliberately wrong calls that FlyDSL must reject.

With ``--cache-dir`` the folder is checked (``flyserve.vllm.flydsl_cache``) before any child is
pointed at it - FlyDSL unpickles what it finds there - and refused with the path and the reason;
after the run the entries the children's cache keys name are listed in flyserve's manifest with
their variant, and the report counts the folder's entries for this deployment apart from the rest.

This package is the plan, the runs and the report; nothing here imports torch or FlyDSL (the child,
flyserve.doctor.compile_child, does), so the plan and the parsing are unit-tested without them.

errors        CompileCheckError: bad arguments or a machine that cannot run the check
geometry      per-rank attention geometry from a HF config.json (--model-config, --tp, --dtype)
variants      the plan: every specialization a deployment compiles, and the wrong calls
results       a child's result line and the verdict on a variant
runs          the machine check, the child's environment, one child process per variant
cache_folder  --cache-dir: refused before a child loads it, listed and counted after
report        the report (--json) and its table
"""

from flyserve.doctor.compile.cache_folder import (
    cache_after_run,
    check_cache_arg,
    deployment_of,
    observed_entries,
)
from flyserve.doctor.compile.errors import CompileCheckError
from flyserve.doctor.compile.geometry import (
    DTYPE_CHOICES,
    HF_DTYPES,
    Geometry,
    geometry_from_hf_config,
    resolve_dtype,
)
from flyserve.doctor.compile.report import (
    FORMAT,
    cache_line,
    failed,
    key_line,
    render,
    report,
    served_note,
)
from flyserve.doctor.compile.results import VariantResult, judge, parse_child_output
from flyserve.doctor.compile.runs import (
    CHILD_ENV,
    CHILD_TIMEOUT_S,
    MAX_JOBS,
    check_machine,
    child_env,
    key_of,
    read_revision,
    run_child,
    run_variants,
)
from flyserve.doctor.compile.variants import (
    BATCHES,
    LIGHT_PAGE,
    SERVE_KV,
    SERVE_Q,
    SHORT_KV,
    SHORT_Q,
    Variant,
    plan_variants,
    wrong_variants,
)

__all__ = [
    "BATCHES",
    "CHILD_ENV",
    "CHILD_TIMEOUT_S",
    "DTYPE_CHOICES",
    "FORMAT",
    "HF_DTYPES",
    "LIGHT_PAGE",
    "MAX_JOBS",
    "SERVE_KV",
    "SERVE_Q",
    "SHORT_KV",
    "SHORT_Q",
    "CompileCheckError",
    "Geometry",
    "Variant",
    "VariantResult",
    "cache_after_run",
    "cache_line",
    "check_cache_arg",
    "check_machine",
    "child_env",
    "deployment_of",
    "failed",
    "geometry_from_hf_config",
    "judge",
    "key_line",
    "key_of",
    "observed_entries",
    "parse_child_output",
    "plan_variants",
    "read_revision",
    "render",
    "report",
    "resolve_dtype",
    "run_child",
    "run_variants",
    "served_note",
    "wrong_variants",
]
