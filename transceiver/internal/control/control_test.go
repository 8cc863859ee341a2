package control

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/internal/memnet"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The tests run in testing/synctest bubbles, over an in-memory network
// (internal/memnet): time is the bubble's fake clock, which moves only when
// every goroutine of the bubble is blocked, so timeouts pass at their exact
// time, with no real wait.

// handler records what a Plane hands it.
type handler struct {
	busy   atomic.Bool
	frames chan wire.Frame
	lost   chan lostConn
}

type lostConn struct {
	c   *Conn
	err error
}

func newHandler() *handler {
	return &handler{frames: make(chan wire.Frame, 64), lost: make(chan lostConn, 64)}
}

func (h *handler) Frame(c *Conn, f wire.Frame, dialled bool) error {
	h.frames <- f
	return nil
}

func (h *handler) Lost(c *Conn, err error) { h.lost <- lostConn{c, err} }

func (h *handler) Busy(*Conn) bool { return h.busy.Load() }

// waitLost returns the connection the handler has been told is lost, once
// every goroutine of the bubble waits; it fails t when there is none.
func (h *handler) waitLost(t *testing.T) lostConn {
	t.Helper()
	synctest.Wait()
	select {
	case l := <-h.lost:
		return l
	default:
		t.Fatal("no connection lost")
		return lostConn{}
	}
}

type counter struct{ opened, closed, refused, idle atomic.Int64 }

func (o *counter) Opened() { o.opened.Add(1) }
func (o *counter) Closed() { o.closed.Add(1) }
func (o *counter) Refused(reason string) {
	if reason == netlimit.ReasonHandshakeTimeout {
		o.refused.Add(1)
	}
}
func (o *counter) IdleClosed() { o.idle.Add(1) }

type testPlane struct {
	*Plane
	h   *handler
	obs *counter
}

// newPlane starts a Plane listening on nw; the test closes it.
func newPlane(t *testing.T, nw *memnet.Network, lim Limits, rank uint32) testPlane {
	t.Helper()
	ln, err := nw.Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	h, obs := newHandler(), &counter{}
	p := New(Config{Listener: ln, Dial: nw.Dial, Name: "control test", Limits: lim, Observer: obs,
		Log: slog.New(slog.DiscardHandler), Hello: wire.Hello{Rank: rank, Host: "test", Backends: []string{"tcp"}, Endpoints: []string{"tcp-ep"}}}, h)
	p.Start()
	t.Cleanup(func() { p.Close() })
	return testPlane{p, h, obs}
}

// rawPeer is a listener the test answers by hand: serve runs for each
// connection it accepts, in the accept goroutine's own goroutine.
type rawPeer struct {
	ln      net.Listener
	accepts atomic.Int64
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
}

func newRawPeer(t *testing.T, nw *memnet.Network, serve func(c net.Conn, br *bufio.Reader)) *rawPeer {
	t.Helper()
	ln, err := nw.Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	rp := &rawPeer{ln: ln}
	rp.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			rp.accepts.Add(1)
			rp.mu.Lock()
			rp.conns = append(rp.conns, c)
			rp.mu.Unlock()
			rp.wg.Go(func() { serve(c, bufio.NewReader(c)) })
		}
	})
	t.Cleanup(rp.close)
	return rp
}

func (rp *rawPeer) close() {
	rp.ln.Close()
	rp.mu.Lock()
	for _, c := range rp.conns {
		c.Close()
	}
	rp.mu.Unlock()
	rp.wg.Wait()
}

// TestDialSharesOneAttempt: concurrent Dials of one endpoint share one
// connection attempt and get one Conn.
func TestDialSharesOneAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		gate := make(chan struct{})
		rp := newRawPeer(t, nw, func(c net.Conn, br *bufio.Reader) {
			if _, err := wire.Read(br); err != nil {
				return
			}
			<-gate
			wire.Write(c, &wire.Hello{Version: wire.Version, Rank: 3, Host: "h", Backends: []string{"tcp"}, Endpoints: []string{"e"}})
			io.Copy(io.Discard, c)
		})
		p := newPlane(t, nw, Limits{}, 0)
		const n = 8
		conns := make([]*Conn, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				c, release, err := p.Dial(context.Background(), rp.ln.Addr().String())
				if err != nil {
					t.Error(err)
					return
				}
				release()
				conns[i] = c
			})
		}
		synctest.Wait() // every Dial waits on the attempt, which waits on the gate
		close(gate)
		wg.Wait()
		for i, c := range conns {
			if c == nil || c != conns[0] {
				t.Fatalf("Dial %d got %p, Dial 0 %p", i, c, conns[0])
			}
		}
		if a := rp.accepts.Load(); a != 1 {
			t.Errorf("%d connections made, want 1", a)
		}
		if peer := conns[0].Peer(); peer.Rank != 3 || peer.Host != "h" || peer.Endpoint != rp.ln.Addr().String() || !conns[0].Dialled() {
			t.Errorf("peer %+v", peer)
		}
		if p.Dialled() != 1 || p.Len() != 1 {
			t.Errorf("%d dialled, %d open; want 1, 1", p.Dialled(), p.Len())
		}
	})
}

// TestDeadConnRedialled: a cached connection that has died, whether its
// reader has seen it yet or not, is replaced by a new one.
func TestDeadConnRedialled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{}, 1)
		c := newPlane(t, nw, Limits{}, 2)
		ep := s.Endpoint()
		dial := func() *Conn {
			t.Helper()
			cc, release, err := c.Dial(context.Background(), ep)
			if err != nil {
				t.Fatal(err)
			}
			release()
			return cc
		}
		c1 := dial()
		if c1.Peer().Rank != 1 {
			t.Fatalf("peer rank %d, want 1", c1.Peer().Rank)
		}
		if again := dial(); again != c1 {
			t.Fatal("a live cached connection was not reused")
		}

		// closed by the peer
		s.mu.Lock()
		for _, sc := range s.conns {
			sc.close(errors.New("test"))
		}
		s.mu.Unlock()
		if l := c.h.waitLost(t); l.c != c1 || !errors.Is(l.err, io.EOF) {
			t.Fatalf("closed by the peer: lost %p (%v), want %p (EOF)", l.c, l.err, c1)
		}
		if c.Conn(c1.ID()) != nil {
			t.Error("closed by the peer: a lost connection is still looked up")
		}
		c2 := dial()
		if c2 == c1 || c2.ID() == c1.ID() {
			t.Fatal("closed by the peer: the dead connection was dialled again")
		}
		c1 = c2

		// closed here, before its reader saw it
		c1.close(errors.New("test"))
		c2 = dial()
		if c2 == c1 || c2.isDead() {
			t.Fatal("closed here: a dead cached connection was returned")
		}
		if err := c1.Send(&wire.Ping{}); !errors.Is(err, ErrPeerLost) {
			t.Errorf("Send on a dead Conn = %v, want ErrPeerLost", err)
		}
		c.h.waitLost(t)
		if o := s.obs.opened.Load(); o != 3 {
			t.Errorf("%d connections accepted, want 3", o)
		}
	})
}

// TestCached: Cached returns a live connection of the dial cache, held as
// Dial holds it, and nothing (dialling nothing) when there is none.
func TestCached(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{}, 1)
		c := newPlane(t, nw, Limits{}, 2)
		ep := s.Endpoint()
		if cc, _, ok, err := c.Cached(ep); ok || cc != nil || err != nil {
			t.Fatalf("Cached before any Dial = %v %v %v, want nothing", cc, ok, err)
		}
		if c.Dialled() != 0 {
			t.Fatalf("Cached started a dial (%d in the dial cache)", c.Dialled())
		}
		c1, release, err := c.Dial(context.Background(), ep)
		if err != nil {
			t.Fatal(err)
		}
		release()
		cc, release, ok, err := c.Cached(ep)
		if !ok || err != nil || cc != c1 {
			t.Fatalf("Cached after Dial = %p %v %v, want %p", cc, ok, err, c1)
		}
		c.mu.Lock()
		users, takes := c1.users, c1.takes
		c.mu.Unlock()
		if users != 1 || takes != 2 {
			t.Errorf("held by Cached: %d users, %d takes; want 1, 2", users, takes)
		}
		release()
		release() // once only
		c.mu.Lock()
		users = c1.users
		c.mu.Unlock()
		if users != 0 {
			t.Errorf("%d users after release, want 0", users)
		}
		c1.close(errors.New("test"))
		if cc, _, ok, _ := c.Cached(ep); ok || cc != nil {
			t.Fatal("Cached returned a dead connection")
		}
		c.h.waitLost(t)
	})
}

// TestHandshakeTimeout: an accepted connection that sends no hello is
// closed once the handshake timeout has passed, not a moment before.
func TestHandshakeTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{HandshakeTimeout: time.Second}, 0)
		raw, err := nw.Dial(context.Background(), s.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		start := time.Now()
		time.Sleep(time.Second - time.Nanosecond)
		synctest.Wait()
		if s.obs.refused.Load() != 0 || s.Len() != 1 {
			t.Fatal("closed before the timeout")
		}
		if _, err := raw.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			t.Fatalf("read = %v, want EOF", err)
		}
		if waited := time.Since(start); waited != time.Second {
			t.Errorf("closed after %v, want 1s", waited)
		}
		if s.obs.refused.Load() != 1 {
			t.Errorf("%d handshake timeouts counted, want 1", s.obs.refused.Load())
		}
		s.h.waitLost(t)
	})
}

// TestIdleNotWhileBusy: an accepted connection is not closed as idle while
// the Handler says it is busy, and is at the idle timeout once it is not.
func TestIdleNotWhileBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{IdleTimeout: 100 * time.Millisecond}, 0)
		c := newPlane(t, nw, Limits{IdleTimeout: time.Hour}, 1) // not idle within the test
		s.h.busy.Store(true)
		_, release, err := c.Dial(context.Background(), s.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		release()
		time.Sleep(250 * time.Millisecond) // two idle timeouts and a half
		synctest.Wait()
		if s.obs.idle.Load() != 0 || s.Len() != 1 {
			t.Fatal("a busy connection was closed as idle")
		}
		s.h.busy.Store(false)
		// The check after 300ms finds it idle.
		time.Sleep(50*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if s.obs.idle.Load() != 0 {
			t.Fatal("closed as idle before the wait it was busy in ended")
		}
		time.Sleep(time.Nanosecond)
		if l := c.h.waitLost(t); !errors.Is(l.err, io.EOF) {
			t.Errorf("the dialler lost its connection with %v, want EOF", l.err)
		}
		s.h.waitLost(t)
		if s.obs.idle.Load() != 1 {
			t.Errorf("%d idle closes, want 1", s.obs.idle.Load())
		}
	})
}

// TestDialledIdle: a dialled connection leaves the dial cache and closes at
// 3/4 of the idle timeout, not while a Dial holds it.
func TestDialledIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{IdleTimeout: time.Hour}, 0)
		c := newPlane(t, nw, Limits{IdleTimeout: 400 * time.Millisecond}, 1)
		_, release, err := c.Dial(context.Background(), s.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		synctest.Wait()
		if c.Dialled() != 1 {
			t.Fatal("closed while a Dial holds it")
		}
		release() // idle from now: the next check, at 600ms, waits 300ms from it
		time.Sleep(300*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if c.Dialled() != 1 {
			t.Fatal("closed before 3/4 of the idle timeout")
		}
		time.Sleep(time.Nanosecond)
		if l := c.h.waitLost(t); !errors.Is(l.err, errIdle) {
			t.Errorf("lost with %v, want idle", l.err)
		}
		if c.Dialled() != 0 {
			t.Error("the idle connection is still in the dial cache")
		}
	})
}

// TestVersionMismatch: a peer of another protocol version is refused, in
// both directions.
func TestVersionMismatch(t *testing.T) {
	t.Run("accepted", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			nw := memnet.New()
			s := newPlane(t, nw, Limits{}, 0)
			raw, err := nw.Dial(context.Background(), s.Endpoint())
			if err != nil {
				t.Fatal(err)
			}
			defer raw.Close()
			if err := wire.Write(raw, &wire.Hello{Version: wire.Version + 1}); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(raw)
			f, err := wire.Read(br)
			if err != nil {
				t.Fatal(err)
			}
			r, ok := f.(*wire.Refused)
			if !ok || r.Code != wire.RefusedVersion || !strings.Contains(r.Reason, fmt.Sprintf("control protocol version %d, this context rank speaks %d", wire.Version+1, wire.Version)) {
				t.Fatalf("got %#v, want a version refusal", f)
			}
			if _, err := wire.Read(br); !errors.Is(err, io.EOF) {
				t.Errorf("after the refusal: %v, want EOF", err)
			}
			s.h.waitLost(t)
		})
	})
	t.Run("dialled", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			nw := memnet.New()
			rp := newRawPeer(t, nw, func(c net.Conn, br *bufio.Reader) {
				if _, err := wire.Read(br); err == nil {
					wire.Write(c, &wire.Refused{Code: wire.RefusedVersion, Reason: "speaks 9"})
				}
			})
			p := newPlane(t, nw, Limits{}, 0)
			_, _, err := p.Dial(context.Background(), rp.ln.Addr().String())
			if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "speaks 9") {
				t.Fatalf("Dial = %v, want ErrRefused with the reason", err)
			}
			if p.Dialled() != 0 {
				t.Error("a failed attempt stayed in the dial cache")
			}
		})
	})
}

// TestDialCheck: Dial asks the peer policy before it dials anything.
func TestDialCheck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		ln, err := nw.Listen("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		no := errors.New("not allowed")
		dialled := false
		p := New(Config{Listener: ln, Log: slog.New(slog.DiscardHandler),
			Dial: func(ctx context.Context, ep string) (net.Conn, error) {
				dialled = true
				return nw.Dial(ctx, ep)
			},
			DialCheck: func(string) error { return no }}, newHandler())
		defer p.Close()
		if _, _, err := p.Dial(context.Background(), ln.Addr().String()); err != no {
			t.Fatalf("Dial = %v, want the check's error", err)
		}
		if _, _, ok, err := p.Cached(ln.Addr().String()); ok || err != no {
			t.Fatalf("Cached = %v, %v; want the check's error", ok, err)
		}
		if dialled || p.Dialled() != 0 {
			t.Errorf("a refused endpoint was dialled (%v) or entered the dial cache (%d)", dialled, p.Dialled())
		}
	})
}

// TestTCP: a Plane without Config.Dial dials over TCP, and accepts from
// a TCP listener.
func TestTCP(t *testing.T) {
	var ps [2]testPlane
	for i := range ps {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		h, obs := newHandler(), &counter{}
		p := New(Config{Listener: ln, Name: "control test", Observer: obs, Log: slog.New(slog.DiscardHandler),
			Hello: wire.Hello{Rank: uint32(i), Host: "test"}}, h)
		p.Start()
		defer p.Close()
		ps[i] = testPlane{p, h, obs}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, release, err := ps[1].Dial(ctx, ps[0].Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if c.Peer().Rank != 0 {
		t.Fatalf("peer rank %d, want 0", c.Peer().Rank)
	}
	// The ping crosses, its pong comes back (TestPing): a frame each way.
	if err := c.Send(&wire.Ping{Nonce: 7}); err != nil {
		t.Fatal(err)
	}
	select {
	case f := <-ps[1].h.frames:
		if p, ok := f.(*wire.Pong); !ok || p.Nonce != 7 {
			t.Fatalf("got %s, want the pong of the ping", f.Type())
		}
	case <-ctx.Done():
		t.Fatal("no frame arrived over TCP")
	}
}

// TestCloseEndsEverything: Close ends the accept loop, every reader, a
// handshake waiting for its hello and a dial in progress, tells the
// Handler, and is idempotent; Dial after it fails with ErrClosed. No
// goroutine outlives the bubble (synctest.Test would fail).
func TestCloseEndsEverything(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		silent := newRawPeer(t, nw, func(c net.Conn, br *bufio.Reader) { io.Copy(io.Discard, br) }) // never answers
		s := newPlane(t, nw, Limits{HandshakeTimeout: time.Hour}, 0)
		c := newPlane(t, nw, Limits{IdleTimeout: time.Hour}, 1)
		if _, release, err := c.Dial(context.Background(), s.Endpoint()); err != nil {
			t.Fatal(err)
		} else {
			release()
		}
		raw, err := nw.Dial(context.Background(), s.Endpoint()) // shakes no hands
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		pending := make(chan error, 1)
		go func() {
			_, _, err := c.Dial(context.Background(), silent.ln.Addr().String())
			pending <- err
		}()
		synctest.Wait()
		if silent.accepts.Load() != 1 || s.Len() != 2 {
			t.Fatalf("%d silent accepts, %d connections open; want 1 and 2", silent.accepts.Load(), s.Len())
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-pending; !errors.Is(err, ErrPeerLost) && !errors.Is(err, ErrClosed) {
			t.Errorf("the dial in progress ended with %v", err)
		}
		if l := c.h.waitLost(t); !errors.Is(l.err, ErrClosed) {
			t.Errorf("the dialled connection was lost with %v, want ErrClosed", l.err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		s.h.waitLost(t)
		s.h.waitLost(t)
		if err := s.Close(); err != nil {
			t.Errorf("second Close = %v", err)
		}
		if _, _, err := c.Dial(context.Background(), s.Endpoint()); !errors.Is(err, ErrClosed) {
			t.Errorf("Dial after Close = %v, want ErrClosed", err)
		}
		if s.Len() != 0 || c.Len() != 0 {
			t.Errorf("%d and %d connections open after Close", s.Len(), c.Len())
		}
		silent.close()
		synctest.Wait()
		if silent.accepts.Load() != 1 {
			t.Errorf("%d silent accepts, want 1", silent.accepts.Load())
		}
	})
	goleak.VerifyNone(t)
}

// TestSendGathers: a Send made while another's write blocks returns at
// once, its frame queued, and the writer writes it after its own; frames
// sent at once from many goroutines all arrive whole, each sender's in its
// order. A write that fails kills the connection.
func TestSendGathers(t *testing.T) {
	a, b := net.Pipe() // a Write blocks until it is read
	defer b.Close()
	c := newConn(a, true)
	defer c.close(errors.New("test over"))
	br := bufio.NewReader(b)
	read := func() uint64 {
		t.Helper()
		f, err := wire.Read(br)
		if err != nil {
			t.Fatal(err)
		}
		return f.(*wire.Ping).Nonce
	}

	first := make(chan error, 1)
	go func() { first <- c.Send(&wire.Ping{Nonce: 0}) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		c.wmu.Lock()
		w := c.writing
		c.wmu.Unlock()
		if w {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the first Send never started its write")
		}
	}
	for i := uint64(1); i <= 10; i++ {
		if err := c.Send(&wire.Ping{Nonce: i}); err != nil { // returns: the pipe is not read yet
			t.Fatal(err)
		}
	}
	for i := uint64(0); i <= 10; i++ {
		if n := read(); n != i {
			t.Fatalf("frame %d arrived as frame %d", n, i)
		}
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}

	const senders, each = 8, 50
	var wg sync.WaitGroup
	for s := range senders {
		wg.Go(func() {
			for i := range each {
				if err := c.Send(&wire.Ping{Nonce: uint64(s)<<32 | uint64(i)}); err != nil {
					t.Errorf("sender %d frame %d: %v", s, i, err)
					return
				}
			}
		})
	}
	next := make([]uint64, senders)
	for got := 0; got < senders*each; got++ {
		n := read()
		s, i := n>>32, n&(1<<32-1)
		if s >= senders || i != next[s] {
			t.Fatalf("frame %d: sender %d frame %d out of order", got, s, i)
		}
		next[s]++
	}
	wg.Wait()

	b.Close()
	if err := c.Send(&wire.Ping{}); !errors.Is(err, ErrPeerLost) {
		t.Fatalf("Send after the peer closed = %v, want ErrPeerLost", err)
	}
	if !c.isDead() {
		t.Fatal("a failed write left the connection alive")
	}
	if err := c.Send(&wire.Ping{}); !errors.Is(err, ErrPeerLost) {
		t.Fatalf("Send on a dead Conn = %v, want ErrPeerLost", err)
	}
}

// TestConnProbe: Probe runs its function once per Conn whoever calls it
// and however many at once; callers during the run wait for its answer;
// Probed says nothing until it is given.
func TestConnProbe(t *testing.T) {
	var c Conn
	if err, ok := c.Probed(); ok || err != nil {
		t.Fatalf("Probed before any Probe: %v, %v", err, ok)
	}
	answer := errors.New("shm endpoint not reachable")
	release := make(chan struct{})
	var runs atomic.Int32
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.Probe(func() error { runs.Add(1); <-release; return answer })
		}()
	}
	time.Sleep(10 * time.Millisecond)
	if _, ok := c.Probed(); ok {
		t.Error("Probed answered while the probe runs")
	}
	close(release)
	wg.Wait()
	if n := runs.Load(); n != 1 {
		t.Errorf("the probe ran %d times, want 1", n)
	}
	for i, err := range errs {
		if err != answer {
			t.Errorf("caller %d got %v, want the probe's answer", i, err)
		}
	}
	if err, ok := c.Probed(); !ok || err != answer {
		t.Errorf("Probed after: %v, %v", err, ok)
	}
	if err := c.Probe(func() error { t.Error("a second probe ran"); return nil }); err != answer {
		t.Errorf("a later Probe: %v", err)
	}
}

// TestPing: a Ping is the Plane's own: it answers with a Pong of the same
// nonce, without the Handler, in either direction; the Pong, like any
// other frame, goes to the Handler of the side that pinged.
func TestPing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{}, 0)
		c := newPlane(t, nw, Limits{}, 1)
		cc, release, err := c.Dial(context.Background(), s.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		if err := cc.Send(&wire.Ping{Nonce: 42}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		select {
		case f := <-c.h.frames:
			if p, ok := f.(*wire.Pong); !ok || p.Nonce != 42 {
				t.Fatalf("the dialler got %#v, want a Pong with nonce 42", f)
			}
		default:
			t.Fatal("no Pong came back to the dialler")
		}
		if len(s.h.frames) != 0 {
			t.Fatalf("the accepting side's Handler was handed %d frames for a Ping", len(s.h.frames))
		}
	})
}

// TestAcceptedHelloNotKept: a stranger's hello may carry up to MaxBackends
// endpoints of MaxBlob bytes and a MaxBlob state; an accepted connection
// keeps none of that (its side never reads them), so that each connection
// a stranger holds open after its hello, until the idle timeout, costs the
// rank its reader and not about 140 KiB of the stranger's choosing.
func TestAcceptedHelloNotKept(t *testing.T) {
	const conns = 64
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		s := newPlane(t, nw, Limits{}, 0)
		big := &wire.Hello{Version: wire.Version, Rank: 1, State: make([]byte, wire.MaxBlob), Host: strings.Repeat("h", wire.MaxName)}
		for i := range wire.MaxBackends {
			big.Backends = append(big.Backends, strings.Repeat(string(rune('a'+i)), wire.MaxName))
			big.Endpoints = append(big.Endpoints, strings.Repeat(string(rune('A'+i)), wire.MaxBlob))
		}
		hello, err := wire.Append(nil, big)
		if err != nil {
			t.Fatal(err)
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var raws []net.Conn
		for range conns {
			raw, err := nw.Dial(context.Background(), s.Endpoint())
			if err != nil {
				t.Fatal(err)
			}
			defer raw.Close()
			if _, err := raw.Write(hello); err != nil {
				t.Fatal(err)
			}
			if f, err := wire.Read(bufio.NewReader(raw)); err != nil || f.Type() != wire.TypeHello {
				t.Fatalf("answer to the hello: %v %v", f, err)
			}
			raws = append(raws, raw)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		per := (int64(after.HeapAlloc) - int64(before.HeapAlloc)) / conns
		t.Logf("%d bytes of heap per accepted connection after a hello of %d bytes", per, len(hello))
		if per > int64(len(hello))/3 {
			t.Errorf("each accepted connection holds %d bytes of heap after a hello of %d bytes, want at most %d", per, len(hello), len(hello)/3)
		}
		if s.Len() != conns {
			t.Errorf("%d connections open, want %d", s.Len(), conns)
		}
		runtime.KeepAlive(raws)
	})
}
