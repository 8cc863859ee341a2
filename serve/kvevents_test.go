package serve

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/kvcache"
)

// reuseCall sends a request to one of the worker's reuse routes with the
// given Authorization header ("" for none).
func reuseCall(t *testing.T, method, url, auth, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// TestWorkerReuseRoutesAuth: with a cluster secret, the event and
// cached-prefix routes answer only the bearer token derived from it: 401
// without one, 403 with a wrong one (another secret's, or the secret
// itself). Without a secret they are open.
func TestWorkerReuseRoutesAuth(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	w := newSecureWorker(t, RoleGeneration, secret, 10_000)
	open := newSecureWorker(t, RoleGeneration, nil, 10_000)
	right := "Bearer " + ReuseToken(secret)
	prompt := `{"prompt_token_ids":[256,1,2,3,4]}`
	for _, tc := range []struct {
		name, method, path, auth, body string
		code                           int
		want                           string
	}{
		{"events, no token", "GET", KVEventsPath, "", "", 401, "Authorization: Bearer"},
		{"events, another secret's token", "GET", KVEventsPath, "Bearer " + ReuseToken([]byte("another secret, 32 bytes long...")), "", 403, "wrong bearer token"},
		{"events, the secret itself", "GET", KVEventsPath, "Bearer " + string(secret), "", 403, "wrong bearer token"},
		{"events, not bearer", "GET", KVEventsPath, "Basic " + ReuseToken(secret), "", 401, "Authorization: Bearer"},
		{"events, right token", "GET", KVEventsPath + "?after=0", right, "", 200, "[]"},
		{"events, POST as upstream", "POST", KVEventsPath, right, "", 200, "[]"},
		{"cached prefix, no token", "POST", CachedPrefixPath, "", prompt, 401, "Authorization: Bearer"},
		{"cached prefix, wrong token", "POST", CachedPrefixPath, "Bearer x", prompt, 403, "wrong bearer token"},
		{"cached prefix, right token", "POST", CachedPrefixPath, right, prompt, 200, `{"prompt_tokens":5,"cached_tokens":0,"compute_tokens":5}`},
		{"cached prefix, text", "POST", CachedPrefixPath, right, `{"prompt":"abc"}`, 200, `"prompt_tokens":4`},
		{"cached prefix, chat", "POST", CachedPrefixPath, right, `{"messages":[{"role":"user","content":"hi"}]}`, 200,
			fmt.Sprintf(`"prompt_tokens":%d`, len(engine.Tokenizer{}.Encode(chatTemplate([]chatMessage{{"user", "hi"}}))))},
		{"cached prefix, no prompt", "POST", CachedPrefixPath, right, `{}`, 400, "prompt is required"},
		{"events, bad cursor", "GET", KVEventsPath + "?after=x", right, "", 400, "not an event id"},
		{"events, bad limit", "GET", KVEventsPath + "?limit=0", right, "", 400, "limit"},
	} {
		code, _, body := reuseCall(t, tc.method, w.srv.URL+tc.path, tc.auth, tc.body)
		if code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want %d and %q", tc.name, code, body, tc.code, tc.want)
		}
	}
	// No secret: open.
	if code, h, body := reuseCall(t, "GET", open.srv.URL+KVEventsPath, "", ""); code != 200 || strings.TrimSpace(body) != "[]" ||
		h.Get(KVEventsNextHeader) != "0" || h.Get(KVEventsEpochHeader) == "" {
		t.Errorf("open worker's events: %d %v %s", code, h, body)
	}
	if code, _, body := reuseCall(t, "POST", open.srv.URL+CachedPrefixPath, "", prompt); code != 200 || !strings.Contains(body, `"compute_tokens":5`) {
		t.Errorf("open worker's cached prefix: %d %s", code, body)
	}
}

// TestEventJSON: upstream's shape, hashes as 32 hex digits, no tokens.
func TestEventJSON(t *testing.T) {
	hs := kvcache.HashBlocks(kvcache.Hash{}, []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4)
	for _, tc := range []struct {
		ev   engine.KVEvent
		want string
	}{
		{engine.KVEvent{ID: 1, Type: engine.KVEventCreated, NumBlocks: 64}, `{"event_id":1,"data":{"type":"created","num_blocks_per_cache_level":[64]}}`},
		{engine.KVEvent{ID: 2, Type: engine.KVEventStored, Hashes: hs},
			fmt.Sprintf(`{"event_id":2,"data":{"type":"stored","blocks":[{"block_hash":"%s"},{"block_hash":"%s"}]}}`, hs[0], hs[1])},
		{engine.KVEvent{ID: 3, Type: engine.KVEventStored, ParentHash: hs[0], Hashes: hs[1:]},
			fmt.Sprintf(`{"event_id":3,"data":{"type":"stored","parent_hash":"%s","blocks":[{"block_hash":"%s"}]}}`, hs[0], hs[1])},
		{engine.KVEvent{ID: 4, Type: engine.KVEventRemoved, Hashes: hs[:1]}, fmt.Sprintf(`{"event_id":4,"data":{"type":"removed","block_hashes":["%s"]}}`, hs[0])},
	} {
		b, _ := json.Marshal(eventJSON(tc.ev))
		if string(b) != tc.want {
			t.Errorf("event %d: %s, want %s", tc.ev.ID, b, tc.want)
		}
		// The router reads back what the worker writes.
		u, err := decodeKVEvents(http.Header{}, []byte("["+string(b)+"]"), 0)
		if err != nil || len(u.events) != 1 || len(u.events[0].hashes) != len(tc.ev.Hashes) {
			t.Errorf("event %d: decoded %+v, %v", tc.ev.ID, u, err)
		}
	}
}

// TestUsageReuseFields: usage carries OpenAI's cached_tokens and the
// transfer's blocks.
func TestUsageReuseFields(t *testing.T) {
	w := newSecureWorker(t, RoleBoth, nil, 10_000)
	code, _, raw := postJSON(t, w.srv.URL+"/v1/completions", map[string]any{"prompt": "usage please", "max_tokens": 2})
	if code != 200 {
		t.Fatalf("%d %s", code, raw)
	}
	var r struct {
		Usage map[string]json.RawMessage `json:"usage"`
	}
	json.Unmarshal([]byte(raw), &r)
	var details map[string]int
	var timing map[string]float64
	json.Unmarshal(r.Usage["prompt_tokens_details"], &details)
	json.Unmarshal(r.Usage["kvxfer_timing"], &timing)
	if _, ok := details["cached_tokens"]; !ok {
		t.Errorf("usage.prompt_tokens_details: %s", r.Usage["prompt_tokens_details"])
	}
	for _, k := range []string{"kv_transfer_blocks", "kv_block_bytes"} {
		if v, ok := timing[k]; !ok || v != 0 { // aggregated: nothing transferred
			t.Errorf("usage.kvxfer_timing.%s: %v %v", k, v, ok)
		}
	}
	_, m := get(t, w.srv.URL+"/metrics")
	for _, want := range []string{"kvxfer_prefix_cache_prompt_tokens_total 13", "kvxfer_prefix_cache_hit_tokens_total 0"} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// TestWorkerKVEventsRoute: the route's cursors, bounds and headers, on a
// fake event source (thousands of events and a lost range on demand).
func TestWorkerKVEventsRoute(t *testing.T) {
	tw := newSecureWorker(t, RoleGeneration, nil, 10_000)
	var all []engine.KVEvent
	for i := range 3000 {
		all = append(all, engine.KVEvent{ID: uint64(i + 1), Type: engine.KVEventStored, Hashes: kvcache.HashBlocks(kvcache.Hash{}, []int32{int32(i), 1, 2, 3}, 4)})
	}
	lostBelow := uint64(0) // reads after fewer than this say lost
	tw.w.kvEventsSource = func(after uint64) ([]engine.KVEvent, bool) {
		if after >= uint64(len(all)) {
			return nil, false
		}
		return all[after:], after < lostBelow
	}
	read := func(query string) (int, http.Header, []kvEventJSON) {
		t.Helper()
		code, h, body := reuseCall(t, "GET", tw.srv.URL+KVEventsPath+query, "", "")
		var evs []kvEventJSON
		if code == 200 {
			if err := json.Unmarshal([]byte(body), &evs); err != nil {
				t.Fatalf("%s: %v", query, err)
			}
		}
		return code, h, evs
	}
	for _, tc := range []struct {
		query       string
		n           int
		first, next uint64
		more        bool
	}{
		{"?after=0", MaxKVEventsPerAnswer, 1, MaxKVEventsPerAnswer, true},
		{"?after=2990", 10, 2991, 3000, false},
		{"?after=3000", 0, 0, 3000, false},
		{"?after=5&limit=7", 7, 6, 12, true},
	} {
		code, h, evs := read(tc.query)
		if code != 200 || len(evs) != tc.n || h.Get(KVEventsNextHeader) != fmt.Sprint(tc.next) || (h.Get(KVEventsMoreHeader) == "true") != tc.more {
			t.Errorf("%s: %d, %d events, next %s, more %q", tc.query, code, len(evs), h.Get(KVEventsNextHeader), h.Get(KVEventsMoreHeader))
			continue
		}
		for i, e := range evs {
			if e.EventID != tc.first+uint64(i) || len(e.Data.Blocks) != 1 {
				t.Errorf("%s: event %d is %+v", tc.query, i, e)
				break
			}
		}
	}
	// Without after: one shared cursor that each read advances (upstream
	// drains); readers with after are not affected.
	total := 0
	for range 5 {
		_, _, evs := read("")
		total += len(evs)
	}
	if _, _, evs := read(""); total != 3000 || len(evs) != 0 {
		t.Errorf("draining: %d events in all, then %d", total, len(evs))
	}
	if _, _, evs := read("?after=0&limit=1"); len(evs) != 1 {
		t.Errorf("a cursor read after draining: %d events", len(evs))
	}
	// Lost events are said in a header.
	lostBelow = 100
	if _, h, _ := read("?after=50&limit=1"); h.Get(KVEventsLostHeader) != "true" {
		t.Errorf("lost: headers %v", h)
	}
	if _, h, _ := read("?after=150&limit=1"); h.Get(KVEventsLostHeader) != "" {
		t.Errorf("not lost: headers %v", h)
	}
	// The byte bound: events with many blocks stop an answer early.
	big := make([]kvcache.Hash, 40_000)
	tw.w.kvEventsSource = func(after uint64) ([]engine.KVEvent, bool) {
		var out []engine.KVEvent
		for id := after + 1; id <= after+10; id++ {
			out = append(out, engine.KVEvent{ID: id, Type: engine.KVEventRemoved, Hashes: big})
		}
		return out, false
	}
	code, h, body := reuseCall(t, "GET", tw.srv.URL+KVEventsPath+"?after=0", "", "")
	if code != 200 || h.Get(KVEventsMoreHeader) != "true" || len(body) > 2*MaxKVEventsBytes {
		t.Errorf("big events: %d, more %q, %d bytes", code, h.Get(KVEventsMoreHeader), len(body))
	}
}

// TestWorkerReusesPrefixesPerSalt: with the default kv_cache_config (block
// reuse on, as upstream), a prompt sent again finds its full blocks cached
// (usage and the cached-prefix route agree), and a request with a
// cache_salt shares nothing with unsalted requests or other salts.
func TestWorkerReusesPrefixesPerSalt(t *testing.T) {
	w := newSecureWorker(t, RoleBoth, nil, 10_000)
	prompt := strings.Repeat("a shared system prompt. ", 8) // 193 tokens with BOS: 12 full blocks of 16
	n := len(engine.Tokenizer{}.Encode(prompt))
	full := n / 16 * 16
	cachedOf := func(body map[string]any) int { return cachedTokensOf(t, w.srv.URL, body) }
	routeSays := func(salt string) int {
		t.Helper()
		q, _ := json.Marshal(map[string]any{"prompt": prompt, "cache_salt": salt})
		code, _, body := reuseCall(t, "POST", w.srv.URL+CachedPrefixPath, "", string(q))
		var cp CachedPrefix
		if code != 200 || json.Unmarshal([]byte(body), &cp) != nil {
			t.Fatalf("cached prefix: %d %s", code, body)
		}
		return cp.CachedTokens
	}
	if c := cachedOf(map[string]any{"prompt": prompt, "max_tokens": 2}); c != 0 {
		t.Fatalf("first request: %d cached tokens, want 0", c)
	}
	if c := routeSays(""); c != full {
		t.Errorf("cached-prefix route after the first request: %d, want the %d tokens of the full blocks", c, full)
	}
	if c := cachedOf(map[string]any{"prompt": prompt, "max_tokens": 2}); c != full {
		t.Errorf("same prompt again: %d cached tokens, want %d", c, full)
	}
	if c := routeSays("tenant-a"); c != 0 {
		t.Errorf("salted lookup found %d tokens of unsalted requests", c)
	}
	if c := cachedOf(map[string]any{"prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a"}); c != 0 {
		t.Errorf("salted request: %d cached tokens of unsalted requests, want 0", c)
	}
	if c := cachedOf(map[string]any{"prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a"}); c != full {
		t.Errorf("salted request again: %d cached tokens, want %d", c, full)
	}
	if c := routeSays("tenant-b"); c != 0 {
		t.Errorf("another salt found %d tokens", c)
	}
	code, _, raw := postJSON(t, w.srv.URL+"/v1/completions", map[string]any{"prompt": "x", "cache_salt": strings.Repeat("s", MaxCacheSaltLen+1)})
	if code != 400 || !strings.Contains(raw, "cache_salt has 1025 bytes") {
		t.Errorf("oversized salt: %d %s", code, raw)
	}
}

// stuckWriter is a ResponseWriter whose client does not read: Write blocks
// until release is closed.
type stuckWriter struct {
	h       http.Header
	writing chan struct{} // closed at the first Write
	once    sync.Once
	release chan struct{}
}

func (s *stuckWriter) Header() http.Header { return s.h }
func (s *stuckWriter) WriteHeader(int)     {}
func (s *stuckWriter) Write(b []byte) (int, error) {
	s.once.Do(func() { close(s.writing) })
	<-s.release
	return 0, io.ErrClosedPipe
}

// TestKVEventsDrainReaderStuck: a cursor-less reader of the events (as
// upstream's router drains them) whose client stops reading its answer
// used to hold the drain cursor's lock while the answer was written: every
// other cursor-less read then hung for as long. The lock now covers the
// cursor only, and the next reader gets the events that follow.
func TestKVEventsDrainReaderStuck(t *testing.T) {
	tw := startTestWorker(t, WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	tw.w.kvEventsSource = func(after uint64) ([]engine.KVEvent, bool) {
		var out []engine.KVEvent
		for id := after + 1; id <= after+3; id++ {
			out = append(out, engine.KVEvent{ID: id, Type: engine.KVEventRemoved, Hashes: make([]kvcache.Hash, 2)})
		}
		return out, false
	}
	h := tw.w.Handler()
	stuck := &stuckWriter{h: http.Header{}, writing: make(chan struct{}), release: make(chan struct{})}
	served := make(chan struct{})
	go func() {
		defer close(served)
		h.ServeHTTP(stuck, httptest.NewRequest(http.MethodGet, KVEventsPath, nil))
	}()
	defer func() {
		close(stuck.release)
		<-served
	}()
	select {
	case <-stuck.writing:
	case <-time.After(10 * time.Second):
		t.Fatal("the first reader's answer was never written")
	}
	rec := httptest.NewRecorder()
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, KVEventsPath, nil))
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a cursor-less read hangs while another reader's client does not read its answer")
	}
	var evs []kvEventJSON
	if err := json.Unmarshal(rec.Body.Bytes(), &evs); err != nil || rec.Code != 200 || len(evs) != 3 || evs[0].EventID != 4 {
		t.Errorf("second reader: %d %s (%v), want events 4..6", rec.Code, rec.Body, err)
	}
}

// TestHostileCachedCountProbe: with partial reuse a worker reuses a cached
// block's first matching tokens, but what leaves it — a client's
// usage.prompt_tokens_details.cached_tokens, the hit-token counter on
// /metrics, the cached-prefix route — counts whole blocks only: a client
// that knows how another user's prompt begins cannot read what follows one
// token at a time through the count.
func TestHostileCachedCountProbe(t *testing.T) {
	w := newSecureWorker(t, RoleBoth, nil, 10_000) // 16 tokens per block
	victim := make([]int, 40)
	for i := range victim {
		victim[i] = 100 + i
	}
	complete := func(prompt []int) int {
		return cachedTokensOf(t, w.srv.URL, map[string]any{"prompt": prompt, "max_tokens": 1})
	}
	complete(victim) // its two full blocks are cached now
	// The probe: the victim's first block and 4 more of its tokens (the
	// attacker's guesses, all right), then a filler.
	probe := append(slices.Clone(victim[:20]), 7, 7, 7, 7, 7)
	code, _, raw := postJSON(t, w.srv.URL+CachedPrefixPath, map[string]any{"prompt": probe})
	if code != 200 || !strings.Contains(raw, `"cached_tokens":16,`) {
		t.Errorf("cached-prefix route for the probe: %d %s, want 16 cached tokens (whole blocks)", code, raw)
	}
	if got := complete(probe); got != 16 {
		t.Errorf("the probe's cached_tokens = %d, want 16: whole blocks, not the 4 tokens of the next block it guessed right", got)
	}
	_, m := get(t, w.srv.URL+"/metrics")
	if !strings.Contains(m, "kvxfer_prefix_cache_hit_tokens_total 16\n") {
		t.Errorf("/metrics: the hit tokens are not whole blocks:\n%s", grepLines(m, "kvxfer_prefix_cache_hit_tokens_total"))
	}
}

// cachedTokensOf posts a completion to the worker at url and returns its
// usage.prompt_tokens_details.cached_tokens.
func cachedTokensOf(t *testing.T, url string, body map[string]any) int {
	t.Helper()
	code, _, raw := postJSON(t, url+"/v1/completions", body)
	if code != 200 {
		t.Fatalf("%d %s", code, raw)
	}
	var r struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		t.Fatal(err)
	}
	return r.Usage.Details.Cached
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "")
}
