//go:build linux

package shm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transport"
)

// Time limits.
const (
	// grace bounds how long a Send whose ctx has ended waits for the
	// receiver to confirm that it stopped reading (and an ACK or CANCEL
	// waits to be written); after it the connection is closed.
	grace = time.Second
	// helloTimeout bounds the wait for a new connection's HELLO (both
	// sides), and dialling.
	helloTimeout = 10 * time.Second
	// probeTimeout bounds a Probe whose ctx has no earlier deadline.
	probeTimeout = 5 * time.Second
)

// Limits that bound a receiver's memory per connection; senders keep to
// them, and a sender that does not breaks the protocol.
const (
	// maxRegions bounds the regions a sender announces on one connection
	// (each is a mapping in the receiver).
	maxRegions = 4096
	// maxOpSegs bounds the segments of one Send, after adjacent ones are
	// merged.
	maxOpSegs = 1 << 20
	// opWeight: a sender's ops in flight on one connection weigh opWeight
	// plus their segments each, at most connCredit in all.
	opWeight = 64
)

// connCredit is the credit of a connection (see opWeight); both ends of a
// connection must agree on it. A variable only so that tests can lower it
// before they open transports.
var connCredit int64 = 2 << 20

// Fcntl constants that package syscall does not define.
const (
	fGetSeals   = 1024 + 10 // F_GET_SEALS
	fSealShrink = 0x2       // F_SEAL_SHRINK
)

func init() { transport.Register(Backend{}) }

// Backend is the shm backend, registered under the name "shm".
type Backend struct{}

// Name returns "shm".
func (Backend) Name() string { return "shm" }

// Open calls the package's Open.
func (Backend) Open(ctx context.Context, opts transport.Options) (transport.Transport, error) {
	t, err := Open(ctx, opts)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// Transport is the shm data plane of one rank: a listener on an abstract
// Unix socket whose connections bring READs that it serves by copying out
// of the sender's regions into armed receipts, and one pooled connection
// per receiver endpoint that sends. See the package documentation.
//
// Lock order: Transport.mu before inConn.mu and outConn.mu; regMu is never
// held with another lock. The write lock of an outConn (a channel) may be
// held while taking outConn.mu or Transport.mu, never the other way round.
type Transport struct {
	log      *slog.Logger
	ln       *net.UnixListener
	endpoint string
	piece    int   // bytes copied between two checks for cancel
	copiers  int   // goroutines that copy one large op
	credit   int64 // connCredit when opened

	done      chan struct{} // closed when Close starts
	closeOnce sync.Once

	sends sync.WaitGroup // in-flight Sends and Probes; Add only under mu while !closed
	wg    sync.WaitGroup // accept loop, connection readers and workers

	mapped atomic.Int64 // bytes of peers' regions mapped (see maxMapped)

	regMu      sync.RWMutex
	regions    []*region // sorted by base address, not overlapping
	nextRegion uint32
	regClosed  bool

	mu       sync.Mutex
	closed   bool
	receipts map[uint64]*recv                    // armed receipts by tag
	ops      map[*sendOp]context.CancelCauseFunc // in-flight Sends
	inbound  map[*inConn]struct{}
	peers    map[string]*outConn      // outbound connections by endpoint
	dialing  map[string]chan struct{} // closed when a dial ends

	maxConns int               // inbound connections kept at most (<= 0: no bound)
	refusals *netlimit.RateLog // logs refused connections
}

var (
	_ transport.Transport       = (*Transport)(nil)
	_ transport.MemoryRegistrar = (*Transport)(nil)
	_ transport.Prober          = (*Transport)(nil)
)

// region is one registered memory region. Immutable once registered.
type region struct {
	id   uint32
	base uintptr
	size int
	mem  []byte // keeps heap memory reachable
	fd   int    // a duplicate of the memory file's descriptor; -1: none
}

// Open listens on a fresh abstract Unix socket, "@kvxfer-shm-" and 128
// random bits in hex, and starts accepting connections. The goroutines it
// starts stop in Close; ctx bounds only the opening.
//
// Of the options, only Logger, MaxConns and FrameBytes (the bytes a
// receiver copies between two checks for cancel, rounded down to a multiple
// of 4096; 0 means transport.DefaultFrameBytes) apply: ListenAddr, Streams
// and MaxConnsPerHost are TCP's. The socket has no TCP port, but every
// process of the host in the same network namespace can connect to it (its
// name is random, not secret: /proc/net/unix lists it), so at most MaxConns
// inbound connections are kept and a silent one is closed at its hello
// deadline.
func Open(ctx context.Context, opts transport.Options) (*Transport, error) {
	opts = opts.WithDefaults()
	piece := opts.FrameBytes
	if piece >= 4096 {
		piece &^= 4095
	}
	var rnd [16]byte
	rand.Read(rnd[:]) // never fails (see crypto/rand.Read)
	ep := endpointPrefix + hex.EncodeToString(rnd[:])
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "unix", ep)
	if err != nil {
		return nil, fmt.Errorf("shm: open: %w", err)
	}
	t := &Transport{
		log:        opts.Logger.With("backend", "shm", "endpoint", ep),
		ln:         ln.(*net.UnixListener),
		endpoint:   ep,
		piece:      piece,
		copiers:    min(2, runtime.GOMAXPROCS(0)),
		credit:     connCredit,
		done:       make(chan struct{}),
		nextRegion: 1,
		receipts:   make(map[uint64]*recv),
		ops:        make(map[*sendOp]context.CancelCauseFunc),
		inbound:    make(map[*inConn]struct{}),
		peers:      make(map[string]*outConn),
		dialing:    make(map[string]chan struct{}),
		maxConns:   opts.MaxConns,
		refusals:   netlimit.NewRateLog(opts.Logger, time.Second),
	}
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
		cancels := make([]context.CancelCauseFunc, 0, len(t.ops))
		for _, c := range t.ops {
			cancels = append(cancels, c)
		}
		t.mu.Unlock()
		close(t.done)
		for _, c := range cancels {
			c(&transport.ClosedError{Op: "send"})
		}
		t.sends.Wait() // the receiving side still serves meanwhile

		t.ln.Close()
		t.mu.Lock()
		for _, r := range t.receipts {
			t.finish(r, &transport.ClosedError{Op: "receive"})
		}
		conns := make([]*inConn, 0, len(t.inbound))
		for c := range t.inbound {
			conns = append(conns, c)
		}
		outs := make([]*outConn, 0, len(t.peers))
		for _, oc := range t.peers {
			outs = append(outs, oc)
		}
		t.mu.Unlock()
		for _, c := range conns {
			c.nc.Close()
		}
		for _, oc := range outs {
			oc.kill(&transport.ClosedError{Op: "send"})
		}
		t.wg.Wait()

		t.regMu.Lock()
		for _, r := range t.regions {
			if r.fd >= 0 {
				syscall.Close(r.fd)
			}
		}
		t.regions = nil
		t.regClosed = true
		t.regMu.Unlock()
	})
	return nil
}

// accept runs until the listener closes.
func (t *Transport) accept() {
	defer t.wg.Done()
	var delay time.Duration
	for {
		nc, err := t.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off as
			// net/http does instead of spinning.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			t.log.Warn("shm: accept failed; retrying", "err", err, "delay", delay)
			timer := time.NewTimer(delay)
			select {
			case <-timer.C:
			case <-t.done:
				timer.Stop()
				return
			}
			continue
		}
		delay = 0
		c := newInConn(t, nc)
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			nc.Close()
			continue
		}
		// Any process of this host (and network namespace) can connect to
		// the abstract socket: bound what they hold. A silent connection
		// within the bound is closed at its hello deadline.
		if t.maxConns > 0 && len(t.inbound) >= t.maxConns {
			t.mu.Unlock()
			nc.Close()
			t.refusals.Warn(netlimit.ReasonMaxConns, "connection refused", "listener", "shm data "+t.endpoint,
				"reason", netlimit.ReasonMaxConns, "limit", t.maxConns)
			continue
		}
		t.inbound[c] = struct{}{}
		t.wg.Add(2) // reader and worker
		t.mu.Unlock()
		go c.work()
		go c.serve()
	}
}

// RegisterMemory declares mem as a region of this transport. A region with
// a file f (a sealed memfd, such as a kvcache.ShmArena's, mapped from its
// start as mem) can be a Send source: the transport keeps a duplicate of
// f's descriptor, which it passes to each receiver the first time a Send
// to it reads from the region, and closes in Close. A region without a file
// is accepted for symmetry with other backends but cannot be a source;
// destinations (Expect) need no registration at all.
//
// Registering the same memory again is a no-op, or adds the file to a
// region registered without one; memory that overlaps a registered region
// otherwise is an error. mem must stay valid until the transport is closed.
func (t *Transport) RegisterMemory(mem []byte, f *os.File) error {
	if len(mem) == 0 {
		return errors.New("shm: register memory: empty region")
	}
	fd := -1
	if f != nil {
		var err error
		if fd, err = dupMemFile(f, len(mem)); err != nil {
			return fmt.Errorf("shm: register memory: %w", err)
		}
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	t.regMu.Lock()
	defer t.regMu.Unlock()
	if t.regClosed {
		closeFd(fd)
		return &transport.ClosedError{Op: "register memory"}
	}
	if t.nextRegion == 0 { // wrapped: ids must stay unique and non-zero
		closeFd(fd)
		return errors.New("shm: register memory: too many registrations")
	}
	// The first region that ends after base.
	i, _ := slices.BinarySearchFunc(t.regions, base, func(r *region, b uintptr) int {
		if r.base+uintptr(r.size) <= b {
			return -1
		}
		return 1
	})
	if i < len(t.regions) && t.regions[i].base < base+uintptr(len(mem)) {
		old := t.regions[i]
		switch {
		case old.base != base || old.size != len(mem):
			closeFd(fd)
			return fmt.Errorf("shm: register memory: [%#x, +%d) overlaps the registered region [%#x, +%d)", base, len(mem), old.base, old.size)
		case old.fd >= 0 || fd < 0:
			closeFd(fd)
			return nil
		}
		// Add the file: a new region with a new id, since regions stay
		// immutable for the Sends reading them.
		t.regions[i] = &region{id: t.nextRegion, base: base, size: len(mem), mem: mem, fd: fd}
		t.nextRegion++
		return nil
	}
	t.regions = slices.Insert(t.regions, i, &region{id: t.nextRegion, base: base, size: len(mem), mem: mem, fd: fd})
	t.nextRegion++
	return nil
}

// dupMemFile checks that f can back a region of size bytes that a peer can
// map safely (at least size bytes, sealed against shrinking) and returns a
// close-on-exec duplicate of its descriptor.
func dupMemFile(f *os.File, size int) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	dup := -1
	var ferr error
	err = rc.Control(func(fd uintptr) {
		var st syscall.Stat_t
		if ferr = syscall.Fstat(int(fd), &st); ferr != nil {
			ferr = fmt.Errorf("fstat %s: %w", f.Name(), ferr)
			return
		}
		if st.Size < int64(size) {
			ferr = fmt.Errorf("file %s is %d bytes, smaller than the region's %d", f.Name(), st.Size, size)
			return
		}
		seals, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, fGetSeals, 0)
		if e != 0 || seals&fSealShrink == 0 {
			ferr = fmt.Errorf("file %s is not a memfd sealed against shrinking (allocate with kvcache.ShmAllocator)", f.Name())
			return
		}
		d, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_DUPFD_CLOEXEC, 0)
		if e != 0 {
			ferr = fmt.Errorf("dup %s: %w", f.Name(), e)
			return
		}
		dup = int(d)
	})
	if err != nil {
		return -1, err
	}
	return dup, ferr
}

func closeFd(fd int) {
	if fd >= 0 {
		syscall.Close(fd)
	}
}

// span is one merged piece of a Send's source: length bytes at offset of a
// region.
type span struct {
	r      *region
	offset uint64
	length uint64
}

// resolve maps each non-empty piece of src to the registered region that
// holds it, merging pieces that are adjacent in one region.
func (t *Transport) resolve(src [][]byte) ([]span, error) {
	t.regMu.RLock()
	defer t.regMu.RUnlock()
	out := make([]span, 0, min(len(src), 1024))
	for i, p := range src {
		if len(p) == 0 {
			continue
		}
		a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
		j, _ := slices.BinarySearchFunc(t.regions, a, func(r *region, b uintptr) int {
			if r.base+uintptr(r.size) <= b {
				return -1
			}
			return 1
		})
		if j == len(t.regions) || t.regions[j].base > a {
			return nil, fmt.Errorf("shm: send: piece %d [%#x, +%d): %w", i, a, len(p), ErrNotShared)
		}
		r := t.regions[j]
		off := uint64(a - r.base)
		if off+uint64(len(p)) > uint64(r.size) {
			return nil, fmt.Errorf("shm: send: piece %d [%#x, +%d) runs past the end of its region [%#x, +%d): %w", i, a, len(p), r.base, r.size, ErrNotShared)
		}
		if r.fd < 0 {
			return nil, fmt.Errorf("shm: send: piece %d [%#x, +%d) is in a region registered without a file: %w", i, a, len(p), ErrNotShared)
		}
		if k := len(out) - 1; k >= 0 && out[k].r == r && out[k].offset+out[k].length == off {
			out[k].length += uint64(len(p))
			continue
		}
		out = append(out, span{r: r, offset: off, length: uint64(len(p))})
	}
	if len(out) > maxOpSegs {
		return nil, fmt.Errorf("shm: send: %d separate pieces, more than %d", len(out), maxOpSegs)
	}
	return out, nil
}

// randUint64 returns a random non-zero value from crypto/rand.
func randUint64() uint64 {
	var b [8]byte
	for {
		rand.Read(b[:]) // never fails (see crypto/rand.Read)
		if v := binary.BigEndian.Uint64(b[:]); v != 0 {
			return v
		}
	}
}

// peerLost wraps cause as ErrPeerLost of op with peer; a protocol error stays
// visible to errors.Is. The cause itself is not wrapped otherwise, so that a
// local net.ErrClosed is not mistaken for a closed Transport.
func peerLost(op, peer string, cause error) error {
	if errors.Is(cause, transport.ErrProtocol) {
		return fmt.Errorf("shm: %s %s: %w: %w", op, peer, transport.ErrPeerLost, cause)
	}
	return fmt.Errorf("shm: %s %s: %w: %v", op, peer, transport.ErrPeerLost, cause)
}
