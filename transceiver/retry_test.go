package transceiver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/mover"
	"github.com/kvxfer/kvxfer/transport"
)

// TestRetryAfterFailedPull: the first pull of a context request fails on
// the generation side (it is cancelled while the data moves). Only that
// generation request fails: every context rank abandons the attempt and
// keeps the blocks, and a second generation request with the same context
// phase params (opaque state) pulls them bit-exact. With duplicated heads
// (TP4 to TP1) half of the context ranks have nothing to send: their part
// of the first attempt is finished at once, and they keep their blocks
// until every rank has finished the same attempt.
func TestRetryAfterFailedPull(t *testing.T) {
	tests := []struct {
		name        string
		sender, gen layout.CacheState
	}{
		{"TP2 to TP1", state(4, 8, 64, 16, kvcache.BF16, 2, 1, false), state(4, 8, 64, 16, kvcache.BF16, 1, 1, false)},
		{"duplicated heads TP4 to TP1", state(4, 2, 128, 16, kvcache.BF16, 4, 1, false), state(4, 2, 128, 16, kvcache.BF16, 1, 1, false)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			const blocks = 32
			sender := newInst(t, tc.sender, testCfg(), blocks+8)
			gen := newInst(t, tc.gen, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), blocks+8)
			ranks := tc.sender.Parallel.NumRanks()
			free := sender.pools[0].FreeBlocks()
			creq, l := startSend(t, sender, 1, blocks*16)

			// The generation rank has no staging buffer: the first pull
			// stalls once every context rank has started its sends.
			giveBack := takeRecvBuffers(gen)
			greq := genReqFor(gen, t, creq, blocks)
			if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
				t.Fatal(err)
			}
			waitSendPhase(t, sender, creq.ID, phaseMoving, phaseSent)
			if !gen.t.Cancel(greq) {
				t.Fatal("Cancel of the stalled pull returned false")
			}
			waitDone(t, greq, 5*time.Second)
			if greq.State() != DisaggTransError || !errors.Is(greq.Err(), ErrCanceled) {
				t.Fatalf("first generation request: %s %v", greq.State(), greq.Err())
			}
			gen.release(t, greq.Blocks)
			giveBack()

			// The context request is still held, on every rank, waiting
			// for the next attempt.
			waitSendPhase(t, sender, creq.ID, phaseWaiting)
			if n := heldBy(sender, sideSend, creq.ID); n != ranks {
				t.Fatalf("after the failed attempt: held by %d ranks of %d", n, ranks)
			}
			if creq.State() != DisaggContextTransInProgress || creq.Err() != nil {
				t.Fatalf("context request after the failed attempt: %s %v", creq.State(), creq.Err())
			}
			if got := sender.pools[0].FreeBlocks(); got != free-blocks {
				t.Fatalf("free blocks after the failed attempt: %d, want %d (the request's blocks held)", got, free-blocks)
			}
			waitFor(t, 5*time.Second, "the given-up sends' staging buffers back", func() bool {
				send, _ := sender.t.StagingBytesInUse()
				return send == 0
			})
			if got, err := sender.t.CheckContextTransferStatus(context.Background(), 0); err != nil || len(got) != 0 {
				t.Fatalf("CheckContextTransferStatus after the failed attempt: %v %v", got, err)
			}
			if n := sender.t.PendingContext(); n != 1 {
				t.Fatalf("PendingContext %d, want 1", n)
			}

			// The owner retries with the same opaque state.
			retry := genReqFor(gen, t, creq, blocks)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := gen.t.RequestAndReceiveSync(ctx, retry); err != nil {
				t.Fatalf("retry: %v", err)
			}
			gen.verify(t, l, 0, retry.Blocks)
			gen.release(t, retry.Blocks)
			waitDone(t, creq, 10*time.Second)
			if creq.State() != DisaggContextComplete || creq.Err() != nil {
				t.Fatalf("context request after the retry: %s %v", creq.State(), creq.Err())
			}
			if got, err := sender.t.CheckContextTransferStatus(ctx, 1); err != nil || len(got) != 1 || got[0] != creq {
				t.Fatalf("CheckContextTransferStatus: %v %v", got, err)
			}
			for r, p := range sender.pools {
				if got := p.FreeBlocks(); got != free {
					t.Errorf("rank %d: %d free blocks after the retry, want %d", r, got, free)
				}
			}
			// Pulled: a third pull is refused as unknown.
			again := genReqFor(gen, t, creq, blocks)
			if err := gen.t.RequestAndReceiveSync(ctx, again); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "unknown id or wrong token") {
				t.Fatalf("pull after completion: %v", err)
			}
			gen.release(t, again.Blocks)
		})
	}
}

// TestRetryAfterSendLostOnOneRank: the defect of issue #13 as it was
// seen: a pull fails on one context rank only (its send reports the loss
// of the data connection, injected here), and the generation request
// fails. The other context rank does not cancel the request: every rank
// gives the attempt up, keeping the blocks (a rank whose send had finished
// among them), and the owner's second pull with the same opaque state
// succeeds bit-exact.
func TestRetryAfterSendLostOnOneRank(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 2, 1, false)
	gs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, cs, testCfg(), 64)
	gen := newInst(t, gs, testCfg(), 64)
	lossy := injectSendLoss(sender.t.ranks[0], 1)
	free := sender.pools[0].FreeBlocks()
	const tokens = 150
	nb := layout.NumBlocks(tokens, cs.Shape.TokensPerBlock)
	creq, l := startSend(t, sender, 1, tokens)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	greq := genReqFor(gen, t, creq, nb)
	err := gen.t.RequestAndReceiveSync(ctx, greq)
	// Told by an abort (context rank 1 aborts the generation rank's ask
	// too when it hears of the failed attempt first), never refused.
	if err == nil || !errors.Is(err, ErrPeerAborted) {
		t.Fatalf("first pull: %v, want it failed by the context side's abort", err)
	}
	if lossy.failed.Load() != 1 {
		t.Fatalf("%d sends failed, want the one injected", lossy.failed.Load())
	}
	gen.release(t, greq.Blocks)

	waitSendPhase(t, sender, creq.ID, phaseWaiting)
	if creq.State() != DisaggContextTransInProgress {
		t.Fatalf("context request after the failed pull: %s %v", creq.State(), creq.Err())
	}
	waitFor(t, 5*time.Second, "the given-up sends' staging buffers back", func() bool {
		send, _ := sender.t.StagingBytesInUse()
		return send == 0
	})
	for r, p := range sender.pools {
		if got := p.FreeBlocks(); got != free-nb {
			t.Fatalf("rank %d: %d free blocks after the failed pull, want %d (the request's held)", r, got, free-nb)
		}
	}

	retry := genReqFor(gen, t, creq, nb)
	if err := gen.t.RequestAndReceiveSync(ctx, retry); err != nil {
		t.Fatalf("retry: %v", err)
	}
	gen.verify(t, l, 0, retry.Blocks)
	gen.release(t, retry.Blocks)
	waitDone(t, creq, 10*time.Second)
	if creq.State() != DisaggContextComplete || creq.Err() != nil {
		t.Fatalf("context request after the retry: %s %v", creq.State(), creq.Err())
	}
	for r, p := range sender.pools {
		if got := p.FreeBlocks(); got != free {
			t.Errorf("rank %d: %d free blocks after the retry, want %d", r, got, free)
		}
	}
}

// TestPullAttemptBound: a pull that keeps failing (every send of context
// rank 0 reports the loss of its peer) fails the context request at the
// maxPullAttempts-th failure, its blocks released on every rank; the next
// pull is refused as unknown.
func TestPullAttemptBound(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 2, 1, false)
	gs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, cs, testCfg(), 64)
	gen := newInst(t, gs, testCfg(), 64)
	injectSendLoss(sender.t.ranks[0], 1000)
	free := sender.pools[0].FreeBlocks()
	creq, _ := startSend(t, sender, 1, 40)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := range maxPullAttempts {
		if i > 0 {
			waitSendPhase(t, sender, creq.ID, phaseWaiting)
		}
		greq := genReqFor(gen, t, creq, 10)
		if err := gen.t.RequestAndReceiveSync(ctx, greq); err == nil {
			t.Fatalf("pull %d succeeded", i+1)
		}
		gen.release(t, greq.Blocks)
	}
	waitDone(t, creq, 10*time.Second)
	if creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrTooManyAttempts) {
		t.Fatalf("context request after %d failed pulls: %s %v", maxPullAttempts, creq.State(), creq.Err())
	}
	for r, p := range sender.pools {
		if got := p.FreeBlocks(); got != free {
			t.Errorf("rank %d: %d free blocks, want %d", r, got, free)
		}
	}
	last := genReqFor(gen, t, creq, 10)
	if err := gen.t.RequestAndReceiveSync(ctx, last); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "unknown id or wrong token") {
		t.Fatalf("pull after the bound: %v", err)
	}
	gen.release(t, last.Blocks)
}

// TestRetryWithSecret: with a cluster secret, the generation instance that
// accepted a signed state for a pull that failed takes it again for the
// retry; once a pull of it completed, or was refused by the context side,
// it refuses the state as replayed before dialling anything.
func TestRetryWithSecret(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 2, 1, false)
	gs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	clk := &fakeClock{}
	sender := newInst(t, cs, testCfg(), 64, withSecret(testSecret, clk))
	gen := newInst(t, gs, testCfg(), 64, withSecret(testSecret, clk))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	lossy := injectSendLoss(sender.t.ranks[0], 1)
	creq, l := startSend(t, sender, 1, 40)
	first := genReqFor(gen, t, creq, 10)
	if err := gen.t.RequestAndReceiveSync(ctx, first); err == nil || errors.Is(err, ErrReplayedOpaqueState) {
		t.Fatalf("first pull: %v, want a failure of the pull", err)
	}
	gen.release(t, first.Blocks)
	if lossy.failed.Load() != 1 {
		t.Fatalf("%d sends failed, want 1", lossy.failed.Load())
	}
	waitSendPhase(t, sender, creq.ID, phaseWaiting)
	retry := genReqFor(gen, t, creq, 10)
	if err := gen.t.RequestAndReceiveSync(ctx, retry); err != nil {
		t.Fatalf("retry of the signed state on the same instance: %v", err)
	}
	gen.verify(t, l, 0, retry.Blocks)
	gen.release(t, retry.Blocks)
	refusedBeforeDial(t, gen, creq.ContextPhase.OpaqueState, ErrReplayedOpaqueState)

	// Refused by the context side (cancelled there): the state is spent.
	gone, _ := startSend(t, sender, 2, 40)
	sender.t.Cancel(gone)
	waitDone(t, gone, 5*time.Second)
	refused := genReqFor(gen, t, gone, 10)
	if err := gen.t.RequestAndReceiveSync(ctx, refused); !errors.Is(err, ErrRefused) {
		t.Fatalf("pull of a cancelled request: %v", err)
	}
	gen.release(t, refused.Blocks)
	refusedBeforeDial(t, gen, gone.ContextPhase.OpaqueState, ErrReplayedOpaqueState)
	if n := gen.t.guard.nonces(); n != 2 {
		t.Errorf("%d nonces remembered, want 2", n)
	}
}

// lossySend is a rank's data plane whose first sends fail with the loss of
// the peer.
type lossySend struct {
	transport.Transport
	left, failed atomic.Int32
}

func (l *lossySend) Send(ctx context.Context, d transport.Descriptor, src [][]byte) error {
	if l.left.Add(-1) >= 0 {
		l.failed.Add(1)
		return fmt.Errorf("test: %w: injected loss of the data connection", transport.ErrPeerLost)
	}
	return l.Transport.Send(ctx, d, src)
}

// injectSendLoss makes the first n sends of rank r fail with the loss of
// the peer.
func injectSendLoss(r *rank, n int) *lossySend {
	r.mu.Lock()
	defer r.mu.Unlock()
	l := &lossySend{Transport: r.transports["tcp"]}
	l.left.Store(int32(n))
	r.transports["tcp"] = l
	return l
}

// TestContextFailureAfterFailedPull: after a failed attempt the request
// waits; a failure of the context side's own (here a cancel) still ends
// it at once, blocks released, and the owner's retry is refused as unknown.
func TestContextFailureAfterFailedPull(t *testing.T) {
	cs := state(4, 8, 64, 16, kvcache.BF16, 2, 1, false)
	gs := state(4, 8, 64, 16, kvcache.BF16, 1, 1, false)
	const blocks = 32
	sender := newInst(t, cs, testCfg(), blocks+8)
	gen := newInst(t, gs, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), blocks+8)
	free := sender.pools[0].FreeBlocks()
	creq, _ := startSend(t, sender, 1, blocks*16)
	giveBack := takeRecvBuffers(gen)
	greq := genReqFor(gen, t, creq, blocks)
	if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
		t.Fatal(err)
	}
	waitSendPhase(t, sender, creq.ID, phaseMoving)
	if !gen.t.Cancel(greq) {
		t.Fatal("Cancel of the stalled pull returned false")
	}
	waitDone(t, greq, 5*time.Second)
	gen.release(t, greq.Blocks)
	giveBack()
	waitSendPhase(t, sender, creq.ID, phaseWaiting)

	if !sender.t.Cancel(creq) {
		t.Fatal("Cancel of the waiting context request returned false")
	}
	waitDone(t, creq, 5*time.Second)
	if creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrCanceled) {
		t.Fatalf("context request: %s %v", creq.State(), creq.Err())
	}
	if n := heldBy(sender, sideSend, creq.ID); n != 0 {
		t.Fatalf("held by %d ranks after the cancel", n)
	}
	for r, p := range sender.pools {
		if got := p.FreeBlocks(); got != free {
			t.Errorf("rank %d: %d free blocks after the cancel, want %d", r, got, free)
		}
	}
	retry := genReqFor(gen, t, creq, blocks)
	if err := gen.t.RequestAndReceiveSync(context.Background(), retry); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "unknown id or wrong token") {
		t.Fatalf("retry after the cancel: %v", err)
	}
	gen.release(t, retry.Blocks)
}

// takeRecvBuffers takes every receive staging buffer of in's ranks, so that
// a staged receive announces no chunk; giveBack returns them.
func takeRecvBuffers(in *inst) (giveBack func()) {
	var taken []*mover.Lease
	for _, r := range in.t.ranks {
		for range r.recvBufs.Count() {
			l, _ := r.recvBufs.Hold(context.Background(), mover.Holder{})
			taken = append(taken, l)
		}
	}
	return func() {
		for _, l := range taken {
			l.Release()
		}
	}
}

// waitSendPhase waits until every rank of in holding context request id
// has its send core in one of phases ps.
func waitSendPhase(t *testing.T, in *inst, id uint64, ps ...phase) {
	t.Helper()
	var got []phase
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		got = got[:0]
		all := true
		for _, r := range in.t.ranks {
			r.mu.Lock()
			q := r.reqs[reqKey{sideSend, id}]
			if q == nil {
				all = false
			} else {
				got = append(got, q.core.state())
				all = all && slices.Contains(ps, q.core.state())
			}
			r.mu.Unlock()
		}
		if all {
			return
		}
	}
	t.Fatalf("context request %d: phases %v on the ranks that hold it, want %v on all %d", id, got, ps, len(in.t.ranks))
}
