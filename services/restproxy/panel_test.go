package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// builtPanel writes a small stand-in for web/dist: an index and one hashed asset.
func builtPanel(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "assets"), 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"index.html":              `<!doctype html><title>cairn</title><script type="module" src="/assets/index-abc123.js"></script>`,
		"assets/index-abc123.js":  `console.log("panel")`,
		"assets/index-abc123.css": `body{}`,
		"favicon.svg":             `<svg xmlns="http://www.w3.org/2000/svg"/>`,
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func get(t *testing.T, url string) (int, string, http.Header) {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw), resp.Header
}

func TestThePanelIsServedWithItsContentTypesCacheHeadersAndAStrictPolicy(t *testing.T) {
	f := startProxy(t, map[string]string{"CAIRN_PANEL_DIR": builtPanel(t)})
	cases := []struct{ path, kind, cache, body string }{
		{"/", "text/html; charset=utf-8", "no-cache", "<title>cairn</title>"},
		{"/assets/index-abc123.js", "text/javascript; charset=utf-8", "public, max-age=31536000, immutable", `console.log("panel")`},
		{"/assets/index-abc123.css", "text/css; charset=utf-8", "public, max-age=31536000, immutable", "body{}"},
		{"/favicon.svg", "image/svg+xml", "no-cache", "<svg"},
	}
	for _, c := range cases {
		code, body, h := get(t, f.url+c.path)
		if code != 200 || h.Get("Content-Type") != c.kind || h.Get("Cache-Control") != c.cache || !strings.Contains(body, c.body) {
			t.Errorf("%s: %d %q %q %q", c.path, code, h.Get("Content-Type"), h.Get("Cache-Control"), body)
		}
		csp := h.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("%s: policy %q lacks %q", c.path, csp, want)
			}
		}
		if strings.Contains(csp, "unsafe") || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s: policy %q or nosniff %q is not strict", c.path, csp, h.Get("X-Content-Type-Options"))
		}
	}
}

func TestAPanelPathFallsBackToIndexButAV1PathAndAMissingAssetDoNot(t *testing.T) {
	f := startProxy(t, map[string]string{"CAIRN_PANEL_DIR": builtPanel(t)})
	code, body, h := get(t, f.url+"/runs/r-1")
	if code != 200 || !strings.Contains(body, "<title>cairn</title>") || h.Get("Cache-Control") != "no-cache" {
		t.Errorf("a panel route: %d %q", code, body)
	}
	code, body, h = get(t, f.url+"/v1/no-such-thing")
	if code != 404 || strings.Contains(body, "<title>") || !strings.HasPrefix(h.Get("Content-Type"), "application/json") {
		t.Errorf("an unknown /v1 path must stay grpc-gateway's JSON 404: %d %q %q", code, body, h.Get("Content-Type"))
	}
	if code, body, _ = get(t, f.url+"/assets/index-old999.js"); code != 404 || strings.Contains(body, "<title>") {
		t.Errorf("a missing asset must be 404, not the index: %d %q", code, body)
	}
	if code, _, _ = get(t, f.url+"/assets/"); code != 404 {
		t.Errorf("a folder must never be listed: %d", code)
	}
	// The REST surface is unchanged behind the panel.
	if status, _, _ := send(t, "POST", f.url+"/v1/runs", `{"agent":"helpdesk","input":"hi"}`, nil); status != 200 {
		t.Errorf("POST /v1/runs behind the panel: %d", status)
	}
	if code, _, _ = get(t, f.url+"/healthz"); code != 200 {
		t.Errorf("/healthz behind the panel: %d", code)
	}
}

func TestWithoutAPanelFolderTheRootIsTheRESTSurfaceAsBefore(t *testing.T) {
	f := startProxy(t, nil)
	code, body, h := get(t, f.url+"/")
	if code != 404 || !strings.HasPrefix(h.Get("Content-Type"), "application/json") || strings.Contains(body, "<html") {
		t.Errorf("no panel configured: %d %q", code, body)
	}
}

func TestThePanelConfigurationComesFromSettingsAndNamesNoDevIdentitiesByDefault(t *testing.T) {
	f := startProxy(t, map[string]string{
		"CAIRN_PANEL_OIDC_ISSUER":        "https://login.example.com/realms/cairn/",
		"CAIRN_PANEL_OIDC_CLIENT_ID":     "cairn-panel",
		"CAIRN_PANEL_TRACE_URL_TEMPLATE": "https://traces.example.com/trace/{trace_id}",
		"CAIRN_PANEL_DIR":                builtPanel(t),
	})
	code, config, h := send(t, "GET", f.url+"/panel/config.json", "", nil)
	if code != 200 || h.Get("Cache-Control") != "no-store" {
		t.Fatalf("config: %d %v", code, config)
	}
	oidc := config["oidc"].(map[string]any)
	if oidc["issuer"] != "https://login.example.com/realms/cairn" || oidc["clientId"] != "cairn-panel" || oidc["scopes"] != "openid" {
		t.Errorf("oidc: %v", oidc)
	}
	if config["traceUrlTemplate"] != "https://traces.example.com/trace/{trace_id}" || config["devIdentities"] != false {
		t.Errorf("config: %v", config)
	}
	if code, body, _ := send(t, "GET", f.url+"/panel/dev-identities", "", nil); code != 404 || body["message"] == "" {
		t.Errorf("dev identities must be off unless the file is set: %d %v", code, body)
	}
	_, _, h = get(t, f.url+"/")
	if csp := h.Get("Content-Security-Policy"); !strings.Contains(csp, "connect-src 'self' https://login.example.com") {
		t.Errorf("the issuer must be reachable for discovery and the token exchange: %q", csp)
	}
}

func TestDevIdentitiesAreHandedOutOnlyWhenTheDevStackWroteThem(t *testing.T) {
	file := filepath.Join(t.TempDir(), "dev-identities.json")
	people := `[{"id":"maria","title":"Maria (manager)","roles":["manager"],"token":"t-maria"},{"id":"tom","title":"Tom (employee)","roles":["employee"],"token":"t-tom"}]`
	if err := os.WriteFile(file, []byte(people), 0o600); err != nil {
		t.Fatal(err)
	}
	f := startProxy(t, map[string]string{"CAIRN_PANEL_DEV_IDENTITIES_FILE": file})
	_, config, _ := send(t, "GET", f.url+"/panel/config.json", "", nil)
	if config["devIdentities"] != true || config["oidc"] != nil {
		t.Errorf("config: %v", config)
	}
	code, body, h := send(t, "GET", f.url+"/panel/dev-identities", "", nil)
	if code != 200 || body["developmentOnly"] != true || h.Get("Cache-Control") != "no-store" {
		t.Fatalf("dev identities: %d %v", code, body)
	}
	listed := body["identities"].([]any)
	if len(listed) != 2 || listed[0].(map[string]any)["token"] != "t-maria" {
		t.Errorf("identities: %v", listed)
	}
}

func TestBadPanelSettingsAreRefusedNamingTheValue(t *testing.T) {
	notAPanel := t.TempDir()
	badFile := filepath.Join(t.TempDir(), "people.json")
	if err := os.WriteFile(badFile, []byte(`{"maria": "t"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	goodFile := filepath.Join(t.TempDir(), "ok.json")
	if err := os.WriteFile(goodFile, []byte(`[{"id":"tom","token":"t"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		env  map[string]string
		name string
	}{
		{map[string]string{"CAIRN_PANEL_DIR": notAPanel}, "CAIRN_PANEL_DIR"},
		{map[string]string{"CAIRN_PANEL_OIDC_ISSUER": "http://login.example.com", "CAIRN_PANEL_OIDC_CLIENT_ID": "p"}, "CAIRN_PANEL_OIDC_ISSUER"},
		{map[string]string{"CAIRN_PANEL_OIDC_ISSUER": "https://login.example.com"}, "CAIRN_PANEL_OIDC_CLIENT_ID"},
		{map[string]string{"CAIRN_PANEL_TRACE_URL_TEMPLATE": "https://traces.example.com/"}, "CAIRN_PANEL_TRACE_URL_TEMPLATE"},
		{map[string]string{"CAIRN_PANEL_DEV_IDENTITIES_FILE": badFile}, "CAIRN_PANEL_DEV_IDENTITIES_FILE"},
		{map[string]string{"CAIRN_PANEL_DEV_IDENTITIES_FILE": goodFile, "CAIRN_RESTPROXY_ADDR": "0.0.0.0:0"}, "CAIRN_PANEL_DEV_IDENTITIES_FILE"},
	}
	for _, c := range cases {
		err := run(context.Background(), nil, func(k string) string { return c.env[k] }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.name) || exitCode(err, io.Discard) != 2 {
			t.Errorf("%v: error %v does not name %s or is not a configuration error", c.env, err, c.name)
		}
	}
}
