package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	gatewayv1 "cairn/gen/go/cairn/gateway/v1"
	memoryv1 "cairn/gen/go/cairn/memory/v1"
	orchestratorv1 "cairn/gen/go/cairn/orchestrator/v1"
	retrievalv1 "cairn/gen/go/cairn/retrieval/v1"
	"cairn/restproxy/internal/openapi"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	// google.rpc.ErrorInfo and the other detail types must be known to protojson,
	// or an error body's details could not be written.
	_ "google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/protobuf/encoding/protojson"
)

// serviceConfig is every cairn client's: round robin over the target's addresses,
// and UNAVAILABLE retried on the RPCs where that is safe. It is written from
// libs/cairn_libs/service_config.py, which says which RPCs and why; a test there
// fails when the two differ.
//
//go:embed service_config.json
var serviceConfig string

// fixedAddresses resolves a target that lists its replicas (`ipv4:a:p,b:p`, or a
// plain `a:p,b:p`, as the local stack starts them): gRPC-Go has no ipv4 resolver.
func fixedAddresses(name, addr string) (string, []grpc.DialOption) {
	list := strings.TrimPrefix(addr, "ipv4:")
	if list == addr && !strings.Contains(addr, ",") {
		return dialTarget(addr), nil
	}
	r := manual.NewBuilderWithScheme("cairn-" + name)
	var state resolver.State
	for _, a := range strings.Split(list, ",") {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: strings.TrimSpace(a)})
	}
	r.InitialState(state)
	return r.Scheme() + ":///" + name, []grpc.DialOption{grpc.WithResolvers(r)}
}

// backend is one service the proxy forwards to.
type backend struct {
	name string
	conn *grpc.ClientConn
}

// incomingHeader decides which HTTP headers become gRPC metadata. Authorization
// is not here because grpc-gateway always forwards it as `authorization`. Only
// the W3C trace context is added; everything else, and in particular
// grpc-gateway's default `Grpc-Metadata-*` passthrough, is dropped, so an outside
// caller can never present the orchestrator's actor credential (x-cairn-actor)
// or any other metadata a service trusts.
func incomingHeader(key string) (string, bool) {
	switch lower := strings.ToLower(key); lower {
	case "traceparent", "tracestate":
		return lower, true
	}
	return "", false
}

// jsonMarshaler is grpc-gateway's JSON with one change: an unknown field in a
// request is an error (400), not silently dropped.
func jsonMarshaler() runtime.Marshaler {
	return &runtime.JSONPb{
		MarshalOptions:   protojson.MarshalOptions{EmitUnpopulated: true},
		UnmarshalOptions: protojson.UnmarshalOptions{DiscardUnknown: false},
	}
}

// callDeadline bounds a unary call that carries no deadline of its own; streams
// (a run's events) are bounded by the caller.
func callDeadline(limit time.Duration) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, limit)
			defer cancel()
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

func dialBackends(s settings, tracing trace.TracerProvider, propagator propagation.TextMapPropagator) ([]backend, error) {
	targets := []struct{ name, addr string }{
		{"orchestrator", s.orchestratorAddr},
		{"memory", s.memoryAddr},
		{"retrieval", s.retrievalAddr},
	}
	if s.exposeGateway {
		targets = append(targets, struct{ name, addr string }{"gateway", s.gatewayAddr})
	}
	backends := make([]backend, 0, len(targets))
	for _, t := range targets {
		target, resolvers := fixedAddresses(t.name, t.addr)
		conn, err := grpc.NewClient(target, append(resolvers,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultServiceConfig(serviceConfig),
			grpc.WithUnaryInterceptor(callDeadline(s.callTimeout)),
			grpc.WithStatsHandler(otelgrpc.NewClientHandler(
				otelgrpc.WithTracerProvider(tracing), otelgrpc.WithPropagators(propagator))),
		)...)
		if err != nil {
			closeBackends(backends)
			return nil, fmt.Errorf("dialling %s at %q: %w", t.name, t.addr, err)
		}
		backends = append(backends, backend{name: t.name, conn: conn})
	}
	return backends, nil
}

func closeBackends(backends []backend) {
	for _, b := range backends {
		_ = b.conn.Close()
	}
}

// newHandler wires the generated handlers, the health and contract endpoints and
// the middleware around them.
func newHandler(ctx context.Context, s settings, backends []backend, tracing trace.TracerProvider, propagator propagation.TextMapPropagator) (http.Handler, error) {
	rest := runtime.NewServeMux(
		runtime.WithIncomingHeaderMatcher(incomingHeader),
		runtime.WithMarshalerOption(runtime.MIMEWildcard, jsonMarshaler()),
	)
	register := map[string]func(context.Context, *runtime.ServeMux, *grpc.ClientConn) error{
		"orchestrator": orchestratorv1.RegisterOrchestratorServiceHandler,
		"memory":       memoryv1.RegisterMemoryServiceHandler,
		"retrieval":    retrievalv1.RegisterRetrievalServiceHandler,
		"gateway":      gatewayv1.RegisterGatewayServiceHandler,
	}
	for _, b := range backends {
		if err := register[b.name](ctx, rest, b.conn); err != nil {
			return nil, fmt.Errorf("registering %s's REST handlers: %w", b.name, err)
		}
	}
	var hidden []string
	if !s.exposeGateway {
		hidden = append(hidden, "/v1/gateway/")
	}
	contract, err := openapi.Document(hidden)
	if err != nil {
		return nil, err
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "SERVING"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		code, body := readiness(r.Context(), backends)
		writeJSON(w, code, body)
	})
	mux.HandleFunc("GET /openapi.json", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(contract)
	})
	registerPanelRoutes(mux, s.panel)
	if s.panel.dir != "" {
		mux.Handle("/v1/", rest)
		mux.Handle("/", panelHandler(s.panel, rest))
	} else {
		mux.Handle("/", rest)
	}

	handler := limitBody(s.maxBodyBytes, mux)
	handler = withCORS(s.corsOrigins, handler)
	return otelhttp.NewHandler(handler, "restproxy",
		otelhttp.WithTracerProvider(tracing),
		otelhttp.WithPropagators(propagator),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			return r.Method + " " + r.URL.Path
		}),
	), nil
}

// readiness asks every backend's grpc.health.v1 for its overall state.
func readiness(ctx context.Context, backends []backend) (int, map[string]any) {
	states := make(map[string]string, len(backends))
	code := http.StatusOK
	for _, b := range backends {
		checkCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := healthpb.NewHealthClient(b.conn).Check(checkCtx, &healthpb.HealthCheckRequest{})
		cancel()
		state := "UNREACHABLE"
		if err == nil {
			state = resp.GetStatus().String()
		}
		if state != "SERVING" {
			code = http.StatusServiceUnavailable
		}
		states[b.name] = state
	}
	overall := "SERVING"
	if code != http.StatusOK {
		overall = "NOT_SERVING"
	}
	return code, map[string]any{"status": overall, "backends": states}
}

// limitBody refuses a declared oversize body before reading it (413) and cuts
// an undeclared one at the limit (grpc-gateway then answers 400).
func limitBody(limit int64, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > limit {
			writeJSON(w, http.StatusRequestEntityTooLarge, map[string]any{
				"code":    8,
				"message": fmt.Sprintf("request body of %d bytes is over the limit of %d bytes (CAIRN_RESTPROXY_MAX_BODY_BYTES)", r.ContentLength, limit),
				"details": []any{},
			})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, limit)
		next.ServeHTTP(w, r)
	})
}

// withCORS answers only the origins named in CAIRN_RESTPROXY_CORS_ORIGINS; with
// none named a browser on another origin cannot call the proxy at all. No
// credentials mode: the token travels in Authorization, never in a cookie.
func withCORS(origins []string, next http.Handler) http.Handler {
	allowed := make(map[string]bool, len(origins))
	for _, o := range origins {
		allowed[o] = true
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		origin := r.Header.Get("Origin")
		if origin != "" && allowed[origin] {
			h := w.Header()
			h.Set("Access-Control-Allow-Origin", origin)
			h.Add("Vary", "Origin")
			if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
				h.Set("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
				h.Set("Access-Control-Allow-Headers", "Authorization, Content-Type, traceparent, tracestate")
				h.Set("Access-Control-Max-Age", "600")
				w.WriteHeader(http.StatusNoContent)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, code int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
