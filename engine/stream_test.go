package engine

import (
	"context"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"
)

// TestStreamEvents checks Stream against a slice: a producer pushes events
// with pauses, and a reader that breaks out of Events at random and comes
// back reads every event once, in order, ending after the final one.
func TestStreamEvents(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 7))
		n := r.IntN(300)
		s := newStream()
		go func() {
			pr := rand.New(rand.NewPCG(seed, 8))
			for i := range n {
				s.push(Event{Token: int32(i), Text: string(rune('a' + i%26))})
				if pr.IntN(8) == 0 {
					time.Sleep(time.Duration(pr.IntN(200)) * time.Microsecond)
				}
			}
			s.push(Event{Token: NoToken, Final: &Final{FinishReason: FinishLength}})
		}()
		var got []Event
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				for ev := range s.Events() {
					got = append(got, ev)
					if ev.Final == nil && r.IntN(10) == 0 {
						break
					}
				}
				if len(got) > 0 && got[len(got)-1].Final != nil {
					// Another loop yields nothing and ends.
					for ev := range s.Events() {
						t.Errorf("seed %d: an event after the final one: %+v", seed, ev)
					}
					return
				}
			}
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("seed %d: the reader did not reach the final event", seed)
		}
		if len(got) != n+1 {
			t.Fatalf("seed %d: read %d events, want %d", seed, len(got), n+1)
		}
		for i, ev := range got[:n] {
			if ev.Token != int32(i) || ev.Final != nil {
				t.Fatalf("seed %d: event %d is %+v", seed, i, ev)
			}
		}
		if got[n].Final == nil {
			t.Fatalf("seed %d: the last event is not final", seed)
		}
	}
}

// TestQueuedRequestHoldsNoEventBuffer: a request's output took a channel
// of max_tokens+1 events from Submit on, 512 KiB at max_tokens 16000,
// whether it ran or waited in the queue: a thousand such requests in the
// queue held 735 MiB. A request now allocates for its events as it makes
// them.
func TestQueuedRequestHoldsNoEventBuffer(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 16, PoolTokens: 16384}, Options{})
	const n = 50
	reqs := make([]*request, 0, n)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		r, err := e.newRequest(context.Background(), Request{Prompt: []int32{1, 2, 3}, MaxTokens: 16000})
		if err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / n
	t.Logf("a request of max_tokens 16000 allocated %d bytes before it ran", per)
	if per > 32<<10 {
		t.Errorf("a request of max_tokens 16000 allocated %d KiB before it ran, want at most 32", per>>10)
	}
	runtime.KeepAlive(reqs)
}
