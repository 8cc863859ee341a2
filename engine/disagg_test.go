package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

// newDisaggEngine builds an engine with a TCP transceiver, closed at the
// end of the test (Close fails the test if blocks leaked).
func newDisaggEngine(t testing.TB, preset string, icfg InstanceConfig, mod ...func(*config.CacheTransceiver)) *Engine {
	t.Helper()
	return newDisaggEngineOpts(t, preset, icfg, Options{}, mod...)
}

// newDisaggEngineOpts is newDisaggEngine with engine options (the
// transceiver is set here).
func newDisaggEngineOpts(t testing.TB, preset string, icfg InstanceConfig, opts Options, mod ...func(*config.CacheTransceiver)) *Engine {
	t.Helper()
	in, err := NewInstance(testModel(t, preset), icfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.NewCacheTransceiver("tcp", in.TokensPerBlock(), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	// Small staging buffers (the default is 512 MB each): layouts that
	// differ stream through them in chunks.
	cfg.MaxTokensInBuffer = 4 * in.TokensPerBlock()
	for _, m := range mod {
		m(cfg)
	}
	tr, err := transceiver.New(context.Background(), cfg, transceiver.Options{State: in.State(), Pools: in.Pools()})
	if err != nil {
		in.Close()
		t.Fatal(err)
	}
	opts.Transceiver = tr
	e, err := New(in, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("engine close: %v", err)
		}
	})
	return e
}

// disaggregate runs req as the router does: context_only on prefillE, then
// generation_only on genE with the context response's params.
func disaggregate(t testing.TB, prefillE, genE *Engine, req Request) (prefillRes, genRes Result) {
	t.Helper()
	prefillRes, genRes, err := tryDisaggregate(prefillE, genE, req)
	if err != nil {
		t.Fatal(err)
	}
	return prefillRes, genRes
}

// tryDisaggregate is disaggregate for goroutines other than the test's.
func tryDisaggregate(prefillE, genE *Engine, req Request) (prefillRes, genRes Result, err error) {
	creq := req
	creq.Type = transceiver.ContextOnly
	cs, err := prefillE.Submit(context.Background(), creq)
	if err != nil {
		return prefillRes, genRes, fmt.Errorf("context_only: %w", err)
	}
	prefillRes = cs.Wait()
	f := prefillRes.Final
	if f.FinishReason != FinishNotFinished && f.FinishReason != FinishLength {
		return prefillRes, genRes, fmt.Errorf("context_only: finish %q (%v), want not_finished or length", f.FinishReason, f.Err)
	}
	if f.ContextPhase == nil || len(f.ContextPhase.FirstGenTokens) != 1 || len(prefillRes.Tokens) != 1 ||
		f.ContextPhase.FirstGenTokens[0] != prefillRes.Tokens[0] || f.State != transceiver.DisaggContextTransInProgress {
		return prefillRes, genRes, fmt.Errorf("context_only: tokens %v, state %v, params %+v", prefillRes.Tokens, f.State, f.ContextPhase)
	}
	greq := req
	greq.Type = transceiver.GenerationOnly
	greq.Prompt = f.PromptTokenIDs
	greq.ContextPhase = f.ContextPhase
	gs, err := genE.Submit(context.Background(), greq)
	if err != nil {
		return prefillRes, genRes, fmt.Errorf("generation_only: %w", err)
	}
	return prefillRes, gs.Wait(), nil
}

// TestDisaggEquivalence: context_only on one instance and generation_only
// on another, of a different layout, give exactly the tokens of
// context_and_generation on either.
func TestDisaggEquivalence(t *testing.T) {
	tests := []struct {
		name         string
		preset       string
		dt           kvcache.DType
		prefill, gen InstanceConfig
	}{
		{"GQA TP2 to TP1", "tiny-gqa", kvcache.BF16, InstanceConfig{TP: 2}, InstanceConfig{}},
		{"GQA TP2 to PP2", "tiny-gqa", kvcache.BF16, InstanceConfig{TP: 2}, InstanceConfig{PP: 2}},
		{"GQA fp8 TP1 to TP2 PP2", "tiny-gqa", kvcache.FP8E4M3, InstanceConfig{}, InstanceConfig{TP: 2, PP: 2}},
		{"duplicated heads TP4 to TP1", "tiny-gqa2", kvcache.BF16, InstanceConfig{TP: 4}, InstanceConfig{}},
		{"duplicated heads TP1 to TP4 PP2", "tiny-gqa2", kvcache.FP16, InstanceConfig{}, InstanceConfig{TP: 4, PP: 2}},
		{"MLA TP2 to TP1 PP2", "tiny-mla", kvcache.BF16, InstanceConfig{TP: 2}, InstanceConfig{PP: 2}},
		{"MLA TP4 PP2 to TP2", "tiny-mla", kvcache.FP8E4M3, InstanceConfig{TP: 4, PP: 2}, InstanceConfig{TP: 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, c := range []*InstanceConfig{&tc.prefill, &tc.gen} {
				c.TokensPerBlock, c.DType, c.PoolTokens = 8, tc.dt, 512
			}
			prefillE := newDisaggEngine(t, tc.preset, tc.prefill)
			genE := newDisaggEngine(t, tc.preset, tc.gen)
			seed := uint64(7)
			reqs := []Request{
				{Prompt: prompt("Greedy path"), MaxTokens: 10, IgnoreEOS: true}, // 12 tokens: a partial last block
				{Prompt: prompt("Sampled 0.8"), MaxTokens: 8, IgnoreEOS: true, Sampling: Sampling{Temperature: 0.8, Seed: &seed}},
				{Prompt: prompt("Two full blocks"), MaxTokens: 9, IgnoreEOS: true}, // 16 tokens: full blocks only
			}
			for i, req := range reqs {
				agg := waitResult(t, submit(t, genE, context.Background(), req))
				aggCtx := waitResult(t, submit(t, prefillE, context.Background(), req))
				_, gen := disaggregate(t, prefillE, genE, req)
				if gen.Final.Err != nil || gen.Final.FinishReason != agg.Final.FinishReason {
					t.Fatalf("request %d: generation_only %q: %v", i, gen.Final.FinishReason, gen.Final.Err)
				}
				if fmt.Sprint(gen.Tokens) != fmt.Sprint(agg.Tokens) || fmt.Sprint(aggCtx.Tokens) != fmt.Sprint(agg.Tokens) {
					t.Errorf("request %d: disaggregated %v, aggregated on the generation layout %v, on the context layout %v",
						i, gen.Tokens, agg.Tokens, aggCtx.Tokens)
				}
				if gen.Text != agg.Text {
					t.Errorf("request %d: text %q, aggregated %q", i, gen.Text, agg.Text)
				}
				ft := gen.Final.Timing
				if ft.KVTransfer <= 0 || ft.TransferBytes <= 0 || gen.Final.State != transceiver.GenerationComplete {
					t.Errorf("request %d: timing %+v state %v", i, ft, gen.Final.State)
				}
				// Every block of the prompt was asked for, and what moved is
				// at least those blocks' bytes (this engine does not reuse).
				var bb int64
				for _, p := range genE.Pools() {
					bb += p.BlockBytes()
				}
				if wantBlocks := (len(req.Prompt) + 7) / 8; ft.TransferBlocks != wantBlocks || ft.BlockBytes != bb {
					t.Errorf("request %d: transfer blocks %d × %d B, want %d × %d B", i, ft.TransferBlocks, ft.BlockBytes, wantBlocks, bb)
				}
			}
			waitPoolsFree(t, prefillE)
			waitPoolsFree(t, genE)
		})
	}
}

// TestDisaggConcurrent keeps 32 disaggregated requests in flight at once
// (context TP2 → generation TP1, more requests than the generation pool
// holds at once) and checks each against a lone aggregated run.
func TestDisaggConcurrent(t *testing.T) {
	const n = 32
	prefillE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 2048})
	genE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 8 * 48}) // 16 requests at a time: the rest queue for blocks
	ref := newTestInstance(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
	type out struct {
		tokens []int32
		err    error
	}
	results := make([]out, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			p := prompt(fmt.Sprintf("request %02d", i))
			_, gen, err := tryDisaggregate(prefillE, genE, Request{Prompt: p, MaxTokens: 4 + i%5, IgnoreEOS: true})
			if err == nil {
				err = gen.Final.Err
			}
			results[i] = out{gen.Tokens, err}
		})
	}
	wg.Wait()
	for i, r := range results {
		want := generate(t, ref, prompt(fmt.Sprintf("request %02d", i)), 4+i%5, 0, 0)
		if r.err != nil || fmt.Sprint(r.tokens) != fmt.Sprint(want.tokens) {
			t.Errorf("request %d: %v (%v), want %v", i, r.tokens, r.err, want.tokens)
		}
	}
	waitPoolsFree(t, prefillE)
	waitPoolsFree(t, genE)
}

// TestDisaggFailures: a generation request whose context side is gone
// ends with a clear error and gives its blocks back.
func TestDisaggFailures(t *testing.T) {
	icfg := InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 256}
	req := Request{Prompt: prompt("the context side went away"), MaxTokens: 8, IgnoreEOS: true}
	contextOnly := func(t *testing.T, e *Engine) Result {
		r := req
		r.Type = transceiver.ContextOnly
		return waitResult(t, submit(t, e, context.Background(), r))
	}
	generationOnly := func(t *testing.T, e *Engine, c Result) Result {
		r := req
		r.Type, r.Prompt, r.ContextPhase = transceiver.GenerationOnly, c.Final.PromptTokenIDs, c.Final.ContextPhase
		return waitResult(t, submit(t, e, context.Background(), r))
	}
	t.Run("expired", func(t *testing.T) {
		prefillE := newDisaggEngine(t, "tiny-gqa", icfg, func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 100 })
		genE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
		c := contextOnly(t, prefillE)
		waitPoolsFree(t, prefillE) // released at the deadline
		g := generationOnly(t, genE, c)
		f := g.Final
		if f.FinishReason != FinishError || !errors.Is(f.Err, ErrTransfer) || !errors.Is(f.Err, transceiver.ErrRefused) ||
			f.State != transceiver.DisaggTransError || len(g.Tokens) != 0 {
			t.Fatalf("generation after the context deadline: %q %v %v, %d tokens", f.FinishReason, f.Err, f.State, len(g.Tokens))
		}
		if msg := f.Err.Error(); !strings.Contains(msg, fmt.Sprint("context request ", c.Final.ContextPhase.CtxRequestID)) {
			t.Errorf("error does not name the context request: %v", msg)
		}
		checkPoolsFree(t, genE.Instance())
	})
	t.Run("context cancelled", func(t *testing.T) {
		prefillE := newDisaggEngine(t, "tiny-gqa2", icfg)
		genE := newDisaggEngine(t, "tiny-gqa2", InstanceConfig{TP: 4, TokensPerBlock: 8, PoolTokens: 256})
		c := contextOnly(t, prefillE)
		id := c.Final.ContextPhase.CtxRequestID
		if !prefillE.CancelContext(id) {
			t.Fatal("CancelContext of a held request returned false")
		}
		waitPoolsFree(t, prefillE)
		if prefillE.CancelContext(id) {
			t.Error("second CancelContext returned true")
		}
		g := generationOnly(t, genE, c)
		if !errors.Is(g.Final.Err, ErrTransfer) || !errors.Is(g.Final.Err, transceiver.ErrRefused) {
			t.Fatalf("generation after the context side was cancelled: %q %v", g.Final.FinishReason, g.Final.Err)
		}
		checkPoolsFree(t, genE.Instance())
	})
	t.Run("context instance closed", func(t *testing.T) {
		prefillE := newDisaggEngine(t, "tiny-mla", icfg)
		genE := newDisaggEngine(t, "tiny-mla", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
		c := contextOnly(t, prefillE)
		if err := prefillE.Close(); err != nil {
			t.Fatal(err)
		}
		g := generationOnly(t, genE, c)
		if !errors.Is(g.Final.Err, ErrTransfer) || g.Final.FinishReason != FinishError {
			t.Fatalf("generation from a closed context instance: %q %v", g.Final.FinishReason, g.Final.Err)
		}
		checkPoolsFree(t, genE.Instance())
	})
	t.Run("cancel during transfer", func(t *testing.T) {
		genE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
		// A context "instance" that accepts and never answers: the pull
		// hangs until the client cancels.
		op := transceiver.OpaqueState{RequestID: 1, State: genE.State(), Endpoints: []string{silentListener(t)}}
		enc, err := op.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s := submit(t, genE, ctx, Request{Type: transceiver.GenerationOnly, Prompt: prompt("hang"), MaxTokens: 4,
			ContextPhase: &transceiver.ContextPhaseParams{CtxRequestID: 1, FirstGenTokens: []int32{'a'}, OpaqueState: enc}})
		for deadline := time.Now().Add(10 * time.Second); genE.Stats().Transferring == 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the transfer never started")
			}
		}
		if free := genE.Instance().FreeBlocks(); free == genE.Instance().NumBlocks() {
			t.Error("no blocks held during the transfer")
		}
		start := time.Now()
		cancel()
		res := waitResult(t, s)
		if !errors.Is(res.Final.Err, context.Canceled) || len(res.Tokens) != 0 {
			t.Fatalf("cancelled transfer: %d tokens, %+v", len(res.Tokens), res.Final)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the cancel took %v", d)
		}
		checkPoolsFree(t, genE.Instance())
	})
	t.Run("bad opaque state", func(t *testing.T) {
		genE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
		_, err := genE.Submit(context.Background(), Request{Type: transceiver.GenerationOnly, Prompt: prompt("x"),
			ContextPhase: &transceiver.ContextPhaseParams{FirstGenTokens: []int32{'a'}, OpaqueState: []byte("garbage")}})
		if !errors.Is(err, ErrBadRequest) || !errors.Is(err, transceiver.ErrBadOpaqueState) {
			t.Errorf("bad opaque state: %v", err)
		}
	})
}

// silentListener accepts connections and never writes: a peer that hangs.
func silentListener(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	return ln.Addr().String()
}
