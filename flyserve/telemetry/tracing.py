"""OpenTelemetry set-up for flyserve's spans, with a sampling ratio that changes while serving.

Two spans exist, both root spans:

* ``flyserve.dispatch``: one per sampled dispatch decision (DispatchRecorder);
* ``flyserve.kernel``: one per sampled, timed kernel-path call (KernelTimer), ended when its
  device time is harvested, with explicit start/end timestamps.

Why a delegating sampler: a TracerProvider hands its sampler to every tracer when the tracer
is created, so replacing the provider's sampler later does not reach tracers that exist (the
recorders of a running engine). :class:`RuntimeRatioSampler` stays the provider's sampler for
life and swaps the ratio inside it.

Why the hot-path spans are "pre-sampled": the recorder and the timer decide with one float
compare (``random() < sampler.ratio``) before they build any attribute, and only then start
the span; sampling again on the trace id would apply the ratio twice. So the sampler admits
root spans named in :data:`PRESAMPLED_SPANS` and ratio-samples every other root span.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Tracer, get_current_span

DISPATCH_SPAN: Final = "flyserve.dispatch"
KERNEL_SPAN: Final = "flyserve.kernel"
PRESAMPLED_SPANS: Final = frozenset({DISPATCH_SPAN, KERNEL_SPAN})
DEFAULT_RATIO: Final = 0.01
ROOT_CONTEXT: Final = Context()
"""Passed as the parent of flyserve's spans: a batch serves many requests, so its spans are roots
(and no context-variable lookup happens on the hot path)."""

_TRACE_ID_LIMIT: Final = (1 << 64) - 1


def _check_ratio(ratio: float) -> float:
    r = float(ratio)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"trace sampling ratio must be within [0, 1], got {ratio!r}")
    return r


class RuntimeRatioSampler(Sampler):
    """Parent-based ratio sampler whose ratio can be changed at run time (:meth:`set_ratio`).

    ``ratio`` is a plain float attribute so the hot path reads it without a call."""

    def __init__(self, ratio: float = DEFAULT_RATIO) -> None:
        self.ratio = _check_ratio(ratio)
        self._bound = TraceIdRatioBased.get_bound_for_rate(self.ratio)

    def set_ratio(self, ratio: float) -> None:
        r = _check_ratio(ratio)
        self._bound = TraceIdRatioBased.get_bound_for_rate(r)
        self.ratio = r

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        if parent is not None and parent.is_valid:
            sampled = parent.trace_flags.sampled
            trace_state = parent.trace_state
        elif name in PRESAMPLED_SPANS:
            sampled = True  # the caller already drew against self.ratio
        else:
            sampled = (trace_id & _TRACE_ID_LIMIT) < self._bound
        if sampled:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return SamplingResult(Decision.DROP, None, trace_state)

    def get_description(self) -> str:
        return f"RuntimeRatioSampler{{{self.ratio}}}"


@dataclass(frozen=True)
class Tracing:
    """What setup_tracing built: hand it to DispatchRecorder and KernelTimer."""

    provider: TracerProvider
    sampler: RuntimeRatioSampler
    tracer: Tracer
    endpoint: str | None

    def set_ratio(self, ratio: float) -> None:
        """Change the sampling ratio of every existing and future flyserve span."""
        self.sampler.set_ratio(ratio)

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.provider.shutdown()


def configured_endpoint(endpoint: str | None = None) -> str | None:
    """The OTLP/HTTP traces endpoint: explicit, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
    OTEL_EXPORTER_OTLP_ENDPOINT (the base URL; the exporter appends /v1/traces), else None."""
    if endpoint:
        return endpoint
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def setup_tracing(
    *,
    service_name: str = "flyserve",
    ratio: float | None = None,
    endpoint: str | None = None,
    exporter: SpanExporter | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    set_global: bool = False,
) -> Tracing | None:
    """Build flyserve's tracer; None when there is nowhere to send spans.

    The OTLP/HTTP exporter is used only when an endpoint is configured (``endpoint``, or the
    standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables); ``exporter`` (tests: an
    InMemorySpanExporter) is exported to synchronously. With neither, no provider is built and
    callers record no spans at all: sampled-but-unexported spans would be pure overhead.

    ``ratio`` defaults to $FLYSERVE_TRACE_RATIO, else 1%. ``set_global`` also installs the
    provider as OpenTelemetry's global one (off by default: vLLM may own that).
    """
    url = configured_endpoint(endpoint)
    if exporter is None and url is None:
        return None
    if ratio is None:
        env = os.environ.get("FLYSERVE_TRACE_RATIO")
        try:
            ratio = float(env) if env else DEFAULT_RATIO
        except ValueError as exc:
            raise ValueError(f"FLYSERVE_TRACE_RATIO must be a number in [0, 1], got {env!r}") from exc
    sampler = RuntimeRatioSampler(ratio)
    attrs = {"service.name": service_name, **(resource_attributes or {})}
    provider = TracerProvider(sampler=sampler, resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if url is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # An explicit endpoint is the full traces URL; from the environment the exporter
        # resolves it itself (it appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT).
        otlp = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        # Batch: export happens on the processor's thread, never on the engine step.
        provider.add_span_processor(BatchSpanProcessor(otlp))
    if set_global:
        from opentelemetry import trace

        trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("flyserve")
    return Tracing(provider=provider, sampler=sampler, tracer=tracer, endpoint=url)
