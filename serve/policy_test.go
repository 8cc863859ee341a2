package serve

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
)

// hashesOf is the chained hashes of n blocks of 4 tokens starting at
// token seed.
func hashesOf(seed int32, n int) []kvcache.Hash {
	toks := make([]int32, 4*n)
	for i := range toks {
		toks[i] = seed + int32(i)
	}
	return kvcache.HashBlocks(kvcache.Hash{}, toks, 4)
}

func setOf(hs ...[]kvcache.Hash) map[kvcache.Hash]struct{} {
	m := map[kvcache.Hash]struct{}{}
	for _, h := range hs {
		for _, x := range h {
			m[x] = struct{}{}
		}
	}
	return m
}

func TestMatchedBlocks(t *testing.T) {
	p := hashesOf(1, 6)
	for _, tc := range []struct {
		name   string
		cached map[kvcache.Hash]struct{}
		want   int
	}{
		{"empty", setOf(), 0},
		{"all", setOf(p), 6},
		{"first three", setOf(p[:3]), 3},
		{"a hole stops the prefix", setOf(p[:2], p[3:]), 2},
		{"only later blocks", setOf(p[1:]), 0},
		{"another prompt", setOf(hashesOf(100, 6)), 0},
	} {
		if got := matchedBlocks(tc.cached, p); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestRankKVAware(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cands    []kvCandidate
		blocks   int
		maxBatch int
		rr       uint64
		want     []int
	}{
		{"empty caches, idle: round robin from rr", []kvCandidate{{}, {}, {}}, 4, 64, 1, []int{1, 2, 0}},
		{"empty caches: the least loaded", []kvCandidate{{inflight: 2}, {inflight: 1}, {inflight: 3}}, 4, 64, 0, []int{1, 0, 2}},
		{"longest prefix wins", []kvCandidate{{matched: 1}, {matched: 4}, {matched: 2}}, 4, 64, 0, []int{1, 2, 0}},
		// 3/4 - 40/64 = 0.125 < 1/4 - 0 = 0.25: load outweighs the cache.
		{"load outweighs the prefix", []kvCandidate{{matched: 3, inflight: 40}, {matched: 1}}, 4, 64, 0, []int{1, 0}},
		// 1 - 8/8 = 0 < 0.5 - 0: max_batch_size weighs the load.
		{"small max_batch_size", []kvCandidate{{matched: 4, inflight: 8}, {matched: 2}}, 4, 8, 0, []int{1, 0}},
		{"ties rotate", []kvCandidate{{matched: 2}, {matched: 2}, {matched: 0}}, 4, 64, 1, []int{1, 0, 2}},
		{"no blocks (short prompt): load only", []kvCandidate{{inflight: 1}, {}}, 0, 64, 0, []int{1, 0}},
		{"one worker", []kvCandidate{{inflight: 9}}, 4, 64, 5, []int{0}},
		{"none", nil, 4, 64, 0, []int{}},
	} {
		if got := rankKVAware(tc.cands, tc.blocks, tc.maxBatch, tc.rr); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestRankKVAwareProperty: against a naive reference, the first is the
// best score (the first of the tied ones from rr on) and scores never rise
// along the order.
func TestRankKVAwareProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		n, blocks, maxBatch := 1+rng.IntN(6), rng.IntN(10), 1+rng.IntN(16)
		cands := make([]kvCandidate, n)
		for i := range cands {
			cands[i] = kvCandidate{matched: rng.IntN(blocks + 1), inflight: int64(rng.IntN(5))}
		}
		rr := rng.Uint64()
		got := rankKVAware(cands, blocks, maxBatch, rr)
		score := func(i int) float64 { return kvScore(cands[i].matched, blocks, cands[i].inflight, maxBatch) }
		best, first := score(0), -1
		for i := range n {
			best = max(best, score(i))
		}
		for k := range n { // the naive choice: the first best from rr on
			if i := (int(rr%uint64(n)) + k) % n; score(i) == best {
				first = i
				break
			}
		}
		if len(got) != n || got[0] != first {
			t.Fatalf("cands %+v blocks %d rr %d: order %v, want %d first", cands, blocks, rr, got, first)
		}
		for k := 1; k < n; k++ {
			if score(got[k]) > score(got[k-1]) {
				t.Fatalf("cands %+v: order %v rises at %d", cands, got, k)
			}
		}
	}
}

func TestSessions(t *testing.T) {
	all := func(string) bool { return true }
	p := hashesOf(1, 8)
	t.Run("explicit id sticks", func(t *testing.T) {
		s := newSessions(10, 0.75)
		if srv, conv := s.lookup("c1", p, all); srv != "" || conv != "" {
			t.Fatalf("unknown conversation: %q %q", srv, conv)
		}
		s.record("c1", "w2", p)
		if srv, conv := s.lookup("c1", hashesOf(50, 2), all); srv != "w2" || conv != "c1" {
			t.Errorf("known conversation: %q %q", srv, conv)
		}
		if srv, _ := s.lookup("c1", p, func(u string) bool { return u != "w2" }); srv != "" {
			t.Errorf("its worker is gone: %q", srv)
		}
	})
	t.Run("implicit prefix match", func(t *testing.T) {
		s := newSessions(10, 0.75)
		id := s.record("", "w1", p[:6])
		for _, tc := range []struct {
			name   string
			hashes []kvcache.Hash
			want   string
		}{
			{"same prompt", p[:6], "w1"},
			{"next turn: 6 of 8 blocks shared", p, "w1"},
			{"5 of 8 shared: below 0.75", append(slices.Clone(p[:5]), hashesOf(99, 3)...), ""},
			{"another prompt", hashesOf(500, 8), ""},
			{"no blocks", nil, ""},
		} {
			srv, conv := s.lookup("", tc.hashes, all)
			if srv != tc.want || (srv != "" && conv != id) {
				t.Errorf("%s: %q %q, want %q %q", tc.name, srv, conv, tc.want, id)
			}
		}
	})
	t.Run("LRU eviction", func(t *testing.T) {
		s := newSessions(2, 0.75)
		s.record("a", "w1", hashesOf(1, 2))
		s.record("b", "w2", hashesOf(10, 2))
		s.lookup("a", nil, all)
		s.record("a", "w1", hashesOf(1, 3)) // a is used again
		s.record("c", "w3", hashesOf(20, 2))
		if s.len() != 2 {
			t.Fatalf("%d conversations, want 2", s.len())
		}
		if srv, _ := s.lookup("b", nil, all); srv != "" {
			t.Errorf("b was the least recently used: still there on %q", srv)
		}
		if srv, _ := s.lookup("", hashesOf(10, 2), all); srv != "" {
			t.Errorf("b's hashes still match: %q", srv)
		}
		if srv, _ := s.lookup("a", nil, all); srv != "w1" {
			t.Errorf("a: %q", srv)
		}
	})
	t.Run("hash budget", func(t *testing.T) {
		// Long prompts used to be kept whole for up to MaxSessions
		// conversations: a client's 1M-token prompts grew the router by
		// gigabytes. The hashes kept in all are bounded; the least
		// recently used conversations go first, the newest stays.
		s := newSessions(1000, 0.75)
		s.maxHashes = 100
		for i := range 10 {
			s.record(fmt.Sprint("c", i), "w1", hashesOf(int32(1000*(i+1)), 30))
		}
		if s.nhashes > 100 || s.len() != 3 || len(s.byHash) != 90 {
			t.Errorf("%d hashes kept in %d conversations (%d indexed), want at most 100 in 3", s.nhashes, s.len(), len(s.byHash))
		}
		if srv, _ := s.lookup("c9", nil, all); srv != "w1" {
			t.Errorf("the newest conversation was evicted")
		}
		if srv, _ := s.lookup("c6", nil, all); srv != "" {
			t.Errorf("c6 kept beyond the budget")
		}
		s.record("huge", "w2", hashesOf(50_000, 500))
		if s.len() != 1 || s.nhashes != 500 {
			t.Errorf("one conversation over the budget: %d conversations, %d hashes; want it alone", s.len(), s.nhashes)
		}
		s.forget("w2")
		if s.nhashes != 0 || len(s.byHash) != 0 {
			t.Errorf("after forget: %d hashes counted, %d indexed", s.nhashes, len(s.byHash))
		}
	})
	t.Run("forget a worker", func(t *testing.T) {
		s := newSessions(10, 0.75)
		s.record("a", "w1", p)
		s.record("b", "w2", hashesOf(9, 3))
		s.forget("w1")
		if srv, _ := s.lookup("a", nil, all); srv != "" || s.len() != 1 || len(s.byHash) != 3 {
			t.Errorf("after forget: %q, %d conversations, %d hashes", srv, s.len(), len(s.byHash))
		}
	})
}

func TestKVSetApply(t *testing.T) {
	a, b := hashesOf(1, 3), hashesOf(100, 2)
	k := newKVSet()
	k.apply(kvUpdate{epoch: "e1", next: 2, events: []kvDelta{{id: 1, store: true, hashes: a}, {id: 2, store: true, hashes: b}}})
	if k.matched(a) != 3 || k.matched(b) != 2 || k.cursor() != 2 {
		t.Fatalf("after stores: %d %d, cursor %d", k.matched(a), k.matched(b), k.cursor())
	}
	// A repeated answer changes nothing; a removal applies.
	k.apply(kvUpdate{epoch: "e1", next: 3, events: []kvDelta{{id: 2, store: true, hashes: b}, {id: 3, hashes: a[1:2]}}})
	if k.matched(a) != 1 || k.size() != 4 || k.cursor() != 3 {
		t.Fatalf("after removal: %d, %d blocks, cursor %d", k.matched(a), k.size(), k.cursor())
	}
	// Lost events: forget, then rebuild from what follows.
	k.apply(kvUpdate{epoch: "e1", lost: true, next: 9, events: []kvDelta{{id: 9, store: true, hashes: b[:1]}}})
	if k.size() != 1 || k.matched(b) != 1 || k.cursor() != 9 {
		t.Fatalf("after lost: %d blocks, cursor %d", k.size(), k.cursor())
	}
	// A restarted worker (new epoch): forget, and its ids start over.
	k.apply(kvUpdate{epoch: "e2", next: 1, events: []kvDelta{{id: 1, store: true, hashes: a}}})
	if k.size() != 3 || k.matched(a) != 3 || k.cursor() != 1 {
		t.Fatalf("after restart: %d blocks, cursor %d", k.size(), k.cursor())
	}
}

func TestDecodeKVEvents(t *testing.T) {
	h1, h2 := hashesOf(1, 1)[0].String(), hashesOf(2, 1)[0].String()
	hdr := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	good := fmt.Sprintf(`[{"event_id":4,"data":{"type":"created","num_blocks_per_cache_level":[64]}},
		{"event_id":5,"data":{"type":"stored","parent_hash":null,"blocks":[{"block_hash":%q},{"block_hash":%q}]}},
		{"event_id":7,"data":{"type":"removed","block_hashes":[%q]}}]`, h1, h2, h2)
	u, err := decodeKVEvents(hdr(KVEventsEpochHeader, "e", KVEventsLostHeader, "true", KVEventsMoreHeader, "true"), []byte(good), 3)
	if err != nil {
		t.Fatal(err)
	}
	if u.epoch != "e" || !u.lost || !u.more || u.next != 7 || len(u.events) != 3 || !u.events[1].store || len(u.events[1].hashes) != 2 ||
		u.events[2].store || u.events[2].hashes[0].String() != h2 {
		t.Errorf("decoded %+v", u)
	}
	for _, tc := range []struct {
		name, body string
		h          http.Header
		after      uint64
	}{
		{"not json", `{`, nil, 0},
		{"an object", `{"event_id":1}`, nil, 0},
		{"ids out of order", `[{"event_id":2,"data":{"type":"created"}},{"event_id":1,"data":{"type":"created"}}]`, nil, 0},
		{"an id at the cursor", `[{"event_id":3,"data":{"type":"created"}}]`, nil, 3},
		{"short hash", `[{"event_id":1,"data":{"type":"removed","block_hashes":["abcd"]}}]`, nil, 0},
		{"not hex", fmt.Sprintf(`[{"event_id":1,"data":{"type":"stored","blocks":[{"block_hash":%q}]}}]`, "zz"+h1[2:]), nil, 0},
		{"next before the last event", `[{"event_id":5,"data":{"type":"created"}}]`, hdr(KVEventsNextHeader, "4"), 0},
		{"next not a number", `[]`, hdr(KVEventsNextHeader, "x"), 0},
	} {
		if tc.h == nil {
			tc.h = http.Header{}
		}
		if _, err := decodeKVEvents(tc.h, []byte(tc.body), tc.after); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
}

func FuzzDecodeKVEvents(f *testing.F) {
	h := hashesOf(1, 1)[0].String()
	f.Add([]byte(`[]`), uint64(0), "")
	f.Add([]byte(fmt.Sprintf(`[{"event_id":1,"data":{"type":"stored","blocks":[{"block_hash":%q}]}}]`, h)), uint64(0), "1")
	f.Add([]byte(fmt.Sprintf(`[{"event_id":9,"data":{"type":"removed","block_hashes":[%q]}}]`, h)), uint64(3), "12")
	f.Fuzz(func(t *testing.T, body []byte, after uint64, next string) {
		hdr := http.Header{}
		if next != "" {
			hdr.Set(KVEventsNextHeader, next)
		}
		u, err := decodeKVEvents(hdr, body, after)
		if err != nil {
			return
		}
		last := after
		for _, e := range u.events {
			if e.id <= last {
				t.Fatalf("event %d not after %d", e.id, last)
			}
			last = e.id
		}
		if u.next < last {
			t.Fatalf("next %d before the last event %d", u.next, last)
		}
		k := newKVSet()
		k.apply(u)
		if k.cursor() != u.next {
			t.Fatalf("cursor %d, want %d", k.cursor(), u.next)
		}
	})
}

// BenchmarkKVAwareOrder is kv_cache_aware's cost per request: read the
// prompt, hash its blocks, score 4 workers (one holding the prompt).
func BenchmarkKVAwareOrder(b *testing.B) {
	prompt := strings.Repeat("a long shared system prompt, then the user's turn. ", 80) // ~4k tokens
	orig := object{}
	orig.set("prompt", prompt)
	g := &group{policy: KVCacheAware, tokensPerBlock: 32, args: config.DefaultRouterArgs()}
	for i := range 4 {
		s := newUpstream(fmt.Sprint("w", i))
		for j := range 50_000 {
			s.kv.blocks[hashesOf(int32(j*7+i), 1)[0]] = struct{}{}
		}
		g.servers = append(g.servers, s)
	}
	r := &Router{needPrompt: true}
	ri := r.newRouteInfo("/v1/completions", orig)
	for _, h := range ri.blockHashes(32, 0) {
		g.servers[2].kv.blocks[h] = struct{}{}
	}
	b.SetBytes(int64(len(prompt)))
	for b.Loop() {
		ri := r.newRouteInfo("/v1/completions", orig)
		if o, _ := g.orderFor(ri); o[0] != g.servers[2] {
			b.Fatal("the worker with the prompt is not first")
		}
	}
}
