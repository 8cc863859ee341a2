package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

type testWorker struct {
	w   *Worker
	srv *httptest.Server
}

func newTestWorker(t *testing.T, role, model string, tp, pp int, mod ...func(*config.CacheTransceiver)) *testWorker {
	t.Helper()
	wc := &config.Worker{TensorParallelSize: tp, PipelineParallelSize: pp, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 4096}}
	ct, err := config.NewCacheTransceiver("tcp", 16, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	ct.KVTransferTimeoutMs = 10_000
	for _, m := range mod {
		m(ct)
	}
	wc.CacheTransceiver = ct
	return startTestWorker(t, WorkerOptions{Role: role, Model: model, Config: wc})
}

// startTestWorker builds a worker from o and serves it on a test server
// until the test ends.
func startTestWorker(t *testing.T, o WorkerOptions) *testWorker {
	t.Helper()
	role := o.Role
	w, err := NewWorker(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(w.Handler())
	tw := &testWorker{w: w, srv: srv}
	t.Cleanup(func() {
		srv.Close()
		http.DefaultClient.CloseIdleConnections()
		tw.waitIdle(t)
		if err := w.Close(); err != nil {
			t.Errorf("close %s worker: %v", role, err)
		}
	})
	return tw
}

// waitIdle waits until every block of the worker's pools is free again
// (held context requests are released when pulled or at their deadline).
func (tw *testWorker) waitIdle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		st := tw.w.Engine().Stats()
		free := true
		for _, p := range tw.w.Engine().Pools() {
			free = free && p.FreeBlocks() == p.NumBlocks()
		}
		if free && st.Running == 0 && st.Waiting == 0 && st.Transferring == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s worker not idle: %+v", tw.w.role, st)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type completion struct {
	Choices []struct {
		Text         string               `json:"text"`
		FinishReason string               `json:"finish_reason"`
		Disagg       *DisaggregatedParams `json:"disaggregated_params"`
		TokenIDs     []int32              `json:"token_ids"`
	} `json:"choices"`
	PromptTokenIDs []int32 `json:"prompt_token_ids"`
	Usage          struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
		Type    string `json:"type"`
	} `json:"error"`
}

func postJSON(t *testing.T, url string, body any) (int, completion, string) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var raw strings.Builder
	var c completion
	dec := json.NewDecoder(resp.Body)
	var v json.RawMessage
	dec.Decode(&v)
	raw.Write(v)
	json.Unmarshal(v, &c)
	return resp.StatusCode, c, raw.String()
}

// TestDisaggregatedEqualsAggregated: through the router, every pairing gives
// the tokens of an aggregated TP1 worker, streamed or not, greedy or seeded:
// the same token ids, max_tokens of them (ignore_eos), and the same text.
func TestDisaggregatedEqualsAggregated(t *testing.T) {
	tests := []struct {
		model                              string
		prefillTP, prefillPP, genTP, genPP int
	}{
		{"tiny-gqa", 2, 1, 1, 1},
		{"tiny-gqa", 1, 1, 2, 1},
		{"tiny-gqa", 2, 2, 1, 2},
		{"tiny-gqa", 4, 1, 2, 2},
		{"tiny-gqa2", 4, 1, 1, 1}, // duplicated KV heads on the context side
		{"tiny-mla", 2, 1, 1, 2},
	}
	if testing.Short() {
		tests = tests[:2]
	}
	const maxTokens = 12
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s ctx TP%d PP%d to gen TP%d PP%d", tc.model, tc.prefillTP, tc.prefillPP, tc.genTP, tc.genPP), func(t *testing.T) {
			prefillW := newTestWorker(t, RoleContext, tc.model, tc.prefillTP, tc.prefillPP)
			genW := newTestWorker(t, RoleGeneration, tc.model, tc.genTP, tc.genPP)
			agg := newTestWorker(t, RoleBoth, tc.model, 1, 1)
			rs := newTestRouter(t, []string{prefillW.srv.URL}, []string{genW.srv.URL}, RoundRobin)
			for i, prompt := range []string{"The quick brown fox", strings.Repeat("a long prompt over several blocks ", 4)} {
				for _, temp := range []float64{0, 0.9} {
					body := map[string]any{"prompt": prompt, "max_tokens": maxTokens, "temperature": temp, "seed": i,
						"ignore_eos": true, "return_token_ids": true}
					_, want, raw := postJSON(t, agg.srv.URL+"/v1/completions", body)
					if len(want.Choices) == 0 || len(want.Choices[0].TokenIDs) != maxTokens || want.Usage.CompletionTokens != maxTokens {
						t.Fatalf("aggregated: want %d token ids: %s", maxTokens, raw)
					}
					wantIDs, wantText := want.Choices[0].TokenIDs, want.Choices[0].Text
					code, got, raw := postJSON(t, rs.URL+"/v1/completions", body)
					if code != 200 || len(got.Choices) == 0 || !slices.Equal(got.Choices[0].TokenIDs, wantIDs) ||
						got.Choices[0].Text != wantText || got.Usage.CompletionTokens != maxTokens {
						t.Fatalf("prompt %d temp %v: router %d %s, aggregated %v %q", i, temp, code, raw, wantIDs, wantText)
					}
					body["stream"] = true
					sr, err := StreamCompletion(context.Background(), http.DefaultClient, rs.URL, body)
					if err != nil || !slices.Equal(sr.TokenIDs, wantIDs) || sr.Text != wantText || sr.FinishReason != "length" {
						t.Fatalf("prompt %d temp %v streamed: %v %q %q %v, want %v %q length", i, temp, sr.TokenIDs, sr.Text, sr.FinishReason, err, wantIDs, wantText)
					}
				}
			}
		})
	}
}

// TestManyClients: 64 clients in flight, a few hundred requests, all
// complete, and every pool is back to its free count.
func TestManyClients(t *testing.T) {
	n, inflight := 256, 64
	if testing.Short() {
		n, inflight = 64, 16
	}
	// 64 requests in flight queue at the generation worker: under -race on
	// a busy 2-core machine a context request can wait longer than the
	// 10 s the other tests give it before its pull starts, which is the
	// timeout doing its job, not what this test is about.
	slow := func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 60_000 }
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 2, 1, slow)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1, slow)
	rs := newTestRouter(t, []string{prefillW.srv.URL}, []string{genW.srv.URL}, LoadBalancing)
	var wg sync.WaitGroup
	sem := make(chan struct{}, inflight)
	errs := make(chan string, n)
	client := &http.Client{Timeout: 60 * time.Second}
	defer client.CloseIdleConnections()
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			body := map[string]any{"prompt": fmt.Sprintf("client %d says", i), "max_tokens": 8, "stream": i%2 == 0,
				"ignore_eos": true, "return_token_ids": true}
			if i%2 == 0 {
				sr, err := StreamCompletion(context.Background(), client, rs.URL, body)
				if err != nil {
					errs <- err.Error()
				} else if len(sr.TokenIDs) != 8 {
					errs <- fmt.Sprintf("client %d: %d token ids streamed, want 8", i, len(sr.TokenIDs))
				}
				return
			}
			b, _ := json.Marshal(body)
			resp, err := client.Post(rs.URL+"/v1/completions", "application/json", strings.NewReader(string(b)))
			if err != nil {
				errs <- err.Error()
				return
			}
			defer resp.Body.Close()
			var c completion
			json.NewDecoder(resp.Body).Decode(&c)
			if resp.StatusCode != 200 {
				errs <- resp.Status
			} else if len(c.Choices) != 1 || len(c.Choices[0].TokenIDs) != 8 {
				errs <- fmt.Sprintf("client %d: %+v, want 8 token ids", i, c.Choices)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func TestWorkerBadRequests(t *testing.T) {
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 1, 1)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1)
	id := uint64(1)
	tests := []struct {
		name string
		url  string
		body any
		code int
		want string
	}{
		{"no params on a context worker", prefillW.srv.URL, map[string]any{"prompt": "x"}, 400, "serves context_only requests, not context_and_generation"},
		{"generation type on a context worker", prefillW.srv.URL, map[string]any{"prompt": "x", "disaggregated_params": map[string]any{"request_type": "generation_only"}}, 400, "encoded_opaque_state is required"},
		{"context type on a generation worker", genW.srv.URL, map[string]any{"prompt": "x", "disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "serves generation_only requests"},
		{"unknown request type", prefillW.srv.URL, map[string]any{"prompt": "x", "disaggregated_params": map[string]any{"request_type": "prefill"}}, 400, `is not one of context_only`},
		{"params not an object", prefillW.srv.URL, map[string]any{"prompt": "x", "disaggregated_params": 7}, 400, "disaggregated_params"},
		{"opaque state not base64", genW.srv.URL, map[string]any{"prompt": []int{256, 1}, "disaggregated_params": DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, FirstGenTokens: []int32{5}, EncodedOpaqueState: "%%%"}}, 400, "not base64"},
		{"opaque state garbage", genW.srv.URL, map[string]any{"prompt": []int{256, 1}, "disaggregated_params": DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, FirstGenTokens: []int32{5}, EncodedOpaqueState: "aGVsbG8gd29ybGQ="}}, 400, "bad opaque state"},
		{"no prompt", prefillW.srv.URL, map[string]any{"disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "prompt is required"},
		{"bad max_tokens", prefillW.srv.URL, map[string]any{"prompt": "x", "max_tokens": 0, "disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "max_tokens = 0"},
		{"wrong model", prefillW.srv.URL, map[string]any{"model": "gpt-4", "prompt": "x"}, 404, `is not served here`},
		{"prompt too long", prefillW.srv.URL, map[string]any{"prompt": strings.Repeat("x", 5000), "disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "context_length_exceeded"},
		{"not json", prefillW.srv.URL, "garbage", 400, "request body"},
		{"resumed token out of the vocabulary", prefillW.srv.URL, map[string]any{"prompt": "x", "max_tokens": 4, ResumeField: []int{72, 999},
			"disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "resumed token 1 is 999"},
		{"resumed tokens fill max_tokens", prefillW.srv.URL, map[string]any{"prompt": "x", "max_tokens": 2, ResumeField: []int{72, 73},
			"disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "nothing to generate"},
		{"resumed tokens not a list", prefillW.srv.URL, map[string]any{"prompt": "x", ResumeField: "abc",
			"disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, ResumeField},
		{"too many resumed tokens", prefillW.srv.URL, map[string]any{"prompt": "x", ResumeField: make([]int, MaxResumeTokens),
			"disaggregated_params": map[string]any{"request_type": "context_only"}}, 400, "at most"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, raw := postJSON(t, tc.url+"/v1/completions", tc.body)
			if code != tc.code || !strings.Contains(raw, tc.want) {
				t.Fatalf("%d %s, want %d and %q", code, raw, tc.code, tc.want)
			}
		})
	}
}

// TestDraftTokensAcceptedNotUsed: draft_tokens are accepted, and the worker
// says once that it does not use them.
func TestDraftTokensAcceptedNotUsed(t *testing.T) {
	var logs syncbuf.Buffer
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 4096}}
	w := startTestWorker(t, WorkerOptions{Role: RoleBoth, Model: "tiny-gqa", Config: wc, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	for range 2 {
		code, _, raw := postJSON(t, w.srv.URL+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2,
			"disaggregated_params": map[string]any{"request_type": "context_and_generation", "draft_tokens": []int{3, 4}}})
		if code != 200 {
			t.Fatalf("%d %s", code, raw)
		}
	}
	if n := strings.Count(logs.String(), "draft_tokens accepted but not used"); n != 1 {
		t.Errorf("logged %d times:\n%s", n, logs.String())
	}
}

// TestDefaultWithNIXLEnvWarns: DEFAULT under TRTLLM_USE_NIXL_KVCACHE=1
// serves with AUTO and logs the warning config check prints.
func TestDefaultWithNIXLEnvWarns(t *testing.T) {
	var logs syncbuf.Buffer
	ct, err := config.NewCacheTransceiver("DEFAULT", 16, config.EnvFromMap(map[string]string{config.EnvUseNIXL: "1"}))
	if err != nil {
		t.Fatal(err)
	}
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 1024}, CacheTransceiver: ct}
	w := startTestWorker(t, WorkerOptions{Role: RoleContext, Model: "tiny-gqa", Config: wc, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if got := w.w.Transceiver().Resolution().Backend; got != config.BackendAuto {
		t.Errorf("backend %s, want AUTO", got)
	}
	if out := logs.String(); !strings.Contains(out, "level=WARN msg=\"TRTLLM_USE_NIXL_KVCACHE=1 asks DEFAULT for NIXL") {
		t.Errorf("no warning:\n%s", out)
	}
}

// TestPulledTwice: a context request can be pulled once; the second pull is
// refused with 409 and a message that says why.
func TestPulledTwice(t *testing.T) {
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 1, 1)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1)
	code, c, raw := postJSON(t, prefillW.srv.URL+"/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 4,
		"disaggregated_params": map[string]any{"request_type": "context_only"}})
	if code != 200 || len(c.Choices) == 0 || c.Choices[0].Disagg == nil || len(c.PromptTokenIDs) == 0 {
		t.Fatalf("%d %s", code, raw)
	}
	dp := *c.Choices[0].Disagg
	dp.RequestType = TypeGenerationOnly
	body := map[string]any{"prompt": c.PromptTokenIDs, "max_tokens": 4, "disaggregated_params": dp}
	if code, _, raw := postJSON(t, genW.srv.URL+"/v1/completions", body); code != 200 {
		t.Fatalf("first pull: %d %s", code, raw)
	}
	code, _, raw = postJSON(t, genW.srv.URL+"/v1/completions", body)
	if code != http.StatusConflict || !strings.Contains(raw, "already transferred") {
		t.Fatalf("second pull: %d %s", code, raw)
	}
}

// TestPromptMustMatch: a generation_only request whose prompt is not the
// one the context request was computed for is refused before any decoding.
func TestPromptMustMatch(t *testing.T) {
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 1, 1)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1)
	code, c, raw := postJSON(t, prefillW.srv.URL+"/v1/completions", map[string]any{"prompt": "hello there", "max_tokens": 4,
		"disaggregated_params": map[string]any{"request_type": "context_only"}})
	if code != 200 || len(c.Choices) == 0 || c.Choices[0].Disagg == nil {
		t.Fatalf("%d %s", code, raw)
	}
	dp := *c.Choices[0].Disagg
	dp.RequestType = TypeGenerationOnly
	short := c.PromptTokenIDs[:len(c.PromptTokenIDs)-2]
	code, _, raw = postJSON(t, genW.srv.URL+"/v1/completions", map[string]any{"prompt": short, "max_tokens": 4, "disaggregated_params": dp})
	if code != 400 || !strings.Contains(raw, "does not belong to this context request") {
		t.Fatalf("mismatched prompt: %d %s", code, raw)
	}
	// The genuine prompt still works: the context request was not consumed.
	code, _, raw = postJSON(t, genW.srv.URL+"/v1/completions", map[string]any{"prompt": c.PromptTokenIDs, "max_tokens": 4, "disaggregated_params": dp})
	if code != 200 {
		t.Fatalf("genuine prompt: %d %s", code, raw)
	}
}

// TestWorkerMetrics: after a few disaggregated requests, both workers'
// /metrics show non-zero transfer counters with the right labels.
func TestWorkerMetrics(t *testing.T) {
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 2, 1)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1)
	rs := newTestRouter(t, []string{prefillW.srv.URL}, []string{genW.srv.URL}, RoundRobin)
	for i := range 3 {
		if code, _, raw := postJSON(t, rs.URL+"/v1/completions", map[string]any{"prompt": fmt.Sprint("metrics ", i), "max_tokens": 4}); code != 200 {
			t.Fatalf("%d %s", code, raw)
		}
	}
	prefillW.waitIdle(t)
	scrape := func(url string) string { _, b := get(t, url+"/metrics"); return b }
	gm, cm := scrape(genW.srv.URL), scrape(prefillW.srv.URL)
	for _, want := range []string{
		`kvxfer_transfers_total{result="ok",role="generation"} 3`,
		`kvxfer_transfer_bytes_total{backend="tcp",role="generation"}`,
		`kvxfer_time_to_first_token_seconds_count 3`,
		`kvxfer_http_requests_total{code="200",route="POST /v1/completions"} 3`,
		`kvxfer_pool_blocks{rank="0",state="free"}`,
	} {
		if !strings.Contains(gm, want) {
			t.Errorf("generation /metrics lacks %s", want)
		}
	}
	// Two context ranks, three requests: six rank transfers.
	for _, want := range []string{`kvxfer_transfers_total{result="ok",role="context"} 6`, `kvxfer_transfer_bytes_total{backend="tcp",role="context"}`,
		`kvxfer_transfers_in_flight{role="context"} 0`} {
		if !strings.Contains(cm, want) {
			t.Errorf("context /metrics lacks %s", want)
		}
	}
	if strings.Contains(gm, `kvxfer_transfer_bytes_total{backend="tcp",role="generation"} 0`) {
		t.Error("no bytes counted")
	}
}

// TestOversizeBody413: a body over MaxBody used to be a 400 like a
// malformed one; it is 413 on every route that reads a body, the worker's
// and the router's, and the answer says the bound.
func TestOversizeBody413(t *testing.T) {
	w := startTestWorker(t, WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	_, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	big := `{"prompt":"` + strings.Repeat("x", MaxBody) + `"}`
	for _, url := range []string{w.srv.URL + "/v1/completions", w.srv.URL + "/v1/chat/completions", w.srv.URL + CancelContextPath,
		w.srv.URL + CachedPrefixPath, rs.URL + "/v1/completions", rs.URL + "/v1/chat/completions"} {
		resp, body := post(t, url, big)
		if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(body, fmt.Sprintf("over %d bytes", MaxBody)) {
			t.Errorf("%s: %d %.200s", url, resp.StatusCode, body)
		}
	}
	// At the bound it is read (and refused for what it says, not its size).
	atBound := `{"prompt":"` + strings.Repeat("x", MaxBody-len(`{"prompt":""}`)) + `"}`
	if resp, body := post(t, w.srv.URL+"/v1/completions", atBound); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "exceeds") {
		t.Errorf("a body of MaxBody bytes: %d %.200s", resp.StatusCode, body)
	}
}

// TestWorkerRefusesTrailingData: the worker decoded the first JSON value of
// a body and ignored what followed it (a second object, garbage), where
// the router refuses the body; it refuses it too now.
func TestWorkerRefusesTrailingData(t *testing.T) {
	w := startTestWorker(t, WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	for _, body := range []string{`{"prompt":"x","max_tokens":1} {"prompt":"y"}`, `{"prompt":"x","max_tokens":1}garbage`} {
		resp, b := post(t, w.srv.URL+"/v1/completions", body)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(b, "after top-level value") {
			t.Errorf("%s: %d %s", body, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, w.srv.URL+"/v1/completions", `{"prompt":"x","max_tokens":1}`+"\n"); resp.StatusCode != 200 {
		t.Errorf("a body with a trailing newline: %d %s", resp.StatusCode, b)
	}
}
