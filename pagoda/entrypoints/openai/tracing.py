"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, as vLLM's): one `llm_request` span
per finished engine request (per prompt), kind SERVER, from its arrival to its end, a child of the
trace its HTTP request names in a W3C `traceparent` header, with vLLM's attributes (the gen_ai.*
names below). Spans are exported in batches off the event loop by OpenTelemetry's SDK, over OTLP
gRPC, or HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf. The SDK is an optional
install (`pip install 'pagoda[tracing]'`)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from pagoda.engine.outputs import SequenceOutput
from pagoda.errors import ConfigError
from pagoda.sampling_params import SamplingParams

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, carried over from the HTTP request
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


class RequestTracer:
    """Owns the tracer provider: spans go out through its batch processor until `shutdown`."""

    def __init__(self, endpoint: str, service_name: str = "pagoda") -> None:
        """ConfigError where the SDK is not installed or the protocol is not one OTLP has."""
        check_setup()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(
            resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
        )
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("pagoda.entrypoints.openai")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    def request_span(
        self,
        headers: Mapping[str, str],
        request_id: str,
        model: str,
        outs: list[SequenceOutput],
        params: Any,
        now: float,
    ) -> None:
        """One prompt's span, ended now (`now`: time.monotonic(), the engine's clock); `outs`: its
        sequences that began, `params` its SamplingParams (or an embedding's PoolingParams)."""
        if not outs:
            return
        m = outs[0].metrics
        attributes: dict[str, Any] = {
            "gen_ai.response.model": model,
            "gen_ai.request.id": request_id,
            "gen_ai.usage.prompt_tokens": m.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": sum(len(out.token_ids) for out in outs),
            "gen_ai.latency.e2e": now - m.arrival_time,
        }
        if isinstance(params, SamplingParams):  # an embedding has none of these
            attributes["gen_ai.request.n"] = params.n
            attributes["gen_ai.request.temperature"] = params.temperature
            attributes["gen_ai.request.top_p"] = params.top_p
        if isinstance(params, SamplingParams) and params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if m.first_scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
            attributes["gen_ai.latency.time_in_model_inference"] = now - m.first_scheduled_time
        if m.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
            attributes["gen_ai.latency.time_in_model_decode"] = now - m.first_token_time
            if m.first_scheduled_time is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = m.first_token_time - m.first_scheduled_time
        ended = time.time_ns()
        started = ended - int((now - m.arrival_time) * 1e9)
        span = self._tracer.start_span(
            "llm_request",
            context=self._propagator.extract(headers) if headers else None,
            kind=self._server_kind,
            attributes=attributes,
            start_time=started,
        )
        span.end(end_time=ended)

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocking: call it off the event loop)."""
        self._provider.shutdown()


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context of an HTTP request's headers (empty: none)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def check_setup() -> None:
    """ConfigError unless the SDK and the exporter of the configured protocol import (before the
    model loads: a missing install fails at once)."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    if protocol not in ("grpc", "http/protobuf"):
        raise ConfigError(f"{PROTOCOL_VARIABLE}={protocol!r}: OTLP traces go over grpc or http/protobuf")
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        _exporter_class(protocol)
    except ImportError as exc:
        raise ConfigError(
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: pip install 'pagoda[tracing]' ({exc})"
        ) from None


def _exporter_class(protocol: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter


def _exporter(endpoint: str):
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    if protocol == "grpc":
        return _exporter_class(protocol)(endpoint=endpoint, insecure=True)
    return _exporter_class(protocol)(endpoint=endpoint)
