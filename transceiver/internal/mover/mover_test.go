package mover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
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
// two receive buffers) and direct moves over tcp between pairings leave
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
				for _, direct := range []bool{false, true} {
					name := fmt.Sprintf("ctx TP%d PP%d rank %d → gen TP%d PP%d rank %d, %d blocks, direct %v", pg.ctxTP, pg.ctxPP, c, pg.genTP, pg.genPP, g, n, direct)
					movePair(t, name, rng, send, recv, plan, n, direct)
					moved++
				}
			}
		}
	}
	if moved < 20 {
		t.Errorf("%d pairs moved: the pairings cover too little", moved)
	}
}

func movePair(t *testing.T, name string, rng *rand.Rand, send, recv transport.Transport, plan *layout.Plan, n int, direct bool) {
	src := randomBlocks(rng, n, plan.SrcBlockBytes())
	dst := randomBlocks(rng, n, plan.DstLayout().BlockBytes())
	want := naive(t, plan, src, dst)
	chunk := 1 + rng.IntN(n)
	packed := plan.PackedBytesPerBlock()
	sb := NewBuffers(1+rng.IntN(2), int(int64(chunk)*packed))
	rb := NewBuffers(1+rng.IntN(2), int(int64(chunk)*packed))
	sp := Pair{Transport: send, Blocks: src, Plan: plan, Chunk: chunk, Buffers: sb}
	rp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: chunk, Buffers: rb}
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
	rb := NewBuffers(2, int(2*plan.PackedBytesPerBlock()))
	rp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: 2, Buffers: rb}

	stop := errors.New("the request stopped")
	ctx, cancel := context.WithCancelCause(context.Background())
	announced := 0
	m := rp.Receive(ctx, func(Chunk) error {
		if announced++; announced == 2 {
			cancel(stop) // no sender: both chunks stay in flight
		}
		return nil
	})
	got, chunks, err := m.Bytes, m.Chunks, m.Err
	if !errors.Is(err, stop) || got != 0 || chunks != 0 {
		t.Errorf("receive with its context ended: %d bytes, %d chunks, %v; want 0, 0 and the cause", got, chunks, err)
	}
	if rb.InUse() != 0 {
		t.Errorf("%d receive buffers taken after the receive ended", rb.InUse())
	}

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
	sp := Pair{Transport: recv, Blocks: dst, Plan: plan, Chunk: 2, Buffers: NewBuffers(1, rb.Size())}
	if err := sp.Send(sctx, nil, make(chan Chunk)).Err; !errors.Is(err, stop) {
		t.Errorf("send with its context ended: %v, want the cause", err)
	}
}

// TestBuffers: at most Count buffers are out at once; each is allocated
// on first use only; Put gives back its full size.
func TestBuffers(t *testing.T) {
	p := NewBuffers(2, 64)
	a, _ := p.Get(context.Background())
	b, ok := p.TryGet()
	if !ok || len(a) != 64 || len(b) != 64 || p.InUse() != 2 || p.Allocated() != 2 {
		t.Fatalf("two buffers: %d and %d bytes, ok %v, %d in use, %d allocated", len(a), len(b), ok, p.InUse(), p.Allocated())
	}
	if _, ok := p.TryGet(); ok {
		t.Fatal("a third buffer out of two")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := p.Get(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get with none free: %v, want the context's deadline", err)
	}
	p.Put(a[:3])
	c, _ := p.Get(context.Background())
	if len(c) != 64 || p.Allocated() != 2 {
		t.Errorf("a buffer put back cut: %d bytes, %d allocated; want 64 and 2", len(c), p.Allocated())
	}
	p.Put(b)
	p.Put(c)
	if p.InUse() != 0 {
		t.Errorf("%d in use after every Put", p.InUse())
	}
	defer func() {
		if recover() == nil {
			t.Error("a Put of a buffer not taken did not panic")
		}
	}()
	p.Put(c)
}
