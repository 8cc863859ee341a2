package transceiver

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
)

// The driver's asks with AUTO on one host, where the choice of a pair's
// backend waits for the probe of the peer's shm endpoint (one per control
// connection, see internal/link), and what becomes of an ask, its request and
// the rank when that probe takes long, never answers, or outlives the
// control connection. Every test here ends with the harness's checks
// (pools back to their free count, no staging buffer in use) and
// TestMain's goleak.

// probeGate is a rank's shm data plane whose probes the test answers:
// each call is counted and announced on entered, then waits for an answer
// on answer or for the probe's context to end.
type probeGate struct {
	transport.Transport
	calls   atomic.Int32
	entered chan struct{}
	answer  chan error
}

func (g *probeGate) Probe(ctx context.Context, endpoint string) error {
	g.calls.Add(1)
	select {
	case g.entered <- struct{}{}:
	default:
	}
	select {
	case err := <-g.answer:
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// gateProbes puts a probeGate in front of the shm data plane of every
// rank of in, before any transfer.
func gateProbes(t *testing.T, in *inst) []*probeGate {
	t.Helper()
	var gs []*probeGate
	for _, r := range in.t.ranks {
		r.mu.Lock()
		tr, ok := r.transports["shm"]
		if !ok {
			r.mu.Unlock()
			t.Fatalf("rank %d has no shm data plane open (AUTO on this host)", r.idx)
		}
		g := &probeGate{Transport: tr, entered: make(chan struct{}, 16), answer: make(chan error, 16)}
		r.transports["shm"] = g
		r.mu.Unlock()
		gs = append(gs, g)
	}
	return gs
}

// pull is a transfer from a sender instance to a generation instance in
// flight: the context request, the generation request, the reference data
// and both sides' blocks.
type pull struct {
	creq, greq *Request
	l          *layout.Logical
	cb, gb     [][]kvcache.BlockID
}

// startPull starts request id (tokens tokens of seed's data) on both
// sides without waiting; the sender's blocks are back to the transceiver
// only.
func startPull(t *testing.T, sender, gen *inst, id uint64, tokens int, seed uint64) *pull {
	t.Helper()
	l, err := layout.NewLogical(sender.state.Shape, tokens)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(seed)
	nb := layout.NumBlocks(tokens, sender.state.Shape.TokensPerBlock)
	p := &pull{l: l, cb: sender.alloc(t, 0, nb)}
	sender.fill(t, l, 0, p.cb)
	p.creq = &Request{ID: id, Type: ContextOnly, Blocks: p.cb}
	if err := sender.t.RespondAndSendAsync(p.creq); err != nil {
		t.Fatalf("request %d: RespondAndSendAsync: %v", id, err)
	}
	sender.release(t, p.cb)
	p.gb = gen.alloc(t, 0, nb)
	p.greq = &Request{ID: id + 1<<32, Type: GenerationOnly, Blocks: p.gb,
		ContextPhase: &ContextPhaseParams{CtxRequestID: p.creq.ContextPhase.CtxRequestID, OpaqueState: p.creq.ContextPhase.OpaqueState}}
	if err := gen.t.RequestAndReceiveAsync(p.greq); err != nil {
		t.Fatalf("request %d: RequestAndReceiveAsync: %v", id, err)
	}
	return p
}

// wantOK waits for both sides of p to succeed, checks the data and gives
// the generation blocks back; it returns the generation side's figures.
func (p *pull) wantOK(t *testing.T, gen *inst, within time.Duration) Stats {
	t.Helper()
	waitDone(t, p.greq, within)
	waitDone(t, p.creq, within)
	if p.greq.Err() != nil || p.creq.Err() != nil {
		t.Fatalf("request %d: generation side %v, context side %v", p.creq.ID, p.greq.Err(), p.creq.Err())
	}
	gen.verify(t, p.l, 0, p.gb)
	gen.release(t, p.gb)
	return p.greq.Stats()
}

func autoCfg() *config.CacheTransceiver {
	return testCfg(func(c *config.CacheTransceiver) { c.Backend = config.BackendAuto })
}

func waitEntered(t *testing.T, g *probeGate) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no probe of the peer's shm endpoint within 10s")
	}
}

// TestProbePendingSharedByAsks: while the probe of a peer is unanswered,
// a second request to that peer finds the connection in the dial cache
// but may not choose yet (ask with mayWait false reports false): it waits
// on a goroutine for the same probe instead of running its own. Both then
// take the fallback the answer implies, and a third request, asked once
// the answer is known, chooses at once without a probe.
func TestProbePendingSharedByAsks(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, autoCfg(), 16)
	gen := newInst(t, s, autoCfg(), 16)
	g := gateProbes(t, gen)[0]

	first := startPull(t, sender, gen, 1, 8, 1)
	waitEntered(t, g)
	// The second ask must not wait for the probe on the caller's
	// goroutine (RequestAndReceiveAsync runs the first effects there).
	start := time.Now()
	second := startPull(t, sender, gen, 2, 8, 2)
	if d := time.Since(start); d > time.Second {
		t.Errorf("RequestAndReceiveAsync took %v with the peer's probe unanswered", d)
	}
	// Neither may end while the probe is unanswered (their deadline is
	// 10s away): the choice of backend waits for it.
	time.Sleep(50 * time.Millisecond)
	if ended(first.greq) || ended(second.greq) {
		t.Fatalf("a receive ended before the probe was answered: %v, %v", first.greq.Err(), second.greq.Err())
	}
	unreachable := errors.New("test: the peer's shm endpoint is not reachable")
	g.answer <- unreachable
	for _, p := range []*pull{first, second} {
		if st := p.wantOK(t, gen, 10*time.Second); st.Backend == "" || st.Backend == "shm" {
			t.Errorf("request %d over %q with shm unreachable, want a fallback", p.creq.ID, st.Backend)
		}
	}
	third := startPull(t, sender, gen, 3, 8, 3)
	if st := third.wantOK(t, gen, 10*time.Second); st.Backend == "" || st.Backend == "shm" {
		t.Errorf("request 3 over %q with shm known unreachable, want a fallback", st.Backend)
	}
	if n := g.calls.Load(); n != 1 {
		t.Errorf("%d probes of one peer over one connection, want 1", n)
	}
}

// TestProbeReachedThenCached: a probe that answers yes makes the pair
// shm, and later requests over the same connection take shm from the
// kept answer without probing again.
func TestProbeReachedThenCached(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, autoCfg(), 16)
	gen := newInst(t, s, autoCfg(), 16)
	g := gateProbes(t, gen)[0]
	g.answer <- nil
	for i := range 4 {
		p := startPull(t, sender, gen, uint64(i+1), 8, uint64(i))
		if st := p.wantOK(t, gen, 10*time.Second); st.Backend != "shm" {
			t.Errorf("request %d over %q, want shm", i+1, st.Backend)
		}
	}
	if n := g.calls.Load(); n != 1 {
		t.Errorf("%d probes of one peer over one connection, want 1", n)
	}
}

// TestProbeNeverAnsweredClose: a probe that never answers does not hold
// the rank's Close (the probe's context is the rank's life, which Close
// ends), and the receive waiting for it ends with the close.
func TestProbeNeverAnsweredClose(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, autoCfg(), 16)
	gen := newInst(t, s, autoCfg(), 16)
	g := gateProbes(t, gen)[0]
	p := startPull(t, sender, gen, 1, 8, 1)
	waitEntered(t, g)
	start := time.Now()
	if err := gen.t.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	// The probe's own bound is 5s: Close must not wait for it.
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Close took %v with a probe unanswered", d)
	}
	waitDone(t, p.greq, time.Second)
	if !errors.Is(p.greq.Err(), ErrClosed) {
		t.Errorf("receive: %v, want ErrClosed", p.greq.Err())
	}
	gen.release(t, p.gb)
	// The sender's request was never asked: cancel it.
	sender.t.Cancel(p.creq)
	waitDone(t, p.creq, 5*time.Second)
}

// TestProbeOutlivesConnection: the control connection to the peer dies
// while the probe of the peer runs, and the probe then answers yes. The
// receive must fail at once with the peer's loss (the request-info has
// nowhere to go), not wait for its deadline; the rank stays usable.
func TestProbeOutlivesConnection(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, autoCfg(), 16)
	gen := newInst(t, s, autoCfg(), 16)
	g := gateProbes(t, gen)[0]
	p := startPull(t, sender, gen, 1, 8, 1)
	waitEntered(t, g)
	if err := sender.t.Close(); err != nil {
		t.Errorf("sender Close: %v", err)
	}
	waitDone(t, p.creq, 5*time.Second)
	// The gen side sees the connection die (its reader ends) before the
	// probe answers.
	waitFor(t, 5*time.Second, "the gen rank's control connection gone", func() bool { return gen.t.ranks[0].ctrl.Len() == 0 })
	g.answer <- nil
	start := time.Now()
	waitDone(t, p.greq, 5*time.Second)
	if err := p.greq.Err(); err == nil || errors.Is(err, ErrTimeout) {
		t.Errorf("receive over a lost connection: %v, want a failure other than the deadline", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the receive took %v to fail after the probe answered", d)
	}
	gen.release(t, p.gb)

	// A new sender on the same host: a new connection, a new probe.
	sender2 := newInst(t, s, autoCfg(), 16)
	g.answer <- nil
	q := startPull(t, sender2, gen, 2, 8, 2)
	if st := q.wantOK(t, gen, 10*time.Second); st.Backend != "shm" {
		t.Errorf("after the loss: over %q, want shm", st.Backend)
	}
	if n := g.calls.Load(); n != 2 {
		t.Errorf("%d probes over two connections, want 2", n)
	}
}

// TestCloseDuringPulls closes the generation instance at a random moment
// of a burst of pulls, several times over: Close returns, every request
// ends, no staging buffer stays taken and no goroutine is left (the
// harness and TestMain check), whatever the moment (asks, dials, probes,
// chunks in flight).
func TestCloseDuringPulls(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	rng := rand.New(rand.NewPCG(7, uint64(time.Now().UnixNano())))
	for round := range 6 {
		cfg := testCfg()
		if round%2 == 1 {
			cfg = autoCfg()
		}
		t.Run(string(cfg.Backend), func(t *testing.T) {
			sender := newInst(t, s, cfg, 64)
			gen := newInst(t, s, cfg, 64)
			var ps []*pull
			for i := range 6 {
				ps = append(ps, startPull(t, sender, gen, uint64(i+1), 4+4*i, uint64(i)))
			}
			time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
			start := time.Now()
			if err := gen.t.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("Close took %v", d)
			}
			for _, p := range ps {
				waitDone(t, p.greq, time.Second)
				if err := p.greq.Err(); err != nil && !errors.Is(err, ErrClosed) {
					t.Errorf("request %d: %v, want success or ErrClosed", p.creq.ID, err)
				}
				gen.release(t, p.gb)
				sender.t.Cancel(p.creq)
				waitDone(t, p.creq, 10*time.Second)
			}
		})
	}
}
