package transport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"
)

// Backend opens a rank's data plane. Backends register themselves with
// Register from an init function; Open (package level) finds them by name.
type Backend interface {
	// Name is the lower-case backend name ("tcp").
	Name() string
	// Open creates the data plane of one rank and starts listening. The
	// goroutines it starts are owned by the returned Transport and stop in
	// its Close. ctx bounds only the opening itself.
	Open(ctx context.Context, opts Options) (Transport, error)
}

// Options are a backend's low-level options. transceiver.New builds them from
// the public config; nothing else does.
type Options struct {
	// ListenAddr is host:port for the data listener; "" means
	// "127.0.0.1:0" (loopback, any free port).
	ListenAddr string
	// Interface, when set, names the network interface the data listener
	// uses instead of ListenAddr's host (ucx: TRTLLM_UCX_INTERFACE): the
	// backend binds its first IPv4 address (its first address when it has
	// none). An interface this host does not have fails Open with an
	// error naming those it has. The tcp and shm backends ignore it.
	Interface string
	// Streams is the number of parallel data connections per peer a sender
	// opens (TCP). 0 means DefaultStreams.
	Streams int
	// FrameBytes bounds one data frame (TCP): a transfer is cut into frames
	// of at most this many bytes, and cancel takes effect between frames.
	// 0 means DefaultFrameBytes.
	FrameBytes int
	// Logger receives the backend's logs; nil discards them.
	Logger *slog.Logger
	// TLS, when non-nil, makes the data connections of the tcp backend
	// mutual TLS: its listener accepts only TLS clients whose certificate
	// TLS.Server verifies, and its dials use TLS.Client (which must verify
	// the receiver's certificate). The shm and ucx backends ignore it: shm
	// moves data between processes of one host through shared memory, and
	// UCX has no TLS here.
	TLS *TLSConfig
	// MaxConns bounds the inbound data connections a backend keeps open
	// (tcp, shm); one more is closed at once. 0 means DefaultMaxConns; a
	// negative value, no bound.
	MaxConns int
	// MaxConnsPerHost bounds those from one remote IP address (tcp). 0
	// means DefaultMaxConnsPerHost; a negative value, no bound.
	MaxConnsPerHost int
	// IdleTimeout closes an inbound data connection that has carried no
	// frame for this long (tcp), or made no progress, no message, part or
	// answer (shm), and a sender retires a pooled connection it has not
	// used for 3/4 of it, so that the receiver never closes a connection a
	// sender is about to use: give both ends the same value. 0 means
	// DefaultIdleTimeout; a negative value, no timeout. The ucx and mpi
	// backends ignore it.
	IdleTimeout time.Duration
}

// TLSConfig is the mutual TLS of a data plane: Server for the connections
// it accepts, Client for those it dials. Both must be set; the backend
// clones them and does not change them. crypto/tls takes the server name
// from the endpoint dialled when Client.ServerName is empty.
type TLSConfig struct {
	Server *tls.Config
	Client *tls.Config
}

// Defaults of Options.
const (
	// DefaultStreams: four connections per peer kept a tcp transfer
	// 21% faster than two on a 2-core machine, with huge-page pools
	// (docs/perf-notes.md, "tcp: four streams").
	DefaultStreams    = 4
	DefaultFrameBytes = 4 << 20
	MaxFrameBytes     = 64 << 20
	MaxStreams        = 64
	// MaxDescriptorBytes bounds a Descriptor on the wire.
	MaxDescriptorBytes = 4096
	// DefaultMaxConns and DefaultMaxConnsPerHost bound a backend's inbound
	// data connections: a sending rank opens Streams (up to MaxStreams) of
	// them, so a host running 16 sending ranks at 64 streams stays within
	// the per-host bound.
	DefaultMaxConns        = 2048
	DefaultMaxConnsPerHost = 1024
	// DefaultIdleTimeout is the control plane's default too
	// (transceiver.DefaultIdleTimeout).
	DefaultIdleTimeout = 5 * time.Minute
)

// WithDefaults returns o with zero fields set to their defaults.
func (o Options) WithDefaults() Options {
	if o.ListenAddr == "" {
		o.ListenAddr = "127.0.0.1:0"
	}
	if o.Streams <= 0 {
		o.Streams = DefaultStreams
	}
	if o.Streams > MaxStreams {
		o.Streams = MaxStreams
	}
	if o.FrameBytes <= 0 {
		o.FrameBytes = DefaultFrameBytes
	}
	if o.FrameBytes > MaxFrameBytes {
		o.FrameBytes = MaxFrameBytes
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.MaxConns == 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.MaxConnsPerHost == 0 {
		o.MaxConnsPerHost = DefaultMaxConnsPerHost
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
	return o
}

// Descriptor tells a sender where and how to deliver one message: it is
// produced by the receiver's Expect, travels to the sender inside a control
// frame, and is consumed by the sender's Send. Its content is
// backend-specific and opaque to everyone else; it is at most
// MaxDescriptorBytes long. A backend must treat a descriptor from the wire
// as untrusted input.
type Descriptor []byte

// Transport is one rank's data plane of one backend. It moves bytes; it
// knows nothing of requests, layouts or config.
//
// All methods are safe for concurrent use. Close is idempotent; after Close,
// Expect and Send fail with an error that unwraps to net.ErrClosed, and every
// pending Recv completes with such an error.
type Transport interface {
	// Name is the backend name, with the detail of what carries the data
	// when the backend can tell ("tcp", "ucx(cma)").
	Name() string
	// Endpoint is the address a peer's Send reaches this data plane at. It
	// is embedded in the descriptors Expect returns.
	Endpoint() string
	// Expect arms the receipt of exactly sum(len(dst[i])) bytes, laid out
	// in order over dst. Ownership of dst passes to the transport until the
	// returned Recv is done (Done closed) or Cancel has returned; the caller
	// must not read or write dst in between. The total must be > 0.
	Expect(dst [][]byte) (Recv, error)
	// Send delivers src (concatenated, in order) to the receiver described
	// by desc; the total length must equal the receiver's. It returns when
	// every byte has been handed to the peer's side of the backend (TCP:
	// written to the connection), after which src may be reused; the
	// receiver's Recv completes when the bytes are in place. src is only read.
	//
	// When ctx ends before all bytes are sent, Send stops at the next frame
	// boundary, tells the receiver (whose Recv then fails with ErrAborted)
	// and returns an error that unwraps to ctx's error. A peer that has gone
	// away fails Send with ErrPeerLost.
	Send(ctx context.Context, desc Descriptor, src [][]byte) error
	// Close stops the data plane, fails pending receives and in-flight
	// sends, and waits for the goroutines it owns. Idempotent.
	Close() error
}

// MemoryRegistrar is implemented by backends that move data between memory
// the two processes share or have registered (shm, ucx). The transceiver
// registers every pool arena and staging buffer of its rank before using
// it as a source or destination; a backend may then refuse (with an error)
// memory that was not registered, or fall back to a slower path and say so
// in its documentation.
type MemoryRegistrar interface {
	// RegisterMemory declares mem as a region usable by Send and Expect.
	// f, when non-nil, is a file (a sealed memfd, see kvcache.ShmArena)
	// whose whole mapping is mem, which a peer on the same host can map.
	// The transport does not take ownership of f; it may dup it. mem must
	// stay valid until the transport is closed.
	RegisterMemory(mem []byte, f *os.File) error
}

// Dialer is implemented by backends whose Send connects to an address that
// the descriptor names (tcp). The descriptor comes from the receiving peer,
// so the address is the peer's choice: DescriptorHost returns its host (an
// IP address or a name, no port), so that the sender can refuse to connect
// where the peer has no business sending it (transceiver: the peer's own
// host, loopback when the peer is local, or the allow-list). An error wraps
// ErrBadDescriptor.
type Dialer interface {
	DescriptorHost(desc Descriptor) (string, error)
}

// Prober is implemented by backends that work only between some pairs of
// ranks (shm: the same host, sharing memory). Probe checks, without moving
// any data of a request, that this transport can Send to the transport whose
// Endpoint is endpoint. AUTO uses it to choose a backend per peer and to fall
// back, with the reason logged, when it fails.
type Prober interface {
	Probe(ctx context.Context, endpoint string) error
}

// Recv is one armed receipt, returned by Transport.Expect.
type Recv interface {
	// Descriptor is what the sender needs; send it inside a control frame.
	Descriptor() Descriptor
	// Done is closed when the receipt ends: every byte in place (Err nil),
	// or failed (Err non-nil).
	Done() <-chan struct{}
	// Err reports why the receipt failed, or nil; valid after Done.
	Err() error
	// Cancel ends the receipt with ErrCanceled unless it already ended.
	// When Cancel returns the transport no longer writes into dst, so the
	// caller owns dst again. Cancel is idempotent and safe to call after
	// Done.
	Cancel()
}

// Errors of every backend. Backends wrap them with the operation and the
// peer; callers test with errors.Is.
var (
	// ErrPeerLost: the connection to the peer broke or the peer went away.
	ErrPeerLost = errors.New("transport: peer lost")
	// ErrAborted: the sender stopped a transfer before its end.
	ErrAborted = errors.New("transport: transfer aborted by the sender")
	// ErrCanceled: the local side cancelled the receipt.
	ErrCanceled = errors.New("transport: receive cancelled")
	// ErrBadDescriptor: a descriptor that this backend did not produce, or
	// that does not match the data offered.
	ErrBadDescriptor = errors.New("transport: bad descriptor")
	// ErrProtocol: the peer broke the data-plane protocol (a malformed or
	// oversized frame); the connection is closed.
	ErrProtocol = errors.New("transport: protocol error")
)

// ClosedError is returned by operations on a closed Transport. It unwraps
// to net.ErrClosed.
type ClosedError struct{ Op string }

func (e *ClosedError) Error() string { return "transport: " + e.Op + ": use of closed transport" }

// Unwrap returns net.ErrClosed.
func (e *ClosedError) Unwrap() error { return net.ErrClosed }

// TimeoutError is returned when an operation's deadline passes. Timeout
// reports true, as net.Error does.
type TimeoutError struct {
	Op   string
	Peer string
	Err  error // the context or network error behind it
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("transport: %s %s: timeout: %v", e.Op, e.Peer, e.Err)
}

// Timeout reports true.
func (e *TimeoutError) Timeout() bool { return true }

// Unwrap returns the underlying error (often context.DeadlineExceeded).
func (e *TimeoutError) Unwrap() error { return e.Err }
