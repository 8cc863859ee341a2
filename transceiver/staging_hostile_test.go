package transceiver

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// heldListener accepts connections and never reads from them: a receiver
// that stopped reading.
func heldListener(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return silentOn(t, ln)
}

// stallStaged has a hostile generation peer, holding a context request's
// token, pull it staged into both of its generation ranks (TP2 against the
// context's TP1: small spans, so the context rank packs each chunk into a
// staging buffer) and name a receiver that never reads for each chunk.
func stallStaged(t *testing.T, sender *inst, creq *Request, gen layout.CacheState) {
	t.Helper()
	var op OpaqueState
	if err := op.UnmarshalBinary(creq.ContextPhase.OpaqueState); err != nil {
		t.Fatal(err)
	}
	st, _ := gen.MarshalBinary()
	held := heldListener(t)
	tr := sender.t.ranks[0].transports["tcp"]
	blocks := len(creq.Blocks)
	var conns []net.Conn
	var chunks []wire.Frame
	// Every rank's request-info first (each generation rank on a control
	// connection of its own, as a generation instance's ranks are): the
	// context rank plans its sends once every rank it serves has asked.
	for g := range gen.Parallel.NumRanks() {
		plan, err := layout.NewPlan(sender.state, 0, gen, g)
		if err != nil {
			t.Fatal(err)
		}
		if directOK(plan, blocks) {
			t.Fatal("the pairing would move directly: the test needs packed chunks")
		}
		rv, err := tr.Expect([][]byte{make([]byte, int64(blocks)*plan.PackedBytesPerBlock())})
		if err != nil {
			t.Fatal(err)
		}
		desc := withEndpoint(t, rv.Descriptor(), tr.Endpoint(), held)
		rv.Cancel()
		c := hostileHello(t, sender.t.Endpoints()[0], "127.0.0.1", st)
		if c == nil {
			t.Fatal("the hostile hello was refused")
		}
		t.Cleanup(func() { c.Close() })
		go func() { // read what the context rank says, so that no control write blocks
			br := bufio.NewReader(c)
			for {
				if _, err := wire.Read(br); err != nil {
					return
				}
			}
		}()
		conns = append(conns, c)
		send(t, c, &wire.RequestInfo{CtxRequestID: creq.ID, GenRequestID: 77, GenRank: uint32(g), Token: op.Token, GenState: st,
			NumBlocks: uint32(blocks), MaxChunkBlocks: uint32(blocks), Backend: "tcp"})
		chunks = append(chunks, &wire.ChunkDesc{CtxRequestID: creq.ID, GenRequestID: 77, Index: 0, Desc: desc})
	}
	for g, c := range conns {
		send(t, c, chunks[g])
	}
}

// send writes f on c.
func send(t *testing.T, c net.Conn, f wire.Frame) {
	t.Helper()
	b, _ := wire.Append(nil, f)
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
}

// TestHostileStagingHold: a peer holding a request's token that takes
// every staging buffer of a context rank and then stops reading does not
// hold up other requests' staged sends until its request's deadline: the
// stalled sends give their buffers back once they have held them past
// ConnLimits.StagingHold while other sends wait, and the other request is
// pulled, bit-exact.
func TestHostileStagingHold(t *testing.T) {
	ctxState := state(2, 4, 16, 4, kvcache.BF16, 1, 1, false)
	genState := state(2, 4, 16, 4, kvcache.BF16, 2, 1, false)
	cfg := testCfg(func(ct *config.CacheTransceiver) {
		ct.KVTransferTimeoutMs = 30_000
		ct.TransferBufferSize = 4 << 20
	})
	var logs syncbuf.Buffer
	sender := newInst(t, ctxState, cfg, 64, func(o *Options) {
		o.Limits.StagingHold = 300 * time.Millisecond
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	gen := newInst(t, genState, cfg, 64)

	hostile, _ := startSend(t, sender, 1, 4*16)
	stallStaged(t, sender, hostile, genState)
	waitFor(t, 10*time.Second, "both staging buffers taken", func() bool { return sender.t.ranks[0].sendBufs.InUse() == 2 })

	creq, l := startSend(t, sender, 2, 4*16)
	if !sender.t.Pulling(hostile) || sender.t.Pulling(creq) {
		t.Errorf("Pulling: %v for the request being pulled, %v for one nobody asked for; want true and false", sender.t.Pulling(hostile), sender.t.Pulling(creq))
	}
	// Stuck for longer than StagingHold (its bytes take well under a
	// millisecond at StagingHoldRate): no longer a pull under way, for the
	// engine's release of unpulled requests, though nobody has waited yet.
	time.Sleep(400 * time.Millisecond)
	if sender.t.Pulling(hostile) || sender.t.ranks[0].sendBufs.InUse() != 2 {
		t.Errorf("a pull stuck past StagingHold: Pulling %v, %d buffers held; want false and 2", sender.t.Pulling(hostile), sender.t.ranks[0].sendBufs.InUse())
	}
	gb := genReqFor(gen, t, creq, 16)
	start := time.Now()
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, gb); err != nil {
		t.Fatalf("the owner's pull while a hostile peer held the staging buffers: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the owner's pull took %v behind the stalled sends, want about StagingHold (300ms)", took)
	}
	gen.verify(t, l, 0, gb.Blocks)
	gen.release(t, gb.Blocks)
	waitDone(t, creq, 10*time.Second)
	// The stalled attempts failed as the peer's (the request stays
	// pullable by its owner), saying why.
	if s := logs.String(); !strings.Contains(s, ErrStalled.Error()) || !strings.Contains(s, "while another transfer waited") {
		t.Errorf("the sender's log does not say a peer stalled:\n%s", s)
	}
	if ended(hostile) {
		t.Errorf("the stalled peer's request ended (%v): a failed pull attempt leaves it pullable", hostile.Err())
	}
}

// stalledContext is a context rank of a hostile peer's making: it answers
// the hello and every request-info with a Ready for staged chunks, takes
// the chunk descriptors and never sends a byte.
func stalledContext(t *testing.T, ctxState layout.CacheState) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	st, _ := ctxState.MarshalBinary()
	return serveOn(t, ln, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			f, err := wire.Read(br)
			if err != nil {
				return
			}
			var out wire.Frame
			switch f := f.(type) {
			case *wire.Hello:
				out = &wire.Hello{Version: wire.Version, State: st, Host: "hostile", Backends: []string{"tcp"}, Endpoints: []string{ln.Addr().String()}}
			case *wire.RequestInfo:
				out = &wire.Ready{CtxRequestID: f.CtxRequestID, GenRequestID: f.GenRequestID, ChunkBlocks: f.MaxChunkBlocks}
			case *wire.Ping:
				out = &wire.Pong{Nonce: f.Nonce}
			}
			if out != nil {
				b, _ := wire.Append(nil, out)
				if _, err := c.Write(b); err != nil {
					return
				}
			}
		}
	})
}

// TestHostileStalledContext: a generation request whose opaque state
// names a context rank that takes the chunk descriptors and never sends
// (any client can hand the generation worker such a state when there is
// no cluster secret; a context worker that hangs does the same) does not
// hold up other requests' staged receives until its deadline: it gives
// its receive buffers back after ConnLimits.StagingHold once another
// receive waits, fails with ErrStalled, and the other request is pulled,
// bit-exact.
func TestHostileStalledContext(t *testing.T) {
	ctxState := state(2, 4, 16, 4, kvcache.BF16, 1, 1, false)
	genState := state(2, 4, 16, 4, kvcache.BF16, 2, 1, false)
	cfg := testCfg(func(ct *config.CacheTransceiver) { ct.KVTransferTimeoutMs = 30_000 })
	sender := newInst(t, ctxState, cfg, 64)
	gen := newInst(t, genState, cfg, 64, func(o *Options) { o.Limits.StagingHold = 300 * time.Millisecond })

	op := OpaqueState{RequestID: 99, Token: [16]byte{1}, State: ctxState, Endpoints: []string{stalledContext(t, ctxState)}}
	ops, err := op.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	hostile := &Request{ID: 99, Type: GenerationOnly, Blocks: gen.alloc(t, 0, 16), ContextPhase: &ContextPhaseParams{CtxRequestID: 99, OpaqueState: ops}}
	if err := gen.t.RequestAndReceiveAsync(hostile); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "both ranks' receive buffers taken", func() bool {
		return gen.t.ranks[0].recvBufs.InUse() == 1 && gen.t.ranks[1].recvBufs.InUse() == 1
	})

	creq, l := startSend(t, sender, 2, 4*16)
	gb := genReqFor(gen, t, creq, 16)
	start := time.Now()
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, gb); err != nil {
		t.Fatalf("the pull behind a stalled context rank: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the pull took %v behind the stalled receives, want about StagingHold (300ms)", took)
	}
	gen.verify(t, l, 0, gb.Blocks)
	gen.release(t, gb.Blocks)
	waitDone(t, creq, 10*time.Second)
	waitDone(t, hostile, 10*time.Second)
	if !errors.Is(hostile.Err(), ErrStalled) {
		t.Errorf("the stalled pull ended with %v, want ErrStalled", hostile.Err())
	}
	gen.release(t, hostile.Blocks)
}
