package serve

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
)

// fakeWorker plays a context or generation worker for router tests.
type fakeWorker struct {
	role  string
	calls atomic.Int64
	last  atomic.Value // object of the last request
	// finish is the context worker's finish_reason.
	finish string
}

func (f *fakeWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/health" {
		w.WriteHeader(http.StatusOK)
		return
	}
	f.calls.Add(1)
	var o object
	if err := json.NewDecoder(r.Body).Decode(&o); err != nil {
		writeError(w, 400, "invalid_request_error", err.Error())
		return
	}
	f.last.Store(o)
	var dp DisaggregatedParams
	o.get("disaggregated_params", &dp)
	switch f.role {
	case "ctx":
		if dp.RequestType != TypeContextOnly {
			writeError(w, 400, "invalid_request_error", "want context_only, got "+dp.RequestType)
			return
		}
		var stream bool
		o.get("stream", &stream)
		if stream {
			writeError(w, 400, "invalid_request_error", "the context phase must not stream")
			return
		}
		id := uint64(7)
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{
			"object": "text_completion",
			"choices": []map[string]any{{"index": 0, "text": "H", "finish_reason": f.finish,
				"disaggregated_params": DisaggregatedParams{RequestType: TypeContextOnly, CtxRequestID: &id,
					EncodedOpaqueState: "b3BhcXVl", FirstGenTokens: []int32{72}}}},
			"prompt_token_ids": []int32{256, 104, 105},
		})
	case "gen":
		if dp.RequestType != TypeGenerationOnly || dp.EncodedOpaqueState != "b3BhcXVl" || dp.CtxRequestID == nil || *dp.CtxRequestID != 7 {
			writeError(w, 400, "invalid_request_error", fmt.Sprintf("bad disaggregated_params %+v", dp))
			return
		}
		var prompt []int32
		if _, err := o.get("prompt", &prompt); err != nil {
			o.get("prompt_token_ids", &prompt)
		}
		var stream bool
		o.get("stream", &stream)
		if stream {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, t := range []string{"H", "ello"} {
				fmt.Fprintf(w, "data: {\"choices\":[{\"text\":%q}]}\n\n", t)
				w.(http.Flusher).Flush()
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"object": "text_completion",
			"choices": []map[string]any{{"index": 0, "text": "Hello", "finish_reason": "length"}}, "prompt": prompt})
	}
}

func newTestRouter(t *testing.T, prefillURLs, genURLs []string, p Policy) *httptest.Server {
	t.Helper()
	r, err := NewRouter(RouterOptions{Context: prefillURLs, Generation: genURLs, ContextPolicy: p, GenerationPolicy: p})
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(r.Handler())
	t.Cleanup(func() {
		s.Close()
		r.Close()
		http.DefaultClient.CloseIdleConnections()
	})
	return s
}

func startFake(t *testing.T, role, finish string) (*fakeWorker, string) {
	f := &fakeWorker{role: role, finish: finish}
	s := httptest.NewServer(f)
	t.Cleanup(s.Close)
	return f, s.URL
}

func post(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func TestRouterFlow(t *testing.T) {
	prefillW, cu := startFake(t, "ctx", "length")
	genW, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)

	resp, body := post(t, rs.URL+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5,"user":"kept"}`)
	if resp.StatusCode != 200 || !strings.Contains(body, `"Hello"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// The generation worker got the token ids instead of the text, the
	// context's params as generation_only, and the fields it did not know.
	last := genW.last.Load().(object)
	var prompt []int32
	last.get("prompt", &prompt)
	var user string
	last.get("user", &user)
	if fmt.Sprint(prompt) != "[256 104 105]" || user != "kept" {
		t.Errorf("generation request: prompt %v user %q", prompt, user)
	}
	if prefillW.calls.Load() != 1 || genW.calls.Load() != 1 {
		t.Errorf("calls ctx %d gen %d", prefillW.calls.Load(), genW.calls.Load())
	}

	// Chat: the ids travel as prompt_token_ids, messages stay.
	resp, body = post(t, rs.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("chat: %d %s", resp.StatusCode, body)
	}
	last = genW.last.Load().(object)
	var ids []int32
	last.get("prompt_token_ids", &ids)
	if len(ids) != 3 || last["messages"] == nil {
		t.Errorf("chat generation request: %v", last)
	}
}

func TestRouterStreams(t *testing.T) {
	_, cu := startFake(t, "ctx", "not_finished")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	resp, err := http.Post(rs.URL+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("content type %q", ct)
	}
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "data: ") {
			events = append(events, strings.TrimPrefix(l, "data: "))
		}
	}
	if len(events) != 3 || events[2] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
}

// A context answer that already finished (first token was EOS) is the
// answer: the generation server is not called.
func TestRouterFinishedInContext(t *testing.T) {
	_, cu := startFake(t, "ctx", "stop")
	genW, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode != 200 || !strings.Contains(body, `"finish_reason":"stop"`) || genW.calls.Load() != 0 {
		t.Fatalf("%d %s (gen calls %d)", resp.StatusCode, body, genW.calls.Load())
	}
	resp, body = post(t, rs.URL+"/v1/completions", `{"prompt":"hi","stream":true}`)
	if resp.StatusCode != 200 || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("stream: %d %q", resp.StatusCode, body)
	}
}

// deadURL is the URL of a loopback port nothing listens on. The port is
// below the ephemeral range (package freeport): one probed with :0 and
// closed could become another test process's listener (any :0 bind may
// take it), and the worker would no longer refuse connections.
func deadURL(t *testing.T) string {
	p, err := freeport.Port()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", p)
}

func TestRouterRetriesUnreachable(t *testing.T) {
	prefillW, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{deadURL(t), cu}, []string{deadURL(t), gu}, RoundRobin)
	for range 4 {
		resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	if prefillW.calls.Load() != 4 {
		t.Errorf("context calls %d", prefillW.calls.Load())
	}
	// Nobody reachable: 502 naming the servers.
	rs2 := newTestRouter(t, []string{deadURL(t)}, []string{gu}, RoundRobin)
	resp, body := post(t, rs2.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, "no context server reachable") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

func TestRouterLoadBalancing(t *testing.T) {
	g := &group{policy: LoadBalancing, servers: []*upstream{{url: "a"}, {url: "b"}, {url: "c"}}}
	g.servers[0].inflight.Store(5)
	g.servers[1].inflight.Store(1)
	g.servers[2].inflight.Store(3)
	if o := g.order(); o[0].url != "b" || o[1].url != "c" || o[2].url != "a" {
		t.Fatalf("order %s %s %s", o[0].url, o[1].url, o[2].url)
	}
	rr := &group{policy: RoundRobin, servers: []*upstream{{url: "a"}, {url: "b"}}}
	first, second := rr.order()[0].url, rr.order()[0].url
	if first == second {
		t.Error("round robin did not rotate")
	}
}

// TestRouterPolicies: TensorRT-LLM's four policies are taken as they are,
// without a warning; an unknown policy is refused with the valid ones.
func TestRouterPolicies(t *testing.T) {
	for _, p := range []Policy{RoundRobin, LoadBalancing, KVCacheAware, Conversation} {
		var logs bytes.Buffer
		r, err := NewRouter(RouterOptions{Context: []string{"a:1"}, Generation: []string{"b:2"}, ContextPolicy: p,
			GenerationPolicy: RoundRobin, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if r.prefill.policy != p || r.gen.policy != RoundRobin {
			t.Errorf("%s: policies %s, %s", p, r.prefill.policy, r.gen.policy)
		}
		if (r.prefill.conv != nil) != (p == Conversation) || r.kvPolled != (p == KVCacheAware) {
			t.Errorf("%s: conversation memory %v, kv polled %v", p, r.prefill.conv != nil, r.kvPolled)
		}
		if out := logs.String(); strings.Contains(out, "level=WARN") {
			t.Errorf("%s: log %q", p, out)
		}
		r.Close()
	}
	if _, err := NewRouter(RouterOptions{Context: []string{"a:1"}, Generation: []string{"b:2"}, ContextPolicy: "random"}); err == nil ||
		!strings.Contains(err.Error(), `context router policy "random" (valid: round_robin, load_balancing, kv_cache_aware, conversation)`) {
		t.Errorf("unknown policy: %v", err)
	}
}

func TestRouterBadRequests(t *testing.T) {
	_, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	for _, tc := range []struct{ body, want string }{
		{`not json`, "request body must be a JSON object: invalid character 'o' in literal null (expecting 'u') (at byte 2)"},
		{`[1,2]`, "request body must be a JSON object, not a JSON array"},
		{`null`, "request body must be a JSON object, not null"},
		{`{"prompt":"x"`, "request body must be a JSON object: unexpected end of JSON input"},
		{`{"prompt":"x"} {"prompt":"y"}`, "invalid character '{' after top-level value"},
		{`{"prompt":"x","stream":"yes"}`, `field \"stream\"`},
		{`{"prompt":"x","disaggregated_params":{}}`, "set by the router"},
		// A worker reads keys whatever their case (encoding/json), the
		// router only as spelled: a key the router would miss is refused.
		{`{"prompt":"x","KVXFER_RESUME_TOKEN_IDS":[1]}`, `key \"KVXFER_RESUME_TOKEN_IDS\" is the request field \"kvxfer_resume_token_ids\"`},
		{`{"prompt":"x","Disaggregated_Params":{}}`, `key \"Disaggregated_Params\"`},
		{`{"prompt":"x","Cache_Salt":"tenant-a"}`, `key \"Cache_Salt\"`},
		{`{"prompt":"x","Stream":true}`, `key \"Stream\"`},
		{`{"prompt":"x","conversation_id":"` + strings.Repeat("c", MaxConversationIDLen) + `"}`, "conversation_id has 1026 bytes of JSON, at most 1024"},
		{`{"prompt":"x","disaggregated_params":{"conversation_id":"` + strings.Repeat("c", MaxConversationIDLen) + `"}}`, "conversation_id has 1026 bytes"},
	} {
		resp, body := post(t, rs.URL+"/v1/completions", tc.body)
		if resp.StatusCode != 400 || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s", tc.body, resp.StatusCode, body)
		}
	}
	resp, _ := post(t, rs.URL+"/v2/nothing", `{}`)
	if resp.StatusCode != 404 {
		t.Errorf("unknown route: %d", resp.StatusCode)
	}
}

func TestRouterHealthAndMetrics(t *testing.T) {
	_, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	resp, body := get(t, rs.URL+"/health")
	if resp.StatusCode != 200 || !strings.Contains(body, `"status":"ok"`) {
		t.Fatalf("health %d %s", resp.StatusCode, body)
	}
	bad := newTestRouter(t, []string{cu}, []string{deadURL(t)}, RoundRobin)
	resp, body = get(t, bad.URL+"/health")
	if resp.StatusCode != 503 || !strings.Contains(body, `"healthy":false`) {
		t.Fatalf("health with a dead worker %d %s", resp.StatusCode, body)
	}
	post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	_, m := get(t, rs.URL+"/metrics")
	for _, want := range []string{`kvxfer_http_requests_total{code="200",route="POST /v1/completions"} 1`, `kvxfer_router_upstream_requests_total{result="ok",role="context"} 1`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func get(t *testing.T, url string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// A chat answer finished in the context phase, replayed to a streaming
// client, is a chat.completion.chunk whose message became the delta.
func TestReplayFinishedChat(t *testing.T) {
	rec := httptest.NewRecorder()
	(&Router{}).replayFinished(rec, []byte(`{"object":"chat.completion","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"x"}}]}`), true)
	body := rec.Body.String()
	if !strings.Contains(body, `"object":"chat.completion.chunk"`) || !strings.Contains(body, `"delta":{"role":"assistant","content":"x"}`) ||
		strings.Contains(body, `"message"`) || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("%q", body)
	}
}

// TestRouterModelsNoWorkerOrStalled: GET /v1/models used to panic (the
// client saw its connection reset) when the cluster had no generation
// worker registered yet, and to wait on a stalled generation worker for the
// HTTP client's 10-minute header timeout without trying another. It now
// answers 503 naming the missing role, and a stalled worker costs the
// header deadline, after which the next one answers.
func TestRouterModelsNoWorkerOrStalled(t *testing.T) {
	_, rs, _ := dynRouter(t, nil)
	resp, body := get(t, rs.URL+"/v1/models")
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, "cluster_not_ready") {
		t.Errorf("no worker registered: %d %s", resp.StatusCode, body)
	}

	stalled := make(chan struct{})
	stall := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stalled:
		case <-r.Context().Done():
		}
	}))
	defer stall.Close()
	defer close(stalled)
	models := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"object":"list","data":[{"id":"tiny-gqa"}]}`)
	}))
	defer models.Close()
	r, err := NewRouter(RouterOptions{Context: []string{models.URL}, Generation: []string{stall.URL, models.URL},
		RouterDeadlines: RouterDeadlines{HeaderTimeout: 300 * time.Millisecond, ProbeInterval: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	srv := httptest.NewServer(r.Handler())
	defer srv.Close()
	client := &http.Client{Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	for i := range 2 { // round robin: the stalled worker comes first once
		start := time.Now()
		resp, err := client.Get(srv.URL + "/v1/models")
		if err != nil {
			t.Fatalf("GET %d: %v after %v", i, err, time.Since(start))
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), "tiny-gqa") {
			t.Errorf("GET %d: %d %s after %v", i, resp.StatusCode, b, time.Since(start))
		}
	}
}

// TestRouterUpstreamOddStatus: a worker that answers a completion with a
// redirect or a success other than 200 gets its request failed with 502,
// naming the status, and a redirect is not followed: the router would
// otherwise send the client's prompt wherever a Location points and hand
// the client what it found there.
func TestRouterUpstreamOddStatus(t *testing.T) {
	var elsewhere atomic.Int32
	other := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
		rw.Write([]byte(`{"choices":[{"text":"from elsewhere","finish_reason":"stop"}]}`))
	}))
	t.Cleanup(other.Close)
	_, gu := startFake(t, "gen", "")
	for _, tc := range []struct {
		status int
		want   string
	}{
		{http.StatusTemporaryRedirect, "307 Temporary Redirect"},
		{http.StatusPermanentRedirect, "308 Permanent Redirect"},
		{http.StatusFound, "302 Found"},
		{http.StatusNotModified, "304 Not Modified"},
		{http.StatusNoContent, "204 No Content"},
		{http.StatusCreated, "201 Created"},
	} {
		ctx := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			rw.Header().Set("Location", other.URL+r.URL.Path)
			rw.WriteHeader(tc.status)
		}))
		rs := newTestRouter(t, []string{ctx.URL}, []string{gu}, RoundRobin)
		resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"secret prompt","max_tokens":2}`)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, tc.want) {
			t.Errorf("context worker answering %d: the client got %d %s; want 502 naming %q", tc.status, resp.StatusCode, body, tc.want)
		}
		ctx.Close()
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("the router followed a worker's redirect %d times", n)
	}
}
