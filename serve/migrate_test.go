package serve

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// cutter stands in front of a real generation worker and passes its
// requests through; while cuts are armed (a count the cutters of a test
// share), the next generation answer dies part-way, as when the worker
// dies: a stream after `after` events, any other answer before its
// headers. The connection is closed, and the real worker sees its client
// go away. With die set the worker stays dead after its cut: its listener
// is closed and any connection still open is dropped.
type cutter struct {
	srv   *httptest.Server
	arms  *atomic.Int64
	after atomic.Int64
	die   bool
	dead  atomic.Bool
	cuts  atomic.Int64
	// how is how the cut happens: cutClose (the default), cutStall (the
	// worker stops sending, as a SIGSTOPped one) or cut502 (the worker
	// answers 502 at once, as for a failed KV transfer).
	how atomic.Int32
}

const (
	cutClose = iota
	cutStall
	cut502
)

func newCutter(t *testing.T, target string, arms *atomic.Int64, die bool) *cutter {
	t.Helper()
	c := &cutter{arms: arms, die: die}
	client := &http.Client{Transport: &http.Transport{}}
	hijack := func(w http.ResponseWriter) {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c.dead.Load() {
			hijack(w)
			return
		}
		body, _ := io.ReadAll(r.Body)
		if c.how.Load() == cut502 && r.URL.Path != "/health" {
			if c.arms.Add(-1) >= 0 {
				c.cuts.Add(1)
				writeError(w, http.StatusBadGateway, "kv_transfer_failed", "cut by the test")
				return
			}
			c.arms.Add(1)
		}
		ureq, _ := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.Path, bytes.NewReader(body))
		ureq.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(ureq)
		if err != nil {
			writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return
		}
		defer resp.Body.Close()
		cut := r.URL.Path != "/health" && c.arms.Add(-1) >= 0
		if !cut && r.URL.Path != "/health" {
			c.arms.Add(1)
		}
		copyHeaders(w, resp)
		if !cut {
			w.WriteHeader(resp.StatusCode)
			flushCopyErr(w, resp.Body)
			return
		}
		c.cuts.Add(1)
		if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			w.WriteHeader(resp.StatusCode)
			w.(http.Flusher).Flush()
			br := bufio.NewReader(resp.Body)
			for n := int64(0); n < c.after.Load(); {
				line, err := br.ReadString('\n')
				if err != nil {
					break
				}
				io.WriteString(w, line)
				if line == "\n" {
					n++
					w.(http.Flusher).Flush()
				}
			}
		} else {
			io.Copy(io.Discard, resp.Body) // the answer is lost with the worker
		}
		if c.how.Load() == cutStall {
			<-r.Context().Done()
			return
		}
		hijack(w)
		if c.die {
			c.dead.Store(true)
			c.srv.Listener.Close()
		}
	}))
	t.Cleanup(func() {
		c.srv.Close()
		client.CloseIdleConnections()
	})
	return c
}

// migrationCluster is a context worker and n generation workers behind
// cutters (sharing arms), and a router with the migration limit.
type migrationCluster struct {
	router  *Router
	url     string
	ctxW    *testWorker
	gens    []*testWorker
	cutters []*cutter
	arms    atomic.Int64
}

func newMigrationCluster(t *testing.T, n, limit int, die bool) *migrationCluster {
	t.Helper()
	return newMigrationClusterDeadlines(t, n, limit, die, RouterDeadlines{ProbeInterval: 50 * time.Millisecond})
}

func newMigrationClusterDeadlines(t *testing.T, n, limit int, die bool, d RouterDeadlines) *migrationCluster {
	t.Helper()
	mc := &migrationCluster{ctxW: newTestWorker(t, RoleContext, "tiny-gqa", 1, 1)}
	var urls []string
	for range n {
		g := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1)
		c := newCutter(t, g.srv.URL, &mc.arms, die)
		mc.gens, mc.cutters = append(mc.gens, g), append(mc.cutters, c)
		urls = append(urls, c.srv.URL)
	}
	r, err := NewRouter(RouterOptions{Context: []string{mc.ctxW.srv.URL}, Generation: urls, MigrationLimit: limit, RouterDeadlines: d})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler())
	t.Cleanup(func() {
		srv.Close()
		r.Close()
		http.DefaultClient.CloseIdleConnections()
	})
	mc.router, mc.url = r, srv.URL
	return mc
}

// cut arms cuts after `after` events of a stream.
func (mc *migrationCluster) cut(cuts, after int) {
	for _, c := range mc.cutters {
		c.after.Store(int64(after))
	}
	mc.arms.Store(int64(cuts))
}

func (mc *migrationCluster) cuts() int64 {
	var n int64
	for _, c := range mc.cutters {
		n += c.cuts.Load()
	}
	return n
}

// allFree waits until every worker's blocks are back.
func (mc *migrationCluster) allFree(t *testing.T) {
	t.Helper()
	for _, w := range append([]*testWorker{mc.ctxW}, mc.gens...) {
		waitFree(t, w, w.w.Engine().Instance().NumBlocks(), 2*time.Second)
	}
}

// answer is a completion as a client sees it, streamed or not.
type answer struct {
	Text       string
	IDs        []int32
	HasIDs     bool // some chunk or choice carried token_ids
	Finish     string
	Completion int // usage.completion_tokens
	Done       bool
	Error      string // an error event, or a non-200 answer
	Code       int
	Roles      int // chat stream: role chunks
	StreamIDs  int // distinct chunk ids
}

type wireChoice struct {
	Text    string `json:"text"`
	Message struct {
		Content string `json:"content"`
	} `json:"message"`
	Delta struct {
		Role    *string `json:"role"`
		Content string  `json:"content"`
	} `json:"delta"`
	TokenIDs     []int32 `json:"token_ids"`
	FinishReason *string `json:"finish_reason"`
}

type wireAnswer struct {
	ID      string       `json:"id"`
	Choices []wireChoice `json:"choices"`
	Usage   *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// ask posts body to the router's path and collects the answer.
func ask(t *testing.T, url, path string, body map[string]any) answer {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := answer{Code: resp.StatusCode}
	take := func(w wireAnswer) {
		if w.Error != nil {
			a.Error = w.Error.Message
		}
		if w.Usage != nil {
			a.Completion = w.Usage.CompletionTokens
		}
		for _, c := range w.Choices {
			a.Text += c.Text + c.Message.Content + c.Delta.Content
			a.IDs = append(a.IDs, c.TokenIDs...)
			a.HasIDs = a.HasIDs || c.TokenIDs != nil
			if c.Delta.Role != nil {
				a.Roles++
			}
			if c.FinishReason != nil {
				a.Finish = *c.FinishReason
			}
		}
	}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		var w wireAnswer
		raw, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(raw, &w); err != nil {
			t.Fatalf("answer %d %q: %v", resp.StatusCode, raw, err)
		}
		take(w)
		return a
	}
	ids := map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			a.Done = true
			continue
		}
		if a.Done {
			t.Fatalf("event after [DONE]: %s", data)
		}
		var w wireAnswer
		if err := json.Unmarshal([]byte(data), &w); err != nil {
			t.Fatalf("event %q: %v", data, err)
		}
		if w.ID != "" {
			ids[w.ID] = true
		}
		take(w)
	}
	a.StreamIDs = len(ids)
	return a
}

// TestMigration: a generation worker that dies mid-request (a stream cut
// after 0 to 6 events, or a non-streamed answer lost) hands its request
// over to the other generation worker, and the client gets exactly the
// answer of an uninterrupted request: the same token ids (as many as
// max_tokens), the same text, one role chunk and one stream id, usage
// counting every token, and [DONE]; greedy and seeded, completions and
// chat. A client that did not ask for token ids gets none. Every worker's
// blocks are back afterwards.
func TestMigration(t *testing.T) {
	mc := newMigrationCluster(t, 2, 0, false)
	const maxTokens = 24
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		for _, temp := range []float64{0, 0.9} {
			body := map[string]any{"max_tokens": maxTokens, "temperature": temp, "seed": 5, "ignore_eos": true, "return_token_ids": true}
			if path == "/v1/completions" {
				body["prompt"] = "Migrate me, please"
			} else {
				body["messages"] = []map[string]string{{"role": "user", "content": "Migrate me, please"}}
			}
			for _, stream := range []bool{false, true} {
				name := fmt.Sprintf("%s temp %v stream %v", path, temp, stream)
				body["stream"] = stream
				if stream {
					body["stream_options"] = map[string]any{"include_usage": true}
				} else {
					delete(body, "stream_options")
				}
				mc.cut(0, 0)
				want := ask(t, mc.url, path, body)
				if want.Code != 200 || len(want.IDs) != maxTokens || want.Completion != maxTokens || want.Text == "" || stream && !want.Done {
					t.Fatalf("%s: uninterrupted: %+v", name, want)
				}
				afters := []int{0}
				if stream {
					afters = []int{0, 1, 3, 6}
				}
				for _, after := range afters {
					before := mc.cuts()
					ok := metricValue(t, mc.router.Registry(), "kvxfer_router_migrations_total", map[string]string{"result": "ok"})
					mc.cut(1, after)
					got := ask(t, mc.url, path, body)
					if mc.cuts() != before+1 {
						t.Fatalf("%s after %d events: %d cuts, want 1", name, after, mc.cuts()-before)
					}
					if got.Code != 200 || got.Error != "" || !slices.Equal(got.IDs, want.IDs) || got.Text != want.Text ||
						got.Finish != want.Finish || got.Completion != maxTokens || got.Done != stream {
						t.Fatalf("%s cut after %d events: %+v\nwant %+v", name, after, got, want)
					}
					if stream && (got.StreamIDs != 1 || path == "/v1/chat/completions" && got.Roles != 1) {
						t.Errorf("%s cut after %d events: %d stream ids, %d role chunks; want 1 and 1 (chat)", name, after, got.StreamIDs, got.Roles)
					}
					if n := metricValue(t, mc.router.Registry(), "kvxfer_router_migrations_total", map[string]string{"result": "ok"}); n != ok+1 {
						t.Errorf("%s: kvxfer_router_migrations_total{result=ok} went from %v to %v, want one more", name, ok, n)
					}
					mc.allFree(t)
				}
				if stream {
					// Without return_token_ids the client gets the same text
					// and no ids, though the router tracks them.
					delete(body, "return_token_ids")
					mc.cut(1, 3)
					got := ask(t, mc.url, path, body)
					body["return_token_ids"] = true
					if got.Text != want.Text || got.HasIDs || !got.Done || got.Completion != maxTokens {
						t.Fatalf("%s without return_token_ids: %+v, want text %q, no ids", name, got, want.Text)
					}
					mc.allFree(t)
				}
			}
		}
	}
	if n := metricValue(t, mc.router.Registry(), "kvxfer_router_migrations_total", map[string]string{"result": "failed"}); n != 0 {
		t.Errorf("kvxfer_router_migrations_total{result=failed} = %v, want 0", n)
	}
}

// TestMigrationStallAnd502: a generation worker that stops sending
// mid-stream (past the chunk deadline) or answers 502 before any output
// (a failed KV transfer) hands the request over too (a non-streamed answer
// stalls before its headers: the header deadline); the unpulled context
// request of the 502 is released.
func TestMigrationStallAnd502(t *testing.T) {
	mc := newMigrationClusterDeadlines(t, 2, 1, false, RouterDeadlines{HeaderTimeout: 2 * time.Second, ChunkTimeout: 300 * time.Millisecond, ProbeInterval: 50 * time.Millisecond})
	for _, how := range []int32{cutStall, cut502} {
		for _, c := range mc.cutters {
			c.how.Store(how)
		}
		for _, stream := range []bool{true, false} {
			body := map[string]any{"prompt": "Stalled or failed", "max_tokens": 20, "ignore_eos": true, "temperature": 0.7, "seed": 3,
				"return_token_ids": true, "stream": stream}
			mc.cut(0, 0)
			want := ask(t, mc.url, "/v1/completions", body)
			before := mc.cuts()
			mc.cut(1, 4)
			got := ask(t, mc.url, "/v1/completions", body)
			if mc.cuts() != before+1 || got.Code != 200 || got.Error != "" || got.Text != want.Text || !slices.Equal(got.IDs, want.IDs) ||
				len(got.IDs) != 20 || got.Done != stream {
				t.Fatalf("cut %d, stream %v: %+v after %d cuts\nwant %+v", how, stream, got, mc.cuts()-before, want)
			}
			mc.allFree(t)
		}
	}
}

// TestMigrationFails: where migration is off, the limit is reached or no
// generation worker is left, a stream cut by a dying worker ends with an
// error event and no [DONE] (a non-streamed request gets a 502), and every
// worker's blocks are back.
func TestMigrationFails(t *testing.T) {
	body := func(stream bool) map[string]any {
		return map[string]any{"prompt": "Nowhere to go", "max_tokens": 16, "ignore_eos": true, "stream": stream}
	}
	streamFails := func(t *testing.T, mc *migrationCluster, what string) {
		t.Helper()
		got := ask(t, mc.url, "/v1/completions", body(true))
		if got.Code != 200 || got.Text == "" || got.Error == "" || got.Done {
			t.Fatalf("%s: %+v, want some text, an error event and no [DONE]", what, got)
		}
	}
	t.Run("off", func(t *testing.T) {
		mc := newMigrationCluster(t, 2, MigrationOff, false)
		if mc.router.MigrationLimit() != 0 {
			t.Fatalf("MigrationLimit() = %d with MigrationOff", mc.router.MigrationLimit())
		}
		mc.cut(1, 3)
		streamFails(t, mc, "migration off")
		mc.cut(1, 0)
		if got := ask(t, mc.url, "/v1/completions", body(false)); got.Code != http.StatusBadGateway || got.Error == "" {
			t.Fatalf("migration off, non-streamed: %+v, want a 502", got)
		}
		if mc.cuts() != 2 {
			t.Fatalf("%d cuts, want 2", mc.cuts())
		}
		mc.allFree(t)
	})
	t.Run("limit", func(t *testing.T) {
		mc := newMigrationCluster(t, 2, 1, false)
		if mc.router.MigrationLimit() != 1 {
			t.Fatalf("MigrationLimit() = %d, want the default 1", mc.router.MigrationLimit())
		}
		mc.cut(2, 3) // the migrated stream dies too
		streamFails(t, mc, "second death with limit 1")
		mc.cut(2, 0)
		if got := ask(t, mc.url, "/v1/completions", body(false)); got.Code != http.StatusBadGateway || got.Error == "" {
			t.Fatalf("second death with limit 1, non-streamed: %+v, want a 502", got)
		}
		if mc.cuts() != 4 {
			t.Fatalf("%d cuts, want 4", mc.cuts())
		}
		reg := mc.router.Registry()
		if ok, failed := metricValue(t, reg, "kvxfer_router_migrations_total", map[string]string{"result": "ok"}),
			metricValue(t, reg, "kvxfer_router_migrations_total", map[string]string{"result": "failed"}); ok != 1 || failed != 2 {
			// The stream's migration was taken over (then died); the
			// non-streamed one's was not (its answer was lost again).
			t.Errorf("migrations ok %v failed %v, want 1 and 2", ok, failed)
		}
		mc.allFree(t)
	})
	t.Run("limit 2", func(t *testing.T) {
		mc := newMigrationCluster(t, 2, 2, false)
		want := ask(t, mc.url, "/v1/completions", body(true))
		mc.cut(2, 3)
		got := ask(t, mc.url, "/v1/completions", body(true))
		if got.Text != want.Text || !got.Done || got.Error != "" || mc.cuts() != 2 {
			t.Fatalf("two deaths with limit 2: %+v after %d cuts, want %q and [DONE]", got, mc.cuts(), want.Text)
		}
		mc.allFree(t)
	})
	t.Run("only worker dead", func(t *testing.T) {
		mc := newMigrationCluster(t, 1, 1, true)
		mc.cut(1, 3)
		streamFails(t, mc, "the only generation worker dead")
		if got := ask(t, mc.url, "/v1/completions", body(false)); got.Code != http.StatusBadGateway || got.Error == "" {
			t.Fatalf("the only generation worker dead, non-streamed: %+v, want a 502", got)
		}
		if got := ask(t, mc.url, "/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "user", "content": "x"}}, "stream": true}); got.Code != http.StatusBadGateway || got.Error == "" {
			t.Fatalf("the only generation worker dead, a new stream: %+v, want a 502 (nothing was sent)", got)
		}
		mc.allFree(t)
	})
}

// TestRouterRefusesResume: kvxfer_resume_token_ids is the router's to
// set: a client that sends it gets 400.
func TestRouterRefusesResume(t *testing.T) {
	_, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	rs := newTestRouter(t, []string{cu}, []string{gu}, RoundRobin)
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		resp, body := post(t, rs.URL+path, `{"prompt":"x","messages":[{"role":"user","content":"x"}],"kvxfer_resume_token_ids":[72]}`)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, ResumeField) {
			t.Errorf("%s: %d %s, want 400 naming %s", path, resp.StatusCode, body, ResumeField)
		}
	}
}

// TestNoGenerationWorkerIsNoMigration: when no generation worker can be
// reached at all, the request fails with a 502 naming the group, as
// without migration, and counts no migration.
func TestNoGenerationWorkerIsNoMigration(t *testing.T) {
	_, cu := startFake(t, "ctx", "length")
	r, err := NewRouter(RouterOptions{Context: []string{cu}, Generation: []string{deadURL(t)}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	h := r.Handler()
	for _, stream := range []string{"false", "true"} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(`{"prompt":"hi","stream":`+stream+`}`)))
		if rec.Code != http.StatusBadGateway || !strings.Contains(rec.Body.String(), "no generation server reachable") {
			t.Errorf("stream %s: %d %s", stream, rec.Code, rec.Body.String())
		}
	}
	for _, result := range []string{"ok", "failed"} {
		if n := metricValue(t, r.Registry(), "kvxfer_router_migrations_total", map[string]string{"result": result}); n != 0 {
			t.Errorf("kvxfer_router_migrations_total{result=%q} = %v, want 0", result, n)
		}
	}
}

// TestUpstreamAnswerOverMaxBody: a generation worker's whole answer longer
// than MaxBody used to be cut at MaxBody and sent to the client as a 200
// of broken JSON; a context worker's, to end as "has no choices". Both
// are a 502 that says the answer was too long.
func TestUpstreamAnswerOverMaxBody(t *testing.T) {
	huge := func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"text":"`+strings.Repeat("x", MaxBody)+`","finish_reason":"length"}]}`)
	}
	bigGen := httptest.NewServer(http.HandlerFunc(huge))
	defer bigGen.Close()
	bigCtx := httptest.NewServer(http.HandlerFunc(huge))
	defer bigCtx.Close()
	_, cu := startFake(t, "ctx", "length")
	_, gu := startFake(t, "gen", "")
	for _, tc := range []struct {
		name     string
		ctx, gen string
	}{{"generation", cu, bigGen.URL}, {"context", bigCtx.URL, gu}} {
		rs := newTestRouter(t, []string{tc.ctx}, []string{tc.gen}, RoundRobin)
		resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hi","max_tokens":4}`)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, fmt.Sprintf("over %d bytes", MaxBody)) {
			t.Errorf("%s worker's answer over MaxBody: %d %.300s", tc.name, resp.StatusCode, body)
		}
	}
}
