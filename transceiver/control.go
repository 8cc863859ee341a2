package transceiver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/accept"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// Control connections of a rank: the ones it accepts (from generation
// ranks that pull from it) and the ones it dials (to context ranks it
// pulls from, cached per endpoint), their handshake, their reader and
// their idle accounting. Each has one reader goroutine (serve), which hands
// the frames to the requests (rank.frame).

type dialEntry struct {
	ready chan struct{} // closed when conn/err are set
	conn  *ctrlConn
	err   error
}

func (r *rank) endpoint() string { return r.ln.Addr().String() }

func (r *rank) backendNames() []string {
	names := make([]string, 0, len(r.transports))
	for n := range r.transports {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// backendEndpoints returns the data-plane endpoint of each backend, in the
// order of backendNames.
func (r *rank) backendEndpoints() []string {
	names := r.backendNames()
	eps := make([]string, len(names))
	for i, n := range names {
		eps[i] = r.transports[n].Endpoint()
	}
	return eps
}

// hello is what the rank tells of itself when a control connection opens,
// in either direction.
func (r *rank) hello() *wire.Hello {
	st, _ := r.state.MarshalBinary()
	return &wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.backendNames(), Endpoints: r.backendEndpoints()}
}

// start runs the accept loop.
func (r *rank) start() {
	r.wg.Add(1)
	go r.acceptLoop()
}

// acceptLoop accepts control connections within the rank's limits (the
// listener closes the others at once) until the listener closes.
func (r *rank) acceptLoop() {
	defer r.wg.Done()
	accept.Loop("control listener", r.log, r.life.Done(), r.ln.Accept, r.admitConn)
}

// admitConn starts serving an accepted control connection, or refuses it; it
// reports false once the rank has closed.
func (r *rank) admitConn(c net.Conn) bool {
	if !r.set.peers.acceptOK(c.RemoteAddr()) {
		r.set.peers.logRefusal(r.log, c.RemoteAddr())
		c.Close()
		return true
	}
	if tc, ok := netlimit.Unwrap(c).(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	cc := newCtrlConn(c, r.set.clock.Now)
	cc.peer.endpoint = c.RemoteAddr().String()
	cc.touch()
	if !r.track(cc) {
		c.Close()
		return false
	}
	r.wg.Add(1)
	go r.serve(cc, false)
	return true
}

// track gives cc its id and records it, unless the rank is closed.
func (r *rank) track(cc *ctrlConn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.nextConn++
	cc.id = r.nextConn
	r.conns[cc.id] = cc
	return true
}

// serve reads the frames of control connection cc until it breaks, closes
// or stays idle. An accepted connection first shakes hands, and is idle
// after the idle timeout; one this rank dialled (its handshake done by
// connect) after 3/4 of it, before the peer's own timeout closes it (see
// ConnLimits).
func (r *rank) serve(cc *ctrlConn, dialled bool) {
	defer r.wg.Done()
	var err error
	idle := r.set.limits.IdleTimeout
	if dialled {
		idle = r.set.limits.dialIdle()
	} else if err = r.acceptHello(cc); errors.Is(err, os.ErrDeadlineExceeded) {
		r.set.conns.Refused(RefusedHandshakeTimeout)
		r.refusals.Warn(RefusedHandshakeTimeout, "control connection closed: no hello in time", "rank", r.idx,
			"remote", cc.peer.endpoint, "timeout", r.set.limits.HandshakeTimeout)
	}
	for err == nil {
		var f wire.Frame
		if f, err = r.nextFrame(cc, idle, dialled); err == nil {
			err = r.frame(cc, f, dialled)
		}
	}
	switch {
	case errors.Is(err, errIdle) && dialled:
		r.log.Debug("dialled control connection closed: idle", "endpoint", cc.peer.endpoint)
	case errors.Is(err, errIdle):
		r.set.conns.idleClosed()
		r.log.Debug("control connection closed: idle", "remote", cc.peer.endpoint, "idle_timeout", idle)
	case errors.Is(err, net.ErrClosed) && dialled:
		err = ErrClosed
	}
	r.connLost(cc, err)
}

// acceptHello shakes hands on an accepted connection: the peer's hello
// within the handshake timeout, then this rank's.
func (r *rank) acceptHello(cc *ctrlConn) error {
	stop := r.interruptAfter(cc, r.set.limits.HandshakeTimeout)
	f, err := wire.Read(cc.br)
	stop()
	if err != nil {
		return fmt.Errorf("handshake: %w", err)
	}
	h, ok := f.(*wire.Hello)
	if !ok {
		return fmt.Errorf("%w: handshake: want hello, got %s", wire.ErrMalformed, f.Type())
	}
	if h.Version != wire.Version {
		reason := fmt.Sprintf("control protocol version %d, this context rank speaks %d", h.Version, wire.Version)
		cc.send(&wire.Refused{Code: wire.RefusedVersion, Reason: reason})
		return errors.New(reason)
	}
	cc.peer.fromHello(h)
	cc.touch()
	return cc.send(r.hello())
}

// interruptAfter makes a read of cc in progress, or the next one, fail
// with os.ErrDeadlineExceeded once d has passed on the rank's clock (never
// when d <= 0). The handshake and idle timeouts are kept this way, rather
// than as socket deadlines, so that a test's clock passes them. stop
// disarms it and clears the interruption: once it returns, cc reads as
// before.
func (r *rank) interruptAfter(cc *ctrlConn, d time.Duration) (stop func()) {
	if d <= 0 {
		return func() {}
	}
	var mu sync.Mutex
	armed := true
	disarm := r.set.clock.AfterFunc(d, func() {
		mu.Lock()
		defer mu.Unlock()
		if armed {
			cc.c.SetReadDeadline(time.Unix(1, 0)) // in the past: the read returns at once
		}
	})
	return func() {
		mu.Lock()
		armed = false
		mu.Unlock()
		if !disarm() {
			cc.c.SetReadDeadline(time.Time{}) // it fired: clear it
		}
	}
}

// errIdle ends a control connection closed for idleness.
var errIdle = errors.New("transceiver: control connection idle")

// frameTimeout bounds the arrival of a frame once its first byte has: a
// peer that starts a frame and stalls is gone (or hostile).
const frameTimeout = writeTimeout

// nextFrame reads cc's next frame. Between frames it waits for the first
// byte at most idle (no bound when idle <= 0); when that passes without the
// connection having been idle all along (see idleLeft), it waits on.
func (r *rank) nextFrame(cc *ctrlConn, idle time.Duration, dialled bool) (wire.Frame, error) {
	wait := idle
	for {
		cc.c.SetReadDeadline(time.Time{}) // the last frame's
		stop := r.interruptAfter(cc, wait)
		_, err := cc.br.Peek(1)
		stop()
		if err == nil {
			break
		}
		if idle <= 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
		if wait = r.idleLeft(cc, idle, dialled); wait <= 0 {
			return nil, errIdle
		}
	}
	cc.c.SetReadDeadline(time.Now().Add(frameTimeout))
	f, err := wire.Read(cc.br)
	cc.touch()
	return f, err
}

// idleLeft returns how much longer cc must stay unused to have been idle
// for d: d while a request has a peer on it or a caller of dial holds it,
// 0 when it is idle. A dialled connection found idle leaves the dial cache
// at once, so that nobody takes it any more.
func (r *rank) idleLeft(cc *ctrlConn, d time.Duration, dialled bool) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cc.users > 0 {
		return d
	}
	for _, q := range r.reqs {
		if slices.Contains(q.core.conns(), cc.id) {
			return d
		}
	}
	if left := d - r.set.clock.Now().Sub(cc.lastUse()); left > 0 {
		return left
	}
	if de := r.dialed[cc.peer.endpoint]; dialled && de != nil && de.conn == cc {
		delete(r.dialed, cc.peer.endpoint)
	}
	return 0
}

// dial returns the control connection to a context rank's endpoint,
// connecting and shaking hands on first use. Concurrent callers for one
// endpoint share one attempt. The connection is the caller's to use until it
// calls undial: meanwhile it is not closed as idle. A cached connection that
// was closed (idle, lost) is replaced by a new one.
func (r *rank) dial(ctx context.Context, endpoint string) (*ctrlConn, error) {
	// RequestAndReceiveAsync has checked every endpoint already; this is
	// the one place that dials, so the rule is enforced here too.
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil, fmt.Errorf("%w: endpoint %q is not host:port", ErrBadOpaqueState, endpoint)
	}
	if err := r.set.peers.dialCheck(host); err != nil {
		return nil, err
	}
	for {
		d, err := r.dialEntry(ctx, endpoint)
		if err != nil {
			return nil, err
		}
		select {
		case <-d.ready:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		if d.err != nil {
			return nil, d.err
		}
		r.mu.Lock()
		if r.dialed[endpoint] == d {
			if !d.conn.isDead() {
				d.conn.users++
				r.mu.Unlock()
				return d.conn, nil
			}
			delete(r.dialed, endpoint) // before connLost gets to it
		}
		r.mu.Unlock()
	}
}

// undial ends a use of cc that dial started.
func (r *rank) undial(cc *ctrlConn) {
	r.mu.Lock()
	cc.users--
	cc.touch()
	r.mu.Unlock()
}

// dialEntry returns the dial cache's entry for endpoint, starting a
// connection attempt when there is none.
func (r *rank) dialEntry(ctx context.Context, endpoint string) (*dialEntry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	d, ok := r.dialed[endpoint]
	if !ok {
		d = &dialEntry{ready: make(chan struct{})}
		r.dialed[endpoint] = d
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			d.conn, d.err = r.connect(endpoint)
			if d.err != nil {
				r.mu.Lock()
				if r.dialed[endpoint] == d {
					delete(r.dialed, endpoint)
				}
				r.mu.Unlock()
			}
			close(d.ready)
		}()
	}
	return d, nil
}

// connect dials and shakes hands. It is bounded by writeTimeout so that a
// dead endpoint does not hold the dial slot forever.
func (r *rank) connect(endpoint string) (*ctrlConn, error) {
	dl := net.Dialer{Timeout: writeTimeout}
	c, err := dl.DialContext(r.life, "tcp", endpoint)
	if err != nil {
		return nil, fmt.Errorf("%w: dial context rank at %s: %v", ErrPeerLost, endpoint, err)
	}
	// Closing the rank interrupts a handshake in progress.
	raw := c
	stop := context.AfterFunc(r.life, func() { raw.SetDeadline(time.Now()) })
	defer stop()
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if r.set.tls != nil {
		hctx, cancel := context.WithTimeout(r.life, writeTimeout)
		c, err = dialTLS(hctx, c, r.set.tls, endpoint)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w: TLS handshake with context rank at %s: %v", ErrPeerLost, endpoint, err)
		}
	}
	cc := newCtrlConn(c, r.set.clock.Now)
	cc.peer.endpoint = endpoint
	if err := r.dialHello(cc); err != nil {
		c.Close()
		return nil, err
	}
	cc.touch()
	if !r.track(cc) {
		c.Close()
		return nil, ErrClosed
	}
	r.wg.Add(1)
	go r.serve(cc, true)
	return cc, nil
}

// dialHello shakes hands on a dialled connection: this rank's hello, then
// the peer's (or its refusal) within writeTimeout.
func (r *rank) dialHello(cc *ctrlConn) error {
	endpoint := cc.peer.endpoint
	if err := cc.send(r.hello()); err != nil {
		return err
	}
	cc.c.SetReadDeadline(time.Now().Add(writeTimeout))
	f, err := wire.Read(cc.br)
	cc.c.SetReadDeadline(time.Time{})
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return fmt.Errorf("%w: handshake with %s: %v (closed before its hello: refused by the peer's connection limits, or gone)", ErrPeerLost, endpoint, err)
		}
		return fmt.Errorf("%w: handshake with %s: %v", ErrPeerLost, endpoint, err)
	}
	switch h := f.(type) {
	case *wire.Hello:
		cc.peer.fromHello(h)
		return nil
	case *wire.Refused:
		return fmt.Errorf("%w by %s: %s", ErrRefused, endpoint, h.Reason)
	}
	return fmt.Errorf("%w: handshake with %s: got %s", wire.ErrMalformed, endpoint, f.Type())
}

// chooseBackend picks the data plane for a pair: the configured one, or
// with AUTO shm with a peer on this host that it reaches, else ucx, else
// tcp.
func (r *rank) chooseBackend(cc *ctrlConn) (string, error) {
	has := func(name string) bool {
		_, mine := r.transports[name]
		return mine && slices.Contains(cc.peer.backends, name)
	}
	if r.set.backend != "auto" {
		if !has(r.set.backend) {
			return "", fmt.Errorf("%w: backend %s: context rank %d at %s has %v open, this rank %v",
				transport.ErrNotBuilt, r.set.backend, cc.peer.rank, cc.peer.endpoint, cc.peer.backends, r.backendNames())
		}
		return r.set.backend, nil
	}
	for _, b := range autoOrder() {
		switch {
		case !has(b):
		case b != "shm":
			return b, nil
		case cc.peer.host == r.set.host:
			err := r.probeShm(cc)
			if err == nil {
				return b, nil
			}
			r.log.Info("shm not usable with this peer, falling back", "peer", cc.peer.endpoint, "peer_rank", cc.peer.rank, "reason", err)
		}
	}
	return "", fmt.Errorf("no backend in common with context rank %d at %s (it has %v, this rank %v)", cc.peer.rank, cc.peer.endpoint, cc.peer.backends, r.backendNames())
}

// probeShm checks once per control connection that this rank can reach
// the peer's shm endpoint and map memory with it (same host and namespace,
// working memory files); the answer is cached on the connection.
func (r *rank) probeShm(cc *ctrlConn) error {
	cc.probeOnce.Do(func() {
		i := slices.Index(cc.peer.backends, "shm")
		if i < 0 || i >= len(cc.peer.endpoints) {
			cc.probeErr = fmt.Errorf("the peer announced no shm endpoint")
			return
		}
		// The receiving side probes in the direction of the data: ask our
		// shm transport to reach the peer's (both directions need the same
		// host and namespace).
		p, ok := r.transports["shm"].(transport.Prober)
		if !ok {
			cc.probeErr = fmt.Errorf("the shm backend cannot probe")
			return
		}
		ctx, cancel := context.WithTimeout(r.life, 5*time.Second)
		defer cancel()
		cc.probeErr = p.Probe(ctx, cc.peer.endpoints[i])
	})
	return cc.probeErr
}
