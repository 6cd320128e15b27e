package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// settings are everything the proxy reads from its environment, parsed once at
// start-up so a bad value stops it before it listens.
type settings struct {
	listenAddr        string
	orchestratorAddr  string
	memoryAddr        string
	retrievalAddr     string
	gatewayAddr       string
	exposeGateway     bool
	corsOrigins       []string
	maxBodyBytes      int64
	callTimeout       time.Duration
	readHeaderTimeout time.Duration
	idleTimeout       time.Duration
	shutdownGrace     time.Duration
	otlpEndpoint      string
	panel             panelSettings
}

func loadSettings(getenv func(string) string) (settings, error) {
	env := func(name, fallback string) string {
		if v := strings.TrimSpace(getenv(name)); v != "" {
			return v
		}
		return fallback
	}
	s := settings{
		listenAddr:       env("CAIRN_RESTPROXY_ADDR", "127.0.0.1:8080"),
		orchestratorAddr: env("CAIRN_ORCHESTRATOR_ADDR", "127.0.0.1:50054"),
		memoryAddr:       env("CAIRN_MEMORY_ADDR", "127.0.0.1:50053"),
		retrievalAddr:    env("CAIRN_RETRIEVAL_ADDR", "127.0.0.1:50052"),
		gatewayAddr:      env("CAIRN_GATEWAY_ADDR", "127.0.0.1:50051"),
		otlpEndpoint:     env("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
	}
	var err error
	if s.exposeGateway, err = parseBool("CAIRN_RESTPROXY_EXPOSE_GATEWAY", env("CAIRN_RESTPROXY_EXPOSE_GATEWAY", "false")); err != nil {
		return settings{}, err
	}
	for _, origin := range strings.Split(env("CAIRN_RESTPROXY_CORS_ORIGINS", ""), ",") {
		if origin = strings.TrimSpace(origin); origin != "" {
			if origin == "*" {
				return settings{}, fmt.Errorf("CAIRN_RESTPROXY_CORS_ORIGINS=%q: name each origin (https://panel.example.com); a wildcard would let any site call with a person's token", origin)
			}
			s.corsOrigins = append(s.corsOrigins, origin)
		}
	}
	if s.maxBodyBytes, err = parsePositiveInt("CAIRN_RESTPROXY_MAX_BODY_BYTES", env("CAIRN_RESTPROXY_MAX_BODY_BYTES", "4194304")); err != nil {
		return settings{}, err
	}
	durations := []struct {
		name     string
		fallback string
		into     *time.Duration
	}{
		{"CAIRN_RESTPROXY_CALL_TIMEOUT_SECONDS", "300", &s.callTimeout},
		{"CAIRN_RESTPROXY_READ_HEADER_TIMEOUT_SECONDS", "10", &s.readHeaderTimeout},
		{"CAIRN_RESTPROXY_IDLE_TIMEOUT_SECONDS", "120", &s.idleTimeout},
		{"CAIRN_SHUTDOWN_GRACE_SECONDS", "5", &s.shutdownGrace},
	}
	for _, d := range durations {
		if *d.into, err = parseSeconds(d.name, env(d.name, d.fallback)); err != nil {
			return settings{}, err
		}
	}
	for name, addr := range map[string]string{
		"CAIRN_ORCHESTRATOR_ADDR": s.orchestratorAddr, "CAIRN_MEMORY_ADDR": s.memoryAddr,
		"CAIRN_RETRIEVAL_ADDR": s.retrievalAddr, "CAIRN_GATEWAY_ADDR": s.gatewayAddr,
	} {
		if addr == "none" {
			return settings{}, fmt.Errorf("%s=%q: the REST proxy needs every backend it serves; give host:port or a dns:/// target", name, addr)
		}
	}
	if s.panel, err = loadPanelSettings(env); err != nil {
		return settings{}, err
	}
	return s, nil
}

func parseBool(name, value string) (bool, error) {
	switch strings.ToLower(value) {
	case "1", "true", "yes":
		return true, nil
	case "0", "false", "no":
		return false, nil
	}
	return false, fmt.Errorf("%s=%q: expected true or false", name, value)
}

func parsePositiveInt(name, value string) (int64, error) {
	n, err := strconv.ParseInt(value, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: expected a whole number of bytes above 0", name, value)
	}
	return n, nil
}

func parseSeconds(name, value string) (time.Duration, error) {
	f, err := strconv.ParseFloat(value, 64)
	if err != nil || f <= 0 || f > 86400 {
		return 0, fmt.Errorf("%s=%q: expected seconds, above 0 and at most 86400", name, value)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// dialTarget makes a bare host:port a dns:/// target, so every address the
// resolver returns (several replicas behind one name) is balanced round robin.
func dialTarget(addr string) string {
	if strings.Contains(addr, ":///") || strings.HasPrefix(addr, "unix:") {
		return addr
	}
	return "dns:///" + addr
}
