package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// heldProxy forwards TCP connections to a target, but only once it is
// let go: until then it accepts them and leaves them unanswered, as a
// receiver that stalls (a paused process, a machine swapping) would.
type heldProxy struct {
	ln     net.Listener
	target string
	hold   chan struct{} // closed by release
	once   sync.Once
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

func newHeldProxy(t *testing.T, target string) *heldProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &heldProxy{ln: ln, target: target, hold: make(chan struct{})}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *heldProxy) addr() string { return p.ln.Addr().String() }
func (p *heldProxy) release()     { p.once.Do(func() { close(p.hold) }) }

func (p *heldProxy) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *heldProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.track(c)
		p.wg.Go(func() { p.forward(c) })
	}
}

// forward pipes c to the target once the proxy is released; an end on
// either side ends both.
func (p *heldProxy) forward(c net.Conn) {
	<-p.hold
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	p.track(u)
	var wg sync.WaitGroup
	pipe := func(dst, src net.Conn) {
		io.Copy(dst, src)
		dst.Close()
		src.Close()
	}
	wg.Go(func() { pipe(u, c) })
	pipe(c, u)
	wg.Wait()
}

func (p *heldProxy) close() {
	p.release()
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// TestAbortReachesStalledReceiver: a Send that times out while its receiver
// is stalled for longer than the ABORT's grace still fails the receipt once
// the receiver answers again, instead of leaving it armed until its owner's
// deadline.
func TestAbortReachesStalledReceiver(t *testing.T) {
	a := open(t, transport.Options{})
	b := open(t, transport.Options{})
	proxy := newHeldProxy(t, b.Endpoint())

	const n = 1 << 20
	r, err := b.Expect([][]byte{make([]byte, n)})
	if err != nil {
		t.Fatal(err)
	}
	desc := descFormat.Encode(receipt.Descriptor{Endpoint: proxy.addr(), Tag: tagOf(t, r), Total: n})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	serr := a.Send(ctx, desc, [][]byte{make([]byte, n)})
	var te *transport.TimeoutError
	if !errors.As(serr, &te) {
		t.Fatalf("Send = %v, want a TimeoutError", serr)
	}
	select {
	case <-r.Done():
		t.Fatalf("receipt ended while the receiver was stalled: %v", r.Err())
	default:
	}

	proxy.release()
	select {
	case <-r.Done():
	case <-time.After(15 * time.Second):
		r.Cancel()
		t.Fatal("receipt of the timed-out Send still armed 15 s after its receiver answered again")
	}
	if !errors.Is(r.Err(), transport.ErrAborted) {
		t.Errorf("receipt Err = %v, want ErrAborted", r.Err())
	}
}

// TestLateAbortEnds: the delivery of a late ABORT ends with the Transport's
// Close, and at once when the receiver refuses its connection, rather than
// at abortPatience.
func TestLateAbortEnds(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(a *Transport, proxy *heldProxy)
	}{
		{"Close", func(a *Transport, _ *heldProxy) { a.Close() }},
		{"refused", func(_ *Transport, proxy *heldProxy) {
			proxy.target = "127.0.0.1:1" // nothing listens there: the proxy closes what it forwards
			proxy.release()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := open(t, transport.Options{})
			proxy := newHeldProxy(t, "")
			const n = 64 << 10
			desc := descFormat.Encode(receipt.Descriptor{Endpoint: proxy.addr(), Tag: 7, Total: n})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			if err := a.Send(ctx, desc, [][]byte{make([]byte, n)}); err == nil {
				t.Fatal("Send to a receiver that never answers succeeded")
			}
			if !a.abortsPending(proxy.addr()) {
				t.Fatal("no late ABORT pending after the Send")
			}
			start := time.Now()
			tc.end(a, proxy)
			eventually(t, "late ABORT given up", func() bool { return !a.abortsPending(proxy.addr()) })
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("late ABORT given up after %v, want well under abortPatience (%v)", d, abortPatience)
			}
		})
	}
}

// abortsPending reports whether late ABORTs to ep are being delivered.
func (t *Transport) abortsPending(ep string) bool {
	t.mu.Lock()
	p := t.peers[ep]
	t.mu.Unlock()
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.aborting
}
