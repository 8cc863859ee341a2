package tcp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/internal/accept"
	"github.com/kvxfer/kvxfer/internal/hugepage"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// Grace periods of cancel and close. A frame in flight is given this long to
// finish once its transfer is cancelled; after that its connection is closed,
// since a half-written or half-read frame cannot be resumed.
const (
	writeGrace  = time.Second // Send: a frame write after ctx ended; an ABORT
	cancelGrace = time.Second // Recv.Cancel: fallback before closing connections
)

// closeLogEvery is the interval of Transport.closes. Tests that check the
// close of each of a series of bad connections set it to 0 before Open.
var closeLogEvery = time.Second

// rcvLowat is how many bytes of a frame a reader that found its socket
// empty waits for before it is woken (SO_RCVLOWAT, see sysReader).
const rcvLowat = 1 << 20

func init() { transport.RegisterOpen("tcp", Open) }

// Transport is the tcp data plane of one rank: a listener that receives
// frames into the memory of armed receipts, and a pool of connections per
// peer that sends. See the package documentation for the protocol.
//
// Lock order: Transport.mu, peer.mu and outConn.mu are never held together,
// except that Transport.mu may be held while a connection's read deadline is
// set. The write lock of an outConn (a channel) may be held while taking
// peer.mu or outConn.mu, never the other way round.
type Transport struct {
	opts         transport.Options
	log          *slog.Logger
	ln           net.Listener
	endpoint     string
	session      uint64      // our sender session, sent in every connection preface
	adviceLogged atomic.Bool // RegisterMemory logged that huge pages were refused
	// retire is how long a pooled outbound connection may stay unused:
	// 3/4 of Options.IdleTimeout (0: forever).
	retire time.Duration
	// srvTLS and cliTLS are clones of Options.TLS; nil without TLS.
	srvTLS, cliTLS *tls.Config
	// rcvLowat: rcvLowat, or what a test set before any connection came.
	rcvLowat int
	// closes logs the accepted connections closed for breaking the
	// protocol or failing the TLS handshake: any process that reaches the
	// listener can open them, so a line a second per cause, not one each.
	closes *netlimit.RateLog

	done chan struct{} // closed when Close starts
	// life ends when Close starts (endLife): the context of work that
	// outlives the call that started it (the ABORTs delivered late).
	life      context.Context
	endLife   context.CancelFunc
	closeOnce sync.Once

	sends sync.WaitGroup // in-flight Sends; Add only under mu while !closed
	wg    sync.WaitGroup // accept loop, inbound readers, outbound watchers, late ABORTs

	mu       sync.Mutex
	closed   bool
	receipts *receipt.Table[filling]
	ops      map[*sendOp]struct{} // in-flight Sends
	inbound  map[*inConn]struct{}
	sessions map[uint64]*session // inbound sender sessions by id
	peers    map[string]*peer    // outbound pools by endpoint
}

var _ transport.Transport = (*Transport)(nil)

// Open listens on opts.ListenAddr (after opts.WithDefaults) and starts
// accepting data connections. The goroutines it starts stop in Close. ctx
// bounds only the opening itself. FrameBytes of 64 or more is rounded down
// to a multiple of 64, which keeps frames aligned in the receiver's memory
// as they are in the kernel's buffers (see wire.go).
func Open(ctx context.Context, opts transport.Options) (*Transport, error) {
	opts = opts.WithDefaults()
	if opts.FrameBytes >= frameAlign {
		opts.FrameBytes &^= frameAlign - 1
	}
	var srvTLS, cliTLS *tls.Config
	if opts.TLS != nil {
		if opts.TLS.Server == nil || opts.TLS.Client == nil {
			return nil, errors.New("tcp: open: Options.TLS needs both a Server and a Client config")
		}
		srvTLS, cliTLS = opts.TLS.Server.Clone(), opts.TLS.Client.Clone()
		// Bulk data: full-size records from the first byte.
		cliTLS.DynamicRecordSizingDisabled = true
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", opts.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("tcp: open: %w", err)
	}
	ep := ln.Addr().String()
	if len(ep) > maxEndpoint {
		ln.Close()
		return nil, fmt.Errorf("tcp: open: endpoint %q longer than %d bytes", ep, maxEndpoint)
	}
	log := opts.Logger.With("backend", "tcp", "endpoint", ep)
	t := &Transport{
		opts:     opts,
		log:      log,
		ln:       ln,
		endpoint: ep,
		session:  receipt.Rand64(),
		retire:   max(opts.IdleTimeout*3/4, 0),
		srvTLS:   srvTLS,
		cliTLS:   cliTLS,
		rcvLowat: rcvLowat,
		closes:   netlimit.NewRateLog(log, closeLogEvery),
		done:     make(chan struct{}),
		ops:      make(map[*sendOp]struct{}),
		inbound:  make(map[*inConn]struct{}),
		sessions: make(map[uint64]*session),
		peers:    make(map[string]*peer),
	}
	t.life, t.endLife = context.WithCancel(context.Background())
	t.receipts = receipt.NewTable(receipt.Config[filling]{
		Format:    descFormat,
		Endpoint:  ep,
		Lock:      &t.mu,
		Interrupt: t.interrupt,
		Stuck:     t.unstick,
		Grace:     cancelGrace,
	})
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Name returns "tcp", or "tcp(tls)" when the data connections are TLS.
func (t *Transport) Name() string {
	if t.srvTLS != nil {
		return "tcp(tls)"
	}
	return "tcp"
}

// Endpoint returns the listener's address, host:port.
func (t *Transport) Endpoint() string { return t.endpoint }

// Close stops the data plane. In-flight Sends stop at their next frame
// boundary and tell their receivers (ABORT); then every connection and the
// listener close, pending receipts fail with a *transport.ClosedError, and
// Close waits for every goroutine of the Transport. Close takes at most a few
// grace periods when a peer has stopped reading. Idempotent; a concurrent
// second Close waits for the first.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		t.receipts.CloseLocked()
		ops := make([]*sendOp, 0, len(t.ops))
		for op := range t.ops {
			ops = append(ops, op)
		}
		t.mu.Unlock()
		close(t.done)
		t.endLife()
		for _, op := range ops {
			op.cancel(&transport.ClosedError{Op: "send"})
		}
		t.sends.Wait() // Sends may still write ABORTs on pooled connections

		t.ln.Close()
		t.mu.Lock()
		for r := range t.receipts.AllLocked() {
			r.FinishLocked(&transport.ClosedError{Op: "receive"})
		}
		conns, peers := slices.Collect(maps.Keys(t.inbound)), slices.Collect(maps.Values(t.peers))
		t.mu.Unlock()
		for _, c := range conns {
			c.raw.Close()
		}
		for _, p := range peers {
			p.closeAll()
		}
		t.wg.Wait()
	})
	return nil
}

// accept runs until the listener closes. Inbound connections beyond
// opts.MaxConns, or MaxConnsPerHost from one host, are closed at once (a
// silent one that is within them is closed at its preface deadline).
func (t *Transport) accept() {
	defer t.wg.Done()
	ln := netlimit.NewListener(t.ln, "tcp data "+t.endpoint,
		netlimit.Limits{MaxConns: t.opts.MaxConns, MaxConnsPerHost: t.opts.MaxConnsPerHost}, t.opts.Logger, nil)
	accept.Loop("tcp", t.log, t.done, ln.Accept, t.admit)
}

// admit starts the reader of an accepted connection, unless t is closed.
func (t *Transport) admit(nc net.Conn) bool {
	c := &inConn{nc: nc, raw: nc, remote: nc.RemoteAddr().String()}
	if t.srvTLS != nil {
		// The handshake runs in the connection's reader (readLoop),
		// bounded by prefaceTimeout, so that a slow or hostile client
		// does not hold up the accept loop.
		c.nc = tls.Server(nc, t.srvTLS)
	}
	c.vr = newVecReader(c.nc, c.raw, t.rcvLowat)
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		nc.Close()
		return true
	}
	t.inbound[c] = struct{}{}
	t.wg.Add(1)
	t.mu.Unlock()
	go t.serve(c)
	return true
}

// DescriptorHost returns the host of the endpoint that desc names: where
// a Send with desc connects (transport.Dialer).
func (t *Transport) DescriptorHost(desc transport.Descriptor) (string, error) {
	d, err := descFormat.Decode(desc)
	if err != nil {
		return "", err
	}
	host, _, err := net.SplitHostPort(d.Endpoint)
	if err != nil {
		return "", fmt.Errorf("tcp: %w: endpoint %q: %v", transport.ErrBadDescriptor, d.Endpoint, err)
	}
	return host, nil
}

// RegisterMemory advises huge pages for mem, the pool a rank sends from
// and receives into (hugepage.Advise): the kernel copies a socket's bytes
// to and from huge pages with fewer TLB misses. It never fails on the
// advice (a refusal is logged once); mem stays the caller's, and nothing
// else of it changes: tcp needs no registration to move it.
func (t *Transport) RegisterMemory(mem []byte, _ *os.File) error {
	if len(mem) == 0 {
		return errors.New("tcp: register memory: empty region")
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return &transport.ClosedError{Op: "register memory"}
	}
	hugepage.AdviseLogged(mem, t.log, "tcp", "", &t.adviceLogged)
	return nil
}
