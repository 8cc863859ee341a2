package mover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/tcp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func openTCP(t *testing.T) transport.Transport {
	t.Helper()
	tr, err := tcp.Open(context.Background(), transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

func cacheState(tp, pp int) layout.CacheState {
	return layout.CacheState{
		Shape:     kvcache.Shape{Layers: 4, KVHeads: 8, HeadDim: 16, TokensPerBlock: 4, KVFactor: 2, DType: kvcache.BF16},
		Parallel:  layout.ParallelConfig{TP: tp, PP: pp, CP: 1},
		Attention: layout.AttentionDefault,
	}
}

func randomBlocks(rng *rand.Rand, n int, size int64) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, size)
		for j := range out[i] {
			out[i][j] = byte(rng.Uint32())
		}
	}
	return out
}

// naive is what the receiver's blocks must hold after a pair moved: the
// plan's packed form of the sender's blocks, unpacked in memory, one
// block at a time (layout's own tests check Pack and Unpack against the
// logical reference).
func naive(t *testing.T, p *layout.Plan, src, dst [][]byte) [][]byte {
	want := make([][]byte, len(dst))
	for i := range dst {
		want[i] = bytes.Clone(dst[i])
	}
	buf := make([]byte, p.PackedBytesPerBlock())
	for i := range src {
		if err := p.Pack(buf, src[i:i+1]); err != nil {
			t.Fatal(err)
		}
		if err := p.Unpack(want[i:i+1], buf); err != nil {
			t.Fatal(err)
		}
	}
	return want
}

// TestPairAgainstNaive: staged (chunk sizes 1 to all the blocks, one or
// two receive buffers; the sender packing or gathering from its blocks,
// the receiver unpacking or scattering into its blocks, with no buffer of
// their own) and direct moves over tcp between pairings leave
// the receiver's blocks as the naive pack and unpack does, report every
// byte and chunk, and put every staging buffer back.
func TestPairAgainstNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	send, recv := openTCP(t), openTCP(t)
	moved := 0
	pairings := []struct{ ctxTP, ctxPP, genTP, genPP int }{
		{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 1, 2, 1}, {2, 2, 4, 1}, {1, 2, 2, 2},
	}
	for _, pg := range pairings {
		cs, gs := cacheState(pg.ctxTP, pg.ctxPP), cacheState(pg.genTP, pg.genPP)
		for c := range cs.Parallel.NumRanks() {
			for g := range gs.Parallel.NumRanks() {
				plan, err := layout.NewPlan(cs, c, gs, g)
				if errors.Is(err, layout.ErrNotTarget) {
					continue // this pair moves nothing
				}
				if err != nil {
					t.Fatal(err)
				}
				if plan.PackedBytesPerBlock() == 0 {
					continue // this pair shares no layer
				}
				n := 1 + rng.IntN(9)
				for _, mode := range []string{"staged", "gathered", "scattered", "gathered+scattered", "direct"} {
					name := fmt.Sprintf("ctx TP%d PP%d rank %d → gen TP%d PP%d rank %d, %d blocks, %s", pg.ctxTP, pg.ctxPP, c, pg.genTP, pg.genPP, g, n, mode)
					movePair(t, name, rng, send, recv, plan, n, mode)
					moved++
				}
			}
		}
	}
	if moved < 20 {
		t.Errorf("%d pairs moved: the pairings cover too little", moved)
	}
}

// movePair moves n blocks with plan: staged (packed into the sender's
// buffers and unpacked from the receiver's), gathered (the sender's
// chunks sent from its blocks' spans), scattered (the receiver's chunks
// received into its blocks' spans), both, or direct.
func movePair(t *testing.T, name string, rng *rand.Rand, send, recv transport.Transport, plan *layout.Plan, n int, mode string) {
	direct := mode == "direct"
	src := randomBlocks(rng, n, plan.SrcBlockBytes())
	dst := randomBlocks(rng, n, plan.DstLayout().BlockBytes())
	want := naive(t, plan, src, dst)
	chunk := 1 + rng.IntN(n)
	packed := plan.PackedBytesPerBlock()
	sb := NewBuffers(1+rng.IntN(2), int(int64(chunk)*packed), HoldLimit{}, nil)
	rb := NewBuffers(1+rng.IntN(2), int(int64(chunk)*packed), HoldLimit{}, nil)
	sp := Pair{Transport: send, Blocks: src, Plan: plan, Chunk: chunk, Buffers: sb, Gather: strings.Contains(mode, "gathered")}
	rp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: chunk, Buffers: rb, Scatter: strings.Contains(mode, "scattered")}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var sm, rm Moved
	if direct {
		rv, err := rp.ExpectDirect()
		if err != nil {
			t.Fatalf("%s: ExpectDirect: %v", name, err)
		}
		sm = sp.Send(ctx, rv.Descriptor(), nil)
		rm = rp.AwaitDirect(ctx, rv)
	} else {
		chunks := make(chan Chunk, 64)
		done := make(chan struct{})
		go func() {
			defer close(done)
			sm = sp.Send(ctx, nil, chunks)
		}()
		rm = rp.Receive(ctx, func(c Chunk) error { chunks <- c; return nil })
		<-done
	}
	serr, rerr := sm.Err, rm.Err
	got, gotChunks, sent, sentChunks := rm.Bytes, rm.Chunks, sm.Bytes, sm.Chunks
	if sm.Backend != send.Name() || rm.Backend != recv.Name() {
		t.Errorf("%s: moved over %q and %q, want %q and %q", name, sm.Backend, rm.Backend, send.Name(), recv.Name())
	}
	if serr != nil || rerr != nil {
		t.Fatalf("%s: send %v, receive %v", name, serr, rerr)
	}
	wantChunks := (n + chunk - 1) / chunk
	if direct {
		wantChunks = 1
	}
	if total := int64(n) * packed; got != total || sent != total || gotChunks != wantChunks || sentChunks != wantChunks {
		t.Errorf("%s: sent %d bytes in %d chunks, received %d in %d; want %d in %d", name, sent, sentChunks, got, gotChunks, total, wantChunks)
	}
	for i := range dst {
		if !bytes.Equal(dst[i], want[i]) {
			t.Fatalf("%s: block %d differs from the naive pack and unpack (chunk %d)", name, i, chunk)
		}
	}
	if sb.InUse() != 0 || rb.InUse() != 0 {
		t.Errorf("%s: %d send and %d receive buffers still taken", name, sb.InUse(), rb.InUse())
	}
	if direct && (sb.Allocated() != 0 || rb.Allocated() != 0) {
		t.Errorf("%s: a direct move allocated %d and %d staging buffers", name, sb.Allocated(), rb.Allocated())
	}
	if strings.Contains(mode, "gathered") && sb.Allocated() != 0 {
		t.Errorf("%s: a gathered send allocated %d staging buffers", name, sb.Allocated())
	}
	if strings.Contains(mode, "scattered") && rb.Allocated() != 0 {
		t.Errorf("%s: a scattered receive allocated %d staging buffers", name, rb.Allocated())
	}
}

// TestStagedStops: a staged receive whose context ends, or whose
// announce fails, returns that error at once with every buffer back and
// its receipts cancelled; so does a direct one, its receipt cancelled; a
// send whose context ends returns its cause.
func TestStagedStops(t *testing.T) {
	recv := openTCP(t)
	cs := cacheState(1, 1)
	plan, err := layout.NewPlan(cs, 0, cs, 0)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 5))
	dst := randomBlocks(rng, 6, plan.DstLayout().BlockBytes())
	rb := NewBuffers(2, int(2*plan.PackedBytesPerBlock()), HoldLimit{}, nil)
	rp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: 2, Buffers: rb}

	stop := errors.New("the request stopped")
	for _, scatter := range []bool{false, true} {
		ctx, cancel := context.WithCancelCause(context.Background())
		announced := 0
		var armed []transport.Descriptor
		sp := rp
		sp.Scatter = scatter
		m := sp.Receive(ctx, func(c Chunk) error {
			armed = append(armed, c.Desc)
			if announced++; announced == 2 {
				cancel(stop) // no sender: both chunks stay in flight
			}
			return nil
		})
		got, chunks, err := m.Bytes, m.Chunks, m.Err
		if !errors.Is(err, stop) || got != 0 || chunks != 0 || len(armed) != 2 {
			t.Errorf("scatter %v: receive with its context ended: %d bytes, %d chunks, %v after %d announced; want 0, 0 and the cause after 2", scatter, got, chunks, err, len(armed))
		}
		if rb.InUse() != 0 {
			t.Errorf("scatter %v: %d receive buffers taken after the receive ended", scatter, rb.InUse())
		}
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(stop)

	refused := errors.New("control connection lost")
	err = rp.Receive(context.Background(), func(Chunk) error { return refused }).Err
	if !errors.Is(err, refused) || rb.InUse() != 0 {
		t.Errorf("receive whose announce failed: %v with %d buffers taken; want the announce's error and 0", err, rb.InUse())
	}

	dp := Pair{Transport: recv, Blocks: dst, Plan: plan}
	rv, err := dp.ExpectDirect()
	if err != nil {
		t.Fatal(err)
	}
	if m := dp.AwaitDirect(ctx, rv); !errors.Is(m.Err, stop) || m.Bytes != 0 || m.Chunks != 0 {
		t.Errorf("direct receive with its context ended: %d bytes, %d chunks, %v; want 0, 0 and the cause", m.Bytes, m.Chunks, m.Err)
	}
	select {
	case <-rv.Done():
		if !errors.Is(rv.Err(), transport.ErrCanceled) {
			t.Errorf("direct receipt given up ended with %v, want %v", rv.Err(), transport.ErrCanceled)
		}
	default:
		t.Error("a direct receipt given up is still armed")
	}

	sctx, scancel := context.WithCancelCause(context.Background())
	scancel(stop)
	sp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: 2, Buffers: NewBuffers(1, rb.Size(), HoldLimit{}, nil)}
	if err := sp.Send(sctx, nil, make(chan Chunk)).Err; !errors.Is(err, stop) {
		t.Errorf("send with its context ended: %v, want the cause", err)
	}
}

// TestBuffers: at most Count buffers are out at once; each is allocated
// on first use only; a buffer goes back at its full size.
func TestBuffers(t *testing.T) {
	p := NewBuffers(2, 64, HoldLimit{}, nil)
	a, _ := p.Hold(context.Background(), Holder{})
	b, ok := p.TryHold(Holder{})
	if !ok || len(a.Buf) != 64 || len(b.Buf) != 64 || p.InUse() != 2 || p.Allocated() != 2 {
		t.Fatalf("two buffers: ok %v, %d in use, %d allocated", ok, p.InUse(), p.Allocated())
	}
	if _, ok := p.TryHold(Holder{}); ok {
		t.Fatal("a third buffer out of two")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := p.Hold(ctx, Holder{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Hold with none free: %v, want the context's deadline", err)
	}
	a.Buf = a.Buf[:3] // a holder that cut its buffer
	a.Release()
	c, _ := p.Hold(context.Background(), Holder{})
	if len(c.Buf) != 64 || p.Allocated() != 2 {
		t.Errorf("a buffer put back cut: %d bytes, %d allocated; want 64 and 2", len(c.Buf), p.Allocated())
	}
	b.Release()
	c.Release()
	if p.InUse() != 0 {
		t.Errorf("%d in use after every Release", p.InUse())
	}
	defer func() {
		if recover() == nil {
			t.Error("a put of a buffer not taken did not panic")
		}
	}()
	p.put(c.buf)
}

// TestBuffersHoldLimit: a holder is stopped, with an error that wraps the
// limit's, once it has held its buffer past its limit (Base plus its bytes
// at Rate) while another caller waits, not before and not while nobody
// waits; the earliest due goes first; holders without a stop function and
// buffers without a limit are never stopped.
func TestBuffersHoldLimit(t *testing.T) {
	errStalled := errors.New("stalled")
	synctest.Test(t, func(t *testing.T) {
		p := NewBuffers(2, 64, HoldLimit{Base: time.Second, Rate: 64, Err: errStalled}, nil)
		// hold takes a buffer for n bytes and gives it back when stopped.
		hold := func(n int64) (*Lease, context.Context, context.CancelCauseFunc) {
			ctx, stop := context.WithCancelCause(t.Context())
			l, err := p.Hold(ctx, Holder{Owner: "holders", Bytes: n, Stop: stop})
			if err != nil {
				t.Fatal(err)
			}
			go func() {
				<-ctx.Done()
				l.Release()
			}()
			return l, ctx, stop
		}
		a, actx, _ := hold(64) // due after 2 s
		b, bctx, _ := hold(0)  // due after 1 s
		time.Sleep(time.Minute)
		if actx.Err() != nil || bctx.Err() != nil {
			t.Fatal("a holder was stopped while nobody waited")
		}

		start := time.Now()
		w, err := p.Hold(t.Context(), Holder{}) // both overdue: the earliest due (b) goes first, at once
		if err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took != 0 {
			t.Errorf("waited %v for an overdue holder to be stopped, want 0", took)
		}
		if !errors.Is(context.Cause(bctx), errStalled) || actx.Err() != nil {
			t.Errorf("after one wait: b %v, a %v; want b stopped (%v) and a holding", context.Cause(bctx), context.Cause(actx), errStalled)
		}
		if !errors.Is(b.Err(), errStalled) || a.Err() != nil {
			t.Errorf("Lease.Err: b %v, a %v", b.Err(), a.Err())
		}
		// a, overdue, is the next waiter's to stop, at once.
		w2, err := p.Hold(t.Context(), Holder{})
		if err != nil {
			t.Fatal(err)
		}
		if !errors.Is(context.Cause(actx), errStalled) {
			t.Errorf("second wait: a %v, want stopped", context.Cause(actx))
		}
		w2.Release()

		c, cctx, _ := hold(128) // held with w: c is due after 1 s + 128 bytes at 64/s
		_ = c
		start = time.Now()
		w3, err := p.Hold(t.Context(), Holder{})
		if err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took != 3*time.Second || !errors.Is(context.Cause(cctx), errStalled) {
			t.Errorf("a fresh holder was stopped after %v (%v), want 3s", took, context.Cause(cctx))
		}
		if err := context.Cause(cctx); err == nil || !strings.Contains(err.Error(), "128 bytes") {
			t.Errorf("the stop error does not name the transfer's bytes: %v", err)
		}
		w3.Release()
		w.Release()
		synctest.Wait()
		if p.InUse() != 0 {
			t.Errorf("%d buffers in use at the end", p.InUse())
		}

		// A waiter of the holder's own request does not stop it; one of
		// another does.
		_, dctx, dstop := hold(0)
		_, ectx, estop := hold(0)
		time.Sleep(time.Minute)
		ctx3, cancel3 := context.WithTimeout(t.Context(), time.Hour)
		defer cancel3()
		if _, err := p.Hold(ctx3, Holder{Owner: "holders"}); !errors.Is(err, context.DeadlineExceeded) || dctx.Err() != nil || ectx.Err() != nil {
			t.Errorf("a waiter of the holders' own request: %v, holders %v and %v; want its deadline, holders untouched", err, dctx.Err(), ectx.Err())
		}
		w4, err := p.Hold(t.Context(), Holder{Owner: "another"})
		if err != nil || (dctx.Err() == nil) == (ectx.Err() == nil) {
			t.Errorf("a waiter of another request: %v, holders %v and %v; want one stopped", err, dctx.Err(), ectx.Err())
		}
		w4.Release()
		dstop(nil) // the one not stopped gives its buffer back
		estop(nil)
		synctest.Wait()

		// Holders without a stop function are never stopped; a waiter
		// waits for its deadline.
		g1, _ := p.Hold(t.Context(), Holder{Owner: "unstoppable"})
		g2, _ := p.Hold(t.Context(), Holder{Owner: "unstoppable"})
		ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
		defer cancel()
		if _, err := p.Hold(ctx, Holder{}); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("a wait behind holders without a stop: %v, want its deadline", err)
		}
		g1.Release()
		g2.Release()

		// Without a limit, nobody is stopped.
		q := NewBuffers(1, 64, HoldLimit{Err: errStalled}, nil)
		qctx, qstop := context.WithCancelCause(t.Context())
		defer qstop(nil)
		l, _ := q.Hold(qctx, Holder{Bytes: 0, Stop: qstop})
		ctx2, cancel2 := context.WithTimeout(t.Context(), time.Hour)
		defer cancel2()
		if _, err := q.Hold(ctx2, Holder{}); !errors.Is(err, context.DeadlineExceeded) || qctx.Err() != nil {
			t.Errorf("without a limit: wait %v, holder %v; want the deadline and the holder untouched", err, qctx.Err())
		}
		l.Release()
	})
}

// TestBuffersClose: Close releases, through the allocator, the buffers that
// are back, and each other one when its lease is released; a buffer whose
// allocation fails leaves its slot free for the next Hold.
func TestBuffersClose(t *testing.T) {
	var allocs, frees int
	fail := false
	alloc := func(size int) ([]byte, func() error, error) {
		if fail {
			return nil, nil, errors.New("no memory")
		}
		allocs++
		freed := false
		return make([]byte, size), func() error {
			if freed {
				t.Error("a buffer released twice")
			}
			freed = true
			frees++
			return nil
		}, nil
	}
	p := NewBuffers(2, 64, HoldLimit{}, alloc)
	fail = true
	if _, err := p.Hold(context.Background(), Holder{}); err == nil || !strings.Contains(err.Error(), "no memory") {
		t.Fatalf("Hold with a failing allocator: %v", err)
	}
	fail = false
	a, err := p.Hold(context.Background(), Holder{})
	if err != nil {
		t.Fatal(err)
	}
	b, ok := p.TryHold(Holder{})
	if !ok {
		t.Fatal("TryHold: the slot of the failed allocation was not free")
	}
	b.Release()
	if allocs != 2 || p.Allocated() != 2 {
		t.Fatalf("allocated %d (%d counted), want 2", allocs, p.Allocated())
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if frees != 1 {
		t.Fatalf("Close released %d buffers, want the 1 that was back", frees)
	}
	a.Release()
	if frees != 2 || p.Allocated() != 0 || p.InUse() != 0 {
		t.Fatalf("after the last Release: %d released, %d allocated, %d in use; want 2, 0, 0", frees, p.Allocated(), p.InUse())
	}
	if err := p.Close(); err != nil || frees != 2 {
		t.Fatalf("a second Close: %v, %d released", err, frees)
	}
}
