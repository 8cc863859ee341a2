package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transceiver"
)

// TestPrefillStopsOnCancel: a client that goes away during a long
// context_only prefill stops it (the model stops part-way through a layer, the
// request is never handed to the transceiver) and its blocks are back
// soon (well within 10 s, tens of milliseconds when quiet), not at
// kv_transfer_timeout_ms.
func TestPrefillStopsOnCancel(t *testing.T) {
	e := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 16, PoolTokens: 8192})
	total := e.Instance().FreeBlocks()
	long := make([]int32, 6000)
	for i := range long {
		long[i] = int32(1 + i%200)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := submit(t, e, ctx, Request{Type: transceiver.ContextOnly, Prompt: long, MaxTokens: 4})
	deadline := time.Now().Add(10 * time.Second)
	for e.Instance().FreeBlocks() == total { // admitted: its blocks are reserved, the prefill runs
		if time.Now().After(deadline) {
			t.Fatal("the request was never admitted")
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	cancelled := time.Now()
	cancel()
	for e.Instance().FreeBlocks() != total {
		// Far below kv_transfer_timeout_ms; that the prefill stopped
		// part-way, not ran to the end, the stats below assert.
		if time.Since(cancelled) > 10*time.Second {
			t.Fatalf("blocks not back 10s after the client went away: %d of %d free", e.Instance().FreeBlocks(), total)
		}
		time.Sleep(time.Millisecond)
	}
	back := time.Since(cancelled)
	res := waitResult(t, s)
	if res.Final.FinishReason != FinishError || !errors.Is(res.Final.Err, context.Canceled) || res.Final.ContextPhase != nil {
		t.Fatalf("cancelled prefill ended %q %v (context phase %v), want an error wrapping context.Canceled and no handover",
			res.Final.FinishReason, res.Final.Err, res.Final.ContextPhase)
	}
	st := statsWhen(e, func(st Stats) bool { return st.PrefillsStopped > 0 })
	if st.PrefillsStopped != 1 || st.PrefillTokens != 0 {
		t.Fatalf("stats after a stopped prefill: %d stopped, %d tokens prefilled; want 1 stopped and 0 tokens", st.PrefillsStopped, st.PrefillTokens)
	}
	t.Logf("blocks back %v after the cancel", back)
	// The engine still serves.
	ok := waitResult(t, submit(t, e, context.Background(), Request{Prompt: prompt("hello"), MaxTokens: 2}))
	if ok.Final.FinishReason == FinishError {
		t.Fatalf("request after the cancel: %v", ok.Final.Err)
	}
	if st := statsWhen(e, func(st Stats) bool { return st.PrefillTokens > 0 }); st.PrefillTokens != uint64(len(prompt("hello"))) {
		t.Errorf("PrefillTokens = %d after one %d-token prompt", st.PrefillTokens, len(prompt("hello")))
	}
}

// statsWhen returns the engine's stats once cond holds of them (the
// scheduler publishes them after its step), or after a second.
func statsWhen(e *Engine, cond func(Stats) bool) Stats {
	deadline := time.Now().Add(time.Second)
	for {
		st := e.Stats()
		if cond(st) || time.Now().After(deadline) {
			return st
		}
		time.Sleep(time.Millisecond)
	}
}
