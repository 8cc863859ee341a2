//go:build linux

package shm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	"github.com/kvxfer/kvxfer/transport/internal/conn"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// Time limits.
const (
	// grace bounds how long a Send whose ctx has ended waits for the
	// receiver to confirm that it stopped reading (and a CANCEL
	// waits to be written); after it the connection is closed.
	grace = time.Second
	// helloTimeout bounds the wait for a new connection's HELLO (both
	// sides), and dialling.
	helloTimeout = 10 * time.Second
	// probeTimeout bounds a Probe whose ctx has no earlier deadline.
	probeTimeout = 5 * time.Second
)

// connCredit bounds the ops a sender keeps open on one connection. A
// variable only so that tests can lower it before they open transports.
var connCredit int64 = maxOpenOps

func init() { transport.RegisterOpen("shm", Open) }

// Transport is the shm data plane of one rank: a listener on an abstract
// Unix socket whose senders post parts in their windows' rings, which it
// copies out of the windows into armed receipts, and one pooled connection
// per receiver endpoint that sends through a window of its own.
// See the package documentation.
//
// Lock order: Transport.mu before inConn.mu and outConn.mu. The write lock
// of an outConn (a channel) may be held while taking outConn.mu or
// Transport.mu, never the other way round; outConn.winMu is taken with no
// other lock held.
type Transport struct {
	log      *slog.Logger
	ln       *net.UnixListener
	endpoint string
	slotLen  int   // bytes of a window slot: the largest part
	credit   int64 // connCredit when opened
	// idle closes an accepted connection that made no progress for this
	// long, after its window (0: never); retire is how long a pooled
	// outbound connection may stay unused: 3/4 of idle (0: forever).
	// Both are Options.IdleTimeout's.
	idle, retire time.Duration
	// epoch is when the Transport opened: outbound connections stamp
	// their last use as the monotonic time since it.
	epoch time.Time

	done chan struct{} // closed when Close starts
	// life ends when Close starts: the context of work that outlives the
	// Send that started it (the ABORTs delivered late).
	life      context.Context
	endLife   context.CancelFunc
	closeOnce sync.Once

	// sends counts in-flight Sends and Probes, and the goroutines that
	// deliver late ABORTs (added by a Send, before it ends); Add only
	// under mu while !closed, or inside a Send.
	sends sync.WaitGroup
	wg    sync.WaitGroup // accept loop, connection readers and workers

	mapped atomic.Int64 // bytes of senders' windows mapped (see maxMapped)

	adviceLogged atomic.Bool // RegisterMemory logged that huge pages were refused

	mu       sync.Mutex
	closed   bool
	receipts *receipt.Table[*rop]
	ops      map[*sendOp]context.CancelCauseFunc // in-flight Sends
	inbound  map[*inConn]struct{}
	peers    map[string]*outConn      // outbound connections by endpoint
	dialing  map[string]chan struct{} // closed when a dial ends
	// aborts holds, per receiver endpoint, the tags whose ABORT no
	// connection took within the grace, left to deliverAborts, which runs
	// while the endpoint has an entry.
	aborts map[string][]uint64

	maxConns int               // inbound connections kept at most (<= 0: no bound)
	refusals *netlimit.RateLog // logs refused connections
	// protoLog logs the accepted connections closed for breaking the
	// protocol (inConn.logEnd).
	protoLog *netlimit.RateLog
}

// protoLogEvery is the interval of Transport.protoLog: a line per
// interval. Tests that check the close of each of a series of malformed
// connections set it to 0 before Open.
var protoLogEvery = time.Second

var (
	_ transport.Transport       = (*Transport)(nil)
	_ transport.MemoryRegistrar = (*Transport)(nil)
	_ transport.Prober          = (*Transport)(nil)
)

// Open listens on a fresh abstract Unix socket, "@kvxfer-shm-" and 128
// random bits in hex, and starts accepting connections. The goroutines it
// starts stop in Close; ctx bounds only the opening.
//
// Of the options, only Logger, MaxConns, IdleTimeout and FrameBytes
// apply: a window slot, the largest part a Send copies at once and so what
// a receiver copies between two checks for cancel, is FrameBytes rounded
// down to a multiple of 4096, at most 1 MiB (0 means
// transport.DefaultFrameBytes). ListenAddr, Streams and MaxConnsPerHost
// are TCP's. The socket has no TCP port, but every process of the host in
// the same network namespace can connect to it (its name is random, not
// secret: /proc/net/unix lists it), so at most MaxConns inbound
// connections are kept, one silent before its window is closed at its
// hello deadline (10 s), and one that made no progress after it (no
// message, no part, no answer) for IdleTimeout is closed then (negative:
// never). A pooled outbound connection unused for 3/4 of IdleTimeout is
// retired and redialled at the next Send (see the package documentation,
// Idle connections).
func Open(ctx context.Context, opts transport.Options) (*Transport, error) {
	opts = opts.WithDefaults()
	slot := min(opts.FrameBytes, maxSlotLen)
	if slot >= 4096 {
		slot &^= 4095
	}
	slot = max(slot&^7, 8) // a multiple of 8 (see WINDOW in wire.go)
	var rnd [16]byte
	rand.Read(rnd[:]) // never fails (see crypto/rand.Read)
	ep := endpointPrefix + hex.EncodeToString(rnd[:])
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "unix", ep)
	if err != nil {
		return nil, fmt.Errorf("shm: open: %w", err)
	}
	t := &Transport{
		log:      opts.Logger.With("backend", "shm", "endpoint", ep),
		ln:       ln.(*net.UnixListener),
		endpoint: ep,
		slotLen:  slot,
		credit:   connCredit,
		idle:     max(opts.IdleTimeout, 0),
		retire:   max(opts.IdleTimeout*3/4, 0),
		epoch:    time.Now(),
		done:     make(chan struct{}),
		ops:      make(map[*sendOp]context.CancelCauseFunc),
		inbound:  make(map[*inConn]struct{}),
		peers:    make(map[string]*outConn),
		dialing:  make(map[string]chan struct{}),
		aborts:   make(map[string][]uint64),
		maxConns: opts.MaxConns,
		refusals: netlimit.NewRateLog(opts.Logger, time.Second),
		protoLog: netlimit.NewRateLog(opts.Logger, protoLogEvery),
	}
	t.life, t.endLife = context.WithCancel(context.Background())
	t.receipts = receipt.NewTable(receipt.Config[*rop]{Format: descFormat, Endpoint: ep, Lock: &t.mu})
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Name returns "shm".
func (t *Transport) Name() string { return "shm" }

// Endpoint returns the abstract socket's name, "@kvxfer-shm-<hex>".
func (t *Transport) Endpoint() string { return t.endpoint }

// Close stops the data plane. In-flight Sends are cancelled as if their ctx
// had ended (CANCEL, then up to the grace period for the receiver's answer)
// and return a *transport.ClosedError; then the listener and every
// connection close, pending receipts fail with a *transport.ClosedError,
// the mappings of peers' regions are unmapped once the goroutines copying
// out of them have stopped, and Close waits for every goroutine of the
// Transport. Registered memory is no longer used when Close returns.
// Idempotent; a concurrent second Close waits for the first.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		t.receipts.CloseLocked()
		cancels := make([]context.CancelCauseFunc, 0, len(t.ops))
		for _, c := range t.ops {
			cancels = append(cancels, c)
		}
		t.mu.Unlock()
		close(t.done)
		t.endLife()
		for _, c := range cancels {
			c(&transport.ClosedError{Op: "send"})
		}
		t.sends.Wait() // the receiving side still serves meanwhile

		t.ln.Close()
		t.mu.Lock()
		for r := range t.receipts.AllLocked() {
			r.FinishLocked(&transport.ClosedError{Op: "receive"})
		}
		conns, outs := slices.Collect(maps.Keys(t.inbound)), slices.Collect(maps.Values(t.peers))
		t.mu.Unlock()
		for _, c := range conns {
			c.nc.Close()
		}
		for _, oc := range outs {
			oc.kill(&transport.ClosedError{Op: "send"})
		}
		t.wg.Wait()
	})
	return nil
}

// accept runs until the listener closes.
func (t *Transport) accept() {
	defer t.wg.Done()
	accept.Loop("shm", t.log, t.done, t.ln.AcceptUnix, t.admit)
}

// admit starts the reader and the worker of an accepted connection, unless
// t is closed or holds opts.MaxConns already.
func (t *Transport) admit(nc *net.UnixConn) bool {
	c := newInConn(t, nc)
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		nc.Close()
		return true
	}
	// Any process of this host (and network namespace) can connect to
	// the abstract socket: bound what they hold. A silent connection
	// within the bound is closed at its hello deadline.
	if t.maxConns > 0 && len(t.inbound) >= t.maxConns {
		t.mu.Unlock()
		nc.Close()
		t.refusals.Warn(netlimit.ReasonMaxConns, "connection refused", "listener", "shm data "+t.endpoint,
			"reason", netlimit.ReasonMaxConns, "limit", t.maxConns)
		return true
	}
	t.inbound[c] = struct{}{}
	t.wg.Add(2) // reader and worker
	t.mu.Unlock()
	go c.work()
	go c.serve()
	return true
}

// RegisterMemory asks the kernel to back mem with transparent huge pages
// (hugepage.Advise), as transport/mpi does: both copies of a Send (the
// sender's out of its pool into the window, the receiver's out of the
// window into its pool) go through the TLB once per page of the pool, and
// Go's heap, where the pools live, is in 4 KiB pages otherwise. Nothing of
// mem is shared with a peer (a Send copies its source into the window of
// the connection), and any memory may still be sent or received:
// registering it only makes the copies faster. The contents are kept,
// nothing outside mem is touched, f is not used. The advice is best effort
// (a kernel without transparent huge pages leaves the memory as it was,
// logged once). It fails only for empty memory or a closed transport.
func (t *Transport) RegisterMemory(mem []byte, f *os.File) error {
	if len(mem) == 0 {
		return errors.New("shm: register memory: empty region")
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return &transport.ClosedError{Op: "register memory"}
	}
	hugepage.AdviseLogged(mem, t.log, "shm", "", &t.adviceLogged)
	return nil
}

// peerLost wraps cause as transport.ErrPeerLost of op with peer (see
// conn.PeerLost).
func peerLost(op, peer string, cause error) error { return conn.PeerLost("shm", op, peer, cause) }
