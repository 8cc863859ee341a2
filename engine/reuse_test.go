package engine

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver"
)

// reuseOpts turns on block reuse, partial reuse by copy and events.
var reuseOpts = Options{BlockReuse: true, PartialReuse: true, CopyOnPartialReuse: true, EventBufferMaxSize: 64}

// newReuseDisaggEngine is newDisaggEngine with engine options.
func newReuseDisaggEngine(t testing.TB, preset string, icfg InstanceConfig, opts Options) *Engine {
	t.Helper()
	return newDisaggEngineOpts(t, preset, icfg, opts)
}

// checkPoolsWhole fails unless every block of every pool of e is
// available again (cached blocks count: Allocate reclaims them).
func checkPoolsWhole(t testing.TB, e *Engine) {
	t.Helper()
	waitPoolsFree(t, e)
	for r, p := range e.Pools() {
		if got := p.FreeBlocks(); got != p.NumBlocks() {
			t.Errorf("rank %d: %d of %d blocks available", r, got, p.NumBlocks())
		}
	}
}

// reuseRun runs prompt and n greedy tokens through the engine's own
// admission path on its (unstarted) instance, as the scheduler does:
// match the cached prefix, reserve the rest, copy a partial block, prefill
// the remainder, decode, publish the full blocks and release. It returns
// the tokens, the logits of every step, the logical KV before the release
// and the tokens taken from the cache.
func reuseRun(t *testing.T, e *Engine, prompt []int32, n int) (run, int) {
	t.Helper()
	return reuseRunSalted(t, e, "", prompt, n)
}

// reuseRunSalted is reuseRun for a request with cache salt salt.
func reuseRunSalted(t *testing.T, e *Engine, salt string, prompt []int32, n int) (run, int) {
	t.Helper()
	in := e.inst
	root := kvcache.RootHash(salt)
	r := &request{typ: transceiver.ContextAndGeneration, prompt: prompt, promptLen: len(prompt),
		root: root, hashes: kvcache.HashBlocks(root, prompt, in.tpb)}
	m := e.matchPrefix(r)
	s := in.NewSequence()
	s.adopt(&m)
	if err := s.Reserve(len(prompt) + n); err != nil {
		m.drop(in.pools)
		s.Release()
		t.Fatal(err)
	}
	s.copyPartial(&m)
	r.seq, r.cached, r.published = s, s.Len(), s.Len()/in.tpb
	defer func() {
		if err := s.Release(); err != nil {
			t.Error(err)
		}
	}()
	lg, err := in.Prefill(s, prompt[s.Len():])
	if err != nil {
		t.Fatal(err)
	}
	e.commitBlocks(r, prompt)
	var out run
	fed := slices.Clone(prompt)
	for i := range n {
		out.logits = append(out.logits, lg)
		tok := sampleToken(lg, 0, 0, i)
		out.tokens = append(out.tokens, tok)
		if i == n-1 {
			break
		}
		if lg, err = in.Decode(s, tok); err != nil {
			t.Fatal(err)
		}
		fed = append(fed, tok)
	}
	if out.kv, err = logicalKV(in, s); err != nil {
		t.Fatal(err)
	}
	e.commitBlocks(r, fed)
	return out, r.cached
}

// TestReuseBitExact is the property test of block reuse: random prompts
// that share prefixes of random lengths (whole blocks, partial blocks, a
// whole earlier prompt, an earlier prompt and its answer), run in turn on
// an instance that reuses what the earlier ones published, give the
// tokens, every logit and every KV byte of a run without reuse, bit for
// bit, for GQA and MLA, every dtype, over TP and PP layouts.
func TestReuseBitExact(t *testing.T) {
	tests := []struct {
		preset string
		dt     kvcache.DType
		icfg   InstanceConfig
	}{
		{"tiny-gqa", kvcache.BF16, InstanceConfig{TP: 2}},
		{"tiny-gqa", kvcache.FP32, InstanceConfig{PP: 2}},
		{"tiny-gqa", kvcache.FP8E4M3, InstanceConfig{TP: 2, PP: 2}},
		{"tiny-gqa2", kvcache.FP16, InstanceConfig{TP: 4}},
		{"tiny-mla", kvcache.BF16, InstanceConfig{TP: 2, PP: 2}},
		{"tiny-mla", kvcache.FP8E4M3, InstanceConfig{}},
		{"tiny-mla", kvcache.FP16, InstanceConfig{PP: 2}},
	}
	for _, tc := range tests {
		name := fmt.Sprintf("%s %v TP%d PP%d", tc.preset, tc.dt, max(1, tc.icfg.TP), max(1, tc.icfg.PP))
		if tc.dt == kvcache.FP16 || tc.dt == kvcache.FP32 {
			name += " in place"
		}
		t.Run(name, func(t *testing.T) {
			icfg := tc.icfg
			icfg.TokensPerBlock, icfg.DType, icfg.PoolTokens = 8, tc.dt, 8*64
			opts := reuseOpts
			if tc.dt == kvcache.FP16 || tc.dt == kvcache.FP32 {
				// Partial reuse in place: cached blocks taken out of the
				// index, not copied.
				opts.CopyOnPartialReuse = false
			}
			e, err := New(newTestInstance(t, tc.preset, icfg), opts)
			if err != nil {
				t.Fatal(err)
			}
			ref := newTestInstance(t, tc.preset, icfg)
			rng := rand.New(rand.NewPCG(uint64(len(name)), 11))
			var earlier [][]int32 // earlier prompts, and prompts with their answers
			sawFull, sawPartial := false, false
			for i := range 16 {
				var p []int32
				if len(earlier) > 0 && i%5 != 0 {
					base := earlier[rng.IntN(len(earlier))]
					cut := 1 + rng.IntN(len(base))
					if i%3 == 0 {
						cut = len(base) // the whole earlier prompt (and answer)
					}
					p = slices.Clone(base[:cut])
				} else {
					p = []int32{BOS}
				}
				for range rng.IntN(20) {
					p = append(p, int32(rng.IntN(256)))
				}
				if len(p) == 0 {
					p = append(p, BOS)
				}
				const n = 6
				got, cached := reuseRun(t, e, p, n)
				want := generate(t, ref, p, n, 0, 0)
				sawFull = sawFull || cached >= icfg.TokensPerBlock
				sawPartial = sawPartial || cached%icfg.TokensPerBlock != 0
				if !slices.Equal(got.tokens, want.tokens) {
					t.Fatalf("prompt %d (%d tokens, %d cached): tokens %v, without reuse %v", i, len(p), cached, got.tokens, want.tokens)
				}
				for s := range got.logits {
					for v := range got.logits[s] {
						if math.Float32bits(got.logits[s][v]) != math.Float32bits(want.logits[s][v]) {
							t.Fatalf("prompt %d (%d cached): step %d logit %d = %v, without reuse %v",
								i, cached, s, v, got.logits[s][v], want.logits[s][v])
						}
					}
				}
				if !slices.Equal(got.kv, want.kv) {
					t.Fatalf("prompt %d (%d cached): KV cache differs from the run without reuse", i, cached)
				}
				earlier = append(earlier, p, append(slices.Clone(p), got.tokens[:n-1]...))
			}
			if !sawFull || !sawPartial {
				t.Fatalf("reused whole blocks %v, part of a block %v: want both", sawFull, sawPartial)
			}
			checkPoolsFree(t, e.inst)
		})
	}
}

// TestReuseSaltsNeverShare is TestReuseBitExact with tenants: prompts of
// three cache salts (one of them none) drawn from two tokens, so that
// they share long prefixes across tenants, run in turn on a pool small
// enough to evict. Each run gives the tokens, logits and KV of a run
// without reuse, and reuses at most what its own tenant published before
// (the naive reference: the longest prefix it shares with an earlier
// prompt, or prompt and answer, of the same salt), never what another
// tenant's did, with partial reuse by copy and in place.
func TestReuseSaltsNeverShare(t *testing.T) {
	const tpb, n = 4, 4
	common := func(a, b []int32) int {
		k := 0
		for k < len(a) && k < len(b) && a[k] == b[k] {
			k++
		}
		return k
	}
	for _, copyPartial := range []bool{true, false} {
		t.Run(fmt.Sprintf("copy %v", copyPartial), func(t *testing.T) {
			icfg := InstanceConfig{TP: 2, TokensPerBlock: tpb, DType: kvcache.FP32, PoolTokens: tpb * 40}
			opts := reuseOpts
			opts.CopyOnPartialReuse = copyPartial
			e, err := New(newTestInstance(t, "tiny-gqa", icfg), opts)
			if err != nil {
				t.Fatal(err)
			}
			ref := newTestInstance(t, "tiny-gqa", icfg)
			salts := []string{"", "tenant-a", "tenant-b"}
			rng := rand.New(rand.NewPCG(7, uint64(len(fmt.Sprint(copyPartial)))))
			type seq struct {
				salt string
				toks []int32
			}
			var earlier []seq // every prompt, and every prompt with its answer fed back
			saltedHits, refused := 0, 0
			for i := range 40 {
				salt := salts[rng.IntN(len(salts))]
				p := []int32{BOS}
				if len(earlier) > 0 && rng.IntN(4) != 0 {
					base := earlier[rng.IntN(len(earlier))].toks // any tenant's
					p = slices.Clone(base[:1+rng.IntN(len(base))])
				}
				for range 1 + rng.IntN(10) {
					p = append(p, int32(7+rng.IntN(2)))
				}
				own, other := 0, 0
				for _, s := range earlier {
					if s.salt == salt {
						own = max(own, common(p, s.toks))
					} else {
						other = max(other, common(p, s.toks))
					}
				}
				got, cached := reuseRunSalted(t, e, salt, p, n)
				want := generate(t, ref, p, n, 0, 0)
				if cached > own {
					t.Fatalf("prompt %d (salt %q, %d tokens): %d tokens reused, but its tenant published at most %d of them (other tenants %d)",
						i, salt, len(p), cached, own, other)
				}
				if !slices.Equal(got.tokens, want.tokens) || !slices.Equal(got.kv, want.kv) {
					t.Fatalf("prompt %d (salt %q, %d cached): tokens %v, KV equal %v; without reuse %v",
						i, salt, cached, got.tokens, slices.Equal(got.kv, want.kv), want.tokens)
				}
				for s := range got.logits {
					for v := range got.logits[s] {
						if math.Float32bits(got.logits[s][v]) != math.Float32bits(want.logits[s][v]) {
							t.Fatalf("prompt %d (salt %q, %d cached): step %d logit %d = %v, without reuse %v",
								i, salt, cached, s, v, got.logits[s][v], want.logits[s][v])
						}
					}
				}
				if salt != "" && cached > 0 {
					saltedHits++
				}
				// Another tenant had published a whole block more of
				// this prompt than its own tenant: the case under test.
				if min(other, len(p)-1)/tpb > own/tpb {
					refused++
				}
				earlier = append(earlier, seq{salt, p}, seq{salt, append(slices.Clone(p), got.tokens[:n-1]...)})
			}
			if saltedHits == 0 || refused < 3 {
				t.Fatalf("%d salted prompts reused their own tenant's blocks, %d could have reused another's: want some of both",
					saltedHits, refused)
			}
			if st := e.inst.pools[0].Stats(); st.Evictions == 0 {
				t.Errorf("no eviction in %+v: the pool is meant to be small enough", st)
			}
			checkPoolsFree(t, e.inst)
		})
	}
}

// conversation returns turn 2's prompt: turn 1's prompt, its answer and
// a follow-up.
func conversation(p1, answer []int32, follow string) []int32 {
	p2 := append(slices.Clone(p1), answer...)
	return append(p2, Tokenizer{}.Encode(follow)[1:]...) // without a second BOS
}

// TestReuseAggregated: a two-turn conversation on an aggregated engine
// with reuse gives the tokens of an engine without, reuses turn 1's
// prompt and answer (what CachedPrefix predicted), counts it in its
// stats, and keeps a salted tenant's prefixes apart.
func TestReuseAggregated(t *testing.T) {
	icfg := InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 8 * 32}
	plain := newTestEngine(t, "tiny-gqa", icfg, Options{})
	for _, opts := range []Options{{BlockReuse: true}, reuseOpts} {
		t.Run(fmt.Sprintf("partial %v", opts.PartialReuse), func(t *testing.T) {
			e := newTestEngine(t, "tiny-gqa", icfg, opts)
			p1 := prompt("You are a helpful assistant. Say something.")
			r1 := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p1, MaxTokens: 12, IgnoreEOS: true}))
			if r1.Final.Usage.CachedTokens != 0 {
				t.Fatalf("turn 1: %d cached tokens in an empty cache", r1.Final.Usage.CachedTokens)
			}
			p2 := conversation(p1, r1.Tokens, " And more?")
			// The cache holds turn 1's prompt and the answer's tokens fed
			// back (all but the last), in full blocks; partial reuse adds
			// nothing here: no cached block continues past them.
			want := (len(p1) + len(r1.Tokens) - 1) / 8 * 8
			if got := e.CachedPrefix(p2); got != want {
				t.Errorf("CachedPrefix(turn 2) = %d, want %d", got, want)
			}
			if got := e.CachedPrefixSalted(p2, "tenant"); got != 0 {
				t.Errorf("CachedPrefixSalted(turn 2, another tenant) = %d, want 0", got)
			}
			r2 := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p2, MaxTokens: 12, IgnoreEOS: true}))
			ref := waitResult(t, submit(t, plain, context.Background(), Request{Prompt: p2, MaxTokens: 12, IgnoreEOS: true}))
			if r2.Final.Err != nil || !slices.Equal(r2.Tokens, ref.Tokens) || r2.Text != ref.Text {
				t.Fatalf("turn 2: %v %q (%v), without reuse %v %q", r2.Tokens, r2.Text, r2.Final.Err, ref.Tokens, ref.Text)
			}
			if got := r2.Final.Usage.CachedTokens; got != want {
				t.Errorf("turn 2: %d cached tokens, want %d", got, want)
			}
			if ref.Final.Usage.CachedTokens != 0 {
				t.Errorf("engine without reuse reports %d cached tokens", ref.Final.Usage.CachedTokens)
			}
			// A salted request shares nothing with the unsalted ones.
			r3 := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p2, MaxTokens: 12, IgnoreEOS: true, CacheSalt: "tenant"}))
			if r3.Final.Usage.CachedTokens != 0 || !slices.Equal(r3.Tokens, ref.Tokens) {
				t.Errorf("salted turn 2: %d cached tokens, tokens %v; want 0 and %v", r3.Final.Usage.CachedTokens, r3.Tokens, ref.Tokens)
			}
			// Stats are those of the last iteration: wait for one more.
			waitStats(t, e, func(st Stats) bool { return st.PromptTokens == uint64(len(p1)+2*len(p2)) })
			st := e.Stats()
			if st.CachedTokens != uint64(want) || st.BlocksPublished == 0 || st.PrefillTokens != st.PromptTokens-st.CachedTokens {
				t.Errorf("stats %+v: want %d cached tokens, blocks published, prefill = prompt - cached", st, want)
			}
			checkPoolsWhole(t, e)
		})
	}
}

// waitStats waits until e's stats satisfy ok.
func waitStats(t testing.TB, e *Engine, ok func(Stats) bool) {
	t.Helper()
	for range 2000 {
		if ok(e.Stats()) {
			return
		}
		e.kick()
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("stats %+v never got there", e.Stats())
}

// TestReuseDisaggConversation: a two-turn conversation, disaggregated,
// where turn 2's prompt extends turn 1's prompt and answer. Turn 2's
// generation side finds turn 1 in its own cache and asks the context side
// only for the blocks after it, and exactly those blocks' bytes move; the
// context side reuses its own cache for the prefill; the tokens are those
// of an aggregated run without reuse.
func TestReuseDisaggConversation(t *testing.T) {
	tests := []struct {
		name         string
		preset       string
		dt           kvcache.DType
		prefill, gen InstanceConfig
	}{
		{"GQA TP2 to TP1", "tiny-gqa", kvcache.BF16, InstanceConfig{TP: 2}, InstanceConfig{}},
		{"GQA PP2 to TP2", "tiny-gqa", kvcache.FP8E4M3, InstanceConfig{PP: 2}, InstanceConfig{TP: 2}},
		{"MLA TP2 to TP1 PP2", "tiny-mla", kvcache.BF16, InstanceConfig{TP: 2}, InstanceConfig{PP: 2}},
		{"duplicated heads TP4 to TP1", "tiny-gqa2", kvcache.FP16, InstanceConfig{TP: 4}, InstanceConfig{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, c := range []*InstanceConfig{&tc.prefill, &tc.gen} {
				c.TokensPerBlock, c.DType, c.PoolTokens = 8, tc.dt, 8*48
			}
			prefillE := newReuseDisaggEngine(t, tc.preset, tc.prefill, reuseOpts)
			genE := newReuseDisaggEngine(t, tc.preset, tc.gen, reuseOpts)
			plain := newTestEngine(t, tc.preset, tc.gen, Options{})
			var bb int64
			for _, p := range genE.Pools() {
				bb += p.BlockBytes()
			}
			p1 := prompt("System: be brief. User: what is a KV cache?")
			req := Request{Prompt: p1, MaxTokens: 14, IgnoreEOS: true}
			_, g1 := disaggregate(t, prefillE, genE, req)
			if g1.Final.Err != nil || g1.Final.Usage.CachedTokens != 0 {
				t.Fatalf("turn 1: %v, %d cached tokens", g1.Final.Err, g1.Final.Usage.CachedTokens)
			}
			if ft := g1.Final.Timing; ft.TransferBlocks != (len(p1)+7)/8 || ft.TransferBytes != int64(ft.TransferBlocks)*bb {
				t.Errorf("turn 1: %d blocks, %d bytes moved; want %d blocks of %d bytes", ft.TransferBlocks, ft.TransferBytes, (len(p1)+7)/8, bb)
			}
			// Turn 1 again: the generation side has the prompt's blocks
			// but still asks for the last one (the transceiver moves one
			// block at least, and a prompt is never taken whole from the
			// cache); the context side recomputes only that block too.
			c1b, g1b := disaggregate(t, prefillE, genE, req)
			full := (len(p1) - 1) / 8 * 8
			if !slices.Equal(g1b.Tokens, g1.Tokens) || g1b.Final.Usage.CachedTokens != full || c1b.Final.Usage.CachedTokens != full ||
				g1b.Final.Timing.TransferBlocks != (len(p1)+7)/8-full/8 {
				t.Errorf("turn 1 again: %v (first %v), %d and %d cached tokens, %d blocks moved; want %d cached, %d blocks",
					g1b.Tokens, g1.Tokens, g1b.Final.Usage.CachedTokens, c1b.Final.Usage.CachedTokens, g1b.Final.Timing.TransferBlocks,
					full, (len(p1)+7)/8-full/8)
			}
			p2 := conversation(p1, g1.Tokens, " User: and why page it?")
			req.Prompt, req.MaxTokens = p2, 10
			c2, g2 := disaggregate(t, prefillE, genE, req)
			ref := waitResult(t, submit(t, plain, context.Background(), req))
			if g2.Final.Err != nil || !slices.Equal(g2.Tokens, ref.Tokens) {
				t.Fatalf("turn 2: %v (%v), aggregated without reuse %v", g2.Tokens, g2.Final.Err, ref.Tokens)
			}
			// The generation side holds turn 1's prompt and the answer it
			// fed back, in full blocks; the context side turn 1's prompt.
			genCached := (len(p1) + len(g1.Tokens) - 1) / 8 * 8
			if got := g2.Final.Usage.CachedTokens; got != genCached {
				t.Errorf("turn 2 generation side: %d cached tokens, want %d", got, genCached)
			}
			if got, want := c2.Final.Usage.CachedTokens, len(p1)/8*8; got != want {
				t.Errorf("turn 2 context side: %d cached tokens, want %d", got, want)
			}
			ft := g2.Final.Timing
			t.Logf("turn 2: %d prompt tokens, %d cached on the generation side, %d on the context side; %d of %d blocks moved, %d bytes",
				len(p2), g2.Final.Usage.CachedTokens, c2.Final.Usage.CachedTokens, ft.TransferBlocks, (len(p2)+7)/8, ft.TransferBytes)
			if want := (len(p2)+7)/8 - genCached/8; ft.TransferBlocks != want || ft.BlockBytes != bb {
				t.Errorf("turn 2: asked for %d blocks of %d bytes, want %d of %d", ft.TransferBlocks, ft.BlockBytes, want, bb)
			}
			if ft.TransferBytes != int64(ft.TransferBlocks)*ft.BlockBytes {
				t.Errorf("turn 2: %d bytes moved, want the %d new blocks' %d", ft.TransferBytes, ft.TransferBlocks, int64(ft.TransferBlocks)*ft.BlockBytes)
			}
			checkPoolsWhole(t, prefillE)
			checkPoolsWhole(t, genE)
		})
	}
}

// TestReuseEvents: the event stream opens with created, says stored with
// the chained hashes of every published block, removed for the blocks
// evicted to make room, keeps only the last EventBufferMaxSize events and
// says lost to a reader that fell behind; a zero buffer keeps nothing.
func TestReuseEvents(t *testing.T) {
	const tpb = 8
	icfg := InstanceConfig{TokensPerBlock: tpb, PoolTokens: tpb * 8}
	t.Run("stream", func(t *testing.T) {
		opts := reuseOpts
		opts.EventBufferMaxSize = 100
		e := newTestEngine(t, "tiny-gqa", icfg, opts)
		evs, lost := e.KVEvents(0)
		if lost || len(evs) != 1 || evs[0].Type != KVEventCreated || evs[0].ID != 1 || evs[0].NumBlocks != 8 {
			t.Fatalf("fresh engine: events %+v lost %v, want one created of 8 blocks", evs, lost)
		}
		// 3 full prompt blocks and a partial one; with 9 tokens generated
		// (8 fed back), 4 full blocks at the end.
		p := prompt("twenty-four bytes of it!!")[:3*tpb+2]
		res := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 9, IgnoreEOS: true}))
		fed := append(slices.Clone(p), res.Tokens[:8]...)
		want := kvcache.HashBlocks(kvcache.Hash{}, fed, tpb)
		evs, lost = e.KVEvents(1)
		if lost || len(evs) != 2 {
			t.Fatalf("after one request: %+v lost %v, want two stored events", evs, lost)
		}
		if ev := evs[0]; ev.Type != KVEventStored || ev.ID != 2 || !ev.ParentHash.IsRoot() || !slices.Equal(ev.Hashes, want[:3]) {
			t.Errorf("prefill: %+v, want stored %v from the root", ev, want[:3])
		}
		if ev := evs[1]; ev.Type != KVEventStored || ev.ParentHash != want[2] || !slices.Equal(ev.Hashes, want[3:4]) {
			t.Errorf("end: %+v, want stored %v after %v", ev, want[3:4], want[2])
		}
		// A request needing all 8 blocks evicts the 4 cached ones, last
		// first.
		long := prompt(string(make([]byte, 6*tpb)))
		waitResult(t, submit(t, e, context.Background(), Request{Prompt: long, MaxTokens: 2 * tpb}))
		evs, _ = e.KVEvents(3)
		if len(evs) < 1 || evs[0].Type != KVEventRemoved {
			t.Fatalf("after eviction: %+v, want removed first", evs)
		}
		rm := slices.Clone(want)
		slices.Reverse(rm)
		if !slices.Equal(evs[0].Hashes, rm) {
			t.Errorf("removed %v, want %v", evs[0].Hashes, rm)
		}
		// Only BOS is left: the long prompt's first block, by partial reuse.
		if n := e.CachedPrefix(fed); n != 1 {
			t.Errorf("CachedPrefix after eviction = %d, want 1", n)
		}
		checkPoolsWhole(t, e)
	})
	t.Run("bounded", func(t *testing.T) {
		opts := reuseOpts
		opts.EventBufferMaxSize = 2
		e := newTestEngine(t, "tiny-gqa", icfg, opts)
		for i := range 3 {
			p := prompt(fmt.Sprintf("distinct prompt %d filling blocks", i))
			waitResult(t, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 1}))
		}
		evs, lost := e.KVEvents(0)
		if !lost || len(evs) != 2 || evs[1].ID != evs[0].ID+1 || evs[0].ID < 3 {
			t.Fatalf("reader from 0: %d events (%+v), lost %v; want the last 2 and lost", len(evs), evs, lost)
		}
		last := evs[1].ID
		if evs, lost := e.KVEvents(last - 1); lost || len(evs) != 1 || evs[0].ID != last {
			t.Errorf("reader from %d: %+v lost %v; want event %d, nothing lost", last-1, evs, lost, last)
		}
		if evs, lost := e.KVEvents(last); lost || len(evs) != 0 {
			t.Errorf("reader up to date: %+v lost %v", evs, lost)
		}
		checkPoolsWhole(t, e)
	})
	t.Run("off", func(t *testing.T) {
		opts := reuseOpts
		opts.EventBufferMaxSize = 0
		e := newTestEngine(t, "tiny-gqa", icfg, opts)
		waitResult(t, submit(t, e, context.Background(), Request{Prompt: prompt("no events kept here"), MaxTokens: 2}))
		if evs, lost := e.KVEvents(0); evs != nil || lost {
			t.Errorf("zero buffer: %+v lost %v", evs, lost)
		}
		checkPoolsWhole(t, e)
	})
}

// TestReuseEvictionUnderPressure: on a context instance whose pool is so
// small that every request evicts cached blocks, the blocks of a request
// the transceiver holds for its pull stay pinned and indexed (a request
// sharing their prefix reuses them, and requests that need every other
// block evict around them), the pull then delivers them intact, every
// output equals a run without reuse, and the pools end whole.
func TestReuseEvictionUnderPressure(t *testing.T) {
	const tpb = 8
	prefillE := newReuseDisaggEngine(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: tpb, PoolTokens: tpb * 10}, reuseOpts)
	genE := newReuseDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: tpb, PoolTokens: tpb * 32}, reuseOpts)
	plain := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: tpb, PoolTokens: tpb * 32}, Options{})
	reference := func(req Request) []int32 {
		return waitResult(t, submit(t, plain, context.Background(), req)).Tokens
	}

	held := Request{Prompt: prompt("a prompt held for its pull!"), MaxTokens: 6, IgnoreEOS: true} // 28 tokens: 3 full blocks
	cq := held
	cq.Type = transceiver.ContextOnly
	cres := waitResult(t, submit(t, prefillE, context.Background(), cq))
	if cres.Final.ContextPhase == nil {
		t.Fatalf("context_only: %v", cres.Final.Err)
	}
	// The transceiver holds the 4 blocks: 6 are left.
	heldPrefix := len(held.Prompt) / tpb * tpb
	for i := range 6 {
		var req Request
		if i%2 == 0 {
			// Shares the held request's prefix: reuses its pinned blocks.
			req = Request{Prompt: append(slices.Clone(held.Prompt[:heldPrefix]), prompt(fmt.Sprintf(" turn %d", i))[1:]...), MaxTokens: 8, IgnoreEOS: true}
		} else {
			// Needs all 6 blocks the transceiver leaves: evicts every
			// cached one.
			req = Request{Prompt: prompt(fmt.Sprintf("filler %d ", i) + string(make([]byte, 30))), MaxTokens: 48 - 39, IgnoreEOS: true}
		}
		res := waitResult(t, submit(t, prefillE, context.Background(), req))
		if want := reference(req); res.Final.Err != nil || !slices.Equal(res.Tokens, want) {
			t.Fatalf("request %d: %v (%v), without reuse %v", i, res.Tokens, res.Final.Err, want)
		}
		if i%2 == 0 && res.Final.Usage.CachedTokens != heldPrefix {
			t.Errorf("request %d: %d cached tokens, want the held request's %d", i, res.Final.Usage.CachedTokens, heldPrefix)
		}
		if got := prefillE.CachedPrefix(held.Prompt); got < heldPrefix {
			t.Fatalf("after request %d: the held request's prefix is cached for %d tokens, want %d", i, got, heldPrefix)
		}
	}
	if n := prefillE.Pools()[0].Stats().Evictions; n == 0 {
		t.Fatal("no block was evicted: the pool was not under pressure")
	}
	waitStats(t, prefillE, func(st Stats) bool { return st.BlocksEvicted == prefillE.Pools()[0].Stats().Evictions })
	// The pull, after all that, gets the held request's KV intact.
	gq := held
	gq.Type, gq.Prompt, gq.ContextPhase = transceiver.GenerationOnly, cres.Final.PromptTokenIDs, cres.Final.ContextPhase
	gres := waitResult(t, submit(t, genE, context.Background(), gq))
	if want := reference(held); gres.Final.Err != nil || !slices.Equal(gres.Tokens, want) {
		t.Fatalf("pulled request: %v (%v), without reuse %v", gres.Tokens, gres.Final.Err, want)
	}
	checkPoolsWhole(t, prefillE)
	checkPoolsWhole(t, genE)
}

// BenchmarkReusePrefill: the prefill of a 2,000-token prompt on tiny-gqa
// (bf16 KV, TP1) through the engine's admission path, with its first
// 1,000 tokens in the cache (cached=1000: matched, then 1,000 tokens
// computed) and without (cached=0: all 2,000 computed). Bytes are the
// prompt's KV bytes; tokens/cpu-s counts all 2,000 prompt tokens, and
// cpu-ms/op is steadier than the wall clock on a shared machine.
func BenchmarkReusePrefill(b *testing.B) {
	const n, prefix, tpb = 2000, 1000, 8
	for _, cached := range []int{0, prefix} {
		b.Run(fmt.Sprintf("cached=%d", cached), func(b *testing.B) {
			in := newTestInstance(b, "tiny-gqa", InstanceConfig{TokensPerBlock: tpb, PoolTokens: 2 * (n + prefix)})
			e, err := New(in, Options{BlockReuse: true})
			if err != nil {
				b.Fatal(err)
			}
			p := benchPrompt(n)
			if cached > 0 {
				// Publish the prefix, as an earlier request would.
				r := &request{prompt: p[:prefix], hashes: kvcache.HashBlocks(kvcache.Hash{}, p[:prefix], tpb), seq: in.NewSequence()}
				if err := r.seq.Reserve(prefix); err != nil {
					b.Fatal(err)
				}
				if _, err := in.Prefill(r.seq, r.prompt); err != nil {
					b.Fatal(err)
				}
				e.commitBlocks(r, r.prompt)
				r.seq.Release()
			}
			// One whole prefill first, so that the scratch has grown.
			warm := in.NewSequence()
			if err := warm.Reserve(n); err != nil {
				b.Fatal(err)
			}
			if _, err := in.Prefill(warm, p); err != nil {
				b.Fatal(err)
			}
			warm.Release()
			hashes := kvcache.HashBlocks(kvcache.Hash{}, p, tpb)
			b.SetBytes(int64(kvcache.BlocksForTokens(n, tpb)) * in.pools[0].BlockBytes())
			b.ReportAllocs()
			got := 0
			cpu := startCPU()
			for b.Loop() {
				r := &request{typ: transceiver.ContextAndGeneration, prompt: p, hashes: hashes}
				m := e.matchPrefix(r)
				s := in.NewSequence()
				s.adopt(&m)
				if err := s.Reserve(n); err != nil {
					b.Fatal(err)
				}
				got = s.Len()
				if _, err := in.Prefill(s, p[s.Len():]); err != nil {
					b.Fatal(err)
				}
				s.Release()
			}
			if want := cached / tpb * tpb; got != want {
				b.Fatalf("%d tokens reused, want %d", got, want)
			}
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/prefill")
			cpu.report(b, n)
		})
	}
}

// TestReuseConcurrentReaders: KVEvents and CachedPrefix, which HTTP
// handlers call, run while the scheduler publishes and evicts (the race
// detector checks them), and every event ID a reader sees is new and in
// order.
func TestReuseConcurrentReaders(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 8 * 12}, reuseOpts)
	base := prompt("a shared system prompt, long enough for blocks")
	done := make(chan struct{})
	readErr := make(chan error, 2)
	go func() {
		var after uint64
		for {
			select {
			case <-done:
				readErr <- nil
				return
			default:
			}
			evs, lost := e.KVEvents(after)
			if lost {
				readErr <- fmt.Errorf("lost events after %d with a buffer of %d", after, reuseOpts.EventBufferMaxSize)
				return
			}
			for _, ev := range evs {
				if ev.ID != after+1 {
					readErr <- fmt.Errorf("event %d after %d", ev.ID, after)
					return
				}
				after = ev.ID
			}
			time.Sleep(100 * time.Microsecond)
		}
	}()
	go func() {
		for {
			select {
			case <-done:
				readErr <- nil
				return
			default:
			}
			if n := e.CachedPrefix(base); n < 0 || n >= len(base) {
				readErr <- fmt.Errorf("CachedPrefix = %d for a prompt of %d", n, len(base))
				return
			}
		}
	}()
	var streams []*Stream
	for i := range 12 {
		p := append(slices.Clone(base), prompt(fmt.Sprintf(" question %d", i))[1:]...)
		streams = append(streams, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 4 + i%3, IgnoreEOS: true}))
	}
	cached := 0
	for _, s := range streams {
		res := waitResult(t, s)
		if res.Final.Err != nil {
			t.Fatal(res.Final.Err)
		}
		cached += res.Final.Usage.CachedTokens
	}
	close(done)
	for range 2 {
		if err := <-readErr; err != nil {
			t.Error(err)
		}
	}
	if cached == 0 {
		t.Error("no request reused the shared prompt")
	}
	checkPoolsWhole(t, e)
}

// TestReuseConcurrentPressure: requests that share a prefix and requests
// that need most of the pool run at once on a pool that holds only a few
// of them, so that admission reuses blocks other running requests hold
// while allocations evict cached ones; every output equals a lone run
// without reuse and the pools end whole.
func TestReuseConcurrentPressure(t *testing.T) {
	const tpb = 8
	for _, opts := range []Options{reuseOpts, {BlockReuse: true, PartialReuse: true, EventBufferMaxSize: 8}} {
		t.Run(fmt.Sprintf("copy %v", opts.CopyOnPartialReuse), func(t *testing.T) {
			e := newTestEngine(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: tpb, PoolTokens: tpb * 14}, opts)
			ref := newTestInstance(t, "tiny-gqa", InstanceConfig{TokensPerBlock: tpb, PoolTokens: tpb * 16})
			base := prompt("shared prefix of a dozen blocks' worth")
			var reqs []Request
			for i := range 16 {
				p := append(slices.Clone(base[:8+i%5*5]), prompt(fmt.Sprintf("#%d", i))[1:]...)
				if i%4 == 3 {
					p = prompt(fmt.Sprintf("filler %02d", i) + string(make([]byte, 60)))
				}
				reqs = append(reqs, Request{Prompt: p, MaxTokens: 5 + i%4, IgnoreEOS: true})
			}
			var streams []*Stream
			for _, r := range reqs {
				streams = append(streams, submit(t, e, context.Background(), r))
			}
			for i, s := range streams {
				res := waitResult(t, s)
				want := generate(t, ref, reqs[i].Prompt, reqs[i].MaxTokens, 0, 0)
				if res.Final.Err != nil || !slices.Equal(res.Tokens, want.tokens) {
					t.Errorf("request %d (%d cached): %v (%v), lone without reuse %v", i, res.Final.Usage.CachedTokens, res.Tokens, res.Final.Err, want.tokens)
				}
			}
			st := waitStatsGet(t, e, func(st Stats) bool { return st.PromptTokens > 0 && st.Waiting == 0 && st.Running == 0 })
			if st.CachedTokens == 0 || st.BlocksEvicted == 0 {
				t.Errorf("stats %+v: want prefix hits and evictions", st)
			}
			checkPoolsWhole(t, e)
		})
	}
}

// waitStatsGet is waitStats returning the stats that satisfied ok.
func waitStatsGet(t testing.TB, e *Engine, ok func(Stats) bool) Stats {
	t.Helper()
	waitStats(t, e, ok)
	return e.Stats()
}

// TestReusePoisonedPromptRefused is the hostile case of reuse-aware
// transfer: a client that holds a context request's opaque state (prompt
// A) sends a generation_only request with another prompt B of the same
// length. Were the pull served, the generation instance would publish A's
// KV under B's hashes and hand it to every later request starting with B.
// The context side refuses the pull (the prompt digests differ), nothing is
// published under B, and B's own disaggregated request then gives exactly
// the aggregated tokens.
func TestReusePoisonedPromptRefused(t *testing.T) {
	cfg := InstanceConfig{TokensPerBlock: 8, DType: kvcache.BF16, PoolTokens: 8 * 48}
	prefillE := newReuseDisaggEngine(t, "tiny-gqa", cfg, reuseOpts)
	genE := newReuseDisaggEngine(t, "tiny-gqa", cfg, reuseOpts)
	a := prompt("The secret plan is to meet at dawn by the old mill.")
	b := prompt("The public plan is to meet at noon by the old mill.")
	if len(a) != len(b) || slices.Equal(a, b) {
		t.Fatalf("prompts of %d and %d tokens: want the same length, other tokens", len(a), len(b))
	}
	cs, err := prefillE.Submit(context.Background(), Request{Type: transceiver.ContextOnly, Prompt: a, MaxTokens: 4, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	ctxA := cs.Wait().Final
	if ctxA.ContextPhase == nil {
		t.Fatalf("context_only: %v", ctxA.Err)
	}
	gs, err := genE.Submit(context.Background(), Request{Type: transceiver.GenerationOnly, Prompt: b, MaxTokens: 4, IgnoreEOS: true, ContextPhase: ctxA.ContextPhase})
	if err != nil {
		t.Fatal(err)
	}
	bad := gs.Wait().Final
	if bad.Err == nil || !strings.Contains(bad.Err.Error(), "prompt is not context request") {
		t.Fatalf("generation_only with another prompt: finish %q, err %v; want the pull refused for its prompt", bad.FinishReason, bad.Err)
	}
	if c := genE.CachedPrefix(b); c != 0 {
		t.Fatalf("%d tokens of prompt B cached on the generation instance after the refused pull", c)
	}
	want := waitResult(t, submit(t, genE, context.Background(), Request{Prompt: b, MaxTokens: 4, IgnoreEOS: true}))
	_, got := disaggregate(t, prefillE, genE, Request{Prompt: b, MaxTokens: 4, IgnoreEOS: true})
	if got.Final.Err != nil || !slices.Equal(got.Tokens, want.Tokens) {
		t.Fatalf("prompt B disaggregated: %v %v, aggregated %v", got.Tokens, got.Final.Err, want.Tokens)
	}
	// The context request A is still held for its rightful owner (a
	// refused pull does not end it), until its deadline or a cancel.
	if !prefillE.CancelContext(ctxA.ContextPhase.CtxRequestID) {
		t.Errorf("context request A was not held after the refused pull")
	}
	waitPoolsFree(t, prefillE)
	waitPoolsFree(t, genE)
}

// TestReusePrefillBudgetCountsComputedTokens: the per-iteration prefill
// budget (MaxPrefillTokens) counts the tokens a request computes, not its
// cached prefix: two prompts whose first blocks are cached are prefilled
// in one iteration under a budget that holds one whole prompt, and an
// uncached prompt of the same length behind them waits for the next.
func TestReusePrefillBudgetCountsComputedTokens(t *testing.T) {
	const tpb = 16
	in, err := NewInstance(testModel(t, "tiny-gqa"), InstanceConfig{TokensPerBlock: tpb, PoolTokens: 1024})
	if err != nil {
		t.Fatal(err)
	}
	P := 4*tpb + 1
	opts := Options{BlockReuse: true, MaxPrefillTokens: P + 1}
	e, err := New(in, opts)
	if err != nil {
		in.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	base := make([]int32, P)
	for i := range base {
		base[i] = int32(1 + i%50)
	}
	// Publish base's first four blocks.
	if _, cached := reuseRun(t, e, base, 1); cached != 0 {
		t.Fatalf("first run found %d tokens cached", cached)
	}
	mk := func(p []int32) *request {
		r, err := e.newRequest(t.Context(), Request{Type: transceiver.ContextAndGeneration, Prompt: p, MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	other := slices.Clone(base)
	other[P-1]++ // same cached prefix, another last token
	fresh := make([]int32, P)
	for i := range fresh {
		fresh[i] = int32(60 + i%50)
	}
	e.waiting = []*request{mk(base), mk(other), mk(fresh)}
	prefill := e.admit()
	for _, r := range prefill {
		defer r.seq.Release()
	}
	if len(prefill) != 2 {
		t.Fatalf("admitted %d requests for prefill, want 2 (the two cached ones; budget %d, prompts of %d tokens)", len(prefill), P+1, P)
	}
	for i, r := range prefill {
		if r.cached != 4*tpb {
			t.Errorf("request %d: %d tokens cached, want %d", i, r.cached, 4*tpb)
		}
	}
	if len(e.waiting) != 1 || e.waiting[0].prompt[0] != fresh[0] {
		t.Fatalf("waiting %d, want the uncached request only", len(e.waiting))
	}
}
