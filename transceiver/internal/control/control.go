package control

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/accept"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// Errors of the control plane. They are the transceiver's own (it exports
// these values), hence their prefix.
var (
	// ErrPeerLost: the connection to the peer broke, or could not be made.
	ErrPeerLost = errors.New("transceiver: peer lost")
	// ErrRefused: the peer refused (here: the handshake).
	ErrRefused = errors.New("transceiver: refused")
	// ErrClosed: the Plane was closed.
	ErrClosed = errors.New("transceiver: closed")
)

// errIdle ends a connection closed for idleness.
var errIdle = errors.New("transceiver: control connection idle")

// frameTimeout bounds the arrival of a frame once its first byte has: a
// peer that starts a frame and stalls is gone (or hostile).
const frameTimeout = writeTimeout

// Observer is told about the accepted connections, for metrics. Its
// methods are called concurrently and must not block.
type Observer interface {
	// Opened: a connection was accepted.
	Opened()
	// Closed: an accepted connection closed (once per Opened).
	Closed()
	// Refused: a connection was refused at accept (netlimit's reasons) or
	// closed because it sent no hello in time
	// (netlimit.ReasonHandshakeTimeout).
	Refused(reason string)
	// IdleClosed: an accepted connection was closed after its idle timeout.
	IdleClosed()
}

// Limits bound the accepted connections. Timeouts <= 0 are none; the
// counts are netlimit's (0 or less: no bound).
type Limits struct {
	// MaxConns and MaxConnsPerHost bound the accepted connections, shaking
	// hands or not, in all and per remote IP address.
	MaxConns, MaxConnsPerHost int
	// HandshakeTimeout is how long an accepted connection may take to send
	// its hello.
	HandshakeTimeout time.Duration
	// IdleTimeout closes an accepted connection unused this long, a dialled
	// one unused 3/4 of it (see the package doc).
	IdleTimeout time.Duration
}

// dialIdle is how long a dialled connection is kept unused.
func (l Limits) dialIdle() time.Duration { return l.IdleTimeout * 3 / 4 }

// Config is what a Plane is built from.
type Config struct {
	// Listener is where peers connect; the Plane owns it from New on.
	Listener net.Listener
	// Name names the listener in logs ("control rank 0").
	Name   string
	Limits Limits
	// Observer may be nil.
	Observer Observer
	// Dial connects to a peer's endpoint (host:port), within ctx; nil
	// means TCP. Tests dial an in-memory network (internal/memnet), whose
	// waits a testing/synctest bubble sees as durably blocked.
	Dial func(ctx context.Context, endpoint string) (net.Conn, error)
	// Log takes the Plane's messages (refusals at a rate, idle closes).
	Log *slog.Logger
	// Hello is what this side tells of itself, in both directions; the
	// Plane sets its Version to wire.Version and never changes it.
	Hello wire.Hello
	// TLSServer, when not nil, makes every accepted connection a TLS server
	// connection; TLSClient, when not nil, runs TLS on every dialled one
	// (its ServerName, when empty, is the endpoint's host).
	TLSServer, TLSClient *tls.Config
	// AcceptOK, when not nil, decides whether to serve a connection from
	// remote (it logs its own refusals).
	AcceptOK func(remote net.Addr) bool
	// DialCheck, when not nil, is asked before any endpoint is dialled; its
	// error is Dial's.
	DialCheck func(endpoint string) error
}

// Handler is what the Plane hands its connections' events to (the
// transceiver's driver). See the package doc for when it is called.
type Handler interface {
	// Frame takes a frame that arrived on c after the handshake, but a
	// Ping, which the Plane answers itself; dialled tells which side c is
	// of. An error closes c (then Lost).
	Frame(c *Conn, f wire.Frame, dialled bool) error
	// Lost says that c has closed, and why (io.EOF: the peer closed it;
	// ErrClosed: the Plane closed). Called once per Conn the Handler or a
	// Dial has seen, after c has left the Plane (Conn(c.ID()) is nil).
	Lost(c *Conn, err error)
	// Busy reports whether c carries work of the Handler: it is then not
	// idle, however long since a frame.
	Busy(c *Conn) bool
}

// Plane is one rank's control connections. New builds it, Start runs its
// accept loop, Close ends it.
type Plane struct {
	cfg      Config
	h        Handler
	ln       *netlimit.Listener
	refusals *netlimit.RateLog // connections dropped at their handshake
	obs      Observer
	hello    wire.Hello

	wg   sync.WaitGroup  // every goroutine of the Plane
	life context.Context // ends at Close: bounds dials and handshakes
	stop context.CancelFunc

	mu     sync.Mutex
	closed bool
	dialed map[string]*dialEntry // per endpoint dialled (or being dialled)
	conns  map[uint64]*Conn
	nextID uint64
}

type dialEntry struct {
	ready chan struct{} // closed when conn/err are set
	conn  *Conn
	err   error
}

type nopObserver struct{}

func (nopObserver) Opened()        {}
func (nopObserver) Closed()        {}
func (nopObserver) Refused(string) {}
func (nopObserver) IdleClosed()    {}

// New builds a Plane on cfg.Listener; it starts no goroutine.
func New(cfg Config, h Handler) *Plane {
	obs := cfg.Observer
	if obs == nil {
		obs = nopObserver{}
	}
	refusals := netlimit.NewRateLog(cfg.Log, time.Second)
	var ln net.Listener = cfg.Listener
	if cfg.TLSServer != nil {
		ln = &tlsListener{Listener: ln, cfg: cfg.TLSServer, log: refusals}
	}
	life, stop := context.WithCancel(context.Background())
	p := &Plane{
		cfg: cfg, h: h, obs: obs, life: life, stop: stop,
		ln:       netlimit.NewListener(ln, cfg.Name, netlimit.Limits{MaxConns: cfg.Limits.MaxConns, MaxConnsPerHost: cfg.Limits.MaxConnsPerHost}, cfg.Log, obs),
		refusals: refusals,
		dialed:   map[string]*dialEntry{}, conns: map[uint64]*Conn{},
	}
	p.hello = cfg.Hello
	p.hello.Version = wire.Version
	return p
}

// Endpoint returns the listener's address.
func (p *Plane) Endpoint() string { return p.ln.Addr().String() }

// Start runs the accept loop, until Close.
func (p *Plane) Start() {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		accept.Loop("control listener", p.cfg.Log, p.life.Done(), p.ln.Accept, p.admit)
	}()
}

// Conn returns the open connection id names; nil when it is gone.
func (p *Plane) Conn(id uint64) *Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conns[id]
}

// Len returns the number of open connections, dialled and accepted.
func (p *Plane) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Dialled returns the number of endpoints in the dial cache (connected or
// being dialled).
func (p *Plane) Dialled() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.dialed)
}

// Close closes the listener and every connection (each Lost with
// ErrClosed), interrupts the dials in progress and waits for every
// goroutine of the Plane. It returns the listener's close error; a second
// Close does nothing and returns nil.
func (p *Plane) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.mu.Lock()
	conns := make([]*Conn, 0, len(p.conns))
	for _, c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.close(ErrClosed)
	}
	p.stop()
	p.wg.Wait()
	return err
}

// admit starts serving an accepted connection, or refuses it; it reports
// false once the Plane has closed.
func (p *Plane) admit(nc net.Conn) bool {
	if p.cfg.AcceptOK != nil && !p.cfg.AcceptOK(nc.RemoteAddr()) {
		nc.Close()
		return true
	}
	c := newConn(nc, false)
	c.peer.Endpoint = nc.RemoteAddr().String()
	c.Touch()
	if !p.track(c) {
		nc.Close()
		return false
	}
	p.wg.Add(1)
	go p.serve(c)
	return true
}

// track gives c its id and records it, unless the Plane is closed.
func (p *Plane) track(c *Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.nextID++
	c.id = p.nextID
	p.conns[c.id] = c
	return true
}

// serve reads the frames of c until it breaks, closes or stays idle. An
// accepted connection first shakes hands, and is idle after the idle
// timeout; a dialled one (its handshake done by connect) after 3/4 of it.
func (p *Plane) serve(c *Conn) {
	defer p.wg.Done()
	var err error
	idle := p.cfg.Limits.IdleTimeout
	if c.dialled {
		idle = p.cfg.Limits.dialIdle()
	} else if err = p.acceptHello(c); errors.Is(err, os.ErrDeadlineExceeded) {
		p.obs.Refused(netlimit.ReasonHandshakeTimeout)
		p.refusals.Warn(netlimit.ReasonHandshakeTimeout, "control connection closed: no hello in time",
			"remote", c.peer.Endpoint, "timeout", p.cfg.Limits.HandshakeTimeout)
	}
	for err == nil {
		var f wire.Frame
		if f, err = p.nextFrame(c, idle); err != nil {
			break
		}
		if ping, ok := f.(*wire.Ping); ok { // the Plane's own: answered here
			err = c.Send(&wire.Pong{Nonce: ping.Nonce})
		} else {
			err = p.h.Frame(c, f, c.dialled)
		}
	}
	switch {
	case errors.Is(err, errIdle) && c.dialled:
		p.cfg.Log.Debug("dialled control connection closed: idle", "endpoint", c.peer.Endpoint)
	case errors.Is(err, errIdle):
		p.obs.IdleClosed()
		p.cfg.Log.Debug("control connection closed: idle", "remote", c.peer.Endpoint, "idle_timeout", idle)
	case errors.Is(err, net.ErrClosed) && c.dialled:
		err = ErrClosed
	}
	p.lost(c, err)
}

// lost closes c, forgets it, and tells the Handler.
func (p *Plane) lost(c *Conn, err error) {
	if err == nil || errors.Is(err, io.EOF) {
		err = io.EOF
	}
	c.close(err)
	p.mu.Lock()
	delete(p.conns, c.id)
	for ep, d := range p.dialed {
		select {
		case <-d.ready:
			if d.conn == c {
				delete(p.dialed, ep)
			}
		default:
		}
	}
	p.mu.Unlock()
	p.h.Lost(c, err)
}

// acceptHello shakes hands on an accepted connection: the peer's hello
// within the handshake timeout, then this side's.
func (p *Plane) acceptHello(c *Conn) error {
	stop := interruptAfter(c, p.cfg.Limits.HandshakeTimeout)
	f, err := wire.Read(c.br)
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
		c.Send(&wire.Refused{Code: wire.RefusedVersion, Reason: reason})
		return errors.New(reason)
	}
	// The accepting side keeps the peer's rank and host, and none of the
	// rest, which it never reads: a stranger's hello carries up to about
	// 140 KiB of state, backends and endpoints of its choosing, which the
	// connection would hold until it closes.
	c.peer.Rank, c.peer.Host = int(h.Rank), h.Host
	c.Touch()
	return c.Send(&p.hello)
}

// interruptAfter makes a read of c fail with os.ErrDeadlineExceeded once d
// has passed (never when d <= 0). stop clears the deadline: once it
// returns, c reads as before.
func interruptAfter(c *Conn, d time.Duration) (stop func()) {
	if d <= 0 {
		return func() {}
	}
	c.c.SetReadDeadline(time.Now().Add(d))
	return func() { c.c.SetReadDeadline(time.Time{}) }
}

// nextFrame reads c's next frame. Between frames it waits for the first
// byte at most idle (no bound when idle <= 0); when that passes without the
// connection having been idle all along (see idleLeft), it waits on.
//
// Each deadline set costs the runtime a timer update, and a frame of a
// busy connection is often in the buffer already: the idle wait is set
// only when the buffer is empty, and the frame's own deadline replaces it
// without clearing it first.
func (p *Plane) nextFrame(c *Conn, idle time.Duration) (wire.Frame, error) {
	wait := idle
	for c.br.Buffered() == 0 {
		if wait > 0 {
			c.c.SetReadDeadline(time.Now().Add(wait))
		} else {
			c.c.SetReadDeadline(time.Time{}) // the last frame's
		}
		_, err := c.br.Peek(1)
		if err == nil {
			break
		}
		if idle <= 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
		if wait = p.idleLeft(c, idle); wait <= 0 {
			return nil, errIdle
		}
	}
	c.c.SetReadDeadline(time.Now().Add(frameTimeout))
	f, err := wire.Read(c.br)
	c.Touch()
	return f, err
}

// idleLeft returns how much longer c must stay unused to have been idle
// for d: d while a caller of Dial holds it or the Handler has work on it,
// 0 when it is idle. A dialled connection found idle leaves the dial cache
// at once, so that nobody takes it any more.
//
// The Handler is asked without p.mu held (it takes its own lock, which
// may be held around Plane.Conn). A Dial that takes c meanwhile, and so
// any work the Handler starts on it, shows in c.takes, checked again.
func (p *Plane) idleLeft(c *Conn, d time.Duration) time.Duration {
	p.mu.Lock()
	if c.users > 0 {
		p.mu.Unlock()
		return d
	}
	takes := c.takes
	p.mu.Unlock()
	if p.h.Busy(c) {
		return d
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if c.users > 0 || c.takes != takes {
		return d
	}
	if left := d - time.Since(c.lastUse()); left > 0 {
		return left
	}
	if de := p.dialed[c.peer.Endpoint]; c.dialled && de != nil && de.conn == c {
		delete(p.dialed, c.peer.Endpoint)
	}
	return 0
}

// Dial returns the connection to a context rank's endpoint, connecting and
// shaking hands on first use. Concurrent callers for one endpoint share one
// attempt. The connection is the caller's to use until it calls release
// (once): meanwhile it is not closed as idle. A cached connection that was
// closed (idle, lost) is replaced by a new one. Dial fails with
// Config.DialCheck's error, ctx's cause, ErrClosed, or the attempt's error
// (ErrPeerLost, ErrRefused, wire.ErrMalformed).
func (p *Plane) Dial(ctx context.Context, endpoint string) (c *Conn, release func(), err error) {
	if p.cfg.DialCheck != nil {
		if err := p.cfg.DialCheck(endpoint); err != nil {
			return nil, nil, err
		}
	}
	for {
		d, err := p.dialEntry(ctx, endpoint)
		if err != nil {
			return nil, nil, err
		}
		select {
		case <-d.ready:
		case <-ctx.Done():
			return nil, nil, context.Cause(ctx)
		}
		if d.err != nil {
			return nil, nil, d.err
		}
		p.mu.Lock()
		if p.dialed[endpoint] == d {
			if !d.conn.isDead() {
				c := d.conn
				c.users++
				c.takes++
				p.mu.Unlock()
				var once sync.Once
				return c, func() { once.Do(func() { p.release(c) }) }, nil
			}
			delete(p.dialed, endpoint) // before lost gets to it
		}
		p.mu.Unlock()
	}
}

// Cached is Dial without the wait: the connection to endpoint when the
// dial cache holds a live one, with its release, and ok false (nothing
// taken, nothing dialled) otherwise, so that a caller may ask on the
// goroutine it runs on when no dial is needed and hand the dial to
// another goroutine when one is. Config.DialCheck's error is returned as
// Dial returns it.
func (p *Plane) Cached(endpoint string) (c *Conn, release func(), ok bool, err error) {
	if p.cfg.DialCheck != nil {
		if err := p.cfg.DialCheck(endpoint); err != nil {
			return nil, nil, false, err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, nil, false, ErrClosed
	}
	d := p.dialed[endpoint]
	if d == nil {
		return nil, nil, false, nil
	}
	select {
	case <-d.ready:
	default:
		return nil, nil, false, nil // being dialled
	}
	if d.err != nil || d.conn.isDead() {
		return nil, nil, false, nil
	}
	c = d.conn
	c.users++
	c.takes++
	var once sync.Once
	return c, func() { once.Do(func() { p.release(c) }) }, true, nil
}

// release ends a use of c that Dial started.
func (p *Plane) release(c *Conn) {
	p.mu.Lock()
	c.users--
	c.Touch()
	p.mu.Unlock()
}

// dialEntry returns the dial cache's entry for endpoint, starting a
// connection attempt when there is none.
func (p *Plane) dialEntry(ctx context.Context, endpoint string) (*dialEntry, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	d, ok := p.dialed[endpoint]
	if !ok {
		d = &dialEntry{ready: make(chan struct{})}
		p.dialed[endpoint] = d
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			d.conn, d.err = p.connect(endpoint)
			if d.err != nil {
				p.mu.Lock()
				if p.dialed[endpoint] == d {
					delete(p.dialed, endpoint)
				}
				p.mu.Unlock()
			}
			close(d.ready)
		}()
	}
	return d, nil
}

// connect dials and shakes hands. It is bounded by writeTimeout so that a
// dead endpoint does not hold the dial slot forever.
func (p *Plane) connect(endpoint string) (*Conn, error) {
	dctx, cancel := context.WithTimeout(p.life, writeTimeout)
	nc, err := p.dial(dctx, endpoint)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("%w: dial context rank at %s: %v", ErrPeerLost, endpoint, err)
	}
	// Closing the Plane interrupts a handshake in progress.
	raw := nc
	stop := context.AfterFunc(p.life, func() { raw.SetDeadline(time.Now()) })
	defer stop()
	if p.cfg.TLSClient != nil {
		hctx, cancel := context.WithTimeout(p.life, writeTimeout)
		nc, err = dialTLS(hctx, nc, p.cfg.TLSClient, endpoint)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w: TLS handshake with context rank at %s: %v", ErrPeerLost, endpoint, err)
		}
	}
	c := newConn(nc, true)
	c.peer.Endpoint = endpoint
	if err := p.dialHello(c); err != nil {
		nc.Close()
		return nil, err
	}
	c.Touch()
	if !p.track(c) {
		nc.Close()
		return nil, ErrClosed
	}
	p.wg.Add(1)
	go p.serve(c)
	return c, nil
}

// dial connects to endpoint with Config.Dial, or over TCP.
func (p *Plane) dial(ctx context.Context, endpoint string) (net.Conn, error) {
	if p.cfg.Dial != nil {
		return p.cfg.Dial(ctx, endpoint)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", endpoint)
}

// dialHello shakes hands on a dialled connection: this side's hello, then
// the peer's (or its refusal) within writeTimeout.
func (p *Plane) dialHello(c *Conn) error {
	endpoint := c.peer.Endpoint
	if err := c.Send(&p.hello); err != nil {
		return err
	}
	c.c.SetReadDeadline(time.Now().Add(writeTimeout))
	f, err := wire.Read(c.br)
	c.c.SetReadDeadline(time.Time{})
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return fmt.Errorf("%w: handshake with %s: %v (closed before its hello: refused by the peer's connection limits, or gone)", ErrPeerLost, endpoint, err)
		}
		return fmt.Errorf("%w: handshake with %s: %v", ErrPeerLost, endpoint, err)
	}
	switch h := f.(type) {
	case *wire.Hello:
		c.peer.fromHello(h)
		return nil
	case *wire.Refused:
		return fmt.Errorf("%w by %s: %s", ErrRefused, endpoint, h.Reason)
	}
	return fmt.Errorf("%w: handshake with %s: got %s", wire.ErrMalformed, endpoint, f.Type())
}
