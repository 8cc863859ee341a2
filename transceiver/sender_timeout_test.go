package transceiver

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
)

// TestSenderFutureTimeout: the generation rank asks, then stalls (it has
// no staging buffer to announce a chunk in, so the send waits for its chunk
// descriptors). The context request ends with ErrTimeout once
// kv_transfer_sender_future_timeout_ms has passed since the ask, long
// before kv_transfer_timeout_ms, its peer aborted and its blocks back in
// the pool.
func TestSenderFutureTimeout(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	clk := newManualClock()
	sender := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.SenderFutureTimeoutMs = 300 }), 16, withClock(clk))
	gen := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), 16)
	stallReceives(t, gen)

	start := clk.Now()
	free := sender.pools[0].FreeBlocks()
	creq, _ := startSend(t, sender, 1, 16)
	greq := genReqFor(gen, t, creq, 4)
	if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
		t.Fatal(err)
	}
	// The sends start when the ask arrives (the clock has not moved): the
	// timer armed then is the sender timeout's.
	waitTimerAt(t, clk, start.Add(300*time.Millisecond))

	clk.Advance(299 * time.Millisecond)
	if n := heldBy(sender, sideSend, creq.ID); n != 1 || creq.State() != DisaggContextTransInProgress {
		t.Fatalf("1ms before the sender timeout: held by %d ranks of 1, state %s (%v)", n, creq.State(), creq.Err())
	}
	clk.Advance(time.Millisecond)
	waitDone(t, creq, 5*time.Second)
	if creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrTimeout) ||
		!strings.Contains(creq.Err().Error(), "kv_transfer_sender_future_timeout_ms=300") {
		t.Fatalf("state %s, err %v; want the sender timeout", creq.State(), creq.Err())
	}
	if got := sender.pools[0].FreeBlocks(); got != free {
		t.Errorf("free blocks after the sender timeout: %d, want %d", got, free)
	}
	// The generation rank is told.
	waitDone(t, greq, 5*time.Second)
	if greq.State() != DisaggTransError || !errors.Is(greq.Err(), ErrPeerAborted) {
		t.Errorf("gen: state %s, err %v; want an abort from the context side", greq.State(), greq.Err())
	}
	gen.release(t, greq.Blocks)
}

// TestSenderFutureTimeoutUnset: without the setting, the same stall lasts
// until kv_transfer_timeout_ms.
func TestSenderFutureTimeoutUnset(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	clk := newManualClock()
	sender := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 2000 }), 16, withClock(clk))
	gen := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), 16)
	stallReceives(t, gen)

	creq, _ := startSend(t, sender, 1, 16)
	greq := genReqFor(gen, t, creq, 4)
	if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
		t.Fatal(err)
	}
	waitMoving(t, sender)
	clk.Advance(1999 * time.Millisecond)
	if n := heldBy(sender, sideSend, creq.ID); n != 1 {
		t.Fatalf("1ms before kv_transfer_timeout_ms: held by %d ranks of 1 (%v)", n, creq.Err())
	}
	clk.Advance(time.Millisecond)
	waitDone(t, creq, 5*time.Second)
	if !errors.Is(creq.Err(), ErrTimeout) || strings.Contains(creq.Err().Error(), "sender_future") {
		t.Fatalf("err %v; want kv_transfer_timeout_ms's", creq.Err())
	}
	waitDone(t, greq, 5*time.Second)
	gen.release(t, greq.Blocks)
}

// stallReceives takes every receive staging buffer of in's rank 0 until
// the test ends: a staged receive then announces no chunk.
func stallReceives(t *testing.T, in *inst) {
	p := in.t.ranks[0].recvBufs
	var taken [][]byte
	for range p.count() {
		taken = append(taken, <-p.slots)
	}
	t.Cleanup(func() {
		for _, b := range taken {
			p.slots <- b
		}
	})
}

// waitTimerAt waits until clk has a timer armed for at.
func waitTimerAt(t *testing.T, clk *manualClock, at time.Time) {
	t.Helper()
	clk.WaitArmedAt(t, at)
}
