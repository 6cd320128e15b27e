package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// newTracing exports the proxy's spans over OTLP/gRPC when an endpoint is set.
// Without one the spans are not recorded, but the caller's trace context still
// passes through to the services, so a run stays one trace either way.
func newTracing(ctx context.Context, s settings, getenv func(string) string) (trace.TracerProvider, propagation.TextMapPropagator, func(), error) {
	propagator := propagation.TraceContext{}
	if s.otlpEndpoint == "" {
		return noop.NewTracerProvider(), propagator, func() {}, nil
	}
	opts := []otlptracegrpc.Option{}
	if strings.Contains(s.otlpEndpoint, "://") {
		opts = append(opts, otlptracegrpc.WithEndpointURL(s.otlpEndpoint))
	} else {
		opts = append(opts, otlptracegrpc.WithEndpoint(s.otlpEndpoint))
	}
	if strings.EqualFold(getenv("OTEL_EXPORTER_OTLP_INSECURE"), "true") || strings.HasPrefix(s.otlpEndpoint, "http://") {
		opts = append(opts, otlptracegrpc.WithInsecure())
	}
	exporter, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("exporting traces to %q (OTEL_EXPORTER_OTLP_ENDPOINT): %w", s.otlpEndpoint, err)
	}
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter, sdktrace.WithBatchTimeout(time.Second)),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "restproxy"))),
	)
	shutdown := func() {
		flushCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = provider.Shutdown(flushCtx)
	}
	return provider, propagator, shutdown, nil
}
