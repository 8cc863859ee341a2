package transceiver

import (
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// TestSenderFutureTimeout: the generation ranks ask, then stall (they have
// no staging buffer to announce a chunk in, their spans too small to
// receive into the blocks, so the sends wait for their chunk
// descriptors). The context request ends with ErrTimeout once
// kv_transfer_sender_future_timeout_ms has passed since the ask, not a
// moment before, long before kv_transfer_timeout_ms, its peer aborted and
// its blocks back in the pool. It runs in a synctest bubble
// (network_test.go).
func TestSenderFutureTimeout(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		sender := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.SenderFutureTimeoutMs = 300 }), 16, withNetwork(nw))
		gen := newInst(t, stagedGen(), testCfg(), 16, withNetwork(nw))
		stallReceives(t, gen)

		free := sender.pools[0].FreeBlocks()
		creq, _ := startSend(t, sender, 1, 16)
		greq := genReqFor(gen, t, creq, 4)
		if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
			t.Fatal(err)
		}
		// The ask arrives and the sends start with no time passing: the
		// sender timeout runs from now.
		synctest.Wait()
		if !moving(sender) {
			t.Fatal("the sends did not start")
		}
		time.Sleep(300*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if n := heldBy(sender, sideSend, creq.ID); n != 1 || creq.State() != DisaggContextTransInProgress {
			t.Fatalf("1ns before the sender timeout: held by %d ranks of 1, state %s (%v)", n, creq.State(), creq.Err())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if !ended(creq) || creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrTimeout) ||
			!strings.Contains(creq.Err().Error(), "kv_transfer_sender_future_timeout_ms=300") {
			t.Fatalf("at the sender timeout: ended %v, state %s, err %v; want the sender timeout", ended(creq), creq.State(), creq.Err())
		}
		if got := sender.pools[0].FreeBlocks(); got != free {
			t.Errorf("free blocks after the sender timeout: %d, want %d", got, free)
		}
		// The generation rank is told, at once.
		if !ended(greq) || greq.State() != DisaggTransError || !errors.Is(greq.Err(), ErrPeerAborted) {
			t.Errorf("gen: ended %v, state %s, err %v; want an abort from the context side", ended(greq), greq.State(), greq.Err())
		}
		gen.release(t, greq.Blocks)
	})
}

// TestSenderFutureTimeoutUnset: without the setting, the same stall lasts
// until kv_transfer_timeout_ms, from the context request's start.
func TestSenderFutureTimeoutUnset(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		sender := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 2000 }), 16, withNetwork(nw))
		gen := newInst(t, stagedGen(), testCfg(), 16, withNetwork(nw))
		stallReceives(t, gen)

		creq, _ := startSend(t, sender, 1, 16)
		time.Sleep(time.Second) // the pull comes late; the deadline runs from the start
		greq := genReqFor(gen, t, creq, 4)
		if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if !moving(sender) {
			t.Fatal("the sends did not start")
		}
		time.Sleep(time.Second - time.Nanosecond)
		synctest.Wait()
		if n := heldBy(sender, sideSend, creq.ID); n != 1 || ended(creq) {
			t.Fatalf("1ns before kv_transfer_timeout_ms: held by %d ranks of 1, ended %v (%v)", n, ended(creq), creq.Err())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if !ended(creq) || !errors.Is(creq.Err(), ErrTimeout) || strings.Contains(creq.Err().Error(), "sender_future") {
			t.Fatalf("at kv_transfer_timeout_ms: ended %v, err %v; want kv_transfer_timeout_ms's", ended(creq), creq.Err())
		}
		if !ended(greq) {
			t.Error("the generation request did not end with the context one")
		}
		gen.release(t, greq.Blocks)
	})
}

// stagedGen is a generation instance's state that receives the tests'
// context TP1 requests in chunks through its staging buffers: TP2, whose
// spans are too small to move directly or to receive into in place.
func stagedGen() layout.CacheState { return state(2, 2, 16, 4, kvcache.BF16, 2, 1, false) }

// stallReceives takes every receive staging buffer of in's ranks until the
// test ends: a staged receive that unpacks then announces no chunk.
func stallReceives(t *testing.T, in *inst) { t.Cleanup(takeRecvBuffers(in)) }
