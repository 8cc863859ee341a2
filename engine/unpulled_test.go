package engine

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/transceiver"
)

// TestHostileUnpulledHold: a client of the context worker that fills its
// pool with context_only requests it never pulls (each held for
// kv_transfer_timeout_ms, 30 s here) does not hold up the next client for
// that long: once a request waits for blocks, held requests nobody has
// begun to pull are released, the oldest first, after
// ReleaseUnpulledAfter, one for one waiting request; the others stay
// pullable, bit-exact. (That a request whose pull has begun is not
// released rests on transceiver.Pulling: TestHostileStagingHold.)
func TestHostileUnpulledHold(t *testing.T) {
	icfg := InstanceConfig{TokensPerBlock: 16, PoolTokens: 16 * 16}
	timeout := func(ct *config.CacheTransceiver) { ct.KVTransferTimeoutMs = 30_000 }
	ctxE := newDisaggEngineOpts(t, "tiny-gqa", icfg, Options{ReleaseUnpulledAfter: 200 * time.Millisecond}, timeout)
	genE := newDisaggEngine(t, "tiny-gqa", icfg, timeout)
	long := func(seed int32) []int32 { // 4 blocks of 16 tokens
		p := make([]int32, 64)
		for i := range p {
			p[i] = 1 + (seed*31+int32(i))%200
		}
		return p
	}
	// Four held requests fill the pool of 16 blocks.
	var held []Result
	for i := range 4 {
		res := waitResult(t, submit(t, ctxE, context.Background(), Request{Type: transceiver.ContextOnly, Prompt: long(int32(i)), MaxTokens: 4}))
		if res.Final.ContextPhase == nil {
			t.Fatalf("context_only %d: %v", i, res.Final.Err)
		}
		held = append(held, res)
	}
	if free := ctxE.Instance().FreeBlocks(); free != 0 {
		t.Fatalf("%d blocks free with four held requests, want 0", free)
	}
	start := time.Now()
	next := waitResult(t, submit(t, ctxE, context.Background(), Request{Type: transceiver.ContextOnly, Prompt: long(9), MaxTokens: 4}))
	took := time.Since(start)
	if next.Final.ContextPhase == nil {
		t.Fatalf("the next client's request: %v", next.Final.Err)
	}
	if took > 10*time.Second {
		t.Errorf("the next client waited %v behind requests nobody pulls, want about ReleaseUnpulledAfter (200ms)", took)
	}
	st := statsWhen(ctxE, func(st Stats) bool { return st.UnpulledReleased >= 1 })
	if st.UnpulledReleased != 1 {
		t.Errorf("%d held requests released for one waiting request, want 1", st.UnpulledReleased)
	}
	// The oldest went first: its pull is refused; the newest is still
	// pullable, bit-exact.
	if gen := pull(t, genE, held[0]); gen.Final.FinishReason != FinishError {
		t.Errorf("the oldest held request, released, was still pulled: %q", gen.Final.FinishReason)
	}
	gen := pull(t, genE, held[3])
	agg := waitResult(t, submit(t, genE, context.Background(), Request{Prompt: long(3), MaxTokens: 4}))
	if gen.Final.FinishReason == FinishError || !slices.Equal(gen.Tokens, agg.Tokens) {
		t.Errorf("the newest held request pulled: %v %v, want the aggregated %v", gen.Final.Err, gen.Tokens, agg.Tokens)
	}
	t.Logf("next client admitted after %v", took)
}

// pull runs the generation phase of a context_only result on genE.
func pull(t *testing.T, genE *Engine, ctxRes Result) Result {
	t.Helper()
	f := ctxRes.Final
	return waitResult(t, submit(t, genE, context.Background(), Request{Type: transceiver.GenerationOnly, Prompt: f.PromptTokenIDs,
		ContextPhase: f.ContextPhase, MaxTokens: 4}))
}
