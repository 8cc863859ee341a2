package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
)

// Modes of a switchWorker.
const (
	modePass   = iota // proxy to the real worker
	modeRefuse        // answer completions with 503 (a generation phase refused)
	modeStall         // hang every route until the client gives up (a SIGSTOPped worker)
)

// switchWorker stands in front of a real worker and passes, refuses or
// stalls, as the test sets.
type switchWorker struct {
	mode   atomic.Int32
	served atomic.Int64 // completions passed to the real worker
	srv    *httptest.Server
}

func newSwitchWorker(t *testing.T, target string) *switchWorker {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	sw := &switchWorker{}
	proxy := httputil.NewSingleHostReverseProxy(u)
	proxy.FlushInterval = -1
	sw.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch sw.mode.Load() {
		case modeStall:
			<-r.Context().Done()
			return
		case modeRefuse:
			if r.URL.Path != "/health" {
				writeError(w, http.StatusServiceUnavailable, "queue_full", "refused by the test")
				return
			}
		}
		if r.URL.Path != "/health" {
			sw.served.Add(1)
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(sw.srv.Close)
	return sw
}

// newBigWorker is a tcp worker with a pool of maxTokens tokens and the
// default 60 s kv_transfer_timeout_ms, the deadline nobody should wait for.
func newBigWorker(t *testing.T, role string, maxTokens int) *testWorker {
	t.Helper()
	ct, err := config.NewCacheTransceiver("tcp", 16, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	ct.KVTransferTimeoutMs = 60_000
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: maxTokens},
		CacheTransceiver: ct}
	return startTestWorker(t, WorkerOptions{Role: role, Model: "tiny-gqa", Config: wc})
}

// waitFree waits until the worker's free block count is back to want, and
// returns how long that took; it fails the test after limit.
func waitFree(t *testing.T, tw *testWorker, want int, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for tw.w.Engine().Instance().FreeBlocks() != want {
		if time.Since(start) > limit {
			t.Fatalf("%d of %d blocks free %v later, want all back", tw.w.Engine().Instance().FreeBlocks(), want, limit)
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start)
}

// TestRefusedGenerationReleasesContext is issue #13's first scenario shrunk:
// generation requests refused by the generation worker used to leave their
// context requests pinned for kv_transfer_timeout_ms (60 s) and starve the
// next request. The router now cancels them on the context worker: the
// free block count is back within a second, and a legitimate request right
// after is served at once.
func TestRefusedGenerationReleasesContext(t *testing.T) {
	ctxW := newBigWorker(t, RoleContext, 512)
	genW := newBigWorker(t, RoleGeneration, 512)
	gen := newSwitchWorker(t, genW.srv.URL)
	router := newTestRouter(t, []string{ctxW.srv.URL}, []string{gen.srv.URL}, RoundRobin)
	total := ctxW.w.Engine().Instance().FreeBlocks()
	prompt := strings.Repeat("abandoned context ", 12) // 217 tokens: two of them fill the pool
	gen.mode.Store(modeRefuse)
	var worst time.Duration
	for i := range 8 {
		resp, body := post(t, router.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":8}`, prompt))
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("request %d: %d %s, want the generation worker's 503", i, resp.StatusCode, body)
		}
		worst = max(worst, waitFree(t, ctxW, total, time.Second))
	}
	t.Logf("context blocks back at most %v after a refused generation phase", worst)
	gen.mode.Store(modePass)
	start := time.Now()
	resp, body := post(t, router.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":8}`, prompt))
	if resp.StatusCode != http.StatusOK || time.Since(start) > 5*time.Second {
		t.Fatalf("legitimate request after the refusals: %d in %v: %s", resp.StatusCode, time.Since(start), body)
	}
	waitFree(t, ctxW, total, time.Second)
}

// TestClientGoneDuringPrefill: a client that disconnects while the context
// worker prefills a long prompt stops the prefill (the engine counts it as
// stopped, no tokens prefilled) and its blocks are back within a second.
func TestClientGoneDuringPrefill(t *testing.T) {
	ctxW := newBigWorker(t, RoleContext, 8192)
	genW := newBigWorker(t, RoleGeneration, 1024)
	router := newTestRouter(t, []string{ctxW.srv.URL}, []string{genW.srv.URL}, RoundRobin)
	total := ctxW.w.Engine().Instance().FreeBlocks()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("a long prompt ", 500), "max_tokens": 8})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, router.URL+"/v1/completions", strings.NewReader(string(body)))
	req.Header.Set("Content-Type", "application/json")
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for ctxW.w.Engine().Instance().FreeBlocks() == total {
		if time.Now().After(deadline) {
			t.Fatal("the prefill never started")
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	back := waitFree(t, ctxW, total, time.Second)
	<-errc
	st := statsWhen(ctxW.w.Engine(), func(st engine.Stats) bool { return st.PrefillsStopped > 0 })
	if st.PrefillsStopped != 1 || st.PrefillTokens != 0 {
		t.Fatalf("context engine: %d prefills stopped, %d tokens prefilled; want 1 stopped, 0 tokens", st.PrefillsStopped, st.PrefillTokens)
	}
	t.Logf("blocks back %v after the client went away", back)
}

// TestCancelContextEndpoint: POST /v1/disaggregated/cancel releases a held
// context request for whoever presents its ctx_request_id and its opaque
// state; a wrong state or id is refused the same way (404) and releases
// nothing.
func TestCancelContextEndpoint(t *testing.T) {
	ctxW := newBigWorker(t, RoleContext, 1024)
	total := ctxW.w.Engine().Instance().FreeBlocks()
	gen := contextPhase(t, ctxW, "held for nobody")
	dp := gen["disaggregated_params"].(DisaggregatedParams)
	if ctxW.w.Engine().Instance().FreeBlocks() == total {
		t.Fatal("the context request holds no blocks")
	}
	other := *dp.CtxRequestID + 1
	for _, c := range []struct {
		name string
		body any
		code int
	}{
		{"no body", map[string]any{}, http.StatusBadRequest},
		{"no state", map[string]any{"ctx_request_id": *dp.CtxRequestID}, http.StatusBadRequest},
		{"bad base64", map[string]any{"ctx_request_id": *dp.CtxRequestID, "encoded_opaque_state": "!!"}, http.StatusBadRequest},
		{"wrong state", map[string]any{"ctx_request_id": *dp.CtxRequestID, "encoded_opaque_state": "b3BhcXVl"}, http.StatusNotFound},
		{"other id", map[string]any{"ctx_request_id": other, "encoded_opaque_state": dp.EncodedOpaqueState}, http.StatusNotFound},
	} {
		code, _, raw := postJSON(t, ctxW.srv.URL+CancelContextPath, c.body)
		if code != c.code {
			t.Errorf("%s: %d %s, want %d", c.name, code, raw, c.code)
		}
		if ctxW.w.Engine().Instance().FreeBlocks() == total {
			t.Fatalf("%s: released the request", c.name)
		}
	}
	code, _, raw := postJSON(t, ctxW.srv.URL+CancelContextPath, dp)
	if code != http.StatusOK {
		t.Fatalf("cancel with the right state: %d %s", code, raw)
	}
	waitFree(t, ctxW, total, time.Second)
	if code, _, raw := postJSON(t, ctxW.srv.URL+CancelContextPath, dp); code != http.StatusNotFound {
		t.Errorf("second cancel: %d %s, want 404", code, raw)
	}
}

// statsWhen returns the engine's stats once cond holds of them (the
// scheduler publishes them after its step), or after a second.
func statsWhen(e *engine.Engine, cond func(engine.Stats) bool) engine.Stats {
	deadline := time.Now().Add(time.Second)
	for {
		st := e.Stats()
		if cond(st) || time.Now().After(deadline) {
			return st
		}
		time.Sleep(time.Millisecond)
	}
}

// TestRouterOutageLogsRateLimited: during a context outage the router used
// to log one warning per refused request (82,206 lines in 30 s). A burst of
// 1,000 refused requests is now a few lines, one of which counts the rest.
func TestRouterOutageLogsRateLimited(t *testing.T) {
	var logs syncbuf.Buffer
	_, gen := startFake(t, "gen", "")
	r, err := NewRouter(RouterOptions{Context: []string{deadURL(t)}, Generation: []string{gen},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	h := r.Handler()
	var wg sync.WaitGroup
	var refused atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 125 {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(`{"prompt":"hi"}`)))
				if rec.Code == http.StatusBadGateway {
					refused.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if refused.Load() != 1000 {
		t.Fatalf("%d of 1000 requests refused with 502", refused.Load())
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "suppressed=") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	total := 0
	for _, l := range lines {
		n := 1
		if _, after, ok := strings.Cut(l, "suppressed="); ok {
			// A line that gets through counts itself and those left
			// out before it; an interval's summary counts those only.
			var left int
			fmt.Sscan(after, &left)
			n = left
			if !strings.Contains(l, "interval=") {
				n++
			}
		}
		total += n
	}
	if len(lines) > 4 || total != 1000 {
		t.Fatalf("%d lines counting %d failures, want at most 4 counting 1000:\n%s", len(lines), total, logs.String())
	}
	t.Logf("1000 refused requests: %d log lines", len(lines))
}
