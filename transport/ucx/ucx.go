//go:build ucx && cgo

package ucx

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

func init() { transport.RegisterOpen("ucx", Open) }

// Timing of the failure paths and of sleep.
const (
	// abortGrace bounds how long a Send whose ctx ended waits for the
	// receiver to acknowledge the abort and for UCX to let go of src;
	// after it the endpoint is closed by force (every request on it fails)
	// and the Send returns.
	abortGrace = 2 * time.Second
	// closeGrace bounds how long Close waits for in-flight operations to
	// settle before it says goodbye to its peers and destroys the worker.
	closeGrace = 2 * time.Second
	// idleWake bounds a sleep of the progress goroutine: UCX's keepalive
	// runs from progress, so an idle worker still turns over this often.
	idleWake = 100 * time.Millisecond
)

// Defaults the backend gives UCX through ucp_config_modify, each only when
// none of the environment variables that set it is present and UCX_TLS
// lets its transport in (UCX warns about a setting no transport used): see
// the package documentation. UCT variables are modified by their name
// inside the transport's table: MM_ERROR_HANDLING reaches
// UCX_SYSV_ERROR_HANDLING and UCX_POSIX_ERROR_HANDLING.
var configDefaults = []struct {
	name, value string
	env         []string // any of them set: leave it to UCX
	tls         []string // UCX_TLS names that let the transport in (nil: always)
}{
	{"MM_ERROR_HANDLING", "y",
		[]string{"UCX_MM_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_POSIX_ERROR_HANDLING"},
		[]string{"sm", "shm", "mm", "sysv", "posix"}},
	{"MEMORY_INVALIDATE", "y", []string{"UCX_CMA_MEMORY_INVALIDATE"}, []string{"sm", "shm", "cma"}},
	{"KEEPALIVE_INTERVAL", "1s", []string{"UCX_KEEPALIVE_INTERVAL"}, nil},
	// UCX's tcp receives at most one receive buffer per recv call (64 KiB
	// by default): 1 MiB makes a 512 MiB transfer 1.9 times as fast (see
	// the package documentation). UCX's tcp also sends messages as long as
	// its own receive buffer, so every process must have the same size
	// (endpointVersion says which default); left alone when either size is
	// set (UCX refuses an RX below TX).
	{"RX_SEG_SIZE", "1M", []string{"UCX_TCP_RX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE"}, []string{"tcp"}},
}

// tlsAllows reports whether UCX_TLS (tls, set or not) selects any of names:
// unset, "all" and exclusions ("^...") select everything.
func tlsAllows(tls string, set bool, names []string) bool {
	if !set || names == nil || strings.HasPrefix(tls, "^") {
		return true
	}
	for _, t := range strings.Split(tls, ",") {
		t = strings.TrimSpace(t)
		if t == "all" || slices.Contains(names, t) {
			return true
		}
	}
	return false
}

// Transport is one rank's UCX data plane: one UCP context and worker, owned
// by one progress goroutine. See the package documentation.
type Transport struct {
	log          *slog.Logger
	inst         uint64 // random id of this transport, inside its endpoint
	endpointRaw  []byte
	endpoint     string
	bind         binding // the network devices UCX listens on
	name         atomic.Pointer[string]
	closed       atomic.Bool // Close called: new operations fail
	adviceLogged atomic.Bool // RegisterMemory logged that MADV_HUGEPAGE failed

	mu       sync.Mutex // guards queue, pending, stopped; held around wakes (the worker outlives them)
	queue    []func()
	pending  map[uint64]struct{} // receipts submitted, not yet posted
	stopped  bool                // the progress goroutine is gone (or going)
	sleeping atomic.Bool
	done     chan struct{} // closed when the progress goroutine has returned

	closeOnce sync.Once

	lp *loop // owned by the progress goroutine
}

var _ transport.Transport = (*Transport)(nil)

// Open creates a UCP context and worker (reading UCX_* from the
// environment, as UCX does) and starts the progress goroutine. ctx bounds
// only the opening. The host of opts.ListenAddr, or opts.Interface when set,
// chooses the network devices UCX may use (UCX_NET_DEVICES, unless the
// environment sets it): see "Listening" in the package documentation. Its port, Streams and
// FrameBytes do not apply.
func Open(ctx context.Context, opts transport.Options) (*Transport, error) {
	opts = opts.WithDefaults()
	bind, err := resolveBinding(ctx, opts.ListenAddr, opts.Interface)
	if err != nil {
		return nil, fmt.Errorf("ucx: open: %w", err)
	}
	if devs, set := envNetDevices(); set && bind.host.IsValid() {
		opts.Logger.Warn("ucx: UCX_NET_DEVICES is set: UCX listens on the devices it names, not only on the listen host",
			"UCX_NET_DEVICES", devs, "listen_host", bind.host.String())
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("ucx: open: %w", err)
	}
	t := &Transport{
		log:     opts.Logger,
		inst:    binary.LittleEndian.Uint64(b[:]),
		bind:    bind,
		done:    make(chan struct{}),
		pending: map[uint64]struct{}{},
	}
	plain := "ucx"
	t.name.Store(&plain)
	ready := make(chan error, 1)
	go t.run(ready)
	select {
	case err := <-ready:
		if err != nil {
			<-t.done
			return nil, err
		}
	case <-ctx.Done():
		// UCP's init cannot be interrupted: let it finish, then undo it.
		if err := <-ready; err == nil {
			t.Close()
		}
		<-t.done
		return nil, fmt.Errorf("ucx: open: %w", ctx.Err())
	}
	return t, nil
}

// defaultsFromEnv returns the settings the backend gives UCX: configDefaults
// and the devices of bind, each only when the environment does not set it.
func defaultsFromEnv(bind binding) string {
	var b strings.Builder
	tls, tlsSet := os.LookupEnv("UCX_TLS")
	if _, set := envNetDevices(); !set && len(bind.devices) > 0 {
		b.WriteString("NET_DEVICES=" + strings.Join(bind.devices, ",") + "\x00")
		// UCX's tcp binds a device's IPv4 address when it has one.
		if _, set := os.LookupEnv("UCX_TCP_AF_PRIO"); bind.ipv6 && !set && tlsAllows(tls, tlsSet, []string{"tcp"}) {
			b.WriteString("AF_PRIO=inet6\x00")
		}
	}
next:
	for _, d := range configDefaults {
		if !tlsAllows(tls, tlsSet, d.tls) {
			continue
		}
		for _, e := range d.env {
			if _, set := os.LookupEnv(e); set {
				continue next
			}
		}
		b.WriteString(d.name + "=" + d.value + "\x00")
	}
	return b.String()
}

// Name reports "ucx(<transports>)": the UCX transports (UCT components) of
// the lanes UCX selected for the endpoints this transport has made so far,
// such as "ucx(sysv,cma)" or "ucx(tcp)"; plain "ucx" before the first.
func (t *Transport) Name() string { return *t.name.Load() }

// Endpoint is the base64 encoding of version, instance id and UCP worker
// address.
func (t *Transport) Endpoint() string { return t.endpoint }

// ListenAddrs describes where UCX listens: the listen host and the network
// devices that hold it ("127.0.0.1 (lo)"), or "every device"; UCX picks the
// ports itself and does not report them. Shared-memory transports listen
// on no socket.
func (t *Transport) ListenAddrs() []string { return []string{t.bind.String()} }

// PeerTransports reports the UCX transports of the endpoint to the peer
// whose Endpoint is endpoint, in lane order (active messages first), or nil
// when this transport has no endpoint to it.
func (t *Transport) PeerTransports(endpoint string) []string {
	raw, err := base64.StdEncoding.DecodeString(endpoint)
	if err != nil {
		return nil
	}
	ch := make(chan []string, 1)
	if !t.submit(func() {
		if p := t.lp.peers[string(raw)]; p != nil {
			ch <- append([]string(nil), p.tls...)
			return
		}
		ch <- nil
	}) {
		return nil
	}
	return <-ch
}

// submit hands f to the progress goroutine; false when it is gone.
func (t *Transport) submit(f func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return false
	}
	t.queue = append(t.queue, f)
	if t.sleeping.Load() {
		t.lp.wake() // under mu: the fd outlives every wake
	}
	return true
}

// Expect posts the receipt's tagged receives. See the package
// documentation for how dst is cut into messages.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	if t.closed.Load() {
		return nil, &transport.ClosedError{Op: "expect"}
	}
	sizes := make([]int, len(dst))
	var total int64
	for i, p := range dst {
		sizes[i] = len(p)
		total += int64(len(p))
	}
	if total == 0 {
		return nil, errors.New("ucx: expect: nothing to receive")
	}
	if total > maxTotal {
		return nil, fmt.Errorf("ucx: expect: %d bytes, more than %d", total, int64(maxTotal))
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("ucx: expect: %w", err)
	}
	r := &recv{
		Outcome: receipt.MakeOutcome(),
		t:       t,
		tagBase: binary.LittleEndian.Uint64(b[:]) &^ indexMask,
	}
	groups := planGroups(sizes, maxGroups)
	var desc []byte
	for {
		d := descriptor{tagBase: r.tagBase, total: total, endpoint: t.endpointRaw}
		for _, g := range groups {
			var n int64
			for _, s := range sizes[g[0]:g[1]] {
				n += int64(s)
			}
			d.groups = append(d.groups, n)
		}
		desc = d.encode()
		if len(desc) <= transport.MaxDescriptorBytes {
			r.lens = d.groups
			break
		}
		if len(groups) == 1 {
			return nil, fmt.Errorf("ucx: expect: descriptor of %d bytes (worker address of %d) exceeds %d",
				len(desc), len(t.endpointRaw), transport.MaxDescriptorBytes)
		}
		groups = mergePairs(groups)
	}
	r.desc = desc
	r.bufs = make([]msgBuf, len(groups))
	for i, g := range groups {
		r.bufs[i] = r.mem.prepare(dst[g[0]:g[1]])
	}
	// The receives are posted by the progress goroutine before its next
	// progress (it runs submitted operations first), so before any message
	// for them can be matched: their tag is known to nobody until Expect
	// returns. Until posted, the tag is marked pending, so that a message
	// for it that a long progress call already delivered is kept rather
	// than dropped as stale.
	if !t.submitPost(r) {
		r.mem.release()
		return nil, &transport.ClosedError{Op: "expect"}
	}
	return r, nil
}

// submitPost hands r to the progress goroutine for posting, marking its tag
// pending until then.
func (t *Transport) submitPost(r *recv) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return false
	}
	t.pending[r.tagBase] = struct{}{}
	t.queue = append(t.queue, func() { t.lp.post(r) })
	if t.sleeping.Load() {
		t.lp.wake()
	}
	return true
}

// isPending reports whether receipt tagBase is submitted but not posted.
func (t *Transport) isPending(tagBase uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.pending[tagBase]
	return ok
}

func (t *Transport) posted(tagBase uint64) {
	t.mu.Lock()
	delete(t.pending, tagBase)
	t.mu.Unlock()
}

// Send tag-sends src to the receipt desc describes, one message per group
// of the receipt, and returns when UCX has completed every message (src is
// no longer read). See the package documentation for cancel and failure.
func (t *Transport) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	if t.closed.Load() {
		return &transport.ClosedError{Op: "send"}
	}
	d, err := decodeDescriptor(desc)
	if err != nil {
		return err
	}
	var total int64
	for _, p := range src {
		total += int64(len(p))
	}
	peer := peerName(d.endpoint)
	if total != d.total {
		return fmt.Errorf("%w: ucx: send of %d bytes to a receipt of %d at %s", transport.ErrBadDescriptor, total, d.total, peer)
	}
	if ctx.Err() != nil {
		// Nothing moved: tell the receiver, so that its receipt fails now
		// rather than at its deadline.
		t.submit(func() { t.lp.abortOnly(d) })
		return ctxError(ctx, peer)
	}
	s := &send{id: 0, tagBase: d.tagBase, done: make(chan struct{})}
	pieces := splitPieces(src, d.groups)
	s.bufs = make([]msgBuf, len(pieces))
	for i, p := range pieces {
		s.bufs[i] = s.mem.prepare(p)
	}
	defer s.mem.release() // after done: UCX no longer reads src
	if !t.submit(func() { t.lp.startSend(s, d) }) {
		return &transport.ClosedError{Op: "send"}
	}
	select {
	case <-s.done:
		return s.err
	case <-ctx.Done():
	}
	why := ctxError(ctx, peer)
	t.submit(func() { t.lp.abortSend(s, why, abortGrace) })
	// Bounded: the loop ends s within abortGrace (or Close within
	// closeGrace) by closing the endpoint when the peer does not answer.
	<-s.done
	return s.err
}

func ctxError(ctx context.Context, peer string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &transport.TimeoutError{Op: "ucx send", Peer: peer, Err: ctx.Err()}
	}
	return fmt.Errorf("ucx: send to %s: %w", peer, ctx.Err())
}

// peerName is how errors and logs name the transport behind a raw endpoint.
func peerName(ep []byte) string {
	inst, _, err := parseEndpoint(ep)
	if err != nil {
		return "ucx:?"
	}
	return fmt.Sprintf("ucx:%016x", inst)
}

// Close stops the progress goroutine after aborting the sends in flight
// (waiting up to closeGrace for their receivers to acknowledge), failing
// pending receipts with a *transport.ClosedError, telling every peer
// goodbye and closing endpoints, worker and context. Idempotent.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.closed.Store(true)
		t.submit(func() { t.lp.beginClose() })
	})
	<-t.done
	return nil
}

// recv is one receipt. Its Outcome is ended by the progress goroutine
// (endRecv).
type recv struct {
	receipt.Outcome
	t       *Transport
	tagBase uint64
	desc    transport.Descriptor
	lens    []int64  // of each message
	bufs    []msgBuf // of each message
	mem     pinned

	// owned by the progress goroutine
	reqs   []*request // per message; nil once ended
	left   int
	fail   error // the first reason the receipt fails
	posted bool
}

func (r *recv) Descriptor() transport.Descriptor { return r.desc }

// Cancel fails the receipt with transport.ErrCanceled unless it has ended,
// and returns once UCX has let go of every message's memory: a message
// that UCX has already matched to an incoming send cannot be cancelled
// (ucp_request_cancel ignores it), so Cancel waits for it to end.
func (r *recv) Cancel() {
	select {
	case <-r.Done():
		return
	default:
	}
	r.t.submit(func() { r.t.lp.failRecv(r, fmt.Errorf("ucx: %w", transport.ErrCanceled)) })
	<-r.Done() // the loop, or its shutdown, always ends every receipt
}

// send is one Send in flight.
type send struct {
	id      uint64
	tagBase uint64
	bufs    []msgBuf
	mem     pinned
	done    chan struct{}
	err     error

	// owned by the progress goroutine
	peer     *peer
	reqs     []*request
	left     int
	fail     error     // the first message failure
	aborting error     // why the Send stops early (ctx, Close); nil when not
	deadline time.Time // of the abort
	ack      uint64    // the receiver's answer to the abort
	ended    bool
}

// msgBuf is one message's memory as UCP takes it: a contiguous buffer
// (iovcnt 0) or a C array of iovcnt ucp_dt_iov_t.
type msgBuf struct {
	ptr    unsafe.Pointer
	len    uintptr // bytes (contiguous) or 0 (iov)
	iovcnt int
	bytes  int64
}

// pinned holds Go memory that C keeps pointers to while UCX works on it,
// and the C iov arrays that point into it.
type pinned struct {
	pin  runtime.Pinner
	iovs []unsafe.Pointer
}
