package main

// The web panel (web/, built into web/dist) is served by the proxy, so the
// browser talks to one origin: the page, its scripts and /v1 are all the same
// site and the Content-Security-Policy can stay at 'self'. The proxy serves the
// files and the panel's settings; it still verifies and mints nothing. The
// development identities are tokens the dev stack minted and wrote to a file:
// the proxy only hands them out, and only when that file is configured and the
// proxy listens on loopback.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// panelSettings are the CAIRN_PANEL_* settings; every one is documented in README.
type panelSettings struct {
	dir                 string // CAIRN_PANEL_DIR: the built panel; empty serves no panel
	oidcIssuer          string // CAIRN_PANEL_OIDC_ISSUER
	oidcClientID        string // CAIRN_PANEL_OIDC_CLIENT_ID
	oidcScopes          string // CAIRN_PANEL_OIDC_SCOPES
	traceURLTemplate    string // CAIRN_PANEL_TRACE_URL_TEMPLATE, {trace_id} is replaced
	devIdentitiesFile   string // CAIRN_PANEL_DEV_IDENTITIES_FILE: development only
	devIdentitiesLoaded []devIdentity
}

// devIdentity is one demo person the dev stack offers for one-click sign-in.
type devIdentity struct {
	ID    string   `json:"id"`
	Title string   `json:"title"`
	Roles []string `json:"roles"`
	Token string   `json:"token"`
}

// panelConfig is what GET /panel/config.json tells the panel.
type panelConfig struct {
	OIDC             *oidcConfig `json:"oidc"`
	TraceURLTemplate string      `json:"traceUrlTemplate"`
	DevIdentities    bool        `json:"devIdentities"`
}

type oidcConfig struct {
	Issuer   string `json:"issuer"`
	ClientID string `json:"clientId"`
	Scopes   string `json:"scopes"`
}

func loadPanelSettings(env func(name, fallback string) string) (panelSettings, error) {
	p := panelSettings{
		dir:               env("CAIRN_PANEL_DIR", ""),
		oidcIssuer:        strings.TrimRight(env("CAIRN_PANEL_OIDC_ISSUER", ""), "/"),
		oidcClientID:      env("CAIRN_PANEL_OIDC_CLIENT_ID", ""),
		oidcScopes:        env("CAIRN_PANEL_OIDC_SCOPES", "openid"),
		traceURLTemplate:  env("CAIRN_PANEL_TRACE_URL_TEMPLATE", ""),
		devIdentitiesFile: env("CAIRN_PANEL_DEV_IDENTITIES_FILE", ""),
	}
	if p.dir != "" {
		if info, err := os.Stat(filepath.Join(p.dir, "index.html")); err != nil || info.IsDir() {
			return panelSettings{}, fmt.Errorf("CAIRN_PANEL_DIR=%q: expected the built panel, a folder holding index.html (run `make web`)", p.dir)
		}
	}
	if p.oidcIssuer != "" {
		issuer, err := url.Parse(p.oidcIssuer)
		if err != nil || issuer.Host == "" || (issuer.Scheme != "https" && !isLoopbackHost(issuer.Hostname())) {
			return panelSettings{}, fmt.Errorf("CAIRN_PANEL_OIDC_ISSUER=%q: expected the issuer's https URL (http only for a loopback issuer in development)", p.oidcIssuer)
		}
		if p.oidcClientID == "" {
			return panelSettings{}, fmt.Errorf("CAIRN_PANEL_OIDC_CLIENT_ID=%q: the panel's client id at %s is needed when CAIRN_PANEL_OIDC_ISSUER is set", p.oidcClientID, p.oidcIssuer)
		}
	}
	if p.traceURLTemplate != "" && !strings.Contains(p.traceURLTemplate, "{trace_id}") {
		return panelSettings{}, fmt.Errorf("CAIRN_PANEL_TRACE_URL_TEMPLATE=%q: expected a URL holding {trace_id}, such as https://grafana.example.com/explore?traceId={trace_id}", p.traceURLTemplate)
	}
	if p.devIdentitiesFile != "" {
		if _, err := readDevIdentities(p.devIdentitiesFile); err != nil {
			return panelSettings{}, err
		}
	}
	return p, nil
}

// checkListen refuses development identities on an address other machines can
// reach: anyone who can load the page could sign in as the demo people.
func (p panelSettings) checkListen(listenAddr string) error {
	if p.devIdentitiesFile == "" {
		return nil
	}
	host, _, err := net.SplitHostPort(listenAddr)
	if err != nil || !isLoopbackHost(host) {
		return fmt.Errorf("CAIRN_PANEL_DEV_IDENTITIES_FILE=%q: development identities are only offered on a loopback address, and the proxy listens on %q", p.devIdentitiesFile, listenAddr)
	}
	return nil
}

func isLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// readDevIdentities reads the file at every request, so a dev stack that mints
// fresh tokens is seen without restarting the proxy.
func readDevIdentities(file string) ([]devIdentity, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("CAIRN_PANEL_DEV_IDENTITIES_FILE=%q: %w", file, err)
	}
	var people []devIdentity
	if err := json.Unmarshal(raw, &people); err != nil {
		return nil, fmt.Errorf("CAIRN_PANEL_DEV_IDENTITIES_FILE=%q: expected a JSON list of {id, title, roles, token}: %w", file, err)
	}
	for i, person := range people {
		if person.ID == "" || person.Token == "" {
			return nil, fmt.Errorf("CAIRN_PANEL_DEV_IDENTITIES_FILE=%q: entry %d needs an id and a token", file, i)
		}
	}
	return people, nil
}

// contentSecurityPolicy allows the panel's own files and calls to its own
// origin, plus the OIDC issuer (discovery and the token exchange).
func (p panelSettings) contentSecurityPolicy() string {
	connect := "'self'"
	form := "'self'"
	if p.oidcIssuer != "" {
		if issuer, err := url.Parse(p.oidcIssuer); err == nil {
			origin := issuer.Scheme + "://" + issuer.Host
			connect += " " + origin
			form += " " + origin
		}
	}
	return strings.Join([]string{
		"default-src 'none'",
		"script-src 'self'",
		"style-src 'self'",
		"img-src 'self' data:",
		"font-src 'self'",
		"connect-src " + connect,
		"form-action " + form,
		"base-uri 'none'",
		"frame-ancestors 'none'",
		"object-src 'none'",
	}, "; ")
}

// contentTypes are named here rather than read from the host's mime tables, so
// the panel is served the same on every machine.
var contentTypes = map[string]string{
	".html":  "text/html; charset=utf-8",
	".js":    "text/javascript; charset=utf-8",
	".css":   "text/css; charset=utf-8",
	".json":  "application/json",
	".svg":   "image/svg+xml",
	".png":   "image/png",
	".ico":   "image/x-icon",
	".woff2": "font/woff2",
	".txt":   "text/plain; charset=utf-8",
	".map":   "application/json",
}

// panelHandler serves the built panel: files as they are, hashed assets cached
// for a year, index.html never cached, and any other GET that is not under /v1/
// answered with index.html so the panel's own paths survive a reload. Anything
// else (another method, an unknown /v1 path) goes on to `rest`.
func panelHandler(p panelSettings, rest http.Handler) http.Handler {
	files := os.DirFS(p.dir)
	csp := p.contentSecurityPolicy()
	index, indexErr := fs.ReadFile(files, "index.html")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if (r.Method != http.MethodGet && r.Method != http.MethodHead) || strings.HasPrefix(r.URL.Path, "/v1/") {
			rest.ServeHTTP(w, r)
			return
		}
		h := w.Header()
		h.Set("Content-Security-Policy", csp)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("X-Frame-Options", "DENY")
		name := strings.TrimPrefix(path.Clean(r.URL.Path), "/")
		if name != "" && name != "index.html" && fs.ValidPath(name) {
			if body, err := fs.ReadFile(files, name); err == nil {
				kind, known := contentTypes[path.Ext(name)]
				if !known {
					kind = "application/octet-stream"
				}
				h.Set("Content-Type", kind)
				if strings.HasPrefix(name, "assets/") {
					h.Set("Cache-Control", "public, max-age=31536000, immutable")
				} else {
					h.Set("Cache-Control", "no-cache")
				}
				if r.Method == http.MethodGet {
					_, _ = w.Write(body)
				}
				return
			} else if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, fs.ErrInvalid) {
				// a folder, or a file that cannot be read: never a directory listing
				http.NotFound(w, r)
				return
			}
			if strings.HasPrefix(name, "assets/") {
				// a missing hashed asset is a stale page, not a panel route
				http.NotFound(w, r)
				return
			}
		}
		if indexErr != nil {
			http.Error(w, "the panel's index.html cannot be read", http.StatusServiceUnavailable)
			return
		}
		h.Set("Content-Type", contentTypes[".html"])
		h.Set("Cache-Control", "no-cache")
		if r.Method == http.MethodGet {
			_, _ = w.Write(index)
		}
	})
}

// registerPanelRoutes adds the panel's settings and, in development, its demo
// people. Both are answered whether or not the static panel is served here, so
// a panel served from elsewhere (CORS) can read them too.
func registerPanelRoutes(mux *http.ServeMux, p panelSettings) {
	config := panelConfig{TraceURLTemplate: p.traceURLTemplate, DevIdentities: p.devIdentitiesFile != ""}
	if p.oidcIssuer != "" {
		config.OIDC = &oidcConfig{Issuer: p.oidcIssuer, ClientID: p.oidcClientID, Scopes: p.oidcScopes}
	}
	mux.HandleFunc("GET /panel/config.json", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		writeJSON(w, http.StatusOK, config)
	})
	mux.HandleFunc("GET /panel/dev-identities", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		if p.devIdentitiesFile == "" {
			writeJSON(w, http.StatusNotFound, map[string]any{
				"code": 5, "message": "development identities are off (CAIRN_PANEL_DEV_IDENTITIES_FILE is not set)", "details": []any{},
			})
			return
		}
		people, err := readDevIdentities(p.devIdentitiesFile)
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{"code": 14, "message": err.Error(), "details": []any{}})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"developmentOnly": true, "identities": people})
	})
}
