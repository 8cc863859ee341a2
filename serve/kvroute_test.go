package serve

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// reuseFake is a fake worker with the reuse routes: the events it serves,
// the cached prefix it claims, the bearer token it requires, and answers
// to context_and_generation requests (conditional disaggregation).
type reuseFake struct {
	*fakeWorker
	token string

	mu     sync.Mutex
	events []kvEventJSON
	lost   bool
	epoch  string
	cached int
	// hostile: "huge" answers a body over the router's bound, "disorder"
	// events out of order, "slow" blocks until release is closed.
	hostile string
	release chan struct{}

	eventReads, concurrent, maxConcurrent atomic.Int64
	prefixAsks, local                     atomic.Int64
	lastLocal                             atomic.Value // object
}

func (f *reuseFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case KVEventsPath, CachedPrefixPath:
		if f.token != "" && r.Header.Get("Authorization") != "Bearer "+f.token {
			writeError(w, http.StatusForbidden, "forbidden", "wrong token")
			return
		}
	}
	switch r.URL.Path {
	case KVEventsPath:
		f.eventReads.Add(1)
		n := f.concurrent.Add(1)
		defer f.concurrent.Add(-1)
		for {
			m := f.maxConcurrent.Load()
			if n <= m || f.maxConcurrent.CompareAndSwap(m, n) {
				break
			}
		}
		f.mu.Lock()
		hostile, release := f.hostile, f.release
		f.mu.Unlock()
		switch hostile {
		case "slow":
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		case "huge":
			w.Write([]byte("[" + strings.Repeat(" ", maxKVEventsAnswer+10) + "]"))
			return
		}
		after, _ := strconv.ParseUint(r.URL.Query().Get("after"), 10, 64)
		f.mu.Lock()
		var out []kvEventJSON
		for _, e := range f.events {
			if e.EventID > after {
				out = append(out, e)
			}
		}
		if hostile == "disorder" && len(out) > 1 {
			out[0], out[1] = out[1], out[0]
		}
		if f.lost {
			w.Header().Set(KVEventsLostHeader, "true")
			f.lost = false
		}
		w.Header().Set(KVEventsEpochHeader, f.epoch)
		f.mu.Unlock()
		if out == nil {
			out = []kvEventJSON{}
		}
		json.NewEncoder(w).Encode(out)
	case CachedPrefixPath:
		f.prefixAsks.Add(1)
		var cr completionRequest
		json.NewDecoder(r.Body).Decode(&cr)
		f.mu.Lock()
		c := min(f.cached, len(cr.PromptTokenIDs))
		f.mu.Unlock()
		json.NewEncoder(w).Encode(CachedPrefix{PromptTokens: len(cr.PromptTokenIDs), CachedTokens: c, ComputeTokens: len(cr.PromptTokenIDs) - c})
	default:
		if r.URL.Path == "/v1/completions" && f.role == "gen" {
			var o object
			if err := json.NewDecoder(r.Body).Decode(&o); err != nil {
				writeError(w, 400, "invalid_request_error", err.Error())
				return
			}
			var dp DisaggregatedParams
			o.get("disaggregated_params", &dp)
			if dp.RequestType == TypeContextAndGeneration {
				f.local.Add(1)
				f.lastLocal.Store(o)
				json.NewEncoder(w).Encode(map[string]any{"object": "text_completion",
					"choices": []map[string]any{{"index": 0, "text": "local", "finish_reason": "length"}}})
				return
			}
			b, _ := json.Marshal(o)
			r.Body = readCloser(string(b))
		}
		f.fakeWorker.ServeHTTP(w, r)
	}
}

func readCloser(s string) *strReader { return &strReader{strings.NewReader(s)} }

type strReader struct{ *strings.Reader }

func (strReader) Close() error { return nil }

// store appends a stored event of hashes.
func (f *reuseFake) store(hashes []kvcache.Hash) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e := kvEventJSON{EventID: uint64(len(f.events) + 1), Data: kvEventData{Type: engine.KVEventStored}}
	for _, h := range hashes {
		e.Data.Blocks = append(e.Data.Blocks, kvBlockJSON{BlockHash: h.String()})
	}
	f.events = append(f.events, e)
}

func startReuseFake(t *testing.T, role, token string) (*reuseFake, string) {
	f := &reuseFake{fakeWorker: &fakeWorker{role: role, finish: "length"}, token: token, epoch: "e1"}
	s := httptest.NewServer(f)
	t.Cleanup(s.Close)
	return f, s.URL
}

func startRouter(t *testing.T, o RouterOptions) (*Router, *httptest.Server) {
	t.Helper()
	r, err := NewRouter(o)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(r.Handler())
	t.Cleanup(func() {
		s.Close()
		r.Close()
		http.DefaultClient.CloseIdleConnections()
	})
	return r, s
}

// promptHashes is the hashes the router computes for a completion prompt.
func promptHashes(prompt string, tpb int) []kvcache.Hash {
	return kvcache.HashBlocks(kvcache.Hash{}, engine.Tokenizer{}.Encode(prompt), tpb)
}

func serverOf(r *Router, g *group, url string) *upstream {
	for _, s := range g.list() {
		if s.url == url {
			return s
		}
	}
	return nil
}

// TestKVCacheAwareRouting: the router polls each worker's events with the
// cluster's token and sends a prompt to the worker that has its prefix
// cached; without any cache, the load decides.
func TestKVCacheAwareRouting(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	a, au := startReuseFake(t, "ctx", ReuseToken(secret))
	b, bu := startReuseFake(t, "ctx", ReuseToken(secret))
	_, gu := startFake(t, "gen", "")
	r, rs := startRouter(t, RouterOptions{Context: []string{au, bu}, Generation: []string{gu}, ContextPolicy: KVCacheAware,
		ContextTokensPerBlock: 4, Secret: secret, KVEventsInterval: 20 * time.Millisecond})
	prompt := "a long shared prefix, then the question"
	// Before anything is cached: the two take turns.
	for range 4 {
		if resp, body := post(t, rs.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q}`, prompt)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	if a.calls.Load() != 2 || b.calls.Load() != 2 {
		t.Fatalf("empty caches: calls %d, %d; want 2, 2", a.calls.Load(), b.calls.Load())
	}
	b.store(promptHashes(prompt, 4))
	sb := serverOf(r, r.prefill, bu)
	waitFor(t, 5*time.Second, "the router to poll b's events", func() bool { return sb.kv.size() == len(promptHashes(prompt, 4)) })
	for range 4 {
		post(t, rs.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q}`, prompt))
	}
	if a.calls.Load() != 2 || b.calls.Load() != 6 {
		t.Errorf("b has the prefix: calls %d, %d; want 2, 6", a.calls.Load(), b.calls.Load())
	}
	// Another prompt: nothing cached anywhere, round robin again.
	for range 2 {
		post(t, rs.URL+"/v1/completions", `{"prompt":"something else entirely"}`)
	}
	if a.calls.Load() != 3 || b.calls.Load() != 7 {
		t.Errorf("other prompt: calls %d, %d; want 3, 7", a.calls.Load(), b.calls.Load())
	}
}

// TestKVEventsPoller: ordering, lost events, a worker that left, and slow
// or hostile workers, which hold up no other worker's poll.
func TestKVEventsPoller(t *testing.T) {
	good, gu := startReuseFake(t, "ctx", "")
	bad, bu := startReuseFake(t, "ctx", "")
	_, genu := startFake(t, "gen", "")
	r, _ := startRouter(t, RouterOptions{Context: []string{gu, bu}, Generation: []string{genu}, ContextPolicy: KVCacheAware,
		ContextTokensPerBlock: 4, RouterDeadlines: RouterDeadlines{HealthTimeout: 200 * time.Millisecond}})
	sg, sb := serverOf(r, r.prefill, gu), serverOf(r, r.prefill, bu)
	h1, h2 := hashesOf(1, 3), hashesOf(50, 2)
	poll := func() {
		r.pollKV()
		waitFor(t, 5*time.Second, "the polls to end", func() bool { return !sg.polling.Load() && !sb.polling.Load() })
	}

	good.store(h1)
	good.store(h2)
	bad.store(h1)
	poll()
	if sg.kv.matched(h1) != 3 || sg.kv.matched(h2) != 2 || sg.kv.cursor() != 2 || sb.kv.matched(h1) != 3 {
		t.Fatalf("after the first poll: %d %d cursor %d; bad %d", sg.kv.matched(h1), sg.kv.matched(h2), sg.kv.cursor(), sb.kv.matched(h1))
	}
	// A removal, in order after the stores.
	good.mu.Lock()
	good.events = append(good.events, kvEventJSON{EventID: 3, Data: kvEventData{Type: engine.KVEventRemoved, BlockHashes: []string{h1[0].String()}}})
	good.mu.Unlock()
	poll()
	if sg.kv.matched(h1) != 0 || sg.kv.matched(h2) != 2 {
		t.Errorf("after the removal: %d %d", sg.kv.matched(h1), sg.kv.matched(h2))
	}

	// Lost: forget, then keep what follows.
	good.mu.Lock()
	good.lost = true
	good.mu.Unlock()
	good.store(h1)
	poll()
	if sg.kv.matched(h2) != 0 || sg.kv.matched(h1) != 3 {
		t.Errorf("after lost: %d %d", sg.kv.matched(h2), sg.kv.matched(h1))
	}

	// Hostile answers change nothing and do not stop the good worker's
	// polls.
	for _, hostile := range []string{"huge", "disorder"} {
		bad.mu.Lock()
		bad.hostile = hostile
		bad.mu.Unlock()
		bad.store(h2)
		bad.store(hashesOf(70, 1))
		good.store(hashesOf(80, 1))
		poll()
		if sb.kv.matched(h2) != 0 || sb.kv.matched(h1) != 3 {
			t.Errorf("%s: the bad worker's set changed: %d %d", hostile, sb.kv.matched(h2), sb.kv.matched(h1))
		}
		if sg.kv.matched(hashesOf(80, 1)) != 1 {
			t.Errorf("%s: the good worker was not polled", hostile)
		}
	}

	// Slow: its poll times out (HealthTimeout); meanwhile the good worker
	// is polled, and the slow one gets one poll at a time.
	bad.mu.Lock()
	bad.hostile, bad.release = "slow", make(chan struct{})
	bad.mu.Unlock()
	waitFor(t, 5*time.Second, "the earlier answers' handlers to end", func() bool { return bad.concurrent.Load() == 0 })
	bad.maxConcurrent.Store(0)
	r.pollKV()
	good.store(hashesOf(90, 1))
	waitFor(t, 5*time.Second, "the good worker's poll", func() bool { return !sg.polling.Load() })
	r.pollKV()
	waitFor(t, 5*time.Second, "the good worker's second poll", func() bool { return sg.kv.matched(hashesOf(90, 1)) == 1 })
	if !sb.polling.Load() {
		t.Error("the slow worker's poll ended early")
	}
	waitFor(t, 5*time.Second, "the slow poll to time out", func() bool { return !sb.polling.Load() })
	close(bad.release)
	if n := bad.maxConcurrent.Load(); n != 1 {
		t.Errorf("%d concurrent polls of the slow worker, want 1", n)
	}

	// A worker that left is not polled any more.
	sb.removed.Store(true)
	reads := bad.eventReads.Load()
	poll()
	if bad.eventReads.Load() != reads {
		t.Error("a removed worker was polled")
	}
}

// TestConversationRouting: a conversation stays on its worker, by
// conversation_id (TensorRT-LLM's disaggregated_params field) or by its
// prefix, and moves when its worker is down.
func TestConversationRouting(t *testing.T) {
	a, au := startReuseFake(t, "ctx", "")
	b, bu := startReuseFake(t, "ctx", "")
	_, gu := startFake(t, "gen", "")
	r, rs := startRouter(t, RouterOptions{Context: []string{au, bu}, Generation: []string{gu}, ContextPolicy: Conversation,
		ContextArgs: config.RouterArgs{TokensPerBlock: 4, MaxSessions: 16}})
	calls := func() [2]int64 { return [2]int64{a.calls.Load(), b.calls.Load()} }
	send := func(body string) {
		t.Helper()
		if resp, out := post(t, rs.URL+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, out)
		}
	}
	send(`{"prompt":"turn one","disaggregated_params":{"conversation_id":"c1"}}`)
	first := calls()
	for i := range 4 {
		send(fmt.Sprintf(`{"prompt":"turn %d","disaggregated_params":{"conversation_id":"c1"}}`, i))
	}
	if got := calls(); got[0]-first[0] != 4*first[0] || got[1]-first[1] != 4*first[1] {
		t.Errorf("conversation c1 moved: %v after %v", got, first)
	}
	// The context worker got no conversation_id in disaggregated_params.
	if last := a.last.Load(); last != nil {
		var dp map[string]any
		last.(object).get("disaggregated_params", &dp)
		if _, ok := dp["conversation_id"]; ok || dp["request_type"] != TypeContextOnly {
			t.Errorf("context request's disaggregated_params %v", dp)
		}
	}
	// Without an id, by prefix: each turn resends the history.
	// (Each turn adds less than a quarter of the history: match_threshold.)
	history := "system: " + strings.Repeat("be brief. ", 30) + "user: hello there, how are you today?"
	pre := calls()
	send(fmt.Sprintf(`{"prompt":%q}`, history))
	before := calls()
	on := 0
	if before[1] > pre[1] {
		on = 1
	}
	for i := range 3 {
		history += fmt.Sprintf(" assistant: fine %d. user: and then?", i)
		send(fmt.Sprintf(`{"prompt":%q}`, history))
	}
	if got := calls(); got[on]-before[on] != 3 {
		t.Errorf("implicit conversation moved: %v after %v (on %d)", got, before, on)
	}
	// Its worker goes down: the conversation moves to the other one.
	urls := []string{au, bu}
	serverOf(r, r.prefill, urls[on]).down.Store(true)
	before = calls()
	history += " user: still there?"
	send(fmt.Sprintf(`{"prompt":%q}`, history))
	if got := calls(); got[1-on]-before[1-on] != 1 {
		t.Errorf("worker down: %v after %v", got, before)
	}
	if r.prefill.conv.len() > 16 {
		t.Errorf("%d conversations remembered, max_sessions 16", r.prefill.conv.len())
	}
	// Any other disaggregated_params field is still refused.
	if resp, out := post(t, rs.URL+"/v1/completions", `{"prompt":"x","disaggregated_params":{"conversation_id":"c","request_type":"context_only"}}`); resp.StatusCode != 400 {
		t.Errorf("other disaggregated_params: %d %s", resp.StatusCode, out)
	}
}

// TestConditionalDisagg: the router asks the generation worker what it has
// cached; a prompt with some cached and at most max_local_prefill_length
// left goes there as context_and_generation, any other through a context
// worker. The answer and a metric say which.
func TestConditionalDisagg(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	ctx, cu := startReuseFake(t, "ctx", ReuseToken(secret))
	gen, gu := startReuseFake(t, "gen", ReuseToken(secret))
	r, rs := startRouter(t, RouterOptions{Context: []string{cu}, Generation: []string{gu}, GenerationPolicy: KVCacheAware,
		ConditionalDisagg: &config.ConditionalDisagg{MaxLocalPrefillLength: 8}, Secret: secret})
	prompt := "0123456789012345678901234567890123456789" // 41 tokens with BOS
	n := len(engine.Tokenizer{}.Encode(prompt))
	for _, tc := range []struct {
		name    string
		cached  int
		stream  bool
		path    string
		ctxCall bool
	}{
		{"nothing cached", 0, false, RouteDisaggregated, true},
		{"nothing cached, short of the threshold in all", 0, false, RouteDisaggregated, true},
		{"9 left", n - 9, false, RouteDisaggregated, true},
		{"8 left", n - 8, false, RouteLocal, false},
		{"all cached", n, false, RouteLocal, false},
		{"1 left, streamed", n - 1, true, RouteLocal, false},
	} {
		gen.mu.Lock()
		gen.cached = tc.cached
		gen.mu.Unlock()
		c0, l0 := ctx.calls.Load(), gen.local.Load()
		resp, body := post(t, rs.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"stream":%v}`, prompt, tc.stream))
		if resp.StatusCode != 200 || resp.Header.Get(RouteHeader) != tc.path {
			t.Errorf("%s: %d %s %q", tc.name, resp.StatusCode, resp.Header.Get(RouteHeader), body)
		}
		if (ctx.calls.Load() > c0) != tc.ctxCall || (gen.local.Load() > l0) == tc.ctxCall {
			t.Errorf("%s: context calls %d→%d, local %d→%d", tc.name, c0, ctx.calls.Load(), l0, gen.local.Load())
		}
	}
	if got := gen.prefixAsks.Load(); got != 6 {
		t.Errorf("%d cached-prefix questions, want 6", got)
	}
	_, m := get(t, rs.URL+"/metrics")
	for _, want := range []string{`kvxfer_router_prefill_path_total{path="local"} 3`, `kvxfer_router_prefill_path_total{path="disaggregated"} 3`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	_ = r
}

// TestConditionalDisaggUnreachable: a generation worker that cannot say
// what it has cached (a wrong token here) leaves the request on the
// disaggregated path.
func TestConditionalDisaggUnreachable(t *testing.T) {
	ctx, cu := startReuseFake(t, "ctx", "")
	gen, gu := startReuseFake(t, "gen", "another secret's token")
	gen.cached = 1000
	_, rs := startRouter(t, RouterOptions{Context: []string{cu}, Generation: []string{gu},
		ConditionalDisagg: &config.ConditionalDisagg{MaxLocalPrefillLength: 100}, Secret: []byte("0123456789abcdef0123456789abcdef")})
	resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hello"}`)
	if resp.StatusCode != 200 || resp.Header.Get(RouteHeader) != RouteDisaggregated || ctx.calls.Load() != 1 || gen.local.Load() != 0 {
		t.Errorf("%d %s %s; context calls %d, local %d", resp.StatusCode, resp.Header.Get(RouteHeader), body, ctx.calls.Load(), gen.local.Load())
	}
}

// TestPoliciesDynamicMembership: with disagg_cluster, kv_cache_aware polls
// a worker from its join on and routes to it by its cache, and
// conversation forgets the conversations of a worker that left and moves
// them to one that is there.
func TestPoliciesDynamicMembership(t *testing.T) {
	st := memstore.New(memstore.Options{})
	t.Cleanup(func() { st.Close() })
	r, rs := startRouter(t, RouterOptions{Cluster: &ClusterOptions{Store: st, Name: "t", MinContext: 1, MinGeneration: 1},
		ContextPolicy: KVCacheAware, GenerationPolicy: Conversation, ContextTokensPerBlock: 4, KVEventsInterval: 10 * time.Millisecond})
	a, au := startReuseFake(t, "ctx", "")
	g1, g1u := startReuseFake(t, "gen", "")
	g2, g2u := startReuseFake(t, "gen", "")
	register(t, st, membership.RoleContext, au)
	m1 := register(t, st, membership.RoleGeneration, g1u)
	m2 := register(t, st, membership.RoleGeneration, g2u)
	waitFor(t, 5*time.Second, "joins", func() bool { return len(r.prefill.list()) == 1 && len(r.gen.list()) == 2 })
	prompt := "a prompt that one worker will have cached"
	send := func(conv string) {
		t.Helper()
		if resp, body := post(t, rs.URL+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"conversation_id":%q}`, prompt, conv)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	send("c1")
	// A context worker joins with the prompt cached: polled, and preferred.
	b, bu := startReuseFake(t, "ctx", "")
	b.store(promptHashes(prompt, 4))
	register(t, st, membership.RoleContext, bu)
	waitFor(t, 5*time.Second, "b's join and events", func() bool {
		s := serverOf(r, r.prefill, "http://"+strings.TrimPrefix(bu, "http://"))
		return s != nil && s.kv.size() > 0
	})
	a0, b0 := a.calls.Load(), b.calls.Load()
	for range 3 {
		send("c1")
	}
	if a.calls.Load() != a0 || b.calls.Load() != b0+3 {
		t.Errorf("context calls a %d→%d, b %d→%d: want all on b, which has the prompt", a0, a.calls.Load(), b0, b.calls.Load())
	}
	// c1 stayed on one generation worker; it leaves, and c1 moves.
	on, other, leave := g1, g2, m1
	if g2.calls.Load() > g1.calls.Load() {
		on, other, leave = g2, g1, m2
	}
	if on.calls.Load() != 4 || other.calls.Load() != 0 {
		t.Fatalf("conversation c1 spread: %d and %d", on.calls.Load(), other.calls.Load())
	}
	if err := leave.Deregister(t.Context()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the leave", func() bool { return len(r.gen.list()) == 1 })
	if n := r.gen.conv.len(); n != 0 {
		t.Errorf("%d conversations remembered on a worker that left", n)
	}
	send("c1")
	send("c1")
	if other.calls.Load() != 2 || on.calls.Load() != 4 {
		t.Errorf("after the leave: %d on the one that stayed, %d on the one that left", other.calls.Load(), on.calls.Load())
	}
}
