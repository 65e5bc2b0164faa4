"""flyserve.telemetry: what the dispatcher did, at a cost the engine does not notice.

metrics        every metric, defined once (the list; add metrics here)
prom           the value backend, metric classes and metrics-file format: the only package touching
               prometheus_client internals (version-gated)
multiprocess   flyserve's own multiprocess directory: set-up, wipe, the exposition registry
recorder       DispatchRecorder: the per-decision hot path (bound cells, span only when sampled)
gpu_timer      KernelTimer: 1-in-N kernel timing with CUDA events harvested by query(), never a sync
tracing        OpenTelemetry set-up with a sampling ratio that changes at run time

Submodules are imported by name (nothing here imports them), so a process that needs only the
metric names does not pay for OpenTelemetry, and none of them imports torch at module import.
"""
