package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	orchestratorv1 "cairn/gen/go/cairn/orchestrator/v1"
	retrievalv1 "cairn/gen/go/cairn/retrieval/v1"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// recordingOrchestrator is a real gRPC server that keeps the metadata and
// requests it is sent, and refuses StartRun for agent "someone-elses".
type recordingOrchestrator struct {
	orchestratorv1.UnimplementedOrchestratorServiceServer
	mu       sync.Mutex
	metadata []metadata.MD
	calls    int
	// closed by a test once it has read the first event of run "stepwise"
	release chan struct{}
}

// StreamRun sends one event, then for run "stepwise" waits for the test to have
// read it before the second, and for run "fails-midway" ends on an error.
func (o *recordingOrchestrator) StreamRun(req *orchestratorv1.StreamRunRequest, stream grpc.ServerStreamingServer[orchestratorv1.StreamRunResponse]) error {
	first := &orchestratorv1.StreamRunResponse{Kind: orchestratorv1.RunEventKind_RUN_EVENT_KIND_STEP_FINISHED, Step: &orchestratorv1.Step{Seq: 1}}
	if err := stream.Send(first); err != nil {
		return err
	}
	switch req.GetRunId() {
	case "fails-midway":
		return status.Error(codes.Aborted, "the run's lease was lost")
	case "stepwise":
		select {
		case <-o.release:
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
	return stream.Send(&orchestratorv1.StreamRunResponse{Kind: orchestratorv1.RunEventKind_RUN_EVENT_KIND_RUN_FINISHED})
}

func (o *recordingOrchestrator) StartRun(ctx context.Context, req *orchestratorv1.StartRunRequest) (*orchestratorv1.StartRunResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	o.mu.Lock()
	o.metadata = append(o.metadata, md)
	o.calls++
	o.mu.Unlock()
	if req.GetAgent() == "someone-elses" {
		st, _ := status.New(codes.PermissionDenied, "not found or not permitted").
			WithDetails(&errdetails.ErrorInfo{Reason: "DENIED", Domain: "cairn"})
		return nil, st.Err()
	}
	return &orchestratorv1.StartRunResponse{Run: &orchestratorv1.Run{RunId: "r-1"}}, nil
}

func (o *recordingOrchestrator) seen() (int, []metadata.MD) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls, append([]metadata.MD(nil), o.metadata...)
}

// echoingRetrieval answers GetDocument with the id exactly as it arrived, so a
// test can see how a path parameter was decoded.
type echoingRetrieval struct {
	retrievalv1.UnimplementedRetrievalServiceServer
}

func (echoingRetrieval) GetDocument(ctx context.Context, req *retrievalv1.GetDocumentRequest) (*retrievalv1.GetDocumentResponse, error) {
	return &retrievalv1.GetDocumentResponse{Document: &retrievalv1.Document{DocumentId: req.GetDocumentId()}}, nil
}

type fixture struct {
	url          string
	orchestrator *recordingOrchestrator
	health       *health.Server
}

// startProxy runs the real proxy in-process (run, as main does) in front of one
// real gRPC server that stands in for every backend.
func startProxy(t *testing.T, env map[string]string) fixture {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	orchestrator := &recordingOrchestrator{release: make(chan struct{})}
	orchestratorv1.RegisterOrchestratorServiceServer(server, orchestrator)
	retrievalv1.RegisterRetrievalServiceServer(server, echoingRetrieval{})
	healthServer := health.NewServer()
	healthpb.RegisterHealthServer(server, healthServer)
	go func() { _ = server.Serve(lis) }()
	t.Cleanup(server.Stop)

	backend := lis.Addr().String()
	vars := map[string]string{
		"CAIRN_RESTPROXY_ADDR":    "127.0.0.1:0",
		"CAIRN_ORCHESTRATOR_ADDR": backend,
		"CAIRN_MEMORY_ADDR":       backend,
		"CAIRN_RETRIEVAL_ADDR":    backend,
		"CAIRN_GATEWAY_ADDR":      backend,
	}
	for k, v := range env {
		vars[k] = v
	}
	ctx, cancel := context.WithCancel(context.Background())
	out, in := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, nil, func(k string) string { return vars[k] }, in)
		_ = in.Close()
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run returned %v", err)
		}
	})
	lines := bufio.NewScanner(out)
	for lines.Scan() {
		var event map[string]any
		if json.Unmarshal(lines.Bytes(), &event) == nil && event["event"] == "restproxy.listening" {
			go func() { _, _ = io.Copy(io.Discard, out) }()
			return fixture{url: "http://" + event["addr"].(string), orchestrator: orchestrator, health: healthServer}
		}
	}
	t.Fatalf("the proxy never said it was listening: %v", <-done)
	return fixture{}
}

func send(t *testing.T, method, url, body string, headers map[string]string) (int, map[string]any, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var decoded map[string]any
	_ = json.Unmarshal(raw, &decoded)
	return resp.StatusCode, decoded, resp.Header
}

func TestAuthorizationAndTraceContextReachTheServiceAndNoActorHeaderDoes(t *testing.T) {
	f := startProxy(t, nil)
	code, _, _ := send(t, "POST", f.url+"/v1/runs", `{"agent":"helpdesk","input":"hi"}`, map[string]string{
		"Authorization":               "Bearer caller-token",
		"traceparent":                 "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tracestate":                  "vendor=1",
		"X-Cairn-Actor":               "Bearer forged-actor",
		"Grpc-Metadata-X-Cairn-Actor": "Bearer forged-actor",
	})
	if code != http.StatusOK {
		t.Fatalf("status %d, want 200", code)
	}
	_, seen := f.orchestrator.seen()
	md := seen[0]
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer caller-token" {
		t.Errorf("authorization = %q, want exactly the caller's", got)
	}
	if got := md.Get("traceparent"); len(got) != 1 || !strings.HasPrefix(got[0], "00-0af7651916cd43dd8448eb211c80319c-") {
		t.Errorf("traceparent = %q, want the caller's trace", got)
	}
	if got := md.Get("tracestate"); len(got) != 1 || got[0] != "vendor=1" {
		t.Errorf("tracestate = %q, want the caller's", got)
	}
	if got := md.Get("x-cairn-actor"); len(got) != 0 {
		t.Errorf("x-cairn-actor = %q reached the service; an outside caller must never present one", got)
	}
}

func TestOnlyTheTraceContextHeadersBecomeMetadata(t *testing.T) {
	for header, want := range map[string]string{"traceparent": "traceparent", "Tracestate": "tracestate"} {
		if got, ok := incomingHeader(header); !ok || got != want {
			t.Errorf("incomingHeader(%q) = %q, %v; want %q", header, got, ok, want)
		}
	}
	// Authorization is forwarded by grpc-gateway itself, once, as `authorization`
	for _, header := range []string{"Authorization", "X-Cairn-Actor", "Grpc-Metadata-X-Cairn-Actor", "Cookie", "Grpc-Metadata-Authorization"} {
		if got, ok := incomingHeader(header); ok {
			t.Errorf("incomingHeader(%q) forwards it as %q", header, got)
		}
	}
}

func TestAnUnknownFieldIsA400AndNeverReachesTheService(t *testing.T) {
	f := startProxy(t, nil)
	code, body, _ := send(t, "POST", f.url+"/v1/runs", `{"agent":"helpdesk","input":"hi","agnet":"typo"}`, nil)
	if code != http.StatusBadRequest {
		t.Fatalf("status %d, want 400", code)
	}
	if msg, _ := body["message"].(string); !strings.Contains(msg, "agnet") {
		t.Errorf("message %q does not name the unknown field", msg)
	}
	if calls, _ := f.orchestrator.seen(); calls != 0 {
		t.Errorf("the service was called %d times", calls)
	}
}

func TestABodyOverTheLimitIsRefusedBeforeTheService(t *testing.T) {
	f := startProxy(t, map[string]string{"CAIRN_RESTPROXY_MAX_BODY_BYTES": "64"})
	big := `{"agent":"helpdesk","input":"` + strings.Repeat("x", 100) + `"}`
	code, body, _ := send(t, "POST", f.url+"/v1/runs", big, nil)
	if code != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d, want 413", code)
	}
	if msg, _ := body["message"].(string); !strings.Contains(msg, "64 bytes") {
		t.Errorf("message %q does not say the limit", msg)
	}
	// an undeclared length (chunked) is cut at the limit instead
	req, _ := http.NewRequest("POST", f.url+"/v1/runs", io.MultiReader(strings.NewReader(big)))
	req.ContentLength = -1
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("chunked oversize: status %d, want 400", resp.StatusCode)
	}
	if calls, _ := f.orchestrator.seen(); calls != 0 {
		t.Errorf("the service was called %d times", calls)
	}
	code, _, _ = send(t, "POST", f.url+"/v1/runs", `{"agent":"a","input":"b"}`, nil)
	if code != http.StatusOK {
		t.Errorf("a body under the limit: status %d, want 200", code)
	}
}

func TestADenialKeepsItsCodeMessageAndErrorInfo(t *testing.T) {
	f := startProxy(t, nil)
	code, body, _ := send(t, "POST", f.url+"/v1/runs", `{"agent":"someone-elses","input":"hi"}`, nil)
	if code != http.StatusForbidden {
		t.Fatalf("status %d, want 403", code)
	}
	if body["message"] != "not found or not permitted" || body["code"] != float64(codes.PermissionDenied) {
		t.Errorf("body %v lost the service's code or message", body)
	}
	details, _ := body["details"].([]any)
	if len(details) != 1 {
		t.Fatalf("details %v, want the one ErrorInfo", body["details"])
	}
	info := details[0].(map[string]any)
	if info["@type"] != "type.googleapis.com/google.rpc.ErrorInfo" || info["reason"] != "DENIED" {
		t.Errorf("detail %v is not the service's ErrorInfo", info)
	}
}

func TestARunsEventsArriveAsJSONLinesAsTheyHappen(t *testing.T) {
	f := startProxy(t, nil)
	resp, err := http.Get(f.url + "/v1/runs/stepwise/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := bufio.NewReader(resp.Body)
	first := make(chan string, 1)
	go func() {
		line, _ := lines.ReadString('\n')
		first <- line
	}()
	select {
	case line := <-first:
		// the service holds the second event back until this line was read
		if !strings.Contains(line, `"seq":1`) || !strings.HasPrefix(line, `{"result":`) {
			t.Errorf("first line %q, want the first event as one JSON line", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first event did not arrive before the stream ended: the proxy buffers")
	}
	close(f.orchestrator.release)
	rest, _ := io.ReadAll(lines)
	if !strings.Contains(string(rest), "RUN_EVENT_KIND_RUN_FINISHED") {
		t.Errorf("after the first line got %q, want the finishing event", rest)
	}
}

func TestAnErrorAfterTheFirstEventIsAFinalErrorLineNotACleanEnd(t *testing.T) {
	f := startProxy(t, nil)
	resp, err := http.Get(f.url + "/v1/runs/fails-midway/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
	if len(lines) != 2 {
		t.Fatalf("got %d lines %q, want one event and one error", len(lines), raw)
	}
	var last struct {
		Error struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(lines[1]), &last); err != nil || last.Error.Code != int(codes.Aborted) ||
		last.Error.Message != "the run's lease was lost" {
		t.Errorf("last line %q, want the service's error", lines[1])
	}
}

func TestReadinessReportsEachBackendsHealth(t *testing.T) {
	f := startProxy(t, nil)
	code, body, _ := send(t, "GET", f.url+"/readyz", "", nil)
	if code != http.StatusOK || body["status"] != "SERVING" {
		t.Fatalf("readyz %d %v, want 200 SERVING", code, body)
	}
	f.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	code, body, _ = send(t, "GET", f.url+"/readyz", "", nil)
	backends, _ := body["backends"].(map[string]any)
	if code != http.StatusServiceUnavailable || backends["orchestrator"] != "NOT_SERVING" {
		t.Errorf("readyz %d %v, want 503 naming the orchestrator NOT_SERVING", code, body)
	}
	if _, ok := backends["gateway"]; ok {
		t.Errorf("readyz asks the gateway, which is not exposed: %v", backends)
	}
	code, _, _ = send(t, "GET", f.url+"/healthz", "", nil)
	if code != http.StatusOK {
		t.Errorf("healthz %d, want 200 while the proxy itself runs", code)
	}
}

func TestTheModelGatewayIsOnlyServedWhenTurnedOn(t *testing.T) {
	closed := startProxy(t, nil)
	code, _, _ := send(t, "POST", closed.url+"/v1/gateway/chat", `{}`, nil)
	if code != http.StatusNotFound {
		t.Errorf("gateway chat by default: status %d, want 404", code)
	}
	_, doc, _ := send(t, "GET", closed.url+"/openapi.json", "", nil)
	paths, _ := doc["paths"].(map[string]any)
	if _, ok := paths["/v1/runs"]; !ok {
		t.Errorf("openapi.json lacks /v1/runs: %v", paths)
	}
	for p := range paths {
		if strings.HasPrefix(p, "/v1/gateway/") {
			t.Errorf("openapi.json lists %s, which is not served", p)
		}
	}
	open := startProxy(t, map[string]string{"CAIRN_RESTPROXY_EXPOSE_GATEWAY": "true"})
	code, _, _ = send(t, "POST", open.url+"/v1/gateway/chat", `{}`, nil)
	if code != http.StatusNotImplemented {
		t.Errorf("gateway chat when exposed: status %d, want 501 from the (stand-in) service", code)
	}
}

func TestCORSAnswersOnlyTheNamedOrigins(t *testing.T) {
	f := startProxy(t, map[string]string{"CAIRN_RESTPROXY_CORS_ORIGINS": "https://panel.example"})
	preflight := map[string]string{"Origin": "https://panel.example", "Access-Control-Request-Method": "POST"}
	code, _, h := send(t, "OPTIONS", f.url+"/v1/runs", "", preflight)
	if code != http.StatusNoContent || h.Get("Access-Control-Allow-Origin") != "https://panel.example" ||
		!strings.Contains(h.Get("Access-Control-Allow-Headers"), "Authorization") {
		t.Errorf("preflight from the named origin: %d %v", code, h)
	}
	_, _, h = send(t, "OPTIONS", f.url+"/v1/runs", "", map[string]string{"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
	if h.Get("Access-Control-Allow-Origin") != "" {
		t.Errorf("an unnamed origin was allowed: %v", h)
	}
}

func TestBadSettingsAreRefusedNamingTheValue(t *testing.T) {
	cases := map[string]string{
		"CAIRN_RESTPROXY_CORS_ORIGINS":         "*",
		"CAIRN_RESTPROXY_MAX_BODY_BYTES":       "-1",
		"CAIRN_RESTPROXY_CALL_TIMEOUT_SECONDS": "soon",
		"CAIRN_RESTPROXY_EXPOSE_GATEWAY":       "maybe",
		"CAIRN_MEMORY_ADDR":                    "none",
	}
	for name, value := range cases {
		err := run(context.Background(), nil, func(k string) string {
			if k == name {
				return value
			}
			return ""
		}, io.Discard)
		if err == nil || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), value) {
			t.Errorf("%s=%q: error %v does not name the setting and value", name, value, err)
		}
		if exitCode(err, io.Discard) != 2 {
			t.Errorf("%s=%q: exit code is not 2", name, value)
		}
	}
}

func TestABareAddressIsDialledThroughDNSForRoundRobin(t *testing.T) {
	for in, want := range map[string]string{
		"orchestrator:50054":          "dns:///orchestrator:50054",
		"dns:///orchestrator:50054":   "dns:///orchestrator:50054",
		"unix:///run/cairn/orch.sock": "unix:///run/cairn/orch.sock",
	} {
		if got := dialTarget(in); got != want {
			t.Errorf("dialTarget(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestADocumentIdHoldingASlashReachesTheServiceWholeEscapedOrNot(t *testing.T) {
	f := startProxy(t, nil)
	for path, want := range map[string]string{
		"team%2Fguide.md": "team/guide.md", // as a browser's encodeURIComponent sends it
		"team/guide.md":   "team/guide.md",
		"_exit.2":         "_exit.2",
		"a%23b%25c":       "a#b%c",
	} {
		code, body, _ := send(t, "GET", f.url+"/v1/retrieval/documents/"+path, "", map[string]string{"Authorization": "Bearer t"})
		if code != 200 {
			t.Fatalf("GET %s: status %d, body %v", path, code, body)
		}
		if got := body["document"].(map[string]any)["documentId"]; got != want {
			t.Errorf("GET %s reached the service as %q, want %q", path, got, want)
		}
	}
}
