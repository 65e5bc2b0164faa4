"""FlyDSL's kernel cache, checked before flyserve lets FlyDSL load it.

What FlyDSL does with the folder, read from its source (``python/flydsl/compiler/jit_function.py``
``JitCacheManager`` and ``JitFunction._ensure_cache_manager``, ``jit_executor.py``
``CompiledArtifact``, ``utils/file.py`` ``atomic_write``; ROCm/FlyDSL main 11c4174d and the
flydsl 0.4.2 wheel, jit_function.py lines 991-1115 and 1390-1406 there; flydsl 0.5.0 names its
folders and entries otherwise and unpickles only the entry a key names: ``flyserve.vllm.flydsl_layout``
has both layouts, and this check reads either):

* one folder per JIT function and build, ``{cache dir}/{function}_{manager_key}/``, where
  ``manager_key`` hashes the flydsl wheel, the kernel's sources and its closure's scalars (page size,
  LPT, heads, head size: what one variant of flyserve's call fixes);
* in it one ``{sha256(str(cache key))[:16]}.pkl`` per specialization, the key holding the target
  (``GPUTarget(backend='rocm', arch='gfx950', ...)``), the dtypes and which dims are dynamic; written
  0600 through a same-folder temporary ``.{name}.*.tmp``, with ``{name}.lock`` beside it (FlyDSL
  opens it read-write, creating it, even to read);
* the ``.pkl`` is ``pickle.dump`` of a ``flydsl.compiler.jit_executor.CompiledArtifact``: a dict
  state with the lowered MLIR module (``ir_zlib`` zlib-compressed in 0.4.2, ``ir_text`` before),
  whose ``#gpu.object<#rocdl.target<chip = "gfx950", ...>, bin = ...>`` carries the code object,
  the names of post-load processors (imported by name when unpickled) and link libraries;
* at a JIT function's first call ``load_all()`` runs ``pickle.load`` on **every** ``*.pkl`` of its
  folder, whatever its name; a hit then parses the module and JIT-compiles its host code.

So whoever can write the folder runs code in the server, twice over (the unpickle, then the host
code of the module). The checks below run before flyserve points FlyDSL at a folder:

1. the location: the folder and every directory above it (as written and as resolved) owned by
   this user or root; the folder itself not a symlink and not group- or world-writable; a directory
   above it writable by others only with the sticky bit (then only an entry's owner may rename or
   remove it, so the path cannot be swapped); a folder not made yet needs its nearest existing
   parent not writable by others at all (else a stranger could make it first);
2. what is inside: function folders holding files, nothing deeper; each one owned by this user or
   root, not group- or world-writable, a directory or a regular file (no symlink, FIFO, socket,
   device), a file at most MAX_ENTRY_BYTES, at most MAX_FILES in all;
3. each entry, read without running it (an unpickler whose only global is a stand-in for
   CompiledArtifact): a FlyDSL artifact whose module targets exactly the serving arch, with no link
   libraries and post-load processors only from FlyDSL or its kernels; and where flyserve's
   manifest lists it, the bytes it listed.

The check is about who could have written the folder, not a sandbox: an artifact that passes is
still code, trusted because only this user or root can have put it there. A refusal raises
CacheRefused naming the folder and the reason, never a file's contents.

The manifest (MANIFEST_NAME in the cache folder, written by `flyserve flydsl compile --cache-dir`;
FlyDSL reads only the function folders) says which variant each entry was compiled for, from the
cache keys FlyDSL computed in the compile, and the key inputs it was built with (flydsl release,
layout, device-bitcode fingerprint: ``flyserve.vllm.flydsl_key``): the warm-up's log line and the
compile report count the entries for this deployment's variants apart from entries for other
variants and unlisted ones, and, given this host's key inputs, the stale entries (another flydsl's
layout or release, another ROCm's bitcode) that can never be a hit here apart from them all.

The checks, one module each: location.py (1), contents.py (2), entries.py (3); manifest.py reads and
writes the manifest; check.py runs them in order (check_cache_dir) and counts what passed
(CacheCheck); refused.py is CacheRefused. This package's names below are its public API.
"""

from flyserve.vllm.flydsl_cache.check import TARGET_ARCH, CacheCheck, Deployment, check_cache_dir
from flyserve.vllm.flydsl_cache.contents import MAX_ENTRY_BYTES, MAX_FILES, scan_entries
from flyserve.vllm.flydsl_cache.entries import artifact_problem, artifact_state, module_targets, read_entry
from flyserve.vllm.flydsl_cache.location import check_location, trusted_owners
from flyserve.vllm.flydsl_cache.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    read_manifest,
    record_entries,
    variant_record,
)
from flyserve.vllm.flydsl_cache.refused import CacheRefused

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "MAX_ENTRY_BYTES",
    "MAX_FILES",
    "TARGET_ARCH",
    "CacheCheck",
    "CacheRefused",
    "Deployment",
    "artifact_problem",
    "artifact_state",
    "check_cache_dir",
    "check_location",
    "module_targets",
    "read_entry",
    "read_manifest",
    "record_entries",
    "scan_entries",
    "trusted_owners",
    "variant_record",
]
