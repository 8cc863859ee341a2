package transceiver

import (
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transport"
)

// Defaults of ConnLimits: generous for a cluster (a context rank gets one
// control connection per generation rank that pulls from it), small enough
// that a flood costs bounded memory and goroutines.
const (
	DefaultMaxControlConns        = 1024
	DefaultMaxControlConnsPerHost = 256
	DefaultHandshakeTimeout       = 10 * time.Second
	DefaultIdleTimeout            = 5 * time.Minute
	// DefaultStagingHold is ConnLimits.StagingHold's default.
	DefaultStagingHold = 5 * time.Second
	// StagingHoldRate is the rate (bytes a second, 100 MB/s: below one
	// 1 GbE link) at which the hold limit of a staging buffer grows with
	// the bytes its transfer moves through it.
	StagingHoldRate = 100_000_000
)

// ConnLimits bound what peers can hold of a rank: the connections it
// accepts, before and after their handshake, and its shared staging
// buffers. A zero field takes its default; a negative one removes the
// bound (a negative timeout: none).
type ConnLimits struct {
	// MaxControlConns bounds one rank's inbound control connections,
	// shaking hands or not (default DefaultMaxControlConns). One more is
	// closed at once.
	MaxControlConns int
	// MaxControlConnsPerHost bounds those from one remote IP address
	// (default DefaultMaxControlConnsPerHost).
	MaxControlConnsPerHost int
	// HandshakeTimeout is how long an inbound control connection may take
	// to send its hello (default DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
	// IdleTimeout closes an inbound control connection that has had no
	// request in flight and no frame for this long (default
	// DefaultIdleTimeout), and an inbound data connection of the tcp
	// backend that has carried no frame, or of the shm backend that has
	// made no progress, for this long. A rank closes the control, tcp and
	// shm data connections it dialled after 3/4 of its own IdleTimeout
	// unused, and dials again when it next needs one, so that with
	// one setting across the cluster a dialler never sends on a connection
	// its peer is closing.
	IdleTimeout time.Duration
	// MaxDataConns and MaxDataConnsPerHost bound each rank's inbound data
	// connections of the tcp backend (MaxDataConns also shm's); 0 means
	// transport.DefaultMaxConns and transport.DefaultMaxConnsPerHost.
	MaxDataConns, MaxDataConnsPerHost int
	// StagingHold bounds how long one staged chunk may hold one of a
	// rank's shared staging buffers while another transfer waits for one
	// (default DefaultStagingHold), plus the time its bytes take at
	// StagingHoldRate: a peer that stops reading (a context rank's send)
	// or sending (a generation rank's receive) then fails its transfer
	// with ErrStalled and gives the buffer back, rather than hold up other
	// requests until its own deadline. Nobody is stopped while no one
	// waits.
	StagingHold time.Duration
}

// withDefaults returns l with zero fields set to their defaults.
func (l ConnLimits) withDefaults() ConnLimits {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&l.MaxControlConns, DefaultMaxControlConns)
	def(&l.MaxControlConnsPerHost, DefaultMaxControlConnsPerHost)
	def(&l.MaxDataConns, transport.DefaultMaxConns)
	def(&l.MaxDataConnsPerHost, transport.DefaultMaxConnsPerHost)
	defDur(&l.HandshakeTimeout, DefaultHandshakeTimeout)
	defDur(&l.IdleTimeout, DefaultIdleTimeout)
	defDur(&l.StagingHold, DefaultStagingHold)
	return l
}

// String describes l for logs.
func (l ConnLimits) String() string {
	return "control: " + netlimit.Limits{MaxConns: l.MaxControlConns, MaxConnsPerHost: l.MaxControlConnsPerHost}.String() +
		", handshake timeout " + l.HandshakeTimeout.String() + ", idle timeout " + l.IdleTimeout.String() +
		"; data: " + netlimit.Limits{MaxConns: l.MaxDataConns, MaxConnsPerHost: l.MaxDataConnsPerHost}.String()
}

// ConnObserver is an optional interface of an Observer: it is told about
// the inbound control connections of every rank, for metrics. Its methods
// are called concurrently and must not block.
type ConnObserver interface {
	// ControlConnOpened: a control connection was accepted.
	ControlConnOpened()
	// ControlConnClosed: an accepted control connection closed (once per
	// ControlConnOpened).
	ControlConnClosed()
	// ControlConnRefused: a control connection was refused at accept
	// ("max_conns", "max_conns_per_host") or closed because it sent no
	// hello in time ("handshake_timeout").
	ControlConnRefused(reason string)
	// ControlConnIdleClosed: an accepted control connection was closed
	// after its idle timeout.
	ControlConnIdleClosed()
}

// Reasons of ControlConnRefused.
const (
	RefusedMaxConns         = netlimit.ReasonMaxConns
	RefusedMaxConnsPerHost  = netlimit.ReasonMaxConnsPerHost
	RefusedHandshakeTimeout = netlimit.ReasonHandshakeTimeout
)

// connObs adapts a ConnObserver (never nil: without one the control plane
// has no observer) to control.Observer.
type connObs struct{ o ConnObserver }

func (c connObs) Opened()               { c.o.ControlConnOpened() }
func (c connObs) Closed()               { c.o.ControlConnClosed() }
func (c connObs) Refused(reason string) { c.o.ControlConnRefused(reason) }
func (c connObs) IdleClosed()           { c.o.ControlConnIdleClosed() }
