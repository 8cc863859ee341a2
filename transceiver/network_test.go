package transceiver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/kvxfer/kvxfer/internal/memnet"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

// The deadline tests run under testing/synctest: inside a bubble time is
// fake and moves only when every goroutine of the bubble is durably
// blocked, so a deadline passes at its exact time with no real wait. A
// goroutine waiting on a real socket is not durably blocked (the runtime's
// poller is outside the bubble), so the instances of those tests run on
// memNetwork: control connections over internal/memnet and data planes
// that copy between the ranks' memory, every wait of them on a channel.

// memNetwork is an in-memory network for instances (Options.network). It
// must be made inside the bubble that uses it.
type memNetwork struct {
	*memnet.Network
	mu     sync.Mutex
	planes map[string]*memPlane // by endpoint
	opened int
}

func newMemNetwork() *memNetwork {
	return &memNetwork{Network: memnet.New(), planes: map[string]*memPlane{}}
}

// withNetwork makes an instance listen, dial and move its data on nw.
func withNetwork(nw *memNetwork) func(*Options) {
	return func(o *Options) { o.network = nw }
}

// bubble runs f in a testing/synctest bubble with a fresh memNetwork.
func bubble(t *testing.T, f func(t *testing.T, nw *memNetwork)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) { f(t, newMemNetwork()) })
}

func (n *memNetwork) Listen(_ context.Context, host string) (net.Listener, error) {
	return n.Network.Listen(host)
}

// OpenData opens a memPlane whatever the backend's name.
func (n *memNetwork) OpenData(_ context.Context, name string, _ transport.Options) (transport.Transport, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.opened++
	p := &memPlane{n: n, ep: "mem-" + strconv.Itoa(n.opened) + "-" + name, recvs: map[uint64]*memRecv{}}
	n.planes[p.ep] = p
	return p, nil
}

// memPlane is a data plane of a memNetwork: Send copies into the
// receiver's memory at once. It keeps the transport.Transport contract
// (TestMemPlaneConformance runs the backends' suite on it): data for a
// receipt that has ended is dropped (as tcp's), a closed plane fails its
// receipts and sends with transport.ClosedError, a send to a closed one
// fails with ErrPeerLost, a send whose ctx has ended aborts the receipt.
type memPlane struct {
	n  *memNetwork
	ep string

	mu     sync.Mutex
	closed bool
	last   uint64
	recvs  map[uint64]*memRecv
}

func (p *memPlane) Name() string     { return "mem" }
func (p *memPlane) Endpoint() string { return p.ep }

func (p *memPlane) Expect(dst [][]byte) (transport.Recv, error) {
	total := 0
	for _, d := range dst {
		total += len(d)
	}
	if total == 0 {
		return nil, errors.New("memplane: expect of 0 bytes")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, &transport.ClosedError{Op: "expect"}
	}
	p.last++
	r := &memRecv{p: p, id: p.last, dst: dst, total: total, done: make(chan struct{})}
	p.recvs[r.id] = r
	return r, nil
}

func (p *memPlane) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return &transport.ClosedError{Op: "send"}
	}
	ep, idText, ok := strings.Cut(string(desc), "#")
	id, err := strconv.ParseUint(idText, 10, 64)
	if !ok || err != nil {
		return fmt.Errorf("%w: %q", transport.ErrBadDescriptor, desc)
	}
	p.n.mu.Lock()
	to := p.n.planes[ep]
	p.n.mu.Unlock()
	if to == nil {
		return fmt.Errorf("%w: send to %s: closed", transport.ErrPeerLost, ep)
	}
	total := 0
	for _, s := range src {
		total += len(s)
	}
	to.mu.Lock()
	r := to.recvs[id]
	if r != nil && r.total != total {
		to.mu.Unlock()
		return fmt.Errorf("%w: %d bytes sent, %d expected", transport.ErrBadDescriptor, total, r.total)
	}
	delete(to.recvs, id)
	closed = to.closed
	to.mu.Unlock()
	switch {
	case closed:
		return fmt.Errorf("%w: send to %s: closed", transport.ErrPeerLost, ep)
	case r == nil:
		return nil // the receipt has ended: its data is dropped
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		r.end(transport.ErrAborted)
		return &transport.TimeoutError{Op: "send", Peer: ep, Err: ctx.Err()}
	case ctx.Err() != nil:
		r.end(transport.ErrAborted)
		return fmt.Errorf("memplane: send to %s: %w", ep, ctx.Err())
	}
	r.mu.Lock()
	if !r.ended {
		d, off := 0, 0
		for _, s := range src {
			for len(s) > 0 {
				n := copy(r.dst[d][off:], s)
				s, off = s[n:], off+n
				if off == len(r.dst[d]) {
					d, off = d+1, 0
				}
			}
		}
	}
	r.mu.Unlock()
	r.end(nil)
	return nil
}

func (p *memPlane) Close() error {
	p.n.mu.Lock()
	delete(p.n.planes, p.ep)
	p.n.mu.Unlock()
	p.mu.Lock()
	p.closed = true
	recvs := p.recvs
	p.recvs = nil
	p.mu.Unlock()
	for _, r := range recvs {
		r.end(&transport.ClosedError{Op: "receive"})
	}
	return nil
}

// memRecv is one receipt of a memPlane.
type memRecv struct {
	p     *memPlane
	id    uint64
	dst   [][]byte
	total int
	done  chan struct{}

	mu    sync.Mutex
	ended bool
	err   error
}

func (r *memRecv) Descriptor() transport.Descriptor {
	return transport.Descriptor(r.p.ep + "#" + strconv.FormatUint(r.id, 10))
}

func (r *memRecv) Done() <-chan struct{} { return r.done }

func (r *memRecv) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

func (r *memRecv) Cancel() {
	r.p.mu.Lock()
	delete(r.p.recvs, r.id)
	r.p.mu.Unlock()
	r.end(transport.ErrCanceled)
}

// end ends the receipt with err, once.
func (r *memRecv) end(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.ended {
		r.ended, r.err = true, err
		close(r.done)
	}
}

// heldBy counts the ranks of in that still hold the request of side with
// instance id reqID.
func heldBy(in *inst, s side, reqID uint64) int {
	n := 0
	for _, r := range in.t.ranks {
		r.mu.Lock()
		for k, q := range r.reqs {
			if k.side == s && q.reqID == reqID {
				n++
			}
		}
		r.mu.Unlock()
	}
	return n
}

// TestMemPlaneConformance holds memPlane to the suite every backend passes,
// so that the deadline tests' data plane keeps the transport contract.
func TestMemPlaneConformance(t *testing.T) {
	transporttest.RunOptions(t, func(t *testing.T) (a, b transport.Transport) {
		nw := newMemNetwork()
		a, _ = nw.OpenData(t.Context(), "a", transport.Options{})
		b, _ = nw.OpenData(t.Context(), "b", transport.Options{})
		return a, b
	}, transporttest.Options{SkipLarge: true}) // a test double: one copy, whatever the size
}
