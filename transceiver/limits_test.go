package transceiver

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// connCounter is an Observer and ConnObserver that counts control
// connections and remembers the most open at once.
type connCounter struct {
	open, peak, idle        atomic.Int64
	maxConns, perHost, hsTO atomic.Int64
}

func (c *connCounter) TransferStarted(string) {}
func (c *connCounter) TransferEnded(Record)   {}
func (c *connCounter) ControlConnOpened() {
	n := c.open.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
}
func (c *connCounter) ControlConnClosed()     { c.open.Add(-1) }
func (c *connCounter) ControlConnIdleClosed() { c.idle.Add(1) }
func (c *connCounter) ControlConnRefused(reason string) {
	switch reason {
	case RefusedMaxConns:
		c.maxConns.Add(1)
	case RefusedMaxConnsPerHost:
		c.perHost.Add(1)
	case RefusedHandshakeTimeout:
		c.hsTO.Add(1)
	}
}

// withLimits sets the instance's connection limits, observer and logger.
func withLimits(lim ConnLimits, obs Observer, log *slog.Logger) func(*Options) {
	return func(o *Options) {
		o.Limits, o.Observer = lim, obs
		if log != nil {
			o.Logger = log
		}
	}
}

// hostileHello connects to a control endpoint from local address from and
// completes the handshake as a generation rank would. It returns the
// connection, or nil when the rank refused it (closed before its hello).
func hostileHello(t *testing.T, endpoint, from string, st []byte) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", endpoint)
	if errors.Is(err, syscall.ECONNRESET) {
		return nil // refused before Dial returned
	}
	if err != nil {
		t.Error(err)
		return nil
	}
	return helloOn(t, c, st)
}

// memHello is hostileHello on an in-memory network.
func memHello(t *testing.T, nw *memNetwork, endpoint, from string, st []byte) net.Conn {
	t.Helper()
	c, err := nw.DialFrom(t.Context(), from, endpoint)
	if err != nil {
		t.Error(err)
		return nil
	}
	return helloOn(t, c, st)
}

// helloOn completes the handshake on c as a generation rank would; it
// returns c, or nil when the rank refused it (closed before its hello).
func helloOn(t *testing.T, c net.Conn, st []byte) net.Conn {
	t.Helper()
	b, _ := wire.Append(nil, &wire.Hello{Version: wire.Version, State: st, Host: "hostile", Backends: []string{"tcp"}, Endpoints: []string{"127.0.0.1:1"}})
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(b); err != nil {
		c.Close()
		return nil
	}
	f, err := wire.Read(bufio.NewReader(c))
	c.SetDeadline(time.Time{})
	if err != nil {
		c.Close()
		return nil
	}
	if _, ok := f.(*wire.Hello); !ok {
		t.Errorf("hostile hello answered with %s", f.Type())
		c.Close()
		return nil
	}
	return c
}

// closedWithin reports whether the peer closed c within d.
func closedWithin(c net.Conn, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	_, err := c.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// waitFor polls cond for up to d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after %v", what, d)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestControlFloodAfterHello is issue #10's flood: 1,000 control
// connections that complete their hello and then sit idle. The per-host cap
// refuses the excess, the idle timeout closes the rest, the goroutines go
// back to where they were, and transfers work before, during and after.
func TestControlFloodAfterHello(t *testing.T) {
	const (
		flood   = 1000
		perHost = 200
		idle    = time.Second
	)
	cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	cfg := testCfg()
	obs := &connCounter{}
	var logs syncbuf.Buffer
	lim := ConnLimits{MaxControlConns: 1000, MaxControlConnsPerHost: perHost, IdleTimeout: idle, HandshakeTimeout: 5 * time.Second}
	sender := newInst(t, cs, cfg, 64, withLimits(lim, obs, slog.New(slog.NewTextHandler(&logs, nil))))
	gen := newInst(t, cs, cfg, 64, withLimits(ConnLimits{IdleTimeout: idle}, nil, nil))
	base := runtime.NumGoroutine()

	transfer(t, sender, gen, 1, 40, 1, 0, 0)
	st, _ := cs.MarshalBinary()
	ep := sender.t.Endpoints()[0]
	var (
		mu   sync.Mutex
		held []net.Conn
		wg   sync.WaitGroup
		next atomic.Int64
	)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= flood {
				if c := hostileHello(t, ep, "127.0.0.2", st); c != nil {
					mu.Lock()
					held = append(held, c)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	// During the flood (its connections held open), from another host.
	transfer(t, sender, gen, 2, 40, 2, 0, 0)

	if got := obs.peak.Load(); got > perHost+1 { // +1: the generation rank's own
		t.Errorf("%d control connections open at once, per-host cap %d", got, perHost)
	}
	// The refusal is counted before the refused connection is closed; the
	// wait only bounds a slow machine.
	waitFor(t, 5*time.Second, "every flood connection answered or counted as refused", func() bool {
		return int(obs.perHost.Load())+len(held) >= flood
	})
	if obs.perHost.Load() == 0 || int(obs.perHost.Load())+len(held) != flood {
		t.Errorf("%d hellos answered and %d refused (per host), want %d in all with some refused", len(held), obs.perHost.Load(), flood)
	}
	// The idle timeout closes every connection that stayed.
	for _, c := range held {
		if !closedWithin(c, 3*idle) {
			t.Fatal("a hostile connection was still open after its idle timeout")
		}
	}
	// (Besides the workers the ranks keep for their next transfers,
	// bounded by maxIdleWorkers a rank.)
	waitFor(t, 5*time.Second, "goroutines back to where they were", func() bool {
		return runtime.NumGoroutine() <= base+2+sender.idleWorkers()+gen.idleWorkers()
	})
	if obs.idle.Load() < int64(len(held)) {
		t.Errorf("%d idle closes counted, %d hostile connections closed", obs.idle.Load(), len(held))
	}
	if !strings.Contains(logs.String(), "reason=max_conns_per_host") {
		t.Errorf("no refusal logged:\n%s", logs.String())
	}
	if n := strings.Count(logs.String(), "connection refused"); n > 5 {
		t.Errorf("%d refusal lines in a burst of %d refusals: not rate-limited", n, obs.perHost.Load())
	}
	// After: the generation rank closed its own idle connection before the
	// context rank did, and dials again.
	transfer(t, sender, gen, 3, 40, 3, 0, 0)
}

// TestControlConnCaps: the total and per-host caps, their reasons, and a
// freed place, with deterministic counts (no idle timeout). It runs in a
// synctest bubble (network_test.go).
func TestControlConnCaps(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		obs := &connCounter{}
		sender := newInst(t, cs, testCfg(), 16, withLimits(ConnLimits{MaxControlConns: 4, MaxControlConnsPerHost: 2, IdleTimeout: -1}, obs, nil), withNetwork(nw))
		st, _ := cs.MarshalBinary()
		ep := sender.t.Endpoints()[0]
		var held []net.Conn
		t.Cleanup(func() {
			for _, c := range held {
				c.Close()
			}
		})
		for _, tc := range []struct {
			from string
			ok   bool
		}{
			{"127.0.0.2", true}, {"127.0.0.2", true}, {"127.0.0.2", false}, // per host
			{"127.0.0.3", true}, {"127.0.0.3", true}, {"127.0.0.4", false}, // total
		} {
			c := memHello(t, nw, ep, tc.from, st)
			if (c != nil) != tc.ok {
				t.Fatalf("connection from %s served: %v, want %v", tc.from, c != nil, tc.ok)
			}
			if c != nil {
				held = append(held, c)
			}
		}
		if obs.perHost.Load() != 1 || obs.maxConns.Load() != 1 {
			t.Errorf("refused %d per host and %d in all, want 1 and 1", obs.perHost.Load(), obs.maxConns.Load())
		}
		if got := obs.open.Load(); got != 4 {
			t.Errorf("%d open, want 4", got)
		}
		held[0].Close()
		synctest.Wait()
		if got := obs.open.Load(); got != 3 {
			t.Fatalf("%d open after one closed, want 3", got)
		}
		if c := memHello(t, nw, ep, "127.0.0.4", st); c == nil {
			t.Fatal("refused after a place was freed")
		} else {
			held = append(held, c)
		}
		// Without an idle timeout, nothing closes them, however long.
		time.Sleep(24 * time.Hour)
		synctest.Wait()
		if got := obs.open.Load(); got != 4 || obs.idle.Load() != 0 {
			t.Fatalf("after a day without an idle timeout: %d open, %d closed as idle; want 4 and 0", got, obs.idle.Load())
		}
		if closedWithin(held[1], time.Millisecond) {
			t.Fatal("a connection was closed without an idle timeout")
		}
	})
}

// TestControlHandshakeTimeout: a connection that never completes its hello
// (silent, or a few bytes of it) is closed at the handshake timeout, not a
// moment before, and counted; one within the timeout is served.
func TestControlHandshakeTimeout(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		const hs = 200 * time.Millisecond
		cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		obs := &connCounter{}
		sender := newInst(t, cs, testCfg(), 16, withLimits(ConnLimits{HandshakeTimeout: hs}, obs, nil), withNetwork(nw))
		ep := sender.t.Endpoints()[0]
		for i, prefix := range [][]byte{nil, {0x40, 0, 0}} {
			c, err := nw.Dial(t.Context(), ep)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.Write(prefix)
			start := time.Now()
			time.Sleep(hs - time.Nanosecond)
			synctest.Wait()
			if obs.open.Load() != 1 || obs.hsTO.Load() != int64(i) {
				t.Fatalf("prefix %x: closed before its handshake timeout", prefix)
			}
			if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("prefix %x: read %v, want the connection closed", prefix, err)
			}
			if waited := time.Since(start); waited != hs {
				t.Fatalf("prefix %x: closed after %v, want %v", prefix, waited, hs)
			}
		}
		synctest.Wait()
		if obs.hsTO.Load() != 2 {
			t.Fatalf("%d handshake timeouts counted, want 2", obs.hsTO.Load())
		}
		st, _ := cs.MarshalBinary()
		c, err := nw.Dial(t.Context(), ep)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(hs - time.Nanosecond) // a hello just in time
		if c := helloOn(t, c, st); c == nil {
			t.Fatal("a hello within the handshake timeout was refused")
		} else {
			c.Close()
		}
		synctest.Wait()
		if obs.open.Load() != 0 || obs.hsTO.Load() != 2 {
			t.Errorf("%d connections open, %d handshake timeouts; want 0 and 2", obs.open.Load(), obs.hsTO.Load())
		}
	})
}

// TestDialledConnIdle: the generation side closes its idle dialled
// connection (at 3/4 of the idle timeout) before the context side would,
// and a later request dials a new one; requests keep working across it.
func TestDialledConnIdle(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		lim := ConnLimits{IdleTimeout: 400 * time.Millisecond}
		senderObs := &connCounter{}
		sender := newInst(t, cs, testCfg(), 64, withLimits(lim, senderObs, nil), withNetwork(nw))
		gen := newInst(t, cs, testCfg(), 64, withLimits(lim, nil, nil), withNetwork(nw))
		transfer(t, sender, gen, 1, 40, 1, 0, 0)
		r := gen.t.ranks[0]
		dialled := func() int { return r.ctrl.Dialled() }
		synctest.Wait() // both ends wait for their next frame, from now
		if dialled() != 1 {
			t.Fatalf("%d dialled connections after a transfer, want 1", dialled())
		}
		time.Sleep(300*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if dialled() != 1 || senderObs.open.Load() != 1 {
			t.Fatalf("before 3/4 of the idle timeout: %d dialled, %d accepted", dialled(), senderObs.open.Load())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if dialled() != 0 || senderObs.open.Load() != 0 {
			t.Fatalf("at 3/4 of the idle timeout: %d dialled, %d accepted; want both closed", dialled(), senderObs.open.Load())
		}
		if senderObs.idle.Load() != 0 {
			t.Errorf("the context side closed %d connections as idle: the dialler should have first", senderObs.idle.Load())
		}
		transfer(t, sender, gen, 2, 40, 2, 0, 0)
		if senderObs.peak.Load() != 1 {
			t.Errorf("peak %d open control connections, want 1", senderObs.peak.Load())
		}
	})
}

// TestPeerClosedIdleConn: a context rank with a shorter idle timeout than
// its dialler closes the cached connection first; the dialler drops it
// from its cache when it sees the close, and the next request dials anew.
func TestPeerClosedIdleConn(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNetwork) {
		cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
		senderObs := &connCounter{}
		sender := newInst(t, cs, testCfg(), 64, withLimits(ConnLimits{IdleTimeout: 200 * time.Millisecond}, senderObs, nil), withNetwork(nw))
		gen := newInst(t, cs, testCfg(), 64, withNetwork(nw))
		transfer(t, sender, gen, 1, 40, 1, 0, 0)
		r := gen.t.ranks[0]
		synctest.Wait()
		time.Sleep(200*time.Millisecond - time.Nanosecond)
		synctest.Wait()
		if r.ctrl.Dialled() != 1 || senderObs.idle.Load() != 0 {
			t.Fatalf("before the context side's idle timeout: %d dialled, %d idle closes; want 1 and 0", r.ctrl.Dialled(), senderObs.idle.Load())
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if r.ctrl.Dialled() != 0 {
			t.Fatal("the closed connection is still in the dial cache")
		}
		if senderObs.idle.Load() != 1 {
			t.Errorf("%d idle closes on the context side, want 1", senderObs.idle.Load())
		}
		transfer(t, sender, gen, 2, 40, 2, 0, 0)
		if senderObs.peak.Load() != 1 || senderObs.open.Load() != 1 {
			t.Errorf("peak %d, open %d control connections, want 1 and 1", senderObs.peak.Load(), senderObs.open.Load())
		}
	})
}

// TestRefusalFloodLogBounded: a stranger who completes a hello and then
// streams request-infos (unknown ids, and a real id with wrong tokens) gets
// every one refused, but buys no log line per frame: the rank's log grows
// by a bounded number of lines however long the flood, and the request
// asked for is still pulled by its owner.
func TestRefusalFloodLogBounded(t *testing.T) {
	const asks = 400
	cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	var logs syncbuf.Buffer
	sender := newInst(t, cs, testCfg(), 16, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })
	gen := newInst(t, cs, testCfg(), 16)
	creq, l := startSend(t, sender, 9, 8)
	st, _ := cs.MarshalBinary()
	c := hostileHello(t, sender.t.Endpoints()[0], "127.0.0.1", st)
	if c == nil {
		t.Fatal("the hostile hello was refused")
	}
	defer c.Close()
	var out []byte
	for i := range asks {
		ri := &wire.RequestInfo{CtxRequestID: 1000 + uint64(i), GenRequestID: uint64(i + 1), GenState: st, NumBlocks: 2, Backend: "tcp"}
		if i%2 == 1 { // the real id, a wrong token
			ri.CtxRequestID, ri.Token = creq.ID, [16]byte{0: byte(i), 1: byte(i >> 8), 15: 1}
		}
		out, _ = wire.Append(out, ri)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	go c.Write(out) // the answers are read meanwhile: neither side blocks on a full buffer
	br := bufio.NewReader(c)
	for i := range asks {
		f, err := wire.Read(br)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		if r, ok := f.(*wire.Refused); !ok || r.Code != wire.RefusedUnknown {
			t.Fatalf("answer %d: %#v, want a refusal as unknown", i, f)
		}
	}
	if n := strings.Count(logs.String(), "request-info"); n > 4 {
		t.Errorf("%d log lines about request-infos for a flood of %d refused asks: one line per frame a stranger sends", n, asks)
	}
	gb := genReqFor(gen, t, creq, 2)
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, gb); err != nil {
		t.Fatalf("the owner's pull after the flood: %v", err)
	}
	gen.verify(t, l, 0, gb.Blocks)
	gen.release(t, gb.Blocks)
	waitDone(t, creq, 10*time.Second)
}
