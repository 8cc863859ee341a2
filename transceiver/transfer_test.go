package transceiver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
)

// TestPairings moves requests over real loopback TCP between instances of
// different layouts and checks every generation byte against the reference.
func TestPairings(t *testing.T) {
	bf, fp16, fp8 := kvcache.BF16, kvcache.FP16, kvcache.FP8E4M3
	uneven := func(s layout.CacheState, per ...int) layout.CacheState {
		s.Parallel.LayersPerPP = per
		return s
	}
	tests := []struct {
		name        string
		sender, gen layout.CacheState
	}{
		{"identical TP1 (direct)", state(4, 4, 16, 4, bf, 1, 1, false), state(4, 4, 16, 4, bf, 1, 1, false)},
		{"identical TP2 PP2 (direct)", state(4, 4, 16, 4, bf, 2, 2, false), state(4, 4, 16, 4, bf, 2, 2, false)},
		{"TP2 to TP1", state(4, 4, 16, 4, bf, 2, 1, false), state(4, 4, 16, 4, bf, 1, 1, false)},
		{"TP1 to TP2", state(4, 4, 16, 4, fp16, 1, 1, false), state(4, 4, 16, 4, fp16, 2, 1, false)},
		{"TP4 PP2 to TP2 PP1", state(4, 4, 16, 4, bf, 4, 2, false), state(4, 4, 16, 4, bf, 2, 1, false)},
		{"TP1 PP2 to TP2 PP2 uneven", uneven(state(5, 4, 16, 4, fp8, 1, 2, false), 1, 4), uneven(state(5, 4, 16, 4, fp8, 2, 2, false), 3, 2)},
		{"duplicated heads TP4 to TP1", state(4, 2, 16, 4, bf, 4, 1, false), state(4, 2, 16, 4, bf, 1, 1, false)},
		{"duplicated heads TP1 to TP4", state(4, 2, 16, 4, bf, 1, 1, false), state(4, 2, 16, 4, bf, 4, 1, false)},
		{"MLA TP2 PP1 to TP1 PP2", state(4, 1, 36, 4, bf, 2, 1, true), state(4, 1, 36, 4, bf, 1, 2, true)},
		{"MLA TP4 PP2 to TP2 PP2 (direct: replicated latent)", state(4, 1, 36, 4, fp8, 4, 2, true), state(4, 1, 36, 4, fp8, 2, 2, true)},
		{"TP3 to TP2 (not a power of two)", state(2, 6, 8, 4, bf, 3, 1, false), state(2, 6, 8, 4, bf, 2, 1, false)},
		// Spans of 32 KiB: direct scatter/gather without staging.
		{"TP2 to TP1 direct", state(2, 4, 256, 32, bf, 2, 1, false), state(2, 4, 256, 32, bf, 1, 1, false)},
		{"TP1 to TP2 PP2 direct", state(2, 4, 256, 32, bf, 1, 1, false), state(2, 4, 256, 32, bf, 2, 2, false)},
	}
	for _, backend := range pairingBackends {
		for i, tc := range tests {
			t.Run(string(backend)+" "+tc.name, func(t *testing.T) {
				pairing(t, backend, i, tc.name, tc.sender, tc.gen)
			})
		}
	}
}

// pairingBackends are the backends TestPairings runs over; a binary built
// with -tags ucx adds UCX (ucx_test.go).
var pairingBackends = []config.Backend{config.BackendTCP, config.BackendSHM}

func pairing(t *testing.T, backend config.Backend, i int, name string, cs, gs layout.CacheState) {
	{
		{
			cfg := testCfg(func(c *config.CacheTransceiver) { c.Backend = backend })
			sender := newInst(t, cs, cfg, 64)
			gen := newInst(t, gs, cfg, 64)
			// 37 tokens: a partial last block; 150 tokens: several chunks
			// through the 64 KiB staging buffers.
			transfer(t, sender, gen, uint64(10*i+1), 37, uint64(i), 0, 0)
			st := transfer(t, sender, gen, uint64(10*i+2), 150, uint64(i+100), 0, 0)
			// ucx names what carried the data: "ucx(sysv,cma)".
			if kind, _, _ := strings.Cut(st.Backend, "("); kind != strings.ToLower(string(backend)) {
				t.Errorf("carried by %q, want %q", st.Backend, strings.ToLower(string(backend)))
			}
			// Direct pairs never touch a staging buffer (they are allocated
			// on first use); the others do.
			direct := strings.Contains(name, "direct")
			for _, r := range gen.t.ranks {
				if used := r.recvBufs.Allocated(); (used == 0) != direct {
					t.Errorf("rank %d: %d receive staging buffers allocated (direct: %v)", r.idx, used, direct)
				}
			}
		}
	}
}

// TestAttentionDP: the generation side has attention DP; the request lives
// in one DP group.
func TestAttentionDP(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 2, 1, false)
	gs := state(4, 4, 16, 4, kvcache.BF16, 4, 1, false)
	gs.Parallel.AttentionDP, gs.Parallel.DPSize = true, 2
	sender := newInst(t, cs, testCfg(), 32)
	gen := newInst(t, gs, testCfg(), 32)
	transfer(t, sender, gen, 1, 40, 1, 0, 1)
	transfer(t, sender, gen, 2, 40, 2, 0, 0)
}

// TestLargerThanBuffer: a request 8× the staging buffer streams through it.
func TestLargerThanBuffer(t *testing.T) {
	s1 := state(4, 4, 32, 8, kvcache.BF16, 1, 1, false) // block = 4×2×4×8×32×2 = 16 KiB
	s2 := state(4, 4, 32, 8, kvcache.BF16, 2, 1, false)
	cfg := testCfg(func(c *config.CacheTransceiver) { c.MaxTokensInBuffer = 16 }) // 3 blocks
	sender := newInst(t, s1, cfg, 64)
	gen := newInst(t, s2, cfg, 64)
	// 24 blocks of 16 KiB: 8× the 48 KiB buffer.
	transfer(t, sender, gen, 1, 24*8, 7, 0, 0)
	// Pools hold no more than they did: the chunks went through the
	// buffers, whose number and size are fixed.
	for _, r := range gen.t.ranks {
		if r.recvBufs.Count() != 1 || r.recvBufs.Size() != 3*int(gen.pools[r.idx].BlockBytes()) {
			t.Errorf("rank %d: %d receive buffers of %d bytes", r.idx, r.recvBufs.Count(), r.recvBufs.Size())
		}
	}
}

// TestConcurrentSmall runs 1,000 one-block transfers, many at a time.
func TestConcurrentSmall(t *testing.T) {
	n := 1000
	if testing.Short() {
		n = 200
	}
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 256)
	gen := newInst(t, s, testCfg(), 256)
	l, _ := layout.NewLogical(s.Shape, 4)
	l.Fill(3)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs <- oneSmall(sender, gen, l, uint64(i+1))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := sender.t.CheckContextTransferStatus(context.Background(), -1)
	if err != nil || len(got) != n {
		t.Fatalf("CheckContextTransferStatus: %d requests, %v", len(got), err)
	}
	if !gen.t.GenTransferComplete() {
		t.Error("GenTransferComplete false after every receive ended")
	}
}

func oneSmall(sender, gen *inst, l *layout.Logical, id uint64) error {
	cb, err := sender.pools[0].Allocate(1)
	if err != nil {
		return err
	}
	shard, _ := layout.Shard(l, sender.state, 0)
	copy(sender.pools[0].Block(cb[0]), shard[0])
	creq := &Request{ID: id, Type: ContextOnly, Blocks: [][]kvcache.BlockID{cb}}
	if err := sender.t.RespondAndSendAsync(creq); err != nil {
		return err
	}
	sender.pools[0].Release(cb...)
	gb, err := gen.pools[0].Allocate(1)
	if err != nil {
		return err
	}
	defer gen.pools[0].Release(gb...)
	greq := &Request{ID: id, Type: GenerationOnly, Blocks: [][]kvcache.BlockID{gb}, ContextPhase: creq.ContextPhase}
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(c, greq); err != nil {
		return fmt.Errorf("request %d: %w", id, err)
	}
	if got := gen.pools[0].Block(gb[0]); string(got) != string(shard[0]) {
		return fmt.Errorf("request %d: wrong bytes", id)
	}
	return nil
}

// startSend prepares and hands over one context request; it returns the
// request and the logical cache.
func startSend(t *testing.T, sender *inst, id uint64, tokens int) (*Request, *layout.Logical) {
	t.Helper()
	var l *layout.Logical
	nb := layout.NumBlocks(tokens, sender.state.Shape.TokensPerBlock)
	cb := sender.alloc(t, 0, nb)
	if tokens <= 1024 { // the naive reference is slow; large requests here test control flow, not bytes
		l, _ = layout.NewLogical(sender.state.Shape, tokens)
		l.Fill(id)
		sender.fill(t, l, 0, cb)
	}
	creq := &Request{ID: id, Type: ContextOnly, Blocks: cb}
	if err := sender.t.RespondAndSendAsync(creq); err != nil {
		t.Fatal(err)
	}
	sender.release(t, cb)
	return creq, l
}

func genReqFor(gen *inst, t *testing.T, creq *Request, nb int) *Request {
	return &Request{ID: creq.ID, Type: GenerationOnly, Blocks: gen.alloc(t, 0, nb),
		ContextPhase: &ContextPhaseParams{CtxRequestID: creq.ID, OpaqueState: creq.ContextPhase.OpaqueState}}
}

func TestWrongToken(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 16)
	gen := newInst(t, s, testCfg(), 16)
	creq, _ := startSend(t, sender, 5, 8)
	var op OpaqueState
	if err := op.UnmarshalBinary(creq.ContextPhase.OpaqueState); err != nil {
		t.Fatal(err)
	}
	op.Token[3] ^= 1
	forged, _ := op.MarshalBinary()
	greq := genReqFor(gen, t, creq, 2)
	greq.ContextPhase.OpaqueState = forged
	err := gen.t.RequestAndReceiveSync(context.Background(), greq)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "unknown id or wrong token") {
		t.Fatalf("forged token: %v", err)
	}
	if greq.State() != DisaggTransError {
		t.Errorf("state %s", greq.State())
	}
	gen.release(t, greq.Blocks)
	// The real request is untouched: it can still be pulled.
	real := genReqFor(gen, t, creq, 2)
	if err := gen.t.RequestAndReceiveSync(context.Background(), real); err != nil {
		t.Fatalf("the genuine pull after a forged one: %v", err)
	}
	gen.release(t, real.Blocks)
	// And not twice.
	again := genReqFor(gen, t, creq, 2)
	if err := gen.t.RequestAndReceiveSync(context.Background(), again); !errors.Is(err, ErrRefused) {
		t.Fatalf("second pull of one request: %v", err)
	}
	gen.release(t, again.Blocks)
}

// TestUnpinnedBlocks: a pull into blocks the caller does not hold is
// refused with an error naming the block, before anything is asked of the
// context side, and the context request stays pullable.
func TestUnpinnedBlocks(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 16)
	gen := newInst(t, s, testCfg(), 16)
	creq, l := startSend(t, sender, 6, 8)
	bad := genReqFor(gen, t, creq, 2)
	gen.release(t, bad.Blocks[:1]) // the request's first rank's blocks
	want := fmt.Sprintf("block %d: bad block id (not pinned)", bad.Blocks[0][0])
	err := gen.t.RequestAndReceiveSync(context.Background(), bad)
	if !errors.Is(err, kvcache.ErrBadBlock) || !strings.Contains(err.Error(), want) {
		t.Fatalf("pull into unpinned blocks: %v; want %v naming %q", err, kvcache.ErrBadBlock, want)
	}
	gen.release(t, bad.Blocks[1:])
	good := genReqFor(gen, t, creq, 2)
	if err := gen.t.RequestAndReceiveSync(context.Background(), good); err != nil {
		t.Fatalf("the genuine pull after a refused one: %v", err)
	}
	gen.verify(t, l, 0, good.Blocks)
	gen.release(t, good.Blocks)
}

func TestIncompatible(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	gs := state(4, 4, 32, 8, kvcache.FP16, 1, 1, false)
	sender := newInst(t, cs, testCfg(), 16)
	gen := newInst(t, gs, testCfg(), 16)
	creq, _ := startSend(t, sender, 9, 8)
	greq := genReqFor(gen, t, creq, 1)
	err := gen.t.RequestAndReceiveAsync(greq)
	// Checked before any byte moves, on the generation side, with both
	// values of every differing field.
	if err == nil {
		t.Fatal("incompatible states accepted")
	}
	for _, want := range []string{"dtype", "bf16", "fp16", "head_dim", "16", "32", "tokens_per_block"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
	gen.release(t, greq.Blocks)
	sender.t.Cancel(creq)
	waitDone(t, creq, 5*time.Second)
}

// TestIncompatibleRefusedByContext: a generation rank that skips its own
// check still gets the context rank's refusal with the fields listed.
func TestIncompatibleRefusedByContext(t *testing.T) {
	cs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	gs := state(4, 4, 16, 4, kvcache.FP16, 1, 1, false)
	sender := newInst(t, cs, testCfg(), 16)
	gen := newInst(t, gs, testCfg(), 16)
	creq, _ := startSend(t, sender, 9, 8)
	// Lie about the context state so that the generation side's own check
	// passes and the request-info goes out.
	var op OpaqueState
	op.UnmarshalBinary(creq.ContextPhase.OpaqueState)
	op.State.Shape.DType = kvcache.FP16
	lie, _ := op.MarshalBinary()
	greq := genReqFor(gen, t, creq, 2)
	greq.ContextPhase.OpaqueState = lie
	err := gen.t.RequestAndReceiveSync(context.Background(), greq)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "dtype") || !strings.Contains(err.Error(), "bf16") {
		t.Fatalf("refusal: %v", err)
	}
	gen.release(t, greq.Blocks)
	sender.t.Cancel(creq)
	waitDone(t, creq, 5*time.Second)
}

// TestContextTimeout: nobody pulls; the blocks go back at the deadline,
// and not a moment before. It runs in a synctest bubble (network_test.go).
func TestContextTimeout(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		s := state(2, 2, 16, 4, kvcache.BF16, 2, 1, false)
		sender := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 200 }), 16, withNetwork(nw))
		creq, _ := startSend(t, sender, 1, 16)
		if got := sender.pools[0].FreeBlocks(); got != 12 {
			t.Fatalf("free blocks while held: %d, want 12", got)
		}
		time.Sleep(200*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if n := heldBy(sender, sideSend, creq.ID); n != 2 || creq.State() != DisaggContextTransInProgress {
			t.Fatalf("1ns before the deadline: held by %d ranks of 2, state %s", n, creq.State())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if n := heldBy(sender, sideSend, creq.ID); n != 0 {
			t.Fatalf("at the deadline: still held by %d ranks", n)
		}
		if !ended(creq) || creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrTimeout) {
			t.Fatalf("at the deadline: ended %v, state %s, err %v", ended(creq), creq.State(), creq.Err())
		}
		for r, p := range sender.pools {
			if p.FreeBlocks() != 16 {
				t.Errorf("rank %d: %d free after the deadline", r, p.FreeBlocks())
			}
		}
	})
}

// TestGenerationTimeout: the context instance is gone (its endpoint accepts
// and never answers); the receive fails at its deadline, and not a moment
// before.
func TestGenerationTimeout(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		cfg := testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 300 })
		gen := newInst(t, s, cfg, 16, withNetwork(nw))
		// A listener that accepts and never answers: the handshake hangs.
		silent := newSilentListener(t, nw)
		op := &OpaqueState{RequestID: 1, State: s, Endpoints: []string{silent}}
		enc, _ := op.MarshalBinary()
		greq := &Request{ID: 1, Type: GenerationOnly, Blocks: gen.alloc(t, 0, 1), ContextPhase: &ContextPhaseParams{OpaqueState: enc}}
		if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if n := heldBy(gen, sideRecv, 1); n != 1 || ended(greq) {
			t.Fatalf("1ns before the deadline: held by %d ranks of 1, ended %v (%v)", n, ended(greq), greq.Err())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if !ended(greq) || !errors.Is(greq.Err(), ErrTimeout) || greq.State() != DisaggTransError {
			t.Fatalf("at the deadline: ended %v, state %s, err %v", ended(greq), greq.State(), greq.Err())
		}
		gen.release(t, greq.Blocks)
	})
}

// TestCancel cancels on each side, before and during the transfer.
func TestCancel(t *testing.T) {
	s := state(4, 8, 64, 16, kvcache.BF16, 1, 1, false) // 64 KiB blocks
	t.Run("context before pull", func(t *testing.T) {
		sender := newInst(t, s, testCfg(), 64)
		gen := newInst(t, s, testCfg(), 64)
		creq, _ := startSend(t, sender, 1, 64)
		if !sender.t.Cancel(creq) {
			t.Fatal("Cancel returned false")
		}
		waitDone(t, creq, 5*time.Second)
		if !errors.Is(creq.Err(), ErrCanceled) || creq.State() != DisaggTransError {
			t.Fatalf("%s %v", creq.State(), creq.Err())
		}
		if sender.t.Cancel(creq) {
			t.Error("second Cancel returned true")
		}
		greq := genReqFor(gen, t, creq, 4)
		if err := gen.t.RequestAndReceiveSync(context.Background(), greq); !errors.Is(err, ErrRefused) {
			t.Fatalf("pull after cancel: %v", err)
		}
		gen.release(t, greq.Blocks)
	})
	t.Run("generation during pull", func(t *testing.T) {
		sender := newInst(t, s, testCfg(), 600)
		gen := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), 600)
		creq, _ := startSend(t, sender, 2, 512*16) // 32 MiB through 64 KiB chunks
		greq := genReqFor(gen, t, creq, 512)
		if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
			t.Fatal(err)
		}
		waitMoving(t, gen)
		cancelled := gen.t.Cancel(greq)
		waitDone(t, greq, 5*time.Second)
		if !cancelled {
			t.Skip("the transfer ended before the cancel: nothing to check")
		}
		if !errors.Is(greq.Err(), ErrCanceled) || greq.State() != DisaggTransError {
			t.Fatalf("gen: %s %v", greq.State(), greq.Err())
		}
		gen.release(t, greq.Blocks)
		// The abort reaches the context side: the pull attempt fails, not
		// the context request, which waits for its owner to pull again,
		// never complete (a staged chunk goes out only when the generation
		// side asks for it, and the cancel comes as soon as the first of
		// the 512 moves). See TestRetryAfterFailedPull for the retry.
		waitSendPhase(t, sender, creq.ID, phaseWaiting)
		if creq.State() != DisaggContextTransInProgress {
			t.Fatalf("sender: %s %v, want the request still held", creq.State(), creq.Err())
		}
		sender.t.Cancel(creq)
		waitDone(t, creq, 5*time.Second)
		if creq.State() != DisaggTransError || !errors.Is(creq.Err(), ErrCanceled) {
			t.Fatalf("sender after its cancel: %s %v", creq.State(), creq.Err())
		}
	})
	t.Run("context during pull", func(t *testing.T) {
		sender := newInst(t, s, testCfg(), 600)
		gen := newInst(t, s, testCfg(func(c *config.CacheTransceiver) { c.ZeroCopy = false }), 600)
		creq, _ := startSend(t, sender, 3, 512*16)
		greq := genReqFor(gen, t, creq, 512)
		if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
			t.Fatal(err)
		}
		waitMoving(t, sender)
		cancelled := sender.t.Cancel(creq)
		waitDone(t, creq, 5*time.Second)
		waitDone(t, greq, 5*time.Second)
		if !cancelled {
			t.Skip("the transfer ended before the cancel: nothing to check")
		}
		if greq.State() != DisaggTransError || (!errors.Is(greq.Err(), ErrPeerAborted) && !errors.Is(greq.Err(), transport.ErrAborted)) {
			t.Fatalf("gen: %s %v, want an abort from the context side", greq.State(), greq.Err())
		}
		gen.release(t, greq.Blocks)
	})
}

// waitMoving waits until rank 0 of in has a request whose data is moving.
func waitMoving(t *testing.T, in *inst) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if moving(in) {
			return
		}
	}
	t.Fatal("no transfer started moving data within 10s")
}

// moving reports whether rank 0 of in has a request whose data is moving.
func moving(in *inst) bool {
	r := in.t.ranks[0]
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, q := range r.reqs {
		if q.core.state() == phaseMoving {
			return true
		}
	}
	return false
}

func TestNoTransceiver(t *testing.T) {
	_, err := New(context.Background(), &config.CacheTransceiver{}, Options{})
	if !errors.Is(err, ErrNoTransceiver) {
		t.Fatalf("%v", err)
	}
	_, err = New(context.Background(), &config.CacheTransceiver{Backend: config.BackendNIXL}, Options{State: state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)})
	if err == nil || !strings.Contains(err.Error(), "NIXL") {
		t.Fatalf("NIXL: %v", err)
	}
}

type countObserver struct {
	mu      sync.Mutex
	started map[string]int
	ended   []Record
}

func (o *countObserver) TransferStarted(role string) {
	o.mu.Lock()
	o.started[role]++
	o.mu.Unlock()
}

func (o *countObserver) TransferEnded(rec Record) {
	o.mu.Lock()
	o.ended = append(o.ended, rec)
	o.mu.Unlock()
}

// TestObserverAndTimingCSV: every rank's part of every transfer is reported
// once, and the timing file has one row per transfer.
func TestObserverAndTimingCSV(t *testing.T) {
	dir := t.TempDir()
	cs := state(4, 4, 16, 4, kvcache.BF16, 2, 1, false)
	gs := state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)
	obs := &countObserver{started: map[string]int{}}
	cfg := testCfg(func(c *config.CacheTransceiver) { c.TimeOutputPath = dir })
	sender := newInst(t, cs, cfg, 32)
	gen := newInst(t, gs, cfg, 32)
	for _, in := range []*inst{sender, gen} {
		for _, r := range in.t.ranks {
			r.obs = obs
		}
	}
	for i := range 3 {
		transfer(t, sender, gen, uint64(i+1), 40, uint64(i), 0, 0)
	}
	creq, _ := startSend(t, sender, 99, 8)
	sender.t.Cancel(creq)
	waitDone(t, creq, 5*time.Second)

	obs.mu.Lock()
	if obs.started[RoleContext] != 8 || obs.started[RoleGeneration] != 3 || len(obs.ended) != 11 {
		t.Errorf("started %v, ended %d", obs.started, len(obs.ended))
	}
	results := map[string]int{}
	for _, r := range obs.ended {
		results[r.Role+"/"+r.Result]++
		if r.Result == ResultOK && r.Role == RoleGeneration && (r.Bytes == 0 || r.Backend != "tcp" || r.Duration <= 0) {
			t.Errorf("record %+v", r)
		}
	}
	obs.mu.Unlock()
	if results["context/cancelled"] != 2 || results["context/ok"] != 6 || results["generation/ok"] != 3 {
		t.Errorf("results %v", results)
	}
	sender.t.Close()
	gen.t.Close()
	files, _ := filepath.Glob(filepath.Join(dir, "*.csv"))
	rows := 0
	for _, f := range files {
		b, _ := os.ReadFile(f)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if lines[0] != strings.TrimSpace(csvHeader) {
			t.Errorf("%s: header %q", f, lines[0])
		}
		rows += len(lines) - 1
	}
	if len(files) != 3 || rows != 11 {
		t.Errorf("%d files, %d rows: %v", len(files), rows, files)
	}
}

// TestAutoPicksPerPeer: AUTO takes shm between two instances on this host,
// whatever memory their pools are in (shm copies through a window of its
// own and shares no pool), and SHM works on heap pools.
func TestAutoPicksPerPeer(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	auto := testCfg(func(c *config.CacheTransceiver) { c.Backend = config.BackendAuto })
	if _, ok := PoolAllocator(auto).(kvcache.HeapAllocator); !ok {
		t.Fatalf("PoolAllocator(AUTO) = %T, want the Go heap", PoolAllocator(auto))
	}
	sender := newInst(t, s, auto, 16)
	gen := newInst(t, s, auto, 16)
	if st := transfer(t, sender, gen, 1, 8, 1, 0, 0); st.Backend != "shm" {
		t.Errorf("AUTO on one host: %q, want shm", st.Backend)
	}
	shm := testCfg(func(c *config.CacheTransceiver) { c.Backend = config.BackendSHM })
	a, b := newInst(t, s, shm, 16), newInst(t, s, shm, 16)
	if st := transfer(t, a, b, 2, 8, 2, 0, 0); st.Backend != "shm" {
		t.Errorf("SHM on heap pools: %q, want shm", st.Backend)
	}
}

// TestRespondBlockCounts: a context request whose ranks hold no blocks, or
// different numbers of them, is refused with an error that says which.
func TestRespondBlockCounts(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 2, 1, false)
	sender := newInst(t, s, testCfg(), 16)
	for _, tc := range []struct {
		name   string
		blocks [][]kvcache.BlockID
		want   string
	}{
		{"none on the first rank", [][]kvcache.BlockID{{}, {1}}, "rank 0 has no blocks"},
		{"none on another rank", [][]kvcache.BlockID{{1}, {}}, "rank 1 has no blocks"},
		{"different counts", [][]kvcache.BlockID{{1, 2}, {1}}, "rank 1 has 1 blocks, rank 0 has 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := sender.t.RespondAndSendAsync(&Request{ID: 7, Type: ContextOnly, Blocks: tc.blocks})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrInvalidRequest) {
				t.Errorf("RespondAndSendAsync = %v, want ErrInvalidRequest with %q", err, tc.want)
			}
		})
	}
}

// TestInvalidRequests: a request the caller got wrong is refused with
// ErrInvalidRequest (and a message that says what is wrong), nothing
// started; a request refused for another reason is not.
func TestInvalidRequests(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 16)
	gen := newInst(t, s, testCfg(), 16)
	creq, _ := startSend(t, sender, 3, 8)
	op := creq.ContextPhase
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"respond with a generation request", func() error {
			return sender.t.RespondAndSendAsync(&Request{ID: 1, Type: GenerationOnly, Blocks: [][]kvcache.BlockID{{1}}})
		}, "want context_only"},
		{"respond with blocks for two ranks", func() error {
			return sender.t.RespondAndSendAsync(&Request{ID: 1, Type: ContextOnly, Blocks: [][]kvcache.BlockID{{1}, {2}}})
		}, "blocks for 2 ranks"},
		{"respond with a DP rank and no attention DP", func() error {
			return sender.t.RespondAndSendAsync(&Request{ID: 1, Type: ContextOnly, DPRank: 1, Blocks: [][]kvcache.BlockID{{1}}})
		}, "without attention DP"},
		{"respond with an id in flight", func() error {
			return sender.t.RespondAndSendAsync(&Request{ID: 3, Type: ContextOnly, Blocks: [][]kvcache.BlockID{{1}}})
		}, "already in flight"},
		{"receive with a context request", func() error {
			return gen.t.RequestAndReceiveAsync(&Request{ID: 1, Type: ContextOnly, Blocks: [][]kvcache.BlockID{{1}}, ContextPhase: op})
		}, "want generation_only"},
		{"receive without an opaque state", func() error {
			return gen.t.RequestAndReceiveAsync(&Request{ID: 1, Type: GenerationOnly, Blocks: [][]kvcache.BlockID{{1}}})
		}, "no context phase params"},
		{"receive with blocks for two ranks", func() error {
			return gen.t.RequestAndReceiveAsync(&Request{ID: 1, Type: GenerationOnly, Blocks: [][]kvcache.BlockID{{1}, {2}}, ContextPhase: op})
		}, "blocks for 2 ranks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v, want ErrInvalidRequest with %q", err, tc.want)
			}
		})
	}
	bad := &ContextPhaseParams{CtxRequestID: 3, OpaqueState: []byte("junk")}
	if err := gen.t.RequestAndReceiveAsync(&Request{ID: 2, Type: GenerationOnly, Blocks: [][]kvcache.BlockID{{1}}, ContextPhase: bad}); !errors.Is(err, ErrBadOpaqueState) || errors.Is(err, ErrInvalidRequest) {
		t.Errorf("a junk opaque state: %v, want ErrBadOpaqueState and not ErrInvalidRequest", err)
	}
	gb := genReqFor(gen, t, creq, 2)
	if err := gen.t.RequestAndReceiveSync(t.Context(), gb); err != nil {
		t.Fatalf("the pull after the refusals: %v", err)
	}
	gen.release(t, gb.Blocks)
	waitDone(t, creq, 10*time.Second)
}
