package chaos

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/kvxfer/kvxfer/transport/faultinject"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

var (
	modelOnce sync.Once
	model     *engine.Model
	modelErr  error
)

func tinyModel(t *testing.T) *engine.Model {
	t.Helper()
	modelOnce.Do(func() {
		cfg, err := engine.Preset("tiny-gqa")
		if err != nil {
			modelErr = err
			return
		}
		model, modelErr = engine.NewModel(cfg)
	})
	if modelErr != nil {
		t.Fatal(modelErr)
	}
	return model
}

var instanceCfg = engine.InstanceConfig{TokensPerBlock: 8, PoolTokens: 2048}

// faultyEngine is an engine with a transceiver over tcp wrapped with
// faults (faulty+tcp; the plan comes from KVXFER_FAULTS, which the caller
// sets). Its closing is the
// caller's.
func faultyEngine(t *testing.T, tp int) *engine.Engine {
	t.Helper()
	ic := instanceCfg
	ic.TP = tp
	in, err := engine.NewInstance(tinyModel(t), ic)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.NewCacheTransceiver("tcp", in.TokensPerBlock(), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVTransferTimeoutMs = transferTimeoutMs
	cfg.MaxTokensInBuffer = 4 * in.TokensPerBlock() // staged in chunks: many Sends per request
	// The data plane is tcp, as the config says, wrapped with the plan in
	// KVXFER_FAULTS, as kvxfer built with -tags chaos wraps a worker's.
	wrap, err := faultinject.FromEnv(os.Getenv)
	if err != nil || wrap == nil {
		in.Close()
		t.Fatalf("the plan in %s: %v", faultinject.EnvPlan, err)
	}
	tr, err := transceiver.New(context.Background(), cfg, transceiver.Options{State: in.State(), Pools: in.Pools(), WrapDataPlane: wrap})
	if err != nil {
		in.Close()
		t.Fatal(err)
	}
	e, err := engine.New(in, engine.Options{Transceiver: tr})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func pinned(e *engine.Engine) int {
	n := 0
	for _, p := range e.Instance().Pools() {
		n += p.Stats().Pinned
	}
	return n
}

// transportRow is the figures of one data-plane plan.
type transportRow struct {
	plan                  string
	requests, ok, failed  int
	wrong, stranded       int
	worstFailure          time.Duration
	failedMsgs, wrongMsgs []string
	closeErrs             []string
}

// disagg runs req as the router does; it returns the generated tokens, or
// the error that ended it and whether that error is clear (an error value
// that says what failed).
func disagg(ctxE, genE *engine.Engine, req engine.Request) ([]int32, error, bool) {
	creq := req
	creq.Type = transceiver.ContextOnly
	cs, err := ctxE.Submit(context.Background(), creq)
	if err != nil {
		return nil, fmt.Errorf("context_only refused: %w", err), true
	}
	cr := cs.Wait()
	f := cr.Final
	if f.FinishReason == engine.FinishError {
		return nil, fmt.Errorf("context_only: %w", f.Err), f.Err != nil
	}
	if f.ContextPhase == nil {
		return nil, fmt.Errorf("context_only: finish %q without context params", f.FinishReason), false
	}
	greq := req
	greq.Type = transceiver.GenerationOnly
	greq.Prompt = f.PromptTokenIDs
	greq.ContextPhase = f.ContextPhase
	gs, err := genE.Submit(context.Background(), greq)
	if err != nil {
		return nil, fmt.Errorf("generation_only refused: %w", err), true
	}
	gr := gs.Wait()
	switch gr.Final.FinishReason {
	case engine.FinishLength:
		return gr.Tokens, nil, false
	case engine.FinishError:
		return nil, fmt.Errorf("generation_only: %w", gr.Final.Err), gr.Final.Err != nil
	}
	return nil, fmt.Errorf("generation_only: finish %q", gr.Final.FinishReason), false
}

// TestFaultyTransceiver: engines (context TP2 -> generation TP1) over the
// data plane faulty+tcp, one plan per fault kind. Every request ends with
// the aggregated tokens or a clear error; no block stays pinned past the
// transfer deadline; the engines close clean.
func TestFaultyTransceiver(t *testing.T) {
	n := 12
	if *long {
		n = 60
	}
	plans := []string{
		"seed=1",
		"seed=2;send:fail/20",
		"seed=3;expect:fail/10",
		"seed=4;send:truncate/20",
		"seed=5;expect:truncate/10",
		"seed=6;send:delay/2=30ms;expect:delay/3=10ms",
		"seed=7;send:reorder/2=40ms;expect:reorder/3=20ms",
	}
	tok := engine.Tokenizer{}
	r := newRng(*seedFlag + 99)
	var reqs []engine.Request
	for i := range n {
		nw := 4 + r.intn(30)
		ws := make([]string, nw)
		for j := range ws {
			ws[j] = words[r.intn(len(words))]
		}
		req := engine.Request{Prompt: tok.Encode(strings.Join(ws, " ")), MaxTokens: 6, IgnoreEOS: true}
		if i%2 == 1 {
			seed := r.next() % 1000
			req.Sampling = engine.Sampling{Temperature: 0.8, Seed: &seed}
		}
		reqs = append(reqs, req)
	}
	// The references, aggregated on one instance without a transceiver.
	in, err := engine.NewInstance(tinyModel(t), instanceCfg)
	if err != nil {
		t.Fatal(err)
	}
	agg, err := engine.New(in, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refs := make([][]int32, n)
	for i, req := range reqs {
		s, err := agg.Submit(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		res := s.Wait()
		if res.Final.Err != nil || len(res.Tokens) != req.MaxTokens {
			t.Fatalf("reference %d: %v, %d tokens", i, res.Final.Err, len(res.Tokens))
		}
		refs[i] = res.Tokens
	}
	if err := agg.Close(); err != nil {
		t.Fatal(err)
	}
	var rows []transportRow
	for _, plan := range plans {
		t.Setenv(faultinject.EnvPlan, plan)
		ctxE, genE := faultyEngine(t, 2), faultyEngine(t, 1)
		rw := transportRow{plan: plan, requests: n}
		var mu sync.Mutex
		var wg sync.WaitGroup
		sem := make(chan struct{}, 4)
		for i, req := range reqs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				start := time.Now()
				ids, err, clear := disagg(ctxE, genE, req)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && slices.Equal(ids, refs[i]):
					rw.ok++
				case err == nil:
					rw.wrong++
					rw.wrongMsgs = append(rw.wrongMsgs, fmt.Sprintf("request %d: %v, want %v", i, ids, refs[i]))
				case clear:
					rw.failed++
					rw.worstFailure = max(rw.worstFailure, time.Since(start))
					if len(rw.failedMsgs) < 2 {
						rw.failedMsgs = append(rw.failedMsgs, err.Error())
					}
				default:
					rw.wrong++
					rw.wrongMsgs = append(rw.wrongMsgs, fmt.Sprintf("request %d: unclear: %v", i, err))
				}
			}()
		}
		wg.Wait()
		deadline := time.Now().Add(transferTimeoutMs*time.Millisecond + 2*time.Second)
		for pinned(ctxE)+pinned(genE) > 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		rw.stranded = pinned(ctxE) + pinned(genE)
		for _, e := range []*engine.Engine{ctxE, genE} {
			if err := e.Close(); err != nil {
				rw.closeErrs = append(rw.closeErrs, err.Error())
			}
		}
		rows = append(rows, rw)
		t.Logf("%s: %d requests, %d bit-exact, %d failed clearly (worst after %v), %d wrong, %d stranded",
			plan, rw.requests, rw.ok, rw.failed, rw.worstFailure.Round(time.Millisecond), rw.wrong, rw.stranded)
		for _, m := range rw.failedMsgs {
			t.Logf("  e.g. %s", m)
		}
		for _, m := range rw.wrongMsgs {
			t.Errorf("%s: WRONG: %s", plan, m)
		}
		if rw.stranded != 0 {
			t.Errorf("%s: %d blocks pinned past the transfer deadline", plan, rw.stranded)
		}
		for _, m := range rw.closeErrs {
			t.Errorf("%s: close: %s", plan, m)
		}
		if plan == "seed=1" && rw.ok != n {
			t.Errorf("no faults, yet %d of %d requests failed", n-rw.ok, n)
		}
	}
	var b strings.Builder
	b.WriteString("| data-plane plan (faulty+tcp) | requests | completed bit-exact | failed with a clear error | wrong output | stranded blocks after the deadline | worst time to fail |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		wf := "–"
		if r.failed > 0 {
			wf = r.worstFailure.Round(time.Millisecond).String()
		}
		fmt.Fprintf(&b, "| `%s` | %d | %d | %d | %d | %d | %s |\n", r.plan, r.requests, r.ok, r.failed, r.wrong, r.stranded, wf)
	}
	t.Logf("figures:\n%s", b.String())
	appendTable(t, b.String())
}
