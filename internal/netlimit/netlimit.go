package netlimit

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// Reasons a connection is refused or dropped, as logs and metrics label
// them.
const (
	ReasonMaxConns         = "max_conns"          // the listener's total cap
	ReasonMaxConnsPerHost  = "max_conns_per_host" // the cap of the remote host
	ReasonHandshakeTimeout = "handshake_timeout"  // no handshake in time (reported by the protocol)
)

// Limits bound the connections a Listener keeps open at once. A value of 0
// or less means no bound.
type Limits struct {
	// MaxConns bounds the listener's open connections.
	MaxConns int
	// MaxConnsPerHost bounds the open connections from one remote IP
	// address (all of a Unix socket's peers count as one host).
	MaxConnsPerHost int
}

// Observer is told about a Listener's connections, for metrics. Its
// methods are called from Accept and from Close of the connections,
// concurrently, and must not block.
type Observer interface {
	// Opened: a connection was accepted within the limits.
	Opened()
	// Closed: an accepted connection was closed (once per Opened).
	Closed()
	// Refused: a connection was refused, for reason (ReasonMaxConns,
	// ReasonMaxConnsPerHost).
	Refused(reason string)
}

// Listener wraps a net.Listener: Accept returns only connections within
// its Limits and closes the others at once (with a TCP reset, so that the
// refusal leaves no TIME_WAIT behind), logging the refusals through a
// RateLog. A connection it returns frees its place when closed.
type Listener struct {
	net.Listener
	lim  Limits
	name string
	obs  Observer
	rl   *RateLog

	mu      sync.Mutex
	open    int
	perHost map[netip.Addr]int
}

// NewListener wraps ln. name says which listener it is in logs ("worker
// http", "control rank 0"); log receives the refusals (nil: none); obs may
// be nil.
func NewListener(ln net.Listener, name string, lim Limits, log *slog.Logger, obs Observer) *Listener {
	return &Listener{Listener: ln, lim: lim, name: name, obs: obs, rl: NewRateLog(log, time.Second),
		perHost: map[netip.Addr]int{}}
}

// Accept waits for the next connection within the limits. Connections
// beyond them are closed and not returned. It returns the wrapped
// listener's errors as they are.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		host := HostOf(c.RemoteAddr())
		if reason := l.admit(host); reason != "" {
			// Counted before the close, so that whoever sees the refused
			// connection end also sees it counted.
			if l.obs != nil {
				l.obs.Refused(reason)
			}
			refuse(c)
			l.rl.Warn(reason, "connection refused", "listener", l.name, "reason", reason,
				"remote", c.RemoteAddr().String(), "limit", l.limitOf(reason))
			continue
		}
		if l.obs != nil {
			l.obs.Opened()
		}
		return &conn{Conn: c, l: l, host: host}, nil
	}
}

// admit takes a place for a connection from host, or says why not.
func (l *Listener) admit(host netip.Addr) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lim.MaxConns > 0 && l.open >= l.lim.MaxConns {
		return ReasonMaxConns
	}
	if l.lim.MaxConnsPerHost > 0 && l.perHost[host] >= l.lim.MaxConnsPerHost {
		return ReasonMaxConnsPerHost
	}
	l.open++
	l.perHost[host]++
	return ""
}

func (l *Listener) release(host netip.Addr) {
	l.mu.Lock()
	l.open--
	if l.perHost[host]--; l.perHost[host] <= 0 {
		delete(l.perHost, host)
	}
	l.mu.Unlock()
	if l.obs != nil {
		l.obs.Closed()
	}
}

func (l *Listener) limitOf(reason string) int {
	if reason == ReasonMaxConns {
		return l.lim.MaxConns
	}
	return l.lim.MaxConnsPerHost
}

// Open returns the number of connections accepted and not yet closed.
func (l *Listener) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open
}

// Limits returns the listener's limits.
func (l *Listener) Limits() Limits { return l.lim }

// conn is an accepted connection; Close frees its place once.
type conn struct {
	net.Conn
	l        *Listener
	host     netip.Addr
	closeOne sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.closeOne.Do(func() { c.l.release(c.host) })
	return err
}

// NetConn returns the connection Accept wrapped (as tls.Conn's does).
func (c *conn) NetConn() net.Conn { return c.Conn }

// Unwrap returns the connection under c when c is one a Listener returned,
// else c itself.
func Unwrap(c net.Conn) net.Conn {
	if w, ok := c.(*conn); ok {
		return w.Conn
	}
	return c
}

// refuse closes c at once; a TCP connection with a reset (SO_LINGER 0).
func refuse(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}

// HostOf returns the IP address of a remote address (IPv4-mapped IPv6
// addresses as IPv4); the zero Addr for addresses without one (Unix
// sockets), which are all one host.
func HostOf(a net.Addr) netip.Addr {
	switch a := a.(type) {
	case *net.TCPAddr:
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			return ip.Unmap()
		}
	case *net.UDPAddr:
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			return ip.Unmap()
		}
	}
	return netip.Addr{}
}

// RateLog writes warnings, at most one line per key per interval, with the
// count of those it left out: the first warning of a key is written at
// once; the others within the interval are counted, and one line at the
// interval's end repeats the latest of them with "suppressed" (their count)
// and "interval". A steady stream of one cause is therefore one line per
// interval, and a burst two lines, however long it is. The zero RateLog,
// and one with a nil logger, writes nothing. Safe for concurrent use.
type RateLog struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time
	// after runs f after d (time.AfterFunc; replaced in tests).
	after func(d time.Duration, f func())

	mu   sync.Mutex
	keys map[string]*rateKey
}

type rateKey struct {
	last       time.Time
	suppressed int
	armed      bool   // a summary line is due at the interval's end
	msg        string // the latest suppressed warning
	args       []any
}

// NewRateLog returns a RateLog that writes to log at most once per key
// per interval every. It starts no goroutine: a summary line is written by
// a timer armed when a warning is first left out in an interval.
func NewRateLog(log *slog.Logger, every time.Duration) *RateLog {
	return &RateLog{log: log, every: every, now: time.Now, keys: map[string]*rateKey{},
		after: func(d time.Duration, f func()) { time.AfterFunc(d, f) }}
}

// maxKeys bounds the keys a RateLog remembers; past it, it forgets them
// all (a key is a reason, not a remote address, so this is a safety net).
const maxKeys = 1024

// Warn logs msg with args at level Warn unless a line of key was logged
// less than the interval ago; then it is counted, and the interval's
// summary line repeats it with the count.
func (r *RateLog) Warn(key, msg string, args ...any) {
	if r == nil || r.log == nil {
		return
	}
	now := r.now()
	r.mu.Lock()
	k := r.keys[key]
	if k == nil {
		if len(r.keys) >= maxKeys {
			clear(r.keys)
		}
		k = &rateKey{}
		r.keys[key] = k
	} else if since := now.Sub(k.last); since < r.every {
		k.suppressed++
		k.msg, k.args = msg, args
		if !k.armed {
			k.armed = true
			r.after(r.every-since, func() { r.summarize(k) })
		}
		r.mu.Unlock()
		return
	}
	n := k.suppressed
	k.last, k.suppressed = now, 0
	r.mu.Unlock()
	if n > 0 {
		args = append(slices.Clip(args), "suppressed", n)
	}
	r.log.Warn(msg, args...)
}

// summarize writes the line that counts the warnings of k left out in the
// interval that just ended, unless a later Warn already did.
func (r *RateLog) summarize(k *rateKey) {
	r.mu.Lock()
	k.armed = false
	n, msg, args := k.suppressed, k.msg, k.args
	if n == 0 {
		r.mu.Unlock()
		return
	}
	k.last, k.suppressed, k.msg, k.args = r.now(), 0, "", nil
	r.mu.Unlock()
	r.log.Warn(msg, append(slices.Clip(args), "suppressed", n, "interval", r.every)...)
}

// String describes l for logs: "127.0.0.1:8001 (max 4096 connections, 1024 per host)".
func (l *Listener) String() string {
	return fmt.Sprintf("%s (%s)", l.Addr(), l.lim)
}

// String describes the limits: "max 4096 connections, 1024 per host".
func (lim Limits) String() string {
	f := func(n int) string {
		if n <= 0 {
			return "unbounded"
		}
		return fmt.Sprint(n)
	}
	return "max " + f(lim.MaxConns) + " connections, " + f(lim.MaxConnsPerHost) + " per host"
}
