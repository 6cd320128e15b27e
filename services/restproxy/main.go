// Command restproxy is cairn's REST surface: grpc-gateway handlers generated
// from protos/ in front of the orchestrator, memory and retrieval (and the model
// gateway only when CAIRN_RESTPROXY_EXPOSE_GATEWAY is set). It passes the
// caller's Authorization and trace context through and mints nothing: every
// service still verifies every call itself.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	stop()
	os.Exit(exitCode(err, os.Stdout))
}

// configError is a setting the proxy refuses; like the services it exits 2.
type configError struct{ err error }

func (e configError) Error() string { return e.err.Error() }
func (e configError) Unwrap() error { return e.err }

func exitCode(err error, stdout io.Writer) int {
	if err == nil {
		return 0
	}
	logger := newLogger(stdout)
	var bad configError
	if errors.As(err, &bad) {
		logger.Error("restproxy.config_invalid", "error", err.Error())
		return 2
	}
	logger.Error("restproxy.start_failed", "error", err.Error())
	return 1
}

func newLogger(stdout io.Writer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.MessageKey {
				a.Key = "event"
			}
			return a
		},
	}))
}

// run serves until ctx ends, then drains in-flight requests for the grace period.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	flags := flag.NewFlagSet("restproxy", flag.ContinueOnError)
	flags.SetOutput(stdout)
	addr := flags.String("addr", "", "listen address (overrides CAIRN_RESTPROXY_ADDR)")
	if err := flags.Parse(args); err != nil {
		return configError{fmt.Errorf("reading the arguments %q: %w", args, err)}
	}
	s, err := loadSettings(getenv)
	if err != nil {
		return configError{err}
	}
	if *addr != "" {
		s.listenAddr = *addr
	}
	if err := s.panel.checkListen(s.listenAddr); err != nil {
		return configError{err}
	}
	logger := newLogger(stdout)

	tracing, propagator, shutdownTracing, err := newTracing(ctx, s, getenv)
	if err != nil {
		return err
	}
	defer shutdownTracing()
	backends, err := dialBackends(s, tracing, propagator)
	if err != nil {
		return err
	}
	defer closeBackends(backends)
	handler, err := newHandler(ctx, s, backends, tracing, propagator)
	if err != nil {
		return err
	}

	listener, err := net.Listen("tcp", s.listenAddr)
	if err != nil {
		return fmt.Errorf("listening on %q (CAIRN_RESTPROXY_ADDR): %w", s.listenAddr, err)
	}
	server := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: s.readHeaderTimeout,
		IdleTimeout:       s.idleTimeout,
	}
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	logger.Info("restproxy.listening", "addr", listener.Addr().String(),
		"gateway_exposed", s.exposeGateway, "cors_origins", s.corsOrigins,
		"panel_dir", s.panel.dir, "panel_dev_identities", s.panel.devIdentitiesFile != "",
		"panel_oidc_issuer", s.panel.oidcIssuer)

	select {
	case err := <-served:
		return fmt.Errorf("serving on %q: %w", s.listenAddr, err)
	case <-ctx.Done():
	}
	drainCtx, cancel := context.WithTimeout(context.Background(), s.shutdownGrace)
	defer cancel()
	if err := server.Shutdown(drainCtx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("shutting down: %w", err)
	}
	logger.Info("restproxy.stopped")
	return nil
}
